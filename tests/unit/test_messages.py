"""One line per bad input or event, naming the value and the fix (issue 28, items 2, 6, 7 and 8's
picklability): each message asserted verbatim, from the command line where it is a CLI message."""

import contextlib
import json
import dataclasses
import logging
import os
import signal
import time

import numpy as np
import pytest
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.errors import ConfigError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small UTF-8 text (fast to tokenise), large enough for 32-token windows."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(f"In the beginning {i} was the word, and the word was {i * 7 % 13}.\n"
                            for i in range(2000)))
    return str(path)


def _error(args: list[str]) -> str:
    """The one line a refused command prints (exit status 2)."""
    res = CliRunner().invoke(cli, ["-q", *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0].removeprefix("error: ")


@contextlib.contextmanager
def _warnings(*names: str):
    """The messages of WARNING and above that the loggers ``names`` log inside the block."""
    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines, loggers = Lines(), [logging.getLogger(n) for n in names]
    for logger in loggers:
        logger.addHandler(lines)
    try:
        yield lines.lines
    finally:
        for logger in loggers:
            logger.removeHandler(lines)


def _simulate(tmp_path, *args: str) -> str:
    return _error(["simulate", "--uniform", "1:2", "--out", str(tmp_path / "sim"), *args])


# item 2: tracebacks and a 0 taken as the default -----------------------------------------------------------

def test_simulate_a_zero(tmp_path):
    assert _simulate(tmp_path, "--schedule", "paci", "--a", "0") == "a=0 is invalid: must be an integer ≥ 1 (set --a)"


def test_simulate_m_zero(tmp_path):
    assert _simulate(tmp_path, "--schedule", "1f1b-flush", "--m", "0") == \
        "m=0 is invalid: must be an integer ≥ 1 (set --m)"


def test_simulate_micro_batches_zero_is_refused_like_minus_five(tmp_path):
    for value in ("0", "-5"):
        assert _simulate(tmp_path, "--micro-batches", value) == \
            f"micro_batches={value} is invalid: must be ≥ 1 (set --micro-batches)"
    assert not (tmp_path / "sim").exists()


# item 6: silent acceptance -----------------------------------------------------------------------------------

def test_train_a_given_to_a_schedule_without_accumulation(cache_dir):
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--schedule", "1f1b-flush",
                   "--a", "8"]) == (
        "a=8 has no effect on schedule='1f1b-flush', whose micro-batches per step are --m: only paci, paci-stashed "
        "take --a (backward passes per update); drop --a or change --schedule")


def test_train_m_given_to_paci(cache_dir):
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--m", "8"]) == (
        "m=8 has no effect on schedule='paci', whose backward passes per update are --a: only gpipe, 1f1b-flush, "
        "interleaved-1f1b, looped-bfs, interleaved-zb, zb-h1, zb-h2, zbv, dualpipev, pipedream-2bw take --m (micro-batches per step); "
        "drop --m or change --schedule")


def test_a_in_a_config_file_is_not_refused_for_a_flush_schedule(tmp_path):
    # a run folder's config.yaml holds every field: its a is not something the user typed for this run
    path = tmp_path / "run.yaml"
    path.write_text("schedule: 1f1b-flush\na: 8\n")
    res = CliRunner().invoke(cli, ["train", "--config", str(path), "--print-config"])
    assert res.exit_code == 0, res.output
    assert "\na: 8\n" in res.output and "\nschedule: 1f1b-flush\n" in res.output


def test_simulate_a_given_to_a_schedule_without_accumulation(tmp_path):
    assert _simulate(tmp_path, "--schedule", "async-1f1b", "--a", "4") == (
        "a=4 has no effect on schedule='async-1f1b', which updates after every backward: only paci, paci-stashed "
        "take --a (backward passes per update); drop --a or change --schedule")
    # --compare with a schedule that takes it: accepted
    res = CliRunner().invoke(cli, ["-q", "simulate", "--uniform", "1:2", "--stages", "2", "--schedule", "1f1b-flush",
                                   "--compare", "paci", "--a", "2", "--m", "2", "--micro-batches", "4",
                                   "--format", "csv", "--out", str(tmp_path / "ok")])
    assert res.exit_code == 0, res.output


def test_simulate_a_larger_than_the_micro_batches_of_the_run(tmp_path):
    assert _simulate(tmp_path, "--schedule", "paci", "--a", "1000", "--micro-batches", "12") == (
        "a=1000 exceeds micro_batches=12: paci updates after 1000 micro-batches, so the run would apply no update "
        "(give --micro-batches 1000 or more, or --a 12 or less)")


# item 7: misleading messages ---------------------------------------------------------------------------------

def test_gpt2_bin_read_with_the_byte_tokenizer(tmp_path, cache_dir):
    folder = tmp_path / "owt"
    folder.mkdir()
    ids = np.array([42749, 11, 290, 50256, 464], dtype="<u2")  # GPT-2 BPE ids, EOS 50256
    ids.tofile(folder / "train.bin")
    ids.tofile(folder / "val.bin")
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--corpus", str(folder),
                   "--tokenizer", "byte"]) == (
        f"bin file '{folder}/train.bin' holds token id 42749 at position 0 (largest 50256), not below the byte "
        "tokenizer's vocab_size=257: its ids fit gpt2's 50257, so it is likely a gpt2 file (set --tokenizer gpt2)")


