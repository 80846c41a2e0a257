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
@click.option("--dry-run", is_flag=True,
              help="List every run that will or may train (grid extensions and token budgets: 'up to'), with a time "
                   "estimate from the finished runs in --out or a short calibration run, and stop.")
def sweep(spec: Path, out: Path | None, workers: int, dry_run: bool) -> None:
    """Train the grid in SPEC (YAML: name, base, methods, stages, lrs, seeds, micro_batches; see
    docs/experiments.md). Each method's lr is tuned on the first seed, the other seeds run at the
    tuned lr, every run sees the same micro-batches. Finished runs are skipped when the same
    command runs again. Writes runs.csv (one row per run) and curves.csv (loss curves)."""
    from unbubble.experiments.sweep import load_spec, plan, run_sweep, summary_rows

    s = load_spec(spec)
    folder = out or Path("runs") / "sweeps" / s.name
    if dry_run:
        _dry_run(s, folder, workers, plan(s))
        return
    records = run_sweep(s, folder, workers=workers, progress=click.echo)
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


def _dry_run(s, folder: Path, workers: int, runs: list[tuple[str, int, str]]) -> None:
    """Prints the plan and its time: seconds per micro-batch from the finished runs in ``folder``,
    or from a calibration run of the first tuning run's configuration at 1/20 of its updates."""
    import json
    import statistics
    import time

    for what, mb, certainty in runs:
        click.echo(f"{certainty:>8}  {what}  ({mb:,} micro-batches)")
    will = [mb for _, mb, c in runs if c == "will"]
    may = [mb * int(c.split()[-1]) for _, mb, c in runs if c.startswith("up to")]
    finished = [json.loads(p.read_text()) for p in (folder / "results").glob("*.json")] \
        if (folder / "results").is_dir() else []
    if finished:
        per_mb = statistics.median(r["wall_s"] / r["micro_batches"] for r in finished if r.get("micro_batches"))
        how = f"the median of {len(finished)} finished run(s) in {folder}"
    else:
        import tempfile
        from dataclasses import replace

        from unbubble.train import train

        first = s.tuning_runs()[0]
        cfg = s.config(first, folder)
        steps = max(cfg.steps // 20, 2)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = replace(cfg, steps=steps, eval_interval=0, run_dir=f"{tmp}/calibration")
            t0 = time.perf_counter()
            train(cfg)
        per_mb = (time.perf_counter() - t0) / (steps * cfg.mb_per_step)
        how = f"a calibration run of {first.method} ({steps} updates, start-up included)"
    low = sum(will) * per_mb / workers
    high = low + sum(may) * per_mb / workers
    more = sum(int(c.split()[-1]) for _, _, c in runs if c.startswith('up to'))
    span = f"{low / 60:.0f}" if round(low / 60) == round(high / 60) else f"{low / 60:.0f}–{high / 60:.0f}"
    click.echo(f"{len(will)} runs will train" + (f", up to {more} more may" if more else "") +
               f"; about {span} min with {workers} worker(s) ({per_mb * 1e3:.1f} ms per micro-batch from {how})")
