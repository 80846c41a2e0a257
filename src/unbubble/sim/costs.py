"""Cost models: how long each action takes on each stage, and how long a message travels (seconds).

Every cost model answers the engine's ``CostModel`` protocol: ``duration(action)`` and
``send_latency(src, dst)``, in seconds; the two built here also expose a per-stage table so the engine
looks durations up without building objects. Their jitter and stragglers:
[Note: common random numbers] in docs/architecture.md#simcostspy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from unbubble.errors import ConfigError, check_int
from unbubble.schedules.actions import Action, ActionKind

if TYPE_CHECKING:  # numpy is imported where it is used (cost models need it only for jitter)
    import numpy as np

#: Engine-internal index of each action kind (F, B, I, W, U), used by the duration tables.
KIND_INDEX: dict[ActionKind, int] = {ActionKind.F: 0, ActionKind.B: 1, ActionKind.I: 2, ActionKind.W: 3, ActionKind.U: 4}
KINDS: tuple[ActionKind, ...] = tuple(KIND_INDEX)

#: ``noise(stage, kind_index, start_s) -> duration_s`` for one run (stateful: it counts draws).
Noise = Callable[[int, int, float], float]


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ConfigError(f"{name}={value!r} is invalid: must be a finite number ≥ 0 (seconds)")


def _check_overlap(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"overlap={value!r} is invalid: the share of a compound action's shorter part hidden "
                          "under the longer must be in [0, 1] (0: sequential, 1: fully overlapped)")


@dataclass(frozen=True)
class UniformCosts:
    """Per-action durations in seconds, the same on every stage unless scaled.

    Attributes:
        f: forward duration (s).
        b: full-backward duration (s).
        u: optimizer-update duration (s).
        latency: send latency of one activation or gradient message (s).
        stage_scale: multiplies every duration of stage s by ``stage_scale[s]`` (non-uniform stages).
        i: input-gradient duration (s); default ``b / 2``.
        w: weight-gradient duration (s); default ``b / 2``.
        overlap: φ of compound actions (DualPipeV's overlapped F and B): the pair takes
            d₁ + d₂ − φ·min(d₁, d₂); 0 (default) runs them one after the other, as on a CPU; 1 hides
            the shorter under the longer (separate streams, communication fully overlapped).
    """

    f: float = 1.0
    b: float = 2.0
    u: float = 0.0
    latency: float = 0.0
    stage_scale: tuple[float, ...] = field(default=())
    i: float | None = None
    w: float | None = None
    overlap: float = 0.0

    def __post_init__(self) -> None:
        _check_overlap(self.overlap)
        for name in ("f", "b", "u", "latency"):
            _check_nonneg(name, getattr(self, name))
        for name in ("i", "w"):
            if getattr(self, name) is not None:
                _check_nonneg(name, getattr(self, name))
        for s, x in enumerate(self.stage_scale):
            _check_nonneg(f"stage_scale[{s}]", x)

    def _base(self) -> list[float]:
        half = self.b / 2
        return [self.f, self.b, half if self.i is None else self.i, half if self.w is None else self.w, self.u]

    def duration(self, action: Action) -> float:
        """Seconds ``action`` keeps its stage busy."""
        base = self._base()[KIND_INDEX[action.kind]]
        if self.stage_scale:
            base *= self.stage_scale[action.stage]
        return base

    def send_latency(self, src: int, dst: int) -> float:
        """Seconds from the end of an action on ``src`` until its output is usable on ``dst``."""
        return self.latency

    def table(self, n_stages: int) -> list[list[float]]:
        """``table[stage][KIND_INDEX[kind]]`` = ``duration`` of that kind on that stage (s).

        Raises:
            ConfigError: ``stage_scale`` is given but has fewer than ``n_stages`` entries.
        """
        if self.stage_scale and len(self.stage_scale) < n_stages:
            raise ConfigError(f"stage_scale has {len(self.stage_scale)} entries but the pipeline has "
                              f"{n_stages} stages: give one factor per stage")
        base = self._base()
        return [[d * (self.stage_scale[s] if self.stage_scale else 1.0) for d in base] for s in range(n_stages)]

    def noise(self, n_stages: int) -> Noise | None:
        """Uniform costs are deterministic."""
        return None


@dataclass(frozen=True)
class StageCosts:
    """Durations of one stage's actions, seconds.

    Attributes:
        f_s: forward of one micro-batch.
        b_s: full backward (input and weight gradients).
        i_s: input-gradient-only backward (the Zero Bubble paper's "B").
        w_s: weight-gradient-only backward (the Zero Bubble paper's "W").
        u_s: local optimizer update.
    """

    f_s: float
    b_s: float
    i_s: float
    w_s: float
    u_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f_s", "b_s", "i_s", "w_s", "u_s"):
            _check_nonneg(name, getattr(self, name))

    def as_list(self) -> list[float]:
        """``[f_s, b_s, i_s, w_s, u_s]`` in :data:`KIND_INDEX` order."""
        return [self.f_s, self.b_s, self.i_s, self.w_s, self.u_s]

    @classmethod
    def from_fb(cls, f_s: float, b_s: float, u_s: float = 0.0) -> "StageCosts":
        """A stage with only F and B known: I and W get half of B each."""
        return cls(f_s, b_s, b_s / 2, b_s / 2, u_s)


@dataclass(frozen=True)
class Straggler:
    """A stage that runs slower for a while (thermal throttling, a noisy neighbour, a GC pause).

    Attributes:
        stage: 0-based stage index.
        slowdown: duration multiplier (> 0; 2.0 = twice as slow).
        start_s, end_s: actions starting in ``[start_s, end_s)`` are slowed (seconds of simulated time).
    """

    stage: int
    slowdown: float
    start_s: float = 0.0
    end_s: float = math.inf

    def __post_init__(self) -> None:
        check_int("straggler stage", self.stage, 0)
        if not self.slowdown > 0 or math.isinf(self.slowdown):
            raise ConfigError(f"straggler slowdown={self.slowdown!r} is invalid: must be a finite number > 0")
        if not self.end_s > self.start_s:
            raise ConfigError(f"straggler window [{self.start_s}, {self.end_s}) is empty: end_s must exceed start_s")

    @classmethod
    def parse(cls, text: str) -> "Straggler":
        """Parses ``STAGE:SLOWDOWN[:START_S[:END_S]]``, e.g. ``"3:2.0"`` or ``"0:1.5:10:20"``.

        Raises:
            ConfigError: the text is not of that form.
        """
        parts = text.split(":")
        try:
            if not 2 <= len(parts) <= 4:
                raise ValueError
            stage, slow = int(parts[0]), float(parts[1])
            start = float(parts[2]) if len(parts) > 2 else 0.0
            end = float(parts[3]) if len(parts) > 3 else math.inf
        except ValueError:
            raise ConfigError(f"straggler={text!r} is invalid: expected STAGE:SLOWDOWN[:START_S[:END_S]], "
                              "e.g. 3:2.0 (set --straggler)") from None
        return cls(stage, slow, start, end)


@dataclass(frozen=True)
class PipelineCosts:
    """Per-stage durations, communication and noise of one pipeline (seconds, bytes).

    A message (an activation after F, a gradient after B or I) crossing the boundary between stages
    s and s + 1 arrives ``latency_s + message_bytes[s] / bandwidth_bytes_per_s[s]`` seconds after the
    action that produced it ends; sends overlap with compute and links have no contention.

    Attributes:
        stages: one :class:`StageCosts` per stage (N entries).
        message_bytes: bytes of one activation (= one gradient) crossing boundary s → s + 1
            (N − 1 entries, or one number for every boundary).
        bandwidth_bytes_per_s: per boundary (N − 1 entries) or one number; ``inf`` = free.
        latency_s: per boundary (N − 1 entries) or one number.
        jitter: σ of a mean-one log-normal factor multiplying every duration (0 = none); see
            [Note: common random numbers].
        seed: seed of the jitter streams.
        stragglers: slow windows of single stages.
        overlap: φ of compound actions, as :class:`UniformCosts`'s.
    """

    stages: tuple[StageCosts, ...]
    message_bytes: float | tuple[float, ...] = 0.0
    bandwidth_bytes_per_s: float | tuple[float, ...] = math.inf
    latency_s: float | tuple[float, ...] = 0.0
    jitter: float = 0.0
    seed: int = 0
    stragglers: tuple[Straggler, ...] = ()
    overlap: float = 0.0

    def __post_init__(self) -> None:
        _check_overlap(self.overlap)
        n = len(self.stages)
        if n < 1:
            raise ConfigError("stages=() is invalid: a pipeline needs at least one StageCosts")
        for name in ("message_bytes", "bandwidth_bytes_per_s", "latency_s"):
            v = getattr(self, name)
            vals = v if isinstance(v, tuple) else (v,)
            if isinstance(v, tuple) and len(v) != n - 1:
                raise ConfigError(f"{name} has {len(v)} entries but {n} stages have {n - 1} boundaries")
            for x in vals:
                if not (isinstance(x, (int, float)) and x >= 0) or (name != "bandwidth_bytes_per_s" and math.isinf(x)):
                    raise ConfigError(f"{name}={x!r} is invalid: must be ≥ 0"
                                      + ("" if name == "bandwidth_bytes_per_s" else " and finite"))
        if isinstance(self.bandwidth_bytes_per_s, (int, float)) and self.bandwidth_bytes_per_s == 0:
            raise ConfigError("bandwidth_bytes_per_s=0 is invalid: must be > 0 (inf = free links)")
        if not (isinstance(self.jitter, (int, float)) and 0 <= self.jitter < 5):
            raise ConfigError(f"jitter={self.jitter!r} is invalid: the log-normal σ must be in [0, 5) (set --jitter)")
        check_int("seed", self.seed, None, "set --seed")
        for st in self.stragglers:
            if st.stage >= n:
                raise ConfigError(f"straggler stage={st.stage} is invalid: the pipeline has stages 0..{n - 1}")

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def _per_boundary(self, name: str, boundary: int) -> float:
        v = getattr(self, name)
        return v[boundary] if isinstance(v, tuple) else v

    def duration(self, action: Action) -> float:
        """Mean seconds ``action`` keeps its stage busy (jitter and stragglers are applied by the engine)."""
        return self.stages[action.stage].as_list()[KIND_INDEX[action.kind]]

    def send_latency(self, src: int, dst: int) -> float:
        """Seconds from the end of an action on ``src`` until its message is usable on ``dst``."""
        if src == dst:
            return 0.0
        b = min(src, dst)
        bw = self._per_boundary("bandwidth_bytes_per_s", b)
        size = self._per_boundary("message_bytes", b)
        return self._per_boundary("latency_s", b) + (0.0 if math.isinf(bw) else size / bw)

    def table(self, n_stages: int) -> list[list[float]]:
        """``table[stage][KIND_INDEX[kind]]`` = mean duration (s).

        Raises:
            ConfigError: the cost model describes a different number of stages.
        """
        if n_stages != self.n_stages:
            raise ConfigError(f"the cost model describes {self.n_stages} stages but the schedule has {n_stages}: "
                              "build the costs for the same --stages")
        return [s.as_list() for s in self.stages]

    def noise(self, n_stages: int) -> Noise | None:
        """A fresh duration sampler for one run, or ``None`` when durations are deterministic."""
        if self.jitter == 0 and not self.stragglers:
            return None
        return _Sampler(self.table(n_stages), self.jitter, self.seed, self.stragglers)

    def with_recompute(self) -> "PipelineCosts":
        """The same pipeline under full activation recomputation: every backward first re-runs its
        micro-batch's forward, so B and I (which starts a split backward) each take one more F;
        W reuses what I recomputed. Cost: one extra forward per micro-batch per stage, e.g.
        (F + B) → (2F + B) ≈ 4/3 of the compute with B = 2F."""
        return dataclasses.replace(self, stages=tuple(
            StageCosts(s.f_s, s.b_s + s.f_s, s.i_s + s.f_s, s.w_s, s.u_s) for s in self.stages))

    def scaled(self, factor: float) -> "PipelineCosts":
        """The same pipeline with every compute duration multiplied by ``factor``."""
        return PipelineCosts(
            tuple(StageCosts(*(x * factor for x in s.as_list())) for s in self.stages),
            self.message_bytes, self.bandwidth_bytes_per_s, self.latency_s, self.jitter, self.seed, self.stragglers)


class _Sampler:
    """Durations with jitter and stragglers for one run; see [Note: common random numbers].

    Stream (stage s, kind k) is ``numpy.random.default_rng(SeedSequence([seed, s, k]))``, drawn in chunks.
    """

    _CHUNK = 1024

    def __init__(self, table: list[list[float]], jitter: float, seed: int, stragglers: tuple[Straggler, ...]):
        import numpy as np

        self.table, self.sigma = table, jitter
        n = len(table)
        self.pool: list[list[list[float]]] = [[[] for _ in range(5)] for _ in range(n)]
        self.used = [[0] * 5 for _ in range(n)]
        self.rngs = [[np.random.default_rng(np.random.SeedSequence([seed, s, k])) for k in range(5)]
                     for s in range(n)]
        self.stragglers = stragglers
        self.slow: list[list[Straggler]] = [[] for _ in range(n)]
        for st in stragglers:
            self.slow[st.stage].append(st)

    def __call__(self, stage: int, kind: int, start_s: float) -> float:
        d = self.table[stage][kind]
        if self.sigma:
            used = self.used[stage]
            i = used[kind]
            pool = self.pool[stage][kind]
            if i >= len(pool):
                sig = self.sigma  # mean-one log-normal: exp(N(−σ²/2, σ²))
                pool.extend(self.rngs[stage][kind].lognormal(-0.5 * sig * sig, sig, self._CHUNK).tolist())
            used[kind] = i + 1
            d *= pool[i]
        if self.slow[stage]:
            for st in self.slow[stage]:
                if st.start_s <= start_s < st.end_s:
                    d *= st.slowdown
        return d

    def draws(self, counts) -> tuple["np.ndarray", "np.ndarray"]:
        """The first ``counts[s][k]`` jitter factors of every stream (s, k), as ``__call__`` would
        return them one by one (drawn in the same chunks, so bit for bit equal), for engines that
        look factors up by index ([Note: compiled engine] in docs/architecture.md).

        Args:
            counts: ``(n_stages, 5)`` draws per stream (kind indices as in :data:`KIND_INDEX`).

        Returns:
            ``(factors, offsets)``: stream (s, k) is ``factors[offsets[5s + k] : offsets[5s + k + 1]]``.

        Raises:
            RuntimeError: this sampler has already been called (its streams are not at the start).
        """
        import numpy as np

        if any(any(u) for u in self.used):
            raise RuntimeError("draws() needs a fresh sampler: this one has already drawn factors")
        sig, chunk = self.sigma, self._CHUNK
        parts, off = [], [0]
        for s, row in enumerate(counts):
            for k in range(5):
                c = int(row[k])
                for _ in range(-(-c // chunk)):
                    parts.append(self.rngs[s][k].lognormal(-0.5 * sig * sig, sig, chunk))
                off.append(off[-1] + -(-c // chunk) * chunk)
        factors = np.concatenate(parts) if parts else np.zeros(1)
        return factors, np.asarray(off, np.int64)
