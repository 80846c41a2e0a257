"""Muon on a stage's hidden matrices, AdamW on everything else, as one optimizer.

``torch.optim.Muon`` accepts only 2-D parameters and its authors pair it with AdamW for
embeddings, the head, norms and biases. A pipeline stage needs one optimizer object (one
``LambdaLR``, one ``state_dict`` per checkpoint), so :class:`MuonAdamW` owns a
``torch.optim.Muon`` and a ``torch.optim.AdamW`` over disjoint parameter groups and exposes their
groups as its own: a learning-rate schedule that edits ``param_groups`` reaches both, and the
``state_dict`` is the ordinary ``torch.optim`` one.

The Muon update uses Moonshot's RMS matching (``adjust_lr_fn="match_rms_adamw"``: lr × 0.2·√max(A, B)),
so one learning rate serves both halves, as it does for AdamW alone.

The update is torch's (momentum, Nesterov, Newton–Schulz, RMS matching, decoupled weight decay; equal
to ``torch.optim.Muon.step`` bit for bit in bfloat16) with the Newton–Schulz dtype a choice:
``torch.optim.Muon`` always iterates in bfloat16, which a GPU multiplies natively but a CPU without
bfloat16 instructions emulates, 10–27× slower than float32 for 32×96 … 768×768 matrices (it doubled
the CPU time of a tiny default run). So the iteration runs in bfloat16 on accelerators and in float32
on the CPU unless ``ns_dtype`` says otherwise.

Sources: K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024);
J. Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982, §2.2 (RMS matching).
"""

from __future__ import annotations

import math
from typing import Any

import torch


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked ``muon=True`` (2-D matrices), AdamW for the others.

    Args:
        groups: parameter-group dicts; a group with ``muon=True`` must hold only 2-D tensors.
            Each group may carry its own ``weight_decay``.
        lr: peak learning rate of both halves.
        betas: AdamW (β1, β2).
        eps: AdamW ε.
        weight_decay: default decoupled weight decay.
        momentum: Muon's momentum μ (0.95, Nesterov form).
        ns_dtype: the dtype of the Newton–Schulz iteration; ``None``: ``torch.float32`` for a
            parameter on the CPU, ``torch.bfloat16`` elsewhere (``torch.optim.Muon``'s).

    Raises:
        ValueError: a ``muon`` group holds a tensor that is not 2-D, ``ns_dtype`` is not a
            floating dtype, or no group is given.
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, momentum: float = 0.95,
                 ns_dtype: torch.dtype | None = None) -> None:
        if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise ValueError(f"ns_dtype={ns_dtype!r} is invalid: pass a floating torch dtype "
                             "(torch.float32, torch.bfloat16) or None (float32 on the CPU, bfloat16 elsewhere)")
        self.ns_dtype = ns_dtype
        muon_groups = [{k: v for k, v in g.items() if k != "muon"} for g in groups if g.get("muon")]
        adam_groups = [{k: v for k, v in g.items() if k != "muon"} for g in groups if not g.get("muon")]
        if not muon_groups and not adam_groups:
            raise ValueError("MuonAdamW needs at least one parameter group")
        for g in muon_groups:
            g["params"] = list(g["params"])
            bad = [tuple(p.shape) for p in g["params"] if p.dim() != 2]
            if bad:
                raise ValueError(f"a Muon group holds a tensor of shape {bad[0]}: Muon updates 2-D matrices only")
        self.muon = torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     adjust_lr_fn="match_rms_adamw") if muon_groups else None
        self.adamw = torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay) if adam_groups else None
        # the same group dicts, so LambdaLR and load_state_dict see every group
        super().__init__([g for opt in self._parts() for g in opt.param_groups], {"lr": lr})
        self._share_state()

    def _parts(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    def _share_state(self) -> None:
        """Points both halves at this optimizer's groups and state (after init or a load)."""
        start = 0
        for opt in self._parts():
            opt.param_groups = self.param_groups[start:start + len(opt.param_groups)]
            start += len(opt.param_groups)
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One update of every parameter (Muon's, then AdamW's)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.muon is not None:
            for group in self.muon.param_groups:
                self._muon_group_step(group)
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        """``torch.optim.Muon``'s update of one group (its single-tensor path), with the Newton–Schulz
        iteration in :attr:`ns_dtype`."""
        lr, mu = float(group["lr"]), group["momentum"]
        if group["adjust_lr_fn"] != "match_rms_adamw":  # set in __init__; the scale below is this rule's
            raise ValueError(f"adjust_lr_fn={group['adjust_lr_fn']!r}: MuonAdamW uses 'match_rms_adamw'")
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p) or p.grad.is_sparse:
                raise RuntimeError("Muon does not support complex parameters or sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            dtype = self.ns_dtype or (torch.float32 if p.device.type == "cpu" else torch.bfloat16)
            update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
            a, b = p.shape[:2]
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-(lr * (0.2 * math.sqrt(max(a, b)))))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_state()


def orthogonalize(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration toward the polar factor UVᵀ of ``g`` (shape (A, B)),
    in ``dtype``: the iteration of ``torch.optim.Muon`` (Jordan et al. 2024), whose dtype is fixed to
    bfloat16. Returns a tensor of shape (A, B) and dtype ``dtype``."""
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm ≤ 1 (not in place: ``g.to`` may return ``g``)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
