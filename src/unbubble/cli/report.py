"""``unbubble report RUN_DIR [RUN_DIR …]``: pictures and a markdown summary of finished runs.

Reads what ``unbubble train`` wrote into each run folder (``config.json``, ``summary.json``,
``metrics.jsonl``, ``actions.jsonl``). What it writes into ``--out``:
docs/architecture.md#clireportpy.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from unbubble._figures import LOSS_LABEL, new_figure, plot_validation, save
from unbubble.errors import ConfigError, check_int
from unbubble.safety import atomic_write_text

log = logging.getLogger("unbubble.report")

NEEDED = ("config.json", "summary.json", "metrics.jsonl", "actions.jsonl")
#: what a run folder holds from its start: a stopped, crashed or diverged run is reported from these
STARTED = ("config.json", "metrics.jsonl")


@dataclass
class ReportRun:
    """One finished run, read back from its folder.

    Attributes:
        path: the run folder.
        label: its name in legends and tables (the folder name, made unique).
        config, summary: ``config.json`` and ``summary.json``.
        steps: ``(step, loss, elapsed_s)`` per optimizer step of the last stage.
        evals: ``(version, validation loss)``.
        run: the measured trace and schedule (``unbubble.sim.measured.MeasuredRun``).
    """

    path: Path
    label: str
    config: dict[str, Any]
    summary: dict[str, Any]
    steps: list[tuple[int, float, float]]
    evals: list[tuple[int, float]]
    run: Any

    @property
    def tokens_per_step(self) -> float:
        """Tokens (or samples) per optimizer step, from the summary (or tokens / steps done)."""
        tps = self.summary.get("tokens_per_step")
        if tps:
            return float(tps)
        return float(self.summary.get("tokens", 0)) / max(self.steps_done, 1)

    @property
    def steps_done(self) -> int:
        """Optimizer steps the run finished (fewer than planned when it was stopped)."""
        done = self.summary.get("steps_done")
        return int(done) if done is not None else self.steps[-1][0]

    @property
    def steps_planned(self) -> int | None:
        """Optimizer steps the run was configured for (``--steps``)."""
        planned = self.summary.get("steps", self.config.get("steps"))
        return None if planned is None else int(planned)

    @property
    def final_eval(self) -> tuple[int, float] | None:
        """``(weight version, validation loss)`` of the last evaluation, or ``None`` without one."""
        return self.evals[-1] if self.evals else None

    @property
    def model(self) -> str:
        """The model preset the run trained (``config.json``'s ``model``)."""
        return str(self.config.get("model", "?"))

    def time_of_step(self, step: int) -> float:
        """Seconds since the start when the last stage finished ``step`` (0 for step 0)."""
        if step <= 0 or not self.steps:
            return 0.0
        i = min(step, len(self.steps)) - 1
        return self.steps[i][2]


def load_report_run(path: str | Path) -> ReportRun:
    """Reads a run folder for the report.

    Raises:
        ConfigError: the folder or one of config.json, summary.json, metrics.jsonl, actions.jsonl is
            missing or malformed; one line naming the folder and what is wrong.
    """
    from unbubble.metrics import read_metrics
    from unbubble.sim.measured import load_run

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"run_dir={str(path)!r} is not a folder: give folders that `unbubble train` wrote")
    missing = [name for name in STARTED if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"{path} is not a run folder: {', '.join(missing)} missing (a run writes "
                          f"{', '.join(STARTED)} when it starts, {', '.join(set(NEEDED) - set(STARTED))} when it ends)")
    try:
        summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else \
            {"status": "crashed", "error": "no summary.json: the process ended without writing one (killed?)"}
        step_records, eval_records = read_metrics(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} holds malformed JSON ({str(exc).splitlines()[0]}): not a run folder of "
                          "unbubble train") from None
    except ValueError as exc:  # a metrics line that is JSON but no object
        raise ConfigError(f"{path / 'metrics.jsonl'} has a malformed line ({exc}): not a run folder of unbubble "
                          "train") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{path / 'summary.json'} holds {type(summary).__name__}, not an object: not a run folder "
                          "of unbubble train")
    for key in ("steps", "steps_done"):
        value = summary.get(key)
        if value is not None:
            check_int(f"{path / 'summary.json'}: {key}", value, 0, "not a run folder of unbubble train")
    run = load_run(path) if (path / "actions.jsonl").is_file() else None  # a run that ended by an error has none
    try:
        steps = [(int(r["step"]), float(r["loss"]), float(r.get("elapsed_s", math.nan))) for r in step_records]
        evals = sorted((int(r["step"]), float(r["val_loss"])) for r in eval_records)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path / 'metrics.jsonl'} has a malformed line ({type(exc).__name__}: {exc}): "
                          "not a run folder of unbubble train") from None
    if not steps:
        raise ConfigError(f"{path / 'metrics.jsonl'} records no training step: the run did not train")
    config = run.config if run is not None else json.loads((path / "config.json").read_text())
    return ReportRun(path, path.name, config, summary, steps, evals, run)


