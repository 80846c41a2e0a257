"""A per-update global operation on the simulator's clock: the gradient-norm all-reduce of global clipping.

Global clipping and the global non-finite check are an all-reduce across all stages per update, a
barrier (docs/architecture.md#global-operations-are-barriers). :class:`GlobalOp` makes it an option of
the timed simulator (``run_policies(..., global_op=...)``, ``simulate(..., global_op=...)``), so the
simulator, the planner and the break-even count it; ``scope`` mirrors the runtime's ``--clip-scope``.

Notes: [Note: the barrier] (when each scope's update may start, and what the trace records) in
docs/architecture.md#global-operations-are-barriers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from unbubble.errors import ConfigError, check_int
from unbubble.schedules.clip import GLOBAL_SCOPES, SIM_SCOPES
from unbubble.schedules.clip import check_scope as _check_scope

#: ``--clip-scope`` values of the simulator: ``none`` (no global operation), and the runtime's three
#: (the one vocabulary, ``schedules/clip.py``).
SCOPES = SIM_SCOPES

#: Bytes of one stage's contribution to the all-reduce: its local squared norm as one fp32 value (a
#: non-finite gradient makes it non-finite, so the same value is the global non-finite check).
NORM_BYTES = 4.0


def check_scope(scope: str) -> None:
    """Raises ConfigError unless ``scope`` is one of :data:`SCOPES` (with a did-you-mean)."""
    _check_scope(scope, SIM_SCOPES)


def allreduce_latency(hardware, n_ranks: int, nbytes: float = NORM_BYTES) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n_ranks`` ranks 0 … R − 1 of ``hardware``:
    2(R − 1) link latencies + 2(R − 1)/R · bytes ÷ bandwidth, over the ring's slowest link (ranks
    r and r + 1 mod R; a ring that spans nodes crosses the NIC). A latency-bound upper estimate for
    one fp32 value: NCCL's tree and low-latency protocols can be faster; the table's per-message
    latencies are themselves order-of-magnitude assumptions (``sim/hardware.py``). 0 for one rank."""
    check_int("n_ranks", n_ranks)
    if n_ranks == 1:
        return 0.0
    links = [hardware.link(r, (r + 1) % n_ranks) for r in range(n_ranks)]
    lat, bw = max(x[0] for x in links), min(x[1] for x in links)
    return 2 * (n_ranks - 1) * lat + 2 * (n_ranks - 1) / n_ranks * nbytes / bw


@dataclass(frozen=True)
class GlobalOp:
    """The per-update global operation of a run ([Note: the barrier]).

    Attributes:
        scope: ``none``, ``stage``, ``sync`` or ``stale`` (:data:`SCOPES`).
        latency_s: λ, seconds from the last rank's contribution to the all-reduce's result on every
            rank (≥ 0).
        norm_s: ν, seconds a stage takes to form its local squared norm: one number for every stage,
            or one per stage (N·v for chunked schedules).
        lag: s of ``stale`` (≥ 1); ``None``: the schedule's ``stale_lag`` (the runtime's: ⌈N/a⌉,
            a = its micro-batches per update, for asynchronous schedules; 1 for flushed ones).
    """

    scope: str = "sync"
    latency_s: float = 0.0
    norm_s: float | tuple[float, ...] = 0.0
    lag: int | None = None

    def __post_init__(self) -> None:
        check_scope(self.scope)
        for name, v in (("latency_s", self.latency_s),) + tuple(
                (f"norm_s[{i}]", x) for i, x in enumerate(self.norm_s if isinstance(self.norm_s, tuple)
                                                          else (self.norm_s,))):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"{name}={v!r} is invalid: must be a finite number ≥ 0 (seconds)")
        if self.lag is not None:
            check_int("lag", self.lag, 1, "set --clip-lag", valid="the stale norm's lag must be an integer ≥ 1 updates")

    @property
    def active(self) -> bool:
        """The operation changes the clock (any scope but ``none``)."""
        return self.scope != "none"

    def lag_for(self, schedule) -> int:
        """s for ``schedule``: ``lag``, or the schedule's own (``Schedule.stale_lag``)."""
        if self.lag is not None:
            return self.lag
        return schedule.stale_lag

    def norms(self, n_stages: int) -> list[float]:
        """ν of each of ``n_stages`` stages.

        Raises:
            ConfigError: ``norm_s`` gives another number of stages.
        """
        if not isinstance(self.norm_s, tuple):
            return [float(self.norm_s)] * n_stages
        if len(self.norm_s) != n_stages:
            raise ConfigError(f"norm_s has {len(self.norm_s)} entries but the schedule has {n_stages} stages: give "
                              "one local-norm time per stage")
        return [float(x) for x in self.norm_s]


def for_analytic(am, scope: str, n_ranks: int | None = None, lag: int | None = None,
                 latency_s: float | None = None) -> GlobalOp:
    """The :class:`GlobalOp` of an analytic model (``unbubble.sim.analytic.AnalyticModel``): ν of each
    stage = its gradient bytes ÷ the device's memory bandwidth (the local norm reads every gradient
    once), λ = :func:`allreduce_latency` over ``n_ranks`` ranks (default the model's devices; a plan
    with data-parallel replicas passes N·dp) unless ``latency_s`` is given."""
    hw = am.hardware
    norm = tuple(g / hw.hbm_bytes_per_s for g in am.memory.grads_bytes)
    lam = allreduce_latency(hw, n_ranks or am.n_ranks) if latency_s is None else latency_s
    return GlobalOp(scope, lam, norm, lag)


@dataclass
class GlobalOpLog:
    """What a run's global operation did ([Note: the barrier]); ``Trace.global_op_log``.

    Attributes:
        scope, lag: the operation's (``lag`` as resolved for the schedule).
        updates: one row per rank and update it reached: ``(rank, stages, t, reached_s, start_s)``:
            the stages whose ``U`` of update t the run holds, when the rank reached it and when its
            first ``U`` (ν included) started; ``start_s − reached_s`` is the rank's wait.
        completed: t → R_t, when update t's all-reduce completed (``sync`` and ``stale``).
        norm_s: ν of each stage.
    """

    scope: str
    lag: int
    updates: list[tuple[int, tuple[int, ...], int, float, float]] = field(default_factory=list)
    completed: dict[int, float] = field(default_factory=dict)
    norm_s: Sequence[float] = ()

    def waits(self) -> dict[tuple[int, int], float]:
        """(rank, t) → seconds the rank idled between reaching update t and starting its step."""
        return {(r, t): start - reached for r, _, t, reached, start in self.updates}

    def norm_lateness(self) -> dict[tuple[int, int], float]:
        """``stale`` and ``sync``: (rank, t) → R_g − (reached + ν) for the all-reduce g the step of
        update t uses (t for ``sync``, t − lag for ``stale``, only where g ≥ 1): how long after the
        rank's own norm was ready the result it needs arrived. ≤ 0: it was there; nobody waited."""
        g_of = (lambda t: t) if self.scope == "sync" else (lambda t: t - self.lag)
        out = {}
        for r, stages, t, reached, _ in self.updates:
            g = g_of(t)
            if self.scope in GLOBAL_SCOPES and g >= 1:
                out[(r, t)] = self.completed[g] - (reached + sum(self.norm_s[s] for s in stages))
        return out
