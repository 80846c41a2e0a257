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
    assert "| paci | tiny | paci | 2 | 2 | muon | emulator | 4/4 |" in md
    assert "(step 4) |" in rows[0] and "Warning" not in md and "WARNING" not in res.stderr  # alike runs
    table = res.stdout.splitlines()[:3]  # the terminal's table (issue 42: 17 columns wrapped into noise)
    assert table[0].split() == ["run", "schedule", "N", "steps", "tokens/s", "speed-up", "final", "val", "loss",
                                "status"]
    assert table[1].split()[:4] == ["paci", "paci", "2", "4/4"] and table[1].endswith("finished")
    assert table[2].split()[:4] == ["flush", "1f1b-flush", "2", "4/4"] and max(map(len, table)) <= 100


def _copy_run(src, dst, config=None, summary=None, last_step=None):
    """A copy of run folder ``src``, its config.json and summary.json updated, metrics.jsonl cut after ``last_step``."""
    dst.mkdir()
    for name in ("config.json", "summary.json", "metrics.jsonl", "actions.jsonl"):
        (dst / name).write_text((src / name).read_text())
    for name, changes in (("config.json", config), ("summary.json", summary)):
        if changes:
            (dst / name).write_text(json.dumps({**json.loads((dst / name).read_text()), **changes}))
    if last_step is not None:
        lines = (dst / "metrics.jsonl").read_text().splitlines()
        (dst / "metrics.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= last_step))
    return dst


def test_report_of_a_stopped_run_shows_steps_done_of_planned_and_the_eval_step(two_runs, tmp_path):
    # evaluated at steps 0 and 2 (eval_interval 2), stopped after step 3 of 4
    stopped = _copy_run(two_runs[0], tmp_path / "stopped", last_step=3,
                        summary=dict(steps_done=3, stopped_at_step=3, tokens=3 * 512, run_tokens=3 * 512))
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(stopped), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "out" / "report.md").read_text()
    (row,) = [line for line in md.splitlines() if line.startswith("| stopped |")]
    assert "| emulator | 3/4 | 1,536 |" in row
    val = dict(json.loads((two_runs[0] / "summary.json").read_text())["val_losses"])  # step -> validation loss
    assert f"| {val[2]:.4f} (step 2) |" in row  # the stopped run's last evaluation, not its planned end
    assert f"| {val[4]:.4f} (step 4) |" in md and row.endswith("| stopped at 3 |")
    lines = res.stdout.splitlines()
    assert lines[1].endswith("(step 4)  finished") and lines[2].endswith("(step 2)  stopped at 3"), res.stdout
    assert "tokens trained (paci 2,048, stopped 1,536)" in (tmp_path / "out" / "report.md").read_text()


def test_report_warns_when_runs_differ_in_model(two_runs, tmp_path):
    llama = _copy_run(two_runs[1], tmp_path / "llama", config=dict(model="llama-tiny"))
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(llama), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    warning = "the runs differ in model (paci tiny, llama llama-tiny): their losses and speed-ups do not compare"
    assert warning in " ".join(res.stderr.split())
    assert f"**Warning:** {warning} like for like.\n" in (tmp_path / "out" / "report.md").read_text()
    assert "| llama | llama-tiny | 1f1b-flush |" in (tmp_path / "out" / "report.md").read_text()


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
    ("not-a-run", "is not a run folder: config.json missing (a run writes config.json, metrics.jsonl when it "
                  "starts"),
    ("malformed", "holds malformed JSON"),
    ("no-steps", "records no training step"),
    ("bad-steps", "summary.json: steps_done='3' is invalid: must be an integer ≥ 0 (not a run folder of unbubble "
                  "train)"),
    ("not-an-object", "metrics.jsonl has a malformed line (line 2 holds int, not an object): not a run folder"),
])
def test_bad_run_folder_one_line_exit_2(two_runs, tmp_path, breakage, message):
    bad = tmp_path / "bad"
    if breakage != "missing":
        bad.mkdir()
        for name in ("config.json", "summary.json", "metrics.jsonl", "actions.jsonl"):
            (bad / name).write_text((two_runs[0] / name).read_text())
    if breakage == "not-a-run":
        (bad / "config.json").unlink()
    elif breakage == "malformed":
        (bad / "metrics.jsonl").write_text("{not json\n")
    elif breakage == "bad-steps":
        (bad / "summary.json").write_text(json.dumps({**json.loads((bad / "summary.json").read_text()),
                                                      "steps_done": "3"}))
    elif breakage == "not-an-object":
        (bad / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n3\n")
    elif breakage == "no-steps":
        (bad / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 5.0}) + "\n")
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(bad), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_metrics_are_read_back_as_steps_and_evaluations(tmp_path):
    """The one reader of metrics.jsonl (the run's summary and the report both use it): training steps and
    evaluations in file order; the guard's events, router lines and blank lines left out."""
    from unbubble.metrics import read_metrics

    lines = [{"step": 0, "val_loss": 4.2, "val_ppl": 66.7}, {"step": 1, "loss": 4.0, "elapsed_s": 0.5},
             {"event": "nonfinite", "step": 1, "stage": 0, "mb": 3}, {"step": 1, "router": {"max_load": 1.0}},
             {"step": 2, "loss": 3.5, "elapsed_s": 1.0}, {"step": 2, "val_loss": 3.9, "val_ppl": 49.4}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    steps, evals = read_metrics(tmp_path)
    assert steps == [lines[1], lines[4]] and evals == [lines[0], lines[5]]
    assert read_metrics(tmp_path / "none") == ([], [])


def test_report_needs_a_run():
    res = CliRunner().invoke(cli, ["report"])
    assert res.exit_code == 2 and "Missing argument 'RUN_DIRS...'" in res.output


def test_report_of_a_crashed_run_says_so(two_runs, tmp_path):
    """Issue 42 item 5: a run that crashed (no summary.json, no actions.jsonl) was refused."""
    crashed = _copy_run(two_runs[0], tmp_path / "crashed", last_step=3)
    (crashed / "summary.json").unlink()
    (crashed / "actions.jsonl").unlink()
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(crashed), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[2].split()[:4] == ["crashed", "paci", "–", "3"] or \
        res.stdout.splitlines()[2].endswith("crashed"), res.stdout
    md = (tmp_path / "out" / "report.md").read_text()
    (row,) = [line for line in md.splitlines() if line.startswith("| crashed |")]
    assert row.endswith("| crashed |")


def test_report_skips_a_simulation_folder_with_a_note(two_runs, tmp_path):
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "summary.csv").write_text("schedule\n")
    res = CliRunner().invoke(cli, ["report", str(two_runs[0]), str(sim), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    # the console wraps a long line wherever it likes, inside the path too: compare without whitespace
    want = f"skipped {sim}: a simulation (no config.json or metrics.jsonl)"
    assert "".join(want.split()) in "".join(res.stderr.split())
