"""The two convergence studies: ``paci-study`` (PACI's Q1/Q2 and remedies for the gradient delay)
and ``br-study`` (Basis Rotation's delay scaling and ablation).

Each trains its sweep (:mod:`unbubble.experiments.study_specs`, run by
:func:`unbubble.experiments.sweep.run_sweep`: lr tuned per method, seeds at the tuned lr, equal
tokens) and then analyses only ``runs.csv`` and ``curves.csv``, so the tables and plots regenerate
from the committed CSVs without training (``unbubble experiment NAME --analyze docs/data/NAME``).

Metrics (docs/architecture.md#comparing-convergence): final validation loss mean ± sample std over seeds; iso-loss token overhead
against the synchronous baseline at m = a; time to a target on the simulated clock of N devices,
calibrated from the per-action durations measured in the runs; Basis Rotation's slowdown in
updates to a training-loss target below the unigram plateau.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

from unbubble.experiments.common import (ExperimentOutput, experiment, figure, md_table, provenance, save_figure, say,
                                         write_csv)
from unbubble.experiments.stats import (iso_loss_overhead, loss_at, loss_at_fraction, mean_curve, mean_std, rms_std,
                                        slowdown, smooth, time_to_target)
from unbubble.experiments.study_specs import br_spec, paci_spec
from unbubble.experiments.sweep import SweepData, SweepSpec, raw_tables, read_tables, run_sweep, tuned_lrs


#: Experiments that are resumable sweeps (``--analyze`` rebuilds them from their CSVs).
STUDIES = ("paci-study", "br-study", "overhead-study", "horizon-study", "pays-study", "clip-study")


def _study_provenance(name: str, size: str, spec: dict[str, Any], data: SweepData, wall: float,
                      analyze: Path | None, workers: int) -> str:
    """The provenance line; analysed from CSVs, the wall time is the runs' total ÷ ``workers``."""
    run_wall = sum(r["wall_s"] for r in data.runs)
    engine = (f"emulator, {len(data.runs)} runs, {workers} at a time on 1 torch thread each, "
              f"{run_wall / 3600:.2f} run-hours" + ("" if analyze is None else f"; wall time = run-hours ÷ {workers}"))
    return provenance(f"unbubble experiment {name} --size {size}", spec["seeds"],
                      wall if analyze is None else run_wall / workers, engine=engine)


def _train_or_read(spec_dict: dict[str, Any], seeds: list[int] | None, out: Path, analyze: Path | None,
                   workers: int) -> tuple[dict[str, Any], SweepData]:
    """(the spec with ``seeds`` if given, its runs): trained into ``out``, or read from ``analyze``."""
    if seeds:
        spec_dict = {**spec_dict, "seeds": list(seeds)}
    if analyze is None:
        run_sweep(SweepSpec.from_dict(spec_dict), out, workers=workers, progress=say)
    return spec_dict, read_tables(out if analyze is None else analyze)


