"""``horizon-study``: asynchrony at length (DESIGN §10). The token overhead of PACI + Muon +
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

import time
from pathlib import Path

from unbubble.experiments.common import ExperimentOutput, experiment, say
from unbubble.experiments.study_specs import horizon_study_spec, overhead_spec
from unbubble.experiments.sweep import SweepSpec, raw_tables, reuse_runs, run_sweep

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


@experiment("horizon-study", "asynchrony at length: PACI + Muon + prediction's token overhead at 1×, 2×, 4× the "
                             "horizon, error feedback, the trend")
def horizon_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
                  workers: int = 2) -> ExperimentOutput:
    """Asynchrony at length; see the module docstring."""
    t0 = time.perf_counter()
    if analyze is None:
        train_parts(out, size, seeds, workers)
    src = out if analyze is None else analyze
    return ExperimentOutput("horizon-study", "", [], time.perf_counter() - t0, data=raw_tables(src / "main"))