def test_bin_with_ids_no_tokenizer_has(tmp_path):
    from unbubble.data.memmap import load_bin

    path = tmp_path / "big.bin"
    np.array([5, 60000], dtype="<u2").tofile(path)
    with pytest.raises(ConfigError) as exc:
        load_bin(path, 50257, "gpt2")
    assert str(exc.value) == (
        f"bin file '{path}' holds token id 60000 at position 1, not below the gpt2 tokenizer's vocab_size=50257: "
        "no --tokenizer has that many ids (byte 257, gpt2 50257): re-tokenize it with one of them")


def test_optimizer_adam_suggests_adamw(cache_dir):
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--optimizer", "adam"]) == (
        "optimizer='adam' is invalid (did you mean 'adamw'?): must be one of adamw, basis-rotation, nesterov, nadam, "
        "pipedream-lr, staleness-lr, muon (set --optimizer)")


def test_hardware_a100x_suggests_a100_80g(tmp_path):
    assert _error(["simulate", "--hardware", "a100x", "--out", str(tmp_path / "sim")]) == (
        "hardware='a100x' is unknown (did you mean 'a100-80g'?): valid presets are a100-80g, h100, h200 "
        "(set --hardware)")


def test_did_you_mean_meaning_first_then_spelling():
    from unbubble.errors import did_you_mean

    assert did_you_mean("a100", ("a100-80g", "h100", "h200")) == " (did you mean 'a100-80g'?)"
    assert did_you_mean("nadm", ("adamw", "nadam")) == " (did you mean 'nadam'?)"  # no alias: edit distance
    assert did_you_mean("adam", ("sgd", "lion")) == ""  # an alias only where its target is valid
    assert did_you_mean("1f1b", ("gpipe", "1f1b-flush")) == " (did you mean '1f1b-flush'?)"


def test_run_dir_that_is_a_file(tmp_path, cache_dir):
    afile = tmp_path / "afile"
    afile.write_text("precious")
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--run-dir", str(afile)]) == (
        f"run_dir='{afile}' is a file, not a folder: give a new folder (set --run-dir); nothing was overwritten")
    assert afile.read_text() == "precious"


def test_config_that_is_not_text(tmp_path):
    pic = tmp_path / "pic.png"
    pic.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert _error(["train", "--config", str(pic)]) == (
        f"config='{pic}' is not a text file (byte 0x89 at offset 0 is not UTF-8): give a YAML file such as a run "
        "folder's config.yaml (set --config)")


def test_second_ctrl_c_names_the_kept_checkpoint(tmp_path, corpus, cache_dir, monkeypatch):
    # the first SIGINT asks for a stop at the next cut (a checkpoint of step 4, not reached); the second stops
    # at once during step 3: what is kept is the checkpoint of step 2, and --resume continues from it
    from unbubble.progress import ProgressListener
    from unbubble.runtime.launch import ECHO_S

    def on_step(self, step, loss, info):
        self.writer.on_step(step, loss, info)
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(ECHO_S + 0.05)  # not an echo of the first
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ProgressListener, "on_step", on_step)
    run = tmp_path / "run"
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--cache-dir", cache_dir, "--corpus", corpus,
                                   "--stages", "2", "--a", "2", "--seq-len", "32", "--micro-batch-size", "2",
                                   "--steps", "6", "--checkpoint-every", "2", "--eval-interval", "0",
                                   "--eval-batches", "1", "--no-tensorboard", "--run-dir", str(run)])
    assert res.exit_code == 1, res.output
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: second SIGINT: stopped at once; the newest complete checkpoint, step 2 ({run}/checkpoints/"
        f"step-00000002), is kept: unbubble train --resume {run} continues from it")
    assert (run / "checkpoints" / "step-00000002").is_dir()


def test_overlapping_validation_windows_are_warned_once_per_run_with_the_remedy(tmp_path, corpus, cache_dir):
    # every stage evaluates (the emulator's two, each evaluation): the warning came once per stage
    with _warnings("unbubble.train", "unbubble.data.sampler") as lines:
        res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--cache-dir", cache_dir, "--corpus",
                                       corpus, "--stages", "2", "--steps", "2", "--seq-len", "32",
                                       "--micro-batch-size", "2", "--eval-batches", "100", "--eval-interval", "1",
                                       "--no-tensorboard", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    overlap = [line for line in lines if "windows overlap" in line]
    assert res.stderr.count("windows overlap") == 1 and overlap == [
        "the validation split's 5,568 tokens hold 173 windows of seq_len=32, fewer than the 200 an evaluation reads "
        "(eval_batches=100 × micro_batch_size=2): windows overlap and the validation loss counts tokens more than "
        "once (set --eval-batches 86 or less, or give a larger corpus)"]


# item 8: a job the process engine cannot send -----------------------------------------------------------------