class Study:
    """Runs of one sweep grouped by (method, N) at each one's tuned lr."""

    def __init__(self, data: SweepData):
        self.data = data
        self.best = tuned_lrs(data.runs)
        self.by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
        #: token-budget runs (budget ≠ 1) per (method, N), kept apart from the method's own runs
        self.budgets: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in data.runs:
            into = self.by_key if r.get("budget", 1.0) == 1.0 else self.budgets
            into.setdefault((r["method"], r["stages"]), []).append(r)

    def has(self, method: str, n: int) -> bool:
        return (method, n) in self.by_key

    def lr(self, method: str, n: int) -> float:
        """The tuned lr, or (for ``lr_from`` methods, which are not tuned) the one they ran at."""
        return self.best.get((method, n), self.by_key[(method, n)][0]["lr"])

    def lr_label(self, method: str, n: int) -> str:
        """The lr as a table shows it: "1e-02 (edge)" when it is the largest or smallest of ≥ 2
        tried (the best may lie beyond the grid), "(from …)" for an lr borrowed with ``lr_from``."""
        lr = self.lr(method, n)
        tried = sorted({r["lr"] for r in self.by_key[(method, n)] if r["phase"] == "tune"})
        if not tried:
            return f"{lr:g} (borrowed)"
        return f"{lr:g} (edge)" if len(tried) > 1 and lr in (tried[0], tried[-1]) else f"{lr:g}"

    def final(self, method: str, n: int) -> list[dict[str, Any]]:
        """The runs at the tuned lr (one per seed)."""
        lr = self.lr(method, n)
        return sorted((r for r in self.by_key[(method, n)] if r["lr"] == lr), key=lambda r: r["seed"])

    def losses(self, method: str, n: int) -> list[float]:
        return [r["final_val_loss"] if r["final_val_loss"] is not None else math.inf for r in self.final(method, n)]

    def curves(self, method: str, n: int) -> list[list[tuple[float, float | None]]]:
        """Validation curves ``(tokens, loss)`` of the seeds at the tuned lr."""
        return [[(tok, loss) for _, tok, loss in self.data.val[r["run_id"]]] for r in self.final(method, n)]

    def curve(self, method: str, n: int) -> list[tuple[float, float]]:
        return mean_curve(self.curves(method, n))

    def updates_curve(self, method: str, n: int) -> list[tuple[int, float]]:
        """Mean validation loss per weight version v (for the simulated clock)."""
        runs = self.final(method, n)
        per = [[(v, loss) for v, _, loss in self.data.val[r["run_id"]]] for r in runs]
        return mean_curve(per)


def _fmt_ms(values: list[float]) -> str:
    if any(not math.isfinite(v) for v in values):
        return "diverged"
    mean, std = mean_std(values)
    return f"{mean:.3f} ± {std:.3f}" if len(values) > 1 else f"{mean:.3f}"


def _mb_per_update(run: dict[str, Any]) -> int:
    return run["micro_batches"] // max(run["steps"], 1)


# PACI study ------------------------------------------------------------------------------------


def sim_update_times(study: Study, method: str, n: int) -> list[float]:
    """Simulated end time (s) of each update of the last stage for ``method`` at depth ``n``:
    the schedule on N devices with per-stage F and B durations = the median over every run at
    depth n (so all methods share one clock), and U = the median of this method's runs."""
    from unbubble.schedules.registry import get_schedule
    from unbubble.sim.costs import PipelineCosts, StageCosts
    from unbubble.sim.engine import run_policies

    at_n = [r for r in study.data.runs if r["stages"] == n]
    own = study.by_key[(method, n)]
    f = [statistics.median(r["f_s"][s] for r in at_n) for s in range(n)]
    b = [statistics.median(r["b_s"][s] for r in at_n) for s in range(n)]
    u = [statistics.median(r["u_s"][s] for r in own) for s in range(n)]
    run = own[0]
    sched = get_schedule(run["schedule"], n, run["steps"], a=run["a"], m=run["m"])
    trace = run_policies(sched, PipelineCosts(tuple(StageCosts.from_fb(f[s], b[s], u[s]) for s in range(n))))
    return [rec.end for rec in trace.records if rec.action.kind.value == "U" and rec.action.stage == n - 1]


def _time_curve(study: Study, method: str, n: int, times: dict) -> list[tuple[float, float]]:
    if (method, n) not in times:
        times[(method, n)] = sim_update_times(study, method, n)
    ends = times[(method, n)]
    return [(0.0 if v == 0 else ends[min(int(v), len(ends)) - 1], loss) for v, loss in study.updates_curve(method, n)]


def _run_to_run_std(study: Study, method: str, n: int) -> float | None:
    """PACI's stability measure: the across-seed std of the validation loss, RMS over the
    evaluations after the first (None with one seed or a diverged seed)."""
    curves = [[loss for _, loss in c[1:]] for c in study.curves(method, n)]
    if len(curves) < 2 or any(x is None or not math.isfinite(x) for c in curves for x in c):
        return None
    return rms_std(curves)


