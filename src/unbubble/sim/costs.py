"""Cost models: how long each action takes on each stage (seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field

from unbubble.errors import ConfigError
from unbubble.schedules.actions import Action, ActionKind


@dataclass(frozen=True)
class UniformCosts:
    """Per-action durations in seconds, optionally per stage.

    Attributes:
        f: forward duration (s), one value or one per stage.
        b: full-backward duration (s).
        u: optimizer-update duration (s).
        latency: send latency of one activation or gradient message (s).
        stage_scale: multiplies every duration of stage s by ``stage_scale[s]`` (non-uniform stages).
    """

    f: float = 1.0
    b: float = 2.0
    u: float = 0.0
    latency: float = 0.0
    stage_scale: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("f", "b", "u", "latency"):
            v = getattr(self, name)
            if not v >= 0:
                raise ConfigError(f"{name}={v!r} is invalid: durations must be ≥ 0 seconds")

    def duration(self, action: Action) -> float:
        """Seconds ``action`` keeps its stage busy."""
        base = {ActionKind.F: self.f, ActionKind.B: self.b, ActionKind.U: self.u}.get(action.kind, self.b / 2)
        if self.stage_scale:
            base *= self.stage_scale[action.stage]
        return base

    def send_latency(self, src: int, dst: int) -> float:
        """Seconds from the end of an action on ``src`` until its output is usable on ``dst``."""
        return self.latency
