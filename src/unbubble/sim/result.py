"""One simulated run and what users ask of it: time, throughput, bubbles, drift, memory."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unbubble.schedules.policy import CutPolicy, Cuts, ListPolicy
from unbubble.schedules.registry import Schedule
from unbubble.sim.engine import CostModel, Trace, run_policies
from unbubble.sim.memory import MemorySpec, RankMemory, peak_memory

_B, _I = 1, 2


@dataclass
class SimResult:
    """A schedule run on a cost model.

    Attributes:
        schedule: what ran.
        trace: every action with simulated start/end (seconds) and versions.
        memory: peak memory per rank (``None`` without a :class:`MemorySpec`).
        samples_per_mb: sequences per micro-batch (1 if unknown: throughput is then micro-batches/s).
        tokens_per_mb: tokens per micro-batch (``None`` if unknown).
        label: a name for tables (default: the schedule's name and its m or a, and the clip scope of
            a per-update global operation, e.g. ``zb-h2 (m=8) clip sync``).
        global_op: the per-update global operation the run had (:class:`~unbubble.sim.barrier.GlobalOp`),
            or ``None``.
    """

    schedule: Schedule
    trace: Trace
    memory: list[RankMemory] | None = None
    samples_per_mb: int = 1
    tokens_per_mb: int | None = None
    label: str = ""
    _util: list[float] | None = field(default=None, repr=False)
    global_op: Any = None

    def __post_init__(self) -> None:
        if not self.label:
            s = self.schedule
            option = s.info.size_option  # None: an update after every backward, nothing to show
            self.label = f"{s.name} ({option}={s.mb_per_step})" if option else s.name
            if self.global_op is not None and self.global_op.active:
                self.label += f" clip {self.global_op.scope}"

    @property
    def n_ranks(self) -> int:
        return self.trace.ranks

    @property
    def makespan_s(self) -> float:
        """Seconds from the first action to the last."""
        return self.trace.makespan

    @property
    def samples(self) -> int:
        return self.schedule.total_mb * self.samples_per_mb

    @property
    def samples_per_s(self) -> float:
        """Sequences per second over the whole run (fill and drain included)."""
        return self.samples / self.makespan_s if self.makespan_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens_per_mb is None else self.samples_per_s / self.samples_per_mb * self.tokens_per_mb

    def completion_times(self) -> list[float]:
        """``c[k]``: when the gradient of micro-batch k reached the first stage (end of its B or I on stage 0)."""
        cols = self.trace.columns()
        if cols is not None:
            s, k, mb, _, end = cols[:5]
            last = (s == 0) & ((k == _B) | (k == _I))
            c = np.full(self.schedule.total_mb, math.nan)
            c[mb[last]] = end[last]
            return c.tolist()
        c = [math.nan] * self.schedule.total_mb
        for s, k, mb, _, end, _, _ in self.trace.rows():
            if s == 0 and (k == _B or k == _I):
                c[mb] = end
        return c

    @property
    def steady_samples_per_s(self) -> float:
        """Sequences per second in steady state: micro-batches whose gradient reaches stage 0 between the
        ends of steps ⌊S/4⌋ and S − ⌊S/4⌋ (S steps; flushed schedules repeat exactly every step),
        divided by that time. Falls back to :attr:`samples_per_s` with fewer than 2 steps."""
        steps, mps = self.schedule.steps, self.schedule.mb_per_step
        a1, a2 = max(1, steps // 4), steps - steps // 4
        if a2 <= a1:
            return self.samples_per_s
        c = self.completion_times()
        k1, k2 = a1 * mps - 1, a2 * mps - 1
        window = max(c[k1:k2 + 1]) - max(c[:k1 + 1])
        return (k2 - k1) * self.samples_per_mb / window if window > 0 else math.nan

    @property
    def steady_tokens_per_s(self) -> float | None:
        if self.tokens_per_mb is None:
            return None
        return self.steady_samples_per_s / self.samples_per_mb * self.tokens_per_mb

    def utilization(self) -> list[float]:
        """Busy / makespan per rank."""
        if self._util is None:
            self._util = self.trace.utilization()
        return self._util

    def bubble(self) -> list[float]:
        """Idle fraction per rank (1 − utilization)."""
        return [1.0 - u for u in self.utilization()]

    def max_drift(self) -> list[int]:
        return self.trace.max_drift()

    def summary(self) -> dict[str, Any]:
        """One row for the comparison table (seconds, samples/s, bytes)."""
        util = self.utilization()
        row: dict[str, Any] = {
            "schedule": self.label,
            "ranks": self.n_ranks,
            "micro_batches": self.schedule.total_mb,
            "makespan_s": self.makespan_s,
            "samples_per_s": self.samples_per_s,
            "steady_samples_per_s": self.steady_samples_per_s,
            "steady_samples_per_s_per_device": self.steady_samples_per_s / self.n_ranks,
            "tokens_per_s": self.tokens_per_s,
            "steady_tokens_per_s": self.steady_tokens_per_s,
            "mean_bubble": 1.0 - sum(util) / len(util),
            "max_bubble": 1.0 - min(util),
            "max_drift": max(self.max_drift(), default=0),
            "max_delay": max(self.trace.max_delay(), default=0),
        }
        if self.memory is not None:
            worst = max(self.memory, key=lambda m: m.peak)
            row.update(peak_memory_bytes=worst.peak, peak_activation_bytes=max(m.activations for m in self.memory),
                       peak_stash_bytes=max(m.stash for m in self.memory),
                       fits=None if worst.fits is None else all(m.fits for m in self.memory))
        return row


def schedule_policies(schedule: Schedule) -> list:
    """``[schedule.policy(r) for r in ranks]``, generating a synchronous schedule's lists once.

    ``Schedule.policy(r)`` regenerates every rank's list to return one (N² work for N ranks, seconds at
    N = 32); when rank 0's policy is the ``ListPolicy`` of ``static_order()[0]``, the other ranks get
    theirs from the same ``static_order()`` call.
    """
    first = schedule.policy(0)
    if isinstance(first, ListPolicy) and not schedule.asynchronous:
        order = schedule.static_order()
        if len(order) == schedule.n_ranks and order[0] == first.actions:
            return [first] + [ListPolicy(o) for o in order[1:]]
    return [first] + [schedule.policy(r) for r in range(1, schedule.n_ranks)]


def simulate(schedule: Schedule, costs: CostModel, memory: MemorySpec | None = None, *, samples_per_mb: int = 1,
             tokens_per_mb: int | None = None, label: str = "", checkpoint_every: int = 0,
             global_op=None) -> SimResult:
    """Runs ``schedule`` on ``costs`` and, with a ``memory`` spec, counts the peak memory of every rank.

    Args:
        schedule: from ``unbubble.schedules.get_schedule``.
        costs: durations (s) and links (see ``unbubble.sim.costs``).
        memory: per-stage sizes (bytes), e.g. ``AnalyticModel.memory``.
        samples_per_mb, tokens_per_mb: sizes of one micro-batch, for throughput.
        label: the row name in tables.
        checkpoint_every: K > 0 drains the pipeline after every K-th update, as a training run
            that checkpoints does ([Note: the checkpoint cut] in ``runtime/checkpoint.py``), so
            the throughput includes the checkpoints' cost (writing the files is not modelled).
        global_op: a per-update global operation (:class:`~unbubble.sim.barrier.GlobalOp`: the
            gradient-norm all-reduce of global clipping, ``sync``, ``stale`` or ``stage``; [Note: the
            barrier] in docs/architecture.md); ``None``: none.

    Raises:
        ScheduleError: the schedule deadlocks.
        ConfigError: costs or memory sizes describe another number of stages.
    """
    policies = schedule_policies(schedule)
    if checkpoint_every:
        cuts = Cuts(schedule.mb_per_step, every=checkpoint_every)
        policies = [CutPolicy(p, cuts) for p in policies]
    trace = run_policies(schedule, costs, policies=policies, global_op=global_op)
    mem = None
    if memory is not None:
        mem = peak_memory(trace, memory, stashed=getattr(schedule, "backward_weights", "current") == "stashed")
    return SimResult(schedule, trace, mem, samples_per_mb, tokens_per_mb, label, global_op=global_op)
