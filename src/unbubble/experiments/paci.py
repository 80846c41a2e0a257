"""PACI's throughput and memory claim (Q3) with real stage processes: tokens/s and peak stored
activations of 1F1B-flush and PACI against m (or a), measured and predicted by the simulator.
The convergence questions (Q1, Q2) are :mod:`unbubble.experiments.studies`. Source: PACI,
arXiv 2606.07881, §5; the paper's numbers in docs/architecture.md#sources."""

from __future__ import annotations

import time
from pathlib import Path

from unbubble.experiments.common import (ExperimentOutput, base_config, experiment, figure, md_table, provenance,
                                         run, save_figure, say, write_csv)
from unbubble.progress import elapsed


@experiment("throughput-memory", "tokens/s and peak memory vs micro-batches, flush and PACI, measured and predicted")
def throughput_memory(out: Path, size: str = "default", seeds: list[int] | None = None) -> ExperimentOutput:
    """Measured with real processes (N=2) and predicted by the simulator calibrated on each run."""
    from unbubble.schedules import get_schedule
    from unbubble.sim.engine import run_policies
    from unbubble.sim.measured import measured_costs

    t0 = time.perf_counter()
    seeds = seeds or [0]
    n = 2
    ms = [1, 2, 4, 8, 16] if size != "tiny" else [2]
    rows = []
    # ≈ 25 s each on 2 busy cores (measured at --size tiny: mostly the stage processes' start-up)
    say(f"throughput-memory: {2 * len(ms)} runs will train (2 stage processes each); about "
        f"{max(2 * len(ms) * 25 / 60, 1):.0f} min")
    for name in ("1f1b-flush", "paci"):
        for x in ms:
            steps = max(512 // x, 2) if size != "tiny" else 2  # 512 micro-batches: seconds of training, not start-up
            cfg = base_config(out, f"tm-{name}-{x}", schedule=name, stages=n, a=x, m=x, steps=steps, model="tiny",
                              seq_len=64, micro_batch_size=8, engine="processes", eval_batches=1, seed=seeds[0])
            r = run(cfg, f"throughput-memory: run {len(rows) + 1}/{2 * len(ms)} ({name}, m or a = {x})")
            say(f"throughput-memory: {len(rows) + 1}/{2 * len(ms)} {name} m or a = {x}: {r.tokens_per_s:,.0f} tok/s "
                f"({elapsed(time.perf_counter() - t0)} so far)")
            sched = get_schedule(name, n, steps, a=x, m=x)
            pred = run_policies(sched, measured_costs(r.trace))
            held, peak = [0] * n, [0] * n
            for rec in r.trace.records:
                s = rec.action.stage
                held[s] += {"F": 1, "B": -1}.get(rec.action.kind.value, 0)
                peak[s] = max(peak[s], held[s])
            rows.append({"schedule": name, "m or a": x, "tok/s measured": r.tokens_per_s,
                         "tok/s predicted": r.tokens / pred.makespan if pred.makespan else None,
                         "utilization measured": min(r.trace.utilization()),
                         "utilization predicted": min(pred.utilization()),
                         "peak activations (micro-batches) per stage": str(peak)})
    files = [write_csv(out / "throughput_memory.csv", rows)]
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("1f1b-flush", "paci"):
        sel = [r for r in rows if r["schedule"] == name]
        ax.plot([r["m or a"] for r in sel], [r["tok/s measured"] for r in sel], "o-", label=f"{name} measured")
        ax.plot([r["m or a"] for r in sel], [r["tok/s predicted"] for r in sel], "x--", label=f"{name} predicted")
    ax.set(xscale="log", xlabel="micro-batches per step (m or a)", ylabel="tokens/s", title="N=2 processes")
    files.append(save_figure(fig, ax, out / "throughput_memory.png"))
    wall = time.perf_counter() - t0
    md = ("## throughput-memory (PACI Q3)\n\n" + md_table(rows) + "\n\n"
          f"![throughput-memory]({(out / 'throughput_memory.png').name})\n\n"
          "Paper: PACI reaches the fully utilized throughput and 1F1B-flush's peak memory; flush throughput grows "
          "with m as m/(m+N−1).\n\n"
          + provenance(f"unbubble experiment throughput-memory --size {size}", seeds, wall,
                       engine="2 stage processes of 1 torch thread"))
    return ExperimentOutput("throughput-memory", md, files, wall)
