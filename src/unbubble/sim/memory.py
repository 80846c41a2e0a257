"""Peak memory per device, counted from a trace: weights, gradients, optimizer state, activations, stash.

Only the per-micro-batch and per-parameter sizes are inputs (:class:`MemorySpec`); how many micro-batches
hold activations and how many weight versions are alive at each instant is read off the trace, so a
schedule's memory is whatever its actions imply. The accounting rules:
docs/architecture.md#simmemorypy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from unbubble.errors import ConfigError
from unbubble.sim.engine import Trace

_F, _B, _I, _W, _U = range(5)


@dataclass(frozen=True)
class MemorySpec:
    """Sizes in bytes, one entry per stage (N·v for interleaved schedules).

    Attributes:
        weights_bytes: the stage's parameters as used for compute (e.g. BF16).
        grads_bytes: its gradient accumulation buffers.
        optimizer_bytes: optimizer state (e.g. FP32 master weights and Adam moments).
        act_bytes: activations one micro-batch keeps from F until its backward (M_B).
        act_w_bytes: part of ``act_bytes`` kept from I until W when the backward is split (M_W).
        version_bytes: one stashed weight version (default: ``weights_bytes``).
        extra_bytes: other per-stage buffers always present (e.g. PipeMare's velocity).
        recomputed_bytes: with full recomputation, the activations a recomputed forward saves for
            the backward of one micro-batch (without the input, which ``act_bytes`` holds); empty =
            no recomputation.
        capacity_bytes: device memory, to flag configurations that do not fit (``None``: unknown).
    """

    weights_bytes: tuple[float, ...]
    grads_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    act_bytes: tuple[float, ...]
    act_w_bytes: tuple[float, ...] = ()
    version_bytes: tuple[float, ...] = ()
    extra_bytes: tuple[float, ...] = ()
    capacity_bytes: float | None = None
    recomputed_bytes: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.weights_bytes)
        for name in ("grads_bytes", "optimizer_bytes", "act_bytes", "act_w_bytes", "version_bytes", "extra_bytes",
                     "recomputed_bytes"):
            v = getattr(self, name)
            if v and len(v) != n:
                raise ConfigError(f"{name} has {len(v)} entries but weights_bytes has {n}: give one per stage")
            if any(not x >= 0 for x in v):
                raise ConfigError(f"{name}={v!r} is invalid: sizes must be ≥ 0 bytes")
        for k, (b, w) in enumerate(zip(self.act_bytes, self.act_w_bytes)):
            if w > b:
                raise ConfigError(f"act_w_bytes[{k}]={w} exceeds act_bytes[{k}]={b}: W keeps part of B's activations")

    @property
    def n_stages(self) -> int:
        return len(self.weights_bytes)

    def version(self, s: int) -> float:
        return self.version_bytes[s] if self.version_bytes else self.weights_bytes[s]

    def act_w(self, s: int) -> float:
        return self.act_w_bytes[s] if self.act_w_bytes else 0.0

    def extra(self, s: int) -> float:
        return self.extra_bytes[s] if self.extra_bytes else 0.0

    @property
    def recompute(self) -> bool:
        return bool(self.recomputed_bytes)

    def with_recompute(self, input_bytes: tuple[float, ...]) -> "MemorySpec":
        """The same stages under full recomputation: each micro-batch keeps only ``input_bytes[s]``
        (its stage's input) from F to its backward, and the backward re-creates the rest of
        ``act_bytes[s]`` (``act_bytes − input_bytes``).

        Raises:
            ConfigError: a wrong count, an input larger than the activations, or a spec that
                already recomputes.
        """
        if self.recompute:
            raise ConfigError("this memory spec already recomputes: apply with_recompute once")
        if len(input_bytes) != self.n_stages:
            raise ConfigError(f"input_bytes has {len(input_bytes)} entries but the spec has {self.n_stages} stages")
        for s, (x, a) in enumerate(zip(input_bytes, self.act_bytes)):
            if not 0 <= x <= a:
                raise ConfigError(f"input_bytes[{s}]={x} is invalid: must be in [0, act_bytes[{s}]={a}]")
        return dataclasses.replace(self, act_bytes=tuple(input_bytes), act_w_bytes=(),
                                   recomputed_bytes=tuple(a - x for a, x in zip(self.act_bytes, input_bytes)))

    @classmethod
    def uniform(cls, n_stages: int, *, weights: float = 0.0, grads: float = 0.0, optimizer: float = 0.0,
                act: float = 1.0, act_w: float = 0.0, version: float | None = None) -> "MemorySpec":
        """The same sizes on every stage (bytes); handy for unit costs and tests."""
        n = n_stages
        return cls((weights,) * n, (grads,) * n, (optimizer,) * n, (act,) * n, (act_w,) * n,
                   () if version is None else (version,) * n)


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one device (bytes).

    Attributes:
        rank: 0-based device index.
        weights, grads, optimizer, extra: static parts.
        activations: peak bytes of activations held.
        stash: peak bytes of stashed weight versions.
        peak: peak of static + activations + stash over time.
        peak_in_flight: most micro-batches holding activations at once (summed over the rank's stages).
        peak_versions: most weight versions alive at once on one stage (1 = no stash).
        fits: ``peak <= capacity`` (``None`` when the capacity is unknown).
    """

    rank: int
    weights: float
    grads: float
    optimizer: float
    extra: float
    activations: float
    stash: float
    peak: float
    peak_in_flight: int
    peak_versions: int
    fits: bool | None = field(default=None)

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer + self.extra


def peak_memory(trace: Trace, spec: MemorySpec, *, stashed: bool = False) -> list[RankMemory]:
    """Peak memory per rank, from the actions in ``trace`` (see the module docstring for the rules).

    Args:
        trace: a simulated or measured run.
        spec: per-stage sizes (bytes); as many stages as the trace.
        stashed: backwards use their forward's weights (PipeDream, PipeDream-2BW), so every
            version still needed by an in-flight micro-batch is kept.

    Returns:
        One :class:`RankMemory` per rank (device).

    Raises:
        ConfigError: ``spec`` describes another number of stages.
    """
    n, nr = trace.n_stages, trace.ranks
    if spec.n_stages != n:
        raise ConfigError(f"the memory spec describes {spec.n_stages} stages but the trace has {n}")
    # Actions of one rank never overlap, so walking them in start order visits that rank's
    # allocations (at F's start) and frees (at a backward's end) in time order, frees first on ties.
    on = [trace.stages_of(r) for r in range(nr)]
    rank_of = [trace.rank_of(s) for s in range(n)]
    weights = [sum(spec.weights_bytes[s] for s in on[r]) for r in range(nr)]
    grads = [sum(spec.grads_bytes[s] for s in on[r]) for r in range(nr)]
    optim = [sum(spec.optimizer_bytes[s] for s in on[r]) for r in range(nr)]
    extra = [sum(spec.extra(s) for s in on[r]) for r in range(nr)]
    base = [weights[r] + grads[r] + optim[r] + extra[r] for r in range(nr)]
    act_b = list(spec.act_bytes)
    act_w = [spec.act_w(s) for s in range(n)]
    recompute = spec.recompute
    rec = list(spec.recomputed_bytes) if recompute else [0.0] * n
    act = [0.0] * nr
    act_peak = [0.0] * nr
    stash = [0.0] * nr
    stash_peak = [0.0] * nr
    peak = list(base)
    q = [0] * nr
    q_peak = [0] * nr
    versions_peak = [1] * nr
    cols = trace.columns()
    if cols is not None and not stashed:
        return _peak_from_columns(cols, spec, rank_of, base, (weights, grads, optim, extra), act_b, act_w, rec,
                                  recompute)
    current = [0] * n
    live: list[dict[int, int]] = [{} for _ in range(n)]  # stage -> {v_F: micro-batches still needing it}
    extra_versions = [0] * n
    fwd_v: dict[tuple[int, int], int] = {}
    for s, k, mb, _, _, ver, _ in trace.rows():
        r = rank_of[s]
        if k == _F:
            act[r] += act_b[s]
            q[r] += 1
        elif k == _B:
            if recompute:  # the recomputed activations are alive during the backward
                act_peak[r] = max(act_peak[r], act[r] + rec[s])
                peak[r] = max(peak[r], base[r] + act[r] + rec[s] + stash[r])
            act[r] -= act_b[s]
            q[r] -= 1
        elif k == _I:
            if recompute:  # recomputed at I, kept (with the input) until W
                act[r] += rec[s]
            else:
                act[r] -= act_b[s] - act_w[s]
        elif k == _W:
            act[r] -= act_b[s] + rec[s] if recompute else act_w[s]
            q[r] -= 1
        if stashed:
            lv = live[s]
            if k == _F:
                fwd_v[(s, mb)] = ver
                lv[ver] = lv.get(ver, 0) + 1
            elif k == _U:
                current[s] += 1
            elif k == _B or k == _W:
                v = fwd_v.pop((s, mb))
                lv[v] -= 1
                if not lv[v]:
                    del lv[v]
            x = len(lv) - (current[s] in lv)  # versions besides the current one
            if x != extra_versions[s]:
                stash[r] += (x - extra_versions[s]) * spec.version(s)
                extra_versions[s] = x
                if x + 1 > versions_peak[r]:
                    versions_peak[r] = x + 1
            if stash[r] > stash_peak[r]:
                stash_peak[r] = stash[r]
        if act[r] > act_peak[r]:
            act_peak[r] = act[r]
        if q[r] > q_peak[r]:
            q_peak[r] = q[r]
        total = base[r] + act[r] + stash[r]
        if total > peak[r]:
            peak[r] = total
    out = [RankMemory(r, weights[r], grads[r], optim[r], extra[r], act_peak[r], stash_peak[r], peak[r], q_peak[r],
                      versions_peak[r], None if spec.capacity_bytes is None else peak[r] <= spec.capacity_bytes)
           for r in range(nr)]
    return out


def _peak_from_columns(cols, spec: MemorySpec, rank_of: list[int], base, static, act_b, act_w, rec, recompute) -> list[RankMemory]:
    """``peak_memory`` without stashing, on a trace's numpy columns: the same additions in the same
    order (a running sum per rank is ``cumsum`` of its rows' changes, which adds sequentially), so
    the same floats."""
    s, k = cols[0], cols[1]
    ab, aw, rc = np.asarray(act_b, np.float64)[s], np.asarray(act_w, np.float64)[s], np.asarray(rec, np.float64)[s]
    isb = k == _B
    delta = np.zeros(len(s))
    delta[k == _F] = ab[k == _F]
    delta[isb] = -ab[isb]
    isi, isw = k == _I, k == _W
    delta[isi] = rc[isi] if recompute else -(ab[isi] - aw[isi])
    delta[isw] = -(ab[isw] + rc[isw]) if recompute else -aw[isw]
    dq = (k == _F).astype(np.int64) - isb - isw
    rank = np.asarray(rank_of, np.int64)[s]
    nr = max(rank_of) + 1
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(nr + 1))
    out = []
    for r in range(nr):
        rows = order[bounds[r]:bounds[r + 1]]
        act = np.cumsum(delta[rows])
        act_peak, peak, q_peak = 0.0, base[r], 0
        if len(rows):
            act_peak = max(act_peak, float(act.max()))
            peak = max(peak, float((base[r] + act).max()))
            q_peak = max(q_peak, int(np.cumsum(dq[rows]).max()))
            b = isb[rows]
            if recompute and b.any():  # the recomputed activations are alive during the backward
                prev, extra_b = np.concatenate(([0.0], act[:-1]))[b], rc[rows][b]  # act before each B
                act_peak = max(act_peak, float((prev + extra_b).max()))
                peak = max(peak, float((base[r] + prev + extra_b).max()))
        w, g, o, e = (x[r] for x in static)
        out.append(RankMemory(r, w, g, o, e, act_peak, 0.0, peak, q_peak, 1,
                              None if spec.capacity_bytes is None else peak <= spec.capacity_bytes))
    return out
