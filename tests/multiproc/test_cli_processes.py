"""``unbubble train`` with stage processes, run as a user runs it (a subprocess and its process
group, as a terminal's Ctrl-C reaches them)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.runtime.checkpoint import complete_steps

pytestmark = pytest.mark.multiproc


def _stage_processes_started(pid: int) -> bool:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return any(b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() for c in children)
    except OSError:
        return False


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(), reason="needs Linux /proc")
def test_ctrl_c_during_start_up_ends_at_once_without_stack_traces_and_keeps_no_half_made_folder(tmp_path):
    (tmp_path / "text.txt").write_text("In the beginning was the word, and the word was with the pipeline. " * 800)
    run_dir = tmp_path / "run"
    args = ["train", "--corpus", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "cache"), "--stages", "2",
            "--steps", "3", "--eval-batches", "1", "--run-dir", str(run_dir)]
    code = "import sys; from unbubble.cli import main; sys.argv = ['unbubble'] + sys.argv[1:]; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not _stage_processes_started(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the launcher and its starting stages
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "frame #" not in err and "Traceback" not in err and "TCPStore" not in err, err
    assert "starting 2 stage processes…" in [line.split(maxsplit=1)[-1].strip() for line in err.splitlines()]
    assert err.strip().splitlines()[-1] == (
        "error: SIGINT before the first step: every stage process was ended (nothing to save; the newest "
        "checkpoint, if any, is unchanged); nothing of the new run was kept")
    assert not run_dir.exists()
    fresh = CliRunner().invoke(cli, ["-q", *args[:-2], "--engine", "emulator", "--run-dir", str(run_dir)])
    assert fresh.exit_code == 0, fresh.output  # the same --run-dir is accepted


def test_ctrl_c_of_a_run_piped_through_tee_still_writes_its_stop_checkpoint(tmp_path):
    # `unbubble train 2>&1 | tee log` and Ctrl-C: tee dies first, so every later console line
    # (the stop warning, the results) meets a closed pipe; the run still stops at a checkpoint
    (tmp_path / "text.txt").write_text("In the beginning was the word, and the word was with the pipeline. " * 800)
    run_dir = tmp_path / "run"
    args = ["train", "--corpus", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "cache"), "--stages", "2",
            "--steps", "100000", "--seq-len", "32", "--eval-interval", "0", "--eval-batches", "1",
            "--no-tensorboard", "--run-dir", str(run_dir)]
    code = "import sys; from unbubble.cli import main; sys.argv = ['unbubble'] + sys.argv[1:]; main()"
    launched = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline and \
            not (metrics.exists() and '"loss"' in metrics.read_text()):
        time.sleep(0.05)
    proc.stdout.close()  # tee has gone
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    ended = time.time()
    summary = json.loads((run_dir / "summary.json").read_text())
    stop = summary["stopped_at_step"]
    assert stop is not None and stop >= 1
    # start-up: from the command's process start to the first step's end on every stage. Bounded by
    # what cannot race: the run's own clock (the stages' first U ends, seconds after the training
    # loop's start, which follows the process start) and the command's whole life seen from here
    # (the clock tick of /proc's start time: 10 ms). The loss line of step 1 is no bound: it is
    # written when the last stage's step ends, before the first stage's backward has come back.
    records = [json.loads(line) for line in (run_dir / "actions.jsonl").read_text().splitlines()]
    first_u = max(min(r["end_s"] for r in records if r["kind"] == "U" and r["stage"] == s) for s in (0, 1))
    assert first_u < summary["startup_s"] <= ended - launched + 0.02
    rss, peak = summary["rss_bytes"], summary["peak_rss_bytes"]
    assert len(rss) == len(peak) == 2 and all(100 * 2**20 < r <= 1.02 * p for r, p in zip(rss, peak))
    assert complete_steps(run_dir / "checkpoints", 2)[-1] == stop
