"""``horizon-study``: asynchrony at length (docs/architecture.md#comparing-convergence). The token overhead of PACI + Muon +
weight prediction against 1F1B-flush + Muon at 1×, 2× and 4× the overhead-study horizon (each with
token budgets), error feedback at 1×, and the trend a user can read a longer horizon from.

Two resumable sweeps (:func:`~unbubble.experiments.study_specs.horizon_study_spec`), ``main`` (4×
and error feedback, the issue's first priority) then ``trend`` (2×), both reusing overhead-study's
published runs of identical settings (:func:`~unbubble.experiments.sweep.reuse_runs`). The
metrics are overhead-study's (:func:`~unbubble.experiments.overhead.overhead_rows`): per seed, the
budget at which PACI's final loss meets its twin's, interpolated in log tokens; the time to that
loss on the simulated clock of N devices against the fastest synchronous schedule.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from unbubble.experiments.common import ExperimentOutput, experiment, provenance, say
from unbubble.experiments.study_specs import horizon_study_spec, overhead_spec
from unbubble.experiments.sweep import (SweepData, SweepSpec, raw_tables, read_tables, reuse_runs, run_sweep,
                                        write_tables)

#: overhead-study's published runs (1× and its 4× sweep), reused where the settings are identical.
PUBLISHED = Path(__file__).resolve().parents[3] / "docs" / "data" / "overhead-study"


def _source(size: str) -> SweepSpec:
    """overhead-study's two sweeps as one spec (what its published runs were trained under)."""
    from unbubble.experiments.overhead import HORIZON
    from unbubble.experiments.study_specs import horizon_spec

    h1 = overhead_spec(size)
    by = {m["label"]: m for m in h1["methods"]}
    flush, paci = "1f1b-flush m=4 + muon", "paci a=4 + muon"
    if size == "tiny" or flush not in by:
        return SweepSpec.from_dict(h1)
    h4 = horizon_spec(h1, {flush: 1e-2, paci: 1e-2}, [(paci, flush)], HORIZON)
    return SweepSpec.from_dict({**h1, "methods": h1["methods"] + h4["methods"]})


def train_parts(out: Path, size: str, seeds: list[int] | None, workers: int,
                published: Path | None = PUBLISHED) -> list[dict]:
    """Trains ``main`` then ``trend`` into ``out/main`` and ``out/trend`` (resumable). Returns
    every record."""
    records = []
    source = _source(size) if published is not None and (published / "runs.csv").is_file() else None
    for part in ("main", "trend"):
        d = horizon_study_spec(size, part)
        if seeds:
            d = {**d, "seeds": list(seeds)}
        spec = SweepSpec.from_dict(d)
        if source is not None:
            reused = reuse_runs(spec, out / part, published, source)
            if reused:
                say(f"{spec.name}: {len(reused)} run(s) of identical settings reused from {published}")
        records += run_sweep(spec, out / part, workers=workers, progress=say)
    return records


def collect(out: Path) -> list[dict[str, Any]]:
    """Every finished run of both parts (``out/main/results``, ``out/trend/results``), as records:
    what the analysis reads when a part was cut short, so its tables say what finished."""
    records = []
    for part in ("main", "trend"):
        for path in sorted((out / part / "results").glob("*.json")):
            records.append(json.loads(path.read_text()))
    return records


def _spec(size: str) -> dict[str, Any]:
    """Both parts' methods as one spec (what :func:`overhead_rows` reads)."""
    main, trend = horizon_study_spec(size, "main"), horizon_study_spec(size, "trend")
    return {**main, "methods": main["methods"] + trend["methods"]}


def _horizon(label: str) -> float:
    return float(label.rsplit("@", 1)[1].rstrip("×")) if " @" in label else 1.0