def _baseline(study: Study, method: str, n: int) -> str | None:
    """The synchronous baseline of a method: 1F1B-flush with m = the method's micro-batches per update."""
    if method.startswith("1f1b-flush"):
        return method
    label = f"1f1b-flush m={_mb_per_update(study.by_key[(method, n)][0])}"
    return label if study.has(label, n) else None


def paci_tables(study: Study, n: int = 8) -> dict[str, list[dict[str, Any]]]:
    """The PACI study's tables at depth ``n`` (main comparison, gap vs lr, a and N scans, gap
    vs training length), each a list of rows."""
    times: dict = {}
    # the synchronous AdamW options a user would otherwise run (flushes with a remedy have their own column)
    flushes = [m for (m, d) in study.by_key if d == n and m.startswith("1f1b-flush") and " + " not in m]
    main, lr_rows, scan_a, scan_n, length = [], [], [], [], []
    methods = list(dict.fromkeys(m for (m, d) in study.by_key if d == n))
    for method in methods:
        base = _baseline(study, method, n)
        losses = study.losses(method, n)
        curve = study.curve(method, n)
        row = {"method": method, "tuned lr": study.lr_label(method, n), "seeds": len(losses),
               "final val loss": _fmt_ms(losses), "run-to-run std": _run_to_run_std(study, method, n),
               "max Δ": max(r["max_drift"] for r in study.final(method, n))}
        if base is not None:
            bl = study.losses(base, n)
            # the baseline's final loss as its curve holds it (curves.csv keeps 5 decimals: the
            # baseline must reach its own target)
            target = study.curve(base, n)[-1][1]
            base_tokens = study.final(base, n)[0]["tokens"]
            ratio, reached = iso_loss_overhead(curve, target, base_tokens)
            row["gap vs " + "flush m=a"] = statistics.fmean(losses) - statistics.fmean(bl)
            row["iso-loss tokens ÷ flush"] = f"{ratio:.2f}" if reached else f"> {ratio:.2f}"
            same = f"{base} + {method.split(' + ', 1)[1]}" if " + " in method and base != method else None
            if same is not None and study.has(same, n):  # a remedy against the same optimizer without delay
                row["gap vs flush, same optimizer"] = statistics.fmean(losses) - statistics.fmean(study.losses(same, n))
            t_method = time_to_target(_time_curve(study, method, n, times), target)
            t_base = time_to_target(_time_curve(study, base, n, times), target)
            fastest = min((t for fl in flushes if (t := time_to_target(_time_curve(study, fl, n, times), target))),
                          default=None)
            row["time-to-target speed-up vs flush m=a"] = (f"{t_base / t_method:.2f}" if t_method and t_base
                                                           else "not reached")
            row["vs fastest AdamW flush"] = f"{fastest / t_method:.2f}" if t_method and fastest else "not reached"
            # a looser target every method of the study reaches: flush's loss at half its tokens
            half = loss_at(study.curve(base, n), 0.5 * base_tokens)
            t_half = time_to_target(_time_curve(study, method, n, times), half) if half is not None else None
            t_base_half = time_to_target(_time_curve(study, base, n, times), half) if half is not None else None
            row["speed-up to flush's loss at 50 %"] = (f"{t_base_half / t_half:.2f}" if t_half and t_base_half
                                                      else "not reached")
        main.append(row)
        tune = {r["lr"]: r["final_val_loss"] for r in study.by_key[(method, n)] if r["phase"] == "tune"}
        if len(tune) > 1:
            lr_rows.append({"method": method, **tune})
    for a in sorted({_mb_per_update(study.by_key[(m, n)][0]) for m in methods if m.startswith("paci a=")}):
        p, f = f"paci a={a}", f"1f1b-flush m={a}"
        if study.has(p, n) and study.has(f, n):
            scan_a.append(_scan_row({"a": a, "N": n}, study, p, f, n))
    for depth in sorted({d for (_, d) in study.by_key}):
        # flush's updates do not depend on N (same math, another clock): its N = n run serves every depth
        f_depth = depth if study.has("1f1b-flush m=4", depth) else n
        if study.has("paci a=4", depth) and study.has("1f1b-flush m=4", f_depth):
            scan_n.append(_scan_row({"a": 4, "N": depth}, study, "paci a=4", "1f1b-flush m=4", depth, f_depth))
    for p, f in (("paci a=4", "1f1b-flush m=4"), ("paci a=8", "1f1b-flush m=8")):
        if study.has(p, n) and study.has(f, n):
            pc, fc = study.curve(p, n), study.curve(f, n)
            end = fc[-1][0]
            length.append({"pair": f"{p} − {f}", **{
                f"gap at {frac:.0%} of tokens": (loss_at(pc, frac * end) or math.nan) - (loss_at(fc, frac * end) or math.nan)
                for frac in (0.25, 0.5, 0.75, 1.0)}})
    grid = sorted({lr for row in lr_rows for lr in row if lr != "method"})
    lr_rows = [{"method": row["method"], **{f"lr {lr:g}": row.get(lr) for lr in grid}} for row in lr_rows]
    return {"main": main, "lr": lr_rows, "scan_a": scan_a, "scan_n": scan_n, "length": length}


