"""Statistics the experiments report, as pure functions of loss curves (no torch).

A curve is a sequence of ``(x, loss)`` points with increasing x (optimizer steps, tokens or
seconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Curve = Sequence[tuple[float, float]]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1 in the denominator; 0 for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_std of no values")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def rms_std(runs: Sequence[Sequence[float]]) -> float:
    """Run-to-run RMS standard deviation of training-loss curves sampled at the same steps:
    sqrt(mean over steps of the across-run sample variance) (PACI paper, Q1).

    Raises:
        ValueError: fewer than two runs or curves of different lengths.
    """
    if len(runs) < 2:
        raise ValueError("rms_std needs at least two runs")
    length = len(runs[0])
    if any(len(r) != length for r in runs) or length == 0:
        raise ValueError("rms_std needs curves of one, non-zero length")
    variances = [mean_std([r[t] for r in runs])[1] ** 2 for t in range(length)]
    return math.sqrt(sum(variances) / length)


def time_to_target(curve: Curve, target: float) -> float | None:
    """First x at which the curve reaches ``loss ≤ target``, linearly interpolated between the
    two points that bracket the crossing; ``None`` if it never does."""
    prev = None
    for x, y in curve:
        if y <= target:
            if prev is None or prev[1] == y:
                return float(x)
            (x0, y0) = prev
            return x0 + (y0 - target) / (y0 - y) * (x - x0)
        prev = (x, y)
    return None


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_at_fraction(losses: Sequence[float], fraction: float, window: int) -> float:
    """The trailing ``window``-point moving average of a per-step loss curve at step
    ⌈fraction · len⌉ (1-based): e.g. the target loss "what the reference run has at half its run".

    Raises:
        ValueError: no losses, or ``fraction`` outside (0, 1].
    """
    if not losses or not 0 < fraction <= 1:
        raise ValueError(f"loss_at_fraction needs losses and 0 < fraction ≤ 1 (got {len(losses)} losses, {fraction})")
    return smooth(losses, window)[max(math.ceil(fraction * len(losses)), 1) - 1]


def slowdown(steps_to_target: dict[int, float | None], base: int = 1) -> dict[int, float | None]:
    """Steps to target at each pipeline depth P divided by the steps at P = ``base``
    (Basis Rotation's slowdown; ``None`` where the target was not reached)."""
    ref = steps_to_target.get(base)
    return {p: (None if s is None or not ref else s / ref) for p, s in steps_to_target.items()}
