"""PipeMare's two techniques as pure functions (no torch).

Source: Yang et al., PipeMare: Asynchronous Pipeline Parallel DNN Training, arXiv 1910.05124:
§3.1 (T1, learning-rate rescheduling) and §3.2 (T2, discrepancy correction).
"""

from __future__ import annotations


def t1_lr_factor(tau: int, step: int, anneal_steps: int) -> float:
    """T1: stage learning rate = base rate × τ^(−p), p = 1 − min(step / K, 1).

    Stages with delay τ start at base/τ and reach the base rate after K = ``anneal_steps``
    updates; a stage without delay (τ ≤ 1) always uses the base rate.

    Args:
        tau: the stage's delay in updates (N − i for asynchronous 1F1B, 1-based i).
        step: local updates applied so far.
        anneal_steps: K ≥ 1.
    """
    if tau <= 1:
        return 1.0
    p = 1.0 - min(step / max(anneal_steps, 1), 1.0)
    return float(tau) ** (-p)


def t2_velocity(velocity: float, delta_w: float, gamma: float) -> float:
    """T2's velocity estimate δ ← γ δ + (1 − γ)(w_{t+1} − w_t) (scalar form of the update
    the executor applies per parameter tensor). The backward then uses w − Δ·δ, the current
    weights moved back toward the forward's by the Δ updates in between."""
    return gamma * velocity + (1.0 - gamma) * delta_w
