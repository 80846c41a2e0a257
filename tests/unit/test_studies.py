"""Sweeps (lr tuning, seeds, resume, validation) and the two studies in their tiny size."""

import csv
import math
import re

import pytest

from unbubble.errors import ConfigError
from unbubble.experiments import get_experiment
from unbubble.experiments import sweep as sweep_mod
from unbubble.experiments.sweep import SweepSpec, next_lr, read_tables, run_sweep, tuned_lrs

from helpers import PUBLISHED_DATA, unpublished_rows


def _spec(**kw):
    d = {"name": "t", "micro_batches": 4, "stages": [2], "lrs": [1e-3], "seeds": [0],
         "base": {"model": "tiny", "seq_len": 16, "micro_batch_size": 2, "eval_batches": 1, "warmup_min": 0},
         "methods": [{"label": "flush", "schedule": "1f1b-flush", "m": 2}]}
    d.update(kw)
    return d


@pytest.mark.parametrize("change,message", [
    ({"lr": 1}, "sweep key 'lr' is unknown (did you mean 'lrs'?): valid keys are"),
    ({"methods": [{"schedule": "paci"}]}, "methods[0]={'schedule': 'paci'} is invalid: each method needs a label"),
    ({"lrs": []}, "sweep lrs=[] is invalid: give at least one"),
    ({"methods": [{"label": "p", "schedule": "nope"}]}, "method 'p' at N=2: schedule='nope' is unknown"),
    ({"methods": [{"label": "p", "schedule": "paci", "lr_from": "q"}]},
     "method 'p': lr_from='q' must name a tuned method of this sweep"),
    ({"micro_batches": 1, "methods": [{"label": "f", "schedule": "1f1b-flush", "m": 4}]},
     "method 'f' at N=2: micro_batches=1 is fewer than one update of 4 micro-batches"),
])
def test_spec_errors_name_the_value(change, message):
    with pytest.raises(ConfigError) as info:
        SweepSpec.from_dict(_spec(**change))
    assert str(info.value).startswith(message)


def test_missing_key_and_labels():
    d = _spec()
    del d["seeds"]
    with pytest.raises(ConfigError, match="sweep key 'seeds' is missing"):
        SweepSpec.from_dict(d)
    with pytest.raises(ConfigError, match="method labels must be unique"):
        SweepSpec.from_dict(_spec(methods=[{"label": "x", "schedule": "paci"}, {"label": "x", "schedule": "paci"}]))


def test_tuned_lr_is_the_lowest_final_loss_and_a_diverged_run_loses():
    runs = [{"method": "m", "stages": 8, "lr": lr, "phase": "tune", "final_val_loss": loss}
            for lr, loss in ((3e-4, 2.2), (1e-3, 1.9), (3e-3, None))]
    runs += [{"method": "m", "stages": 4, "lr": lr, "phase": "tune", "final_val_loss": 2.0} for lr in (1e-3, 3e-4)]
    runs += [{"method": "m", "stages": 8, "lr": 3e-3, "phase": "seeds", "final_val_loss": 0.1}]  # not a tuning run
    assert tuned_lrs(runs) == {("m", 8): 1e-3, ("m", 4): 3e-4}  # a tie goes to the smaller lr


def test_lr_from_takes_the_nearest_tuned_depth_on_a_log_scale_and_seed_phases():
    spec = SweepSpec.from_dict(_spec(
        stages=[1, 32], seeds=[0, 1, 2], seed_stages=[32], lrs=[1e-3, 3e-3],
        base={**_spec()["base"], "model": "deep32-cpu"},  # 32 blocks for 32 stages (planned only)
        methods=[{"label": "a", "schedule": "pipedream"},
                 {"label": "b", "schedule": "pipedream", "stages": [4, 8, 16], "lr_from": "a", "extra_seeds": False}]))
    best = {("a", 1): 1e-3, ("a", 32): 3e-3}
    b = spec.methods[1]
    # |ln 4 − ln 1| < |ln 4 − ln 32|; 8 and 16 are nearer 32
    assert [spec.lr_for(b, n, best) for n in (4, 8, 16)] == [1e-3, 3e-3, 3e-3]
    assert len(spec.tuning_runs()) == 4  # a at 2 depths × 2 lrs, seed 0; b waits for phase 2
    ids = sorted(r.run_id for r in spec.seed_runs(best))
    assert ids == ["a-N32-lr0.003-s1", "a-N32-lr0.003-s2",  # other seeds only where seed_stages allows
                   "b-N16-lr0.003-s0", "b-N4-lr0.001-s0", "b-N8-lr0.003-s0"]


