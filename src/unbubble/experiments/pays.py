"""``pays-study``: where asynchrony pays (docs/architecture.md#comparing-convergence, break-even). The default remedy, PACI + Muon + error
feedback (c = 1), against 1F1B-flush + Muon at the same m, in the regimes the break-even table
points to: 4× the horizon (3 seeds), a second model family, N = 16, few micro-batches, and a run
that trains synchronously first (part ``switch``, tabled by :func:`switch_rows`).

Five resumable sweeps (:func:`~unbubble.experiments.study_specs.pays_study_spec`), trained in the
order ``default``, ``llama``, ``deep16``, ``few``, ``switch`` into ``OUT/<part>``; ``default`` reuses
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
#: This study's own published runs, one folder per part: a study that spans sessions resumes from them.
OWN = PUBLISHED.parent / "pays-study"


def train_parts(out: Path, size: str, seeds: list[int] | None, workers: int, parts: tuple[str, ...] = PAYS_PARTS,
                published: Path | None = PUBLISHED) -> list[dict]:
    """Trains ``parts`` in order into ``out/<part>`` (resumable). Returns every record."""
    records = []
    for part in parts:
        d = pays_study_spec(size, part)
        if seeds:
            d = {**d, "seeds": list(seeds)}
        spec = SweepSpec.from_dict(d)
        sources = []
        if part == "default" and published is not None and (published / "runs.csv").is_file():
            sources.append((published, SweepSpec.from_dict(horizon_study_spec(size, "main"))))
        if published is not None and size != "tiny" and (OWN / part / "runs.csv").is_file():
            sources.append((OWN / part, SweepSpec.from_dict(pays_study_spec(size, part))))
        for folder, source in sources:
            reused = reuse_runs(spec, out / part, folder, source)
            if reused:
                say(f"{spec.name}: {len(reused)} run(s) of identical settings reused from {folder}")
        records += run_sweep(spec, out / part, workers=workers, progress=say)
    return records


def collect(out: Path, part: str) -> list[dict[str, Any]]:
    """Every finished run of one part (``out/<part>/results``), as records."""
    return [json.loads(p.read_text()) for p in sorted((out / part / "results").glob("*.json"))]


def part_rows(data: SweepData, spec: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, dict]]:
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


#: The map's grid: depth N and micro-batches per update m (= PACI's a).
MAP_NS, MAP_MS = (8, 16), (1, 2, 4, 8)


def _ratio(cell: str) -> float:
    return float(cell.split()[0])


def _ratios(throughput: float, overheads: list[float], relations: list[str]) -> str:
    """throughput ÷ overhead per seed as a cell (:func:`~unbubble.experiments.overhead.paired_text`;
    a ratio from a bounded overhead is itself a bound: "≤" reads "at most", ">" "more than")."""
    from unbubble.experiments.overhead import paired_text

    return paired_text([throughput / v for v in overheads], relations, minmax=False)


def _time_ratios(throughput: float, per_seed: list[tuple[float, str]]) -> str:
    """:func:`_ratios` of a method's paired per-seed ``(overhead, relation)``: an overhead above the
    largest budget bounds that seed's speed-up from above; one where PACI's own run already reached
    its twin's loss (≤) from below."""
    flip = [{">": "≤", "≤": "≥"}.get(rel, "=") for _, rel in per_seed]
    return _ratios(throughput, [v for v, _ in per_seed], flip)


