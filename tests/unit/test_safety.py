"""Nothing lost, nothing silently wrong (issue 42): every export loads into the right model or is
refused, a diverged run fails, a run folder belongs to one process, operating-system errors in one
line with nothing half-written, and a memory estimate before a model is built."""

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.errors import ConfigError

TINY = ["--engine", "emulator", "--stages", "2", "--seq-len", "32", "--micro-batch-size", "2", "--eval-batches", "2",
        "--no-tensorboard"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(f"And God said, let there be light {i}; and there was light {i * 7 % 13}.\n"
                            for i in range(1500)))
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _cli(*args: str):
    return CliRunner().invoke(cli, ["-q", *args])


def _one_line(res, status: int, warnings: bool = False) -> str:
    """The one error line of a refused command (after the guard's warnings, with ``warnings``)."""
    assert res.exit_code == status, res.output
    lines = res.stderr.strip().splitlines()
    if warnings:
        assert not any(ln.startswith("error: ") for ln in lines[:-1]), res.stderr
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0].removeprefix("error: ")


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, cache_dir):
    """The default-like preset run: tiny, PACI, 2 stages (so wte and lm_head train apart), 6 steps."""
    run_dir = tmp_path_factory.mktemp("runs") / "A"
    res = _cli("train", *TINY, "--steps", "6", "--eval-interval", "6", "--corpus", corpus, "--cache-dir", cache_dir,
               "--run-dir", str(run_dir))
    assert res.exit_code == 0, res.output
    return run_dir


# item 1: every export loads into the right model or is refused --------------------------------------------


def _val_loss(model, run_dir: Path) -> float:
    """The model's loss (torch's own cross-entropy) on the run's own validation batches."""
    from unbubble.data import prepare_tokens, val_batches

    cfg = json.loads((run_dir / "config.json").read_text())
    tokens = prepare_tokens(cfg["corpus"], cfg["tokenizer"], Path(cfg["cache_dir"]))
    batches = val_batches(tokens.val, cfg["micro_batch_size"], cfg["seq_len"], cfg["eval_batches"], warn=False)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    return sum(losses) / len(losses)


