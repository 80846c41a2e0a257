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


def iso_loss_overhead(curve: Curve, target: float, baseline_tokens: float) -> tuple[float, bool]:
    """Iso-loss token overhead: tokens a method needs to reach ``target`` (the loss the
    synchronous baseline reaches at the end of its run) ÷ the baseline's tokens.

    Args:
        curve: the method's ``(tokens, loss)`` points (validation loss, mean over seeds).
        target: the baseline's final loss.
        baseline_tokens: tokens the baseline trained on (> 0).

    Returns:
        ``(ratio, reached)``; when the method never reaches the target, the ratio is a lower
        bound, its last tokens ÷ the baseline's (reported as "> ratio"). 1.0 means parity;
        below 1, the method is ahead.

    Raises:
        ValueError: an empty curve or baseline_tokens ≤ 0.

    Source: docs/architecture.md#comparing-convergence (iso-loss token overhead as used in delayed-gradient studies).
    """
    if not curve or baseline_tokens <= 0:
        raise ValueError("iso_loss_overhead needs a non-empty curve and baseline_tokens > 0")
    t = time_to_target(curve, target)
    if t is None:
        return curve[-1][0] / baseline_tokens, False
    return t / baseline_tokens, True


def mean_curve(curves: Sequence[Curve]) -> list[tuple[float, float]]:
    """Pointwise mean of curves sampled at the same x (seeds of one configuration); points
    where any curve has no finite value are dropped.

    Raises:
        ValueError: no curves, or curves sampled at different x.
    """
    if not curves:
        raise ValueError("mean_curve of no curves")
    xs = [x for x, _ in curves[0]]
    if any([x for x, _ in c] != xs for c in curves):
        raise ValueError("mean_curve needs curves sampled at the same x")
    out = []
    for i, x in enumerate(xs):
        ys = [c[i][1] for c in curves]
        if all(y is not None and math.isfinite(y) for y in ys):
            out.append((x, sum(ys) / len(ys)))
    return out


def loss_at(curve: Curve, x: float) -> float | None:
    """The curve's loss at ``x``, linearly interpolated (None outside its range)."""
    prev = None
    for cx, cy in curve:
        if cx == x:
            return cy
        if cx > x:
            if prev is None:
                return None
            (px, py) = prev
            return py + (cy - py) * (x - px) / (cx - px)
        prev = (cx, cy)
    return None


def budget_overhead(points: dict[float, float], target: float) -> tuple[float, str]:
    """Token budget (a multiple of the method's tokens) at which a method's *final* loss meets
    ``target``, interpolated linearly in log budget between the two budgets that bracket it
    (docs/architecture.md#comparing-convergence: each budget is its own full warm-up + cosine run).

    Args:
        points: final loss per budget trained (1.0 = the method's own run; inf = diverged).
        target: the baseline's final loss.

    Returns:
        ``(budget, relation)``: ``"="`` interpolated between two budgets; ``"≤"`` the smallest
        budget trained already reaches the target; ``">"`` none reaches it (``budget`` is the largest).

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("budget_overhead needs at least one budget")
    pts = sorted(points.items())
    if pts[0][1] <= target:
        return pts[0][0], "≤"
    for (b0, l0), (b1, l1) in zip(pts, pts[1:]):
        if l1 <= target < l0:
            if not math.isfinite(l0):
                return b1, "≤"
            return b0 * math.exp((l0 - target) / (l0 - l1) * math.log(b1 / b0)), "="
    return pts[-1][0], ">"
