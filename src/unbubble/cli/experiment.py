"""``unbubble experiment NAME``: regenerate one of the papers' figures in miniature."""

from __future__ import annotations

import shutil
from pathlib import Path

import click


@click.command()
@click.argument("name")
@click.option("--size", type=click.Choice(["default", "tiny", "full"]), default="default", show_default=True,
              help="default: the documented size (≤ 30 min on 2 cores); tiny: a smoke-sized run (< 60 s); full: "
                   "delay-scaling's whole grid (P = 1…32, with Nesterov; ≈ 1.5 h), the default for the others.")
@click.option("--seed", "seeds", type=int, multiple=True, help="Seeds (repeatable); default per experiment.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("experiments"), show_default=True,
              help="Folder for runs, CSV and PNG files.")
@click.option("--results", type=click.Path(path_type=Path), default=Path("docs/results.md"), show_default=True,
              help="Markdown file whose section for NAME is replaced.")
def experiment(name: str, size: str, seeds: tuple[int, ...], out: Path, results: Path) -> None:
    """Run experiment NAME: paci-stability, time-to-accuracy, throughput-memory, delay-scaling, br-ablation."""
    from unbubble.experiments import get_experiment, update_results

    fn = get_experiment(name)
    folder = out / name
    if (folder / "runs").exists() and any((folder / "runs").iterdir()):
        from unbubble.errors import ConfigError

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