def _unique_labels(runs: list[ReportRun]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.path.parent.name}/{r.path.name}" if r.path.parent.name else str(r.path)
    labels = [r.label for r in runs]
    for i, r in enumerate(runs):  # still equal (the same folder twice): number them
        if labels.count(r.label) > 1:
            r.label = f"{r.label} #{i + 1}"


def _ema(values: list[float], span: int) -> np.ndarray:
    alpha, out, acc = 2.0 / (span + 1), np.empty(len(values)), values[0]
    for i, v in enumerate(values):
        acc = alpha * v + (1 - alpha) * acc if i else v
        out[i] = acc
    return out


def status(r: ReportRun) -> str:
    """How the run ended: finished, stopped at step k, diverged or crashed (summary.json's ``status``;
    older summaries: stopped when ``stopped_at_step`` is set, else finished)."""
    s = r.summary
    state = "stopped" if s.get("stopped_at_step") is not None else s.get("status") or "finished"
    return f"stopped at {s['stopped_at_step']}" if state == "stopped" and s.get("stopped_at_step") else state


def _describe(r: ReportRun) -> str:
    s = r.summary
    from unbubble.schedules.registry import REGISTRY

    info = REGISTRY.get(r.config.get("schedule"))  # a run of an unknown schedule: shown with a, as before
    asynchronous = r.run.schedule.asynchronous if r.run is not None else info is None or info.asynchronous
    knob = "a" if asynchronous else "m"
    return f"{r.model}, {s.get('schedule', '?')}, N={s.get('stages', '?')}, {knob}={s.get('mb_per_step', '?')}"


