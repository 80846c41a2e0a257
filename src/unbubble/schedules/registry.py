"""Named schedules: ``get_schedule("paci", n_stages=4, a=4, steps=100)``."""

from __future__ import annotations

from dataclasses import dataclass

from unbubble.errors import ConfigError
from unbubble.schedules.actions import Action
from unbubble.schedules.policy import ListPolicy, PaciPolicy, Policy
from unbubble.schedules.static import one_f_one_b_flush

#: name -> one line of semantics (shown by ``unbubble schedules``).
SCHEDULES: dict[str, str] = {
    "paci": "async 1F1B, never flushed; U after every a-th local backward; Δ_i ≤ ⌈(N−i)/a⌉; no weight copies",
    "async-1f1b": "naive async 1F1B = paci with a=1; U after every backward; Δ_i ≤ N−i",
    "1f1b-flush": "synchronous 1F1B, flush and U after m micro-batches; Δ=0; bubble (N−1)/(m+N−1)",
}


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule bound to its sizes.

    Attributes:
        name: registry name.
        n_stages: pipeline depth N.
        mb_per_step: micro-batches per optimizer step (a for PACI, m for synchronous ones).
        steps: optimizer steps each stage applies.
        asynchronous: True if a backward may run on newer weights than its forward.
    """

    name: str
    n_stages: int
    mb_per_step: int
    steps: int
    asynchronous: bool

    @property
    def total_mb(self) -> int:
        """Micro-batches processed by the whole run."""
        return self.mb_per_step * self.steps

    @property
    def loss_scale(self) -> float:
        """Factor applied to each micro-batch loss so an update applies the mean gradient."""
        return 1.0 / self.mb_per_step

    def policy(self, stage: int) -> Policy:
        """A fresh policy for ``stage`` (0-based)."""
        if self.asynchronous:
            return PaciPolicy(stage, self.n_stages, self.mb_per_step)
        return ListPolicy(self.static_order()[stage])

    def static_order(self) -> list[list[Action]]:
        """Per-stage action lists of a synchronous schedule."""
        if self.name == "1f1b-flush":
            return one_f_one_b_flush(self.n_stages, self.mb_per_step, self.steps)
        raise ConfigError(f"schedule={self.name!r} has no static action list: it is asynchronous")

    def drift_bound(self, stage: int) -> int:
        """Largest weight-version drift Δ of ``stage`` (0-based): ⌈(N−i)/a⌉ for PACI, 0 if flushed."""
        if not self.asynchronous:
            return 0
        a = self.mb_per_step
        return -(-(self.n_stages - 1 - stage) // a)


def get_schedule(name: str, n_stages: int, steps: int, a: int | None = None, m: int | None = None) -> Schedule:
    """Builds a named schedule.

    Args:
        name: one of :data:`SCHEDULES`.
        n_stages: pipeline depth N ≥ 1.
        steps: optimizer steps ≥ 1.
        a: PACI accumulation factor (backward passes per local update), ≥ 1.
        m: micro-batches per step of synchronous schedules, ≥ 1.

    Raises:
        ConfigError: unknown name or a value out of range (the message names the option).
    """
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r} is unknown: valid schedules are {', '.join(SCHEDULES)} (set --schedule)")
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ConfigError(f"stages={n_stages!r} is invalid: must be an integer ≥ 1 (set --stages)")
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} is invalid: must be an integer ≥ 1 (set --steps)")
    if name in ("paci", "async-1f1b"):
        a = 1 if name == "async-1f1b" else a
        if not isinstance(a, int) or a < 1:
            raise ConfigError(f"a={a!r} is invalid: the accumulation factor must be an integer ≥ 1 (set --a)")
        return Schedule("paci" if name == "paci" else name, n_stages, a, steps, asynchronous=True)
    if not isinstance(m, int) or m < 1:
        raise ConfigError(f"m={m!r} is invalid: micro-batches per step must be an integer ≥ 1 (set --m)")
    return Schedule(name, n_stages, m, steps, asynchronous=False)
