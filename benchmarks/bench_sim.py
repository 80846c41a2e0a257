"""Simulator speed: simulated actions per second, fast path against the reference engine, side by side.

What is measured, in one process and one run (pure Python, no torch):

1. **Engine throughput** (``unbubble.sim.engine.run_policies``) at N = 32 stages and 10,000 micro-batches
   for PACI (a = 8), 1F1B-flush (m = 8 and m = 128) and ZB-H1 (m = 128), with unit costs (F = 1, B = 2:
   every event time ties, the worst case for event ordering) and with jittered per-stage costs (distinct
   times). Each variant is timed on the fast path and on the reference path (``fast=False``, which asks
   every policy); the ratio is reference time / fast time. Policies are built before timing (building a
   synchronous schedule's lists is the registry's work, reported apart as "lists").
2. **End to end** ``unbubble.sim.result.simulate`` (schedule lists + engine + peak-memory accounting) for the
   same PACI and 1F1B-flush runs: the time a user waits for N = 32 and 10,000 micro-batches.

Targets (issue 4): ≥ 10⁶ simulated actions per second; N = 32 with 10,000 micro-batches in under 2 s.
Medians of ``--repeats`` runs; results printed as a table and written as JSON (``--out``). Times are CPU
seconds of this process (``time.process_time``): the engine is single-threaded, so CPU time is the wall
time on an idle core, and it does not count time spent waiting for a core shared with other processes
(the wall-clock medians are in the JSON too).

Usage::

    python benchmarks/bench_sim.py                 # ~1–2 min on 2 CPU cores
    python benchmarks/bench_sim.py --quick         # N = 32, 2,000 micro-batches, 1 repeat
    python benchmarks/bench_sim.py --out bench_sim.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from unbubble.schedules import get_schedule
from unbubble.sim import PipelineCosts, StageCosts, UniformCosts, run_policies
from unbubble.sim.memory import MemorySpec
from unbubble.sim.result import schedule_policies, simulate

N = 32


def _costs(kind: str, n: int):
    if kind == "unit":
        return UniformCosts(f=1.0, b=2.0, u=0.0, i=1.0, w=1.0)
    return PipelineCosts(tuple(StageCosts(1.0 + 0.01 * s, 2.0, 1.0, 1.0, 0.05) for s in range(n)),
                         latency_s=0.01, jitter=0.1, seed=0)


def _variants(mb: int):
    return [
        ("paci a=8", lambda: get_schedule("paci", N, steps=mb // 8, a=8)),
        ("1f1b-flush m=8", lambda: get_schedule("1f1b-flush", N, steps=mb // 8, m=8)),
        ("1f1b-flush m=128", lambda: get_schedule("1f1b-flush", N, steps=max(1, mb // 128), m=128)),
        ("zb-h1 m=128", lambda: get_schedule("zb-h1", N, steps=max(1, mb // 128), m=128)),
    ]


def _time(fn, repeats: int) -> tuple[float, object, float]:
    """Median CPU seconds, the last result, median wall seconds."""
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), out, statistics.median(wall)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2,000 micro-batches, 1 repeat")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    mb, repeats = (2000, 1) if args.quick else (args.micro_batches, args.repeats)

    rows = []
    print(f"N = {N}, {mb} micro-batches, median of {repeats}, CPU seconds; Python {platform.python_version()}")
    header = f"{'variant':<18} {'costs':<7} {'actions':>9} {'lists s':>8} {'fast s':>8} {'actions/s':>11} " \
             f"{'reference s':>12} {'ref/fast':>9}"
    print(header)
    print("-" * len(header))
    for name, make in _variants(mb):
        sched = make()
        t_lists, pols, _ = _time(lambda: schedule_policies(sched), 1)
        for kind in ("unit", "jitter"):
            costs = _costs(kind, N)
            t_fast, trace, w_fast = _time(lambda: run_policies(sched, costs, policies=pols), repeats)
            t_ref, ref, _ = _time(lambda: run_policies(sched, costs, policies=pols, fast=False), 1)
            assert trace.makespan == ref.makespan and len(trace) == len(ref)
            n_act = len(trace)
            row = {"variant": name, "costs": kind, "actions": n_act, "lists_s": t_lists, "fast_s": t_fast,
                   "fast_actions_per_s": n_act / t_fast, "fast_wall_s": w_fast, "reference_s": t_ref,
                   "ratio": t_ref / t_fast}
            rows.append(row)
            print(f"{name:<18} {kind:<7} {n_act:>9,} {t_lists:>8.2f} {t_fast:>8.2f} {n_act / t_fast:>11,.0f} "
                  f"{t_ref:>12.2f} {t_ref / t_fast:>9.1f}")

    print("\nend to end (simulate: lists + engine + memory accounting), unit costs")
    e2e = []
    for name, make in _variants(mb)[:2]:
        sched = make()
        spec = MemorySpec.uniform(N, weights=1.0, act=1.0)
        t, res, w = _time(lambda: simulate(sched, UniformCosts(), spec), repeats)
        e2e.append({"variant": name, "actions": len(res.trace), "seconds": t, "wall_seconds": w})
        print(f"{name:<18} {len(res.trace):>9,} actions {t:>6.2f} s  (target < 2 s)")

    fastest = max(r["fast_actions_per_s"] for r in rows)
    worst_paci = min(r["fast_actions_per_s"] for r in rows if r["variant"].startswith("paci"))
    print(f"\nfast path: {worst_paci:,.0f}–{fastest:,.0f} actions/s for PACI / best variant "
          f"(target ≥ 1,000,000)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n_stages": N, "micro_batches": mb, "repeats": repeats, "python": sys.version,
                       "engine": rows, "end_to_end": e2e}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
