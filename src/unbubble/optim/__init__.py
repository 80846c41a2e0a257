"""Optimizers for stale gradients: Basis Rotation and delay-aware baselines, one algorithm per file.

* ``basis_rotation``: ``BasisRotation`` (arXiv 2602.03515) and stage-aware refresh intervals.
* ``pipenag``: ``PipeNAG`` (Nesterov look-ahead for delays, arXiv 2505.01099) and ``nadam``.
* ``lr_rescheduling``: PipeMare's T1 (arXiv 1910.05124), the PipeDream-LR multiplier and
  staleness-aware scaling 1/(1 + τ_s) (arXiv 1511.05950).
* ``muon``: ``MuonAdamW``, ``torch.optim.Muon`` on hidden matrices with AdamW on the rest.
* ``error_feedback``: ``ErrorFeedback``, x ← x − u_t − c·(u_t − u_{t−1}) around any optimizer's step
  (arXiv 2606.30634, as read by lodestone-rock/RamTorch).
* ``memory``: ``optimizer_state_bytes``.
* ``factory``: ``build_optimizer(name, params, stage, n_stages, delay, ...)`` for the pipeline.
* ``keys``: state and group keys.
"""

from unbubble.optim.basis_rotation import (
    ALLOCATIONS,
    GEOMETRIES,
    SOURCES,
    BasisRotation,
    initial_basis,
    power_step,
    refresh_basis,
    refresh_budget,
    rotated_sides,
    rotation_extra_numel,
    stage_refresh_intervals,
)
from unbubble.optim.factory import OPTIMIZERS, OPTIONS, build_optimizer
from unbubble.optim.lr_rescheduling import PipeDreamLR, StalenessLR, pipemare_t1_factor
from unbubble.optim.memory import optimizer_state_bytes
from unbubble.optim.muon import MuonAdamW
from unbubble.optim.pipenag import PipeNAG, nadam, pipenag_beta1

__all__ = [
    "ALLOCATIONS", "GEOMETRIES", "OPTIMIZERS", "OPTIONS", "SOURCES",
    "BasisRotation", "MuonAdamW", "PipeDreamLR", "PipeNAG", "StalenessLR",
    "build_optimizer", "initial_basis", "nadam", "optimizer_state_bytes", "pipemare_t1_factor",
    "pipenag_beta1", "power_step", "refresh_basis", "refresh_budget", "rotated_sides",
    "rotation_extra_numel", "stage_refresh_intervals",
]