def test_a_lambda_given_to_the_process_engine():
    from unbubble.runtime.launch import run_processes
    from unbubble.schedules.registry import get_schedule
    from helpers import tiny_gpt_job

    job = dataclasses.replace(tiny_gpt_job(get_schedule("paci", 2, steps=1, a=1)), loss_fn=lambda out, y: out.sum())
    with pytest.raises(ConfigError) as exc:
        run_processes(job)
    assert str(exc.value) == (
        f"job.loss_fn={__name__}.test_a_lambda_given_to_the_process_engine.<locals>.<lambda> cannot be pickled, and "
        "the processes engine sends the job to every stage process: give a module-level function (or a "
        "functools.partial of one), or run it on the emulator engine")


# found by a new user's try of the above ------------------------------------------------------------------------

def test_sweep_spec_that_is_not_text_or_missing(tmp_path):
    pic = tmp_path / "pic.png"
    pic.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert _error(["sweep", str(pic), "--dry-run"]) == (
        f"spec='{pic}' is not a text file (byte 0x89 at offset 0 is not UTF-8): give a YAML sweep spec such as "
        "examples/grid.yaml")
    assert _error(["sweep", str(tmp_path / "grid.yaml"), "--dry-run"]) == (
        f"spec='{tmp_path / 'grid.yaml'}' does not exist: give a YAML sweep spec such as examples/grid.yaml")


def test_experiment_out_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("mine")
    assert _error(["experiment", "br-study", "--size", "tiny", "--out", str(tmp_path / "afile")]) == (
        f"out='{tmp_path / 'afile'}' is a file, not a folder: give a folder (set --out); nothing was overwritten")
    assert (tmp_path / "afile").read_text() == "mine"


def test_yaml_numbers_in_exponent_form_are_numbers():
    # YAML 1.1 reads 1e-3 as the string '1e-3': a sweep's lrs: [1e-3] was refused as not a number
    from unbubble.config import read_yaml

    assert read_yaml("lrs: [1e-3, 3.0e-3, -2E+2]\nname: 1e3x\n", "spec") == {"lrs": [0.001, 0.003, -200.0],
                                                                              "name": "1e3x"}


def test_simulate_says_when_it_rounds_the_micro_batches_up_to_whole_updates(tmp_path):
    with _warnings("unbubble.simulate") as lines:
        res = CliRunner().invoke(cli, ["-q", "simulate", "--schedule", "paci", "--a", "8", "--micro-batches", "20",
                                       "--uniform", "1:2", "--out", str(tmp_path / "sim")])
    assert res.exit_code == 0, res.output
    assert lines == ["paci: 24 micro-batches simulated, not 20: 3 whole updates of 8 (give --micro-batches 24)"]


def test_second_ctrl_c_under_torchrun_names_the_kept_checkpoint(tmp_path, monkeypatch, cache_dir):
    # under torchrun the stage's own handler raises the second signal straight into the CLI, which
    # called it "interrupted before the first step"; the run folder and its step-2 checkpoint exist
    import types

    import unbubble.train as train_mod
    from unbubble.errors import SecondSignal
    from unbubble.runtime.checkpoint import Checkpointing, stage_path

    run = tmp_path / "run"
    for s in (0, 1):  # a complete checkpoint of step 2: every stage's file
        stage_path(run / "checkpoints", 2, s).parent.mkdir(parents=True, exist_ok=True)
        stage_path(run / "checkpoints", 2, s).write_bytes(b"x")

    def fake_train(cfg=None, listener_factory=None, **kw):
        job = types.SimpleNamespace(checkpoint=Checkpointing(str(run / "checkpoints")),
                                    schedule=types.SimpleNamespace(n_stages=2))
        listener_factory(types.SimpleNamespace(dir=run, job=job, resume_step=0), 10)
        raise SecondSignal("SIGINT")

    monkeypatch.setattr(train_mod, "train", fake_train)
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--cache-dir", cache_dir,
                                   "--run-dir", str(run)])
    assert res.exit_code == 1, res.output
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: second SIGINT: stopped at once; the newest complete checkpoint, step 2 ({run}/checkpoints/"
        f"step-00000002), is kept: unbubble train --resume {run} continues from it")


def test_sweep_dry_run_stopped_during_its_calibration_gives_no_estimate(tmp_path, monkeypatch):
    # a Ctrl-C during the calibration run cut it short: its per-micro-batch figure was printed as the estimate
    import unbubble.experiments.sweep as sweep_mod

    def stopped(spec, out, workers, rows, flag=None, max_share=None):
        flag.stop_requested = True  # what the calibration run's stop sets
        return "about 0 min (from a run cut short)"

    monkeypatch.setattr(sweep_mod, "estimate", stopped)
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmicro_batches: 40\nstages: [2]\nlrs: [1e-3]\nseeds: [0]\n"
                    "base: {engine: emulator, model: tiny, seq_len: 32}\nmethods:\n  - {label: f, schedule: 1f1b-flush, m: 2}\n")
    res = CliRunner().invoke(cli, ["-q", "sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"])
    assert res.exit_code == 130, res.output
    assert res.stderr.strip().splitlines()[-1] == "s: stopped during the calibration run: no estimate"
    assert "about 0 min" not in res.stdout