def test_sweep_resumes_without_retraining_and_reads_back(tmp_path, monkeypatch):
    spec = SweepSpec.from_dict(_spec(lrs=[1e-3, 3e-3], seeds=[0, 1], extend_grid=0))
    records = run_sweep(spec, tmp_path, workers=2)
    assert [(r["lr"], r["seed"], r["phase"]) for r in records][:2] == [(1e-3, 0, "tune"), (3e-3, 0, "tune")]
    best = tuned_lrs(records)[("flush", 2)]
    assert records[2]["lr"] == best and records[2]["seed"] == 1 and records[2]["phase"] == "seeds"
    assert all(r["tokens"] == 4 * 2 * 16 and r["steps"] == 2 and r["max_drift"] == 0 for r in records)

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(sweep_mod, "execute", no_training)
    lines = []
    again = run_sweep(spec, tmp_path, workers=2, progress=lines.append)
    assert [r["final_val_loss"] for r in again] == [r["final_val_loss"] for r in records]
    assert lines == ["t: 2 of 2 tune runs already finished (skipped)", "t: 1 of 1 seeds runs already finished (skipped)"]
    data = read_tables(tmp_path)
    assert [r["final_val_loss"] for r in data.runs] == pytest.approx([r["final_val_loss"] for r in records])
    assert all(len(data.val[r["run_id"]]) >= 2 for r in records)  # initial and final evaluation at least


def test_next_lr_continues_the_grid():
    assert next_lr([3e-4, 1e-3, 3e-3]) == 0.01  # the half-decade pattern
    assert next_lr([3e-4, 1e-3, 3e-3, 1e-2]) == 0.03
    assert next_lr([3e-4, 1e-3, 3e-3], up=False) == 1e-4
    assert next_lr([1e-3, 2e-3]) == 4e-3 and next_lr([1e-3, 2e-3], up=False) == 5e-4  # the last ratio


def test_a_best_lr_at_the_edge_extends_the_grid(tmp_path, monkeypatch):
    """A fake trainer whose loss is (log10 lr + 2)², best at lr 1e-2: starting from
    [1e-3, 3e-3], round 1 tries 9e-3 (ratio 3), round 2 tries 2.7e-2, which is worse: tuned 9e-3."""
    def fake_execute(run, spec, out):
        return {"run_id": run.run_id, "method": run.method, "stages": run.stages, "lr": run.lr, "seed": run.seed,
                "phase": run.phase, "final_val_loss": (math.log10(run.lr) + 2) ** 2, "wall_s": 0.0}

    monkeypatch.setattr(sweep_mod, "execute", fake_execute)
    monkeypatch.setattr(sweep_mod, "write_tables", lambda records, out: None)
    spec = SweepSpec.from_dict(_spec(lrs=[1e-3, 3e-3], seeds=[0, 1], extend_grid=3))
    records = run_sweep(spec, tmp_path, workers=1)
    assert [(r["lr"], r["seed"], r["phase"]) for r in records] == [
        (1e-3, 0, "tune"), (3e-3, 0, "tune"), (9e-3, 0, "tune"), (2.7e-2, 0, "tune"), (9e-3, 1, "seeds")]
    off = SweepSpec.from_dict(_spec(lrs=[1e-3, 3e-3], seeds=[0], extend_grid=0))
    assert [r["lr"] for r in run_sweep(off, tmp_path / "off", workers=1)] == [1e-3, 3e-3]
    with pytest.raises(ConfigError, match="extend_grid=-1 is invalid"):
        SweepSpec.from_dict(_spec(extend_grid=-1))


