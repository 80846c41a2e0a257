"""What a training run shows while it runs and when it ends, for ``unbubble train`` and
``unbubble.train_model`` alike: the stderr console and the ``unbubble`` logger's handler, the
progress bar (plain step lines off a terminal), and the end lines."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger("unbubble.train")

#: Results go to stdout, messages (logs, errors) to stderr.
err_console = Console(stderr=True)


def setup_logging(verbosity: int) -> None:
    """The ``unbubble`` logger to stderr through :data:`err_console` (``verbosity`` < 0: warnings
    only; > 0: debug)."""
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    handler = RichHandler(console=err_console, show_path=False, show_time=False, markup=False)
    root = logging.getLogger("unbubble")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False



def elapsed(seconds: float) -> str:
    """A duration as a person reads it: '40 s', '12.7 min', '2 h 05 min' (never '0.2 min')."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"


def estimate_span(low_s: float, high_s: float) -> str:
    """An estimate from ``low_s`` to ``high_s`` seconds in whole minutes: 'under 1 min', 'about
    5 min', 'about 66–347 min' (never 'about 0 min')."""
    if high_s < 60:
        return "under 1 min"
    lo, hi = max(round(low_s / 60), 1), max(round(high_s / 60), 1)
    return f"about {lo} min" if lo == hi else f"about {lo}–{hi} min"

