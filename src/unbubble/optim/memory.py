"""Optimizer state memory, measured from the live state (for the run summary and the benchmark)."""

from __future__ import annotations

from typing import Any

import torch

from unbubble.optim import keys as K

_ADAMW_KEYS = (K.STEP, K.EXP_AVG, K.EXP_AVG_SQ)  # what torch.optim.AdamW keeps per parameter


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Bytes of every optimizer's per-parameter state, and how much of it AdamW would not need.

    State is created lazily, so call this after the first ``step()``. Works for any torch
    optimizer; the "rotated" figures are non-zero only for ``BasisRotation``.

    Args:
        optimizer: any ``torch.optim.Optimizer``.

    Returns:
        A dict with

        * ``param_bytes``: bytes of all parameters in the optimizer's groups;
        * ``rotated_param_bytes``: bytes of the parameters that have a basis (rotated matrices);
        * ``state_bytes``: bytes of all tensor state (``by_key`` splits it by state key);
        * ``extra_bytes``: state beyond AdamW's (everything except ``step``, ``exp_avg`` and
          ``exp_avg_sq``): bases and factors for Basis Rotation, ``mu_product`` for NAdam;
        * ``extra_per_rotated_param``: ``extra_bytes / rotated_param_bytes`` (0.0 if nothing is
          rotated). For Basis Rotation on a GPT-2-small block: 7.0 (2nd, bilateral),
          3.5 (1st, bilateral), 1.0 (2nd, unilateral), 0.5 (1st, unilateral), because the
          factors and bases are m^2 + n^2 per side-pair while the moments are already counted
          by AdamW (see ``rotation_extra_numel``);
        * ``extra_per_param``: ``extra_bytes / param_bytes``, for optimizers without a notion of
          rotated parameters (SOAP keeps its factors and bases in lists; they are counted);
        * ``state_per_param``: ``state_bytes / param_bytes`` (AdamW: 2.0 plus the step scalars).
    """
    by_key: dict[str, int] = {}
    param_bytes = 0
    rotated_param_bytes = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            size = p.numel() * p.element_size()
            param_bytes += size
            state = optimizer.state.get(p, {})
            if K.BASIS_LEFT in state or K.BASIS_RIGHT in state:
                rotated_param_bytes += size
            for key, value in state.items():
                nbytes = _tensor_bytes(value)
                if nbytes:
                    by_key[str(key)] = by_key.get(str(key), 0) + nbytes
    state_bytes = sum(by_key.values())
    extra = sum(v for k, v in by_key.items() if k not in _ADAMW_KEYS)
    return {
        "param_bytes": param_bytes,
        "rotated_param_bytes": rotated_param_bytes,
        "state_bytes": state_bytes,
        "by_key": dict(sorted(by_key.items())),
        "extra_bytes": extra,
        "extra_per_rotated_param": extra / rotated_param_bytes if rotated_param_bytes else 0.0,
        "extra_per_param": extra / param_bytes if param_bytes else 0.0,
        "state_per_param": state_bytes / param_bytes if param_bytes else 0.0,
    }


def _tensor_bytes(value: object) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0