def test_a_preset_export_loads_into_the_right_model_and_a_tied_one_is_refused(run, tmp_path):
    """Issue 42 item 1: before, the only whole model of a preset tied lm_head to wte and kept one of the
    two trained tensors (loss 3.52 against the run's 2.27 after 60 steps); now unbubble.export.load builds
    it untied and its loss on the run's validation text is the run's own."""
    from unbubble.export import export_record, load, load_export, sample
    from unbubble.models import make_config
    from unbubble.models.gpt2 import GPTStage

    assert not (run / ".lock").exists()  # released when the run ended
    res = _cli("export", str(run), str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    path = tmp_path / "out" / "model.pt"
    assert export_record(path) == {"model": "tiny", "tokenizer": "byte", "seed": 0, "vocab_size": 257,
                                   "untied": [["wte.weight", "lm_head.weight"]]}
    run_loss = json.loads((run / "summary.json").read_text())["final_val_loss"]
    for source in (path, tmp_path / "out", run):  # the file, its folder, the run itself
        model = load(source)
        assert model.lm_head.weight is not model.wte.weight
        assert _val_loss(model, run) == pytest.approx(run_loss, rel=1e-6, abs=1e-6), source
    text = sample(model, "And God said", tokens=20, seed=1)
    assert text.startswith("And God said") and text == sample(model, "And God said", tokens=20, seed=1)
    assert len(sample(model, "And", tokens=5, temperature=0)) >= 3
    tied = GPTStage(make_config("tiny", 257), range(4), True, True, 0)
    with pytest.raises(ConfigError) as plain:  # whatever the path: plain load_state_dict too
        tied.load_state_dict(torch.load(path, weights_only=True))
    assert str(plain.value) == ("this state dict holds wte.weight and lm_head.weight as two different tensors "
                                "(trained untied), but this GPTStage ties them: loading would keep only one; build "
                                "the model untied (unbubble.export.load builds it for you)")
    with pytest.raises(ConfigError, match="trained untied"):
        load_export(tied, path)
    assert tied.load_state_dict(tied.state_dict())  # a tied model's own state loads as before


def test_load_refuses_what_it_cannot_build(tmp_path):
    from unbubble.export import load, sample

    torch.save({"w": torch.zeros(2)}, tmp_path / "bare.pt")
    with pytest.raises(ConfigError) as exc:
        load(tmp_path / "bare.pt")
    assert str(exc.value) == (f"{str(tmp_path / 'bare.pt')!r} does not say what model it is (written by an older "
                              "unbubble export, or not by unbubble export): build the model yourself and load it with "
                              "unbubble.export.load_export(model, path)")
    (tmp_path / "junk.pt").write_text("not a tensor file")
    with pytest.raises(ConfigError, match="is not a state dict unbubble export wrote"):
        load(tmp_path / "junk.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="sample needs a tokenizer"):
        sample(torch.nn.Identity(), "x")


# item 2: a diverged run fails -----------------------------------------------------------------------------


def test_a_diverged_run_fails_in_one_line_and_its_summary_says_so(tmp_path, corpus, cache_dir):
    """Issue 42 item 2: --lr 1e6 gave a NaN validation loss, exit 0 and "asynchrony pays"."""
    run_dir = tmp_path / "D"
    res = _cli("train", *TINY, "--steps", "4", "--eval-interval", "2", "--lr", "1e6", "--corpus", corpus,
               "--cache-dir", cache_dir, "--run-dir", str(run_dir))
    line = _one_line(res, 1, warnings=True)
    assert line.startswith("training diverged at step 2: the validation loss is nan after the non-finite guard "
                           "(skip) dropped ") and line.endswith(
        f"micro-batch(es); start again with a lower --lr (this run: 1e+06) or --nan-policy lower-lr; "
        f"{run_dir}/summary.json says diverged"), line
    assert "pays" not in res.output and "break-even" not in res.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["diverged"], summary["steps_done"], summary["error"]) == \
        ("diverged", True, 2, line)
    assert not (run_dir / ".lock").exists()


def test_a_sweep_records_a_diverged_run_and_goes_on(tmp_path, corpus, cache_dir):
    from unbubble.config import TrainConfig
    from unbubble.train import train

    cfg = TrainConfig(engine="emulator", stages=2, seq_len=32, micro_batch_size=2, eval_batches=1, steps=2,
                      eval_interval=1, lr=1e6, corpus=corpus, cache_dir=cache_dir, tensorboard=False,
                      run_dir=str(tmp_path / "R"), checkpoints=False)
    result, run_dir = train(cfg, on_divergence="record")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps_done"] == 2 and result is not None


# item 3: a run folder belongs to one process --------------------------------------------------------------


def _lock_of(pid: int) -> dict:
    return {"pid": pid, "host": socket.gethostname(), "started": "2026-01-01 00:00:00"}


def test_a_second_writer_is_refused_naming_the_first(run):
    """Issue 42 item 3: --resume of a run still training was accepted; both processes wrote
    metrics.jsonl and the run lost its summary."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / ".lock").write_text(json.dumps(_lock_of(other.pid)))
        before = (run / "metrics.jsonl").read_text()
        line = _one_line(_cli("train", "--resume", str(run), "--engine", "emulator"), 2)
        assert line == (f"run folder {str(run)!r} is in use by process {other.pid} on {socket.gethostname()} "
                        "(started 2026-01-01 00:00:00): one process writes a run folder at a time; wait for it to end "
                        f"(or stop it), or if it is gone remove {str(run / '.lock')!r}")
        assert (run / "metrics.jsonl").read_text() == before  # nothing touched
    finally:
        other.kill()
        other.wait()
        (run / ".lock").unlink()


def test_a_stale_lock_is_taken_over_and_the_lock_is_exclusive(tmp_path, caplog):
    from unbubble.safety import RunLock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps(_lock_of(dead.pid)))
    with RunLock(tmp_path) as lock:
        assert f"removing the stale lock of process {dead.pid}" in caplog.text
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=f"is in use by process {os.getpid()} "):
            RunLock(tmp_path)  # even this process's second writer
        assert lock.held
    assert not (tmp_path / ".lock").exists()


# item 4: operating-system errors in one line, nothing half-written, memory -----------------------------------


def test_export_onto_a_full_disk_says_so_and_leaves_nothing(run, tmp_path, monkeypatch):
    """Issue 42 item 4: a full disk during an export printed torch's '[enforce fail at
    inline_container.cc:672] unexpected pos' traceback; now one line and no file (a real ENOSPC:
    the temporary file is /dev/full)."""
    import unbubble.safety as safety

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    monkeypatch.setattr(safety, "open", lambda path, mode="r": open("/dev/full", mode), raising=False)
    out = tmp_path / "out"
    line = _one_line(_cli("export", str(run), str(out)), 1)
    assert line == f"cannot write {str(out / 'model.pt')!r}: no space left on device (ENOSPC)"
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("code,words", [(errno.EROFS, "read-only file system (EROFS)"),
                                        (errno.EACCES, "permission denied (EACCES)")])
def test_export_into_a_folder_it_may_not_write(run, tmp_path, monkeypatch, code, words):
    """Tests run as root, whom chmod does not stop: the error comes from a monkeypatched open."""
    import unbubble.safety as safety

    def refuse(path, mode="r"):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(safety, "open", refuse, raising=False)
    out = tmp_path / "ro"
    assert _one_line(_cli("export", str(run), str(out)), 1) == f"cannot write {str(out / 'model.pt')!r}: {words}" \
        if code == errno.EROFS else f"file system error on {str(out / 'model.pt')!r}: {words}"


def test_paths_under_a_file_and_overlong_names(run, tmp_path, corpus, cache_dir):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert _one_line(_cli("export", str(run), str(afile / "out")), 1) == \
        f"file system error on {str(afile / 'out')!r}: a part of the path is a file, not a folder (ENOTDIR)"
    long = tmp_path / ("r" * 300)
    line = _one_line(_cli("train", *TINY, "--steps", "1", "--corpus", corpus, "--cache-dir", cache_dir,
                          "--run-dir", str(long)), 1)
    assert line == f"file system error on {str(long)!r}: file name too long (ENAMETOOLONG)"


def test_a_checkpoint_onto_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch):
    from unbubble.runtime import checkpoint
    from unbubble.safety import os_error_line

    checkpoint.save_stage(tmp_path, 2, 0, {"x": torch.zeros(3)})
    real_open = open
    monkeypatch.setattr(checkpoint, "open", lambda p, mode="r": real_open("/dev/full", mode), raising=False)
    with pytest.raises(OSError) as exc:
        checkpoint.save_stage(tmp_path, 4, 0, {"x": torch.zeros(3)})
    path = checkpoint.stage_path(tmp_path, 4, 0)
    assert os_error_line(exc.value) == \
        f"cannot write checkpoint {str(path)!r}: no space left on device (ENOSPC); the previous checkpoint is kept"
    assert not list(path.parent.iterdir())
    assert checkpoint.stage_path(tmp_path, 2, 0).is_file()


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(corpus, cache_dir, tmp_path, monkeypatch):
    """Issue 42 item 4: --model llama-8b on a 24 GB machine built until it died."""
    import unbubble.safety as safety

    monkeypatch.setattr(safety, "available_memory_bytes", lambda: 24 * 2**30)
    line = _one_line(_cli("train", "--model", "llama-8b", "--engine", "emulator", "--corpus", corpus,
                          "--cache-dir", cache_dir, "--run-dir", str(tmp_path / "big")), 2, warnings=True)
    assert line == ("model='llama-8b' does not fit this machine's memory: 6.98B parameters on 4 stage(s) need at least "
                    "112.0 GiB (parameters 26.0 GiB, evaluation copy 26.0 GiB, gradients 26.0 GiB, optimizer state "
                    "26.0 GiB, activations 8.0 GiB) but 24.0 GiB is available (pick a smaller --model, or run each "
                    "stage on its own machine with torchrun; `unbubble simulate --model ...` predicts the memory per "
                    "GPU)")
    assert not (tmp_path / "big").exists()


# item 6: the checkout guard checks what a test writes ---------------------------------------------------------


def test_a_users_run_in_the_checkout_meanwhile_is_not_this_tests():
    """Issue 42 item 6: a user training in the same checkout made whichever test was running fail.
    Another process makes a folder in runs/ during this test; the guard (tests/conftest.py) lets it be."""
    from conftest import RUNS

    theirs = RUNS / "20990101-000000-paci-N4-someone-elses"
    existed = RUNS.is_dir()
    subprocess.run(["mkdir", "-p", str(theirs)], check=True)
    try:
        assert theirs.is_dir()
    finally:
        theirs.rmdir()
        if not existed:
            RUNS.rmdir()
