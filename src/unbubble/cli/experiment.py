"""``unbubble experiment NAME``: regenerate one of the papers' figures in miniature."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.argument("name")
@click.option("--size", type=click.Choice(["default", "tiny"], case_sensitive=False), default="default", show_default=True,
              help="default: the documented size (on 2 cores: paci-study 55–80 min, overhead-study 25–80 min and "
                   "its 4× sweep, br-study ≈ 16 min, moe-delay 9–12 min, throughput-memory ≈ 4 min; the plan and "
                   "estimate are printed before the first run); tiny: a smoke-sized run (23–89 s on 2 cores, benchmarks/doc_timings.py).")
@click.option("--seed", "seeds", type=int, multiple=True, help="Seeds (repeatable); default per experiment.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("experiments"), show_default=True,
              help="Folder for OUT/NAME: runs, CSV and PNG files and the results section (results.md).")
@click.option("--write-docs", is_flag=True,
              help="Also publish: replace NAME's section of DOCS/results.md, copy its figures to DOCS/img/ and "
                   "its runs.csv, curves.csv to DOCS/data/NAME/ (refused with --size tiny). Without it docs/ is "
                   "never written.")
@click.option("--docs", type=click.Path(path_type=Path, file_okay=False), default=Path("docs"), show_default=True,
              help="The documentation folder --write-docs writes.")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True,
              help="paci-study, br-study, overhead-study: runs trained at once (one process and one torch "
                   "thread each).")
@click.option("--analyze", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="paci-study, br-study, overhead-study: train nothing; rebuild tables and plots from DIR/runs.csv and "
                   "DIR/curves.csv (e.g. docs/data/paci-study).")
def experiment(name: str, size: str, seeds: tuple[int, ...], out: Path, write_docs: bool, docs: Path, workers: int,
               analyze: Path | None) -> None:
    """Run experiment NAME: paci-study, br-study, overhead-study, horizon-study, pays-study, clip-study,
    throughput-memory, moe-delay.

    Results go to OUT/NAME (results.md, CSV, PNG); docs/ changes only with --write-docs.
    The studies (paci-study … clip-study) are resumable sweeps: run the same command again after a stop and
    finished runs are skipped."""
    from unbubble.errors import ConfigError
    from unbubble.experiments import get_experiment, publish, write_section
    from unbubble.experiments.studies import STUDIES
    from unbubble.experiments.sweep import OutsideARun, SweepStopped, stop_handlers

    fn = get_experiment(name)
    if write_docs and size == "tiny":
        rebuild = f", or rebuild from --analyze docs/data/{name}" if name in STUDIES else ""
        raise ConfigError("--write-docs with --size tiny is refused: smoke-test numbers must not replace the "
                          f"published results (drop --size tiny to train the default size{rebuild})")
    folder = out / name
    for path in (out, folder):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"out={str(path)!r} is a file, not a folder: give a folder (set --out); nothing was "
                              "overwritten")
    resumable = name in STUDIES or name == "moe-delay"  # sweeps: finished runs are kept and skipped
    if name in STUDIES and analyze is not None and not (analyze / "runs.csv").is_file() \
            and not any(analyze.glob("*/runs.csv")):  # pays-study: one folder per part
        raise ConfigError(f"analyze={str(analyze)!r} holds no runs.csv: give the folder of a finished study "
                          f"(e.g. docs/data/{name})")
    if name not in STUDIES and analyze is not None:
        raise ConfigError(f"--analyze is for {', '.join(STUDIES)}, not {name!r}")
    if not resumable and (folder / "runs").exists() and any((folder / "runs").iterdir()):
        raise ConfigError(f"out={str(folder)!r} already holds runs: choose another --out; nothing was overwritten")
    try:
        with stop_handlers():  # a stop starts no further run, in a sweep or between an experiment's runs
            if name in STUDIES:
                output = fn(folder, size=size, seeds=list(seeds) or None, analyze=analyze, workers=workers)
            else:
                output = fn(folder, size=size, seeds=list(seeds) or None)
    except SweepStopped as exc:  # what finished and how to continue; exit 130 as `unbubble train` after a stop
        again = "run the same command again to continue (finished runs are kept)" if resumable else \
            f"{name} does not resume: remove {folder} or choose another --out to start it again"
        click.echo(f"{exc}; {again}" if "run the same command again" not in str(exc) else str(exc), err=True)
        sys.exit(130)
    except KeyboardInterrupt as exc:  # a second stop, or one while no run was training (the analysis)
        how = f"stopped at once ({exc}: the plan or the analysis)" if isinstance(exc, OutsideARun) else \
            "stopped at once by a second signal"
        click.echo(f"{name}: {how}; "
                   + ("run the same command again to continue (finished runs are kept)" if resumable else
                      f"{name} does not resume: remove {folder} or choose another --out to start it again"), err=True)
        sys.exit(130)
    section = write_section(output, folder)
    for f in [*output.files, section]:
        click.echo(str(f))
    if write_docs:
        for f in publish(output, docs):
            click.echo(str(f))
    where = f"section published to {docs / 'results.md'}" if write_docs else \
        f"section in {section} (docs/ unchanged: --write-docs publishes it)"
    click.echo(f"{name}: {output.wall_s:.0f} s; {where}")
