"""``pays-study``: where asynchrony pays (DESIGN §11). The default remedy, PACI + Muon + error
feedback (c = 1), against 1F1B-flush + Muon at the same m, in the regimes the break-even table
points to: 4× the horizon (3 seeds), a second model family, N = 16 and few micro-batches.

Four resumable sweeps (:func:`~unbubble.experiments.study_specs.pays_study_spec`), trained in the
order ``default``, ``llama``, ``deep16``, ``few`` into ``OUT/<part>``; ``default`` reuses
horizon-study's published 4× runs of identical settings. The metrics are overhead-study's
(:func:`~unbubble.experiments.overhead.overhead_rows`): per seed, the budget at which PACI's final
loss meets its twin's (interpolated in log tokens), and the time to that loss on the simulated
clock of N devices, built from this study's own runs, against the fastest synchronous schedule.
Whatever finished is analysed: a part cut short says so in its row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from unbubble.experiments.common import ExperimentOutput, experiment, provenance, say
from unbubble.experiments.study_specs import PAYS_PARTS, horizon_study_spec, pays_study_spec
from unbubble.experiments.sweep import SweepData, SweepSpec, read_tables, reuse_runs, run_sweep, write_tables

#: horizon-study's published runs: its 4× rows are reused where the settings are identical.
PUBLISHED = Path(__file__).resolve().parents[3] / "docs" / "data" / "horizon-study"


def train_parts(out: Path, size: str, seeds: list[int] | None, workers: int, parts: tuple[str, ...] = PAYS_PARTS,
                published: Path | None = PUBLISHED) -> list[dict]:
    """Trains ``parts`` in order into ``out/<part>`` (resumable). Returns every record."""
    records = []
    for part in parts:
        d = pays_study_spec(size, part)
        if seeds:
            d = {**d, "seeds": list(seeds)}
        spec = SweepSpec.from_dict(d)
        if part == "default" and published is not None and (published / "runs.csv").is_file():
            source = SweepSpec.from_dict(horizon_study_spec(size, "main"))
            reused = reuse_runs(spec, out / part, published, source)
            if reused:
                say(f"{spec.name}: {len(reused)} run(s) of identical settings reused from {published}")
        records += run_sweep(spec, out / part, workers=workers, progress=say)
    return records


def collect(out: Path, part: str) -> list[dict[str, Any]]:
    """Every finished run of one part (``out/<part>/results``), as records."""
    return [json.loads(p.read_text()) for p in sorted((out / part / "results").glob("*.json"))]


def part_rows(data: SweepData, spec: dict[str, Any], part: str) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """overhead-study's rows for one part's data, on the clock of the part's own runs (runs
    reused from published folders, timed by older code, left out of the clock's medians)."""
    from unbubble.experiments.overhead import Clock, overhead_rows
    from unbubble.experiments.studies import Study

    study = Study(data)
    n = max(spec["stages"])
    present = {m["label"] for m in spec["methods"] if study.has(m["label"], n)}
    spec = {**spec, "methods": [m for m in spec["methods"] if m["label"] in present]}
    own = [r for r in data.runs if r.get("commit")] or None
    return overhead_rows(study, spec, n, same_horizon=True, clock=Clock(study, n, pool=own))


def analyse(out: Path, size: str) -> tuple[str, list[Path], list[dict[str, Any]]]:
    """The map's measured rows (one per PACI method with its twin), the re-run row and text."""
    from unbubble.experiments.common import md_table, write_csv

    rows, runs = [], []
    for part in PAYS_PARTS:
        if not (out / part / "runs.csv").is_file():
            continue
        spec = pays_study_spec(size, part)
        data = read_tables(out / part)
        runs += data.runs
        table, facts = part_rows(data, spec, part)
        for row in table:
            m = next(x for x in spec["methods"] if x["label"] == row["method"])
            rows.append({"part": part, "N": max(spec["stages"]), "model": spec["base"]["model"],
                         "a = m": m.get("a"), **row})
    rerun = [r for r in runs if r["method"].endswith("(re-run)")]
    text = ""
    if rerun:
        r = rerun[0]
        text = (f"Re-run of a published row at commit {r['commit'] or 'unrecorded'}: "
                f"{r['method'].replace(' (re-run)', '')} at 1×, seed {r['seed']}, lr {r['lr']:g}: final validation "
                f"loss {r['final_val_loss']:.4f}.")
    files = [write_csv(out / "pays_study.csv", rows)] if rows else []
    md = (md_table(rows) if rows else "No part has finished a pair yet.") + ("\n\n" + text if text else "")
    return md, files, runs


@experiment("pays-study", "where asynchrony pays: the default remedy at 4× (3 seeds), Llama, N = 16, few "
                          "micro-batches")
def pays_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
               workers: int = 2) -> ExperimentOutput:
    """Where asynchrony pays; see the module docstring. ``analyze``: a folder holding the parts'
    folders (``default/runs.csv``, …) to rebuild the tables from, training nothing."""
    t0 = time.perf_counter()
    if analyze is None:
        train_parts(out, size, seeds, workers)
        for part in PAYS_PARTS:
            write_tables(collect(out, part), out / part)
    md, files, runs = analyse(out if analyze is None else analyze, size)
    wall = time.perf_counter() - t0
    run_wall = sum(r["wall_s"] for r in runs)
    commits = sorted({r.get("commit") or "unrecorded" for r in runs})
    section = ("## pays-study (where asynchrony pays)\n\n" + md + "\n\n"
               + provenance(f"unbubble experiment pays-study --size {size}", sorted({r["seed"] for r in runs}),
                            wall if analyze is None else run_wall / workers,
                            engine=f"emulator, {len(runs)} runs at commits {', '.join(commits)}, {workers} at a "
                                   f"time on 1 torch thread each, {run_wall / 3600:.2f} run-hours"))
    data_files = [p for part in PAYS_PARTS for p in (out / part / "runs.csv", out / part / "curves.csv")
                  if analyze is None and p.is_file()]
    return ExperimentOutput("pays-study", section, files, wall, data=data_files)

