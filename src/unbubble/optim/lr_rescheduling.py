"""Delay-aware learning-rate rescheduling: PipeMare's T1, PipeDream-LR built from it, and
staleness-aware scaling.

Notes: docs/architecture.md#optimlr_reschedulingpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unbubble.errors import check_int


def pipemare_t1_factor(delay: int, step: int, anneal_steps: int) -> float:
    """PipeMare T1 multiplier tau^(-p) with p = 1 - min((step + 1) / K, 1).

    Args:
        delay: tau_s, the stage's staleness in updates (≥ 0); 0 and 1 give 1.0 at every step.
        step: updates already applied (0-based, ``LambdaLR``'s argument); the factor is for
            update number ``step + 1``.
        anneal_steps: K ≥ 1, updates over which the exponent goes from 1 to 0.

    Returns:
        The multiplier in (0, 1]: 1/tau at the start (up to 1/K in the exponent), 1.0 from
        update K on.

    Raises:
        ConfigError: a negative delay or step, or K < 1.

    Source: PipeMare, arXiv 1910.05124, Technique 1.
    """
    check_int("delay", delay, 0, "the stage's staleness tau_s, in updates")
    check_int("step", step, 0, "updates already applied")
    check_int("anneal_steps", anneal_steps, 1, "set the T1 annealing length K")
    if delay <= 1:
        return 1.0
    power = 1.0 - min((step + 1) / anneal_steps, 1.0)
    return float(delay) ** (-power)


@dataclass(frozen=True)
class PipeDreamLR:
    """``LambdaLR`` multiplier ``base(step) * pipemare_t1_factor(delay, step, anneal_steps)``.

    Picklable when ``base`` is (a module-level function or a ``functools.partial`` of one), so it
    can travel to stage processes. Build one per stage with that stage's delay.

    Attributes:
        delay: tau_s of this stage (PipeDream: N - 1 - s, 0-based s).
        anneal_steps: K, updates over which the rescaling fades out (the released code uses
            ``lr_correction_epoch`` epochs' worth).
        base: the schedule it multiplies (e.g. ``functools.partial(warmup_cosine, total=...,
            warmup=..., min_ratio=...)``); None is the constant 1.

    Source: Basis Rotation, arXiv 2602.03515, PipeDream-LR baseline; PipeMare, arXiv 1910.05124, T1.
    """

    delay: int
    anneal_steps: int
    base: Callable[[int], float] | None = None

    def __post_init__(self) -> None:
        check_int("delay", self.delay, 0, "the stage's staleness tau_s, in updates")
        check_int("anneal_steps", self.anneal_steps, 1, "set the T1 annealing length K")

    def __call__(self, step: int) -> float:
        """The multiplier of the base learning rate for update ``step + 1``."""
        base = 1.0 if self.base is None else self.base(step)
        return base * pipemare_t1_factor(self.delay, step, self.anneal_steps)


@dataclass(frozen=True)
class StalenessLR:
    """``LambdaLR`` multiplier ``base(step) / (1 + delay)``: a stage whose gradients are τ_s
    updates stale takes steps 1/(1 + τ_s) as large for the whole run (no annealing, unlike
    :class:`PipeDreamLR`); the last stage (τ = 0) keeps the full schedule.

    Source: W. Zhang et al., "Staleness-aware Async-SGD for Distributed Deep Learning",
    arXiv 1511.05950 (IJCAI 2016), §3 (lr divided by the gradient's staleness); here per pipeline
    stage with τ_s = ⌈(N−1−s)/a⌉ under PACI.
    """

    delay: int
    base: Callable[[int], float] | None = None

    def __post_init__(self) -> None:
        check_int("delay", self.delay, 0, "the stage's staleness tau_s, in updates")

    def __call__(self, step: int) -> float:
        """The multiplier of the base learning rate for update ``step + 1``."""
        return (1.0 if self.base is None else self.base(step)) / (1 + self.delay)