def test_simulate_too_many_stages_for_a_v_schedule_names_the_stages_typed_and_the_chunks(tmp_path):
    # --stages is devices: zbv holds 2 chunks per device, so 16 devices need 32 chunks of gpt2-medium's 24 blocks.
    # The most devices named is the most the analytic model accepts (13 where the first and last chunk may hold
    # only the embedding / the head, 12 where every chunk needs a block), checked here against it
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.hardware import get_hardware

    gpt2m, h200 = make_model("gpt2-medium"), get_hardware("h200")

    def most(v, placement):
        fits = []
        for k in range(1, 17):
            try:
                analytic_model(gpt2m, k, h200, 16, virtual=v, placement=placement)
                fits.append(k)
            except ConfigError:
                pass
        assert fits == list(range(1, len(fits) + 1))  # a limit, not a gap
        return fits[-1]

    zbv, il3 = most(2, "v"), most(3, "loop")
    assert zbv in (12, 13) and il3 == 8  # 24 blocks: 2·12 ≤ 24 (+ 2 bare ends); 3·8 ≤ 24 < 3·9 − 2
    out = ["--out", str(tmp_path / "sim")]
    assert _error(["simulate", "--schedule", "zbv", "--stages", "16", "--m", "32", *out]) == (
        f"stages=16 with 2 chunks per device needs 32 chunks, but gpt2-medium has 24 blocks: at most {zbv} stages "
        f"for zbv (set --stages {zbv} or less, or pick a deeper --model)")
    assert _error(["simulate", "--schedule", "interleaved-1f1b", "--v", "3", "--stages", "10", "--m", "20", *out]) == (
        "stages=10 with 3 chunks per device needs 30 chunks, but gpt2-medium has 24 blocks: at most 8 stages for "
        "interleaved-1f1b (set --stages 8 or less, or pick a deeper --model)")


def test_simulate_layers_per_stage_of_a_v_schedule_counts_chunks(tmp_path):
    out = ["--out", str(tmp_path / "sim")]
    assert _error(["simulate", "--schedule", "zbv", "--stages", "4", "--m", "8", "--layers-per-stage", "6,6,6,6",
                   *out]) == (
        "layers_per_stage=6,6,6,6 is invalid for zbv: stages=4 with 2 chunks per device needs 8 block counts, one "
        "per chunk in pipeline order (set --layers-per-stage)")
    assert _error(["simulate", "--schedule", "zbv", "--stages", "4", "--m", "8", "--compare", "1f1b-flush",
                   "--layers-per-stage", "3,3,3,3,3,3,3,3", *out]) == (
        "layers_per_stage=3,3,3,3,3,3,3,3 is invalid with --compare: one list of block counts fits one chunk count, "
        "but at stages=4 zbv has 8, 1f1b-flush has 4 (compare schedules with as many chunks, or drop "
        "--layers-per-stage)")


def test_schedules_export_to_a_missing_folder_is_one_line(tmp_path):
    out = tmp_path / "nonexist" / "dir" / "zbv.csv"
    assert _error(["schedules", "--export", "zbv", "--stages", "2", "--m", "4", str(out)]) == (
        f"out={str(out)!r} is invalid: the folder {str(out.parent)!r} does not exist (create it first, or write to an "
        "existing folder; '-' or no OUT prints to stdout)")
    assert not out.parent.exists()


def test_schedules_export_refuses_v_where_the_schedule_takes_none():
    assert _error(["schedules", "--export", "zbv", "--stages", "2", "--m", "4", "--v", "3"]) == (
        "v=3 does not apply to schedule='zbv', which always holds two chunks per device in a V: only "
        "interleaved-1f1b, looped-bfs, interleaved-zb take --v (virtual stages per device); drop --v or change --export")
    assert _error(["schedules", "--export", "1f1b-flush", "--stages", "2", "--m", "4", "--v", "2"]) == (
        "v=2 has no effect on schedule='1f1b-flush': only interleaved-1f1b, looped-bfs, interleaved-zb take --v "
        "(virtual stages per device); drop --v or change --export")
    res = CliRunner().invoke(cli, ["-q", "schedules", "--export", "interleaved-1f1b", "--stages", "2", "--m", "4",
                                   "--v", "3"])
    assert res.exit_code == 0, res.output  # a schedule that takes it


def test_schedules_export_without_stages_says_export_needs_them():
    assert _error(["schedules", "--export", "zbv", "--m", "4"]) == (
        "--export zbv needs --stages: the exported step is one of N ranks and m micro-batches, e.g. unbubble "
        "schedules --export zbv --stages 4 --m 8 out.csv")
    assert _error(["schedules", "--export", "zbv"]) == (
        "--export zbv needs --stages and --m: the exported step is one of N ranks and m micro-batches, e.g. unbubble "
        "schedules --export zbv --stages 4 --m 8 out.csv")


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_train_v_given_to_a_v_shaped_schedule_says_it_always_holds_two_chunks(cache_dir, schedule):
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--schedule", schedule,
                   "--v", "2"]) == (
        f"v=2 does not apply to schedule={schedule!r}, which always holds two chunks per device in a V: only "
        "interleaved-1f1b, looped-bfs, interleaved-zb take --v (virtual stages per device); drop --v or change "
        "--schedule")


