"""Named schedules: ``get_schedule("paci", n_stages=4, steps=100, a=4)``.

Every entry of :data:`SCHEDULES` states its admission rule, the weights F and B use, when U
fires and the memory held; the semantics table is DESIGN §2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from unbubble.errors import ConfigError, check_int, did_you_mean
from unbubble.schedules.actions import Action, flatten
from unbubble.schedules.policy import ListPolicy, OrderedPaciPolicy, PaciPolicy, Policy, check_order
from unbubble.schedules import static

#: name -> one line of semantics (shown by ``unbubble schedules``).
SCHEDULES: dict[str, str] = {
    "gpipe": "all m F, then all m B, U after the flush; Δ=0; m activations; bubble (N−1)/(m+N−1)  [arXiv 1811.06965]",
    "1f1b-flush": "synchronous 1F1B, U after m B then flush; Δ=0; ≤N+1−i activations; bubble (N−1)/(m+N−1)  [arXiv 2007.01045]",
    "interleaved-1f1b": "v virtual stages per rank (Megatron order), flush; Δ=0; bubble (N−1)/(v·m+N−1)  [arXiv 2104.04473]",
    "looped-bfs": "v stages per rank, breadth-first: all m F of a chunk, chunk by chunk, then the B's in reverse, flush; Δ=0; GPipe's m activations per stage; bubble (N−1)/(v·m+N−1) for m ≥ N  [arXiv 2211.05953]",
    "interleaved-zb": "v stages per rank, interleaved 1F1B with B split into I and W (ZB1P, torch's order), flush; Δ=0; 1F1B's N activations per device; bubble (N−1)/(3·v·m+N−1) at F=I=W, N | m  [arXiv 2401.10241]",
    "zb-h1": "B split into I and W, W fills bubbles, flush; Δ=0; 1F1B memory; critical-path bubble 1/3 of 1F1B's at F=I=W  [arXiv 2401.10241]",
    "zb-h2": "as zb-h1 with 2N activations; one step's bubble is zb-h1's, later steps' max(0, 2N−1−m) at F=I=W (still flushed)  [arXiv 2401.10241]",
    "zbv": "zero-bubble V: 2 chunks per rank in a V (rank r holds stages r and 2N−1−r), B split into I and W, torch's order, flush; Δ=0; 2N chunk activations per device (1F1B-flush's N when a device's two chunks hold 1/N of the blocks)  [arXiv 2401.10241 §6]",
    "dualpipev": "DualPipeV: 2 chunks per rank in a V, F of one chunk overlapped with B of the other as one compound action, torch's order, flush; m ≥ 2N; Δ=0; 2N+1 chunk activations per device  [arXiv 2412.19437]",
    "async-1f1b": "naive async 1F1B (= paci, a=1): U after every B on current weights; Δ_i ≤ N−i; no extra weights",
    "paci": "async 1F1B never flushed; U after every a-th local B; B on current weights; Δ_i ≤ ⌈(N−i)/a⌉; no weight copies  [arXiv 2606.07881]",
    "paci-stashed": "PACI's schedule with weight stashing: U after every a-th B, B on its F's version; Δ=0, τ_i ≤ ⌈(N−i)/a⌉; ≤ ⌈(N−i)/a⌉+1 weight versions (the control that separates gradient delay from PACI's inconsistency)",
    "pipedream": "async 1F1B with weight stashing: B on its F's version; Δ=0, τ_i=N−i; ≤N+1−i weight versions  [arXiv 1806.03377]",
    "pipedream-2bw": "async 1F1B, U after m B, B on its F's version; Δ=0, τ=1; 2 weight versions (m ≥ N−1)  [arXiv 2006.09503]",
    "pipemare": "async 1F1B, U after every B with per-stage lr rescheduling (T1); B on current weights corrected by a velocity estimate (T2)  [arXiv 1910.05124]",
}

#: Schedules with v stages per rank (stage s on rank s mod N), taking ``--v``.
VIRTUAL = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")

#: Schedules with two stages per rank placed in a V (rank r holds stages r and 2N − 1 − r).
V_SHAPED = ("zbv", "dualpipev")

#: Where a schedule's stages live: ``"loop"``, stage s on rank s mod N; ``"v"``, the V shape.
Placement = Literal["loop", "v"]


def stage_rank(stage: int, n_ranks: int, placement: str = "loop") -> int:
    """The rank of ``stage`` among ``n_ranks`` ranks: s mod N, or in a V (2N stages) min(s, 2N − 1 − s)."""
    return min(stage, 2 * n_ranks - 1 - stage) if placement == "v" else stage % n_ranks

ASYNC = ("paci", "paci-stashed", "async-1f1b", "pipedream", "pipedream-2bw", "pipemare")

#: Which weights a backward uses: the current ones, the forward's stashed version, or the
#: current ones corrected toward the forward's (PipeMare T2).
BackwardWeights = Literal["current", "stashed", "corrected"]


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
    """

    name: str
    n_stages: int
    mb_per_step: int
    steps: int
    asynchronous: bool
    virtual: int = 1
    backward_weights: BackwardWeights = "current"
    placement: Placement = "loop"

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
    if name == "gpipe":
        order = static.gpipe(n, m, steps)
    elif name == "1f1b-flush":
        order = static.one_f_one_b_flush(n, m, steps)
    elif name == "interleaved-1f1b":
        order = static.interleaved_1f1b(n // v, v, m, steps)
    elif name == "looped-bfs":
        order = static.looped_bfs(n // v, v, m, steps)
    elif name == "interleaved-zb":
        order = static.interleaved_zero_bubble(n // v, v, m, steps)
    elif name == "zb-h1":
        order = static.zb_h1(n, m, steps)
    elif name == "zb-h2":
        order = static.zero_bubble(n, m, steps, memory=2)
    elif name == "zbv":
        order = static.zbv(n // 2, m, steps)
    elif name == "dualpipev":
        order = static.dualpipev(n // 2, m, steps)
    else:
        raise ConfigError(f"schedule={name!r} has no static action list: it is asynchronous")
    return tuple(tuple(acts) for acts in order)


@functools.lru_cache(maxsize=64)
def _flat_order(name: str, n: int, m: int, steps: int, v: int) -> tuple[tuple[tuple[Action, ...], frozenset[int]], ...]:
    return tuple((tuple(acts), firsts) for acts, firsts in map(flatten, _static_order(name, n, m, steps, v)))

def schedule_name(name: object, option: str = "--schedule") -> str:
    """The registry's name of schedule ``name``, matched ignoring case as torch's
    ``get_schedule_class`` does ('PACI' and 'ZBV' are 'paci' and 'zbv').

    Raises:
        ConfigError: an unknown name, with the closest valid one and ``option`` to set.
    """
    if isinstance(name, str) and name.lower() in SCHEDULES:
        return name.lower()
    raise ConfigError(f"schedule={name!r} is unknown{did_you_mean(name, SCHEDULES)}: valid schedules are "
                      f"{', '.join(SCHEDULES)} (set {option})")


def get_schedule(name: str, n_stages: int, steps: int, a: int | None = None, m: int | None = None,
                 v: int | None = None) -> Schedule:
    """Builds a named schedule.

    Args:
        name: one of :data:`SCHEDULES`.
        n_stages: pipeline depth N ≥ 1 (ranks; interleaved 1F1B has N·v stages).
        steps: optimizer steps ≥ 1.
        a: accumulation factor of paci and paci-stashed (backward passes per local update), ≥ 1.
        m: micro-batches per step of gpipe, 1f1b-flush, interleaved-1f1b, looped-bfs,
            interleaved-zb, zb-h1, zb-h2 and pipedream-2bw, ≥ 1 (interleaved-1f1b: a multiple of N;
            interleaved-zb: a multiple of max(1, ⌊m/N⌋), as torch requires).
        v: stages per rank of interleaved-1f1b, looped-bfs and interleaved-zb, ≥ 1 (default 2);
            zbv and dualpipev always hold 2 (V-shaped, :data:`V_SHAPED`) and ignore it.

    Raises:
        ConfigError: unknown name, a value out of range or an invalid combination (the
            message names the option to change).
    """
    name = schedule_name(name)
    check_int("stages", n_stages, 1, "set --stages")
    check_int("steps", steps, 1, "set --steps")
    if name in ("async-1f1b", "pipedream", "pipemare"):
        weights = {"async-1f1b": "current", "pipedream": "stashed", "pipemare": "corrected"}[name]
        return Schedule(name, n_stages, 1, steps, True, backward_weights=weights)
    if name in ("paci", "paci-stashed"):
        check_int("a", a, 1, "set --a")
        return Schedule(name, n_stages, a, steps, True, backward_weights="stashed" if name == "paci-stashed" else "current")
    check_int("m", m, 1, "set --m")
    if name == "pipedream-2bw":
        if m < n_stages - 1:
            raise ConfigError(f"m={m} is invalid for pipedream-2bw with stages={n_stages}: two weight versions need "
                              f"m ≥ N−1 = {n_stages - 1} (set --m)")
        return Schedule(name, n_stages, m, steps, True, backward_weights="stashed")
    if name in VIRTUAL:
        v = 2 if v is None else v
        check_int("v", v, 1, "set --v")
        if name == "interleaved-1f1b" and m % n_stages:
            raise ConfigError(f"m={m} is invalid for interleaved-1f1b: it must be a multiple of stages={n_stages} "
                              "(Megatron's interleaved order; set --m)")
        rounds = static.interleaved_zb_rounds(n_stages, m)
        if name == "interleaved-zb" and m % rounds:
            ok = [x for x in range(m - 1, 0, -1) if x % static.interleaved_zb_rounds(n_stages, x) == 0][:1]
            ok += [x for x in range(m + 1, 2 * m + 2) if x % static.interleaved_zb_rounds(n_stages, x) == 0][:1]
            raise ConfigError(f"m={m} is invalid for interleaved-zb with stages={n_stages}: it must be a multiple of "
                              f"max(1, ⌊m/N⌋) = {rounds} (torch's rounds), e.g. m={ok[0]} or m={ok[1]} (set --m)")
        return Schedule(name, n_stages * v, m, steps, False, virtual=v)
    if name in V_SHAPED:
        if name == "dualpipev" and m < 2 * n_stages:
            raise ConfigError(f"m={m} is invalid for dualpipev with stages={n_stages}: it needs m ≥ 2N = {2 * n_stages} "
                              "micro-batches per step (2 chunks per rank, as torch requires; set --m)")
        return Schedule(name, 2 * n_stages, m, steps, False, virtual=2, placement="v")
    return Schedule(name, n_stages, m, steps, False)
