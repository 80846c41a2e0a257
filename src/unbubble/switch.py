"""Synchronous, then asynchronous: one run that trains its first K updates with 1F1B-flush and the rest
with an asynchronous schedule (``unbubble train --switch-after K``; docs/concepts.md).

The delay costs most early in training (pays-study: PACI's token overhead falls from 1.33 at 600
updates to about 1.07 at 2,400, paired per seed), so a run may train synchronously while it hurts and asynchronously
after. The switch sits at an update boundary where 1F1B-flush has flushed, so nothing is in flight:

* phase 1 is 1F1B-flush with m = a (the same micro-batches per update, the same loss scale 1/a, the
  same stages), on the *whole* run's learning-rate schedule (``lr_steps`` = the run's steps), stopped
  after update K; it is a complete run folder of its own, ``RUN/synchronous``;
* phase 2 is the configured schedule from phase 1's checkpoint of update K, exactly as
  ``--init-from RUN/synchronous`` (weights and optimizer state by parameter name, the update counter
  and the data position continuing: its first micro-batch is K·a). What the asynchronous schedule
  keeps across updates starts empty at the switch: drift (the pipeline fills again, Δ = 0 for its
  first forwards), the error-feedback history (the first asynchronous update is plain, as a run's
  first), the stale clip's pending norms (its first s updates clip with their own) and PipeMare's
  velocity. Synchronous updates carry none of them, so each is defined as at a run's start.

The run's folder is phase 2's (``summary.json``, ``metrics.jsonl`` from update K + 1), with phase 1
inside it; :func:`train_switched` returns a result whose losses cover both phases.
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
