"""The non-finite guard of one stage: per micro-batch drops, the update-time check, the divergence stop.

A non-finite loss or gradient must not reach the weights, and one bad micro-batch should not end a
run: the guard drops what is non-finite and tells the previous stage by a NaN-filled gradient.
[Note: non-finite guard] in docs/architecture.md#checkpoints-stops-and-faults-runtimecheckpointpy-schedulespolicypy-runtimelaunchpy.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from unbubble.errors import NonFiniteError

log = logging.getLogger(__name__)

#: The non-finite guard gives up after this many consecutive updates whose every micro-batch it
#: dropped (the weights themselves have diverged).
MAX_DROPPED_UPDATES = 10
_LOGGED_DROPS = 3


def finite(tensors: list[torch.Tensor | None]) -> bool:
    """True if every element of ``tensors`` is finite (max |x| per tensor, NaN and ±inf propagate;
    one host synchronisation; 5× cheaper on small CPU tensors than ``get_total_norm``)."""
    ts = [t.detach().abs().amax().float() for t in tensors if t is not None]
    return not ts or bool(torch.isfinite(torch.stack(ts)).all())


class NonFiniteGuard:
    """One stage's non-finite guard ([Note: non-finite guard]); its update-time check is the
    ``"non_finite"`` step of the update (``runtime/update.py``).

    Args:
        stage: the stage index (named in events and errors).
        policy: one of ``unbubble.config.NAN_POLICIES``: ``"skip"``, ``"lower-lr"``, ``"abort"``, ``"off"``.
        lr_factor: under ``"lower-lr"``, what each event multiplies the learning rate by.
        optimizer: the stage's optimizer (its groups' ``lr`` are cut under ``"lower-lr"``).
        lr_scheduler: the stage's scheduler or ``None`` (its ``base_lrs`` are cut too).
    """

    def __init__(self, stage: int, policy: str, lr_factor: float, optimizer: torch.optim.Optimizer,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None):
        self.stage, self.policy, self.nan_lr_factor = stage, policy, lr_factor
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.lr_factor = 1.0  # product of the guard's learning-rate cuts (checkpointed)
        self.events: list[dict[str, Any]] = []  # what this stage dropped or skipped, drained by the engine
        self.n_dropped = 0  # micro-batches (and updates) dropped so far
        self.tainted = False  # a non-finite gradient of this stage is in the accumulated sum
        self.kept_since_update = 0  # backwards completed since the last update
        self._all_dropped_updates = 0  # consecutive updates without a kept micro-batch

    @property
    def on(self) -> bool:
        return self.policy != "off"

    def incoming_bad(self, loss: torch.Tensor | None, grads: list[torch.Tensor | None]) -> bool:
        """Whether a micro-batch's loss (last stage: ``loss``) or incoming gradient is non-finite."""
        if not self.on:
            return False
        if loss is not None:
            return not math.isfinite(float(loss))
        return not finite(grads)

    def poison(self, inp, k: int | None, what: str, version: int) -> Any:
        """Records a drop (of micro-batch ``k``, or of the update when ``None``) at weight ``version``.

        Returns:
            A NaN-filled gradient shaped like ``inp``'s gradient-carrying leaves (the signal for the
            previous stage), or ``None`` when ``inp`` is ``None``.

        Raises:
            NonFiniteError: under ``"abort"``.
        """
        event = {"stage": self.stage, "mb": k, "version": version, "what": what, "policy": self.policy}
        if self.policy == "abort":
            where = "" if k is None else f" in micro-batch {k}"
            raise NonFiniteError(f"stage {self.stage}: non-finite {what}{where} at weight version {version} "
                                 "(nan_policy='abort'; 'skip' drops the micro-batch instead)")
        if self.policy == "lower-lr":
            self.scale_lr(self.nan_lr_factor)
            event["lr_factor"] = self.lr_factor
        self.events.append(event)
        self.n_dropped += 1
        if self.n_dropped <= _LOGGED_DROPS:  # every drop is in metrics.jsonl; the log shows the first few
            more = " (further drops of this stage: metrics.jsonl only)" if self.n_dropped == _LOGGED_DROPS else ""
            log.warning("stage %d dropped %s at weight version %d: non-finite %s%s", self.stage,
                        "its update" if k is None else f"micro-batch {k}", version, what, more)
        if inp is None:
            return None
        return inp.pack([torch.full_like(t, math.nan) for t in inp.leaves])  # one per gradient-carrying leaf

    def scale_lr(self, factor: float) -> None:
        self.lr_factor *= factor
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        if self.lr_scheduler is not None:  # LambdaLR recomputes lr from base_lrs each step
            self.lr_scheduler.base_lrs = [lr * factor for lr in self.lr_scheduler.base_lrs]

    def apply(self, ctx) -> None:
        """The update-time check (step ``"non_finite"``): a non-finite accumulated gradient, or one
        the stage's backward found in its sum, turns the update into a zero gradient (as for a
        dropped micro-batch) or, when the update is clipped (``ctx.clipper``), into NaN, which makes
        the clip skip it (on every stage under ``sync``, [Note: clip scopes] in docs/architecture.md);
        then the divergence stop."""
        if self.on:
            grads = [p.grad for p in ctx.grad_params if p.grad is not None]
            if self.tainted or not finite(grads):
                if not self.tainted:
                    self.poison(None, None, "accumulated weight gradient (this stage's update is dropped)",
                                ctx.version)
                fill = 0.0 if ctx.clipper is None else math.nan
                for g in grads:
                    g.fill_(fill)
                self.tainted = False
                self.kept_since_update = 0  # counts as an update without a usable micro-batch
        self.check_divergence(ctx.version)

    def check_divergence(self, version: int) -> None:
        """Raises once every micro-batch of :data:`MAX_DROPPED_UPDATES` consecutive updates was
        dropped (an update follows at least one backward, so none kept means all dropped): the
        weights have diverged and skipping more data cannot help."""
        kept, self.kept_since_update = self.kept_since_update, 0
        self._all_dropped_updates = 0 if kept else self._all_dropped_updates + 1
        if self._all_dropped_updates >= MAX_DROPPED_UPDATES:
            raise NonFiniteError(
                f"stage {self.stage}: every micro-batch of the last {MAX_DROPPED_UPDATES} updates had a non-finite "
                f"loss or gradient (weight version {version}): training diverged; start again with a lower "
                "--lr" + ("" if self.policy == "lower-lr" else " or --nan-policy lower-lr"))
