"""Muon on a stage's hidden matrices, AdamW on everything else, as one optimizer.

``torch.optim.Muon`` accepts only 2-D parameters and its authors pair it with AdamW for
embeddings, the head, norms and biases. A pipeline stage needs one optimizer object (one
``LambdaLR``, one ``state_dict`` per checkpoint), so :class:`MuonAdamW` owns a
``torch.optim.Muon`` and a ``torch.optim.AdamW`` over disjoint parameter groups and exposes their
groups as its own: a learning-rate schedule that edits ``param_groups`` reaches both, and the
``state_dict`` is the ordinary ``torch.optim`` one.

The Muon update uses Moonshot's RMS matching (``adjust_lr_fn="match_rms_adamw"``: lr × 0.2·√max(A, B)),
so one learning rate serves both halves, as it does for AdamW alone.

Sources: K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024);
J. Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982, §2.2 (RMS matching).
"""

from __future__ import annotations

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

    Raises:
        ValueError: a ``muon`` group holds a tensor that is not 2-D, or no group is given.
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, momentum: float = 0.95) -> None:
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
        for opt in self._parts():
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_state()
