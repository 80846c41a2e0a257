"""What every experiment shares: running configurations, writing CSV/PNG and markdown into the
experiment's folder, and publishing them into ``docs/`` (only on request: :func:`publish`)."""

from __future__ import annotations

import csv
import logging
import os
import platform
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from unbubble.config import TrainConfig
from unbubble.errors import ConfigError, did_you_mean
from unbubble.runtime.telemetry import RunResult

log = logging.getLogger(__name__)


@dataclass
class ExperimentOutput:
    """Files and the markdown section one experiment produced (all of them in its folder)."""

    name: str
    #: the results section; figures are linked by file name (they sit beside it)
    markdown: str
    files: list[Path] = field(default_factory=list)
    wall_s: float = 0.0
    #: the raw tables the section was computed from (``runs.csv``, ``curves.csv``), published to
    #: ``docs/data/NAME/`` so that ``--analyze docs/data/NAME`` rebuilds the section
    data: list[Path] = field(default_factory=list)


EXPERIMENTS: dict[str, tuple[str, Callable[..., ExperimentOutput]]] = {}


def experiment(name: str, summary: str):
    """Registers ``fn(out_dir, size, seeds) -> ExperimentOutput`` under ``name``."""
    def wrap(fn):
        EXPERIMENTS[name] = (summary, fn)
        return fn
    return wrap


def get_experiment(name: str) -> Callable[..., ExperimentOutput]:
    """Raises:
        ConfigError: unknown name (the message lists the valid ones)."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"experiment={name!r} is unknown{did_you_mean(name, EXPERIMENTS)}: valid experiments are {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name][1]


def say(line: str) -> None:
    """An experiment's plan and progress line, on stdout at once (a pipe buffers ``print``)."""
    print(line, flush=True)


def run(cfg: TrainConfig, what: str = "") -> RunResult:
    """Trains one configuration (its run folder goes under the experiment's folder).

    Raises:
        SweepStopped: a stop signal came before it (it does not start) or stopped it (a partial
            run must not enter a table); ``what`` ("throughput-memory 3/10") names it.
    """
    from unbubble.experiments.sweep import SweepStopped, stop_requested, training
    from unbubble.train import train

    name = what or Path(cfg.run_dir or "run").name
    if stop_requested():
        raise SweepStopped(f"{name}: stopped before this run started")
    with training():
        result, _ = train(cfg, on_divergence="record")
    if result.stopped_at is not None:
        raise SweepStopped(f"{name}: stopped at step {result.stopped_at} of {cfg.steps}")
    return result


def base_config(out_dir: Path, tag: str, **overrides: Any) -> TrainConfig:
    """A CPU experiment configuration: emulator, byte-level KJV, evaluation at the end only."""
    defaults = dict(engine="emulator", eval_interval=0, eval_batches=4, run_dir=str(out_dir / "runs" / tag),
                    checkpoints=False,  # no drains: the schedules run as the papers define them
                    optimizer="adamw",  # the papers' optimizer (train's default is Muon)
                    error_feedback=0.0)  # the papers' algorithms (train's default adds it to asynchronous ones)
    defaults.update(overrides)
    return TrainConfig(**defaults)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of ``rows`` in first-seen order (a row may lack a column: "—" in tables)."""
    return list(dict.fromkeys(k for r in rows for k in r))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows))
        writer.writeheader()
        writer.writerows(rows)
    return path


def figure():
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, ax, path: Path) -> Path:
    """Saves ``fig`` as a small PNG in the house style (:func:`unbubble._figures.save`; no grid, 90 dpi, as
    the published figures) and closes it."""
    from unbubble._figures import save

    save(fig, ax, path, dpi=90, grid=None)
    figure().close(fig)
    return path


def md_table(rows: list[dict[str, Any]]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ("—" if v is None else str(v))

    head = _columns(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(r.get(h)) for h in head) + " |" for r in rows]
    return "\n".join(lines)


def provenance(command: str, seeds: list[int], wall_s: float, engine: str = "emulator on 1 torch thread") -> str:
    """The line under every results table: command, seeds, hardware, engine, wall time."""
    return (f"Command: `{command}` · seeds {seeds} · {platform.machine()} CPU, {os.cpu_count()} cores, "
            f"{engine} · wall time {wall_s / 60:.1f} min · {time.strftime('%Y-%m-%d')}")


def update_results(doc: Path, name: str, markdown: str) -> None:
    """Replaces (or appends) the section of ``name`` in ``docs/results.md``."""
    begin, end = f"<!-- experiment:{name} -->", f"<!-- /experiment:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = doc.read_text() if doc.exists() else \
        "# Results\n\nEach section is written by `unbubble experiment NAME --write-docs`.\n"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


#: The file in an experiment's folder that holds its results section.
SECTION_FILE = "results.md"


def write_section(output: ExperimentOutput, folder: Path) -> Path:
    """Writes ``output``'s markdown to ``folder/results.md``, beside its figures and CSVs."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SECTION_FILE
    path.write_text(output.markdown.strip() + "\n")
    return path


def publish(output: ExperimentOutput, docs: Path) -> list[Path]:
    """Publishes one experiment into the documentation (``unbubble experiment NAME --write-docs``):
    replaces its section of ``docs/results.md`` (figure links pointed at ``img/``), copies its
    PNGs to ``docs/img/`` and its raw tables to ``docs/data/NAME/``. Nothing else writes ``docs/``.

    Args:
        output: what the experiment produced.
        docs: the documentation folder (``docs``).

    Returns:
        The files written or replaced.
    """
    markdown, written = output.markdown, []
    for f in output.files:  # figures travel with the results page
        if f.suffix == ".png":
            (docs / "img").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, docs / "img" / f.name)
            written.append(docs / "img" / f.name)
            markdown = markdown.replace(f"]({f.name})", f"](img/{f.name})")
    for f in output.data:  # a study of several sweeps keeps each sweep's folder (pays-study's parts)
        part = f.parent.name if f.parent.name != output.name and f.parent.parent.name == output.name else ""
        dest = docs / "data" / output.name / part / f.name
        if f.resolve() != dest.resolve():  # --analyze docs/data/NAME reads them in place
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
            written.append(dest)
    update_results(docs / "results.md", output.name, markdown)
    return [docs / "results.md", *written]
