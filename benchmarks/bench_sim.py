"""Simulator speed: simulated actions per second of each engine path, side by side, optionally against a baseline.

What is measured, in one process and one run (no torch):

1. **Engine throughput** (``unbubble.sim.engine.run_policies``) at N = 32 stages and 10,000 micro-batches
   for PACI (a = 8), 1F1B-flush (m = 8 and m = 128) and ZB-H1 (m = 128), with unit costs (F = 1, B = 2:
   every event time ties, the worst case for event ordering) and with jittered per-stage costs (distinct
   times). Each variant is timed on the default path (the numba-compiled kernel, [Note: compiled engine]
   in docs/architecture.md; without numba, or with ``UNBUBBLE_SIM_NUMBA=0``, the reference) and on the
   reference (``fast=False``, which asks every policy), and the two traces are checked equal. Policies
   are built before timing (building a synchronous schedule's lists is the registry's work, reported
   apart as "lists").
2. With ``--baseline PATH`` (another checkout, e.g. a ``git worktree`` of an older commit), the same runs
   on that checkout's simulator, imported into this process beside this one, and the ratio
   this / baseline. Every run's trace rows are checked equal to the baseline's.
3. **End to end** ``unbubble.sim.result.simulate`` (schedule lists + engine + peak-memory accounting) and
   its ``summary()`` for the same PACI and 1F1B-flush runs: the time a user waits for one table row.

Targets: ≥ 2·10⁶ simulated actions per second on every variant (issues 4 and 45), ≥ 3× the landed
engine's jittered rate (issue 20). Medians of ``--repeats`` runs; the table is printed and written as JSON
(``--out``). Times are CPU seconds of this process (``time.process_time``): the engine is
single-threaded, so CPU time is the wall time on an idle core, and it does not count time spent waiting
for a core shared with other processes (the wall-clock medians are in the JSON too). The compiled
kernel is loaded (or compiled) once before timing; that one-off time is printed.

Usage::

    python benchmarks/bench_sim.py                 # ~1–2 min on 2 CPU cores
    python benchmarks/bench_sim.py --quick         # N = 32, 2,000 micro-batches, 1 repeat
    git worktree add --detach ../base HEAD~3 && python benchmarks/bench_sim.py --baseline ../base
    python benchmarks/bench_sim.py --out bench_sim.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

N = 32


def _load(src: str | None) -> types.SimpleNamespace:
    """The simulator API of the checkout whose package lives in ``src`` (``None``: the importable one).

    A baseline is imported under the same module names, then moved out of ``sys.modules`` so both
    versions live side by side (their modules keep references to each other, not to ``sys.modules``).
    """
    names = ("unbubble.schedules", "unbubble.sim", "unbubble.sim.engine", "unbubble.sim.memory",
             "unbubble.sim.result")
    if src is None:
        mods = [importlib.import_module(m) for m in names]
    else:
        mine = {k: v for k, v in sys.modules.items() if k == "unbubble" or k.startswith("unbubble.")}
        for k in mine:
            del sys.modules[k]
        sys.path.insert(0, src)
        try:
            mods = [importlib.import_module(m) for m in names]
            if not mods[0].__file__.startswith(str(Path(src).resolve())):
                raise SystemExit(f"--baseline: {src} did not provide unbubble (got {mods[0].__file__})")
        finally:
            sys.path.remove(src)
            for k in [k for k in sys.modules if k == "unbubble" or k.startswith("unbubble.")]:
                del sys.modules[k]
            sys.modules.update(mine)
    sched, sim, engine, memory, result = mods
    return types.SimpleNamespace(get_schedule=sched.get_schedule, PipelineCosts=sim.PipelineCosts,
                                 StageCosts=sim.StageCosts, UniformCosts=sim.UniformCosts,
                                 run_policies=engine.run_policies, MemorySpec=memory.MemorySpec,
                                 schedule_policies=result.schedule_policies, simulate=result.simulate,
                                 file=sched.__file__)


def _costs(api, kind: str, n: int):
    if kind == "unit":
        return api.UniformCosts(f=1.0, b=2.0, u=0.0, i=1.0, w=1.0)
    return api.PipelineCosts(tuple(api.StageCosts(1.0 + 0.01 * s, 2.0, 1.0, 1.0, 0.05) for s in range(n)),
                             latency_s=0.01, jitter=0.1, seed=0)


def _variants(mb: int):
    return [
        ("paci a=8", lambda api: api.get_schedule("paci", N, steps=mb // 8, a=8)),
        ("1f1b-flush m=8", lambda api: api.get_schedule("1f1b-flush", N, steps=mb // 8, m=8)),
        ("1f1b-flush m=128", lambda api: api.get_schedule("1f1b-flush", N, steps=max(1, mb // 128), m=128)),
        ("zb-h1 m=128", lambda api: api.get_schedule("zb-h1", N, steps=max(1, mb // 128), m=128)),
    ]


def _time(fn, repeats: int) -> tuple[float, object, float]:
    """Median CPU seconds, the last result, median wall seconds (a full garbage collection before each
    run, so every run starts from the same heap)."""
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        out = None
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), out, statistics.median(wall)


def _digest(trace) -> tuple[int, str]:
    """Rows and a hash of every row of a trace, so runs can be compared after the trace is freed."""
    h = hashlib.sha256(repr(list(trace.rows())).encode())
    return len(trace), h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2,000 micro-batches, 1 repeat")
    ap.add_argument("--baseline", default=None, metavar="PATH",
                    help="another checkout (its src/ is imported) to time side by side")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference engine (fast=False)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    mb, repeats = (2000, 1) if args.quick else (args.micro_batches, args.repeats)

    api = _load(None)
    base = None
    if args.baseline:
        src = Path(args.baseline) / "src"
        if not (src / "unbubble").is_dir():
            ap.error(f"--baseline {args.baseline}: no src/unbubble there (give a checkout of this repository)")
        base = _load(str(src.resolve()))
    from unbubble.sim import kernel

    c0 = time.perf_counter()
    compiled = kernel.compiled() is not None
    if compiled:  # load (or compile) the kernel outside the timings
        api.run_policies(api.get_schedule("paci", 2, steps=1, a=1), api.UniformCosts())
    print(f"N = {N}, {mb} micro-batches, median of {repeats}, CPU seconds; Python {platform.python_version()}")
    print(f"this checkout: {api.file}; compiled kernel: "
          + (f"numba, loaded in {time.perf_counter() - c0:.2f} s" if compiled else "off (every run takes the reference)"))
    if base is not None:
        print(f"baseline: {base.file}")
    cols = [("variant", 18, "s"), ("costs", 7, "s"), ("actions", 9, ",")]
    cols += [("lists s", 8, ".2f"), ("actions/s", 11, ",.0f")]
    if base is not None:
        cols += [("base a/s", 11, ",.0f"), ("× base", 7, ".2f")]
    if not args.no_reference:
        cols += [("ref a/s", 10, ",.0f")]
    header = " ".join(f"{c:<{w}}" if f == "s" else f"{c:>{w}}" for c, w, f in cols)
    print(header)
    print("-" * len(header))
    rows = []
    for name, make in _variants(mb):
        sched = make(api)
        t_lists, pols, _ = _time(lambda: api.schedule_policies(sched), 1)
        if base is not None:
            bsched = make(base)
            bpols = base.schedule_policies(bsched)
        for kind in ("unit", "jitter"):
            costs = _costs(api, kind, N)
            t_fast, trace, w_fast = _time(lambda: api.run_policies(sched, costs, policies=pols), repeats)
            n_act, expect = _digest(trace)
            del trace
            row = {"variant": name, "costs": kind, "actions": n_act, "lists_s": t_lists, "fast_s": t_fast,
                   "fast_actions_per_s": n_act / t_fast, "fast_wall_s": w_fast, "compiled": compiled}
            vals = [name, kind, n_act, t_lists, n_act / t_fast]
            if base is not None:
                bcosts = _costs(base, kind, N)
                t_base, btrace, w_base = _time(lambda: base.run_policies(bsched, bcosts, policies=bpols), repeats)
                assert _digest(btrace) == (n_act, expect), (name, kind, "the baseline's trace differs")
                del btrace
                row.update(baseline_s=t_base, baseline_actions_per_s=n_act / t_base, baseline_wall_s=w_base,
                           speedup_vs_baseline=t_base / t_fast)
                vals += [n_act / t_base, t_base / t_fast]
            if not args.no_reference:
                t_ref, ref, _ = _time(lambda: api.run_policies(sched, costs, policies=pols, fast=False), 1)
                assert _digest(ref) == (n_act, expect), (name, kind, "the reference trace differs")
                del ref
                row.update(reference_s=t_ref, reference_actions_per_s=n_act / t_ref)
                vals += [n_act / t_ref]
            rows.append(row)
            print(" ".join(f"{v:<{w}}" if f == "s" else f"{v:>{w}{f}}" for v, (_, w, f) in zip(vals, cols)))

    print("\nend to end (simulate: lists + engine + memory accounting, then summary()), unit costs")
    e2e = []
    for name, make in _variants(mb)[:2]:
        for label, a in [("this", api)] + ([("baseline", base)] if base is not None else []):
            sched = make(a)
            spec = a.MemorySpec.uniform(N, weights=1.0, act=1.0)
            t, res, w = _time(lambda: a.simulate(sched, a.UniformCosts(), spec).summary(), repeats)
            e2e.append({"variant": name, "checkout": label, "seconds": t, "wall_seconds": w})
            print(f"{name:<18} {label:<9} {t:>6.2f} s  (target < 2 s)")

    slowest = min(r["fast_actions_per_s"] for r in rows)
    print(f"\nslowest variant: {slowest:,.0f} actions/s (target ≥ 2,000,000)")
    if base is not None:
        worst = min(r["speedup_vs_baseline"] for r in rows if r["costs"] == "jitter")
        print(f"smallest jittered speed-up over the baseline: {worst:.2f}× (target ≥ 3×)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n_stages": N, "micro_batches": mb, "repeats": repeats, "python": sys.version,
                       "baseline": args.baseline, "engine": rows, "end_to_end": e2e}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
