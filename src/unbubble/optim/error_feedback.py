"""Error feedback for delayed gradients: a correction of the applied update, for any optimizer.

[Note: error feedback] Zmushko et al. (arXiv 2606.30634), as read by the public implementation in
lodestone-rock/RamTorch ``ramtorch/delayed_optim.py`` (a third party's reading of the paper's
Algorithm 1/2, not the authors' code). With u_t the optimizer's full update of step t, learning rate
and decoupled weight decay included (u_t = x_t − x_{t+1}^plain, x_{t+1}^plain what the optimizer alone
produced), the applied step is

    x_{t+1} = x_t − u_t − c·(u_t − u_{t−1}),

c ≥ 0 (1 in RamTorch's Adam; c = 0 is the plain optimizer). The first step is plain (there is no
u_0), and the history keeps the *uncorrected* u_t, never the corrected step: both as in RamTorch.

Where this differs from RamTorch: RamTorch computes u_t explicitly inside its own Adam/Muon/Lion;
here u_t is read off the parameters (before − after ``optimizer.step()``), so the rule wraps every
optimizer unbubble has (AdamW, Muon, Basis Rotation, NAdam, …) unchanged, at the cost of the rounding
of that subtraction (exact in the hand-computed test at float64; one fp32 ulp of x otherwise). Weight
decay enters u_t wherever the optimizer applies it (decoupled: in the step, as RamTorch's AdamW;
coupled: through the gradient).

A tensor without a gradient in an update (``.grad is None`` at the step: a layer no micro-batch
reached, an MoE expert no token was routed to) is left as the optimizer left it (torch's optimizers
skip it: unchanged) with no correction, and its history is zeroed, as RamTorch's ``_skip_parameter``
does: without this it would move by c·u_{t−1} although it had no update. The step counter still
advances, so when it next receives a gradient its correction is c·(u_t − 0), as in RamTorch.

Memory: two buffers shaped like the stepped tensors (the fp32 masters under bf16): the history
u_{t−1} and a snapshot of the weights before the step; both allocated once.
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