def trend_fit(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Least squares of token overhead against log₂ horizon over per-seed points ``(horizon,
    overhead)``: ``overhead = a + b·log₂(h)``, with the standard error of b (n − 2 degrees of
    freedom) and the horizons at which the line reaches 1.15 and 1.0 (``None`` where it does not
    fall). Needs ≥ 3 points at ≥ 2 horizons."""
    xs = [math.log2(h) for h, _ in points]
    ys = [y for _, y in points]
    n = len(points)
    if n < 3 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    resid = [y - (a + b * x) for x, y in zip(xs, ys)]
    se_b = math.sqrt(sum(r * r for r in resid) / (n - 2) / sxx) if n > 2 else math.nan
    reach = {t: (2 ** ((t - a) / b) if b < 0 else None) for t in (1.15, 1.0)}
    return {"a": a, "b": b, "se_b": se_b, "n": n, "h_1.15": reach[1.15], "h_1.0": reach[1.0]}


def _published_ids() -> set[str]:
    """Run ids of overhead-study's published runs (what :func:`train_parts` reuses)."""
    if not (PUBLISHED / "runs.csv").is_file():
        return set()
    return {r["run_id"] for r in read_tables(PUBLISHED).runs}


def analyse(data: SweepData, spec: dict[str, Any], out: Path, published: bool = True) -> tuple[str, list[Path]]:
    """The section's tables, the trend plot and its text, from one sweep's data. Times use one
    clock (:class:`~unbubble.experiments.overhead.Clock` with a pool): the F, B and, per optimizer,
    U medians of the runs this study trained (``published``: overhead-study's reused runs left out,
    as older code timed them)."""
    from unbubble.experiments.common import figure, md_table, save_figure, write_csv
    from unbubble.experiments.overhead import Clock, _schedule_set, overhead_rows
    from unbubble.experiments.studies import Study

    study = Study(data)
    n = max(spec["stages"])
    present = {m["label"] for m in spec["methods"] if study.has(m["label"], n)}
    spec = {**spec, "methods": [m for m in spec["methods"] if m["label"] in present]}
    reused = _published_ids() if published else set()
    pool = [r for r in data.runs if r["run_id"] not in reused] or None
    rows, facts = overhead_rows(study, spec, n, same_horizon=True, clock=Clock(study, n, pool=pool))
    by = {m["label"]: m for m in spec["methods"]}
    flush = next(m["label"] for m in spec["methods"] if m.get("optimizer") == "muon" and " @" not in m["label"]
                 and "baseline" not in m)
    pmp = next(m["label"] for m in spec["methods"] if m.get("predict_weights") == "bound"
               and m.get("optimizer") == "muon" and not m.get("error_feedback") and " @" not in m["label"])
    horizon_rows, points = [], []
    for row in rows:
        label = row["method"]
        if label.split(" @")[0] != pmp:
            continue
        h = _horizon(label)
        f = facts[label]
        horizon_rows.append({"horizon": f"{h:g}×", "updates": study.final(label, n)[0]["steps"], **{
            k: row[k] for k in ("tuned lr", "seeds", "final val loss", "flush twin", "gap", "budgets trained",
                                "token overhead ÷ flush", "speed-up vs twin", "vs fastest synchronous")}})
        points += [(h, v) for v, rel in f["per_seed"] if rel == "="]
    horizon_rows.sort(key=lambda r: float(r["horizon"].rstrip("×")))
    remedy_rows = [{k: r[k] for k in ("method", "optimizer", "tuned lr", "seeds", "final val loss", "flush twin", "gap",
                                      "budgets trained", "token overhead ÷ flush", "speed-up vs twin")}
                   for r in rows if " @" not in r["method"]]
    fit = trend_fit(points)
    files = [write_csv(out / "horizon_study_trend.csv", horizon_rows), write_csv(out / "horizon_study_1x.csv", remedy_rows)]
    plt = figure()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    tokens1 = study.final(flush, n)[0]["tokens"]
    if points:
        ax.plot([h * tokens1 for h, _ in points], [v for _, v in points], "o", label=f"{pmp}, per seed")
    if fit is not None:
        hs = [2 ** (k / 10) for k in range(0, 31)]
        ax.plot([h * tokens1 for h in hs], [fit["a"] + fit["b"] * math.log2(h) for h in hs], "-", lw=1,
                label=f"fit: {fit['a']:.3f} {fit['b']:+.3f}·log₂(h) (± {fit['se_b']:.3f})")
    ax.axhline(1.15, ls=":", color="grey", lw=0.8, label="1.15 (the target)")
    ax.axhline(1.0, ls="--", color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="training tokens of the flush twin", ylabel="token overhead ÷ flush + Muon",
           title=f"Token overhead against the horizon, N={n}")
    files.append(save_figure(fig, ax, out / "horizon_study_trend.png"))
    if fit is None:
        fit_text = "Too few points for a fit (need three per-seed overheads at two horizons at least)."
    else:
        lo, hi = min(h for h, _ in points), max(h for h, _ in points)
        reach = []
        for t in (1.15, 1.0):
            h = fit[f"h_{t}"]
            if h is None:
                reach.append(f"it does not fall to {t:g}")
            elif lo <= h <= hi:
                reach.append(f"{t:g} at {h:.2g}× (inside the measured range)")
            elif h < lo:
                reach.append(f"{t:g} at {h:.2g}× (below the smallest horizon measured, {lo:g}×: the points there "
                             "are already at or under it)")
            else:
                reach.append(f"{t:g} at {h:.2g}× (beyond the largest horizon measured, {hi:g}×: an extrapolation, "
                             "not a measurement)")
        fit_text = (f"Fit over {fit['n']} per-seed overheads: overhead = {fit['a']:.3f} {fit['b']:+.3f} ± "
                    f"{fit['se_b']:.3f} (standard error) per doubling of the tokens; the line reaches "
                    + "; ".join(reach) + ".")
    md = (f"Token overhead of PACI + Muon + `--predict-weights bound` (a = {by[pmp]['a']}) against 1F1B-flush + Muon "
          f"(m = {by[flush]['m']}) as "
          "the horizon grows (each horizon's budgets are full warm-up + cosine runs at its tuned lr), and the "
          f"times on the simulated clock of N = {n} devices against the fastest synchronous schedule of "
          f"{_schedule_set()}. The lr of the longer horizons was checked on the first seed at the 1× tuned lr and "
          "one step lower, so a tuned lr at the grid's upper edge is by design:\n\n"
          + md_table(horizon_rows) + "\n\n" + fit_text + "\n\n"
          "![trend](horizon_study_trend.png)\n\n"
          "Error feedback (`--error-feedback 1`) at 1×, with and without prediction, beside the rows it is "
          "compared with (each at the tuned lr of the method without error feedback):\n\n"
          + md_table(remedy_rows))
    return md, files


@experiment("horizon-study", "asynchrony at length: PACI + Muon + prediction's token overhead at 1×, 2×, 4× the "
                             "horizon, error feedback, the trend")
def horizon_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
                  workers: int = 2) -> ExperimentOutput:
    """Asynchrony at length; see the module docstring."""
    t0 = time.perf_counter()
    spec = _spec(size)
    if analyze is None:
        train_parts(out, size, seeds, workers)
        write_tables(collect(out), out)
    data = read_tables(out if analyze is None else analyze)
    section, files = analyse(data, spec, out)
    wall = time.perf_counter() - t0
    run_wall = sum(r["wall_s"] for r in data.runs)
    md = (f"## horizon-study (asynchrony at length), N={max(spec['stages'])}\n\n" + section + "\n\n"
          + provenance(f"unbubble experiment horizon-study --size {size}", spec["seeds"],
                       wall if analyze is None else run_wall / workers,
                       engine=f"emulator, {len(data.runs)} runs, {workers} at a time on 1 torch thread each, "
                              f"{run_wall / 3600:.2f} run-hours (overhead-study's reused runs included)"))
    return ExperimentOutput("horizon-study", md, files, wall, data=raw_tables(out if analyze is None else analyze))
