"""``unbubble sweep SPEC.yaml``: a resumable, lr-tuned grid of training runs in the emulator."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Folder for results/, runs/, runs.csv and curves.csv (default: runs/sweeps/<name>).")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True,
              help="Runs trained at once, each in its own process on one torch thread.")
@click.option("--dry-run", is_flag=True,
              help="List every run that will or may train (grid extensions and token budgets: 'up to') and those "
                   "already finished in --out ('done': not trained again), with a time estimate from the finished "
                   "runs or a short calibration run, and stop.")
def sweep(spec: Path, out: Path | None, workers: int, dry_run: bool) -> None:
    """Train the grid in SPEC (YAML: name, base, methods, stages, lrs, seeds, micro_batches; see
    docs/experiments.md). Each method's lr is tuned on the first seed, the other seeds run at the
    tuned lr, every run sees the same micro-batches. Finished runs are skipped when the same
    command runs again. Writes runs.csv (one row per run) and curves.csv (loss curves)."""
    from unbubble.experiments.sweep import SweepStopped, estimate, load_spec, plan, run_sweep, stop_handlers, \
        summary_rows

    s = load_spec(spec)
    folder = out or Path("runs") / "sweeps" / s.name
    if dry_run:
        rows = plan(s, folder)
        for what, mb, certainty in rows:
            click.echo(f"{certainty:>8}  {what}  ({mb:,} micro-batches)")
        with stop_handlers() as flag:  # a Ctrl-C during the calibration run: no estimate from a cut-short run
            line = estimate(s, folder, workers, rows, flag)
        if flag.stop_requested:
            click.echo(f"{s.name}: stopped during the calibration run: no estimate", err=True)
            sys.exit(130)
        click.echo(line)
        return
    try:
        records = run_sweep(s, folder, workers=workers, progress=click.echo)
    except SweepStopped as exc:  # what finished and how to continue; exit 130 as `unbubble train` after a stop
        click.echo(str(exc), err=True)
        sys.exit(130)
    _table(summary_rows(records), f"{s.name}: tuned lr and final validation loss (mean ± std over seeds)")
    click.echo(f"{folder / 'runs.csv'}\n{folder / 'curves.csv'}")


def _table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col)
    for r in rows:
        table.add_row(*(f"{v:g}" if isinstance(v, float) else str(v) for v in r.values()))
    Console().print(table)