class ProgressListener:
    """Draws a progress bar on a terminal (plain lines otherwise) and forwards to the run writer.

    Until the first step the bar says what is starting (``starting`` text); tokens/s count the
    steps done since the training loop started (start-up excluded), and :meth:`finish` shows
    the run's final figure, the one summary.json holds.
    """

    def __init__(self, writer, total_steps: int, log_every: int, starting: str = "", first_step: int = 0):
        self.writer, self.total, self.log_every = writer, total_steps, log_every
        self.progress = None
        if err_console.is_terminal:
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=first_step, stats=starting)
            self.progress.start()
        elif starting:
            log.info(starting)

    def on_step(self, step: int, loss: float, info: dict) -> None:
        self.writer.on_step(step, loss, info)
        stats = f"loss {loss:.4f} | {info['tok_per_s']:,.0f} tok/s | max Δ {info['max_drift']}"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=stats)
        elif step % self.log_every == 0 or step == self.total:
            log.info("step %d/%d | %s | %.1f s", step, self.total, stats, info["elapsed_s"])

    def on_eval(self, version: int, val_loss: float) -> None:
        self.writer.on_eval(version, val_loss)

    def on_event(self, event: dict) -> None:
        self.writer.on_event(event)

    def on_snapshot(self, version: int, states: dict) -> None:
        self.writer.on_snapshot(version, states)

    def finish(self, summary: dict) -> None:
        """Shows the whole run's figures of ``summary`` (summary.json) on the bar."""
        if self.progress is not None and summary.get("final_train_loss") is not None:
            self.progress.update(self.task, stats=f"loss {summary['final_train_loss']:.4f} | "
                                 f"{summary['tokens_per_s']:,.0f} tok/s (whole run) | max Δ {max(summary['max_drift'])}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def break_even_line(cfg: TrainConfig, result, n_layer: int | None = None) -> str | None:
    """For an asynchronous run: the throughput ratio it buys over the fastest synchronous schedule
    (:data:`unbubble.sim.extrapolate.SYNCHRONOUS`) at m = its micro-batches per update, simulated with
    this run's measured per-stage costs (the break-even its token overhead must stay below), and over
    the fastest within 1F1B-flush's activation memory where that is another schedule; None for
    synchronous runs or tiny traces.

    A run trained with a global clip (``--clip-grad-norm`` with ``--clip-scope sync`` or ``stale``)
    is simulated with its per-update all-reduce ([Note: the barrier] in docs/architecture.md), as
    ``unbubble simulate --clip-scope`` does on measured costs (no local-norm time; zero latency, the
    emulator measures none): ``sync`` on every schedule; ``stale`` on this run against the
    synchronous schedules on ``sync``, the exact clip they can afford (the comparison of
    docs/results.md's barrier table). ``stage`` needs no all-reduce: no barrier.

    ``n_layer``: the model's layers; a synchronous schedule whose chunks this model cannot fill
    (interleaved ones need stages × v, V-shaped ones stages × 2) is left out of the comparison, as
    ``unbubble train`` would refuse it."""
    from unbubble.errors import ConfigError
    from unbubble.schedules.registry import get_schedule

    if not get_schedule(cfg.schedule, cfg.stages, 1, a=cfg.a, m=cfg.m, v=cfg.v).asynchronous or cfg.dp > 1:
        return None
    from unbubble.sim.barrier import GlobalOp
    from unbubble.sim.extrapolate import COMPARE_V, SYNCHRONOUS, async_over_sync
    from unbubble.sim.measured import compute_costs

    m = cfg.mb_per_step

    def fits(name: str) -> bool:  # the model has a layer for each chunk of the schedule as it is compared
        try:
            return n_layer is None or get_schedule(name, cfg.stages, 1, m=m, v=COMPARE_V).n_stages <= n_layer
        except ConfigError:
            return True  # does not run at this m: async_over_sync leaves it out itself

    schedules = tuple(s for s in SYNCHRONOUS if fits(s))
    scope = (cfg.clip_scope or "sync") if cfg.clip_grad_norm is not None else None
    ops = {"sync": (GlobalOp("sync"), GlobalOp("sync")), "stale": (GlobalOp("stale"), GlobalOp("sync"))}
    paci_op, sync_op = ops.get(scope, (None, None))
    try:  # compute only (median F, B, U per stage): the emulator's wall-clock gaps are not link times
        costs = compute_costs(result.trace)
        ratio, name = async_over_sync(costs, cfg.stages, m, a=m, schedules=schedules, paci_op=paci_op,
                                      sync_op=sync_op)
        ratio_mem, name_mem = async_over_sync(costs, cfg.stages, m, a=m, schedules=schedules, memory="1f1b",
                                              paci_op=paci_op, sync_op=sync_op)
    except (ConfigError, KeyError, ValueError, ZeroDivisionError):  # a stage that ran no F or B
        return None
    same = "" if name_mem == name else (f" ({ratio_mem:.2f}× against {name_mem}, the fastest within 1F1B-flush's "
                                        "activation memory)")
    barrier = {"sync": " with --clip-scope sync's per-update all-reduce on every schedule (a barrier),",
               "stale": " with --clip-scope stale's all-reduce here (no wait) and sync's on the synchronous "
                        "schedules (a barrier),"}.get(scope, "")
    return (f"break-even: on these stages' measured costs{barrier} this schedule is {ratio:.2f}× as fast as the "
            f"fastest synchronous one at m = {m} ({name}){same}; "
            + (f"asynchrony pays while it needs fewer than {ratio:.2f}× their tokens" if round(ratio, 2) > 1 else
               "it needs at least their tokens, so asynchrony does not pay here")
            + " (docs/faq.md#when-does-asynchrony-pay)")


def validation_line(summary: dict, eval_interval: int, initial: tuple[int, float] | None = None) -> str:
    """The end-of-run validation line from ``summary.json``: the step of the final evaluation when it
    is not the last step done, and no "5.57 -> 5.57" when the run stopped before any evaluation after
    step 0, or when its only evaluation is its last (a run started with --init-from is not evaluated
    at its first step): either would read as no progress.

    ``initial``: ``(step, loss)`` of an evaluation before the run folder's first, from the same run (a
    ``--switch-after`` run's synchronous phase, whose evaluations are in ``RUN/synchronous``)."""
    from unbubble.loggers import perplexity

    first, last = summary["val_losses"][0][0], summary["val_losses"][-1][0]  # the versions evaluated
    if last == 0:
        return (f"validation loss {summary['initial_val_loss']:.4f} at step 0; no evaluation since "
                f"(--eval-interval {eval_interval})")
    at = "" if last == summary["steps_done"] else f" at step {last}"
    start = summary["initial_val_loss"]
    if initial is not None and initial[0] < first:
        start, first = initial[1], initial[0]
    ppl = f"(ppl {perplexity(summary['final_val_loss']):.4g})"
    if first == last:
        return f"validation loss {summary['final_val_loss']:.4f} at step {last} {ppl}, the first in this run folder"
    return f"validation loss {start:.4f} -> {summary['final_val_loss']:.4f}{at} {ppl}"


def _first_evaluation(result, run_dir: Path) -> tuple[int, float] | None:
    """The run's first ``(step, val_loss)``: a switched run's result holds both phases; resumed, its
    synchronous phase's summary.json (RUN/synchronous) holds step 0's."""
    import json

    from unbubble.metrics import SYNC_PHASE_DIR

    whole = getattr(result, "val_losses", None)
    sync = Path(run_dir) / SYNC_PHASE_DIR / "summary.json"
    if sync.is_file():
        try:
            first = json.loads(sync.read_text())["val_losses"][:1]
            whole = first + list(whole or []) if first else whole
        except (OSError, ValueError, KeyError, TypeError):
            pass  # the run folder's own evaluations still make the line
    return tuple(min(whole, key=lambda v: v[0])) if whole else None


def end_lines(cfg, result, run_dir: Path, summary: dict) -> list[str]:
    """The lines a finished run ends with (``summary``: its summary.json): the run folder, the
    validation loss, tokens/s with the drift and utilization per stage, the break-even of an
    asynchronous run, and what the non-finite guard dropped."""
    lines = [f"run folder: {run_dir}"]
    if summary["val_losses"]:
        lines.append(validation_line(summary, cfg.eval_interval, _first_evaluation(result, run_dir)))
    util, kind = result.trace.utilization(), "utilization"
    if result.sim_trace is not None:  # one process: its wall clock is no device's (sim/measured.py)
        util, kind = summary.get("simulated_utilization"), f"utilization on {cfg.stages} devices simulated from " \
            "the measured stage costs"
    per = "virtual stage" if len(result.max_drift()) != len(util or ()) else "stage"  # interleaved: v per rank
    lines.append(f"tokens/s {result.tokens_per_s:,.0f} | max Δ per {per} {result.max_drift()}"
                 + (f" | {kind} {' '.join(f'{u:.2f}' for u in util)}" if util else ""))
    line = break_even_line(cfg, result, n_layer=(summary.get("model") or {}).get("n_layer"))
    if line:
        lines.append(line)
    if result.events:
        lines.append(f"non-finite guard ({cfg.nan_policy}): dropped {len(result.events)} micro-batch(es); see "
                     f"{run_dir}/metrics.jsonl")
    return lines
