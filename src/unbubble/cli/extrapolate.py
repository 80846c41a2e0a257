"""``unbubble extrapolate``: the large-scale table (1.5B–28.3B, Zero Bubble setups) for every schedule."""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path

import click

log = logging.getLogger("unbubble.extrapolate")


@click.command(context_settings={"show_default": True})
@click.option("--hardware", default="a100-80g", help="Device preset (the paper used a100-80g).")
@click.option("--achievable", default=None, type=float, help="Fraction of peak FLOP/s [default: the preset's].")
@click.option("--schedules", default=None,
              help="Comma-separated schedules [default: 1f1b-flush, interleaved-1f1b, zb-h1, zb-h2, pipedream, paci].")
@click.option("--models", default=None, help="Comma-separated setups [default: zb-1.5b,zb-6.2b,zb-14.6b,zb-28.3b].")
@click.option("--flash-attention/--no-flash-attention", default=False, help="Do not store attention scores.")
@click.option("--speedup-model", default="gpt2-medium",
              help="Model of the PACI/1F1B speed-up table at N=8 (the PACI paper's GPT-2 Medium).")
@click.option("--speedup-hardware", default="h200", help="Device of the speed-up table.")
@click.option("--write", "write", default=None, type=click.Path(), help="Write the markdown page here "
                                                                        "(e.g. docs/extrapolation.md).")
@click.option("--csv", "csv_path", default=None, type=click.Path(), help="Also write every cell as CSV.")
def extrapolate(hardware: str, achievable: float | None, schedules: str | None, models: str | None,
                flash_attention: bool, speedup_model: str, speedup_hardware: str, write: str | None,
                csv_path: str | None) -> None:
    """Throughput and memory of every schedule in the Zero Bubble paper's large-scale setups.

    Simulates 1.5B, 6.2B, 14.6B and 28.3B GPT models on 8, 8, 16 and 32 devices with the paper's
    micro-batch counts and prints (or writes) samples/s per device and peak memory beside the
    paper's measurements, the speed-ups over 1F1B, and PACI's speed-up over 1F1B-flush at N = 8.
    """
    import dataclasses

    from unbubble.sim import report
    from unbubble.sim.extrapolate import extrapolate as run, markdown, speedups
    from unbubble.sim.hardware import get_hardware

    hw = get_hardware(hardware, achievable)
    t0 = time.perf_counter()
    cells = run(hw, [s.strip() for s in schedules.split(",")] if schedules else None,
                [s.strip() for s in models.split(",")] if models else None, flash_attention)
    sp_hw = get_hardware(speedup_hardware)
    sp = {f"simulated, {speedup_model} on {sp_hw.name}": speedups(speedup_model, sp_hw),
          "simulated, uniform F=1 B=2": speedups(speedup_model, sp_hw, uniform=True)}
    log.info("%d configurations simulated in %.1f s", len(cells), time.perf_counter() - t0)
    command = "unbubble " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["extrapolate"] \
        else "unbubble extrapolate"
    page = markdown(cells, hw, command, sp)
    if write:
        Path(write).parent.mkdir(parents=True, exist_ok=True)
        Path(write).write_text(page)
        click.echo(f"wrote {write}")
    else:
        click.echo(page)
    if csv_path:
        Path(csv_path).write_text(report.to_csv([dataclasses.asdict(c) for c in cells]))
