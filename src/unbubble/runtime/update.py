"""The steps of a stage's optimizer update ``U``, each a small unit, run in one declared order.

A step is a callable ``step(ctx) -> None`` on an :class:`UpdateContext` (:data:`UpdateStep`); a
feature that acts on both sides of the optimizer step (error feedback, weight prediction, PipeMare's
velocity) has two, sharing its state. ``StageExecutor`` builds the steps its options enable and runs
them in :data:`UPDATE_ORDER`; the executor keeps only the stage's state and the sequencing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from unbubble.optim.error_feedback import ErrorFeedback
from unbubble.runtime.precision import copy_masters

#: The update's steps, in the order they run (those a stage's options leave off are not built). Why:
#:
#: first part (``StageExecutor.prepare_update``: once per update; a rank's clipper runs it for all of
#: its stages before it exchanges their norms, so it must end with the gradients final):
#: - ``non_finite``: the guard first, so that nothing below reads a poisoned sum (it becomes zeros,
#:   or NaN when clipped, which the clip turns into a skipped update);
#: - ``step_loss`` then ``grad_sync``: the replicas average their gradients and step losses, so every
#:   replica clips by the same norm and applies the same step;
#:
#: second part (``StageExecutor.update``):
#: - ``clip`` on the final gradient; it decides whether the update is applied at all (``ctx.apply``);
#: - the snapshots of the weights before the optimizer moves them (order among them is free);
#: - ``optimizer``, then ``error_feedback.correct`` on the tensors it stepped (the fp32 masters under
#:   bf16), before ``masters`` rounds them into the bf16 parameters;
#: - ``prediction.record`` and ``velocity.update`` last: they measure W − W_prev as the live weights
#:   moved, error feedback's correction and bf16 rounding included.
UPDATE_ORDER: tuple[str, ...] = (
    "non_finite", "step_loss", "grad_sync",
    "clip", "velocity.snapshot", "prediction.snapshot", "error_feedback.snapshot",
    "optimizer", "error_feedback.correct", "masters", "prediction.record", "velocity.update",
)
#: The steps of the first part (``prepare_update``); the rest are the second part.
PREPARE_STEPS = UPDATE_ORDER[:3]


@dataclass
class UpdateContext:
    """What the steps of one update read and write.

    Attributes:
        version: t, the weight version this update turns into t + 1.
        params: the live parameters (bf16 under ``precision="bf16"``).
        grad_params: what the optimizer steps, their ``.grad`` the accumulated gradient (the fp32
            masters under bf16, else ``params``).
        clipper: the rank's ``clipping.RankClipper`` or ``None``.
        executor: the stage's executor (what the rank clipper works on); ``None`` in unit use.
        step_loss: the last stage's mean loss of this update's micro-batches (``None`` elsewhere).
        apply: ``False`` once a step skips the update: the optimizer does not step, and nothing that
            accompanies the step (error feedback, the bf16 copy) runs.
    """

    version: int
    params: list[torch.Tensor]
    grad_params: list[torch.Tensor]
    clipper: Any = None
    executor: Any = None
    step_loss: float | None = None
    apply: bool = True


UpdateStep = Callable[[UpdateContext], None]


class MeanLoss:
    """``step_loss``: the mean of the micro-batch losses gathered since the last update (last stage:
    one host synchronisation per update)."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []  # 0-dim detached losses, appended after each backward

    def apply(self, ctx: UpdateContext) -> None:
        if self.pending:
            values = torch.stack(self.pending).tolist()
            ctx.step_loss = sum(values) / len(values)
            self.pending = []


class GradSync:
    """``grad_sync``: data parallelism's average of the gradients (and the step loss) over the
    replicas, ``sync(grad_params, step_loss) -> step_loss`` (``data_parallel.GradientAverager``)."""

    def __init__(self, sync: Callable[[list, float | None], float | None]):
        self.sync = sync

    def apply(self, ctx: UpdateContext) -> None:
        ctx.step_loss = self.sync(ctx.grad_params, ctx.step_loss)


class GradClip:
    """``clip``: the rank clipper's clip when one is attached ([Note: clip scopes] in
    docs/architecture.md; a non-finite norm skips the update), else a plain local
    ``torch.nn.utils.clip_grad_norm_`` at ``max_norm`` (``None``: off)."""

    def __init__(self, max_norm: float | None = None):
        self.max_norm = max_norm

    def apply(self, ctx: UpdateContext) -> None:
        if ctx.clipper is not None:
            ctx.apply = ctx.clipper.clip(ctx.executor)
        elif self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ctx.grad_params, self.max_norm)


