"""``unbubble bench``: our runtime against torch.distributed.pipelining, and against the simulator.

A thin layer over ``benchmarks/bench_runtime.py`` (in the source checkout), which documents what is
measured; this command only finds it, runs it and prints its table.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import click

from unbubble.errors import ConfigError


def load_bench_module():
    """Imports ``benchmarks/bench_runtime.py`` from the source checkout (or the current folder).

    Raises:
        ConfigError: no ``benchmarks/bench_runtime.py`` next to the installed package or here.
    """
    roots = [Path(__file__).resolve().parents[3], Path.cwd()]
    for root in roots:
        folder = root / "benchmarks"
        if (folder / "bench_runtime.py").is_file():
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))  # spawned benchmark processes inherit sys.path
            return importlib.import_module("bench_runtime")
    raise ConfigError(f"benchmarks/bench_runtime.py was not found in {' or '.join(str(r) for r in roots)}: "
                      "run unbubble bench from the source checkout (pip install -e .)")


@click.command(context_settings={"show_default": True})
@click.option("--repeats", type=click.IntRange(1), default=None, help="Timed runs per system (default 4; medians).")
@click.option("--steps", type=click.IntRange(1), default=None, help="Optimizer steps per timed run (default 12).")
@click.option("--stages", "n", type=click.IntRange(2), default=None,
              help="Pipeline stages (processes) of the model comparison (default 2).")
@click.option("--m", "m", type=click.IntRange(1), default=None,
              help="Micro-batches per step of the model comparison; PACI uses a = m (default 4).")
@click.option("--quick", is_flag=True, help="A smoke run: 1 repeat, fewer steps (≈ 1 min).")
@click.option("--only", type=click.Choice(["model", "synthetic"], case_sensitive=False), default=None,
              help="Run one part: the model against torch, or the synthetic stages against the simulator.")
@click.option("--compile/--no-compile", "compile_", default=True,
              help="Also time 1f1b-flush and paci with every stage under torch.compile: tokens/s compiled ÷ eager "
                   "in the same processes, and the compile time (the compiled warm-up run's extra seconds).")
@click.option("--compile-backend", type=click.Choice(["inductor", "aot_eager"], case_sensitive=False), default="inductor",
              help="torch.compile backend of the compiled variants.")
@click.option("--clip/--no-clip", "clip", default=True,
              help="Also time gradient clipping (max norm 1.0): our paci with --clip-scope sync, stale and stage, "
                   "1f1b-flush with sync, and paci on torch's PipelineStage with PipelineClip sync and stale, each "
                   "÷ the same system without clipping.")
@click.option("--out", type=click.Path(dir_okay=False), default="bench_runtime.json", help="JSON results file.")
def bench(repeats: int | None, steps: int | None, n: int | None, m: int | None, quick: bool, only: str | None,
          compile_: bool, compile_backend: str, clip: bool, out: str) -> None:
    """Throughput of 1f1b-flush, gpipe and paci against torch.distributed.pipelining's ScheduleGPipe and
    Schedule1F1B (same model, micro-batches and N = 2 gloo processes): tokens/s, ratios, per-stage
    utilization, medians over repeats; then synthetic sleep stages (N = 8) against the simulator's
    makespan. PACI runs in both action orders in both parts, its default deterministic one (paci) and
    the arrival-driven one (paci dynamic, --order dynamic): the ratio is the cost of reproducibility.
    With --compile (the default) 1f1b-flush and paci also run with torch.compile'd stages: compiled ÷
    eager tokens/s, compile time apart. The row "paci on torch PipelineStage" runs unbubble.pipelining's
    SchedulePACI over torch's own PipelineStage (a = m): its tokens/s ÷ our paci and ÷ torch's 1F1B. With
    --clip (the default) the clipped rows (max norm 1.0): our paci with each --clip-scope (sync, stale,
    stage), 1f1b-flush with sync, and the PipelineStage row with PipelineClip sync and stale, each ÷ the same
    system unclipped, and the ms per step inside the clip. Targets are reported, not asserted: flush ≥ 0.95 ×
    torch 1F1B, PACI ≥ 0.95 × (m+N−1)/m × torch 1F1B, PACI + stale ≥ 0.97 × PACI, PACI on torch's
    PipelineStage ≥ 0.95 × ours, synthetic within 5 %. 8 min 03 s on 2 CPU cores at load 3.5–6.8
    (benchmarks/doc_timings.py); --no-clip leaves the clipped rows out, --no-compile the compiled ones.
    """
    mod = load_bench_module()
    cfg = mod.quick_config() if quick else mod.BenchConfig()
    for name, value in (("repeats", repeats), ("steps", steps), ("n", n), ("m", m)):
        if value is not None:
            setattr(cfg, name, value)
    if only:
        cfg.parts = (only,)
    cfg.compile, cfg.compile_backend, cfg.clip = compile_, compile_backend, clip
    res = mod.run(cfg)
    click.echo(mod.format_report(res))
    Path(out).write_text(json.dumps(res, indent=1))
    click.echo(f"results: {out}")