def plot_loss(runs: list[ReportRun], out: Path, x: str) -> Path:
    """Training and validation loss of every run against ``x`` = ``"tokens"`` or ``"time"``; returns the PNG."""
    fig = new_figure(8, 4.5)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for r, color in zip(runs, colors):
        steps = [s for s, _, _ in r.steps]
        losses = [loss for _, loss, _ in r.steps]
        xs = (np.asarray(steps) * r.tokens_per_step if x == "tokens" else np.asarray([t for _, _, t in r.steps]))
        ax.plot(xs, losses, color=color, lw=0.5, alpha=0.25)
        ax.plot(xs, _ema(losses, max(len(losses) // 50, 1)), color=color, lw=1.5,
                label=f"{r.label} ({_describe(r)}) train")
        if r.evals:
            ex = [v * r.tokens_per_step if x == "tokens" else r.time_of_step(v) for v, _ in r.evals]
            plot_validation(ax, ex, [loss for _, loss in r.evals], color, f"{r.label} validation")
    if x == "tokens":
        ax.set_xlabel("tokens processed")
        ax.set_title("loss against tokens (same data: curves of equally good optimizers overlap)", fontsize=10)
    else:
        ax.set_xlabel("wall-clock seconds since the start")
        ax.set_title("loss against wall time (faster schedules reach a loss sooner)", fontsize=10)
    ax.set_ylabel(LOSS_LABEL)
    return save(fig, ax, out / f"loss_vs_{x}.png")


def plot_drift(runs: list[ReportRun], out: Path) -> Path:
    """Per run, micro-batches per drift value Δ and stage (grouped bars); returns the PNG (runs that
    ended without actions.jsonl are left out)."""
    runs = [r for r in runs if r.run is not None] or runs[:0]
    fig = new_figure(8, 2.6 * max(len(runs), 1) + 0.4)
    for row, r in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, row + 1)
        hist = r.run.trace.drift_histogram()
        n = len(hist)
        top = max((max(h) for h in hist if h), default=0)
        width = 0.8 / max(n, 1)
        for s, h in enumerate(hist):
            xs = np.arange(top + 1) + (s - (n - 1) / 2) * width
            ax.bar(xs, [h.get(d, 0) for d in range(top + 1)], width=width, label=f"stage {s}")
        ax.set_xticks(range(top + 1))
        ax.set_xlabel("drift Δ = v_B − v_F (optimizer updates between a micro-batch's forward and backward)")
        ax.set_ylabel("micro-batches")
        bound = r.summary.get("drift_bound")
        ax.set_title(f"{r.label} ({_describe(r)}): max Δ per stage {r.run.trace.max_drift()}"
                     + (f", bound {bound}" if bound is not None else ""), fontsize=9, loc="left")
        ax.legend(fontsize=7, ncol=min(n, 8))
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out / "drift.png"
    fig.savefig(path, dpi=100)
    return path


def plot_utilization(runs: list[ReportRun], out: Path, bins: int = 60) -> Path:
    """Per run, a rank × time heat map of the busy fraction (measured wall clock); returns the PNG."""
    from unbubble.analysis import utilization_timeline

    runs = [r for r in runs if r.run is not None]
    fig = new_figure(9, 1.0 + sum(0.35 * r.run.trace.ranks + 1.0 for r in runs))
    for row, r in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, row + 1)
        edges, util = utilization_timeline(r.run.trace, bins=bins)
        im = ax.imshow(util, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                       extent=(edges[0], edges[-1], util.shape[0] - 0.5, -0.5))
        means = r.run.trace.utilization()
        ax.set_yticks(range(util.shape[0]))
        ax.set_yticklabels([f"rank {i} ({u:.0%})" for i, u in enumerate(means)], fontsize=7)
        ax.set_xlabel("wall-clock seconds")
        note = " (emulator: the stages take turns in one process, so the fractions add up to ≤ 1)" \
            if r.config.get("engine") == "emulator" else ""
        ax.set_title(f"{r.label} ({_describe(r)}): busy fraction per rank{note}", fontsize=9, loc="left")
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    fig.tight_layout()
    path = out / "utilization.png"
    fig.savefig(path, dpi=100)
    return path


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return format(v, spec)


#: What runs must share for their losses and speed-ups to compare like for like: (name, value of a run).
_COMPARED: tuple[tuple[str, Any], ...] = (
    ("model", lambda r: r.model),
    ("tokenizer", lambda r: r.config.get("tokenizer")),
    ("corpus", lambda r: r.config.get("corpus")),
    ("tokens per step", lambda r: r.summary.get("tokens_per_step")),
    ("tokens trained", lambda r: r.summary.get("run_tokens", r.summary.get("tokens"))),
)


def mismatch_warning(runs: list[ReportRun]) -> str | None:
    """One line naming what the runs differ in among model, tokenizer, corpus, tokens per step and tokens
    trained, with each run's value, or ``None`` when they agree (or there is one run)."""
    differ = []
    for name, get in _COMPARED:
        values = [get(r) for r in runs]
        if len(set(map(str, values))) > 1:
            shown = [f"{r.label} {v:,}" if isinstance(v, int) else f"{r.label} {v}" for r, v in zip(runs, values)]
            differ.append(f"{name} ({', '.join(shown)})")
    if not differ:
        return None
    return f"the runs differ in {'; '.join(differ)}: their losses and speed-ups do not compare like for like"