class OptimizerStep:
    """``optimizer``: ``optimizer.step()`` unless the update is skipped. In place: in-flight graphs
    (built under ``SavedByReference``) read the new weights at their backward."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def apply(self, ctx: UpdateContext) -> None:
        if ctx.apply:
            self.optimizer.step()


class ErrorFeedbackSteps:
    """``error_feedback.snapshot`` / ``.correct``: x_{t+1} = x_t − u_t − c·(u_t − u_{t−1}) around the
    optimizer step ([Note: error feedback] in docs/architecture.md); a skipped update leaves
    the history as it is."""

    def __init__(self, feedback: ErrorFeedback):
        self.feedback = feedback

    def snapshot(self, ctx: UpdateContext) -> None:
        if ctx.apply:
            self.feedback.snapshot()

    def correct(self, ctx: UpdateContext) -> None:
        if ctx.apply:
            self.feedback.correct()


class MasterCopy:
    """``masters``: under ``precision="bf16"`` the bf16 parameters ← the stepped fp32 masters,
    rounded, in place ([Note: precision and version semantics] in docs/architecture.md)."""

    def __init__(self, masters: list[torch.Tensor]):
        self.masters = masters

    def apply(self, ctx: UpdateContext) -> None:
        if ctx.apply:
            copy_masters(ctx.params, self.masters)


class WeightPrediction:
    """Weight prediction's state and its two steps ([Note: weight prediction] in ``executor.py``).

    ``prediction.snapshot`` keeps W before the step and ``prediction.record`` turns it into the
    applied update W − W_prev (0 for a skipped update); a forward then runs on
    W + s·(W − W_prev) (:meth:`predicted`).

    Args:
        params: the live parameters.
        mode: ``"bound"`` (s = ``bound``) or ``"measured"`` (s = the stage's mean measured drift).
        bound: the stage's drift bound ⌈(N−i)/a⌉ (updates, ≥ 0).
    """

    def __init__(self, params: list[torch.Tensor], mode: str, bound: int):
        self.params, self.mode, self.bound = params, mode, bound
        # the last applied update, and room for the live weights during a predicted forward
        self.last_update = [torch.zeros_like(p) for p in params]
        self.scratch = [torch.empty_like(p) for p in params]

    @torch.no_grad()
    def snapshot(self, ctx: UpdateContext) -> None:
        for d, p in zip(self.last_update, ctx.params):
            d.copy_(p)

    @torch.no_grad()
    def record(self, ctx: UpdateContext) -> None:
        for d, p in zip(self.last_update, ctx.params):
            d.neg_().add_(p)

    def steps(self, mean_drift: float | None) -> float:
        """s: the bound, or ``mean_drift`` (0 while it is ``None``: no backward yet)."""
        if self.mode == "bound":
            return float(self.bound)
        return 0.0 if mean_drift is None else mean_drift

    def predicted(self, s: float, version: int):
        """Context of a forward at weight ``version`` on the predicted weights (a no-op before the
        first update or when s = 0)."""
        if s == 0 or version == 0:
            return contextlib.nullcontext()
        return moved(self.params, self.last_update, s, self.scratch)


class PipeMareVelocity:
    """PipeMare's velocity estimate δ (arXiv 1910.05124 §3.2, T2) and its two steps:
    ``velocity.snapshot`` keeps W before the step, ``velocity.update`` sets
    δ ← γ δ + (1 − γ)(W − W_prev) (a skipped update decays δ).

    Args:
        params: the live parameters.
        decay: γ.
    """

    def __init__(self, params: list[torch.Tensor], decay: float):
        self.decay = decay
        self.velocity = [torch.zeros_like(p) for p in params]
        self._before: list[torch.Tensor] | None = None

    def snapshot(self, ctx: UpdateContext) -> None:
        self._before = [p.detach().clone() for p in ctx.params]

    @torch.no_grad()
    def update(self, ctx: UpdateContext) -> None:
        for v, p, b in zip(self.velocity, ctx.params, self._before):
            v.mul_(self.decay).add_(p - b, alpha=1.0 - self.decay)
        self._before = None

    def corrected(self, params: list[torch.Tensor], drift: int):
        """Context of a backward ``drift`` updates after its forward: the live weights at W − Δ·δ."""
        return moved(params, self.velocity, -float(drift), [p.detach().clone() for p in params])


@contextlib.contextmanager
def moved(params: list[torch.Tensor], deltas: list[torch.Tensor], alpha: float, saved: list[torch.Tensor]):
    """Runs the block on ``params`` moved by ``alpha · deltas`` (in place: graphs built under
    ``SavedByReference`` follow them), then restores them exactly from ``saved`` (filled here; never a
    parameter swap, see versions.py)."""
    with torch.no_grad():
        for p, d, c in zip(params, deltas, saved):
            c.copy_(p)
            p.add_(d, alpha=alpha)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, c in zip(params, saved):
                p.copy_(c)


def ordered(steps: dict[str, UpdateStep]) -> list[tuple[str, UpdateStep]]:
    """``steps`` (name → step) as ``(name, step)`` pairs in :data:`UPDATE_ORDER`.

    Raises:
        ValueError: a name that is not in :data:`UPDATE_ORDER`.
    """
    unknown = sorted(set(steps) - set(UPDATE_ORDER))
    if unknown:
        raise ValueError(f"update steps {unknown} are not in UPDATE_ORDER (valid: {', '.join(UPDATE_ORDER)})")
    return [(name, steps[name]) for name in UPDATE_ORDER if name in steps]


def run_steps(steps: list[tuple[str, UpdateStep]], ctx: UpdateContext) -> None:
    for _, step in steps:
        step(ctx)
