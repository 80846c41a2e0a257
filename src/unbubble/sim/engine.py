"""Discrete-event execution of per-stage policies.

Every stage runs its own :class:`~unbubble.schedules.policy.Policy` on a simulated clock:
a stage that is idle asks its policy for an action; the action occupies the stage for
the cost model's duration; a forward's activation reaches the next stage and a
backward's gradient reaches the previous stage after the send latency. Ties are broken
by event creation order, so a run is deterministic. With an ``execute`` hook attached,
each action also runs for real at its simulated start (the emulator, DESIGN §3).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Protocol

from unbubble.errors import ScheduleError
from unbubble.schedules.actions import Action, ActionKind, format_order
from unbubble.schedules.policy import StageState
from unbubble.schedules.registry import Schedule


class CostModel(Protocol):
    def duration(self, action: Action) -> float: ...

    def send_latency(self, src: int, dst: int) -> float: ...


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One executed action.

    Attributes:
        action: what ran.
        start, end: simulated (or measured) times in seconds.
        version: the stage's weight version when the action started.
    """

    action: Action
    start: float
    end: float
    version: int


@dataclass
class Trace:
    """Everything a run did, per stage, in execution order."""

    n_stages: int
    records: list[ActionRecord] = field(default_factory=list)

    def order(self) -> list[list[Action]]:
        """Per-stage action order (feed it to replay mode)."""
        out: list[list[Action]] = [[] for _ in range(self.n_stages)]
        for r in self.records:
            out[r.action.stage].append(r.action)
        return out

    @property
    def makespan(self) -> float:
        """Seconds from the first start to the last end."""
        return max((r.end for r in self.records), default=0.0)

    def busy(self, stage: int) -> float:
        """Seconds ``stage`` spent executing actions."""
        return sum(r.end - r.start for r in self.records if r.action.stage == stage)

    def utilization(self) -> list[float]:
        """Busy / makespan per stage (1 − bubble fraction)."""
        span = self.makespan or 1.0
        return [self.busy(s) / span for s in range(self.n_stages)]

    def versions(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(stage, mb) -> (v_F, v_B)`` for every micro-batch that finished its backward."""
        fwd: dict[tuple[int, int], int] = {}
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for r in self.records:
            a = r.action
            if a.kind is ActionKind.F:
                fwd[(a.stage, a.mb)] = r.version
            elif a.kind in (ActionKind.B, ActionKind.I):
                out[(a.stage, a.mb)] = (fwd[(a.stage, a.mb)], r.version)
        return out

    def drift(self) -> dict[tuple[int, int], int]:
        """``(stage, mb) -> Δ = v_B − v_F`` (DESIGN §1)."""
        return {key: vb - vf for key, (vf, vb) in self.versions().items()}

    def max_drift(self) -> list[int]:
        """Largest Δ seen on each stage."""
        out = [0] * self.n_stages
        for (stage, _), d in self.drift().items():
            out[stage] = max(out[stage], d)
        return out


Execute = Callable[[Action], None]


def run_policies(schedule: Schedule, costs: CostModel, execute: Execute | None = None,
                 policies: list | None = None) -> Trace:
    """Runs every stage's policy on a simulated clock.

    Args:
        schedule: what to run (N, micro-batch count, policies).
        costs: per-action durations and send latencies, seconds.
        execute: called with each action at its simulated start, in start-time order;
            the emulator runs real computation here.
        policies: per-stage policies overriding ``schedule.policy`` (replay mode).

    Returns:
        The :class:`Trace` with simulated start/end times and versions.

    Raises:
        ScheduleError: no stage can act but some are not done (deadlock); the message
            shows each stage's state.
    """
    n = schedule.n_stages
    pols = policies if policies is not None else [schedule.policy(s) for s in range(n)]
    states = [StageState(s, n, schedule.total_mb) for s in range(n)]
    trace = Trace(n)
    busy_until = [0.0] * n
    inbox: list[list[tuple[float, ActionKind, int]]] = [[] for _ in range(n)]
    events: list[tuple[float, int, int]] = []
    seq = 0

    def wake(t: float, stage: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, stage))
        seq += 1

    for s in range(n):
        wake(0.0, s)
    while events:
        t, _, s = heapq.heappop(events)
        if t < busy_until[s]:
            continue
        st = states[s]
        arrived = [m for m in inbox[s] if m[0] <= t]
        if arrived:
            inbox[s] = [m for m in inbox[s] if m[0] > t]
            for _, kind, mb in arrived:
                (st.fwd_ready if kind is ActionKind.F else st.bwd_ready).add(mb)
        action = pols[s].next_action(st)
        if action is None:
            continue
        end = t + costs.duration(action)
        if execute is not None:
            execute(action)
        trace.records.append(ActionRecord(action, t, end, st.version))
        st.apply(action)
        busy_until[s] = end
        wake(end, s)
        dst = s + 1 if action.kind is ActionKind.F else s - 1
        if action.kind in (ActionKind.F, ActionKind.B, ActionKind.I) and 0 <= dst < n:
            arrival = end + costs.send_latency(s, dst)
            inbox[dst].append((arrival, ActionKind.F if action.kind is ActionKind.F else ActionKind.B, action.mb))
            wake(arrival, dst)
    stuck = [s for s in range(n) if not pols[s].done(states[s])]
    if stuck:
        lines = [
            f"stage {s}: in_flight={states[s].in_flight} fwd_ready={sorted(states[s].fwd_ready)} "
            f"bwd_ready={sorted(states[s].bwd_ready)} done F={states[s].n_fwd} B={states[s].n_bwd} v={states[s].version}"
            for s in stuck
        ]
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocked: stages {stuck} cannot act\n" + "\n".join(lines)
            + "\nexecuted so far:\n" + format_order(trace.order())
        )
    return trace
