"""`unbubble train` end to end in-process: real text, run folder, bad input."""

import json
import logging

import pytest
import torch
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.config import TrainConfig
from unbubble.train import train


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_short_real_text_run_lowers_validation_loss(tmp_path, cache_dir):
    cfg = TrainConfig(engine="emulator", steps=30, eval_interval=15, eval_batches=4, run_dir=str(tmp_path / "run"),
                      cache_dir=cache_dir)
    result, run_dir = train(cfg)
    (v0, first), (_, mid), (v_end, last) = result.val_losses
    assert (v0, v_end) == (0, 30)
    assert first == pytest.approx(5.55, abs=0.1)  # ≈ ln(257): untrained byte model
    assert last < first - 2.0  # KJV bytes: the model learns at least the unigram statistics
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["max_drift"] == [1, 1, 1, 0] == summary["drift_bound"]
    assert summary["final_val_loss"] == pytest.approx(last)
    # the tokenizer the run used: --tokenizer auto is byte for a preset
    assert json.loads((run_dir / "config.json").read_text()) == {**cfg.to_dict(), "tokenizer": "byte"}
    actions = [json.loads(line) for line in (run_dir / "actions.jsonl").read_text().splitlines()]
    assert len(actions) == 4 * (2 * 30 * 4 + 30)  # per stage: F and B per micro-batch, one U per step
    assert max(a.get("drift", 0) for a in actions if a["stage"] == 0) == 1
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert [s["step"] for s in steps if "val_loss" not in s] == list(range(1, 31))
    assert (run_dir / "loss.png").stat().st_size > 1000


