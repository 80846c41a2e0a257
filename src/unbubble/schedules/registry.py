"""Named schedules: ``get_schedule("paci", n_stages=4, steps=100, a=4)``.

One record per schedule (:class:`ScheduleInfo` in :data:`REGISTRY`) holds every fact the rest of
the library asks about it: its semantics line (admission rule, the weights F and B use, when U fires,
the memory held), whether it is asynchronous, which of ``--a``/``--m``/``--v`` it takes, its
placement, split backward, and the defaults and remedies that follow. A new schedule is one record
(and, if synchronous, its action list in :mod:`~unbubble.schedules.static`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from unbubble.errors import ConfigError, check_int, did_you_mean
from unbubble.schedules import static
from unbubble.schedules.actions import Action, flatten
from unbubble.schedules.clip import stale_lag
from unbubble.schedules.policy import ListPolicy, OrderedPaciPolicy, PaciPolicy, Policy, check_order

#: Where a schedule's stages live: ``"loop"``, stage s on rank s mod N; ``"v"``, the V shape.
Placement = Literal["loop", "v"]

#: Which weights a backward uses: the current ones, the forward's stashed version, or the
#: current ones corrected toward the forward's (PipeMare T2).
BackwardWeights = Literal["current", "stashed", "corrected"]

#: The size options a schedule may take, and what each means (``--a``, ``--m``, ``--v``).
OPTIONS: dict[str, str] = {"a": "backward passes per update", "m": "micro-batches per step",
                           "v": "virtual stages per device"}

#: ``error_feedback`` of the schedules it applies to when none is given: horizon-study measured error
#: feedback (c = 1) as the best delay remedy at 600 updates (docs/results.md).
DEFAULT_ERROR_FEEDBACK = 1.0


@dataclass(frozen=True)
class ScheduleInfo:
    """Everything the library knows about one schedule before it is given sizes: the one record the
    configuration, simulator, planner, runtime and command line query (add a schedule here and,
    for a synchronous one, its action list in :mod:`~unbubble.schedules.static`).

    Attributes:
        name: registry name.
        semantics: one line: admission rule, the weights F and B use, when U fires, memory, source
            (shown by ``unbubble schedules``).
        asynchronous: never flushed: a stage updates while later micro-batches are in flight, so
            gradients are delayed (the policy is :class:`~unbubble.schedules.policy.PaciPolicy`);
            otherwise the schedule is a fixed list per rank (:attr:`order`), flushed every step.
        takes: which of the size options ``a``, ``m``, ``v`` (:data:`OPTIONS`) it reads; the others
            are refused when given (``config.check_schedule_options``).
        backward_weights: which weights B uses (:data:`BackwardWeights`).
        placement: which rank holds each stage (:data:`Placement`).
        split_backward: B is split into I (input gradient) and W (weight gradient).
        order: ``(ranks, v, m, steps) -> per-rank action lists`` of a synchronous schedule, ``None``
            for an asynchronous one (its policy decides at run time).
        check: ``(ranks, m) -> None``, raising ConfigError for sizes the schedule cannot run.
        activations: ``(stages, m, stage) -> most micro-batches whose activations the stage holds``,
            where the schedule bounds it (checked by :func:`~unbubble.sim.validate.validate`).
        delay_lr: the per-stage learning-rate rescheduling the schedule itself prescribes
            (``"pipedream"``: PipeMare's T1, lr ÷ τ_s^(1−min(t/K,1)); ``runtime.job.PipelineJob.delay_lr``),
            or ``None``.
    """

    name: str
    semantics: str
    asynchronous: bool
    takes: tuple[str, ...] = ()
    backward_weights: BackwardWeights = "current"
    placement: Placement = "loop"
    split_backward: bool = False
    order: Callable[[int, int, int, int], list[list]] | None = field(default=None, repr=False, compare=False)
    check: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)
    activations: Callable[[int, int, int], int] | None = field(default=None, repr=False, compare=False)
    delay_lr: str | None = None

    def mb_per_update(self, a: int | None, m: int | None) -> int:
        """Micro-batches per optimizer update: ``a`` if it takes ``--a``, ``m`` if it takes ``--m``,
        else 1 (an update after every backward)."""
        return a if "a" in self.takes else m if "m" in self.takes else 1

    @property
    def updates_every_backward(self) -> bool:
        """One micro-batch per update whatever ``--a`` and ``--m`` say."""
        return "a" not in self.takes and "m" not in self.takes

    @property
    def size_option(self) -> str | None:
        """The option that sets its micro-batches per update (``"a"`` or ``"m"``), ``None`` when fixed at 1."""
        return "a" if "a" in self.takes else "m" if "m" in self.takes else None

    def chunks(self, v: int | None = None) -> int:
        """Stages (model chunks) per rank: 2 in a V, ``v`` (default 2) for a schedule taking ``--v``, else 1."""
        if self.placement == "v":
            return 2
        return (2 if v is None else v) if "v" in self.takes else 1

    @property
    def error_feedback(self) -> bool:
        """Error feedback applies: the updates are delayed (τ > 0), i.e. the schedule is asynchronous."""
        return self.asynchronous

    @property
    def predicts(self) -> bool:
        """Weight prediction applies: delayed updates and a backward on the current weights (a stashed
        backward has no drift to predict across; PipeMare corrects its own)."""
        return self.asynchronous and self.backward_weights == "current"

    @property
    def switchable(self) -> bool:
        """``--switch-after`` applies: an asynchronous schedule that updates after a fixed number of
        backwards (``a`` or 1), so its synchronous phase is 1F1B-flush with m = that number."""
        return self.asynchronous and "m" not in self.takes

    @property
    def default_error_feedback(self) -> float:
        """``error_feedback`` when none is given: :data:`DEFAULT_ERROR_FEEDBACK` where it applies, else 0."""
        return DEFAULT_ERROR_FEEDBACK if self.error_feedback else 0.0

    @property
    def default_clip_scope(self) -> str:
        """``clip_scope`` when ``--clip-grad-norm`` is given alone: ``stale`` on the asynchronous schedules
        (clip-study, docs/results.md: the same loss as ``sync``, no barrier), ``sync`` on the flushed ones."""
        return "stale" if self.asynchronous else "sync"


def _check_2bw(n: int, m: int) -> None:
    if m < n - 1:
        raise ConfigError(f"m={m} is invalid for pipedream-2bw with stages={n}: two weight versions need "
                          f"m ≥ N−1 = {n - 1} (set --m)")


def _check_interleaved(n: int, m: int) -> None:
    if m % n:
        raise ConfigError(f"m={m} is invalid for interleaved-1f1b: it must be a multiple of stages={n} "
                          "(Megatron's interleaved order; set --m)")


def _check_interleaved_zb(n: int, m: int) -> None:
    rounds = static.interleaved_zb_rounds(n, m)
    if m % rounds:
        ok = [x for x in range(m - 1, 0, -1) if x % static.interleaved_zb_rounds(n, x) == 0][:1]
        ok += [x for x in range(m + 1, 2 * m + 2) if x % static.interleaved_zb_rounds(n, x) == 0][:1]
        raise ConfigError(f"m={m} is invalid for interleaved-zb with stages={n}: it must be a multiple of "
                          f"max(1, ⌊m/N⌋) = {rounds} (torch's rounds), e.g. m={ok[0]} or m={ok[1]} (set --m)")


def _check_dualpipev(n: int, m: int) -> None:
    if m < 2 * n:
        raise ConfigError(f"m={m} is invalid for dualpipev with stages={n}: it needs m ≥ 2N = {2 * n} "
                          "micro-batches per step (2 chunks per rank, as torch requires; set --m)")


_M, _MV = ("m",), ("m", "v")
_ASYNC_BOUND = lambda n, m, s: n - s  # noqa: E731 - q_i < N + 1 − i, the back-pressure cap

#: Every schedule's record, in the order ``unbubble schedules`` lists them (and every list of names
#: derived from it: error messages name the schedules in this order).
REGISTRY: dict[str, ScheduleInfo] = {r.name: r for r in (
    ScheduleInfo("gpipe", "all m F, then all m B, U after the flush; Δ=0; m activations; bubble (N−1)/(m+N−1)  [arXiv 1811.06965]",
                 False, _M, order=lambda r, v, m, steps: static.gpipe(r, m, steps),
                 activations=lambda n, m, s: m),
    ScheduleInfo("1f1b-flush", "synchronous 1F1B, U after m B then flush; Δ=0; ≤N+1−i activations; bubble (N−1)/(m+N−1)  [arXiv 2007.01045]",
                 False, _M, order=lambda r, v, m, steps: static.one_f_one_b_flush(r, m, steps),
                 activations=lambda n, m, s: min(n - s, m)),
    ScheduleInfo("interleaved-1f1b", "v virtual stages per rank (Megatron order), flush; Δ=0; bubble (N−1)/(v·m+N−1)  [arXiv 2104.04473]",
                 False, _MV, order=static.interleaved_1f1b, check=_check_interleaved),
    ScheduleInfo("looped-bfs", "v stages per rank, breadth-first: all m F of a chunk, chunk by chunk, then the B's in reverse, flush; Δ=0; GPipe's m activations per stage; bubble (N−1)/(v·m+N−1) for m ≥ N  [arXiv 2211.05953]",
                 False, _MV, order=static.looped_bfs, activations=lambda n, m, s: m),
    ScheduleInfo("interleaved-zb", "v stages per rank, interleaved 1F1B with B split into I and W (ZB1P, torch's order), flush; Δ=0; 1F1B's N activations per device; bubble (N−1)/(3·v·m+N−1) at F=I=W, N | m  [arXiv 2401.10241]",
                 False, _MV, split_backward=True, order=static.interleaved_zero_bubble, check=_check_interleaved_zb),
    ScheduleInfo("zb-h1", "B split into I and W, W fills bubbles, flush; Δ=0; 1F1B memory; critical-path bubble 1/3 of 1F1B's at F=I=W  [arXiv 2401.10241]",
                 False, _M, split_backward=True, order=lambda r, v, m, steps: static.zb_h1(r, m, steps),
                 activations=lambda n, m, s: min(n, m)),
    ScheduleInfo("zb-h2", "as zb-h1 with 2N activations; one step's bubble is zb-h1's, later steps' max(0, 2N−1−m) at F=I=W (still flushed)  [arXiv 2401.10241]",
                 False, _M, split_backward=True, order=lambda r, v, m, steps: static.zero_bubble(r, m, steps, memory=2),
                 activations=lambda n, m, s: min(2 * n, m)),
    ScheduleInfo("zbv", "zero-bubble V: 2 chunks per rank in a V (rank r holds stages r and 2N−1−r), B split into I and W, torch's order, flush; Δ=0; 2N chunk activations per device (1F1B-flush's N when a device's two chunks hold 1/N of the blocks)  [arXiv 2401.10241 §6]",
                 False, _M, placement="v", split_backward=True, order=lambda r, v, m, steps: static.zbv(r, m, steps)),
    ScheduleInfo("dualpipev", "DualPipeV: 2 chunks per rank in a V, F of one chunk overlapped with B of the other as one compound action, torch's order, flush; m ≥ 2N; Δ=0; 2N+1 chunk activations per device  [arXiv 2412.19437]",
                 False, _M, placement="v", split_backward=True, order=lambda r, v, m, steps: static.dualpipev(r, m, steps),
                 check=_check_dualpipev),
    ScheduleInfo("paci", "async 1F1B never flushed; U after every a-th local B; B on current weights; Δ_i ≤ ⌈(N−i)/a⌉; no weight copies  [arXiv 2606.07881]",
                 True, ("a",), activations=_ASYNC_BOUND),
    ScheduleInfo("async-1f1b", "naive async 1F1B (= paci, a=1): U after every B on current weights; Δ_i ≤ N−i; no extra weights",
                 True, activations=_ASYNC_BOUND),
    ScheduleInfo("paci-stashed", "PACI's schedule with weight stashing: U after every a-th B, B on its F's version; Δ=0, τ_i ≤ ⌈(N−i)/a⌉; ≤ ⌈(N−i)/a⌉+1 weight versions (the control that separates gradient delay from PACI's inconsistency)",
                 True, ("a",), backward_weights="stashed", activations=_ASYNC_BOUND),
    ScheduleInfo("pipedream", "async 1F1B with weight stashing: B on its F's version; Δ=0, τ_i=N−i; ≤N+1−i weight versions  [arXiv 1806.03377]",
                 True, backward_weights="stashed", activations=_ASYNC_BOUND),
    ScheduleInfo("pipedream-2bw", "async 1F1B, U after m B, B on its F's version; Δ=0, τ=1; 2 weight versions (m ≥ N−1)  [arXiv 2006.09503]",
                 True, _M, backward_weights="stashed", check=_check_2bw, activations=_ASYNC_BOUND),
    ScheduleInfo("pipemare", "async 1F1B, U after every B with per-stage lr rescheduling (T1); B on current weights corrected by a velocity estimate (T2)  [arXiv 1910.05124]",
                 True, backward_weights="corrected", activations=_ASYNC_BOUND, delay_lr="pipedream"),
)}


def names_where(test: Callable[[ScheduleInfo], bool]) -> tuple[str, ...]:
    """The registered schedules whose record passes ``test``, in registry order (what every list of
    schedules in the library is: ``names_where(lambda r: r.asynchronous)``)."""
    return tuple(n for n, r in REGISTRY.items() if test(r))


#: name -> one line of semantics (shown by ``unbubble schedules``).
SCHEDULES: dict[str, str] = {n: r.semantics for n, r in REGISTRY.items()}

#: Schedules with v stages per rank (stage s on rank s mod N), taking ``--v``.
VIRTUAL = names_where(lambda r: "v" in r.takes)

#: Schedules with two stages per rank placed in a V (rank r holds stages r and 2N − 1 − r).
V_SHAPED = names_where(lambda r: r.placement == "v")

#: The asynchronous (never-flushed) schedules.
ASYNC = names_where(lambda r: r.asynchronous)


def schedule_info(name: str) -> ScheduleInfo:
    """The record of schedule ``name`` (any case, as :func:`schedule_name` reads it).

    Raises:
        ConfigError: an unknown name, with the closest valid one.
    """
    return REGISTRY[schedule_name(name)]


def stage_rank(stage: int, n_ranks: int, placement: str = "loop") -> int:
    """The rank of ``stage`` among ``n_ranks`` ranks: s mod N, or in a V (2N stages) min(s, 2N − 1 − s)."""
    return min(stage, 2 * n_ranks - 1 - stage) if placement == "v" else stage % n_ranks



@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule bound to its sizes.

    Attributes:
        name: registry name.
        n_stages: pipeline stages (N·v for interleaved 1F1B, else N).
        mb_per_step: micro-batches per optimizer step (a for PACI, m otherwise).
        steps: optimizer steps each stage applies.
        asynchronous: True if stages are never flushed.
        virtual: stages per rank (interleaved 1F1B, V-shaped schedules), else 1.
        backward_weights: which weights B uses (see :data:`BackwardWeights`).
        placement: which rank holds each stage (:data:`Placement`; :meth:`rank_of`).

    Raises:
        ConfigError: a ``name`` the registry does not hold (:func:`get_schedule` builds one by name).
    """

    name: str
    n_stages: int
    mb_per_step: int
    steps: int
    asynchronous: bool
    virtual: int = 1
    backward_weights: BackwardWeights = "current"
    placement: Placement = "loop"

    def __post_init__(self):
        # the runtime, simulator and checks read the schedule's record by name (:attr:`info`)
        if self.name not in REGISTRY:
            raise ConfigError(f"Schedule(name={self.name!r}) is not a registered schedule: valid names are "
                              f"{', '.join(REGISTRY)} (build one with get_schedule)")

    @property
    def n_ranks(self) -> int:
        """Devices (processes): one per stage, or N = stages / v when interleaved."""
        return self.n_stages // self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank that hosts ``stage``: s mod N, or in a V min(s, 2N − 1 − s)."""
        return stage_rank(stage, self.n_ranks, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` hosts, in increasing order (its chunks)."""
        if self.placement == "v":
            return [rank, self.n_stages - 1 - rank]
        return list(range(rank, self.n_stages, self.n_ranks))

    @property
    def ranks(self) -> tuple[int, ...]:
        """``rank_of(s)`` for every stage s (what traces and the memory model are given)."""
        return tuple(self.rank_of(s) for s in range(self.n_stages))

    @property
    def total_mb(self) -> int:
        """Micro-batches processed by the whole run."""
        return self.mb_per_step * self.steps

    @property
    def loss_scale(self) -> float:
        """Factor applied to each micro-batch loss so an update applies the mean gradient."""
        return 1.0 / self.mb_per_step

    @property
    def stashing(self) -> bool:
        return self.backward_weights == "stashed"

    @property
    def info(self) -> ScheduleInfo:
        """The schedule's record (:class:`ScheduleInfo`)."""
        return REGISTRY[self.name]

    @property
    def stale_lag(self) -> int:
        """s of ``clip_scope="stale"``: ⌈N/a⌉ (a = :attr:`mb_per_step`) if asynchronous, else 1."""
        return stale_lag(self.n_stages, self.mb_per_step, self.asynchronous)

    def policy(self, rank: int, order: str = "dynamic") -> Policy:
        """A fresh policy for ``rank`` (= stage unless interleaved).

        Args:
            rank: the rank (0-based).
            order: for asynchronous schedules, ``"dynamic"`` (:class:`PaciPolicy`, decides by
                arrival: what the simulator models) or ``"deterministic"`` (:class:`OrderedPaciPolicy`,
                a fixed per-stage order; the training engines' default). Synchronous schedules
                follow their lists either way.

        Raises:
            ConfigError: ``order`` is not one of :data:`ORDERS`.
        """
        check_order(order)
        if self.asynchronous:
            cls = OrderedPaciPolicy if order == "deterministic" else PaciPolicy
            return cls(rank, self.n_stages, self.mb_per_step)
        acts, overlaps = _flat_order(self.name, self.n_stages, self.mb_per_step, self.steps, self.virtual)[rank]
        return ListPolicy(acts, overlaps)

    def static_order(self) -> list[list[Action]]:
        """Per-rank action lists of a synchronous schedule (generated once per shape, cached); a
        compound action (:class:`~unbubble.schedules.actions.Overlap`) is listed as its two parts.

        Raises:
            ConfigError: the schedule is asynchronous (it is a rule, not a list).
        """
        return [list(acts) for acts, _ in _flat_order(self.name, self.n_stages, self.mb_per_step, self.steps,
                                                      self.virtual)]

    def compound_order(self) -> list[list]:
        """:meth:`static_order` with DualPipeV's compound actions as
        :class:`~unbubble.schedules.actions.Overlap` items (what ``dump_csv`` writes)."""
        return [list(acts) for acts in _static_order(self.name, self.n_stages, self.mb_per_step, self.steps,
                                                     self.virtual)]

    def drift_bound(self, stage: int) -> int:
        """Largest drift Δ = v_B − v_F of ``stage`` (0-based): ⌈(N−i)/a⌉ for PACI-type
        schedules on current weights, 0 when flushed or stashed."""
        if not self.asynchronous or self.stashing:
            return 0
        return -(-(self.n_stages - 1 - stage) // self.mb_per_step)

    def delay_bound(self, stage: int) -> int:
        """Largest staleness τ (updates between the version a gradient was computed on and
        the one it is applied to) of ``stage``: ⌈(N−i)/a⌉ for every asynchronous schedule."""
        if not self.asynchronous:
            return 0
        return -(-(self.n_stages - 1 - stage) // self.mb_per_step)


@functools.lru_cache(maxsize=64)
def _static_order(name: str, n: int, m: int, steps: int, v: int) -> tuple[tuple[Action, ...], ...]:
    order = REGISTRY[name].order
    if order is None:
        raise ConfigError(f"schedule={name!r} has no static action list: it is asynchronous")
    return tuple(tuple(acts) for acts in order(n // v, v, m, steps))


@functools.lru_cache(maxsize=64)
def _flat_order(name: str, n: int, m: int, steps: int, v: int) -> tuple[tuple[tuple[Action, ...], frozenset[int]], ...]:
    return tuple((tuple(acts), firsts) for acts, firsts in map(flatten, _static_order(name, n, m, steps, v)))

def schedule_name(name: object, option: str = "--schedule") -> str:
    """The registry's name of schedule ``name``, matched ignoring case as torch's
    ``get_schedule_class`` does ('PACI' and 'ZBV' are 'paci' and 'zbv').

    Raises:
        ConfigError: an unknown name, with the closest valid one and ``option`` to set.
    """
    if isinstance(name, str) and name.lower() in REGISTRY:
        return name.lower()
    raise ConfigError(f"schedule={name!r} is unknown{did_you_mean(name, REGISTRY)}: valid schedules are "
                      f"{', '.join(REGISTRY)} (set {option})")


def get_schedule(name: str, n_stages: int, steps: int, a: int | None = None, m: int | None = None,
                 v: int | None = None) -> Schedule:
    """Builds a named schedule.

    Args:
        name: one of :data:`SCHEDULES`.
        n_stages: pipeline depth N ≥ 1 (ranks; interleaved 1F1B has N·v stages).
        steps: optimizer steps ≥ 1.
        a: backward passes per local update of the schedules taking ``a`` (:attr:`ScheduleInfo.takes`:
            paci, paci-stashed), ≥ 1.
        m: micro-batches per step of the schedules taking ``m`` (every synchronous one and
            pipedream-2bw), ≥ 1, within the record's :attr:`~ScheduleInfo.check` (interleaved-1f1b: a
            multiple of N; interleaved-zb: a multiple of max(1, ⌊m/N⌋), as torch requires; dualpipev:
            m ≥ 2N; pipedream-2bw: m ≥ N − 1).
        v: stages per rank of the schedules taking ``v`` (:data:`VIRTUAL`), ≥ 1 (default 2); the
            V-shaped ones (:data:`V_SHAPED`) always hold 2 and ignore it. Options a schedule does not
            take are ignored.

    Raises:
        ConfigError: unknown name, a value out of range or an invalid combination (the
            message names the option to change).
    """
    name = schedule_name(name)
    check_int("stages", n_stages, 1, "set --stages")
    check_int("steps", steps, 1, "set --steps")
    info = REGISTRY[name]
    for opt, value in (("a", a), ("m", m)):
        if opt in info.takes:
            check_int(opt, value, 1, f"set --{opt}")
    if "v" in info.takes:
        check_int("v", info.chunks(v), 1, "set --v")
    if info.check is not None:
        info.check(n_stages, m)
    chunks = info.chunks(v)
    return Schedule(name, n_stages * chunks, info.mb_per_update(a, m), steps, info.asynchronous, virtual=chunks,
                    backward_weights=info.backward_weights, placement=info.placement)
