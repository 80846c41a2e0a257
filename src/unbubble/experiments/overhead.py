"""``overhead-study``: when does asynchrony pay? Token overhead and time-to-target of PACI with
delay remedies against 1F1B-flush with the same optimizer (docs/architecture.md#comparing-convergence).

Two resumable sweeps (the paci-study horizon with token budgets, and a 4× longer one), analysed from
``runs.csv`` and ``curves.csv`` only. The sweeps and the metrics:
docs/architecture.md#experimentsoverheadpy.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from pathlib import Path
from typing import Any

from unbubble.experiments.common import (ExperimentOutput, experiment, figure, md_table, provenance, save_figure, say,
                                         write_csv)
from unbubble.experiments.stats import budget_overhead, iso_loss_overhead, mean_std, time_to_target
from unbubble.experiments.studies import Study
from unbubble.experiments.study_specs import horizon_spec, overhead_spec
from unbubble.experiments.sweep import SweepSpec, raw_tables, read_tables, run_sweep, write_tables
from unbubble.sim.extrapolate import COMPARE_V, SYNCHRONOUS, chunk_costs, sync_label, synchronous_options

#: The longer horizon, a multiple of the paci-study tokens.
HORIZON = 4.0


class Clock:
    """The simulated clock of N devices for a study's runs: per-stage F and B durations are the
    medians over every run at depth N (one clock for all methods), U the median of the method's own
    runs (Muon's update costs more than AdamW's).

    ``pool``: the runs the medians come from instead (every run at N), and U then per optimizer
    over the pool: for a study that reuses runs timed by older code, whose durations are not
    comparable (Muon's U fell from ≈ 20 ms to ≈ 4 ms per stage between overhead-study and
    horizon-study), a pool of the runs timed together keeps both sides of every ratio on one clock."""

    def __init__(self, study: Study, n: int, pool: list[dict[str, Any]] | None = None):
        self.study, self.n = study, n
        self.pool = pool
        at_n = [r for rs in study.by_key.values() for r in rs if r["stages"] == n] if pool is None else \
            [r for r in pool if r["stages"] == n]
        self.f = [statistics.median(r["f_s"][s] for r in at_n) for s in range(n)]
        self.b = [statistics.median(r["b_s"][s] for r in at_n) for s in range(n)]
        self._cache: dict[tuple, float] = {}

    def _costs(self, method: str):
        from unbubble.sim.costs import PipelineCosts, StageCosts

        own = self.study.by_key[(method, self.n)]
        if self.pool is not None:
            own = [r for r in self.pool if r["stages"] == self.n and r["optimizer"] == own[0]["optimizer"]]
        u = [statistics.median(r["u_s"][s] for r in own) for s in range(self.n)]
        return PipelineCosts(tuple(StageCosts.from_fb(self.f[s], self.b[s], u[s]) for s in range(self.n)))

    def makespan(self, method: str, schedule: str, steps: int, a: int = 1, m: int = 1, v: int = COMPARE_V) -> float:
        """Simulated seconds for ``steps`` updates of ``schedule`` with ``method``'s update cost (a
        schedule with v chunks per rank runs each stage's measured work split evenly into v chunks:
        the study's model has one block per stage)."""
        from unbubble.schedules.registry import get_schedule
        from unbubble.sim.engine import run_policies

        key = (method, schedule, steps, a, m, v)
        if key not in self._cache:
            sched = get_schedule(schedule, self.n, steps, a=a, m=m, v=v)
            costs = chunk_costs(self._costs(method), self.n, sched.virtual, sched.placement)
            self._cache[key] = run_policies(sched, costs).makespan
        return self._cache[key]

    def sync_step(self, method: str, m: int, memory: str = "any") -> tuple[float, str]:
        """(seconds per update, schedule) of the fastest synchronous schedule for ``method``'s
        updates at m micro-batches per update (flushed schedules repeat the same step), among
        :func:`~unbubble.sim.extrapolate.synchronous_options` (``memory="1f1b"``: within 1F1B-flush's
        activation memory)."""
        options = [(self.makespan(method, name, 4, m=m) / 4, sync_label(name))
                   for name in synchronous_options(self.n, m, SYNCHRONOUS, memory)]
        return min(options)

    def async_time(self, method: str, steps: float) -> float:
        """Simulated seconds for ``steps`` updates of ``method``'s asynchronous schedule (rounded up);
        a switched method (``switch_after``, :mod:`unbubble.switch`) runs the same fraction of them
        as 1F1B-flush with m = a first, at that schedule's own speed."""
        run = self.study.by_key[(method, self.n)][0]
        total = max(math.ceil(steps), 1)
        k = min(round(run.get("switch_after", 0) / run["steps"] * total), total - 1) if run.get("switch_after") else 0
        sync = self.makespan(method, "1f1b-flush", k, m=run["a"]) if k else 0.0
        return sync + self.makespan(method, run["schedule"], total - k, a=run["a"], m=run["m"])