def _scan_row(head: dict[str, Any], study: Study, p: str, f: str, n: int, f_n: int | None = None) -> dict[str, Any]:
    """Seed-0 comparison at each method's own tuned lr (the scans run one seed); the flush run is
    taken at depth ``f_n`` (default ``n``)."""
    pl = study.final(p, n)[0]
    fl = next(r for r in study.final(f, f_n or n) if r["seed"] == pl["seed"])
    return {**head, "paci lr": pl["lr"], "paci loss": pl["final_val_loss"], "flush lr": fl["lr"],
            "flush loss": fl["final_val_loss"], "gap": (pl["final_val_loss"] or math.inf) - (fl["final_val_loss"] or math.inf)}


def paci_plots(study: Study, out: Path, n: int = 8) -> list[Path]:
    plt = figure()
    files = []
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    shown: list[tuple[float, float]] = []  # (tokens, loss) plotted: the y-axis is taken from them
    for method in dict.fromkeys(m for (m, d) in study.by_key if d == n):
        curves = study.curves(method, n)
        if len(curves) < 2:
            continue
        mc = mean_curve(curves)
        xs = [x / 1e6 for x, _ in mc]
        ys = [y for _, y in mc]
        shown += [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
        sd = [statistics.stdev([c[i][1] for c in curves]) for i in range(len(mc))]
        line, = ax.plot(xs, ys, lw=1.2, label=f"{method} (lr {study.lr(method, n):g})",
                        ls="-" if method.startswith(("1f1b", "paci a=")) and "+" not in method else "--")
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.2,
                        color=line.get_color())
    ax.set(xlabel="tokens (millions; equal for every method)", ylabel="validation loss (mean ± std over seeds)",
           title=f"PACI study, N={n}, each method at its tuned lr")
    if shown:  # the curves after their first fifth of tokens: the start (ln V ≈ 5.5) would flatten the rest
        end = max(x for x, _ in shown)
        late = [y for x, y in shown if x >= 0.2 * end] or [y for _, y in shown]
        ax.set_ylim(min(late) - 0.05 * (max(late) - min(late) or 1), max(late) + 0.1 * (max(late) - min(late) or 1))
    files.append(save_figure(fig, ax, out / "paci_study_loss.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(m for (m, d) in study.by_key if d == n):
        base = _baseline(study, method, n)
        if base is None or base == method:
            continue
        mine = {r["lr"]: r["final_val_loss"] for r in study.by_key[(method, n)] if r["phase"] == "tune"}
        ref = {r["lr"]: r["final_val_loss"] for r in study.by_key[(base, n)] if r["phase"] == "tune"}
        lrs = sorted(set(mine) & set(ref))
        if len(lrs) > 1:
            ax.plot(lrs, [(mine[x] or math.nan) - (ref[x] or math.nan) for x in lrs], "o-", label=f"{method} − {base}")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final val loss gap (nats, seed 0)",
           title=f"Gap to the synchronous baseline vs lr, N={n}")
    files.append(save_figure(fig, ax, out / "paci_study_gap_lr.png"))

    times: dict = {}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lo = min(statistics.fmean(study.losses(m, n)) for (m, d) in study.by_key if d == n)
    targets = [lo + (3.0 - lo) * i / 20 for i in range(21)]
    for method in ("1f1b-flush m=4", "1f1b-flush m=8", "paci a=4", "paci a=8",
                   *[m for (m, d) in study.by_key if d == n and "+" in m]):
        if not study.has(method, n):
            continue
        tc = _time_curve(study, method, n, times)
        pts = [(tg, t) for tg in targets if (t := time_to_target(tc, tg)) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" if method.startswith("1f1b") else "--", lw=1.2,
                label=method)
    ax.set(xlabel="target validation loss", ylabel="simulated seconds to reach it", yscale="log",
           title=f"Time to target on the calibrated clock of N={n} devices")
    ax.invert_xaxis()
    files.append(save_figure(fig, ax, out / "paci_study_time_to_target.png"))
    return files


@experiment("paci-study", "tuned, multi-seed PACI vs 1F1B-flush at equal tokens, the stashed control, and remedies")
def paci_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
               workers: int = 2) -> ExperimentOutput:
    """PACI's Q1/Q2 at N = 8 (N = 2 in ``tiny``); see the module docstring."""
    t0 = time.perf_counter()
    spec, data = _train_or_read(paci_spec(size), seeds, out, analyze, workers)
    study = Study(data)
    n = max(spec["stages"])
    tables = paci_tables(study, n)
    files = [write_csv(out / f"paci_study_{k}.csv", rows) for k, rows in tables.items() if rows]
    files += paci_plots(study, out, n)
    wall = time.perf_counter() - t0
    b = spec["base"]
    tokens = spec["micro_batches"] * b["micro_batch_size"] * b["seq_len"]
    md = (f"## paci-study (PACI Q1/Q2 and remedies), N={n}\n\n"
          f"Setup: {b['model']}, byte-level KJV, {spec['micro_batches']:,} micro-batches of "
          f"{b['micro_batch_size']}×{b['seq_len']} tokens per run ({tokens:,} tokens, equal for every method), "
          f"warm-up {b['warmup_frac']:.0%} of the tokens, cosine to 10 %, AdamW (0.9, 0.95) wd 0.1 unless named; "
          f"lr tuned per method over {spec['lrs']} on seed {spec['seeds'][0]}, then seeds {spec['seeds'][1:]} at "
          "the tuned lr. Baseline of each method: 1F1B-flush with m = its micro-batches per update. "
          "Time-to-target: the simulated clock of N devices with per-stage F/B durations measured in these runs.\n\n"
          + md_table(tables["main"]) + "\n\n"
          + ("Final validation loss at each lr (seed 0):\n\n" + md_table(tables["lr"]) + "\n\n" if tables["lr"] else "")
          + ("Gap vs a (own tuned lr, seed 0):\n\n" + md_table(tables["scan_a"]) + "\n\n" if tables["scan_a"] else "")
          + ("Gap vs N (a = 4, own tuned lr, seed 0):\n\n" + md_table(tables["scan_n"]) + "\n\n" if tables["scan_n"] else "")
          + ("Gap vs training length (mean over seeds):\n\n" + md_table(tables["length"]) + "\n\n" if tables["length"] else "")
          + "![loss](paci_study_loss.png)\n\n![gap vs lr](paci_study_gap_lr.png)\n\n"
            "![time to target](paci_study_time_to_target.png)\n\n"
          + _study_provenance("paci-study", size, spec, data, wall, analyze, workers))
    return ExperimentOutput("paci-study", md, files, wall, data=raw_tables(out if analyze is None else analyze))


