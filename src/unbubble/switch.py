"""Synchronous, then asynchronous: one run that trains its first K updates with 1F1B-flush and the rest
with an asynchronous schedule (``unbubble train --switch-after K``; docs/concepts.md).

The delay costs most early in training, so a run may train synchronously while it hurts and
asynchronously after. How the switch is placed and what carries over:
docs/architecture.md#switchpy.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable

from unbubble.config import TrainConfig
from unbubble.metrics import SYNC_PHASE_DIR, RunWriter

log = logging.getLogger(__name__)


def phases(cfg: TrainConfig, run_dir: Path) -> tuple[TrainConfig, TrainConfig]:
    """The two runs of a switched ``cfg`` (``switch_after`` = K > 0, validated) in ``run_dir``."""
    k = cfg.switch_after
    sync_dir = run_dir / SYNC_PHASE_DIR
    first = dataclasses.replace(
        cfg, schedule="1f1b-flush", m=cfg.mb_per_step, a=TrainConfig.a, steps=k, lr_steps=cfg.steps, switch_after=0,
        run_dir=str(sync_dir), final_checkpoint=True, error_feedback=0.0, predict_weights="none",
        clip_scope="sync" if cfg.clip_grad_norm is not None else None)
    second = dataclasses.replace(cfg, switch_after=0, init_from=str(sync_dir), run_dir=str(run_dir))
    return first, second


def train_switched(cfg: TrainConfig, train: Callable) -> tuple:
    """Trains the two phases of ``cfg`` (see the module docstring) with ``train``
    (:func:`unbubble.train.train`, its other arguments bound).

    Returns:
        ``(result, run_dir)`` of phase 2, the result's ``step_losses`` and ``val_losses`` preceded by
        phase 1's (``start_step`` 0), so it reads as one run of ``cfg.steps`` updates; ``(None, None)``
        on torchrun ranks other than 0.

    Raises:
        ConfigError: as :func:`unbubble.train.train`, for either phase (phase 2's before it trains).
        PipelineFailure: as :func:`unbubble.train.train`.
    """
    run_dir = RunWriter.choose_dir(cfg).resolve()
    first, second = phases(cfg, run_dir)
    log.info("synchronous phase: 1F1B-flush with m = %d for updates 1 … %d, into %s", first.m, cfg.switch_after,
             first.run_dir)
    r1, _ = train(first)
    if r1 is None or r1.stopped_at is not None:
        return r1, Path(first.run_dir) if r1 is not None else None
    log.info("switching to %s after update %d", cfg.schedule, cfg.switch_after)
    r2, out = train(second)
    if r2 is None:
        return None, None
    whole = dataclasses.replace(r2, step_losses=list(r1.step_losses) + list(r2.step_losses),
                                val_losses=[(v, x) for v, x in r1.val_losses if v < cfg.switch_after]
                                + list(r2.val_losses), start_step=0)
    return whole, out