def _settings(run: dict[str, Any], overrides: dict[str, Any]) -> str:
    opt = run["optimizer"]
    if opt == "muon":
        return f"muon μ={overrides.get('muon_momentum', 0.95)}"
    return f"{opt} β=({overrides.get('beta1', 0.9)}, {overrides.get('beta2', 0.95)})"


def _final(run: dict[str, Any]) -> float:
    return run["final_val_loss"] if run["final_val_loss"] is not None else math.inf


def _rel(relation: str) -> str:
    return {"=": "", "≤": "≤ ", "≥": "≥ ", ">": "> "}[relation]


def paired_text(values: list[float], relations: list[str], minmax: bool = True) -> str:
    """Paired per-seed values as a table cell: ``mean ± std (min–max)`` when every seed is a
    number, the per-seed values in seed order when any is a bound (``1.04, 1.08, > 1.15``)."""
    if any(r != "=" for r in relations):
        return ", ".join(f"{_rel(r)}{v:.2f}" for v, r in zip(values, relations))
    if len(values) == 1:
        return f"{values[0]:.2f} (1 seed)"
    mu, sd = mean_std(values)
    return f"{mu:.2f} ± {sd:.2f}" + (f" ({min(values):.2f}–{max(values):.2f})" if minmax else "")


def overhead_rows(study: Study, spec: dict[str, Any], n: int,
                  same_horizon: bool = False, clock: "Clock | None" = None) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """The main table (one row per asynchronous method with a baseline) and, per method, the
    numbers the text and the horizon sweep use (``overhead``, ``relation``, ``per_seed``,
    ``speedup``…). ``same_horizon``: "vs fastest synchronous" only among the synchronous methods
    of the row's own horizon (the " @h×" suffix of their labels)."""
    methods = {m["label"]: m for m in spec["methods"]}
    clock = clock or Clock(study, n)
    all_sync = [lbl for lbl, m in methods.items() if "baseline" not in m and study.has(lbl, n)]
    rows, facts = [], {}
    for label, m in methods.items():
        base = m.get("baseline")
        if base is None or not study.has(label, n) or not study.has(base, n):
            continue
        runs = study.final(label, n)
        twins = {r["seed"]: r for r in study.final(base, n)}
        mean_target = study.curve(base, n)[-1][1]  # the baseline's mean final loss as its curve holds it
        steps1 = runs[0]["steps"]
        per_seed, relations, times, targets, seeds, commits = [], [], [], [], [], []
        budgets_trained = set()
        for r in runs:
            # paired: each seed against its own synchronous twin (same seed, same data order)
            twin = twins.get(r["seed"])
            target = _final(twin) if twin is not None else mean_target
            points, used = {1.0: _final(r)}, [r]
            for b in study.budgets.get((label, n), []):
                if b["seed"] == r["seed"] and b["lr"] == r["lr"]:
                    points[b["budget"]] = _final(b)
                    budgets_trained.add(b["budget"])
                    used.append(b)
            value, rel = budget_overhead(points, target)
            per_seed.append(value)
            relations.append(rel)
            times.append(clock.async_time(label, value * steps1))
            targets.append(target)
            seeds.append((r["seed"], twin is not None))
            # the commits the seed's value joins: its twin's and the budget runs it is read from
            keys = ({max(b for b in points if b <= value), min(b for b in points if b >= value)} if rel == "="
                    else {value})
            joined = ([twin] if twin is not None else []) + [u for u in used if u.get("budget", 1.0) in keys]
            commits.append(sorted({(u.get("commit") or "unrecorded")[:10] for u in joined}))
        base_run = study.final(base, n)[0]
        step_same, sched_same = clock.sync_step(base, base_run["m"])
        t_same = step_same * base_run["steps"]
        # the fastest synchronous (schedule, optimizer) of the study to reach the same loss
        fastest = None
        suffix = label.rsplit(" @", 1)[1] if " @" in label else None
        sync_labels = [lbl for lbl in all_sync if not same_horizon
                       or (lbl.rsplit(" @", 1)[1] if " @" in lbl else None) == suffix]
        per_fast = []  # per seed: the fastest synchronous schedule's time to that seed's target
        for (seed, _), target in zip(seeds, targets):
            best = None
            for s in sync_labels:
                sr = study.final(s, n)[0]
                step, sched = clock.sync_step(s, sr["m"])
                own = [q for q in study.final(s, n) if q["seed"] == seed]
                if own:  # the curve rounds its losses: its last point is the run's exact final loss
                    curve = [(v, loss) for v, _, loss in study.data.val[own[0]["run_id"]] if loss is not None]
                    curve[-1] = (curve[-1][0], _final(own[0]))
                else:
                    curve = study.updates_curve(s, n)
                v = time_to_target(curve, target)
                if v is not None and (best is None or v * step < best[0]):
                    best = (v * step, s, sched)
            per_fast.append(best)
        reached = [f for f in per_fast if f is not None]
        if reached:
            counts = {}
            for f in reached:
                counts[f[1:]] = counts.get(f[1:], 0) + 1
            who = max(counts, key=counts.get)
            fastest = (statistics.fmean(f[0] for f in reached), *who)
        losses = study.losses(label, n)
        t_mean = statistics.fmean(times)
        speeds = [t_same / t for t in times]
        fasts = [f[0] / t for f, t in zip(per_fast, times) if f is not None]
        bound = ">" in relations
        overhead_txt = paired_text(per_seed, relations)
        if bound:  # a seed that never reached its twin: its time is a lower bound, each ratio an upper one
            speed_txt, fast_txt = f"< {max(speeds):.2f}", (f"< {max(fasts):.2f}" if fasts else "—")
        else:
            speed_txt = paired_text(speeds, ["="] * len(speeds), minmax=False)
            fast_txt = paired_text(fasts, ["="] * len(fasts), minmax=False) if fasts else "—"
        mixed = any(len(c) > 1 or "unrecorded" in c for c in commits)
        rows.append({
            "method": label, "optimizer": _settings(runs[0], m), "tuned lr": study.lr_label(label, n),
            "seeds": len(runs), "final val loss": _fmt(losses), "flush twin": f"{_fmt(study.losses(base, n))} "
            f"(lr {study.lr(base, n):g})", "gap": statistics.fmean(losses) - statistics.fmean(study.losses(base, n)),
            "budgets trained": ", ".join(f"{b:g}" for b in sorted(budgets_trained)) or "1",
            "token overhead ÷ flush": overhead_txt,
            "per seed (paired)": ", ".join(f"s{sd}{'' if paired else '*'} {_rel(rel)}{v:.2f}"
                                           for (sd, paired), v, rel in zip(seeds, per_seed, relations)),
            "commits": ("mixed: " if mixed else "") + ", ".join(sorted({c for cs in commits for c in cs})),
            "time-to-target (s)": f"{'> ' if '>' in relations else ''}{t_mean:.3g}",
            "speed-up vs twin": f"{speed_txt} ({sched_same})",
            "vs fastest synchronous": fast_txt + (f" ({fastest[1].split(' + ')[-1] if ' + ' in fastest[1] else 'adamw'}"
                                                  f", {fastest[2]})" if fastest else ""),
        })
        relation = ">" if ">" in relations else "≤" if "≤" in relations else "="  # a bound above, below, or none
        facts[label] = {"overhead": statistics.fmean(per_seed), "relation": relation,
                        "per_seed": list(zip(per_seed, relations)), "seeds_paired": seeds, "commits": commits,
                        "mixed_commits": mixed, "speedups": speeds, "fastest_per_seed": fasts,
                        "time_s": t_mean, "twin_time_s": t_same,
                        "speedup": statistics.fmean(speeds), "fastest": statistics.fmean(fasts) if fasts else None,
                        "baseline": base, "seeds": len(runs), "gap": rows[-1]["gap"],
                        "sync_schedule": sched_same}
    return rows, facts


