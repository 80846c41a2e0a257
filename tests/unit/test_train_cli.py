"""`unbubble train` end to end in-process: real text, run folder, bad input."""

import json

import pytest
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
    assert json.loads((run_dir / "config.json").read_text()) == cfg.to_dict()
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


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not utf-8 \xc3\x28")
    (tmp_path / "emptydir").mkdir()
    return tmp_path


BAD = [
    (["--stages", "9"], "stages=9 is invalid: the model has 4 layers"),
    (["--a", "0"], "a=0 is invalid: must be an integer ≥ 1 (set --a)"),
    (["--a", "-3"], "a=-3 is invalid"),
    (["--micro-batch-size", "0"], "micro_batch_size=0 is invalid"),
    (["--schedule", "gpipe2"], "schedule='gpipe2' is unknown: valid schedules are gpipe, 1f1b-flush"),
    (["--corpus", "{tmp}/missing.txt"], "corpus='{tmp}/missing.txt' does not exist"),
    (["--corpus", "{tmp}/empty.txt"], "empty.txt"),
    (["--corpus", "{tmp}/binary.txt"], "binary.txt"),
    (["--corpus", "{tmp}/emptydir"], "emptydir"),
    (["--seq-len", "4096"], "seq_len=4096 is invalid: model 'tiny' has block_size=128"),
    (["--model", "gpt5"], "model='gpt5' is invalid"),
    (["--lr", "-1"], "lr=-1.0 is invalid"),
    (["--steps", "0"], "steps=0 is invalid"),
    (["--engine", "gpu"], "engine='gpu' is unknown: valid engines are emulator, processes"),
    (["--optimizer", "sgd"], "optimizer='sgd' is invalid: must be one of adamw, basis-rotation"),
    (["--br-source", "3rd"], "br_source='3rd' is invalid: must be one of 2nd, 1st (set --br-source)"),
    (["--br-freq", "0"], "br_freq=0 is invalid"),
    (["--schedule", "interleaved-1f1b", "--v", "4"], "interleaved-1f1b needs stages × v = 16 model chunks"),
    (["--schedule", "interleaved-1f1b", "--m", "6"], "m=6 is invalid for interleaved-1f1b"),
    (["--schedule", "pipedream-2bw", "--m", "2"], "m=2 is invalid for pipedream-2bw with stages=4"),
    (["--stage-aware", "--br-allocation", "inverse"], "stage_aware=True contradicts br_allocation='inverse'"),
]


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


def test_emulator_runs_on_threads_per_stage_and_restores_threads(monkeypatch):
    import torch

    import unbubble.train as train_mod

    seen = []
    monkeypatch.setattr(train_mod, "run_emulator", lambda job, listener=None: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    train_mod.run_job(None, "emulator", threads_per_stage=1)
    assert seen == [1]  # not the process default: oversubscribed threads made small kernels 20x slower
    assert torch.get_num_threads() == before
