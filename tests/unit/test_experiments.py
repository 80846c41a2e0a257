"""Each experiment in its tiny configuration: it writes its files with sane values."""

import pytest

from unbubble.experiments import EXPERIMENTS, ExperimentOutput, get_experiment, publish, update_results, write_section


# paci-study and br-study: tests/unit/test_studies.py; throughput-memory spawns processes:
# tests/multiproc/test_experiments_multiproc.py
def test_results_section_is_replaced_not_repeated(tmp_path):
    doc = tmp_path / "results.md"
    update_results(doc, "x", "## x\n\nfirst")
    update_results(doc, "y", "## y\n\nother")
    update_results(doc, "x", "## x\n\nsecond")
    text = doc.read_text()
    assert text.count("<!-- experiment:x -->") == 1 and "second" in text and "first" not in text
    assert text.index("experiment:x") < text.index("experiment:y")  # in place


def test_publish_is_the_only_writer_of_docs(tmp_path):
    """The experiment's folder gets its section as written; publish() puts it into docs/results.md
    with figure links under img/, copies the figure and the raw tables (not onto themselves)."""
    folder, docs = tmp_path / "experiments" / "x", tmp_path / "docs"
    folder.mkdir(parents=True)
    (folder / "x_plot.png").write_bytes(b"png")
    (folder / "runs.csv").write_text("run_id\nr0\n")
    out = ExperimentOutput("x", "## x\n\n![plot](x_plot.png)\n", [folder / "x_plot.png"], 1.0,
                           data=[folder / "runs.csv"])
    assert write_section(out, folder).read_text() == "## x\n\n![plot](x_plot.png)\n"
    assert not docs.exists()
    written = publish(out, docs)
    assert written == [docs / "results.md", docs / "img" / "x_plot.png", docs / "data" / "x" / "runs.csv"]
    assert "![plot](img/x_plot.png)" in (docs / "results.md").read_text()
    assert (docs / "img" / "x_plot.png").read_bytes() == b"png"
    assert (docs / "data" / "x" / "runs.csv").read_text() == "run_id\nr0\n"
    # --analyze docs/data/x --write-docs: the raw tables are already in place
    again = ExperimentOutput("x", "## x\n\nagain\n", [], 1.0, data=[docs / "data" / "x" / "runs.csv"])
    assert publish(again, docs) == [docs / "results.md"]
    assert (docs / "data" / "x" / "runs.csv").read_text() == "run_id\nr0\n"


def test_experiments_are_listed_in_order():
    assert list(EXPERIMENTS) == ["paci-study", "br-study", "overhead-study", "horizon-study", "pays-study",
                                "clip-study", "throughput-memory", "moe-delay"]


def test_unknown_experiment():
    from unbubble.errors import ConfigError

    with pytest.raises(ConfigError, match="experiment='nope' is unknown: valid experiments are paci-study, br-study"):
        get_experiment("nope")


