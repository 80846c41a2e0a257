"""horizon-study (issue 29): the sweeps' reuse of published runs, the trend fit, a tiny run, and the
published tables rebuilt from their CSVs."""

import csv
import json
import math

import pytest

from unbubble.experiments.horizon import PUBLISHED, _source, collect, horizon_study, trend_fit
from unbubble.experiments.study_specs import horizon_study_spec
from unbubble.experiments.sweep import SweepSpec, reuse_runs

from helpers import PUBLISHED_DATA, unpublished_rows


def test_trend_fit_is_least_squares_in_log2_horizon():
    # points on 1.5 − 0.2·log2(h) plus ±0.01: slope −0.2, residuals ±0.01 at h = 1, 2, 4 (hand computation)
    pts = [(1, 1.51), (1, 1.49), (2, 1.31), (2, 1.29), (4, 1.11), (4, 1.09)]
    fit = trend_fit(pts)
    assert fit["a"] == pytest.approx(1.5) and fit["b"] == pytest.approx(-0.2)
    # s² = Σr²/(n − 2) = 6·1e-4/4, Sxx = Σ(x − 1)² = 4 → se(b) = sqrt(1.5e-4 / 4)
    assert fit["se_b"] == pytest.approx(math.sqrt(1.5e-4 / 4))
    assert fit["h_1.15"] == pytest.approx(2 ** (0.35 / 0.2)) and fit["h_1.0"] == pytest.approx(2 ** 2.5)
    assert trend_fit([(1, 1.4), (1, 1.5)]) is None  # one horizon: no slope
    assert trend_fit([(1, 1.2), (2, 1.3), (4, 1.4)])["h_1.0"] is None  # rising: never reaches 1


def test_reuse_takes_only_runs_of_identical_settings(tmp_path):
    spec = SweepSpec.from_dict(horizon_study_spec("default", "main"))
    reused = reuse_runs(spec, tmp_path, PUBLISHED, _source("default"))
    published = list(csv.DictReader(open(PUBLISHED / "runs.csv")))
    labels = {m.label for m in spec.methods}
    assert set(reused) == {r["run_id"] for r in published if r["method"] in labels}
    assert "1f1b-flush-m-4-muon-4-N8-lr0.01-s1" in reused  # flush + Muon at 4×: same settings, not retrained
    rec = json.loads((tmp_path / "results" / "1f1b-flush-m-4-muon-4-N8-lr0.01-s1.json").read_text())
    row = next(r for r in published if r["run_id"] == rec["run_id"])
    assert rec["final_val_loss"] == pytest.approx(float(row["final_val_loss"])) and rec["val_curve"]
    # a method whose settings differ under the same label is not reused
    d = horizon_study_spec("default", "main")
    d["methods"] = [{**m, "muon_momentum": 0.9} if m["label"] == "1f1b-flush m=4 + muon" else m for m in d["methods"]]
    other = reuse_runs(SweepSpec.from_dict(d), tmp_path / "other", PUBLISHED, _source("default"))
    assert not any(r.startswith("1f1b-flush-m-4-muon-N8") for r in other)
    # nor anything when the base differs
    d = {**horizon_study_spec("default", "main"), "micro_batches": 1200}
    assert reuse_runs(SweepSpec.from_dict(d), tmp_path / "base", PUBLISHED, _source("default")) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("horizon")
    return out, horizon_study(out, size="tiny", workers=1)


def test_tiny_study_has_every_horizon_and_rebuilds_from_its_csvs(tiny, tmp_path):
    out, _ = tiny
    trend = list(csv.DictReader(open(out / "horizon_study_trend.csv")))
    assert [r["horizon"] for r in trend] == ["1×", "1.5×", "2×"]
    assert all(r["seeds"] == "2" for r in trend)
    one = {r["method"]: r for r in csv.DictReader(open(out / "horizon_study_1x.csv"))}
    assert {"paci a=2 + muon + error feedback", "paci a=2 + prediction + error feedback"} <= set(one)
    # every run of both parts is in runs.csv
    runs = list(csv.DictReader(open(out / "runs.csv")))
    assert len(runs) == len(collect(out)) == len(list((out / "main" / "results").glob("*.json"))) + \
        len(list((out / "trend" / "results").glob("*.json")))
    # the tables come from runs.csv and curves.csv alone: the published ones rebuild to docs/results.md's figures
    published = horizon_study(tmp_path, analyze=PUBLISHED_DATA / "horizon-study")
    assert "| 1× | 600 | 0.01 | 2 | 1.351 ± 0.011 | 1.234 ± 0.001 (lr 0.01) | 0.1162 | 1.5 | 1.41 ± 0.00 (1.40–1.41) |" \
        in published.markdown
    assert unpublished_rows(published.markdown) == []
