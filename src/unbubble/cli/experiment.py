"""``unbubble experiment NAME``: regenerate one of the papers' figures in miniature."""

from __future__ import annotations

import shutil
from pathlib import Path

import click


@click.command()
@click.argument("name")
@click.option("--size", type=click.Choice(["default", "tiny"]), default="default", show_default=True,
              help="default: the documented size (paci-study ≈ 75 min, br-study ≈ 45 min, the others ≤ 30 min on "
                   "2 cores); tiny: a smoke-sized run (< 30 s).")
@click.option("--seed", "seeds", type=int, multiple=True, help="Seeds (repeatable); default per experiment.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("experiments"), show_default=True,
              help="Folder for runs, CSV and PNG files.")
@click.option("--results", type=click.Path(path_type=Path), default=Path("docs/results.md"), show_default=True,
              help="Markdown file whose section for NAME is replaced.")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True,
              help="paci-study, br-study: runs trained at once (one process and one torch thread each).")
@click.option("--analyze", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="paci-study, br-study: train nothing; rebuild tables and plots from DIR/runs.csv and "
                   "DIR/curves.csv (e.g. docs/data/paci-study).")
def experiment(name: str, size: str, seeds: tuple[int, ...], out: Path, results: Path, workers: int,
               analyze: Path | None) -> None:
    """Run experiment NAME: paci-study, br-study, throughput-memory, moe-delay.

    paci-study and br-study are resumable sweeps: run the same command again after a stop and
    finished runs are skipped."""
    from unbubble.errors import ConfigError
    from unbubble.experiments import get_experiment, update_results
    from unbubble.experiments.studies import STUDIES

    fn = get_experiment(name)
    folder = out / name
    if name in STUDIES:
        if analyze is not None and not (analyze / "runs.csv").is_file():
            raise ConfigError(f"analyze={str(analyze)!r} holds no runs.csv: give the folder of a finished study "
                              f"(e.g. docs/data/{name})")
        output = fn(folder, size=size, seeds=list(seeds) or None, analyze=analyze, workers=workers)
    else:
        if analyze is not None:
            raise ConfigError(f"--analyze is for {', '.join(STUDIES)}, not {name!r}")
        if (folder / "runs").exists() and any((folder / "runs").iterdir()):
            raise ConfigError(f"out={str(folder)!r} already holds runs: choose another --out; nothing was overwritten")
        output = fn(folder, size=size, seeds=list(seeds) or None)
    markdown = output.markdown
    img = results.parent / "img"
    for f in output.files:  # figures travel with the results page
        if f.suffix == ".png":
            img.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, img / f.name)
            markdown = markdown.replace(f"]({f.name})", f"](img/{f.name})")
    update_results(results, name, markdown)
    for f in output.files:
        click.echo(str(f))
    click.echo(f"{name}: {output.wall_s:.0f} s; section written to {results}")