# Basis Rotation study ----------------------------------------------------------------------------

WINDOW = 10  # updates of smoothing before a training loss counts as reaching the target
TARGET_FRACTION = 0.5


def _slowdown_text(p1: float | None, pn: float | None, updates: int) -> str | None:
    """The slowdown, or its lower bound "> updates/p1" when depth P never reached the target."""
    if p1 and pn:
        return f"{slowdown({1: p1, 2: pn})[2]:.2f}"
    return f"> {updates / p1:.2f}" if p1 else None


def br_tables(study: Study) -> tuple[float, float, dict[str, list[dict[str, Any]]]]:
    """(target, plateau, tables): the target is AdamW's smoothed training loss at half of its
    P = 1 run (mean over seeds); steps to target are means over the seeds that ran."""
    ref = study.final("adamw", 1)
    target = statistics.fmean(loss_at_fraction(study.data.train[r["run_id"]], TARGET_FRACTION, WINDOW) for r in ref)
    plateau = statistics.fmean(loss_at_fraction(study.data.train[r["run_id"]], 0.1, WINDOW) for r in ref)

    def steps(method: str, p: int) -> float | None:
        if method == "pipedream-lr" and p == 1:  # τ = 0: PipeDream-LR is AdamW
            method = "adamw"
        for label in (method, f"{method} @ P=4-16"):
            if study.has(label, p):
                reached = [time_to_target(list(enumerate(smooth(study.data.train[r["run_id"]], WINDOW), 1)), target)
                           for r in study.final(label, p)]
                return None if any(x is None for x in reached) else statistics.fmean(reached)
        return None

    depths = sorted({d for (_, d) in study.by_key})
    updates = study.data.runs[0]["steps"]
    opts = [m for m in ("adamw", "pipedream-lr", "nesterov", "basis-rotation (2nd, bilateral)", "muon")
            if any(k[0] == m for k in study.by_key)]
    scaling = []
    for opt in opts:
        for stash in (True, False):
            label = opt if stash else f"{opt}, no stashing"
            if not stash and not any(k[0] == label for k in study.by_key):
                continue
            row: dict[str, Any] = {"optimizer": opt, "stashing": stash}
            for p in depths:
                row[f"P={p}"] = steps(opt, 1) if p == 1 else steps(label, p)
            last = depths[-1]
            row[f"slowdown P=1→{last}"] = _slowdown_text(row["P=1"], row[f"P={last}"], updates)
            scaling.append(row)
    tuned = []
    for opt in opts:
        for p in (1, depths[-1]):
            if study.has(opt, p):
                tuned.append({"optimizer": opt, "P": p, "tuned lr": study.lr_label(opt, p),
                              "final val loss": _fmt_ms(study.losses(opt, p)), "seeds": len(study.losses(opt, p))})
    ablation = []
    for label in ["adamw"] + [m for m in dict.fromkeys(k[0] for k in study.by_key)
                              if m.startswith("basis-rotation (") and "," in m.split(")")[0] and "P=4" not in m
                              and "no stashing" not in m and not m.endswith(("stage-aware", "inverse"))]:
        s1, sp = steps(label, 1), steps(label, depths[-1])
        ablation.append({"variant": label, "P=1 steps": s1, f"P={depths[-1]} steps": sp,
                         "slowdown": _slowdown_text(s1, sp, updates),
                         f"P={depths[-1]} final val loss": _fmt_ms(study.losses(label, depths[-1]))
                         if study.has(label, depths[-1]) else None})
    alloc = []
    for suffix, name in (("", "uniform"), (", stage-aware", "stage-aware"), (", inverse", "inverse")):
        label = f"basis-rotation (2nd, bilateral){suffix}"
        if study.has(label, depths[-1]):
            seed0 = study.final(label, depths[-1])[:1]
            alloc.append({"allocation": name, f"P={depths[-1]} steps to target": (
                time_to_target(list(enumerate(smooth(study.data.train[seed0[0]["run_id"]], WINDOW), 1)), target)),
                "final val loss (seed 0)": seed0[0]["final_val_loss"]})
    return target, plateau, {"scaling": scaling, "tuned": tuned, "ablation": ablation, "allocation": alloc}


