"""One stage's work: forward, backward and optimizer update (shared by every engine)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from unbubble.optim.error_feedback import ErrorFeedback, check_coefficient
from unbubble.runtime import pytree
from unbubble.runtime.compiled import COMPILED_PREFIX, compile_stage
from unbubble.runtime.guard import MAX_DROPPED_UPDATES as MAX_DROPPED_UPDATES  # re-exported
from unbubble.runtime.guard import NonFiniteGuard, finite as _finite
from unbubble.runtime.held import HeldBytes
from unbubble.runtime.precision import check_modes, compute_context, device_type, fold_grads, replayed_rng, \
    rng_state, tensor_bytes
from unbubble.runtime.update import PREPARE_STEPS, ErrorFeedbackSteps, GradClip, GradSync, MasterCopy, MeanLoss, \
    OptimizerStep, PipeMareVelocity, UpdateContext, UpdateStep, WeightPrediction, ordered, run_steps
from unbubble.runtime.versions import SavedByReference
from unbubble.schedules.actions import Action, ActionKind

#: ``batch_fn(k) -> (inputs, targets)``: each a tensor or a pytree of them ([Note: stage boundaries
#: carry pytrees] in docs/architecture.md).
BatchFn = Callable[[int], tuple[Any, Any]]
LossFn = Callable[[Any, Any], torch.Tensor]


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
        module: the stage's layers, called with one argument. Input: the batch's inputs as
            ``batch_fn`` gives them on the first stage (token ids ``(B, T)`` int64, or a dict),
            else the previous stage's output; output: a tensor or a pytree of tensors
            ([Note: stage boundaries carry pytrees] in docs/architecture.md).
        loss_fn: on the last stage, ``loss_fn(output, targets) -> scalar`` mean loss.
        batch_fn: ``batch_fn(k) -> (inputs, targets)`` for global micro-batch id k; the
            first stage reads inputs, the last stage reads targets (deterministic in k, so
            labels never travel through the pipe).
        optimizer: updates ``module``'s parameters.
        loss_scale: multiplies each micro-batch loss before backward (1/a for PACI, 1/m for
            flushed schedules) so an update applies the mean gradient.
        lr_scheduler: stepped once after every update.
        clip_grad_norm: a plain local clip at this threshold before each update (off if None),
            for direct users of the executor; the engines attach a ``clipping.RankClipper`` as
            ``clipper`` instead (global, stale or per-stage clipping, [Note: clip scopes] in
            docs/architecture.md).
        backward_weights: ``"current"`` (PACI, 1F1B: the live weights), ``"stashed"``
            (PipeDream, 2BW: the version the forward used, kept as separate tensors and used
            through ``torch.func.functional_call``; live parameters are never swapped), or
            ``"corrected"`` (PipeMare T2: live weights moved back by Δ·δ during the backward).
        velocity_decay: γ of PipeMare's velocity estimate δ (T2).
        grad_sync: ``grad_sync(params, step_loss) -> step_loss`` run at the start of every
            update (data parallelism: averages the gradients and the last stage's step loss
            over the replicas, ``data_parallel.GradientAverager``); ``None`` for one replica.
        device: where the module lives; micro-batches from ``batch_fn`` are moved there.
            ``None`` leaves them where ``batch_fn`` puts them.
        nan_policy: the non-finite guard, one of ``unbubble.config.NAN_POLICIES``
            ([Note: non-finite guard] in ``guard.py``).
        nan_lr_factor: with ``"lower-lr"``, the stage's learning rate is multiplied by this
            after each dropped micro-batch.
        precision: ``"fp32"``, ``"bf16-autocast"`` or ``"bf16"`` ([Note: precision and version
            semantics] in docs/architecture.md).
        masters: with ``"bf16"``, the fp32 master copies of the (bf16) parameters, in
            ``module.parameters()`` order: the tensors ``optimizer`` steps
            (``precision.to_bf16``). Gradients accumulate in their ``.grad`` (fp32).
        recompute: ``"none"`` or ``"full"``: keep only the stage's input and RNG state per
            in-flight micro-batch and re-run the forward right before its backward.
        predict_weights: ``"none"``, ``"bound"`` or ``"measured"``: each forward runs on the
            predicted weights Ŵ = W + s·(W − W_prev), the last applied update extrapolated s
            updates ahead, with s = ``predict_bound`` (the stage's drift bound ⌈(N−i)/a⌉) or the
            mean drift Δ this stage has measured so far; the backward still uses the current
            weights with the forward-time activations ([Note: weight prediction]).
        predict_bound: s under ``"bound"`` (updates, ≥ 0).
        error_feedback: c of error feedback (Zmushko et al., arXiv 2606.30634): each update applies
            x_{t+1} = x_t − u_t − c·(u_t − u_{t−1}), u_t the optimizer's full step, the first update
            plain; 0 = off ([Note: error feedback] in ``optim/error_feedback.py``).
        compile_backend: ``None`` (eager) or a ``torch.compile`` backend (``"inductor"``,
            ``"aot_eager"``): every forward calls ``torch.compile(module)``; the loss stays eager
            ([Note: compiled stages] in ``compiled.py``).
        rng_seed: each forward of micro-batch k first seeds the stage device's generator from
            (``rng_seed``, stage, k) ([Note: random numbers per micro-batch]); ``None`` draws from the
            caller's stream as it runs.

    Memory is measured, not estimated (:meth:`memory_bytes`): the bytes autograd saves in a
    forward (``precision.SavedBytes``, once per input shape and dtype), split into activations
    and per-forward weight copies, held from F until the micro-batch's backward ends.

    On CUDA nothing in F, B, I or W synchronises with the host: the last stage keeps each
    micro-batch's loss as a device tensor and reads the step's losses once, at ``U``.
    """

    def __init__(self, stage: int, n_stages: int, module: nn.Module, loss_fn: LossFn | None,
                 batch_fn: BatchFn, optimizer: torch.optim.Optimizer, loss_scale: float,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 clip_grad_norm: float | None = None, backward_weights: str = "current",
                 velocity_decay: float = 0.9, grad_sync: Callable[[list, float | None], float | None] | None = None,
                 device: torch.device | None = None, nan_policy: str = "skip", nan_lr_factor: float = 0.5,
                 precision: str = "fp32", masters: list[nn.Parameter] | None = None, recompute: str = "none",
                 predict_weights: str = "none", predict_bound: int = 0, compile_backend: str | None = None,
                 rng_seed: int | None = None, error_feedback: float = 0.0):
        check_modes(precision, recompute, device)
        check_coefficient(error_feedback)
        if predict_weights not in ("none", "bound", "measured"):
            raise ValueError(f"predict_weights={predict_weights!r} is invalid: must be none, bound or measured")
        if predict_weights != "none" and (backward_weights != "current" or recompute != "none"):
            raise ValueError(f"predict_weights={predict_weights!r} needs backward_weights='current' and "
                             f"recompute='none' (got {backward_weights!r}, {recompute!r})")
        if (precision == "bf16") != (masters is not None):
            raise ValueError(f"precision={precision!r} {'needs' if precision == 'bf16' else 'takes no'} fp32 master "
                             "copies (masters=precision.to_bf16(module))")
        self.stage, self.n_stages = stage, n_stages
        self.module, self.loss_fn, self.batch_fn = module, loss_fn, batch_fn
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.loss_scale, self.clip_grad_norm = loss_scale, clip_grad_norm
        self.params = [p for p in module.parameters() if p.requires_grad]
        #: every forward with autograd runs under these: its backward may follow in-place updates of the
        #: parameters ([Note: backward on current weights] in ``versions.py``)
        self._by_reference = SavedByReference(self.params)
        self.precision, self.recompute, self.masters = precision, recompute, masters
        #: where gradients accumulate and what the optimizer steps: the fp32 masters under bf16
        self.grad_params = self.params if masters is None else list(masters)
        self._device_type = device_type(module)
        self._replay: dict[int, tuple] = {}  # recompute: k -> (forward input, RNG state)
        #: bytes held per in-flight micro-batch, measured (``held.py``)
        self.held = HeldBytes(module, by_value=compile_backend is not None)
        self.peak_grad_bytes = 0
        self.version = 0
        self.store: dict[int, tuple] = {}  # k -> (input leaf or leaves, output) [+ incoming gradient between I and W]
        self.backward_weights = backward_weights
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        # stashing: version -> (tensors named like the parameters, in-flight micro-batches using them)
        self.stash: dict[int, list] = {}
        self.fwd_version: dict[int, int] = {}
        self.device = device
        self.losses: dict[int, torch.Tensor] = {}  # k -> unscaled loss, detached 0-dim (last stage)
        self.last_step_loss: float | None = None  # mean loss of the last update (last stage)
        #: the non-finite guard ([Note: non-finite guard] in ``guard.py``)
        self.guard = NonFiniteGuard(stage, nan_policy, nan_lr_factor, optimizer, lr_scheduler)
        self._dropped: set[int] = set()  # split backward (I then W): dropped at I
        self.drift_sum = self.drift_count = 0  # backwards' Δ on this stage (for predict_weights="measured")
        #: weight prediction's state and steps ([Note: weight prediction]); None when off
        self.prediction = None if predict_weights == "none" else \
            WeightPrediction(self.params, predict_weights, predict_bound)
        #: PipeMare T2's velocity estimate and steps (``backward_weights="corrected"``); None otherwise
        self.pipemare = PipeMareVelocity(self.params, velocity_decay) if backward_weights == "corrected" else None
        #: error feedback on what the optimizer steps (the fp32 masters under bf16); None when off
        self.error_feedback = ErrorFeedback(self.grad_params, error_feedback) if error_feedback else None
        #: what a forward calls: the module, or torch.compile of it (same parameters)
        self.compile_backend = compile_backend
        self._call = module if compile_backend is None else compile_stage(module, compile_backend)
        self._prefix = "" if compile_backend is None else COMPILED_PREFIX
        self.rng_seed = rng_seed
        #: the rank's ``clipping.RankClipper`` ([Note: clip scopes]); ``None``: ``clip_grad_norm`` alone
        self.clipper = None
        #: updates clipped, skipped (non-finite norm) and, under ``stale``, clipped locally before the first global norm
        self.clip_stats = {"clipped": 0, "skipped": 0, "local": 0}
        #: ``stale``: this stage's per-tensor norms of its last s updates (checkpointed, [Note: stale lag])
        self.clip_recent: dict[int, torch.Tensor] = {}
        self._step_loss = MeanLoss()  # the last stage's losses of the update in progress
        #: the update's steps this stage's options enable, in ``update.UPDATE_ORDER``: the first part
        #: (``prepare_update``) and the second (``update``)
        steps = self._update_steps(grad_sync)
        self.prepare_steps = [(name, step) for name, step in steps if name in PREPARE_STEPS]
        self.apply_steps = [(name, step) for name, step in steps if name not in PREPARE_STEPS]
        self._prepared = -1  # the version whose update's first part (prepare_update) has run
        self._ctx: UpdateContext | None = None  # that update's context, until update() runs its second part

    def _update_steps(self, grad_sync) -> list[tuple[str, UpdateStep]]:
        """The update's steps for this stage's options, in ``UPDATE_ORDER`` (``runtime/update.py``)."""
        steps: dict[str, UpdateStep] = {"non_finite": self.guard.apply, "step_loss": self._step_loss.apply,
                                        "clip": GradClip(self.clip_grad_norm).apply,
                                        "optimizer": OptimizerStep(self.optimizer).apply}
        if grad_sync is not None:
            steps["grad_sync"] = GradSync(grad_sync).apply
        if self.pipemare is not None:
            steps["velocity.snapshot"], steps["velocity.update"] = self.pipemare.snapshot, self.pipemare.update
        if self.prediction is not None:
            steps["prediction.snapshot"], steps["prediction.record"] = self.prediction.snapshot, self.prediction.record
        if self.error_feedback is not None:
            ef = ErrorFeedbackSteps(self.error_feedback)
            steps["error_feedback.snapshot"], steps["error_feedback.correct"] = ef.snapshot, ef.correct
        if self.masters is not None:
            steps["masters"] = MasterCopy(self.masters).apply
        return ordered(steps)

    @property
    def events(self) -> list[dict[str, Any]]:
        """What this stage dropped or skipped (the guard's and the clipper's events), drained by the engine."""
        return self.guard.events

    @property
    def lr_factor(self) -> float:
        """The product of the non-finite guard's learning-rate cuts (``nan_policy="lower-lr"``)."""
        return self.guard.lr_factor

    @property
    def n_dropped(self) -> int:
        """Micro-batches (and updates) the non-finite guard dropped so far."""
        return self.guard.n_dropped

    @property
    def velocity(self) -> list[torch.Tensor] | None:
        """PipeMare T2's velocity δ, one tensor per parameter; ``None`` unless ``backward_weights="corrected"``."""
        return None if self.pipemare is None else self.pipemare.velocity

    @property
    def last_update(self) -> list[torch.Tensor] | None:
        """Weight prediction's last applied update W − W_prev; ``None`` when prediction is off."""
        return None if self.prediction is None else self.prediction.last_update

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
            inp, x = None, self._on_device(self.batch_fn(k)[0])
            if self.masters is not None:  # bf16: float inputs in the weights' dtype
                x = pytree.tree_map(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, x)
        else:  # inp: the input's leaves whose gradients go upstream (a tensor input: itself)
            x, inp = pytree.input_leaves(activation)
        self.fwd_version[k] = self.version
        if self.rng_seed is not None:
            seed_forward(self.rng_seed, self.stage, k, self._device_type)
        if self.backward_weights == "stashed":
            self._stashed_weights()  # registers this micro-batch with the current version's stash
        if self.recompute == "full":  # keep the input and the RNG state; the graph is rebuilt at B
            state = rng_state(self._device_type)
            with torch.no_grad():
                out, loss = self._compute(k, x)
            self._replay[k] = (x, state)
            self.store[k] = (inp, None)
            self.held.hold(k, (pytree.storage_bytes(x), 0, 0), "input")  # a view keeps its whole storage
        else:
            with self._by_reference(), self.held.measured("forward", x) as sizes, self._predicted():
                out, loss = self._compute(k, x)
            self.store[k] = (inp, out)
            self.held.hold(k, (sizes[0], sizes[1], 0), "forward")
            self.held.per_mb["input"] = pytree.storage_bytes(x)  # what recomputation would keep (sim.memory)
        if self.is_last:
            self.losses[k] = loss  # read at U: no host synchronisation per micro-batch
            return None
        return pytree.detach_output(out, all_floating=self.recompute == "full")

    def _compute(self, k: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's function on ``x`` with the weights micro-batch ``k``'s backward will use
        (the live ones, or its forward's stashed version), in the precision's context.

        Returns:
            ``(output, None)``, or on the last stage ``(loss × loss_scale, detached loss)``.
        """
        with compute_context(self.precision, self._device_type):
            if self.backward_weights == "stashed":
                stash = self.stash[self.fwd_version[k]][0]
                out = functional_call(self._call, {self._prefix + n: t for n, t in stash.items()}, (x,))
            else:
                out = self._call(x)
            if not self.is_last:
                return out, None
            # the loss (log-softmax over the vocabulary) in fp32
            out = pytree.tree_map(lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t,
                                  out)
            loss = self.loss_fn(out, self._on_device(self.batch_fn(k)[1]))
        return loss * self.loss_scale, loss.detach()

    def _recompute(self, k: int) -> torch.Tensor:
        """Re-runs micro-batch ``k``'s forward with autograd, on the weights in use now (v_B, the
        stashed v_F, or PipeMare's corrected ones) and its forward's RNG state; its input's leaves
        are the ones F stored (their requires_grad flags kept).

        Returns:
            The output, or on the last stage the scaled loss.
        """
        x, state = self._replay.pop(k)
        with replayed_rng(state), self._by_reference(), self.held.measured("recomputed", x) as sizes:
            out, _ = self._compute(k, x)
        self.held.hold(k, (0, sizes[1], sizes[0]), "recomputed")
        return out

    @property
    def held_bytes(self) -> list[int]:
        """Bytes the in-flight micro-batches hold now: stored from F, weight copies, recomputed."""
        return self.held.now

    def memory_bytes(self) -> dict[str, Any]:
        """This stage's measured memory, bytes (the run's summary.json ``memory`` entry).

        Returns:
            ``precision``, ``recompute``; ``param_bytes`` (the module's parameters as stored:
            fp32, or bf16 under ``"bf16"``); ``master_bytes`` (fp32 masters, 0 unless bf16);
            ``grad_bytes`` (largest accumulated gradient seen at an update, fp32);
            ``optimizer_state_bytes``; ``stored_activation_bytes`` (peak of what in-flight
            micro-batches keep from F to their backward: saved activations, or only the inputs
            under recomputation), ``activation_bytes`` (peak of that plus the activations of a
            micro-batch recomputed for its backward), ``weight_copy_bytes`` (peak of the weight
            copies forwards saved: autocast's bf16 casts); ``prediction_bytes`` (weight prediction's
            two weight-sized buffers: the last applied update and the live weights during a
            predicted forward; 0 without prediction); ``error_feedback_bytes`` (error feedback's two
            buffers like what the optimizer steps, fp32 masters under bf16: the last uncorrected update and the
            weights before the step; 0 when off); ``per_micro_batch`` (one micro-batch's
            bytes: ``forward`` saved by a forward, ``input`` the stage's input (what recomputation keeps),
            ``recomputed`` saved by a recomputed forward, ``weight_copies`` the weight-copy part).
        """
        from unbubble.optim import optimizer_state_bytes

        return {"precision": self.precision, "recompute": self.recompute,
                "param_bytes": tensor_bytes(self.params),
                "master_bytes": tensor_bytes(self.masters or []),
                "grad_bytes": self.peak_grad_bytes,
                "optimizer_state_bytes": optimizer_state_bytes(self.optimizer)["state_bytes"],
                "stored_activation_bytes": self.held.peak[0], "activation_bytes": self.held.peak[2],
                "weight_copy_bytes": self.held.peak[1],
                "prediction_bytes": 0 if self.prediction is None else tensor_bytes(self.prediction.last_update
                                                                                    + self.prediction.scratch),
                "error_feedback_bytes": 0 if self.error_feedback is None else self.error_feedback.nbytes(),
                "per_micro_batch": dict(self.held.per_mb)}

    def _on_device(self, t):
        """A micro-batch (tensor or pytree) from ``batch_fn`` on the stage's device (non-blocking copies)."""
        return t if self.device is None else pytree.tree_map(lambda x: x.to(self.device, non_blocking=True), t)

    def backward(self, k: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Full backward of micro-batch ``k``; accumulates into the parameters' ``.grad``.

        Args:
            k: global micro-batch id (its forward must have run on this stage).
            grad: gradient of the loss w.r.t. this stage's output, shaped like the output
                (ignored on the last stage); for a pytree output, a tuple with one gradient
                (or ``None``) per gradient-carrying leaf ([Note: stage boundaries carry pytrees]).

        Returns:
            Gradient w.r.t. this stage's input, to send to the previous stage (a tensor, or for
            a pytree input a tuple of ``Tensor | None``), or ``None`` on the first stage.
            NaN-filled if the guard dropped ``k``.

        Raises:
            NonFiniteError: non-finite loss or gradient under ``nan_policy="abort"``.
        """
        inp, out = self.store.pop(k)
        if self._incoming_bad(k, grad):
            return self._drop(k, inp, self._incoming_reason)
        with self._backward_weights(k):
            if self.recompute == "full":
                out = self._recompute(k)
            if self.is_last:
                out.backward()
            else:
                outs, grads = pytree.grad_outputs(out, grad, self.recompute == "full")
                if outs:
                    torch.autograd.backward(outs, grads)
        self._finish(k)
        if inp is None:
            return None
        gx = inp.grads()
        if self.guard.on and not _finite(pytree.tensors(gx)):  # its weight gradient is in the sum now
            self.guard.tainted = True
            return self.guard.poison(inp, k, "input gradient (this stage's update is dropped)", self.version)
        return gx

    def backward_input(self, k: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """``I``: the input gradient of micro-batch ``k`` only; its weight gradient waits for ``W``.

        Returns:
            Gradient w.r.t. this stage's input (``None`` on the first stage).
        """
        inp, out = self.store[k]
        self.store[k] = (inp, out, grad)
        if self._incoming_bad(k, grad):
            self._dropped.add(k)
            return self.guard.poison(inp, k, self._incoming_reason, self.version)
        with self._backward_weights(k):
            if self.recompute == "full":  # the graph is kept from I until W
                out = self._recompute(k)
                self.store[k] = (inp, out, grad)
            if inp is None:
                return None
            if self.is_last:
                outs, grads = [out], [None]
            else:
                outs, grads = pytree.grad_outputs(out, grad, self.recompute == "full")
            leaves = inp.leaves
            gx = inp.pack(torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
                          if outs and leaves else [None] * len(leaves))
        if self.guard.on and not _finite(pytree.tensors(gx)):
            self._dropped.add(k)
            return self.guard.poison(inp, k, "input gradient", self.version)
        return gx

    def backward_weight(self, k: int) -> None:
        """``W``: the weight gradient of micro-batch ``k`` (after its ``I``), accumulated into ``.grad``."""
        _, out, grad = self.store.pop(k)
        if k in self._dropped:
            self._dropped.discard(k)
            self._release(k)
            return
        with self._backward_weights(k):
            if self.is_last:
                torch.autograd.backward(out, inputs=self._grad_targets(k))
            else:
                outs, grads = pytree.grad_outputs(out, grad, self.recompute == "full")
                if outs:
                    torch.autograd.backward(outs, grads, inputs=self._grad_targets(k))
        self._finish(k)

    # -- the non-finite guard's per-micro-batch part ([Note: non-finite guard] in ``guard.py``) -------
    def _incoming_bad(self, k: int, grad: Any) -> bool:
        """Whether micro-batch ``k``'s loss (last stage) or incoming gradient ``grad`` is non-finite."""
        if not self.guard.on:
            return False
        return self.guard.incoming_bad(self.losses[k] if self.is_last else None, pytree.tensors(grad))

    @property
    def _incoming_reason(self) -> str:
        return "loss" if self.is_last else "gradient from the next stage"

    def _drop(self, k: int, inp, what: str) -> torch.Tensor | None:
        """Discards micro-batch ``k`` before its backward and returns the poison for upstream."""
        for p in self.grad_params:  # a zero contribution: the update still comes (momentum moves on)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        poison = self.guard.poison(inp, k, what, self.version)
        self._release(k)
        return poison

    def _release(self, k: int) -> None:
        """Forgets micro-batch ``k`` without using its gradients."""
        self._replay.pop(k, None)
        self.held.release(k)
        version = self.fwd_version.pop(k)
        if self.is_last:
            self.losses.pop(k, None)
        if self.backward_weights == "stashed":
            entry = self.stash[version]
            entry[1] -= 1
            if entry[1] == 0 and version != self.version:
                del self.stash[version]

    # -- weight versions for the backward ----------------------------------------------------
    def _stashed_weights(self) -> dict[str, torch.Tensor]:
        """The current version's stash (separate tensors; created on its first forward)."""
        entry = self.stash.get(self.version)
        if entry is None:
            tensors = {n: p.detach().clone().requires_grad_(True) for n, p in zip(self.names, self.params)}
            entry = self.stash[self.version] = [tensors, 0]
        entry[1] += 1
        return entry[0]

    def _grad_targets(self, k: int) -> list[torch.Tensor]:
        if self.backward_weights == "stashed":
            return list(self.stash[self.fwd_version[k]][0].values())
        return self.params

    def _backward_weights(self, k: int):
        """Context in which the backward of ``k`` computes (PipeMare T2 moves the live weights)."""
        drift = self.version - self.fwd_version[k]
        if self.backward_weights != "corrected" or drift == 0:
            return contextlib.nullcontext()
        return self._corrected(drift)

    def _corrected(self, drift: int):
        # PipeMare T2 (arXiv 1910.05124 §3.2): backward on w − Δ·δ
        return self.pipemare.corrected(self.params, drift)

    @property
    def predict_steps(self) -> float:
        """s of weight prediction: the stage's drift bound, or its mean measured drift so far
        (0 before its first backward); 0 when prediction is off."""
        if self.prediction is None:
            return 0.0
        return self.prediction.steps(self.drift_sum / self.drift_count if self.drift_count else None)

    def _predicted(self):
        """Context of a forward under weight prediction: the live weights are W + s·(W − W_prev).

        [Note: weight prediction] SpecTrain (arXiv 1809.02839 §4) and PipeOptim (arXiv 2312.00839)
        run a forward on the weights it expects its backward to meet; here the extrapolated step is
        the update the optimizer last *applied* (for Muon the orthogonalised step), not the raw
        momentum; with error feedback it is the corrected step, the one the weights moved by. The
        weights are moved in place and restored exactly, so the autograd graph saves the parameters
        by reference as in PACI: the backward's input gradient uses the current weights and its
        weight gradient the activations of the predicted forward.
        """
        if self.prediction is None:
            return contextlib.nullcontext()
        return self.prediction.predicted(self.predict_steps, self.version)

    def _finish(self, k: int) -> None:
        """After the backward of ``k``: move stashed-version gradients to the live parameters."""
        self.guard.kept_since_update += 1
        self.held.release(k)
        version = self.fwd_version.pop(k)
        self.drift_sum += self.version - version
        self.drift_count += 1
        if self.is_last:
            self._step_loss.pending.append(self.losses.pop(k))
        if self.backward_weights == "stashed":
            entry = self.stash[version]
            for p, t in zip(self.params, entry[0].values()):
                if t.grad is not None:
                    p.grad = t.grad if p.grad is None else p.grad.add_(t.grad)
                    t.grad = None
            entry[1] -= 1
            if entry[1] == 0 and version != self.version:
                del self.stash[version]
        if self.masters is not None:
            fold_grads(self.params, self.masters)

    def weights_version(self, action: Action) -> int:
        """Version of the weights ``action`` computes with (the forward's, when stashed)."""
        if self.backward_weights == "stashed" and action.kind in (ActionKind.B, ActionKind.I, ActionKind.W):
            return self.fwd_version[action.mb]
        return self.version

    @property
    def live_versions(self) -> int:
        """Weight versions held besides the live parameters (stashed copies)."""
        return len(self.stash)

    @property
    def idle(self) -> bool:
        """True at a cut: no stored activation, stashed version or accumulated gradient."""
        return not (self.store or self.stash or self._step_loss.pending or self._replay
                    or any(p.grad is not None for p in self.grad_params))

    def state_dict(self) -> dict[str, Any]:
        """The stage's training state at a cut ([Note: the checkpoint cut] in ``checkpoint.py``).

        Raises:
            RuntimeError: the stage is not idle (something is in flight).
        """
        if not self.idle:
            raise RuntimeError(f"stage {self.stage} is not at a cut: {len(self.store)} micro-batches in flight, "
                               f"{len(self.stash)} stashed versions")
        sched = self.lr_scheduler
        return {
            "version": self.version,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if sched is None else {"last_epoch": sched.last_epoch,
                                                        "base_lrs": list(sched.base_lrs)},
            "velocity": self.velocity,
            "lr_factor": self.guard.lr_factor,
            "last_step_loss": self.last_step_loss,
            "masters": None if self.masters is None else [m.detach() for m in self.masters],
            # the masters' parameter names: what export writes in place of the bf16 parameters
            "master_names": None if self.masters is None else list(self.names),
            "last_update": self.last_update,
            "drift_stats": (self.drift_sum, self.drift_count),
            "error_feedback": None if self.error_feedback is None else self.error_feedback.state_dict(),
            "clip": {"stats": dict(self.clip_stats), "recent": dict(self.clip_recent)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (the module must have the same parameters)."""
        self.module.load_state_dict(state["model"])
        if self.masters is not None:  # fp32 masters: the bf16 parameters alone would lose their low bits
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        sched = self.lr_scheduler
        if sched is not None and state["lr_scheduler"] is not None:
            sched.last_epoch = state["lr_scheduler"]["last_epoch"]
            sched.base_lrs = list(state["lr_scheduler"]["base_lrs"])
            sched._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        if self.velocity is not None and state["velocity"] is not None:
            for v, saved in zip(self.velocity, state["velocity"]):
                v.copy_(saved)
        if self.last_update is not None and state.get("last_update") is not None:
            for d, saved in zip(self.last_update, state["last_update"]):
                d.copy_(saved)
        self.drift_sum, self.drift_count = state.get("drift_stats", (0, 0))
        if self.error_feedback is not None and state.get("error_feedback") is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])
        clip = state.get("clip") or {}
        self.clip_stats.update(clip.get("stats", {}))
        self.clip_recent = dict(clip.get("recent", {}))
        self.version = state["version"]
        self.guard.lr_factor = state["lr_factor"]
        self.last_step_loss = state["last_step_loss"]

    def prepare_update(self) -> None:
        """The first part of ``U``, before clipping (runs once per update; a rank's clipper calls it
        for each of its stages before their norms are exchanged): the steps ``non_finite`` (the
        guard's update-time check and the divergence stop), ``step_loss`` (last stage) and
        ``grad_sync`` (data parallelism: the average over the replicas), ``update.UPDATE_ORDER``."""
        if self._prepared == self.version:
            return
        self._prepared = self.version
        self._ctx = UpdateContext(self.version, self.params, self.grad_params, clipper=self.clipper, executor=self)
        run_steps(self.prepare_steps, self._ctx)

    def update(self) -> None:
        """Applies the accumulated gradients, zeroes them and bumps the weight version.

        Runs the update's steps in ``update.UPDATE_ORDER`` (the first part through
        :meth:`prepare_update`): with ``grad_sync`` (data parallelism) the gradients are first
        averaged over the replicas and the last stage's step loss becomes the replicas' mean; with a
        ``clipper`` the gradients are then clipped, or the update is skipped (no optimizer step, no
        error feedback, no bf16 copy) when the norm it clips by is non-finite ([Note: clip scopes]
        in docs/architecture.md).
        """
        self.prepare_update()
        ctx, self._ctx = self._ctx, None
        self.peak_grad_bytes = max(self.peak_grad_bytes, tensor_bytes([p.grad for p in self.grad_params]))
        run_steps(self.apply_steps, ctx)
        self.optimizer.zero_grad(set_to_none=True)
        if self.backward_weights == "stashed":  # drop the old version once nothing in flight uses it
            entry = self.stash.get(self.version)
            if entry is not None and entry[1] == 0:
                del self.stash[self.version]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.version += 1
        if ctx.step_loss is not None:
            self.last_step_loss = ctx.step_loss

    def run(self, action: Action, payload: torch.Tensor | None = None) -> torch.Tensor | None:
        """Dispatches one action; returns the tensor to send (or ``None``)."""
        if action.kind is ActionKind.F:
            return self.forward(action.mb, payload)
        if action.kind is ActionKind.B:
            return self.backward(action.mb, payload)
        if action.kind is ActionKind.I:
            return self.backward_input(action.mb, payload)
        if action.kind is ActionKind.W:
            self.backward_weight(action.mb)
            return None
        if action.kind is ActionKind.U:
            self.update()
            return None
        raise NotImplementedError(f"action {action}: kind {action.kind.value} is not supported by this executor")


# [Note: random numbers per micro-batch]
# A forward's random numbers (dropout masks) are a function of the job's seed, the replica, the
# stage and the micro-batch only: the generator of the stage's device is re-seeded right before
# each forward. The emulator (one stream, simulated order) and the stage processes (one stream per
# rank, arrival order) then draw the same masks, and a resumed run the same as an uninterrupted
# one. Seeding a generator costs microseconds per forward; recomputation saves and replays the
# state after the seeding, as before.


def seed_forward(seed: int, stage: int, k: int, device_type: str) -> None:
    """Seeds the generator a forward of micro-batch ``k`` on ``stage`` draws from (CPU, or the
    current CUDA device's) from ``seed``, ``stage`` and ``k``, mixed so that nearby ids give
    unrelated streams ([Note: random numbers per micro-batch])."""
    mixed = seed
    for part in (stage, k):  # a multiplicative hash per component, within torch's 64-bit seeds
        mixed = (mixed * 0x9E3779B97F4A7C15 + part + 1) % (1 << 63)
    if device_type == "cuda":
        torch.cuda.manual_seed(mixed)
    else:
        torch.random.default_generator.manual_seed(mixed)
