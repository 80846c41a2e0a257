"""`unbubble report`: pictures and markdown for several runs; bad run folders give one line and exit 2."""

import json
import logging

import pytest
import torch
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.config import TrainConfig
from unbubble.train import train


@pytest.fixture(autouse=True, scope="module")
def quiet_single_thread():
    threads, logger = torch.get_num_threads(), logging.getLogger("unbubble")
    saved = logger.handlers[:], logger.level, logger.propagate
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    common = dict(engine="emulator", stages=2, steps=4, eval_interval=2, eval_batches=1, seq_len=32,
                  cache_dir=str(root / "cache"), tensorboard=False)
    paci = TrainConfig(schedule="paci", a=2, run_dir=str(root / "paci"), **common)
    flush = TrainConfig(schedule="1f1b-flush", m=2, run_dir=str(root / "flush"), **common)
    return [train(cfg)[1] for cfg in (paci, flush)]


def test_report_draws_two_runs(two_runs, tmp_path):
    out = tmp_path / "report"
    res = CliRunner().invoke(cli, ["report", *map(str, two_runs), "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("loss_vs_tokens.png", "loss_vs_time.png", "drift.png", "utilization.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 10_000
    md = (out / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| paci") or line.startswith("| flush")]
    assert len(rows) == 2 and "| 1.00× |" in rows[0]
    assert "[1, 0] ([1, 0])" in rows[0] and "[0, 0] ([0, 0])" in rows[1]  # max Δ beside the bound
    assert "![drift](drift.png)" in md
    assert "| paci | paci | 2 | 2 | muon | emulator | 4 |" in res.stdout


def test_report_writes_into_the_run_folder_or_runs_by_default(two_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["report", str(two_runs[0])])
    assert res.exit_code == 0, res.output
    assert (two_runs[0] / "report" / "report.md").is_file()
    res = CliRunner().invoke(cli, ["report", *map(str, two_runs)])
    assert res.exit_code == 0, res.output
    (made,) = (tmp_path / "runs").iterdir()
    assert made.name.endswith("-report") and (made / "report.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing else in the working folder


def test_report_of_the_same_folder_twice_gets_distinct_labels(two_runs, tmp_path):
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(two_runs[0]), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "#1" in res.stdout and "#2" in res.stdout


@pytest.mark.parametrize("breakage, message", [
    ("missing", "is not a folder: give folders that `unbubble train` wrote"),
    ("unfinished", "is not a finished run folder: summary.json, actions.jsonl missing"),
    ("malformed", "holds malformed JSON"),
    ("no-steps", "records no training step"),
])
def test_bad_run_folder_one_line_exit_2(two_runs, tmp_path, breakage, message):
    bad = tmp_path / "bad"
    if breakage != "missing":
        bad.mkdir()
        for name in ("config.json", "summary.json", "metrics.jsonl", "actions.jsonl"):
            (bad / name).write_text((two_runs[0] / name).read_text())
    if breakage == "unfinished":
        (bad / "summary.json").unlink()
        (bad / "actions.jsonl").unlink()
    elif breakage == "malformed":
        (bad / "metrics.jsonl").write_text("{not json\n")
    elif breakage == "no-steps":
        (bad / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 5.0}) + "\n")
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(bad), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_report_needs_a_run():
    res = CliRunner().invoke(cli, ["report"])
    assert res.exit_code == 2 and "Missing argument 'RUN_DIRS...'" in res.output