def br_plots(study: Study, tables: dict[str, list[dict[str, Any]]], target: float, out: Path) -> list[Path]:
    plt = figure()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    depths = sorted({d for (_, d) in study.by_key})
    for row in tables["scaling"]:
        pts = [(p, row[f"P={p}"]) for p in depths if row.get(f"P={p}") is not None]
        ax.plot([p for p, _ in pts], [s for _, s in pts], "o-" if row["stashing"] else "x--",
                label=f"{row['optimizer']}{'' if row['stashing'] else ', no stashing'}")
    ax.set(xscale="log", xlabel="pipeline depth P (τ_s = P−1−s)",
           ylabel=f"updates to training loss {target:.3f} (missing = not reached)",
           title="Delay scaling, each optimizer at its tuned lr")
    files = [save_figure(fig, ax, out / "br_study_scaling.png")]
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = tables["ablation"]
    last = depths[-1]
    xs = range(len(rows))
    for off, col, name in ((-0.2, "P=1 steps", "P=1"), (0.2, f"P={last} steps", f"P={last}")):
        ax.bar([x + off for x in xs], [r[col] or 0 for r in rows], width=0.4, label=f"{name} (0 = not reached)")
    ax.set_xticks(list(xs), [r["variant"] for r in rows], rotation=25, ha="right", fontsize=7)
    ax.set(ylabel=f"updates to loss {target:.3f}", title="Basis Rotation ablation (stashed delays)")
    files.append(save_figure(fig, ax, out / "br_study_ablation.png"))
    return files