def horizon_rows(study: Study, h4: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Gap and curve-read iso-loss tokens at the longer horizon beside the same pair at 1×."""
    rows = []
    for m in h4["methods"]:
        base = m.get("baseline")
        if base is None or not study.has(m["label"], n) or not study.has(base, n):
            continue
        short, short_base = m["label"].rsplit(" @", 1)[0], base.rsplit(" @", 1)[0]
        losses, bl = study.losses(m["label"], n), study.losses(base, n)
        target = study.curve(base, n)[-1][1]
        ratio, reached = iso_loss_overhead(study.curve(m["label"], n), target, study.final(base, n)[0]["tokens"])
        row = {"method": short, "horizon": m["label"].rsplit("@", 1)[1], "seeds": len(losses),
               "final val loss": _fmt(losses), "flush twin": _fmt(bl),
               "gap": statistics.fmean(losses) - statistics.fmean(bl),
               "gap at 1×": (statistics.fmean(study.losses(short, n)) - statistics.fmean(study.losses(short_base, n))
                             if study.has(short, n) and study.has(short_base, n) else None),
               "tokens to twin's loss, read on the curve": f"{ratio:.2f}" if reached else f"> {ratio:.2f}"}
        rows.append(row)
    return rows


def break_even_rows(ns=(4, 8, 16), ms=(4, 8, 16, 32), schedules=SYNCHRONOUS, memory: str = "any") -> list[dict[str, Any]]:
    """The throughput ratio PACI (a = m) buys over the fastest synchronous schedule at m
    micro-batches per update (:func:`unbubble.sim.extrapolate.async_over_sync`): GPT-2 Medium on
    H200s (16 × 1024 tokens per micro-batch, the analytic cost model; schedules with several chunks
    per device get whole blocks per chunk with the devices balanced,
    :func:`~unbubble.models.partition.partition_for_devices`) and unit costs (F = 1, B = 2: a balanced
    pipeline such as the CPU presets, each chunk 1/v of a stage), against ``schedules``
    (``memory="1f1b"``: only those within 1F1B-flush's activation memory). Asynchrony pays when its
    token overhead is below it."""
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.extrapolate import async_over_sync
    from unbubble.sim.hardware import get_hardware

    rows = []
    cfg, hw = make_model("gpt2-medium"), get_hardware("h200")
    for setup in ("gpt2-medium, H200", "unit costs (F = 1, B = 2)"):
        for n in ns:
            if setup.startswith("gpt2"):  # whole blocks per chunk, the devices balanced (partition_for_devices)
                def costs(sched, n=n):
                    return analytic_model(cfg, n, hw, 16, virtual=sched.virtual, placement=sched.placement).costs
            else:
                costs = UniformCosts(f=1.0, b=2.0)
            row: dict[str, Any] = {"setup": setup, "N": n}
            for m in ms:
                ratio, name = async_over_sync(costs, n, m, schedules=schedules, memory=memory)
                row[f"m={m}"] = f"{ratio:.2f} ({name})"
            rows.append(row)
    return rows


def break_even_barrier_rows(ns=(4, 8, 16), ms=(4, 8, 16, 32), schedules=SYNCHRONOUS) -> list[dict[str, Any]]:
    """The break-even ratio with a per-update barrier (global gradient clipping: a gradient-norm
    all-reduce over every stage each update; [Note: the barrier] in docs/architecture.md), on the
    setups of :func:`break_even_rows`, one row per (setup, N, m): PACI (a = m) over the fastest
    synchronous schedule without it (``none``), with ``sync`` on every schedule (``sync``: the synchronous
    schedules lose their across-update overlap, PACI's staggered stages stall), and PACI with ``stale``
    against the synchronous schedules with ``sync`` (``stale vs sync``: the exact clip for the
    synchronous run, PACI clipping update t with the norm of update t − ⌈N/a⌉). gpt2-medium:
    the H200 table's all-reduce latency (a ring over the N devices) and each chunk's local-norm time
    (gradient bytes ÷ HBM bandwidth); unit costs: neither. Computed once per arguments (the simulator
    is deterministic)."""
    return [dict(row) for row in _barrier_rows(tuple(ns), tuple(ms), tuple(schedules))]


@functools.lru_cache(maxsize=8)
def _barrier_rows(ns: tuple, ms: tuple, schedules: tuple) -> tuple:
    """:func:`break_even_barrier_rows`, cached."""
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.barrier import GlobalOp, for_analytic
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.extrapolate import async_over_sync
    from unbubble.sim.hardware import get_hardware

    rows = []
    cfg, hw = make_model("gpt2-medium"), get_hardware("h200")
    for setup in ("gpt2-medium, H200", "unit costs (F = 1, B = 2)"):
        for n in ns:
            if setup.startswith("gpt2"):
                @functools.lru_cache(maxsize=None)
                def model(virtual, placement, n=n):
                    return analytic_model(cfg, n, hw, 16, virtual=virtual, placement=placement)

                def costs(sched, model=model):
                    return model(sched.virtual, sched.placement).costs

                def op(scope, model=model):
                    return lambda sched: for_analytic(model(sched.virtual, sched.placement), scope)
            else:
                costs = UniformCosts(f=1.0, b=2.0)

                def op(scope):
                    return GlobalOp(scope)
            for m in ms:
                row: dict[str, Any] = {"setup": setup, "N": n, "m": m}
                for key, paci_op, sync_op in (("none", None, None), ("sync", op("sync"), op("sync")),
                                              ("stale vs sync", op("stale"), op("sync"))):
                    ratio, name = async_over_sync(costs, n, m, schedules=schedules, paci_op=paci_op, sync_op=sync_op)
                    row[key] = f"{ratio:.2f} ({name})"
                rows.append(row)
    return tuple(rows)


def measured_break_even(study: Study, method: str, n: int, ms=(4, 8, 16, 32), memory: str = "any") -> dict[str, Any]:
    """The same ratio on this study's clock (per-stage F, B measured in its runs, ``method``'s U;
    schedules with v chunks per rank split each stage's measured work evenly)."""
    from unbubble.sim.extrapolate import async_over_sync

    costs = Clock(study, n)._costs(method)
    row: dict[str, Any] = {"setup": f"{study.by_key[(method, n)][0]['schedule']} runs of this study (measured "
                                    f"F/B, {method}'s U)", "N": n}
    for m in ms:
        ratio, name = async_over_sync(costs, n, m, memory=memory)
        row[f"m={m}"] = f"{ratio:.2f} ({name})"
    return row


def _schedule_set() -> str:
    """The sentence naming the synchronous schedules the break-even analyses choose from."""
    from unbubble.schedules.registry import VIRTUAL

    from unbubble.schedules.registry import V_SHAPED

    virtual = [s for s in SYNCHRONOUS if s in VIRTUAL]
    v_shaped = [s for s in SYNCHRONOUS if s in V_SHAPED]
    return (f"{', '.join(SYNCHRONOUS)} ({', '.join(virtual)} with v = {COMPARE_V} chunks per rank and "
            f"{', '.join(v_shaped)} with 2 placed in a V, each chunk doing 1/v of its stage's work, an even split "
            "assumed because the model has one block per stage; interleaved-1f1b only where m is a multiple of N, "
            "dualpipev where m ≥ 2N, its overlapped F and B run one after the other (overlap φ = 0, as on these "
            "CPUs))")


#: The sentence above the break-even table with a per-update barrier (:func:`break_even_barrier_rows`).
BARRIER_NOTE = (
    "With a per-update barrier (global gradient clipping or a global non-finite check: one gradient-norm "
    "all-reduce over all stages per update, `unbubble simulate --clip-scope`): PACI (a = m) over the fastest "
    "synchronous schedule without it (none), with `sync` on every schedule (the synchronous schedules lose "
    "their across-update overlap: ZB-H2 and ZBV pay their flushed step's bubble each update, 1F1B-flush only "
    "the latency; PACI's staggered stages wait for stage 0), and PACI with `stale` (update t clipped with the "
    "norm of update t − ⌈N/a⌉, which no stage waits for in steady state) against the synchronous "
    "schedules with `sync`. A synchronous schedule that validates its step after the fact (Zero Bubble's "
    "optimizer post-validation) keeps the ratio of the none column while clipping rarely triggers. gpt2-medium: "
    "the all-reduce's latency from the H200 table (a ring over the N devices) and each stage's local norm "
    "(gradient bytes ÷ HBM bandwidth); unit costs: neither.")


def _memory_note(ns=(4, 8, 16), ms=(4, 8, 16, 32)) -> str:
    """The sentence above the at-1F1B-memory table: the criterion and what it excludes (computed)."""
    from unbubble.sim.extrapolate import peak_activations

    out = sorted({s for n in ns for m in ms for s in synchronous_options(n, m)
                  if s not in synchronous_options(n, m, memory="1f1b")}, key=SYNCHRONOUS.index)
    bites = sorted({(n, m) for n in ns for m in ms
                    if synchronous_options(n, m) != synchronous_options(n, m, memory="1f1b")})
    only_above = all(m > n for n, m in bites)
    ex = ", ".join(f"{s} ({peak_activations(s, 8, 16):g})" for s in out)
    return ("At 1F1B-flush's activation memory: only the schedules whose busiest device holds no more activations "
            "than 1F1B-flush's, min(m, N) micro-batches (the simulator's memory model, a split backward holding a "
            "micro-batch's activations until its W; a chunk counts 1/v). PACI holds N at every m, so this is PACI's "
            "memory for m ≥ N. "
            + ("Every schedule here holds at most m, so the limit bites only where m > N; " if only_above else "")
            + f"it excludes {ex}: in brackets the micro-batches on their busiest device at N = 8, m = 16, against "
            f"1F1B-flush's {peak_activations('1f1b-flush', 8, 16):g}. The count is in stage-sized micro-batches, "
            "every chunk 1/v of a stage: on gpt2-medium's whole-block chunks the busiest device can hold more (ZBV "
            "at N = 8, m = 16: 62 GB against 1F1B-flush's 48 GB in `unbubble simulate`, its devices 1–3 holding 4 "
            "of the 24 blocks).")


def _fmt(values: list[float]) -> str:
    if any(not math.isfinite(v) for v in values):
        return "diverged"
    mu, sd = mean_std(values)
    return f"{mu:.3f} ± {sd:.3f}" if len(values) > 1 else f"{mu:.3f}"


def _pairs_for_horizon(facts: dict[str, dict], spec: dict[str, Any]) -> list[tuple[str, str]]:
    """Muon and the best remedy (lowest token overhead of the multi-seed rows other than Muon's),
    each with its flush twin."""
    methods = {m["label"]: m for m in spec["methods"]}
    multi = {k: v for k, v in facts.items() if v["seeds"] > 1}
    order = sorted(multi, key=lambda k: (multi[k]["relation"] == ">", multi[k]["overhead"], multi[k]["gap"]))

    def plain(k: str, optimizer: str) -> bool:
        m = methods[k]
        return (m.get("optimizer", "adamw") == optimizer and m.get("predict_weights", "none") == "none"
                and m.get("muon_momentum", 0.95) == 0.95)

    muon = next((k for k in order if plain(k, "muon")), None)
    remedy = next((k for k in order if k != muon), None)
    pairs = []
    for k in (muon, remedy):
        if k is not None and (k, facts[k]["baseline"]) not in pairs:
            pairs.append((k, facts[k]["baseline"]))
    return pairs


def _plots(study: Study, spec: dict[str, Any], facts: dict[str, dict], n: int, out: Path) -> list[Path]:
    plt = figure()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    methods = {m["label"]: m for m in spec["methods"]}
    for label, f in facts.items():
        base = methods[label]["baseline"]
        budgets = sorted({1.0} | {b["budget"] for b in study.budgets.get((label, n), [])})
        ys = []
        for bud in budgets:
            vals = [r["final_val_loss"] for r in (study.final(label, n) if bud == 1.0 else study.budgets[(label, n)])
                    if (bud == 1.0 or r["budget"] == bud) and r["final_val_loss"] is not None]
            ys.append(statistics.fmean(vals) if vals else math.nan)
        line, = ax.plot(budgets, ys, "o-", lw=1.2, label=label)
        ax.axhline(study.curve(base, n)[-1][1], color=line.get_color(), ls=":", lw=0.8)
    ax.set(xscale="log", xlabel="tokens ÷ the flush twin's (each budget a full warm-up + cosine run)",
           ylabel="final validation loss (mean over seeds)",
           title=f"Token budgets of PACI, N={n}; dotted: the flush twin's final loss")
    files = [save_figure(fig, ax, out / "overhead_study_budgets.png")]
    return files


@experiment("overhead-study", "token overhead and time-to-target of PACI with delay remedies (momentum, NAdam, "
                              "Muon, weight prediction) against flush with the same optimizer; 4× horizon")
def overhead_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
                   workers: int = 2) -> ExperimentOutput:
    """When does asynchrony pay? See the module docstring."""
    t0 = time.perf_counter()
    h1 = overhead_spec(size)
    if seeds:
        h1 = {**h1, "seeds": list(seeds)}
    n = max(h1["stages"])
    if analyze is None:
        records = run_sweep(SweepSpec.from_dict(h1), out / "h1", workers=workers, progress=say)
        write_tables(records, out)
        study = Study(read_tables(out))
        _, facts = overhead_rows(study, h1, n)
        tuned = {m["label"]: study.lr(m["label"], n) for m in h1["methods"] if study.has(m["label"], n)}
        horizon = HORIZON if size == "default" else 2.0
        pairs = _pairs_for_horizon(facts, h1)
        h4 = horizon_spec(h1, tuned, pairs, horizon, one_seed=pairs)  # one seed each: the 2-hour budget
        if h4["methods"]:
            records += run_sweep(SweepSpec.from_dict(h4), out / "h4", workers=workers, progress=say)
        write_tables(records, out)
    data = read_tables(out if analyze is None else analyze)
    study = Study(data)
    rows, facts = overhead_rows(study, h1, n)
    h4_methods = _horizon_methods(study, h1)
    longer = horizon_rows(study, {"methods": h4_methods}, n)
    breakeven = break_even_rows() + [measured_break_even(study, h1["methods"][0]["label"], n)]
    same_memory = break_even_rows(memory="1f1b") + [measured_break_even(study, h1["methods"][0]["label"], n,
                                                                        memory="1f1b")]
    files = [write_csv(out / "overhead_study_main.csv", rows)]
    if longer:
        files.append(write_csv(out / "overhead_study_horizon.csv", longer))
    files.append(write_csv(out / "overhead_study_break_even.csv", breakeven))
    barrier = break_even_barrier_rows()
    files.append(write_csv(out / "overhead_study_break_even_barrier.csv", barrier))
    files += _plots(study, h1, facts, n, out)
    wall = time.perf_counter() - t0
    b = h1["base"]
    tokens = h1["micro_batches"] * b["micro_batch_size"] * b["seq_len"]
    run_wall = sum(r["wall_s"] for r in data.runs)
    md = (f"## overhead-study (when asynchrony pays), N={n}\n\n"
          f"Setup: {b['model']}, byte-level KJV, PACI a = {h1['methods'][1].get('a', 4)} against 1F1B-flush with "
          f"m = a and the *same* optimizer settings; {h1['micro_batches']:,} micro-batches of "
          f"{b['micro_batch_size']}×{b['seq_len']} tokens ({tokens:,} tokens) per 1× run, warm-up "
          f"{b['warmup_frac']:.0%}, cosine to 10 %, weight decay 0.1; each method's lr tuned on seed "
          f"{h1['seeds'][0]} (rows marked (borrowed) take a tuned row's lr), then seeds {h1['seeds'][1:]}. PACI also "
          f"trains at budgets {h1['budgets']} × the tokens, each a full warm-up + cosine run, while its final loss "
          "is above its twin's. Token overhead: the budget at which PACI's final loss meets its twin's, "
          "interpolated in log tokens, mean ± std over seeds. Times: the simulated clock of N devices with the "
          f"F/B/U durations measured in these runs; the twin runs on the fastest synchronous schedule, which "
          f"computes flush's updates, of {_schedule_set()}.\n\n"
          + md_table(rows) + "\n\n"
          + ("Longer horizon (the 1× tuned lr, budgets not trained; 'read on the curve' reads the intermediate "
             "point of PACI's own cosine run, which favours the baseline):\n\n" + md_table(longer) + "\n\n"
             if longer else "")
          + "Break-even: the throughput ratio PACI (a = m) buys over the fastest synchronous schedule (simulator, "
            "steady state; in brackets the schedule). Asynchrony pays when its token overhead is below it. ZB-H2 "
            "and ZBV win only across updates: one update has ZB-H1's bubble (ZBV: half of it), but from m ≥ 2N − 1 "
            "a device starts its next update while later ones finish theirs, so the steady-state bubble vanishes; "
            "ZBV does so within 1F1B-flush's activation memory.\n\n"
          + md_table(breakeven) + "\n\n" + _memory_note() + "\n\n" + md_table(same_memory) + "\n\n"
          + BARRIER_NOTE + "\n\n" + md_table(barrier) + "\n\n"
          + "![budgets](overhead_study_budgets.png)\n\n"
          + provenance(f"unbubble experiment overhead-study --size {size}", h1["seeds"],
                       wall if analyze is None else run_wall / workers,
                       engine=f"emulator, {len(data.runs)} runs, {workers} at a time on 1 torch thread each, "
                              f"{run_wall / 3600:.2f} run-hours"))
    return ExperimentOutput("overhead-study", md, files, wall, data=raw_tables(out if analyze is None else analyze))


def _horizon_methods(study: Study, h1: dict[str, Any]) -> list[dict[str, Any]]:
    """The longer-horizon methods present in the data (labels "… @4×"), with their baselines."""
    by = {m["label"]: m for m in h1["methods"]}
    out = []
    for (label, _n) in study.by_key:
        if " @" in label:
            short = label.rsplit(" @", 1)[0]
            base = by.get(short, {}).get("baseline")
            suffix = label.rsplit(" @", 1)[1]
            out.append({"label": label, **({"baseline": f"{base} @{suffix}"} if base else {})})
    return out
