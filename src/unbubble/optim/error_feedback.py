"""Error feedback for delayed gradients: a correction of the applied update, for any optimizer.

x_{t+1} = x_t − u_t − c·(u_t − u_{t−1}), u_t the optimizer's full update, read off the parameters so that
it wraps every optimizer unchanged (Zmushko et al., arXiv 2606.30634, as read by lodestone-rock/RamTorch).
The rule, where it differs from RamTorch, and its memory:
[Note: error feedback] in docs/architecture.md#optimerror_feedbackpy.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def check_coefficient(c: float) -> None:
    """Raises ValueError unless ``c`` is a finite number ≥ 0."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
        raise ValueError(f"error_feedback={c!r} is invalid: must be a finite number ≥ 0 (0 = off)")


class ErrorFeedback:
    """The update history of one stage and the correction x ← x − c·(u_t − u_{t−1}) ([Note: error feedback]).

    Use: :meth:`snapshot` right before ``optimizer.step()``, :meth:`correct` right after it (before
    any copy of the stepped tensors into lower-precision parameters).

    Args:
        tensors: what the optimizer steps (the parameters, or their fp32 masters).
        c: the coefficient (> 0; c = 0 means: build no ErrorFeedback at all).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], c: float):
        check_coefficient(c)
        self.tensors, self.c = list(tensors), float(c)
        self.history = [torch.zeros_like(t) for t in self.tensors]  # u_{t−1}, uncorrected
        self._before = [torch.empty_like(t) for t in self.tensors]  # x_t, then u_t
        self.steps = 0  # steps corrected or not; the first is plain

    @torch.no_grad()
    def snapshot(self) -> None:
        for b, t in zip(self._before, self.tensors):
            b.copy_(t)

    @torch.no_grad()
    def correct(self) -> None:
        """After the step (gradients not yet cleared): u_t = x_t − x_{t+1}^plain; x_{t+1} =
        x_{t+1}^plain − c·(u_t − u_{t−1}) from the second step on; the history becomes u_t. A tensor
        whose ``.grad`` is ``None`` is not corrected and its history becomes 0."""
        for b, h, t in zip(self._before, self.history, self.tensors):
            if t.grad is None:  # no gradient this update: no correction, history zeroed (RamTorch)
                b.zero_()
                continue
            b.sub_(t)  # u_t
            if self.steps:
                h.sub_(b).mul_(self.c)  # c·(u_{t−1} − u_t)
                t.add_(h)
        self.history, self._before = self._before, self.history  # history ← u_t; the old one is scratch
        self.steps += 1

    def nbytes(self) -> int:
        """Bytes of the history and the snapshot."""
        return sum(t.numel() * t.element_size() for t in self.history + self._before)

    def state_dict(self) -> dict[str, Any]:
        return {"c": self.c, "steps": self.steps, "history": [h.detach() for h in self.history]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for h, saved in zip(self.history, state["history"]):
            h.copy_(saved)
        self.steps = state["steps"]
