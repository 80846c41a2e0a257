"""The experiments that run real stage processes, in their tiny configuration."""

import csv

import pytest

from unbubble.experiments import get_experiment

pytestmark = pytest.mark.multiproc


def test_throughput_memory_tiny(tmp_path):
    tm = get_experiment("throughput-memory")(tmp_path / "tm", size="tiny")
    rows = {r["schedule"]: r for r in csv.DictReader(open(tm.files[0]))}
    assert float(rows["paci"]["tok/s measured"]) > 0 and float(rows["1f1b-flush"]["tok/s predicted"]) > 0
    assert rows["1f1b-flush"]["peak activations (micro-batches) per stage"] == "[2, 1]"


def test_a_stopped_sweep_starts_nothing_new_exits_130_and_resumes(tmp_path):
    """Issue 28: SIGINT to `unbubble sweep` (twice within 0.25 s, as GNU timeout delivers it)
    while 2 of 3 runs train: the third never starts, the two stop and are not recorded, exit
    130 with one line saying so; the same command again trains all three."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    spec = {"name": "t3", "micro_batches": 96, "stages": [2], "lrs": [1e-3, 3e-3, 1e-2], "seeds": [0],
            "extend_grid": 0, "evals": 1,
            "base": {"model": "tiny", "seq_len": 16, "micro_batch_size": 2, "eval_batches": 1, "warmup_min": 0},
            "methods": [{"label": "flush", "schedule": "1f1b-flush", "m": 2}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "o"
    code = "import sys; from unbubble.cli import main; sys.argv = ['unbubble'] + sys.argv[1:]; main()"
    cmd = [sys.executable, "-c", code, "-q", "sweep", str(tmp_path / "s.yaml"), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = [f"flush-N2-lr{lr:g}-s0" for lr in spec["lrs"]]
    deadline = time.monotonic() + 60
    while not all((out / "runs" / r / "metrics.jsonl").is_file() for r in runs[:2]):  # both train
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # the echo: still the first stop, not "at once"
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert not (out / "runs" / runs[2]).exists()  # queued: never started
    assert not list(out.glob("results/*.json")) and "val loss" not in stdout  # nothing finished, nothing recorded
    assert "t3: stop requested: no new run starts; the 2 running run(s) stop at their next step boundary" in stdout
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"t3: runs stopped before their last step: {runs[0]}, {runs[1]}") or \
        last.startswith(f"t3: runs stopped before their last step: {runs[1]}, {runs[0]}"), last
    assert last.endswith(f"this tune phase: 0 of 3 finished, 1 not started; 0 finished run(s) in {out / 'results'}")
    done = subprocess.run(cmd + ["--workers", "1"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    assert sorted(p.stem for p in out.glob("results/*.json")) == sorted(runs)