def _hf_folder(path, **changes):
    """A tiny GPT-2 config folder (random init) with ``changes`` to its config.json (``None`` removes a key)."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=257,
                                     bos_token_id=0, eos_token_id=0).to_dict()
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_bad_hf_model_inputs_are_one_line_each(tmp_path, cache_dir):
    """--model hf: with a T5 config, invalid JSON, no model_type, a family transformers has no causal LM for,
    a damaged or cut-short model.safetensors, a file instead of a folder (issue 33 item 7): each used to end
    in a 44–70-line transformers traceback."""
    import transformers

    t5 = tmp_path / "t5"
    transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=257).save_pretrained(t5)
    broken = _hf_folder(tmp_path / "broken")
    (broken / "config.json").write_text('{"model_type": "gpt2",')
    untyped = _hf_folder(tmp_path / "untyped", model_type=None)
    unknown = _hf_folder(tmp_path / "unknown", model_type="no-such-family")
    damaged = _hf_folder(tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes(b"not a safetensors file")
    good = tmp_path / "good"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**json.loads((damaged / "config.json").read_text()))
                                 ).save_pretrained(good)
    cut = _hf_folder(tmp_path / "cut")
    data = (good / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    run = ["train", "--engine", "emulator", "--steps", "1", "--stages", "2", "--seq-len", "12", "--eval-interval", "0",
           "--cache-dir", cache_dir, "--run-dir", str(tmp_path / "run"), "--model"]
    decoders = "unbubble trains decoder-only causal language models (GPT-2, Llama, Qwen, Mistral, …)"
    cases = {
        f"hf:{t5}": f"model='hf:{t5}' is invalid: model_type='t5' is an encoder-decoder model (is_encoder_decoder: "
                    f"true): {decoders}",
        f"hf:{broken}": f"model='hf:{broken}' is invalid: '{broken}/config.json' is not valid JSON (Expecting property "
                        "name enclosed in double quotes at line 1, column 23): fix it, or write it again with "
                        "config.save_pretrained",
        f"hf:{untyped}": f"model='hf:{untyped}' is invalid: '{untyped}/config.json' has no \"model_type\" (a Hugging "
                         "Face config names its family, e.g. \"model_type\": \"llama\"): write it with "
                         "config.save_pretrained",
        f"hf:{unknown}": f"model='hf:{unknown}' is invalid: model_type='no-such-family' has no causal language model "
                         f"class in transformers {transformers.__version__} (AutoModelForCausalLM does not know it): "
                         f"{decoders}",
        f"hf:{damaged}": f"model='hf:{damaged}' is invalid: '{damaged}/model.safetensors' is not a readable "
                         "safetensors file (its header is damaged or the file is cut short): save or download the "
                         "weights again",
        f"hf:{cut}": f"model='hf:{cut}' is invalid: '{cut}/model.safetensors' is not a readable safetensors file (its "
                     "header is damaged or the file is cut short): save or download the weights again",
        f"hf:{good}/model.safetensors": f"model='hf:{good}/model.safetensors' is invalid: '{good}/model.safetensors' "
                                        "is a file, not a folder: give --model hf:FOLDER (a Hugging Face model folder "
                                        "with config.json) or hf:FOLDER/config.json",
    }
    for spec, message in cases.items():
        assert _error([*run, spec]) == message
    assert not (tmp_path / "run").exists()


# issue 37, item 5: messages that pointed the wrong way ---------------------------------------------------------

def test_zbv_with_too_many_stages_does_not_advise_lowering_v(cache_dir):
    """Was: "... (lower --v or --stages, or pick a deeper --model)", and zbv refuses --v."""
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--schedule", "zbv", "--stages", "3",
                   "--m", "2", "--seq-len", "16"]) == (
        "stages=3 is invalid: zbv holds 2 chunks per device in a V, so it needs stages × 2 = 6 model chunks but model "
        "'tiny' has 4 layers (set --stages ≤ 2, or pick a deeper --model)")


def test_tied_weights_on_the_command_line_name_the_flag(tmp_path, cache_dir):
    """Was: "... pass untie=True to train two copies ..." (train_model's argument, not a flag)."""
    tied = _hf_folder(tmp_path / "tied")
    assert _error(["train", "--engine", "emulator", "--steps", "1", "--stages", "2", "--seq-len", "12",
                   "--eval-interval", "0", "--cache-dir", cache_dir, "--run-dir", str(tmp_path / "run"),
                   "--model", f"hf:{tied}"]) == (
        "transformer.wte.weight (stage 0) and lm_head.weight (stage 1) are one tied tensor on two stages, which "
        "asynchronous stages cannot share: pass --untie to train two copies (with a warning), or untie them in the "
        "model (e.g. tie_word_embeddings=False)")


def test_plan_seq_len_zero_names_the_option():
    """Was: "block_size=0 is invalid: must be an integer >= 1" (the model's internal name)."""
    assert _error(["plan", "--seq-len", "0"]) == "seq_len=0 is invalid: must be an integer ≥ 1 (set --seq-len)"
    assert _error(["simulate", "--model", "zb-1.5b", "--seq-len", "0"]) == \
        "seq_len=0 is invalid: must be an integer ≥ 1 (set --seq-len)"  # was taken as the default


def test_untie_with_a_preset_is_refused(cache_dir):
    """Was: silently ignored."""
    assert _error(["train", "--engine", "emulator", "--cache-dir", cache_dir, "--untie"]) == (
        "untie=True has no effect on model='tiny': a preset's head is untied from its embedding whenever the two "
        "sit on different stages; --untie is for hf:PATH and module:function models (drop --untie)")


def test_a_model_module_in_the_current_folder_is_found(tmp_path, cache_dir, monkeypatch):
    """Was: "model='mymods:build' is invalid: ModuleNotFoundError: No module named 'mymods'" (the console
    script's path starts with its own folder; python -m starts with the current one)."""
    import sys

    (tmp_path / "mymods.py").write_text(
        "import transformers\n\n\ndef build():\n"
        "    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, "
        "n_positions=32, vocab_size=257, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymods", raising=False)
    res = CliRunner().invoke(cli, ["-q", "train", "--model", "mymods:build", "--engine", "emulator", "--steps", "1",
                                   "--stages", "2", "--seq-len", "12", "--eval-interval", "0", "--eval-batches", "1",
                                   "--cache-dir", cache_dir, "--run-dir", str(tmp_path / "run"), "--no-tensorboard"])
    sys.modules.pop("mymods", None)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_done"] == 1


def test_simulate_dualpipev_runs_on_its_default_m(tmp_path):
    """Was: "m=8 is invalid for dualpipev with stages=8: it needs m ≥ 2N = 16 ..." with no --m given."""
    res = CliRunner().invoke(cli, ["-q", "simulate", "--schedule", "dualpipev", "--micro-batches", "32", "--format",
                                   "csv", "--out", str(tmp_path / "sim")])
    assert res.exit_code == 0, res.output
    assert "dualpipev (m=16)" in (tmp_path / "sim" / "summary.csv").read_text()
    assert _error(["simulate", "--schedule", "dualpipev", "--m", "8", "--out", str(tmp_path / "sim2")]) == (
        "m=8 is invalid for dualpipev with stages=8: it needs m ≥ 2N = 16 micro-batches per step (2 chunks per rank, "
        "as torch requires; set --m)")


# issue 37, item 6: what a fresh user's trial found ------------------------------------------------------------

def test_schedule_names_ignore_case_as_torch_does(tmp_path):
    """Was: "schedule='PACI' is unknown (did you mean 'paci'?)" (torch's get_schedule_class ignores case)."""
    res = CliRunner().invoke(cli, ["-q", "train", "--schedule", "PACI", "--print-config"])
    assert res.exit_code == 0, res.output
    assert "\nschedule: paci\n" in res.output
    res = CliRunner().invoke(cli, ["-q", "simulate", "--schedule", "ZBV", "--compare", "1F1B-Flush", "--format", "csv",
                                   "--out", str(tmp_path / "sim")])
    assert res.exit_code == 0, res.output
    assert "zbv" in (tmp_path / "sim" / "summary.csv").read_text()


def test_an_abbreviated_engine_gets_the_name_it_begins():
    """Was: "engine='emu' is unknown: valid engines are ..." with no suggestion."""
    assert _error(["train", "--engine", "emu"]) == (
        "engine='emu' is unknown (did you mean 'emulator'?): valid engines are emulator, processes (set --engine)")


def test_auto_on_the_command_line_means_what_it_means_in_a_config_file():
    """Was: "Invalid value for '--error-feedback': 'auto' is not a valid float." and "clip_scope='auto' is
    invalid" although --print-config writes auto for both."""
    def config(*args):
        res = CliRunner().invoke(cli, ["-q", "train", *args, "--print-config"])
        assert res.exit_code == 0, res.output
        return res.output

    assert "\nerror_feedback: auto\n" in config("--schedule", "1f1b-flush", "--error-feedback", "auto")
    assert "\nerror_feedback: 0.5\n" in config("--error-feedback", "0.5")
    assert "\nclip_scope: auto\n" in config("--clip-grad-norm", "1", "--clip-scope", "AUTO")
    res = CliRunner().invoke(cli, ["-q", "train", "--error-feedback", "x", "--print-config"])
    assert res.exit_code == 2 and "'x' is neither auto nor a float" in res.output


def test_too_many_stages_for_a_hf_model_name_the_flag(tmp_path, cache_dir):
    """Was: "n_stages=4 is invalid: must be 1…2 (the model has 2 layers) or give cuts=[…]" (split_model's
    arguments, not flags)."""
    folder = _hf_folder(tmp_path / "gpt2", tie_word_embeddings=False)
    run = ["train", "--engine", "emulator", "--steps", "1", "--seq-len", "12", "--eval-interval", "0",
           "--cache-dir", cache_dir, "--run-dir", str(tmp_path / "run"), "--model", f"hf:{folder}"]
    assert _error([*run, "--stages", "4"]) == (
        f"stages=4 is invalid: model 'hf:{folder}' has 2 layers (set --stages ≤ 2, or give a deeper model)")
    assert _error([*run, "--stages", "2", "--schedule", "zbv", "--m", "4"]) == (
        f"stages=2 is invalid: model 'hf:{folder}' has 2 layers: zbv needs stages × 2 = 4 model chunks (set "
        "--stages ≤ 1, or give a deeper model)")
    assert not (tmp_path / "run").exists()


def test_a_stop_before_the_first_step_ends_the_progress_line(monkeypatch):
    """Was: the bar stayed open, so the 'interrupted before the first step' line was written onto it."""
    import unbubble.train
    from unbubble.progress import ProgressListener

    closed = []
    monkeypatch.setattr(ProgressListener, "close", lambda self: closed.append(self))

    def stopped(cfg=None, listener_factory=None, **kwargs):
        class Writer:
            resume_step = 0
        listener_factory(Writer(), 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(unbubble.train, "train", stopped)
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator"])
    assert res.exit_code != 0
    assert len(closed) == 1
    assert "interrupted before the first step; nothing of the new run was kept" in res.stderr


def test_a_choice_in_another_case_is_that_choice(tmp_path):
    """Was: "optimizer='MUON' is invalid (did you mean 'muon'?)" — suggesting the word it refused."""
    res = CliRunner().invoke(cli, ["-q", "train", "--optimizer", "MUON", "--engine", "EMULATOR", "--precision", "FP32",
                                   "--order", "Dynamic", "--schedule", "1F1B-Flush", "--print-config"])
    assert res.exit_code == 0, res.output
    for line in ("optimizer: muon", "engine: emulator", "precision: fp32", "order: dynamic", "schedule: 1f1b-flush"):
        assert f"\n{line}\n" in res.output
    res = CliRunner().invoke(cli, ["-q", "simulate", "--uniform", "1:2", "--recompute", "FULL", "--format", "CSV",
                                   "--out", str(tmp_path / "sim")])
    assert res.exit_code == 0, res.output


def test_plan_names_why_the_model_does_not_split_at_that_depth():
    """Was: "no configuration of zbv runs at stages [8] with 2048 sequences per update: give more tokens per batch,
    other --stages or more schedules" (more tokens changed nothing: tiny has 4 blocks)."""
    assert _error(["plan", "--model", "tiny", "--schedules", "paci", "--stages", "8"]) == (
        "no configuration of paci runs at stages [8]: stages=8 is invalid: the model has 4 layers, so stages must be "
        "in 1..4 (set --stages or pick a deeper --model)")


def test_simulate_refuses_before_writing_and_simulates_each_schedule_once(tmp_path):
    """Was: a refused --compare left the timelines of the schedules before it in --out; 'paci, PACI' ran twice."""
    assert _simulate(tmp_path, "--schedule", "1f1b-flush", "--compare", "paci,zbv").startswith(
        "schedule='zbv' has 16 virtual stages")
    assert not (tmp_path / "sim").exists()
    res = CliRunner().invoke(cli, ["-q", "simulate", "--uniform", "1:2", "--schedule", "paci", "--compare",
                                   "paci, PACI,1f1b-flush", "--format", "csv", "--out", str(tmp_path / "sim2")])
    assert res.exit_code == 0, res.output
    rows = (tmp_path / "sim2" / "summary.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == ["paci (a=8)", "1f1b-flush (m=8)"]


def test_auto_in_any_case_in_a_config_file_and_in_a_sweep_spec(tmp_path):
    """Was: "error_feedback='AUTO' has the wrong type str: expected a number" in a config file, and a sweep spec's
    clip_scope: auto refused ("has no effect without clip_grad_norm" / "must be one of sync, stale, stage")."""
    from unbubble.config import load_config
    from unbubble.experiments.sweep import RunSpec, SweepSpec

    (tmp_path / "c.yaml").write_text("schedule: paci\nerror_feedback: AUTO\nclip_grad_norm: 1.0\nclip_scope: Auto\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.error_feedback, cfg.clip_scope) == (1.0, "stale")
    spec = SweepSpec.from_dict({
        "name": "t", "micro_batches": 4, "stages": [2], "lrs": [1e-3], "seeds": [0],
        "base": {"model": "tiny", "seq_len": 16, "micro_batch_size": 2, "eval_batches": 1, "warmup_min": 0},
        "methods": [{"label": "flush", "schedule": "1f1b-flush", "m": 2, "clip_scope": "auto"},
                    {"label": "paci", "schedule": "paci", "a": 2, "clip_grad_norm": 1.0, "clip_scope": "AUTO",
                     "error_feedback": "auto"}]})
    flush, paci = (spec.config(RunSpec(m.label, m.overrides, 2, 1e-3, 0, "tune"), tmp_path) for m in spec.methods)
    assert (flush.clip_scope, flush.error_feedback) == (None, 0.0)
    assert (paci.clip_scope, paci.error_feedback) == ("stale", 1.0)


def test_predict_fits_the_terminal_and_says_what_an_emulator_run_measured(tmp_path, cache_dir, monkeypatch):
    """Was: a 128-column table (the console was fixed at 160) whose 'measured util.' of an emulator
    run (stages one after another in one process) read as a device's."""
    run = tmp_path / "run"
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--steps", "2", "--seq-len", "32",
                                   "--eval-batches", "1", "--run-dir", str(run), "--cache-dir", cache_dir,
                                   "--no-tensorboard"])
    assert res.exit_code == 0, res.output
    monkeypatch.setenv("COLUMNS", "100")
    res = CliRunner().invoke(cli, ["predict", str(run)])
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 100
    assert " ".join(res.output.split()).endswith(
        "An emulator run: its 4 stages ran one after another in one process, so the measured makespan and "
        "utilization are no device's; the predicted columns are its schedule on 4 devices at the measured action "
        "durations.")
    # and its prediction is the utilization `unbubble train` reported (was 0.54 against 0.81: the gaps between
    # serial stages were calibrated as link latencies and sends)
    res = CliRunner().invoke(cli, ["predict", str(run), "--statistic", "median", "--format", "csv"])
    lines = res.stdout.splitlines()
    rows = [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:5]]
    reported = json.loads((run / "summary.json").read_text())["simulated_utilization"]
    assert [float(r["predicted_utilization"]) for r in rows] == pytest.approx(reported, rel=1e-9)


# issue 42 item 5: the messages a new user met --------------------------------------------------------------------


def test_an_empty_run_dir_is_refused_as_empty():
    """Before: "'.' already exists"."""
    assert _error(["train", "--run-dir", ""]) == \
        "run_dir='' is empty: give a folder name, or leave --run-dir out for runs/<time>-<schedule>-N<stages>"


def test_a_sequence_too_long_names_flags_that_exist():
    """Before: "use shorter sequences or a larger --block-size" (there is no --block-size)."""
    import torch

    from unbubble.models import make_config
    from unbubble.models.gpt2 import GPTStage

    stage = GPTStage(make_config("tiny", 257), range(4), True, True, 0)
    with pytest.raises(ValueError) as exc:
        stage(torch.zeros(1, 129, dtype=torch.long))
    assert str(exc.value) == ("sequence length T=129 exceeds block_size=128 (set --seq-len ≤ 128, or pick a --model "
                              "with more positions)")


def test_plan_suggests_two_different_batch_sizes():
    """Before: "e.g. 1024 or 1024" for a batch smaller than one sequence."""
    assert _error(["plan", "--model", "gpt2", "--gpus", "8xH200", "--global-batch-tokens", "100"]) == \
        ("global_batch_tokens=100 is not a multiple of seq_len=1024: a batch holds whole sequences, e.g. 1024 (one "
         "sequence) or more (set --global-batch-tokens or --seq-len)")
    assert _error(["plan", "--model", "gpt2", "--gpus", "8xH200", "--global-batch-tokens", "3000"]) == \
        ("global_batch_tokens=3000 is not a multiple of seq_len=1024: a batch holds whole sequences, e.g. 2048 or "
         "3072 (set --global-batch-tokens or --seq-len)")


def test_eval_interval_zero_has_a_documented_meaning():
    res = CliRunner().invoke(cli, ["train", "--help"], terminal_width=200)
    assert "Evaluate the version-v weights every this many steps, at step 0 and at the end (0: at step 0 and the " \
           "end only)." in " ".join(res.output.split())


def test_a_factory_that_needs_arguments_is_refused(tmp_path, monkeypatch):
    """Before: a TypeError traceback from inside the call."""
    (tmp_path / "needs_args.py").write_text("import torch\ndef make(width, depth=2):\n    return torch.nn.Linear(width, width)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _error(["train", "--model", "needs_args:make", "--engine", "emulator"]) == \
        ("model='needs_args:make' is invalid: needs_args.make needs argument(s) width; --model module:function calls "
         "it with none (give a function that takes no arguments, e.g. one that calls make(...) with yours)")


def test_ctrl_c_during_an_experiments_analysis_stops_it_at_once(tmp_path, monkeypatch):
    """Before: a first Ctrl-C after the last run set a flag nothing read: the analysis went on without a word."""
    import unbubble.experiments as experiments
    from unbubble.experiments.sweep import OutsideARun, stop_handlers, training

    def analysis(folder, size, seeds):  # what a study does after its last run
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
        raise AssertionError("the signal was ignored")

    monkeypatch.setattr(experiments, "get_experiment", lambda name: analysis)
    res = CliRunner().invoke(cli, ["experiment", "throughput-memory", "--out", str(tmp_path)])
    assert res.exit_code == 130, res.output
    assert res.stderr.strip() == ("throughput-memory: stopped at once (SIGINT while no run was training: the plan or "
                                  f"the analysis); throughput-memory does not resume: remove {tmp_path / 'throughput-memory'} "
                                  "or choose another --out to start it again")
    with stop_handlers() as flag, training():  # while a run trains, the first signal asks it to stop at a step
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        assert flag.stop_requested
    with pytest.raises(OutsideARun):
        with stop_handlers():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