def test_cli_train_runs_and_reports(tmp_path, cache_dir):
    run_dir = tmp_path / "cli-run"
    res = CliRunner().invoke(cli, ["train", "--engine", "emulator", "--steps", "4", "--stages", "2", "--a", "2",
                                   "--eval-interval", "0", "--eval-batches", "1", "--run-dir", str(run_dir),
                                   "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    assert "max Δ per stage [1, 0]" in res.stdout
    assert (run_dir / "summary.json").exists()
    # the partition, inclusive block indices (summary.json keeps half-open [start, stop) pairs)
    layers = json.loads((run_dir / "summary.json").read_text())["stage_layers"]
    assert layers == [[0, 2], [2, 4]]
    assert "parameters; stage 0: blocks 0–1, stage 1: blocks 2–3" in " ".join(res.stderr.split())


def test_block_ranges_read_as_inclusive_indices():
    from unbubble.metrics import describe_blocks

    assert describe_blocks([range(0, 4), range(4, 8)]) == "stage 0: blocks 0–3, stage 1: blocks 4–7"
    assert describe_blocks([range(0, 1), range(1, 3), range(3, 3)]) == \
        "stage 0: block 0, stage 1: blocks 1–2, stage 2: no blocks"


@pytest.fixture
def bad_files(tmp_path):
    import numpy as np
    import torch

    from unbubble.config import config_to_yaml
    from unbubble.runtime.checkpoint import save_stage

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not utf-8 \xc3\x28")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "small.txt").write_text("In the beginning " * 120)  # 2,040 bytes + EOS: 1,939 train + 102 val tokens
    good = np.arange(4000, dtype="<u2") % 257
    bad = good.copy()
    bad[1234] = 300
    for name, train_bin, val in (("bin-empty", b"", good.tobytes()), ("bin-odd", good.tobytes() + b"\x01", good.tobytes()),
                             ("bin-vocab", bad.tobytes(), good.tobytes()),
                             ("bin-noval", good.tobytes(), None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.bin").write_bytes(train_bin)
        if val is not None:
            (tmp_path / name / "val.bin").write_bytes(val)
    # run folders to resume: no checkpoint; one written by a 2-stage run; a damaged file
    for name in ("run-nockpt", "run-2stages", "run-damaged", "run-edited"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(config_to_yaml(TrainConfig(engine="emulator", steps=20)))
    (tmp_path / "run-edited" / "config.json").write_text(json.dumps(TrainConfig(engine="emulator", steps=20,
                                                                               lr=0.5).to_dict()))
    for s in range(4):
        save_stage(tmp_path / "run-2stages" / "checkpoints", 10, s,
                   {"fingerprint": {"schedule": "paci", "n_stages": 2}, "extra_cuts": []})
        save_stage(tmp_path / "run-damaged" / "checkpoints", 10, s, {"extra_cuts": [], "x": torch.zeros(1)})
    (tmp_path / "run-damaged" / "checkpoints" / "step-00000010" / "stage-000.pt").write_bytes(b"\x00truncated")
    return tmp_path


BAD = [
    (["--stages", "9"], "stages=9 is invalid: the model has 4 layers"),
    (["--a", "0"], "a=0 is invalid: must be an integer ≥ 1 (set --a)"),
    (["--a", "-3"], "a=-3 is invalid"),
    (["--micro-batch-size", "0"], "micro_batch_size=0 is invalid"),
    (["--schedule", "gpipe2"], "schedule='gpipe2' is unknown (did you mean 'gpipe'?): valid schedules are gpipe, 1f1b-flush"),
    (["--corpus", "{tmp}/missing.txt"], "corpus='{tmp}/missing.txt' does not exist"),
    (["--corpus", "{tmp}/empty.txt"], "empty.txt"),
    (["--corpus", "{tmp}/binary.txt"], "binary.txt"),
    (["--corpus", "{tmp}/emptydir"], "emptydir"),
    (["--seq-len", "4096"], "seq_len=4096 is invalid: model 'tiny' has block_size=128"),
    (["--corpus", "{tmp}/small.txt", "--seq-len", "120"],
     "seq_len=120 is too long for this corpus: the validation split has 102 tokens; the corpus has 2,041 (a split "
     "needs seq_len + 2 = 122): set --seq-len 100 or less, or give a larger corpus"),
    (["--model", "gpt5"], "model='gpt5' is invalid"),
    (["--lr", "-1"], "lr=-1.0 is invalid: must be a finite number > 0 (set --lr)"),
    (["--lr", "inf"], "lr=inf is invalid: must be a finite number > 0 (set --lr)"),
    (["--steps", "0"], "steps=0 is invalid"),
    (["--engine", "gpu"], "engine='gpu' is unknown: valid engines are emulator, processes"),
    (["--optimizer", "sgd"], "optimizer='sgd' is invalid: must be one of adamw, basis-rotation"),
    (["--br-source", "3rd"], "br_source='3rd' is invalid: must be one of 2nd, 1st (set --br-source)"),
    (["--br-freq", "0"], "br_freq=0 is invalid"),
    (["--schedule", "interleaved-1f1b", "--v", "4"], "interleaved-1f1b needs stages × v = 16 model chunks"),
    (["--schedule", "interleaved-1f1b", "--m", "6"], "m=6 is invalid for interleaved-1f1b"),
    (["--schedule", "pipedream-2bw", "--m", "2"], "m=2 is invalid for pipedream-2bw with stages=4"),
    (["--stage-aware", "--br-allocation", "inverse"], "stage_aware=True contradicts br_allocation='inverse'"),
    (["--dp", "2"], "dp=2 is invalid with engine='emulator'"),
    (["--run-dir", "{tmp}/existing-run"], "already exists and is not empty"),
    (["--nan-policy", "ignore"], "nan_policy='ignore' is invalid: must be one of skip, lower-lr, abort, off"),
    (["--nan-lr-factor", "0"], "nan_lr_factor=0.0 is invalid: must be in (0, 1]"),
    (["--nan-lr-factor", "1.5"], "nan_lr_factor=1.5 is invalid"),
    (["--timeout-s", "0"], "timeout_s=0.0 is invalid: must be a number of seconds > 0"),
    (["--order", "determinstic"], "order='determinstic' is invalid (did you mean 'deterministic'?): must be one of "
                                  "deterministic, dynamic (set --order)"),
    (["--checkpoint-every", "-1"], "checkpoint_every=-1 is invalid: must be an integer ≥ 0"),
    (["--micro-batch-size", "100000"], "micro_batch_size=100000"),
    # pre-tokenised data files
    (["--corpus", "{tmp}/bin-empty"], "bin-empty/train.bin' is empty"),
    (["--corpus", "{tmp}/bin-odd"], "has odd size 8001 bytes, not a whole number of uint16 ids"),
    (["--corpus", "{tmp}/bin-vocab"], "holds token id 300 at position 1234, not below the byte tokenizer's "
                                       "vocab_size=257: its ids fit gpt2's 50257, so it is likely a gpt2 file (set "
                                       "--tokenizer gpt2)"),
    (["--corpus", "{tmp}/bin-noval"], "bin-noval/val.bin' does not exist"),
    # resuming
    (["--resume", "{tmp}/nowhere"], "resume='{tmp}/nowhere' does not exist: give the folder of a previous"),
    (["--resume", "{tmp}"], "resume='{tmp}' is not a run folder: '{tmp}/config.yaml' is missing"),
    (["--schedule", "paci-stash"], "schedule='paci-stash' is unknown (did you mean 'paci-stashed'?)"),
    (["--optimizer", "adamx"], "optimizer='adamx' is invalid (did you mean 'adamw'?)"),
    (["--resume", "{tmp}/emptydir"], "is not a run folder"),
    (["--resume", "{tmp}/run-edited"], "lr was edited in"),
    (["--run-dir", "{tmp}/empty.txt/run"], "cannot be created"),
    (["--resume", "{tmp}/run-nockpt", "--steps", "40"], "steps cannot change on --resume"),
    (["--resume", "{tmp}/run-nockpt", "--config", "{tmp}/run-nockpt/config.yaml"], "--config and --resume exclude"),
    (["--resume", "{tmp}/run-2stages"], "was written with stages=2 but this run has stages=4"),
    (["--resume", "{tmp}/run-damaged"], "stage-000.pt' cannot be read: it is cut short or not a torch.save file (RuntimeError); there is no older checkpoint: delete"),
]


@pytest.mark.parametrize("args", [["--model", "gpt2-mediun"], ["--seq-len", "4096"], ["--stages", "9"]])
def test_bad_input_prints_no_configuration_before_its_error(args, cache_dir):
    """Regression: a bad model, seq_len or stage count was found after the configuration line
    (12 lines at 80 columns) had been printed; without -q the error is still the last and only
    warning-free output about the run."""
    res = CliRunner().invoke(cli, ["train", "--engine", "emulator", "--cache-dir", cache_dir, *args])
    assert res.exit_code == 2, res.output
    assert "config:" not in res.output and res.stderr.strip().splitlines()[-1].startswith("error: ")


def test_an_option_conflict_is_the_only_line_even_without_q(cache_dir):
    """Regression: --dp 2 with the emulator was refused after the corpus had been read (an INFO line)."""
    res = CliRunner().invoke(cli, ["train", "--engine", "emulator", "--dp", "2", "--cache-dir", cache_dir])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        "error: dp=2 is invalid with engine='emulator' (one replica): use --engine processes or --dp 1"]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_one_clear_line_and_nothing_overwritten(args, message, bad_files, cache_dir):
    run_dir = bad_files / "existing-run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("precious")
    args = [a.format(tmp=bad_files) for a in args]
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--cache-dir", cache_dir, *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert message.format(tmp=bad_files) in lines[0]
    assert [p.name for p in run_dir.iterdir()] == ["keep.txt"]
    assert (run_dir / "keep.txt").read_text() == "precious"


def test_existing_run_folder_is_refused(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--steps", "1", "--run-dir", str(run_dir),
                                   "--cache-dir", cache_dir])
    assert res.exit_code == 2
    assert "already exists and is not empty" in res.stderr
    assert (run_dir / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("optimizer,extra", [("basis-rotation", True), ("pipedream-lr", False), ("nesterov", False)])
def test_optimizers_train_through_the_pipeline(optimizer, extra, tmp_path, cache_dir):
    run_dir = tmp_path / optimizer
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--steps", "6", "--optimizer", optimizer,
                                   "--stage-aware", "--br-freq", "2", "--eval-interval", "0", "--eval-batches", "2",
                                   "--run-dir", str(run_dir), "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    per_rotated = summary["optimizer_extra_per_rotated_param"]
    assert (min(per_rotated) > 4.0) if extra else per_rotated == [0.0] * 4


def test_run_job_gives_the_emulator_threads_per_stage(monkeypatch):
    import unbubble.train as train_mod

    seen = []
    from unbubble.schedules import get_schedule
    from helpers import tiny_gpt_job

    monkeypatch.setattr(train_mod, "run_emulator",
                        lambda job, listener=None, cuts=None, threads=None: seen.append(threads))
    # the emulator sets and restores them (tests/unit/test_runtime.py); not the process default:
    # oversubscribed threads made small kernels 20x slower
    train_mod.run_job(tiny_gpt_job(get_schedule("paci", 2, 1, a=1)), "emulator", threads_per_stage=1)
    train_mod.run_job(tiny_gpt_job(get_schedule("paci", 2, 1, a=1)), "emulator", threads_per_stage=2)
    assert seen == [1, 2]


class _Messages(logging.Handler):
    """The formatted messages of one logger while attached (the CLI's console wraps long lines)."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger(name)
        self.logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def close(self):
        self.logger.removeHandler(self)
        super().close()


def test_resume_continues_the_run_folder_bit_identically(tmp_path, cache_dir):
    """A run cut off after its step-10 checkpoint and resumed equals the uninterrupted run: the
    step-20 checkpoints hold the same weights, metrics.jsonl lists each step once."""
    import shutil

    import torch

    from unbubble.runtime.checkpoint import complete_steps, load_stage

    run = tmp_path / "run"

    def assert_same_step_20(other):
        """Every stage's step-20 weights of ``other`` equal the uninterrupted run's."""
        for s in range(4):
            a = load_stage(run / "checkpoints", 20, s)["executor"]["model"]
            b = load_stage(other / "checkpoints", 20, s)["executor"]["model"]
            assert all(torch.equal(a[k], b[k]) for k in a), (other, s)

    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--steps", "20", "--checkpoint-every", "10",
                                   "--seq-len", "32", "--eval-interval", "10", "--eval-batches", "1",
                                   "--run-dir", str(run), "--cache-dir", cache_dir, "--no-tensorboard"])
    assert res.exit_code == 0, res.output
    def resume_a_copy(name, damage):
        """Copies the finished run, damages the copy as a crash would, resumes it; the logged lines."""
        copy = tmp_path / name
        shutil.copytree(run, copy)
        damage(copy)
        (copy / "summary.json").unlink()
        said = _Messages("unbubble.train")
        try:
            res = CliRunner().invoke(cli, ["train", "--resume", str(copy), "--cache-dir", cache_dir])
        finally:
            said.close()
        assert res.exit_code == 0, res.output
        return copy, said.lines

    # as if the machine died after step 10's checkpoint
    cut, lines_said = resume_a_copy("cut", lambda c: shutil.rmtree(c / "checkpoints" / "step-00000020"))
    assert f"resuming run {cut} from step 10 of 20 (checkpoint {cut}/checkpoints/step-00000010)" in lines_said
    assert complete_steps(cut / "checkpoints", 4) == [10, 20]
    assert_same_step_20(cut)
    lines = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 21))
    assert [r["step"] for r in lines if "val_loss" in r] == [0, 10, 20]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10 and summary["stopped_at_step"] is None
    # the summary covers the whole run, not only the part after the resume
    assert summary == {**json.loads((run / "summary.json").read_text()), **{
        k: summary[k] for k in ("resumed_from_step", "tokens", "train_wall_s", "total_wall_s", "tokens_per_s",
                                "utilization", "simulated_utilization", "startup_s", "run_train_wall_s")}}
    assert summary["tokens"] == 10 * 4 * 8 * 32 and summary["steps_done"] == 20
    # the whole run across the resume: all 20 steps' tokens, training seconds that keep rising
    assert summary["run_tokens"] == 20 * 4 * 8 * 32 == json.loads((run / "summary.json").read_text())["run_tokens"]
    elapsed = [r["elapsed_s"] for r in lines if "elapsed_s" in r]
    assert len(elapsed) == 20 and elapsed == sorted(elapsed) and summary["run_train_wall_s"] >= elapsed[-1]
    report = CliRunner().invoke(cli, ["report", str(cut), str(run), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0 and "differ" not in report.output, report.output

    # a damaged newest checkpoint (a file cut short) is passed over for the previous one, saying so
    def cut_short(copy):
        newest = copy / "checkpoints" / "step-00000020" / "stage-002.pt"
        newest.write_bytes(newest.read_bytes()[:1000])

    torn, lines_said = resume_a_copy("torn", cut_short)
    newest = torn / "checkpoints" / "step-00000020" / "stage-002.pt"
    assert any(f"checkpoint file '{newest}' cannot be read" in x and x.endswith("resuming from the previous "
                                                                              "checkpoint, step 10") for x in lines_said)
    assert f"resuming run {torn} from step 10 of 20 (checkpoint {torn}/checkpoints/step-00000010)" in lines_said
    assert_same_step_20(torn)

    # a run cut off before its first checkpoint restarts from step 0 in the same folder
    fresh, _ = resume_a_copy("fresh", lambda c: shutil.rmtree(c / "checkpoints"))
    lines = [json.loads(x) for x in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "val_loss" in r] == [0, 10, 20]
    assert_same_step_20(fresh)


def test_a_short_run_writes_its_last_step_unless_told_not_to_and_a_finished_run_is_not_resumed(tmp_path, cache_dir,
                                                                                             monkeypatch):
    """Fewer steps than --checkpoint-every: the last step's checkpoint by default (issue 33: train then
    export works), none with --no-final-checkpoint (a stop still writes one); at least --checkpoint-every
    steps: the periodic ones and the last step's. A finished run refuses --resume even without a
    checkpoint at its last step."""
    from unbubble.runtime.checkpoint import complete_steps

    base = ["-q", "train", "--engine", "emulator", "--stages", "2", "--a", "2", "--seq-len", "32", "--eval-interval",
            "0", "--eval-batches", "1", "--no-tensorboard", "--cache-dir", cache_dir]
    written = {}
    for name, extra in (("short", ["--steps", "6", "--no-final-checkpoint"]), ("default", ["--steps", "6"]),
                        ("long", ["--steps", "7", "--checkpoint-every", "3", "--no-final-checkpoint"])):
        res = CliRunner().invoke(cli, [*base, *extra, "--run-dir", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        written[name] = complete_steps(tmp_path / name / "checkpoints", 2)
    assert written == {"short": [], "default": [6], "long": [6, 7]}
    # said before the corpus is read or the model built (it came after both: tens of seconds on a real corpus)
    monkeypatch.setattr("unbubble.train.prepare_tokens", lambda *a, **k: pytest.fail("the corpus was read"))
    res = CliRunner().invoke(cli, ["-q", "train", "--resume", str(tmp_path / "short"), "--cache-dir", cache_dir])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: run '{tmp_path / 'short'}' already finished: its summary.json has all 6 steps (start a new run to "
        "train longer)")


def test_the_end_line_names_the_step_of_the_final_evaluation():
    """Regression: a run stopped at step 86 before its first evaluation after step 0 printed
    'validation loss 5.5675 -> 5.5675', which reads as no progress."""
    from unbubble.progress import validation_line

    base = {"initial_val_loss": 5.5675, "steps_done": 86}
    assert validation_line({**base, "val_losses": [[0, 5.5675]], "final_val_loss": 5.5675}, 100) == \
        "validation loss 5.5675 at step 0; no evaluation since (--eval-interval 100)"
    assert validation_line({**base, "val_losses": [[0, 5.5675], [50, 3.0]], "final_val_loss": 3.0}, 50) == \
        "validation loss 5.5675 -> 3.0000 at step 50 (ppl 20.09)"
    assert validation_line({**base, "steps_done": 50, "val_losses": [[0, 5.5675], [50, 3.0]], "final_val_loss": 3.0},
                           50) == "validation loss 5.5675 -> 3.0000 (ppl 20.09)"
    # a run started with --init-from is first evaluated at its end: it printed "3.5953 -> 3.5953"
    once = {"initial_val_loss": 3.5953, "steps_done": 10, "val_losses": [[10, 3.5953]], "final_val_loss": 3.5953}
    assert validation_line(once, 50) == "validation loss 3.5953 at step 10 (ppl 36.43), the first in this run folder"
    # a --switch-after run: its synchronous phase evaluated step 0 (RUN/synchronous), the run folder step 6
    switched = {"initial_val_loss": 3.8657, "steps_done": 6, "val_losses": [[6, 3.8657]], "final_val_loss": 3.8657}
    assert validation_line(switched, 50, (0, 5.7246)) == "validation loss 5.7246 -> 3.8657 (ppl 47.74)"


def test_br_max_precond_dim_reaches_every_stages_basis_rotation(tmp_path):
    from unbubble.data import prepare_tokens
    from unbubble.optim import keys as K
    from unbubble.train import build_job

    corpus = tmp_path / "c.txt"
    corpus.write_text("In the beginning God created the heaven and the earth. " * 400)
    tokens = prepare_tokens(str(corpus), "byte", tmp_path)
    for limit, want_left in ((128, False), (10_000, True)):
        cfg = TrainConfig(optimizer="basis-rotation", br_max_precond_dim=limit, cache_dir=str(tmp_path))
        job, _ = build_job(cfg, tokens)
        stage = job.stage_fn(1)
        opt = job.optimizer_fn(list(stage.named_parameters()), 1)
        qkv = stage.h["1"].attn.c_attn.weight  # (384, 128) in the tiny preset
        assert qkv.shape == (384, 128)
        qkv.grad = torch.randn_like(qkv)
        opt.step()
        state = opt.state[qkv]
        assert (K.BASIS_LEFT in state) is want_left and state[K.BASIS_RIGHT].shape == (128, 128)


def test_train_help_is_grouped_with_the_most_used_options_first():
    """Issue 37, item 3: the sections of `unbubble train --help`, each TrainConfig field in exactly one."""
    import dataclasses

    from unbubble.cli.train import HELP_SECTIONS

    text = CliRunner().invoke(cli, ["train", "--help"], terminal_width=100).output
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles == ["Schedule", "Model", "Data", "Optimizer and remedies", "Precision and speed",
                      "Run folder and logging", "Reliability", "Other options"]
    placed = [name for names in HELP_SECTIONS.values() for name in names]
    assert sorted(placed) == sorted([f.name for f in dataclasses.fields(TrainConfig)]
                                    + ["config", "print_config", "resume"])
    schedule = text.split("\nSchedule:\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in schedule.splitlines() if line.startswith("  --")][:3] == \
        ["--schedule", "--stages", "--a"]
    assert max(len(line) for line in text.splitlines()) <= 100


def test_schedules_list_fits_100_columns():
    from unbubble.schedules.registry import SCHEDULES

    lines = CliRunner().invoke(cli, ["schedules"]).output.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == list(SCHEDULES)


def test_a_run_folder_resumes_from_another_folder_with_a_relative_corpus(tmp_path, cache_dir, monkeypatch):
    """Regression: config.yaml kept ``corpus: c.txt`` as given, so ``--resume`` from another working
    directory failed with "corpus='c.txt' does not exist" (and --corpus cannot change on --resume)."""
    import shutil

    from unbubble.config import load_config

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    (start / "c.txt").write_text("In the beginning God created the heaven and the earth. " * 400)
    monkeypatch.chdir(start)
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--steps", "4", "--checkpoint-every", "2",
                                   "--seq-len", "32", "--eval-interval", "2", "--eval-batches", "1", "--corpus", "c.txt",
                                   "--run-dir", "run", "--cache-dir", cache_dir, "--no-tensorboard"])
    assert res.exit_code == 0, res.output
    assert load_config(start / "run" / "config.yaml").corpus == str(start / "c.txt")
    shutil.rmtree(start / "run" / "checkpoints" / "step-00000004")  # as if the machine died after step 2
    (start / "run" / "summary.json").unlink()
    monkeypatch.chdir(elsewhere)
    res = CliRunner().invoke(cli, ["-q", "train", "--resume", "../start/run", "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    assert json.loads((start / "run" / "summary.json").read_text())["steps_done"] == 4