def map_rows(measured: list[dict[str, Any]], facts: dict[str, dict]) -> list[dict[str, Any]]:
    """The map a user decides by, one row per (N, m): the simulated throughput of PACI (a = m) over
    the fastest synchronous schedule (gpt2-medium on H200, :func:`break_even_barrier_rows`:
    without a barrier, and PACI ``stale`` against the synchronous schedules with an exact ``sync``
    clip) is the token overhead asynchrony can afford; where this study measured a token overhead
    (``measured``: its rows, ``facts``: overhead_rows' facts by label) the time-to-target ratio is
    throughput ÷ overhead (> 1: PACI reaches the loss sooner)."""
    from unbubble.experiments.overhead import break_even_barrier_rows

    sim = {(r["N"], r["m"]): r for r in break_even_barrier_rows(MAP_NS, MAP_MS) if r["setup"].startswith("gpt2")}
    rows = []
    for n in MAP_NS:
        for m in MAP_MS:
            cell = sim[(n, m)]
            here = [r for r in measured if r["N"] == n and r["a = m"] == m]
            base = {"N": n, "m = a": m, "throughput ÷ fastest sync": cell["none"],
                    "with clip (stale vs sync)": cell["stale vs sync"]}
            if not here:
                rows.append({**base, "cell": "simulated", "model, horizon": "—", "token overhead": "—",
                             "time-to-target ÷ fastest sync": f"≥ 1 while overhead < {_ratio(cell['none']):.2f}",
                             "with clip": f"≥ 1 while overhead < {_ratio(cell['stale vs sync']):.2f}"})
            for r in here:
                f = facts[r["method"]]
                rows.append({**base, "cell": "measured",
                             "model, horizon": f"{r['model']}, {r['method'].rsplit('@', 1)[-1]}",
                             "token overhead": r["token overhead ÷ flush"], "overhead (mean)": f["overhead"],
                             "bound": f["relation"],
                             "time-to-target ÷ fastest sync": _time_ratios(_ratio(cell["none"]), f["per_seed"]),
                             "with clip": _time_ratios(_ratio(cell["stale vs sync"]), f["per_seed"])})
    return rows


