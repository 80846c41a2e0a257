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
from unbubble.schedules.policy import RankView, StageState
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
        weights: the version of the weights the action computed with (differs from
            ``version`` when a backward uses a stashed version, as in PipeDream).
    """

    action: Action
    start: float
    end: float
    version: int
    weights: int | None = None

    @property
    def weights_version(self) -> int:
        return self.version if self.weights is None else self.weights


@dataclass
class Trace:
    """Everything a run did, per stage, in execution order."""

    n_stages: int
    records: list[ActionRecord] = field(default_factory=list)
    n_ranks: int | None = None

    @property
    def ranks(self) -> int:
        """Ranks (devices): ``n_ranks``, or one per stage."""
        return self.n_ranks or self.n_stages

    def order(self) -> list[list[Action]]:
        """Per-rank action order (feed it to replay mode)."""
        out: list[list[Action]] = [[] for _ in range(self.ranks)]
        for r in self.records:
            out[r.action.stage % self.ranks].append(r.action)
        return out

    @property
    def makespan(self) -> float:
        """Seconds from the first start to the last end."""
        return max((r.end for r in self.records), default=0.0)

    def busy(self, rank: int) -> float:
        """Seconds ``rank`` spent executing actions."""
        return sum(r.end - r.start for r in self.records if r.action.stage % self.ranks == rank)

    def utilization(self) -> list[float]:
        """Busy / makespan per rank (1 − bubble fraction)."""
        span = self.makespan or 1.0
        return [self.busy(r) / span for r in range(self.ranks)]

    def versions(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(stage, mb) -> (v_F, v_B)``: the weight versions its forward and backward used."""
        fwd: dict[tuple[int, int], int] = {}
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for r in self.records:
            a = r.action
            if a.kind is ActionKind.F:
                fwd[(a.stage, a.mb)] = r.version
            elif a.kind in (ActionKind.B, ActionKind.I):
                out[(a.stage, a.mb)] = (fwd[(a.stage, a.mb)], r.weights_version)
        return out

    def drift(self) -> dict[tuple[int, int], int]:
        """``(stage, mb) -> Δ = v_B − v_F`` (DESIGN §1)."""
        return {key: vb - vf for key, (vf, vb) in self.versions().items()}

    def delays(self) -> dict[tuple[int, int], int]:
        """``(stage, mb) -> τ``: updates between the version its gradient was computed on
        (v_F) and the stage's version when the gradient was produced (then applied)."""
        fwd = {(r.action.stage, r.action.mb): r.version for r in self.records if r.action.kind is ActionKind.F}
        return {(r.action.stage, r.action.mb): r.version - fwd[(r.action.stage, r.action.mb)]
                for r in self.records if r.action.kind in (ActionKind.B, ActionKind.I)}

    def max_delay(self) -> list[int]:
        """Largest τ per stage."""
        out = [0] * self.n_stages
        for (stage, _), d in self.delays().items():
            out[stage] = max(out[stage], d)
        return out

    def max_drift(self) -> list[int]:
        """Largest Δ seen on each stage."""
        out = [0] * self.n_stages
        for (stage, _), d in self.drift().items():
            out[stage] = max(out[stage], d)
        return out


Execute = Callable[[Action], None]


def run_policies(schedule: Schedule, costs: CostModel, execute: Execute | None = None,
                 policies: list | None = None) -> Trace:
    """Runs every rank's policy on a simulated clock.

    A rank (= a stage, or the v virtual stages of interleaved 1F1B) runs one action at a
    time; F's output reaches stage s+1 and B's (or I's) gradient reaches stage s−1 after the
    send latency.

    Args:
        schedule: what to run (stages, micro-batch count, policies).
        costs: per-action durations and send latencies, seconds.
        execute: called with each action at its simulated start, in start-time order;
            the emulator runs real computation here.
        policies: per-rank policies overriding ``schedule.policy`` (replay mode).

    Returns:
        The :class:`Trace` with simulated start/end times and versions.

    Raises:
        ScheduleError: no rank can act but some are not done (deadlock); the message
            shows each stuck stage's state and the actions executed so far.
    """
    n, n_ranks = schedule.n_stages, schedule.n_ranks
    pols = policies if policies is not None else [schedule.policy(r) for r in range(n_ranks)]
    states = [StageState(s, n, schedule.total_mb) for s in range(n)]
    views = states if n_ranks == n else [
        RankView([states[s] for s in range(r, n, n_ranks)]) for r in range(n_ranks)]
    trace = Trace(n, n_ranks=n_ranks)
    busy_until = [0.0] * n_ranks
    inbox: list[list[tuple[float, ActionKind, int]]] = [[] for _ in range(n)]
    events: list[tuple[float, int, int]] = []
    seq = 0
    stashed = schedule.backward_weights == "stashed"
    fwd_version: dict[tuple[int, int], int] = {}

    def wake(t: float, rank: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, rank))
        seq += 1

    for r in range(n_ranks):
        wake(0.0, r)
    while events:
        t, _, r = heapq.heappop(events)
        if t < busy_until[r]:
            continue
        for s in range(r, n, n_ranks):
            if inbox[s]:
                st = states[s]
                keep = []
                for m in inbox[s]:
                    if m[0] <= t:
                        (st.fwd_ready if m[1] is ActionKind.F else st.bwd_ready).add(m[2])
                    else:
                        keep.append(m)
                inbox[s] = keep
        action = pols[r].next_action(views[r])
        if action is None:
            continue
        s = action.stage
        st = states[s]
        end = t + costs.duration(action)
        if execute is not None:
            execute(action)
        weights = st.version
        if action.kind is ActionKind.F:
            fwd_version[(s, action.mb)] = st.version
        elif stashed and action.kind is not ActionKind.U:
            weights = fwd_version[(s, action.mb)]
        trace.records.append(ActionRecord(action, t, end, st.version, weights))
        views[r].apply(action)
        busy_until[r] = end
        wake(end, r)
        dst = s + 1 if action.kind is ActionKind.F else s - 1
        if action.kind in (ActionKind.F, ActionKind.B, ActionKind.I) and 0 <= dst < n:
            arrival = end + costs.send_latency(s, dst)
            inbox[dst].append((arrival, ActionKind.F if action.kind is ActionKind.F else ActionKind.B, action.mb))
            wake(arrival, schedule.rank_of(dst))
    stuck = [r for r in range(n_ranks) if not pols[r].done(views[r])]
    if stuck:
        lines = [
            f"stage {s}: in_flight={states[s].in_flight} fwd_ready={sorted(states[s].fwd_ready)} "
            f"bwd_ready={sorted(states[s].bwd_ready)} done F={states[s].n_fwd} B={states[s].n_bwd} v={states[s].version}"
            for r in stuck for s in range(r, n, n_ranks)
        ]
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocked: stages {stuck} cannot act\n" + "\n".join(lines)
            + "\nexecuted so far:\n" + format_order(trace.order())
        )
    return trace