def _csv(path):
    return list(csv.DictReader(open(path)))


def _docs_digest(docs):
    """sha256 of every file under ``docs`` by relative path."""
    import hashlib

    return {str(f.relative_to(docs)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(docs.rglob("*")) if f.is_file()}


def test_paci_study_tiny_values_and_analysis_from_the_csvs(tmp_path, monkeypatch):
    """The README's try-out (``unbubble experiment paci-study --size tiny``) through the CLI, from
    the repository root: its results land in OUT/paci-study and docs/ stays byte-identical."""
    from pathlib import Path

    from click.testing import CliRunner

    from unbubble.cli import cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the default --docs (docs) is the repository's
    before = _docs_digest(root / "docs")
    result = CliRunner().invoke(cli, ["experiment", "paci-study", "--size", "tiny", "--workers", "1",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert _docs_digest(root / "docs") == before
    assert result.output.splitlines()[-1].endswith(
        f"section in {tmp_path / 'paci-study' / 'results.md'} (docs/ unchanged: --write-docs publishes it)")
    section = (tmp_path / "paci-study" / "results.md").read_text()
    assert section.startswith("## paci-study") and "![loss](paci_study_loss.png)" in section
    assert (tmp_path / "paci-study" / "paci_study_loss.png").is_file()
    run = get_experiment("paci-study")
    main = {r["method"]: r for r in _csv(tmp_path / "paci-study" / "paci_study_main.csv")}
    flush = main["1f1b-flush m=2"]
    # the baseline against itself: no gap, iso-loss ratio 1, speed-up 1
    assert float(flush["gap vs flush m=a"]) == 0 and flush["iso-loss tokens ÷ flush"] == "1.00"
    assert flush["time-to-target speed-up vs flush m=a"] == "1.00"
    # Δ ≤ ⌈(N−1)/a⌉ = 1 at N=2, a=2, reached; the stashed control has Δ = 0
    assert main["paci a=2"]["max Δ"] == "1" and main["paci-stashed a=2"]["max Δ"] == "0"
    for row in main.values():
        mean = float(row["final val loss"].split(" ± ")[0])
        assert mean < math.log(257)  # below the untrained model's loss
        assert int(row["seeds"]) == 2
    # PACI has no bubble: on the simulated clock of 2 devices it reaches flush's final loss sooner
    # whenever it reaches it at about the same tokens
    assert float(main["paci a=2"]["time-to-target speed-up vs flush m=a"]) > 1
    # the tables come from runs.csv and curves.csv alone: the published ones rebuild to docs/results.md's figures
    published = run(tmp_path / "a", analyze=PUBLISHED_DATA / "paci-study")
    assert published.data == [PUBLISHED_DATA / "paci-study" / "runs.csv", PUBLISHED_DATA / "paci-study" / "curves.csv"]
    assert "| 1f1b-flush m=4 | 0.01 | 3 | 1.568 ± 0.026 | 0.02795 | 0 | 0 | 1.00 | 1.00 | 1.00 | 1.00 | — |" \
        in published.markdown
    assert unpublished_rows(published.markdown) == []


def test_write_docs_refuses_the_tiny_size(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    docs = tmp_path / "docs"
    result = CliRunner().invoke(cli, ["experiment", "paci-study", "--size", "tiny", "--write-docs",
                                      "--docs", str(docs), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "error: --write-docs with --size tiny is refused: smoke-test numbers must not replace the published " \
           "results (drop --size tiny to train the default size, or rebuild from --analyze docs/data/paci-study)" \
        in " ".join(result.output.split())
    assert not docs.exists() and not (tmp_path / "o").exists()  # refused before anything ran


def test_br_study_tiny_values(tmp_path):
    get_experiment("br-study")(tmp_path, size="tiny", workers=1)
    scaling = _csv(tmp_path / "br_study_scaling.csv")
    assert {(r["optimizer"], r["stashing"]) for r in scaling} == {
        ("adamw", "True"), ("adamw", "False"), ("basis-rotation (2nd, bilateral)", "True")}
    for r in scaling:  # every method reaches the target at both depths in the tiny run (about 6 of 12 updates)
        assert r["P=1"] and r["P=4"], r
        assert r["slowdown P=1→4"] == f"{float(r['P=4']) / float(r['P=1']):.2f}"
    tuned = _csv(tmp_path / "br_study_tuned.csv")
    assert {r["seeds"] for r in tuned if r["P"] == "1"} == {"2"}


def test_br_slowdown_is_the_ratio_or_a_lower_bound():
    """6 updates to the target at P = 1 and 9 at P = 4: 9 / 6 = 1.50; never reached at P = 4 within
    12 updates: more than 12 / 6 = 2.00; never reached at P = 1: no slowdown."""
    from unbubble.experiments.studies import _slowdown_text

    assert _slowdown_text(6.0, 9.0, 12) == "1.50"
    assert _slowdown_text(6.0, None, 12) == "> 2.00"
    assert _slowdown_text(None, 9.0, 12) is None


def test_the_documented_sweep_spec_is_valid(tmp_path):
    import re
    from pathlib import Path

    import yaml

    from unbubble.experiments.sweep import load_spec

    doc = (Path(__file__).resolve().parents[2] / "docs" / "experiments.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, flags=re.S).group(1)
    (tmp_path / "grid.yaml").write_text(block)
    spec = load_spec(tmp_path / "grid.yaml")  # validates every method's configuration
    assert len(spec.tuning_runs()) == 3 * 3  # three tuned methods × three lrs; the lr_from one waits
    assert yaml.safe_load(block)["methods"][3]["lr_from"] == "paci a=4"
    assert spec.lr_for(spec.methods[3], 4, {("paci a=4", 8): 1e-3}) == 1e-3


def test_sweep_cli_dry_run_and_a_bad_spec(tmp_path):
    from click.testing import CliRunner

    import yaml

    from unbubble.cli import cli

    spec = _spec(lrs=[1e-3, 3e-3])
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["sweep", str(tmp_path / "s.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:3] == ["    will  flush-N2-lr0.001-s0  (4 micro-batches)", "    will  flush-N2-lr0.003-s0  (4 micro-batches)",
                         " up to 1  flush N=2: grid extension beyond its best lr  (4 micro-batches)"]
    summary = next(line for line in lines if line.startswith("2 runs will train, up to 1 more may; "))
    assert "calibration run of flush (2 updates, start-up included)" in summary
    assert "run folder" not in result.output and "config:" not in result.output  # the calibration's own log
    assert not (tmp_path / "runs").exists()  # the calibration run leaves nothing behind
    # micro_batches not a multiple of m = 2: the plan shows what each run trains (4 of 5), not 5
    (tmp_path / "odd.yaml").write_text(yaml.safe_dump({**spec, "micro_batches": 5}))
    output = CliRunner().invoke(cli, ["sweep", str(tmp_path / "odd.yaml"), "--dry-run"]).output
    assert "    will  flush-N2-lr0.001-s0  (4 micro-batches)" in output.splitlines()
    assert "5 micro-batches is not a multiple of its 2 per" in " ".join(output.split())
    # nothing that may train: no "up to 0 more may", and one figure rather than a range "21–21"
    (tmp_path / "fixed.yaml").write_text(yaml.safe_dump({**spec, "extend_grid": 0}))
    lines = CliRunner().invoke(cli, ["sweep", str(tmp_path / "fixed.yaml"), "--dry-run"]).output.splitlines()
    summary = next(line for line in lines if line.startswith("2 runs will train; "))
    assert re.match(r"2 runs will train; (about \d+ min|under 1 min) with 2 worker\(s\) \(", summary), summary
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "stages": []}))
    result = CliRunner().invoke(cli, ["sweep", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 2 and result.output.strip().endswith("error: sweep stages=[] is invalid: give at least one")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("change,message", [
    ({"methods": [{"label": "p", "schedule": "paci", "optimiser": "muon"}]},
     "method 'p': key 'optimiser' is unknown (did you mean 'optimizer'?): a method takes label, stages"),
    ({"methods": [{"label": "p", "schedule": "paci", "lr": 1}]},
     "method 'p': key 'lr' is set by the sweep for every run: give lrs (or a method's lrs)"),
    ({"base": {"modle": "tiny"}}, "base: key 'modle' is unknown (did you mean 'model'?)"),
    ({"base": {"seed": 3}}, "base: key 'seed' is set by the sweep for every run: give seeds"),
    ({"method": []}, "sweep key 'method' is unknown (did you mean 'methods'?)"),
    ({"methods": [{"label": "p", "schedule": "paci", "a": 0}]}, "method 'p' at N=2: a=0 is invalid: must be an integer ≥ 1 (key a)"),
    # YAML scalars where lists belong, words where numbers belong: one line, never a Python TypeError
    ({"seeds": 0}, "sweep seeds=0 is invalid: must be a list of integers"),
    ({"lrs": 0.01}, "sweep lrs=0.01 is invalid: must be a list of numbers"),
    ({"lrs": ["abc"]}, "sweep lrs=['abc'] is invalid: must be a list of numbers"),
    ({"micro_batches": "forty"}, "sweep micro_batches='forty' is invalid: must be an integer"),
    ({"extend_grid": True}, "sweep extend_grid=True is invalid: must be an integer"),
    ({"evals": -1}, "sweep evals=-1 is invalid: must be ≥ 1"),
    ({"stages": [9]}, "method 'flush' at N=9: stages=9 is invalid: model 'tiny' has 4 blocks, so at most 4 pipeline"),
    ({"methods": [{"label": "p", "schedule": "paci", "stages": 2}]}, "method 'p': stages=2 is invalid: must be a list"),
])
def test_spec_errors_name_the_key_and_suggest_one(change, message):
    with pytest.raises(ConfigError) as info:
        SweepSpec.from_dict(_spec(**change))
    assert str(info.value).startswith(message) and "__init__" not in str(info.value)


def test_a_sweep_ends_with_its_tuned_lr_and_loss_table(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import yaml

    from unbubble.cli import cli

    def fake_execute(run, spec, out):
        return {"run_id": run.run_id, "method": run.method, "stages": run.stages, "lr": run.lr, "seed": run.seed,
                "phase": run.phase, "budget": run.budget, "final_val_loss": 2.0 + run.seed + 100 * run.lr,
                "wall_s": 0.0, "micro_batches": 4}

    monkeypatch.setattr(sweep_mod, "execute", fake_execute)
    monkeypatch.setattr(sweep_mod, "write_tables", lambda records, out: None)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(_spec(lrs=[1e-3, 3e-3], seeds=[0, 1], extend_grid=0)))
    result = CliRunner().invoke(cli, ["sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o"),
                                      "--workers", "1"])  # in-process: the patched execute is not picklable
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "flush" in line and "±" in line)
    # tuned lr 1e-3 (loss 2.1 < 2.3); seeds 0 and 1 there: 2.1, 3.1 -> 2.6000 ± 0.7071
    assert "0.001" in row and "2.6000 ± 0.7071" in row and "│ 2 " in row


def test_a_stopped_run_is_not_recorded_as_finished(tmp_path, monkeypatch):
    """Regression: a sweep stopped by Ctrl-C/SIGTERM recorded its workers' partial runs (stopped
    at a step boundary) as finished, and a resumed sweep skipped them."""
    import unbubble.train
    from unbubble.errors import PipelineFailure

    real_train = unbubble.train.train

    def stopped_train(cfg, **kw):  # the sweep passes on_divergence="record"
        result, run_dir = real_train(cfg, **kw)
        result.stopped_at, result.step_losses = 1, result.step_losses[:1]  # as a stop after update 1
        return result, run_dir

    monkeypatch.setattr(unbubble.train, "train", stopped_train)
    spec = SweepSpec.from_dict(_spec(micro_batches=8, extend_grid=0))  # 4 updates of m=2
    with pytest.raises(PipelineFailure, match=r"t: run flush-N2-lr0.001-s0 was stopped at step 1 of 4; it is not "
                                              r"recorded: run the same command again"):
        run_sweep(spec, tmp_path, workers=1)
    assert not list(tmp_path.glob("results/*.json"))
