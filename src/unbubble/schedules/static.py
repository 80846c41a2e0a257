"""Generators of synchronous (flushed) schedules as per-stage action lists."""

from __future__ import annotations

from unbubble.schedules.actions import Action, ActionKind


def one_f_one_b_flush(n_stages: int, m: int, steps: int) -> list[list[Action]]:
    """1F1B with a flush after every m micro-batches (PipeDream-Flush / DAPPLE).

    Stage i (1-based) runs min(N − i, m) warm-up forwards, then alternates one forward
    and one backward, drains the remaining backwards, and applies ``U`` after the step's
    m backwards. Every backward therefore runs on the weights of its forward (Δ = 0) and at
    most N + 1 − i activations are held. Micro-batch ids are global: step t covers
    ``t*m … t*m + m − 1``.

    Args:
        n_stages: pipeline depth N ≥ 1.
        m: micro-batches per optimizer step ≥ 1.
        steps: optimizer steps ≥ 1.

    Returns:
        ``order[stage]`` = the stage's actions in execution order.

    Source: DAPPLE, arXiv 2007.01045, §3; PipeDream-2BW, arXiv 2006.09503, §3 (1F1B-flush).
    """
    order: list[list[Action]] = []
    for stage in range(n_stages):
        acts: list[Action] = []
        warmup = min(n_stages - stage - 1, m)
        for t in range(steps):
            k0 = t * m
            acts += [Action(stage, ActionKind.F, k0 + j) for j in range(warmup)]
            for j in range(m - warmup):
                acts.append(Action(stage, ActionKind.F, k0 + warmup + j))
                acts.append(Action(stage, ActionKind.B, k0 + j))
            acts += [Action(stage, ActionKind.B, k0 + j) for j in range(m - warmup, m)]
            acts.append(Action(stage, ActionKind.U))
        order.append(acts)
    return order
