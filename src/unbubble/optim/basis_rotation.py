"""Basis Rotation: Adam run in a rotated, Kronecker-factored eigenbasis, robust to stale gradients.

In a deep asynchronous pipeline a stage applies gradients that are τ updates old; Adam helps only when
the Hessian's eigenbasis is aligned with the coordinate axes. Basis Rotation rotates each weight matrix
into estimated eigenbases and runs Adam there. The update, the refresh of the bases, the notes ([Note:
batches of matrices], [Note: BR update order], [Note: first moment in the rotated basis], [Note: epsilon
placement]) and the defects of the released code fixed here: docs/architecture.md#basis-rotation.

Source: H. Jung, S. Shin, N. Lee, arXiv 2602.03515, Algorithms 1 and 2; SOAP, arXiv 2409.11321.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from unbubble.errors import ConfigError, check_int
from unbubble.optim import keys as K
from unbubble.optim._checks import check_betas, check_choice, check_nonneg, check_unit
from unbubble.optim.memory import optimizer_state_bytes

logger = logging.getLogger(__name__)

SOURCES = ("2nd", "1st")
_ORIGINAL_SPACE_MAX_FREQ = 2  # update_freq ≤ this keeps M in the original space ([Note: first moment ...])
GEOMETRIES = ("bilateral", "unilateral")
ALLOCATIONS = ("uniform", "stage-aware", "inverse")


# ----------------------------------------------------------------------------------------------
# Pure numerics (tested on their own)


def initial_basis(factor: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric factor, columns by descending eigenvalue (the cold start).

    Args:
        factor: ``(..., d, d)`` symmetric positive semi-definite matrices (L, R, M M^T or M^T M).

    Returns:
        ``(..., d, d)`` orthogonal matrices in ``factor``'s dtype; column j belongs to the j-th largest
        eigenvalue. Signs are whatever ``torch.linalg.eigh`` returns.

    Raises:
        torch.linalg.LinAlgError: ``eigh`` failed in float32 and again in float64.

    Source: SOAP ``soap.py`` ``get_orthogonal_matrix`` (eigh, float64 retry, flip to descending).
    Cost: O(d^3).
    """
    return _initial_basis(factor)[0]


