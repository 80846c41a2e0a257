"""Nesterov-style delay correction for asynchronous pipelines (PipeNAG), and the NAdam baseline.

PipeNAG raises NAdam's momentum toward 1 so that Nesterov's look-ahead reaches further when gradients are
τ updates old (arXiv 2505.01099). The update and the released code's settings:
docs/architecture.md#optimpipenagpy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from unbubble.errors import check_int
from unbubble.optim._checks import check_betas, check_nonneg, check_unit


def pipenag_beta1(beta1: float, delay: int, n_stages: int, beta1_max: float = 0.99) -> float:
    """Delay-adaptive momentum beta1 + tau (beta1_max - beta1) / N.

    Args:
        beta1: the base coefficient (the last stage's, tau = 0), in [0, 1).
        delay: tau_s ≥ 0, the stage's staleness in updates.
        n_stages: pipeline depth N ≥ 1.
        beta1_max: the coefficient approached as tau -> N, in [0, 1). Default 0.99.

    Returns:
        The stage's beta1 (below 1 whenever tau ≤ N).

    Raises:
        ConfigError: an argument out of range.

    Source: PluralisResearch/AsyncPP ``main_with_runtime.py`` (``--adaptive_momentum``) for
    arXiv 2505.01099.
    """
    check_unit("beta1", beta1, "set --beta1")
    check_unit("beta1_max", beta1_max, "pass nag_beta1 in [0, 1)")
    check_int("delay", delay, 0, "the stage's staleness tau_s, in updates")
    check_int("n_stages", n_stages, 1, "set --stages")
    return beta1 + delay * (beta1_max - beta1) / n_stages


class PipeNAG(torch.optim.NAdam):
    """NAdam with decoupled weight decay and a delay-aware (high) momentum coefficient.

    Args:
        params: tensors or parameter groups (torch semantics).
        lr: learning rate ≥ 0.
        betas: (beta1, beta2). With ``adaptive_momentum=False`` (default) beta1 is used as given;
            the paper's experiments use 0.99. With ``adaptive_momentum=True`` beta1 is the last
            stage's coefficient and stage s gets ``pipenag_beta1(beta1, delay, n_stages, beta1_max)``.
        eps: Adam's epsilon.
        weight_decay: decoupled (AdamW-style) weight decay.
        momentum_decay: NAdam's psi in mu_t = beta1 (1 - 0.5 * 0.96^(t psi)). Default 0.004.
        delay: tau_s of this stage (≥ 0).
        n_stages: pipeline depth N (≥ 1).
        adaptive_momentum: grow beta1 with the delay (see above).
        beta1_max: the adaptive rule's limit. Default 0.99.

    Raises:
        ConfigError: an argument out of range.

    Source: arXiv 2505.01099; see the module docstring.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.99, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        momentum_decay: float = 4e-3,
        *,
        delay: int = 0,
        n_stages: int = 1,
        adaptive_momentum: bool = False,
        beta1_max: float = 0.99,
    ) -> None:
        check_nonneg("lr", lr, "set --lr")
        check_betas(betas)
        check_nonneg("eps", eps, "pass eps ≥ 0")
        check_nonneg("weight_decay", weight_decay, "set --weight-decay")
        check_nonneg("momentum_decay", momentum_decay, "pass momentum_decay ≥ 0")
        beta1 = pipenag_beta1(betas[0], delay, n_stages, beta1_max) if adaptive_momentum else betas[0]
        if not adaptive_momentum:
            check_int("delay", delay, 0, "the stage's staleness tau_s, in updates")
            check_int("n_stages", n_stages, 1, "set --stages")
        self.delay, self.n_stages, self.adaptive_momentum = delay, n_stages, adaptive_momentum
        super().__init__(
            params, lr=lr, betas=(beta1, betas[1]), eps=eps, weight_decay=weight_decay,
            momentum_decay=momentum_decay, decoupled_weight_decay=True, foreach=False,
        )


def nadam(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    momentum_decay: float = 4e-3,
) -> torch.optim.NAdam:
    """The Basis Rotation paper's "Nesterov" baseline: ``torch.optim.NAdam`` with decoupled weight
    decay and momentum_decay 0.004.

    Args:
        params: tensors or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.NAdam`` (weight decay decoupled).
        momentum_decay: NAdam's psi. Default 0.004 (the paper's).

    Returns:
        The optimizer.

    Raises:
        ConfigError: an argument out of range.

    Source: Basis Rotation, arXiv 2602.03515, baselines; its released ``optim/nadamw.py``.
    """
    check_nonneg("lr", lr, "set --lr")
    check_betas(betas)
    check_nonneg("eps", eps, "pass eps ≥ 0")
    check_nonneg("weight_decay", weight_decay, "set --weight-decay")
    check_nonneg("momentum_decay", momentum_decay, "pass momentum_decay ≥ 0")
    return torch.optim.NAdam(
        params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
        momentum_decay=momentum_decay, decoupled_weight_decay=True, foreach=False,
    )