@experiment("br-study", "tuned Basis Rotation delay scaling P=1…32 with/without stashing, ablation, allocation")
def br_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
             workers: int = 2) -> ExperimentOutput:
    """Basis Rotation's slowdown P = 1 → 32 and ablation; see the module docstring."""
    t0 = time.perf_counter()
    spec, data = _train_or_read(br_spec(size), seeds, out, analyze, workers)
    study = Study(data)
    target, plateau, tables = br_tables(study)
    files = [write_csv(out / f"br_study_{k}.csv", rows) for k, rows in tables.items() if rows]
    files += br_plots(study, tables, target, out)
    wall = time.perf_counter() - t0
    b = spec["base"]
    md = (f"## br-study (Basis Rotation delay scaling and ablation)\n\n"
          f"Setup: {b['model']}, byte-level KJV, {spec['micro_batches']} updates of one {b['micro_batch_size']}×"
          f"{b['seq_len']}-token micro-batch, PipeDream's schedule (stashing, τ_s = P−1−s) or async 1F1B (no "
          f"stashing), warm-up {b['warmup_frac']:.0%}, cosine to 10 %; lr tuned over {spec['lrs']} at P = 1 and "
          f"P = {max(spec['stages'])} (stashed) on seed {spec['seeds'][0]}, seeds {spec['seeds'][1:]} added there; "
          "other depths, no-stashing runs and variants use the tuned lr of the nearest tuned depth. "
          f"Target: training loss {target:.3f} (AdamW at P = 1, {TARGET_FRACTION:.0%} of its run, smoothed over "
          f"{WINDOW} updates; the unigram plateau at 10 % of the run: {plateau:.3f}). — = not reached.\n\n"
          + md_table(tables["scaling"]) + "\n\n" + md_table(tables["tuned"]) + "\n\n"
          + md_table(tables["ablation"]) + "\n\n" + (md_table(tables["allocation"]) + "\n\n" if tables["allocation"] else "")
          + "![scaling](br_study_scaling.png)\n\n![ablation](br_study_ablation.png)\n\n"
          + _study_provenance("br-study", size, spec, data, wall, analyze, workers))
    return ExperimentOutput("br-study", md, files, wall, data=raw_tables(out if analyze is None else analyze))