def _initial_basis(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``initial_basis`` and the eigenvalues (ascending; non-finite ones flag a bad factor)."""
    work = factor.float() if factor.dtype in (torch.float16, torch.bfloat16) else factor
    work = work * _power_of_two_scale(work)
    try:
        eigenvalues, q = torch.linalg.eigh(work)
    except torch.linalg.LinAlgError:
        logger.warning("eigh failed in %s on a %s factor; retrying in float64", work.dtype, tuple(work.shape))
        eigenvalues, q = torch.linalg.eigh(work.double())
    return q.flip(-1).to(factor.dtype), eigenvalues


def power_step(basis: torch.Tensor, factor_basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One refresh from a current basis Q and the product F Q: sort, then Q <- QR(F Q).

    Args:
        basis: ``(..., d, d)`` current orthogonal basis Q.
        factor_basis: ``(..., d, d)`` the product F Q.

    Returns:
        ``(new_basis, order)``: the ``(..., d, d)`` orthogonal Q factor of ``(F Q)[:, order]`` and the
        int64 permutation ``order`` (``(..., d)``, one per matrix) that sorts the estimated eigenvalues
        diag(Q^T F Q) in descending order (stable for ties). Column j of the new basis continues
        column ``order[j]`` of the old one, so a rotated second moment must be permuted by
        ``order`` along this side's axis.

    Source: SOAP, arXiv 2409.11321 (eigenbasis update by one power iteration and QR);
    ``soap.py`` ``get_orthogonal_matrix_QR``.
    Cost: O(d^3) for the QR (float32 at least).
    """
    q, order, _ = _power_step(basis, factor_basis)
    return q, order


def _power_step(basis: torch.Tensor, factor_basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``power_step`` and the estimated eigenvalues (any non-finite F Q makes them non-finite)."""
    estimated = (basis * factor_basis).sum(dim=-2)  # diag(Q^T F Q), (..., d)
    order = torch.argsort(estimated, dim=-1, descending=True, stable=True)
    power = torch.take_along_dim(factor_basis, order.unsqueeze(-2), dim=-1)  # a fresh (..., d, d) tensor
    if power.dtype in (torch.float16, torch.bfloat16):
        power = power.float()
    q, _ = torch.linalg.qr(power.mul_(_power_of_two_scale(power)))
    return q.to(basis.dtype), order, estimated


def _power_of_two_scale(x: torch.Tensor) -> torch.Tensor:
    """2^-e per matrix of ``x`` (``(..., 1, 1)``) with max |x| * 2^-e in [0.5, 1) (1 for an all-zero matrix).

    Eigenvectors and the Q of a QR are scale-invariant and a power-of-two scale is exact, so
    scaling by it changes no result; it keeps factors built from tiny gradients (and the near-zero
    columns of F Q on a null space) away from float32's slow subnormal range. No host sync.
    """
    _, exponent = torch.frexp(x.abs().amax(dim=(-2, -1), keepdim=True))
    return torch.ldexp(torch.ones(exponent.shape, dtype=x.dtype, device=x.device), -exponent)


def refresh_basis(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``power_step(basis, factor @ basis)``: one warm-started subspace-iteration step on F.

    Args:
        factor: ``(d, d)`` symmetric positive semi-definite F.
        basis: ``(d, d)`` orthogonal Q.

    Returns:
        ``(new_basis, order)`` as in ``power_step``. Repeated calls converge to the eigenvectors of
        F (descending, up to sign) at rate lambda_{j+1}/lambda_j per column.
    """
    return power_step(basis, factor @ basis)


def rotated_sides(shape: Sequence[int], geometry: str, max_precond_dim: int) -> tuple[bool, bool]:
    """Which sides of a matrix of ``shape`` are rotated.

    Args:
        shape: ``(m, n)`` of a 2-D parameter, or ``(E, m, n)`` of E matrices ([Note: batches of
            matrices]); other ranks are never rotated.
        geometry: "bilateral" (both sides) or "unilateral" (only the smaller side; the right one
            when m == n, as in the released code).
        max_precond_dim: sides longer than this stay unrotated.

    Returns:
        ``(left, right)``: whether U (m x m) and V (n x n) exist.
    """
    if len(shape) not in (2, 3):
        return False, False
    m, n = int(shape[-2]), int(shape[-1])
    if geometry == "bilateral":
        return m <= max_precond_dim, n <= max_precond_dim
    if m < n:
        return m <= max_precond_dim, False
    return False, n <= max_precond_dim


def rotation_extra_numel(shape: Sequence[int], source: str, geometry: str, max_precond_dim: int = 10_000) -> int:
    """Elements of state Basis Rotation keeps for one matrix beyond AdamW's two moments.

    Bases U (m^2) and V (n^2) for each rotated side, plus the factors L (m^2) and R (n^2) with
    source "2nd"; E times that for a 3-D ``(E, m, n)`` parameter. For GPT-2-small's block (4 x 768x768, 768x3072, 3072x768) this is 7x, 3.5x, 1x
    and 0.5x the block's parameters for (2nd, bi), (1st, bi), (2nd, uni), (1st, uni).

    Args:
        shape: the parameter's shape.
        source: "2nd" or "1st".
        geometry: "bilateral" or "unilateral".
        max_precond_dim: as in ``BasisRotation``.

    Returns:
        The element count (multiply by the element size for bytes).
    """
    left, right = rotated_sides(shape, geometry, max_precond_dim)
    per_side = 2 if source == "2nd" else 1
    total = 0
    if left:
        total += per_side * int(shape[-2]) ** 2
    if right:
        total += per_side * int(shape[-1]) ** 2
    return total * math.prod(int(e) for e in shape[:-2])


def stage_refresh_intervals(delays: Sequence[int], base_interval: int, allocation: str = "stage-aware") -> list[int]:
    """Per-stage refresh intervals k_s that share one total refresh budget.

    The budget is what every stage refreshing every ``base_interval`` steps costs: a total rate
    sum_s 1/k_s = N / base_interval refreshes per step. Rules (tau_s = stage s's staleness):

    * "uniform": k_s = base_interval.
    * "stage-aware": rate proportional to tau_s + 1, so staler (earlier) stages refresh more often:
      k_s = base_interval * sum_j (tau_j + 1) / (N (tau_s + 1)).
    * "inverse": rate proportional to 1 / (tau_s + 1) (the allocation the paper reports as worse):
      k_s = base_interval * (tau_s + 1) * sum_j 1/(tau_j + 1) / N.

    Intervals are rounded to the nearest integer and at least 1, so the realized budget
    (``refresh_budget``) differs from N / base_interval only by that rounding.

    Args:
        delays: tau_s per stage, stage 0 first (e.g. PACI's ceil((N-1-s)/a), PipeDream's N-1-s).
        base_interval: the uniform interval k (update_freq), ≥ 1.
        allocation: "uniform", "stage-aware" or "inverse".

    Returns:
        One interval per stage, in stage order.

    Raises:
        ConfigError: an empty or negative delay list, k < 1, or an unknown allocation.

    Source: Basis Rotation, arXiv 2602.03515, stage-aware basis updates (+29.2% speed with
    budget allocated by delay; inverse allocation worse). The paper does not publish its rule;
    the 1/(tau+1) rule above is unbubble's.
    """
    check_choice("allocation", allocation, ALLOCATIONS, "set --br-allocation")
    check_int("base_interval", base_interval, 1, "set --br-freq")
    if len(delays) == 0:
        raise ConfigError("delays=[] is invalid: must give one staleness per stage (at least one stage)")
    for s, tau in enumerate(delays):
        check_int(f"delays[{s}]", tau, 0, "staleness is a number of updates")
    n = len(delays)
    if allocation == "uniform":
        raw = [float(base_interval)] * n
    elif allocation == "stage-aware":
        total = sum(t + 1 for t in delays)
        raw = [base_interval * total / (n * (t + 1)) for t in delays]
    else:
        total = sum(1.0 / (t + 1) for t in delays)
        raw = [base_interval * (t + 1) * total / n for t in delays]
    return [max(1, int(math.floor(k + 0.5))) for k in raw]


def refresh_budget(intervals: Iterable[int]) -> float:
    """Total refresh rate sum_s 1/k_s (refreshes per step over all stages)."""
    return sum(1.0 / k for k in intervals)


# ----------------------------------------------------------------------------------------------
# The optimizer


def _rotate(x: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
    """U^T x V, skipping absent sides. x: (..., m, n)."""
    if left is not None:
        x = left.mT @ x  # (m, m)^T (m, n) -> (m, n)
    if right is not None:
        x = x @ right  # (m, n) (n, n) -> (m, n)
    return x


def _unrotate(x: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
    """U x V^T, skipping absent sides. x: (..., m, n)."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.mT
    return x


def _gram(a: torch.Tensor) -> torch.Tensor:
    """A A^T, (..., m, n) -> (..., m, m)."""
    return a @ a.mT


def _gram_times(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(A A^T) Q in the cheaper order. a: (..., m, n), q: (..., m, m)."""
    m, n = a.shape[-2:]
    if n >= m:
        return _gram(a) @ q  # m^2 n + m^3
    return a @ (a.mT @ q)  # 2 m^2 n


def _add_product(factor: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """factor += alpha · a b, in place, for one matrix or a batch."""
    if factor.dim() == 2:
        factor.addmm_(a, b, alpha=alpha)
    else:
        factor.baddbmm_(a, b, alpha=alpha)


class BasisRotation(torch.optim.Optimizer):
    """Adam in a rotated eigenbasis for 2-D hidden matrices (and 3-D batches of them, [Note: batches of
    matrices]), AdamW for everything else.

    See the module docstring for the update, [Note: BR update order] for when bases change, and
    ``unbubble.optim.keys`` for the state it keeps.

    Args:
        params: tensors or parameter groups. A group may set ``rotate=False`` (plain AdamW for its
            matrices: embeddings, the LM head) and override any option below.
        lr: learning rate (float ≥ 0). Default 1e-3.
        betas: (beta1, beta2), each in [0, 1). Default (0.9, 0.999) as the released code.
        eps: added to the bias-corrected sqrt of the second moment (torch's AdamW placement; see
            [Note: epsilon placement]). Default 1e-8.
        weight_decay: decoupled, W <- W (1 - lr wd), on every parameter of the group (exclude
            biases and norms by giving them their own group). Default 0.01 (released code).
        source: "2nd" (factors L = EMA(G G^T), R = EMA(G^T G); the SOAP member; most memory) or
            "1st" (singular vectors of the momentum; no factors; the paper finds it converges
            slower under delay: 2.55x (uni) and 1.77x (bi) vs 1.27x for (2nd, bi) at 32 stages).
        geometry: "bilateral" (U and V) or "unilateral" (only the smaller side; half the rotation
            cost and memory, weaker alignment: 1.66x for (2nd, uni)).
        update_freq: refresh interval k in steps (int ≥ 1). Default 10. Smaller k tracks the
            eigenbasis better at O(m^3 + n^3) per refresh; see ``stage_refresh_intervals`` for
            per-stage k under one budget.
        start_step: the cold-start refresh (full ``eigh``) runs after this step (int ≥ 1); until
            then the bases are the identity and the update is exactly AdamW. Default 1.
        max_precond_dim: sides longer than this stay unrotated (int ≥ 1). Default 10000 (SOAP's);
            e.g. a GPT-2 head (50257 x 768) would be rotated on the 768 side only.
        factor_beta: EMA decay of L and R; None uses beta2.

    Raises:
        ConfigError: any option out of range, named with the valid values and the CLI flag.
        torch.linalg.LinAlgError: a cold-start ``eigh`` failed in float32 and float64 (a warning
            is logged and the refresh is skipped instead if the result is merely non-finite).

    Source: arXiv 2602.03515, Algorithms 1-2; SOAP arXiv 2409.11321.
    Memory: ``rotation_extra_numel`` per matrix beyond AdamW; ``optimizer_state_bytes`` measures it.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        source: str = "2nd",
        geometry: str = "bilateral",
        update_freq: int = 10,
        start_step: int = 1,
        max_precond_dim: int = 10_000,
        factor_beta: float | None = None,
    ) -> None:
        defaults = {
            "lr": lr, "betas": tuple(betas) if isinstance(betas, list) else betas, "eps": eps,
            "weight_decay": weight_decay, K.SOURCE: source, K.GEOMETRY: geometry, K.UPDATE_FREQ: update_freq,
            K.START_STEP: start_step, K.MAX_PRECOND_DIM: max_precond_dim, K.FACTOR_BETA: factor_beta,
            K.ROTATE: True,
        }
        _check_options(defaults)  # fail before torch's own, less helpful, checks
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group (torch semantics) and validates its options after defaults are filled in.

        Raises:
            ConfigError: an option of the group is out of range.
        """
        super().add_param_group(param_group)
        _check_options(self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault(K.ROTATE, True)
            group.setdefault(K.START_STEP, 1)
            group.setdefault(K.FACTOR_BETA, None)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One update of every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional, torch semantics).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BasisRotation does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state, group)
                if K.BASIS_LEFT in state or K.BASIS_RIGHT in state:
                    self._rotated_step(p, state, group)
                else:
                    self._adamw_step(p, state, group)
        return loss

    def state_bytes(self) -> dict[str, Any]:
        """``unbubble.optim.optimizer_state_bytes(self)``: measured state memory (see there)."""
        return optimizer_state_bytes(self)

    # --- internals ------------------------------------------------------------------------------

    @staticmethod
    def _init_state(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state[K.STEP] = torch.zeros((), dtype=torch.float32)
        state[K.EXP_AVG] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state[K.EXP_AVG_SQ] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not group[K.ROTATE]:
            return
        left, right = rotated_sides(p.shape, group[K.GEOMETRY], group[K.MAX_PRECOND_DIM])
        second = group[K.SOURCE] == "2nd"
        for present, dim, basis_key, factor_key in (
            (left, -2, K.BASIS_LEFT, K.FACTOR_LEFT), (right, -1, K.BASIS_RIGHT, K.FACTOR_RIGHT),
        ):
            if not present:
                continue
            d, batch = p.shape[dim], p.shape[:-2]  # batch: (E,) for a 3-D parameter, () for a matrix
            state[basis_key] = torch.eye(d, dtype=p.dtype, device=p.device).expand(*batch, d, d).clone()
            if second:
                state[factor_key] = torch.zeros(*batch, d, d, dtype=p.dtype, device=p.device)
        if left or right:
            state[K.REFRESHES] = 0
            state[K.EXP_AVG_ROTATED] = group[K.UPDATE_FREQ] > _ORIGINAL_SPACE_MAX_FREQ

    @staticmethod
    def _adamw_step(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        # Exactly torch.optim.adam._single_tensor_adam with decoupled weight decay (torch 2.3-2.13).
        grad = p.grad
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        step_t = state[K.STEP]
        step_t += 1
        if wd != 0:
            p.mul_(1 - lr * wd)
        exp_avg, exp_avg_sq = state[K.EXP_AVG], state[K.EXP_AVG_SQ]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)

    def _rotated_step(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        grad = p.grad  # (m, n), or (E, m, n)
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        left, right = state.get(K.BASIS_LEFT), state.get(K.BASIS_RIGHT)
        step_t = state[K.STEP]
        step_t += 1
        if wd != 0:
            p.mul_(1 - lr * wd)
        grad_rot = _rotate(grad, left, right)  # G~ = U^T G V, (m, n)
        exp_avg, exp_avg_sq = state[K.EXP_AVG], state[K.EXP_AVG_SQ]
        if state[K.EXP_AVG_ROTATED]:
            exp_avg.lerp_(grad_rot, 1 - beta1)  # M~, rotated basis
            momentum_rot = exp_avg
        else:
            exp_avg.lerp_(grad, 1 - beta1)  # M, original space (update_freq ≤ 2)
            momentum_rot = _rotate(exp_avg, left, right)
        exp_avg_sq.mul_(beta2).addcmul_(grad_rot, grad_rot, value=1 - beta2)
        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        update = torch.mul(momentum_rot, -step_size).div_(denom)  # the same rounding as AdamW's addcdiv_
        p.add_(_unrotate(update, left, right))
        # [Note: BR update order]: statistics and bases change only now.
        if group[K.SOURCE] == "2nd":
            beta_f = beta2 if group[K.FACTOR_BETA] is None else group[K.FACTOR_BETA]
            if left is not None:
                _add_product(state[K.FACTOR_LEFT].mul_(beta_f), grad, grad.mT, 1 - beta_f)  # L, (m, m)
            if right is not None:
                _add_product(state[K.FACTOR_RIGHT].mul_(beta_f), grad.mT, grad, 1 - beta_f)  # R, (n, n)
        start, freq = group[K.START_STEP], group[K.UPDATE_FREQ]
        t = int(step)
        if t >= start and (t - start) % freq == 0:
            self._refresh(state, group)

    @staticmethod
    def _refresh(state: dict[str, Any], group: dict[str, Any]) -> None:
        """New bases from the factors, moments carried over ([Note: first moment in the rotated basis])."""
        cold = state[K.REFRESHES] == 0
        old = {0: state.get(K.BASIS_LEFT), 1: state.get(K.BASIS_RIGHT)}
        exp_avg, exp_avg_sq = state[K.EXP_AVG], state[K.EXP_AVG_SQ]
        rotated_momentum = state[K.EXP_AVG_ROTATED]
        momentum = _unrotate(exp_avg, old[0], old[1]) if rotated_momentum else exp_avg  # M, (m, n)
        new: dict[int, torch.Tensor] = {}
        orders: dict[int, torch.Tensor] = {}
        checks: list[torch.Tensor] = []  # small vectors that turn non-finite with a bad factor
        for axis, factor_key in ((0, K.FACTOR_LEFT), (1, K.FACTOR_RIGHT)):
            q = old[axis]
            if q is None:
                continue
            if group[K.SOURCE] == "2nd":
                factor = state[factor_key]  # L or R
                if cold:
                    new[axis], check = _initial_basis(factor)
                else:
                    new[axis], orders[axis], check = _power_step(q, factor @ q)
            else:
                a = momentum if axis == 0 else momentum.mT  # F = A A^T: M M^T or M^T M
                if cold:
                    new[axis], check = _initial_basis(_gram(a))
                else:
                    new[axis], orders[axis], check = _power_step(q, _gram_times(a, q))
            checks.append(check)
        if not all(bool(torch.isfinite(c).all()) for c in checks):
            logger.warning("basis refresh met non-finite values (non-finite gradients?); keeping the old bases")
            return
        if rotated_momentum:  # M~_new = U1^T M V1 (exact; for m != n cheaper than U0^T U1 and V0^T V1)
            state[K.EXP_AVG] = _rotate(momentum, new.get(0), new.get(1))
        if cold:  # the old bases are the identity: U0^T U1 = U1. Squared-rotation map, see the Note.
            state[K.EXP_AVG_SQ] = _rotate(exp_avg_sq, _square(new.get(0)), _square(new.get(1)))
        else:
            for axis, order in orders.items():  # permuted (per matrix), never rotated
                index = order.unsqueeze(-1) if axis == 0 else order.unsqueeze(-2)
                exp_avg_sq = torch.take_along_dim(exp_avg_sq, index, dim=axis - 2)
            state[K.EXP_AVG_SQ] = exp_avg_sq
        if 0 in new:
            state[K.BASIS_LEFT] = new[0]
        if 1 in new:
            state[K.BASIS_RIGHT] = new[1]
        state[K.REFRESHES] += 1
        logger.debug("basis refresh %d at step %d", state[K.REFRESHES], int(state[K.STEP].item()))


def _square(q: torch.Tensor | None) -> torch.Tensor | None:
    return None if q is None else q.square()


def _check_options(group: dict[str, Any]) -> None:
    """Validates one group's options (messages name the CLI flag of ``unbubble train``)."""
    check_nonneg("lr", group["lr"], "set --lr")
    check_betas(group["betas"])
    check_nonneg("eps", group["eps"], "pass eps ≥ 0")
    check_nonneg("weight_decay", group["weight_decay"], "set --weight-decay")
    check_choice(K.SOURCE, group[K.SOURCE], SOURCES, "set --br-source")
    check_choice(K.GEOMETRY, group[K.GEOMETRY], GEOMETRIES, "set --br-geometry")
    check_int(K.UPDATE_FREQ, group[K.UPDATE_FREQ], 1, "set --br-freq")
    check_int(K.START_STEP, group[K.START_STEP], 1, "pass start_step ≥ 1")
    check_int(K.MAX_PRECOND_DIM, group[K.MAX_PRECOND_DIM], 1, "pass max_precond_dim ≥ 1")
    if group[K.FACTOR_BETA] is not None:
        check_unit(K.FACTOR_BETA, group[K.FACTOR_BETA], "pass factor_beta in [0, 1) or None for beta2")
    if not isinstance(group[K.ROTATE], bool):
        raise ConfigError(f"rotate={group[K.ROTATE]!r} is invalid: must be True or False (param group flag)")
