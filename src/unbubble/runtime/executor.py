"""One stage's work: forward, backward and optimizer update (shared by every engine)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from unbubble.runtime.versions import keep_version_counters
from unbubble.schedules.actions import Action, ActionKind

BatchFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageExecutor:
    """Runs F, B and U for one pipeline stage; transport-agnostic.

    The activation store maps micro-batch id k to the stage's input leaf and its output
    (on the last stage, the scaled loss), so a backward can run any time after its
    forward, possibly after optimizer updates: it then uses the *current* weights with the
    forward-time activations (see [Note: backward on current weights] in ``versions.py``).
    No weight is ever copied.

    Args:
        stage: 0-based stage index.
        n_stages: pipeline depth N.
        module: the stage's layers. Input: token ids ``(B, T)`` int64 on the first stage,
            else the previous stage's output; output: anything tensor-valued.
        loss_fn: on the last stage, ``loss_fn(output, targets) -> scalar`` mean loss.
        batch_fn: ``batch_fn(k) -> (inputs, targets)`` for global micro-batch id k; the
            first stage reads inputs, the last stage reads targets (deterministic in k, so
            labels never travel through the pipe).
        optimizer: updates ``module``'s parameters.
        loss_scale: multiplies each micro-batch loss before backward (1/a for PACI, 1/m for
            flushed schedules) so an update applies the mean gradient.
        lr_scheduler: stepped once after every update.
        clip_grad_norm: per-stage gradient-norm clipping before each update (off if None);
            global clipping would need cross-stage synchronisation.
    """

    def __init__(self, stage: int, n_stages: int, module: nn.Module, loss_fn: LossFn | None,
                 batch_fn: BatchFn, optimizer: torch.optim.Optimizer, loss_scale: float,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 clip_grad_norm: float | None = None):
        self.stage, self.n_stages = stage, n_stages
        self.module, self.loss_fn, self.batch_fn = module, loss_fn, batch_fn
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.loss_scale, self.clip_grad_norm = loss_scale, clip_grad_norm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.version = 0
        self.store: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.losses: dict[int, float] = {}  # k -> unscaled loss (last stage)
        self._step_losses: list[float] = []  # losses of the micro-batches in the current update
        self.last_step_loss: float | None = None  # mean loss of the last update (last stage)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def forward(self, k: int, activation: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward of micro-batch ``k``.

        Args:
            k: global micro-batch id.
            activation: the previous stage's output (ignored on the first stage).

        Returns:
            The activation to send to the next stage (detached), or ``None`` on the last stage.
        """
        if self.is_first:
            inp, x = None, self.batch_fn(k)[0]
        else:
            inp = x = activation.detach().requires_grad_(True)
        out = self.module(x)
        if self.is_last:
            loss = self.loss_fn(out, self.batch_fn(k)[1])
            self.losses[k] = loss.item()
            self.store[k] = (inp, loss * self.loss_scale)
            return None
        self.store[k] = (inp, out)
        return out.detach()

    def backward(self, k: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Full backward of micro-batch ``k``; accumulates into the parameters' ``.grad``.

        Args:
            k: global micro-batch id (its forward must have run on this stage).
            grad: gradient of the loss w.r.t. this stage's output (ignored on the last stage).

        Returns:
            Gradient w.r.t. this stage's input, to send to the previous stage, or ``None`` on
            the first stage.
        """
        inp, out = self.store.pop(k)
        if self.is_last:
            self._step_losses.append(self.losses.pop(k))
            out.backward()
        else:
            out.backward(grad)
        return None if inp is None else inp.grad

    def update(self) -> None:
        """Applies the accumulated gradients, zeroes them and bumps the weight version."""
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        with keep_version_counters(self.params):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.version += 1
        if self._step_losses:
            self.last_step_loss = sum(self._step_losses) / len(self._step_losses)
            self._step_losses = []

    def run(self, action: Action, payload: torch.Tensor | None = None) -> torch.Tensor | None:
        """Dispatches one action; returns the tensor to send (or ``None``)."""
        if action.kind is ActionKind.F:
            return self.forward(action.mb, payload)
        if action.kind is ActionKind.B:
            return self.backward(action.mb, payload)
        if action.kind is ActionKind.U:
            self.update()
            return None
        raise NotImplementedError(f"action {action}: kind {action.kind.value} is not supported by this executor")
