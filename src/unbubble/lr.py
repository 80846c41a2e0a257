"""Learning-rate schedules as pure functions of the local update count."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate after ``step`` updates.

    Linear warm-up over ``warmup`` updates, then cosine decay to ``min_ratio`` at ``total``
    (PACI paper's recipe: 1 % warm-up, cosine to 10 %; arXiv 2606.07881 §5).
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
