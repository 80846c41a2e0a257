"""Checks a schedule before anything runs, by a dry run on the simulator's clock: counts, local causality,
caps, deadlock, drift, memory.

Every failure raises :class:`~unbubble.errors.ScheduleError` naming the first offending
action and showing the per-rank order with that action marked.
"""

from __future__ import annotations

from collections import Counter

from unbubble.errors import ScheduleError
from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import ListPolicy
from unbubble.schedules.registry import Schedule

F, B, I, W, U = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.U


def _fail(order: list[list[Action]], rank: int, pos: int, why: str) -> ScheduleError:
    grid = []
    for r, acts in enumerate(order):
        cells = [f">>{a}<<" if (r, i) == (rank, pos) else str(a) for i, a in enumerate(acts)]
        grid.append(f"rank {r}: " + " ".join(cells))
    return ScheduleError(f"{order[rank][pos]} (rank {rank}, position {pos}): {why}\n" + "\n".join(grid))


def activation_bound(schedule: Schedule, stage: int) -> int | None:
    """Most micro-batches whose activations ``stage`` may hold at once (``None``: not bounded here)."""
    bound = schedule.info.activations  # the record's (q_i < N + 1 − i for the asynchronous ones)
    return None if bound is None else bound(schedule.n_stages, schedule.mb_per_step, stage)


def validate(schedule: Schedule, order: list[list[Action]] | None = None):
    """Validates ``order`` (default: the schedule's own action lists, or a dry run of its policy).

    Checks, in order: every stage runs F and either B or I+W exactly once per micro-batch and
    U ``steps`` times; on each stage F(k) precedes B(k)/I(k) and I(k) precedes W(k);
    a dry run on unit costs finishes (no deadlock, cross-stage order respected); activations
    held per stage stay within :func:`activation_bound`; the measured drift Δ stays within
    ``schedule.drift_bound`` (0 for synchronous and stashed schedules); stashed weight versions
    per stage stay ≤ N + 1 − i.

    Returns:
        The dry run's :class:`~unbubble.sim.engine.Trace`.

    Raises:
        ScheduleError: the first violation, with the offending action marked.
    """
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.engine import run_policies

    n, total = schedule.n_stages, schedule.total_mb
    if order is None and not schedule.asynchronous:
        order = schedule.static_order()
    if order is not None:
        if len(order) != schedule.n_ranks:
            raise ScheduleError(f"the order has {len(order)} ranks but the schedule has {schedule.n_ranks}")
        for r, acts in enumerate(order):
            seen: Counter = Counter()
            for pos, a in enumerate(acts):
                if not 0 <= a.stage < n or schedule.rank_of(a.stage) != r:
                    raise _fail(order, r, pos, f"stage {a.stage} does not live on rank {r}")
                key = (a.stage, a.kind, a.mb)
                if a.kind is not U:
                    if not 0 <= a.mb < total:
                        raise _fail(order, r, pos, f"micro-batch {a.mb} is outside 0…{total - 1}")
                    if seen[key]:
                        raise _fail(order, r, pos, "runs twice")
                    if a.kind in (B, I) and not seen[(a.stage, F, a.mb)]:
                        raise _fail(order, r, pos, f"runs before its forward {a.stage}F{a.mb}")
                    if a.kind is W and not seen[(a.stage, I, a.mb)]:
                        raise _fail(order, r, pos, f"runs before its input gradient {a.stage}I{a.mb}")
                seen[key] += 1
            for s in schedule.stages_of(r):
                for k in range(total):
                    if not seen[(s, F, k)] or not (seen[(s, B, k)] or (seen[(s, I, k)] and seen[(s, W, k)])):
                        raise ScheduleError(f"stage {s} never completes micro-batch {k} (needs F and B, or F, I and W)")
                if seen[(s, U, None)] != schedule.steps:
                    raise ScheduleError(f"stage {s} applies U {seen[(s, U, None)]} times, expected steps={schedule.steps}")
    policies = None if order is None else [ListPolicy(acts) for acts in order]
    trace = run_policies(schedule, UniformCosts(f=1.0, b=2.0), policies=policies)
    held = [0] * n
    versions_held: list[dict[int, int]] = [dict() for _ in range(n)]
    fwd_v: dict[tuple[int, int], int] = {}
    drift = trace.drift()
    for rec in trace.records:
        a, s = rec.action, rec.action.stage
        bound = activation_bound(schedule, s)
        if a.kind is F:
            held[s] += 1
            fwd_v[(s, a.mb)] = rec.version
            versions_held[s][rec.version] = versions_held[s].get(rec.version, 0) + 1
            if bound is not None and held[s] > bound:
                raise ScheduleError(f"{a}: stage {s} would hold {held[s]} activations, more than the bound {bound}")
            if schedule.stashing and len(versions_held[s]) > n - s:
                raise ScheduleError(f"{a}: stage {s} would stash {len(versions_held[s])} weight versions, "
                                    f"more than N+1−i = {n - s}")
        elif a.kind in (B, W):
            held[s] -= 1
            v = fwd_v.pop((s, a.mb))
            versions_held[s][v] -= 1
            if not versions_held[s][v]:
                del versions_held[s][v]
        if a.kind in (B, I) and drift[(s, a.mb)] > schedule.drift_bound(s):
            raise ScheduleError(f"{a}: drift Δ={drift[(s, a.mb)]} exceeds the bound {schedule.drift_bound(s)} of "
                                f"stage {s} for {schedule.name}")
    return trace
