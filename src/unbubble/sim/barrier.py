"""A per-update global operation on the simulator's clock: the gradient-norm all-reduce of global clipping.

Global gradient clipping (torchtitan's ``max_norm``, Megatron's ``clip_grad``) and the global
non-finite check need, at every update, one number from every stage: the squared norm of its
gradients. Over a pipeline that is an all-reduce across all stages per update, a barrier
(docs/architecture.md#global-operations-are-barriers). :class:`GlobalOp` makes it an option of the timed simulator
(``run_policies(..., global_op=...)``, ``simulate(..., global_op=...)``); ``scope`` mirrors the
runtime's ``--clip-scope``.

[Note: the barrier]
Update t of a stage is its t-th ``U`` (1-based; its weights go from version t − 1 to t). For every
schedule:

* **reached**: stage s *reaches* update t when its next action is its t-th ``U``: every backward of
  update t's micro-batches on s is done (B, or I and W: a synchronous list places a stage's ``U``
  after its whole step; PACI fires ``U`` after its a-th local backward). A rank hosting several
  chunks (interleaved, V-shaped schedules) reaches the update when its list reaches the run of
  consecutive ``U`` that updates its chunks; it computes their local norms together, one all-reduce
  per rank, as a real rank does.
* **local norm**: the rank then reads its gradients once to form its local squared norm, ν seconds
  (``norm_s``: gradient bytes ÷ memory bandwidth in the analytic model, 0 on unit costs).
* **all-reduce**: update t's all-reduce completes at R_t = max over ranks (reached + ν) + λ, where λ
  is the all-reduce's latency (``latency_s``; :func:`allreduce_latency` from the hardware table).
* the step (clip, then the optimizer update) waits for the norm it uses:

  - ``sync``: the norm of update t itself. Nothing may start update t + 1's work before R_t: on a
    synchronous schedule every stage's next forwards follow its ``U`` in its list, so the step's
    across-update overlap is gone (ZB-H2 and ZBV pay their flushed step's bubble every update;
    1F1B-flush, whose next step cannot start before stage 0's last backward anyway, pays only λ
    and ν); under PACI a stage that reaches update t idles until the slowest stage (stage 0, the
    last to finish update t's backwards) has reached it too: the staggered stages stall.
  - ``stale``: the norm of update t − s (``lag`` s; none for t ≤ s, which then clip by their local
    norm alone as the runtime does), an all-reduce started at update t − s and not waited for
    unless it is still running. :func:`~unbubble.schedules.clip.stale_lag` gives the runtime's s
    ([Note: stale lag] in ``runtime/clipping.py``): ⌈N/a⌉ for the asynchronous schedules, which by causality alone
    guarantees that every stage has started update t − s before any stage reaches update t
    (never more than ⌈(N − 1)/a⌉ + 1, the drift bound plus one), and 1 for the flushed ones.
    ``tests/unit/test_sim_barrier.py`` checks on the timeline that no stage waits in steady state,
    and that the smallest s for which none waits is ⌈(N − 1)·B / (a·(F + B))⌉ on unit costs with
    λ = 0 (⌊…⌋ + 1 with λ > 0): stage 0 reaches update t (N − 1)·B after the last stage, which
    completes an update every a·(F + B).
  - ``stage``: the local norm only, no all-reduce, no wait.

  The ``U`` action carries ν (its duration is ν + u on the first ``U`` of the run) and starts at
  max(reached, G − ν), G = R_t (``sync``) or R_{t−s} (``stale``): the same end time and busy time as
  the norm right at ``reached`` followed by the wait. The engine starts it no earlier than the moment
  G is known (when the last rank reaches the update), which is later than G − ν only when that
  rank's ν is more than λ shorter than this one's.

A ``U`` that waits is a rank that idles: it runs nothing else meanwhile (a blocking all-reduce). The
engine records every update's reached and start times and R_t in ``Trace.global_op_log``
(:class:`GlobalOpLog`). Runs with a global operation take the reference engine ([Note: engine fast
paths] in ``sim/engine.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from unbubble.errors import ConfigError, check_int
from unbubble.schedules.clip import GLOBAL_SCOPES, SIM_SCOPES, stale_lag
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
        lag: s of ``stale`` (≥ 1); ``None``: :func:`stale_lag` of the schedule (the runtime's: ⌈N/a⌉,
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
        """s for ``schedule``: ``lag``, or :func:`stale_lag` (N = its stages, a = its micro-batches per update)."""
        if self.lag is not None:
            return self.lag
        return stale_lag(schedule.n_stages, schedule.mb_per_step, schedule.asynchronous)

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