def test_dry_run_counts_finished_runs_as_finished(tmp_path):
    """Issue 28: after a finished sweep, --dry-run said '… runs will train' though a rerun trains
    nothing. Finished tuning runs decide the next phases exactly: the best lr 3e-3 is inside the
    grid (no extension), so only seed 1 at 3e-3 remains, then nothing."""
    import json

    from unbubble.experiments.sweep import SweepSpec, estimate, plan

    spec = SweepSpec.from_dict({
        "name": "t", "micro_batches": 4, "stages": [2], "lrs": [1e-3, 3e-3, 1e-2], "seeds": [0, 1],
        "base": {"model": "tiny", "seq_len": 16, "micro_batch_size": 2, "eval_batches": 1, "warmup_min": 0},
        "methods": [{"label": "flush", "schedule": "1f1b-flush", "m": 2}]})
    before = plan(spec, tmp_path)
    assert [c for _, _, c in before] == ["will"] * 3 + ["up to 1", "will"]  # nothing finished: as before

    def finish(run_id, lr, seed, phase, loss):
        (tmp_path / "results").mkdir(exist_ok=True)
        (tmp_path / "results" / f"{run_id}.json").write_text(json.dumps(
            {"run_id": run_id, "method": "flush", "stages": 2, "lr": lr, "seed": seed, "phase": phase, "budget": 1.0,
             "final_val_loss": loss, "wall_s": 3.0, "micro_batches": 4}))

    for lr, loss in [(1e-3, 3.0), (3e-3, 2.5), (1e-2, 2.8)]:
        finish(f"flush-N2-lr{lr:g}-s0", lr, 0, "tune", loss)
    rows = plan(spec, tmp_path)
    assert rows[3:] == [("flush-N2-lr0.003-s1", 4, "will")] and [c for _, _, c in rows[:3]] == ["done"] * 3
    line = estimate(spec, tmp_path, 2, rows)
    assert line.startswith(f"1 runs will train (3 already finished in {tmp_path}); under 1 min with 2 worker(s) "
                           "(750.0 ms per micro-batch from the median of 3 finished run(s)"), line
    # records that hold the training loop's own time: start-up is counted once per run, not per
    # micro-batch (a resumed sweep said 781.5 ms per micro-batch against 63 ms measured)
    for lr in (1e-3, 3e-3, 1e-2):
        path = tmp_path / "results" / f"flush-N2-lr{lr:g}-s0.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "train_wall_s": 0.4}))
    assert estimate(spec, tmp_path, 2, rows) == (
        f"1 runs will train (3 already finished in {tmp_path}); under 1 min with 2 worker(s) (100.0 ms per "
        f"micro-batch and 2.6 s start-up per run from the median of 3 finished run(s) in {tmp_path})")
    finish("flush-N2-lr0.003-s1", 3e-3, 1, "seeds", 2.6)
    rows = plan(spec, tmp_path)
    assert [c for _, _, c in rows] == ["done"] * 4
    assert estimate(spec, tmp_path, 2, rows) == f"nothing to train: all 4 runs are finished in {tmp_path}"


def test_the_example_grid_spec_ships_and_is_valid():
    from pathlib import Path

    from unbubble.experiments.sweep import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / "grid.yaml")  # validates every method
    assert spec.name == "my-grid" and len(spec.tuning_runs()) == 3 * 3


def test_durations_read_as_a_person_reads_them():
    """Was: 'about 0 min' for a sweep of seconds and '(0.2 min so far)' after the first run."""
    from unbubble.progress import elapsed, estimate_span

    assert [elapsed(s) for s in (12.4, 59.6, 60, 762, 3599, 3600, 7530)] == \
        ["12 s", "60 s", "1.0 min", "12.7 min", "60.0 min", "1 h 00 min", "2 h 06 min"]
    assert [estimate_span(lo, hi) for lo, hi in ((5, 40), (20, 70), (300, 310), (3960, 20820))] == \
        ["under 1 min", "about 1 min", "about 5 min", "about 66–347 min"]


def test_a_dry_run_names_the_depth_once_when_the_label_has_it(tmp_path):
    """Was: 'paci a=4, N=4 N=4 seed 0 at the borrowed lr' (examples/grid.yaml)."""
    from unbubble.experiments.sweep import SweepSpec, plan

    spec = SweepSpec.from_dict({
        "name": "t", "micro_batches": 4, "stages": [4], "lrs": [1e-3, 3e-3], "seeds": [0, 1],
        "base": {"model": "tiny", "seq_len": 16, "micro_batch_size": 2, "eval_batches": 1, "warmup_min": 0},
        "methods": [{"label": "paci a=2", "schedule": "paci", "a": 2},
                    {"label": "paci a=2, N=2", "schedule": "paci", "a": 2, "stages": [2], "lr_from": "paci a=2",
                     "extra_seeds": False}]})
    what = [w for w, _, _ in plan(spec, tmp_path)]
    assert "paci a=2, N=2 seed 0 at the borrowed lr" in what and "paci a=2 N=4 seed 1 at the tuned lr" in what