def switch_rows(measured: list[dict[str, Any]], facts: dict[str, dict], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The switch part's table (:mod:`unbubble.switch`), one row per horizon and synchronous share K
    (0: PACI throughout): the paired token overhead ÷ flush + Muon and the time-to-target ÷ the
    fastest synchronous schedule on two clocks. This study's own (``overhead_rows``: the first K of
    the updates at 1F1B-flush's simulated speed, the rest at PACI's), and gpt2-medium's on N H200
    (the map's): there 1F1B-flush runs at f and PACI at r times the fastest synchronous schedule's
    throughput (:func:`~unbubble.experiments.overhead.break_even_barrier_rows`), so a run of o·T
    tokens takes o·T·(K/f + (1 − K)/r) against the fastest's T: per seed the ratio is
    1 / (o·(K/f + (1 − K)/r)), the switched run's throughput 1 / (K/f + (1 − K)/r) over its overhead.

    Args:
        measured: the study's rows of the switch part (``N``, ``a = m``, ``method``, ``token overhead ÷
            flush``, ``vs fastest synchronous``).
        facts: overhead_rows' facts by method label (``per_seed``).
        spec: the switch part's spec (each method's ``switch_at``: K as a fraction of the updates).
    """
    from unbubble.experiments.overhead import break_even_barrier_rows

    def paci_over(n: int, m: int, *schedules: tuple[str, ...]) -> float:
        """PACI's simulated throughput ÷ the fastest of ``schedules`` (default: the map's)."""
        return _ratio(next(c["none"] for c in break_even_barrier_rows((n,), (m,), *schedules)
                           if c["setup"].startswith("gpt2")))

    share = {m["label"]: m.get("switch_at", 0.0) for m in spec["methods"] if "baseline" in m}
    rows = []
    for r in measured:
        if r["method"] not in share:
            continue
        n, m, k = r["N"], r["a = m"], share[r["method"]]
        paci = paci_over(n, m)
        flush = paci / paci_over(n, m, ("1f1b-flush",))  # 1F1B-flush's throughput ÷ the fastest's
        mixed = 1 / (k / flush + (1 - k) / paci)
        rows.append({"horizon": r["method"].rsplit("@", 1)[-1], "flush share K": f"{k:.0%}",
                     "token overhead ÷ flush": r["token overhead ÷ flush"],
                     "per seed (paired)": r["per seed (paired)"],
                     "time-to-target ÷ fastest sync (study's clock)": r["vs fastest synchronous"],
                     "throughput ÷ fastest sync (gpt2-medium, simulated)": f"{mixed:.2f}",
                     "time-to-target ÷ fastest sync (gpt2-medium)":
                         _time_ratios(mixed, facts[r["method"]]["per_seed"])})
    return sorted(rows, key=lambda row: (float(row["horizon"].rstrip("×")), float(row["flush share K"].rstrip("%"))))


def map_figure(rows: list[dict[str, Any]], out: Path) -> Path:
    """Break-even lines (simulated throughput ratio against m, per N, with and without the clip's
    barrier) and the measured token overheads as points: a point under its line pays."""
    from unbubble.experiments.common import figure, save_figure

    plt = figure()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, n in enumerate(MAP_NS):
        cells = {r["m = a"]: r for r in rows if r["N"] == n}
        ms = sorted(cells)
        color = f"C{i}"
        ax.plot(ms, [_ratio(cells[m]["throughput ÷ fastest sync"]) for m in ms], "-", color=color,
                label=f"N={n}: break-even (simulated, no barrier)")
        ax.plot(ms, [_ratio(cells[m]["with clip (stale vs sync)"]) for m in ms], ":", color=color,
                label=f"N={n}: break-even with clip (stale vs sync)")
        pts = [(r["m = a"], r["overhead (mean)"], r["bound"] == ">")
               for r in rows if r["N"] == n and r["cell"] == "measured"]
        for bound, marker, what in ((False, "o", "measured token overhead"), (True, "^", "overhead above (not reached "
                                                                                          "within the budgets)")):
            mine = [(m, v) for m, v, b in pts if b == bound]
            if mine:
                ax.plot([m for m, _ in mine], [v for _, v in mine], marker, color=color, label=f"N={n}: {what}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="micro-batches per update m (= PACI's a)",
           ylabel="token overhead PACI can afford / measured", title="Where asynchrony pays (below the line)")
    ax.set_xticks(list(MAP_MS), [str(m) for m in MAP_MS])
    ticks = [1, 1.5, 2, 3, 4]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    return save_figure(fig, ax, out / "pays_study_map.png")


def analyse(out: Path, size: str) -> tuple[str, list[Path], list[dict[str, Any]]]:
    """The map's measured rows (one per PACI method with its twin), the re-run row and text."""
    from unbubble.experiments.common import md_table, write_csv

    rows, runs, facts = [], [], {}
    for part in PAYS_PARTS:
        if not (out / part / "runs.csv").is_file():
            continue
        spec = pays_study_spec(size, part)
        data = read_tables(out / part)
        runs += data.runs
        table, part_facts = part_rows(data, spec)
        facts.update(part_facts)
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
    if size != "tiny":  # the map's simulated side is gpt2-medium at N = 8 and 16
        grid = map_rows([r for r in rows if r["method"].startswith("paci") and "error feedback" in r["method"]],
                        facts)
        files += [write_csv(out / "pays_study_map.csv", grid), map_figure(grid, out)]
        md += ("\n\n**The map.** PACI + Muon + error feedback (a = m) against the fastest synchronous schedule, "
               "gpt2-medium on 8 (N = 8) or 16 (N = 16) H200 by the simulator; measured cells are this study's "
               "(deep-cpu or llama-deep-cpu on the CPU, token overhead against flush + Muon at the same m), the "
               "others simulated only: there the time-to-target ratio is ≥ 1 exactly while the token overhead stays "
               "below the throughput ratio.\n\n" + md_table(grid) + "\n\n![map](pays_study_map.png)")
    here = [r for r in rows if r["part"] == "switch"]
    switched = switch_rows(here, facts, pays_study_spec(size, "switch"))
    if switched:
        n = here[0]["N"]
        files.append(write_csv(out / "pays_study_switch.csv", switched))
        md += ("\n\n**Synchronous, then asynchronous** (part `switch`: 1F1B-flush + Muon for the first K of the "
               "updates, then PACI + Muon + error feedback; K = 0 is PACI throughout). Time-to-target ÷ the "
               f"fastest synchronous schedule on the study's {n}-device clock and on gpt2-medium's simulated "
               f"one on {n} H200 (1F1B-flush and PACI at their own throughput, each for its share of the tokens).\n\n"
               + md_table(switched))
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

