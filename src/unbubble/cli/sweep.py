"""``unbubble sweep SPEC.yaml``: a resumable, lr-tuned grid of training runs in the emulator."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Folder for results/, runs/, runs.csv and curves.csv (default: runs/sweeps/<name>).")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True,
              help="Runs trained at once, each in its own process on one torch thread.")
@click.option("--dry-run", is_flag=True, help="List the tuning runs and stop.")
def sweep(spec: Path, out: Path | None, workers: int, dry_run: bool) -> None:
    """Train the grid in SPEC (YAML: name, base, methods, stages, lrs, seeds, micro_batches; see
    docs/experiments.md). Each method's lr is tuned on the first seed, the other seeds run at the
    tuned lr, every run sees the same micro-batches. Finished runs are skipped when the same
    command runs again. Writes runs.csv (one row per run) and curves.csv (loss curves)."""
    from unbubble.experiments.sweep import load_spec, run_sweep

    s = load_spec(spec)
    folder = out or Path("runs") / "sweeps" / s.name
    if dry_run:
        for r in s.tuning_runs():
            click.echo(r.run_id)
        click.echo(f"{len(s.tuning_runs())} tuning runs; then {len(s.seeds) - 1} more seed(s) per tuned method")
        return
    run_sweep(s, folder, workers=workers, progress=click.echo)
    click.echo(f"{folder / 'runs.csv'}\n{folder / 'curves.csv'}")
