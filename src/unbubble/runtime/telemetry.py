"""Collects what a run did — action records, losses, drift, evaluations — from any engine."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from unbubble.runtime.job import PipelineJob, evaluate
from unbubble.schedules.actions import ActionKind
from unbubble.sim.engine import ActionRecord, Trace, placement_of


class Listener(Protocol):
    """Receives live progress (the CLI draws a progress bar and writes JSONL from it)."""

    def on_step(self, step: int, loss: float, info: dict[str, Any]) -> None: ...

    def on_eval(self, version: int, val_loss: float) -> None: ...

    def on_event(self, event: dict[str, Any]) -> None: ...

    # optional: ``on_snapshot(version, {stage: state_dict})`` receives every evaluated snapshot
    # (the run writer reads the router counters of a mixture of experts from it)


@dataclass
class RunResult:
    """What a finished run produced.

    Attributes:
        trace: executed actions with measured wall-clock start/end (seconds since start) and
            the weight version each started on.
        sim_trace: the emulator's simulated trace (``None`` for the process engine).
        step_losses: last stage's mean training loss per local update (index = update − 1).
        val_losses: ``(version, validation loss)`` pairs.
        final_states: each stage's ``state_dict`` after the run.
        wall_s: wall-clock seconds of the training loop.
        tokens: tokens processed by all replicas (micro-batches × tokens per micro-batch × D),
            or samples if unknown.
        optimizer_bytes: per stage, ``unbubble.optim.optimizer_state_bytes`` of its optimizer
            at the end (state bytes, extra bytes over AdamW, multiples of the parameters).
        start_step: the update the run started after (0, or the checkpoint it resumed);
            ``step_losses[i]`` belongs to update ``start_step + i + 1``.
        stopped_at: the step T a stop (SIGINT/SIGTERM) ended the run at, else ``None``.
        events: micro-batches the non-finite guard dropped (stage, mb, version, what, policy).
        memory: per stage, the executor's measured bytes (``StageExecutor.memory_bytes``:
            parameters, fp32 masters, gradients, optimizer state, peak activations and weight
            copies; with the process engine also ``process_rss_bytes`` and
            ``process_peak_rss_bytes`` of the stage's process), or empty when the engine did not
            report them.
        first_step_end: epoch seconds at which the run's first optimizer step had ended on every
            stage (``None`` if one never updated).
        clip: gradient clipping (``clipping.clip_summary``): scope, threshold, stale lag and per
            stage the updates clipped and skipped over the whole run (across resumes); ``None``
            without clipping.
    """

    trace: Trace
    sim_trace: Trace | None
    step_losses: list[float]
    val_losses: list[tuple[int, float]]
    final_states: list[dict[str, torch.Tensor]]
    wall_s: float
    tokens: int
    optimizer_bytes: list[dict] = field(default_factory=list)
    start_step: int = 0
    stopped_at: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    first_step_end: float | None = None
    clip: dict[str, Any] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    def max_drift(self) -> list[int]:
        """Largest Δ = v_B − v_F per stage (0-based)."""
        return self.trace.max_drift()


class Telemetry:
    """Aggregates events from the engine and evaluates consistent weight snapshots.

    Evaluation uses the weights of version v on *every* stage (each stage contributes its
    snapshot when it reaches v), so asynchronous engines evaluate the same model whatever
    the interleaving, and the emulator and the process engine report identical values.
    """

    def __init__(self, job: PipelineJob, listener: Listener | None = None, start_step: int = 0):
        self.job, self.listener, self.start_step = job, listener, start_step
        self.events: list[dict[str, Any]] = []
        n = job.schedule.n_stages
        self.trace = Trace(n, n_ranks=job.schedule.n_ranks, placement=placement_of(job.schedule))
        self.step_losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self._snapshots: dict[int, dict[int, dict]] = {}
        self._eval_modules: list | None = None
        self._fwd_version: dict[tuple[int, int], int] = {}
        self._max_drift = [0] * n  # per stage
        self.t0 = time.time()  # training start (epoch seconds): the process engine moves it with set_start

    def set_start(self, t0: float) -> None:
        """The training loop's start (epoch seconds, shared by the stages): per-step tokens/s and
        elapsed seconds exclude the process engine's start-up."""
        self.t0 = t0

    def add_record(self, rec: ActionRecord) -> None:
        self.trace.records.append(rec)
        a = rec.action
        if a.kind is ActionKind.F:
            self._fwd_version[(a.stage, a.mb)] = rec.version
        elif a.kind in (ActionKind.B, ActionKind.I):
            d = rec.weights_version - self._fwd_version.pop((a.stage, a.mb))
            self._max_drift[a.stage] = max(self._max_drift[a.stage], d)

    def add_step_loss(self, loss: float) -> None:
        self.step_losses.append(loss)
        if self.listener is not None:
            elapsed = time.time() - self.t0
            # the tokens of the steps done, as RunResult.tokens counts them at the end
            tokens = len(self.step_losses) * self.job.schedule.mb_per_step * (self.job.tokens_per_mb or 1) * self.job.dp
            self.listener.on_step(self.start_step + len(self.step_losses), loss, {
                "tok_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "max_drift": max(self._max_drift),
                "elapsed_s": elapsed,
            })

    def add_event(self, event: dict[str, Any]) -> None:
        """A micro-batch dropped by the non-finite guard."""
        self.events.append(event)
        if self.listener is not None and hasattr(self.listener, "on_event"):
            self.listener.on_event(event)

    def add_snapshot(self, stage: int, version: int, state: dict[str, torch.Tensor]) -> None:
        got = self._snapshots.setdefault(version, {})
        got[stage] = state
        if len(got) == self.job.schedule.n_stages:
            del self._snapshots[version]
            if self._eval_modules is None:  # stage_fn seeds its initialisation: keep the training RNG stream
                with torch.random.fork_rng(devices=[]):
                    self._eval_modules = [self.job.stage_fn(s) for s in range(self.job.schedule.n_stages)]
            for s, m in enumerate(self._eval_modules):
                m.load_state_dict(got[s])
                m.eval()
            val = evaluate(self.job, self._eval_modules)
            self.val_losses.append((version, val))
            if self.listener is not None:
                self.listener.on_eval(version, val)
                if hasattr(self.listener, "on_snapshot"):
                    self.listener.on_snapshot(version, got)

    def result(self, final_states: list[dict], wall_s: float, sim_trace: Trace | None = None,
               optimizer_bytes: list[dict] | None = None, stopped_at: int | None = None,
               memory: list[dict] | None = None, clip: dict[str, Any] | None = None) -> RunResult:
        self.trace.records.sort(key=lambda r: (r.start, r.action.stage))
        sched = self.job.schedule
        end = sched.steps if stopped_at is None else stopped_at
        tokens = (end - self.start_step) * sched.mb_per_step * (self.job.tokens_per_mb or 1) * self.job.dp
        return RunResult(self.trace, sim_trace, self.step_losses, sorted(self.val_losses),
                         final_states, wall_s, tokens, optimizer_bytes or [], self.start_step, stopped_at,
                         self.events, memory or [], self._first_step_end(), clip)

    def _first_step_end(self) -> float | None:
        """When the run's first optimizer step had ended on every stage, epoch seconds (``None``
        if some stage never updated)."""
        first: dict[int, float] = {}
        for r in self.trace.records:
            if r.action.kind is ActionKind.U:
                first[r.action.stage] = min(first.get(r.action.stage, math.inf), r.end)
        if len(first) < self.job.schedule.n_stages:
            return None
        return self.t0 + max(first.values())


def process_memory() -> dict[str, int | None]:
    """This process's resident memory in bytes: ``rss_bytes`` now (``Rss`` of
    ``/proc/self/smaps_rollup``) and ``peak_rss_bytes`` (``getrusage``'s ``ru_maxrss``, KiB on
    Linux); ``None`` for what the platform does not report."""
    rss = peak = None
    try:
        with open("/proc/self/smaps_rollup") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Rss:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError):
        pass
    return {"rss_bytes": rss, "peak_rss_bytes": peak}


def process_start_epoch() -> float | None:
    """When this process started, epoch seconds, to /proc's clock tick (10 ms): now minus the
    time since its start (``/proc/uptime`` less field 22 of ``/proc/self/stat``; the boot time of
    ``/proc/stat`` has whole seconds only); ``None`` without /proc."""
    import os

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``module``'s state for evaluation (never used for training)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