def _steps_text(r: ReportRun) -> str:
    planned = r.steps_planned
    return f"{r.steps_done}/{planned}" if planned is not None else str(r.steps_done)


def _eval_text(r: ReportRun) -> tuple[str, str]:
    """``(final val loss (step), val ppl)`` cells."""
    last = r.final_eval
    if last is None:
        return "–", "–"
    step, loss = last
    from unbubble.loggers import perplexity

    return f"{_fmt(loss)} (step {step})", _fmt(perplexity(loss), ".2f")


def summary_markdown(runs: list[ReportRun], pictures: list[Path], warning: str | None = None) -> str:
    """The report's markdown: the ``warning`` (:func:`mismatch_warning`), a table row per run, the pictures."""
    base = runs[0].summary.get("tokens_per_s")
    lines = ["# unbubble report", ""] + ([f"**Warning:** {warning}.", ""] if warning else []) + [
             "| run | model | schedule | N | a/m | optimizer | engine | steps done/planned | tokens | wall s "
             "| tokens/s | speed-up | train loss (last 10 %) | final val loss (step) | val ppl "
             "| max Δ per stage (bound) | utilization per rank | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.summary
        tail = [loss for _, loss, _ in r.steps[-max(len(r.steps) // 10, 1):]]
        util = s.get("utilization") or []
        sim = s.get("simulated_utilization")
        util_text = " ".join(f"{u:.2f}" for u in util) + (f" (simulated {' '.join(f'{u:.2f}' for u in sim)})"
                                                           if sim else "")
        tps = s.get("tokens_per_s")
        speed = tps / base if tps and base else None
        lines.append(" | ".join([
            f"| {r.label}", r.model, str(s.get("schedule")), str(s.get("stages")), str(s.get("mb_per_step")),
            str(s.get("optimizer", "–")), str(s.get("engine", "–")), _steps_text(r),
            f"{s.get('run_tokens', s.get('tokens', 0)):,}", _fmt(s.get("run_train_wall_s", s.get("train_wall_s")), ".1f"),
            _fmt(tps, ",.0f"),
            _fmt(speed, ".2f") + "×" if speed else "–", _fmt(sum(tail) / len(tail)), *_eval_text(r),
            f"{r.run.trace.max_drift() if r.run is not None else '–'} ({s.get('drift_bound', '–')})", util_text,
            status(r)]) + " |")
    lines += ["", "Steps done/planned: fewer done than planned when the run was stopped. Train loss (last 10 %): "
              "mean over the last 10 % of the steps done (summary.json's final_train_loss is the last step's "
              "loss). Final val loss (step): the last evaluation and the weight version (step) it evaluated. "
              "Speed-up: tokens/s against the first run. Utilization: busy / wall time per rank, measured (the "
              "emulator runs the stages one after another, so the simulated value shows the schedule's own "
              "utilization).", ""]
    lines += [f"![{p.stem}]({p.name})" for p in pictures]
    return "\n".join(lines) + "\n"


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Reads the runs and writes the pictures and ``report.md`` into ``out``; returns the markdown path.
    Logs a warning when the runs differ in model, tokenizer, corpus, tokens per step or tokens trained.

    Raises:
        ConfigError: a bad run folder (see :func:`load_report_run`), or ``out`` is a file.
    """
    return write_runs_report([load_report_run(p) for p in run_dirs], out)


def write_runs_report(runs: list[ReportRun], out: str | Path) -> Path:
    """:func:`write_report` of runs already read."""
    if not runs:
        raise ConfigError("no run folder to report: give folders that `unbubble train` wrote")
    _unique_labels(runs)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={str(out)!r} is a file: give a folder for the report (set --out)")
    out.mkdir(parents=True, exist_ok=True)
    pictures = [plot_loss(runs, out, "tokens"), plot_loss(runs, out, "time"), plot_drift(runs, out),
                plot_utilization(runs, out)]
    warning = mismatch_warning(runs)
    if warning:
        log.warning("%s", warning)
    md = out / "report.md"
    atomic_write_text(md, summary_markdown(runs, pictures, warning))
    return md


def short_table(runs: list[ReportRun]) -> str:
    """The report's table in the terminal's width: one line per run with the figures most read
    (report.md has every column)."""
    base = runs[0].summary.get("tokens_per_s")
    head = ["run", "schedule", "N", "steps", "tokens/s", "speed-up", "final val loss", "status"]
    rows = []
    for r in runs:
        s = r.summary
        tps = s.get("tokens_per_s")
        ev = r.final_eval
        rows.append([r.label, str(s.get("schedule", r.config.get("schedule", "?"))),
                     str(s.get("stages", r.config.get("stages", "?"))), _steps_text(r), _fmt(tps, ",.0f"),
                     _fmt(tps / base, ".2f") + "×" if tps and base else "–",
                     f"{_fmt(ev[1])} (step {ev[0]})" if ev else "–", status(r)])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    width = shutil.get_terminal_size((100, 24)).columns
    over = sum(widths) + 2 * (len(widths) - 1) - width
    if over > 0:  # long run names give way first
        widths[0] = max(widths[0] - over, 12)
    def line(cells):
        cells = [c if len(c) <= w else c[:w - 1] + "…" for c, w in zip(cells, widths)]
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), *map(line, rows)])


def run_folders(paths: list[str]) -> tuple[list[str], list[str]]:
    """``(run folders, notes)``: the paths given, less folders that are not runs (``unbubble simulate``'s,
    a report's: neither config.json nor metrics.jsonl), each with a note. A path that is not a folder
    stays (it is refused in one line)."""
    keep, notes = [], []
    for p in paths:
        d = Path(p)
        if d.is_dir() and not any((d / name).is_file() for name in STARTED):
            what = "a simulation" if (d / "summary.csv").is_file() or (d / "simulate.json").is_file() else \
                "a report" if (d / "report.md").is_file() else "not a run folder"
            notes.append(f"skipped {p}: {what} (no config.json or metrics.jsonl)")
        else:
            keep.append(p)
    return keep, notes


@click.command(context_settings={"show_default": True})
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--out", default=None, type=click.Path(), help="Folder for the PNGs and report.md (created) "
              "[default: RUN/report for one run folder, runs/<time>-report for several].")
def report(run_dirs: tuple[str, ...], out: str | None) -> None:
    """Plot and summarise runs: loss against tokens and wall time, drift, utilization.

    RUN_DIRS are folders written by `unbubble train` (finished, stopped, diverged or crashed: the
    status column says which); the first is the baseline of the speed-up column. Folders that are
    not runs (a simulation's, a report's) are skipped with a note. Writes loss_vs_tokens.png,
    loss_vs_time.png, drift.png, utilization.png and report.md (every column) into --out, and prints
    a short table that fits the terminal.
    """
    dirs, notes = run_folders(list(run_dirs))
    for note in notes:
        log.warning("%s", note)
    if not dirs:
        raise ConfigError(f"no run folder among {', '.join(run_dirs)}: give folders that `unbubble train` wrote")
    if out is None:
        out = str(Path(dirs[0]) / "report") if len(dirs) == 1 else \
            f"runs/{time.strftime('%Y%m%d-%H%M%S')}-report"
    runs = [load_report_run(p) for p in dirs]
    md = write_runs_report(runs, out)
    click.echo(short_table(runs))
    click.echo(f"\nreport: {md} (every column; with loss_vs_tokens.png, loss_vs_time.png, drift.png, "
               "utilization.png)")
