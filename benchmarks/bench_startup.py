"""Stage-process memory and start-up of the default run, side by side, optionally against a baseline.

What is measured, in one run: ``unbubble train`` with its defaults (PACI a = 4, 4 stage processes,
the tiny preset, Muon) for ``--steps`` steps (30: the resident memory "after 30 steps"), repeated
``--repeats`` times, alternating between this checkout and ``--baseline PATH`` (another checkout, e.g.
``git worktree add --detach ../base <commit>``; run with this environment's packages and that
checkout's ``src`` first on ``sys.path``) so any background load falls on both alike. From each run's
``summary.json``:

* ``rss_bytes``: each stage process's resident memory at the end of the run (``Rss`` of
  ``/proc/self/smaps_rollup``); reported as the mean over stages, then the median over repeats.
* ``peak_rss_bytes``: each stage's peak (``getrusage`` ``ru_maxrss``), same statistics.
* ``startup_s``: from the command's process start to the end of the first optimizer step.

Targets (issue 20): mean RSS per stage ≤ 350 MiB and start-up ≤ 5 s on a quiet 2-core machine.
The 1-minute load average before and after is printed: compare medians only from quiet runs.

Usage::

    python benchmarks/bench_startup.py                       # this checkout, 3 repeats (~1 min)
    python benchmarks/bench_startup.py --baseline ../base    # side by side
    python benchmarks/bench_startup.py --out bench_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
MIB = 2**20


def run_once(checkout: Path, steps: int, work: Path) -> dict[str, Any]:
    """One default run of ``checkout`` for ``steps`` steps; its summary.json's memory and start-up."""
    run_dir = work / f"run-{os.urandom(4).hex()}"
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    cmd = [sys.executable, "-c", "import sys; from unbubble.cli import main; sys.exit(main())",
           "-q", "train", "--steps", str(steps), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"{checkout}: unbubble train failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rss, peak = summary["rss_bytes"], summary["peak_rss_bytes"]
    return {"rss_mib": [r / MIB for r in rss], "peak_rss_mib": [p / MIB for p in peak],
            "mean_rss_mib": statistics.fmean(rss) / MIB, "mean_peak_rss_mib": statistics.fmean(peak) / MIB,
            "startup_s": summary["startup_s"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--repeats", type=int, default=3, help="runs per checkout (alternating)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (memory is read at the end)")
    parser.add_argument("--out", default="bench_startup.json", help="JSON output path")
    args = parser.parse_args(argv)
    checkouts = {"this": HERE}
    if args.baseline is not None:
        if not (args.baseline / "src" / "unbubble").is_dir():
            sys.exit(f"--baseline {args.baseline}: no src/unbubble there (give a checkout of this repository)")
        checkouts["baseline"] = args.baseline.resolve()
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, path in checkouts.items():
                runs[name].append(run_once(path, args.steps, Path(tmp)))
                last = runs[name][-1]
                print(f"  {name:<9} repeat {r + 1}: mean RSS {last['mean_rss_mib']:.0f} MiB "
                      f"(per stage {', '.join(f'{x:.0f}' for x in last['rss_mib'])}), mean peak "
                      f"{last['mean_peak_rss_mib']:.0f} MiB, start-up {last['startup_s']:.2f} s", flush=True)
    load_end = os.getloadavg()
    print(f"\nDefault run, {args.steps} steps, medians of {args.repeats} (1-min load {load_start[0]:.1f} before, "
          f"{load_end[0]:.1f} after, {os.cpu_count()} CPUs)")
    print(f"{'checkout':<10}{'mean RSS MiB':>14}{'max stage':>11}{'mean peak MiB':>15}{'start-up s':>12}")
    report: dict[str, Any] = {"steps": args.steps, "repeats": args.repeats, "load_average_start": load_start,
                              "load_average_end": load_end, "checkouts": {k: str(v) for k, v in checkouts.items()}}
    for name, rs in runs.items():
        row = {"mean_rss_mib": statistics.median(x["mean_rss_mib"] for x in rs),
               "max_stage_rss_mib": statistics.median(max(x["rss_mib"]) for x in rs),
               "mean_peak_rss_mib": statistics.median(x["mean_peak_rss_mib"] for x in rs),
               "startup_s": statistics.median(x["startup_s"] for x in rs), "runs": rs}
        report[name] = row
        print(f"{name:<10}{row['mean_rss_mib']:>14.0f}{row['max_stage_rss_mib']:>11.0f}"
              f"{row['mean_peak_rss_mib']:>15.0f}{row['startup_s']:>12.2f}")
    if "baseline" in report:
        b, t = report["baseline"], report["this"]
        print(f"{'this/base':<10}{t['mean_rss_mib'] / b['mean_rss_mib']:>14.2f}"
              f"{t['max_stage_rss_mib'] / b['max_stage_rss_mib']:>11.2f}"
              f"{t['mean_peak_rss_mib'] / b['mean_peak_rss_mib']:>15.2f}{t['startup_s'] / b['startup_s']:>12.2f}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
