"""One entry point that builds a stage's optimizer by name, knowing the stage's index and delay."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from unbubble.errors import ConfigError, check_int, did_you_mean
from unbubble.optim._checks import (
    check_betas, check_choice, check_nonneg, check_unit,
)
from unbubble.optim.basis_rotation import ALLOCATIONS, GEOMETRIES, SOURCES, BasisRotation, stage_refresh_intervals
from unbubble.optim.muon import MuonAdamW
from unbubble.optim.pipenag import PipeNAG, nadam

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "basis-rotation", "nesterov", "nadam", "muon")
DEFAULT_UNROTATED = ("wte", "wpe", "lm_head")  # GPT-2 embeddings and head (unbubble.models.gpt2 names)

_DEFAULTS: dict[str, Any] = {
    "eps": 1e-8,
    "br_source": "2nd",
    "br_geometry": "bilateral",
    "br_freq": 10,
    "br_start_step": 1,
    "br_max_precond_dim": 10_000,
    "br_factor_beta": None,
    "br_allocation": "uniform",
    "br_stage_delays": None,
    "br_unrotated": DEFAULT_UNROTATED,
    "momentum_decay": 4e-3,
    "nag_beta1": 0.99,
    "nag_adaptive": False,
    "muon_momentum": 0.95,
}
OPTIONS = tuple(_DEFAULTS)


def build_optimizer(
    name: str,
    params: Iterable[Any],
    stage: int,
    n_stages: int,
    delay: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    **br_options: Any,
) -> torch.optim.Optimizer:
    """Builds the optimizer of one pipeline stage.

    Parameters are grouped as in nanoGPT (and ``unbubble.train.adamw``): weight decay on tensors
    with ≥ 2 dimensions only. ``params`` may be

    * tensors (every matrix is rotated by Basis Rotation),
    * ``(name, tensor)`` pairs such as ``module.named_parameters()`` (matrices whose name contains
      one of ``br_unrotated`` — by default the GPT-2 embeddings ``wte``/``wpe`` and ``lm_head`` —
      get AdamW inside Basis Rotation, as in the paper), or
    * parameter-group dicts, used as given (set ``rotate=False`` yourself).

    Args:
        name: "adamw" (``torch.optim.AdamW``), "basis-rotation" (``BasisRotation``), "nesterov"
            (``PipeNAG``), "nadam" (``torch.optim.NAdam``, momentum_decay 0.004, decoupled wd) or
            "muon" (``MuonAdamW``: ``torch.optim.Muon`` on the matrices Basis Rotation would rotate,
            AdamW on ``br_unrotated`` matrices, norms, biases and stacked expert weights, which
            are not 2-D).
        params: see above.
        stage: this stage's 0-based index s, in 0..n_stages-1.
        n_stages: pipeline depth N ≥ 1.
        delay: tau_s ≥ 0, the staleness of this stage's gradients in updates (PACI:
            ceil((N-1-s)/a); PipeDream: N-1-s; synchronous schedules: 0).
        lr: peak learning rate ≥ 0 (a schedule may scale it).
        betas: (beta1, beta2), each in [0, 1).
        weight_decay: decoupled weight decay ≥ 0 on matrices.
        **br_options: ``eps`` (1e-8); Basis Rotation: ``br_source`` ("2nd" | "1st"),
            ``br_geometry`` ("bilateral" | "unilateral"), ``br_freq`` (k, 10), ``br_start_step``
            (1), ``br_max_precond_dim`` (10000), ``br_factor_beta`` (None = beta2),
            ``br_allocation`` ("uniform" | "stage-aware" | "inverse"; non-uniform needs
            ``br_stage_delays``, every stage's tau, and then this stage refreshes every
            ``stage_refresh_intervals(br_stage_delays, br_freq, br_allocation)[stage]`` steps),
            ``br_unrotated`` (name substrings kept unrotated); NAdam / PipeNAG: ``momentum_decay``
            (0.004); PipeNAG: ``nag_beta1`` (0.99, the paper's momentum, used instead of beta1) and
            ``nag_adaptive`` (False; True uses ``pipenag_beta1(beta1, delay, N, nag_beta1)``); Muon:
            ``muon_momentum`` (μ, 0.95; in [0, 1)).
            Options of other optimizers are accepted and ignored, so a CLI can pass all of them.

    Returns:
        The optimizer, ready for ``LambdaLR``.

    Raises:
        ConfigError: unknown name or option, or a value out of range; one line naming the value,
            what is valid and the flag (``br_source='3rd' is invalid: must be one of 2nd, 1st
            (set --br-source)``).
    """
    check_choice("optimizer", name, OPTIMIZERS, "set --optimizer")
    unknown = sorted(set(br_options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"option {unknown[0]}={br_options[unknown[0]]!r} is invalid{did_you_mean(unknown[0], OPTIONS)}: "
            f"build_optimizer accepts {', '.join(OPTIONS)}"
        )
    opts = {**_DEFAULTS, **br_options}
    check_int("n_stages", n_stages, 1, "set --stages")
    check_int("stage", stage, 0, f"stages are 0..{n_stages - 1} for n_stages={n_stages}", hi=n_stages - 1)
    check_int("delay", delay, 0, "the stage's staleness tau_s, in updates")
    check_nonneg("lr", lr, "set --lr")
    check_betas(betas)
    check_nonneg("weight_decay", weight_decay, "set --weight-decay")
    check_nonneg("eps", opts["eps"], "pass eps ≥ 0")
    betas = (float(betas[0]), float(betas[1]))

    if name == "basis-rotation":
        freq = _basis_rotation_interval(opts, stage, n_stages, delay)
        groups = _groups(params, weight_decay, tuple(opts["br_unrotated"]), mark_rotation=True)
        optimizer: torch.optim.Optimizer = BasisRotation(
            groups, lr=lr, betas=betas, eps=opts["eps"], weight_decay=weight_decay,
            source=opts["br_source"], geometry=opts["br_geometry"], update_freq=freq,
            start_step=opts["br_start_step"], max_precond_dim=opts["br_max_precond_dim"],
            factor_beta=opts["br_factor_beta"],
        )
        logger.debug("stage %d: basis-rotation (%s, %s), refresh every %d steps, delay %d",
                     stage, opts["br_source"], opts["br_geometry"], freq, delay)
        return optimizer
    if name == "muon":  # the matrices Basis Rotation would rotate are the ones Muon orthogonalises
        groups = _groups(params, weight_decay, tuple(opts["br_unrotated"]), mark_rotation=True)
        groups = [{**{k: v for k, v in g.items() if k != "rotate"}, "muon": g.get("rotate", True)} for g in groups]
        groups = [part for g in groups for part in _split_non_matrices(g)]
        check_unit("muon_momentum", opts["muon_momentum"], "set --muon-momentum")
        return MuonAdamW(groups, lr=lr, betas=betas, eps=opts["eps"], weight_decay=weight_decay,
                         momentum=float(opts["muon_momentum"]))
    groups = _groups(params, weight_decay, (), mark_rotation=False)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=opts["eps"], weight_decay=weight_decay)
    check_nonneg("momentum_decay", opts["momentum_decay"], "pass momentum_decay ≥ 0")
    if name == "nadam":
        return nadam(groups, lr=lr, betas=betas, eps=opts["eps"], weight_decay=weight_decay,
                     momentum_decay=opts["momentum_decay"])
    check_unit("nag_beta1", opts["nag_beta1"], "pass nag_beta1 in [0, 1)")
    if not isinstance(opts["nag_adaptive"], bool):
        raise ConfigError(f"nag_adaptive={opts['nag_adaptive']!r} is invalid: must be True or False")
    beta1 = betas[0] if opts["nag_adaptive"] else opts["nag_beta1"]
    return PipeNAG(
        groups, lr=lr, betas=(beta1, betas[1]), eps=opts["eps"], weight_decay=weight_decay,
        momentum_decay=opts["momentum_decay"], delay=delay, n_stages=n_stages,
        adaptive_momentum=opts["nag_adaptive"], beta1_max=opts["nag_beta1"],
    )


def _basis_rotation_interval(opts: dict[str, Any], stage: int, n_stages: int, delay: int) -> int:
    """Validates the br_ options and returns this stage's refresh interval."""
    check_choice("br_source", opts["br_source"], SOURCES, "set --br-source")
    check_choice("br_geometry", opts["br_geometry"], GEOMETRIES, "set --br-geometry")
    check_int("br_freq", opts["br_freq"], 1, "set --br-freq")
    check_int("br_start_step", opts["br_start_step"], 1, "pass br_start_step ≥ 1")
    check_int("br_max_precond_dim", opts["br_max_precond_dim"], 1, "pass br_max_precond_dim ≥ 1")
    if opts["br_factor_beta"] is not None:
        check_unit("br_factor_beta", opts["br_factor_beta"], "pass br_factor_beta in [0, 1) or None")
    check_choice("br_allocation", opts["br_allocation"], ALLOCATIONS, "set --br-allocation")
    unrotated = opts["br_unrotated"]
    if isinstance(unrotated, str) or not all(isinstance(u, str) for u in unrotated):
        raise ConfigError(f"br_unrotated={unrotated!r} is invalid: must be a sequence of name substrings")
    if opts["br_allocation"] == "uniform":
        return opts["br_freq"]
    delays = opts["br_stage_delays"]
    if not isinstance(delays, Sequence) or len(delays) != n_stages:
        raise ConfigError(
            f"br_stage_delays={delays!r} is invalid: br_allocation={opts['br_allocation']!r} needs one delay "
            f"per stage ({n_stages} values, stage 0 first)"
        )
    if delays[stage] != delay:
        raise ConfigError(
            f"br_stage_delays[{stage}]={delays[stage]!r} is invalid: must equal this stage's delay={delay}"
        )
    return stage_refresh_intervals(list(delays), opts["br_freq"], opts["br_allocation"])[stage]


def _groups(
    params: Iterable[Any], weight_decay: float, unrotated: tuple[str, ...], mark_rotation: bool,
) -> list[dict[str, Any]]:
    """nanoGPT grouping (decay on ≥ 2-D) plus, for Basis Rotation, an unrotated group of named matrices."""
    items = list(params)
    if not items:
        raise ConfigError("params=[] is invalid: the stage has no trainable parameters")
    if isinstance(items[0], dict):
        return items
    named = isinstance(items[0], tuple)
    rotated, kept, flat = [], [], []
    for item in items:
        pname, p = item if named else ("", item)
        if p.dim() < 2:
            flat.append(p)
        elif named and any(u in pname for u in unrotated):
            kept.append(p)
        else:
            rotated.append(p)
    groups: list[dict[str, Any]] = []
    if rotated:
        groups.append({"params": rotated, "weight_decay": weight_decay})
    if kept:
        groups.append({"params": kept, "weight_decay": weight_decay, **({"rotate": False} if mark_rotation else {})})
    if flat:
        groups.append({"params": flat, "weight_decay": 0.0, **({"rotate": False} if mark_rotation else {})})
    return groups


def _split_non_matrices(group: dict) -> list[dict]:
    """A Muon group as itself, or, when it holds tensors that are not 2-D (stacked expert weights
    (E, out, in) of an MoE layer), as a Muon group of its matrices and an AdamW group of the rest:
    ``torch.optim.Muon`` updates 2-D matrices only."""
    params = list(group["params"])
    if not group["muon"] or all(p.dim() == 2 for p in params):
        return [group]
    split = [({**group, "params": [p for p in params if p.dim() == 2]}),
             ({**group, "params": [p for p in params if p.dim() != 2], "muon": False})]
    return [g for g in split if g["params"]]
