"""One stage's work: forward, backward and optimizer update (shared by every engine)."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from unbubble.errors import NonFiniteError
from unbubble.optim.error_feedback import ErrorFeedback, check_coefficient
from unbubble.runtime import pytree
from unbubble.runtime.compiled import COMPILED_PREFIX, compile_stage
from unbubble.runtime.precision import SavedBytes, check_modes, compute_context, copy_masters, device_type, \
    fold_grads, replayed_rng, rng_state, tensor_bytes
from unbubble.runtime.versions import SavedByReference
from unbubble.schedules.actions import Action, ActionKind

log = logging.getLogger(__name__)

#: The non-finite guard gives up after this many consecutive updates whose every micro-batch it
#: dropped (the weights themselves have diverged).
MAX_DROPPED_UPDATES = 10
_LOGGED_DROPS = 3

#: ``batch_fn(k) -> (inputs, targets)``: each a tensor or a pytree of them ([Note: stage boundaries
#: carry pytrees] in ``pytree.py``).
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
            ([Note: stage boundaries carry pytrees] in ``pytree.py``).
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
            ``runtime/clipping.py``).
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
            ([Note: non-finite guard]).
        nan_lr_factor: with ``"lower-lr"``, the stage's learning rate is multiplied by this
            after each dropped micro-batch.
        precision: ``"fp32"``, ``"bf16-autocast"`` or ``"bf16"`` ([Note: precision and version
            semantics] in ``precision.py``).
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
        # bytes held per micro-batch k: [stored from F (activations, or the input when recomputing),
        # weight copies saved by F, activations of a recomputed forward (from recompute to B / W)]
        self._held: dict[int, list[int]] = {}
        self.held_bytes = [0, 0, 0]  # now, summed over k
        self.peak_bytes = [0, 0, 0]  # maxima of: stored, weight copies, stored + recomputed
        self.mb_bytes: dict[str, int] = {}  # one micro-batch's measured bytes (last forward / recompute)
        self._sizes: dict[tuple, list[int]] = {}  # (forward or recomputed, input shape, dtype) -> saved bytes
        self.peak_grad_bytes = 0
        self.version = 0
        self.store: dict[int, tuple] = {}  # k -> (input leaf or leaves, output) [+ incoming gradient between I and W]
        self.backward_weights, self.velocity_decay = backward_weights, velocity_decay
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        # stashing: version -> (tensors named like the parameters, in-flight micro-batches using them)
        self.stash: dict[int, list] = {}
        self.fwd_version: dict[int, int] = {}
        self.velocity = [torch.zeros_like(p) for p in self.params] if backward_weights == "corrected" else None
        self.grad_sync, self.device = grad_sync, device
        self.losses: dict[int, torch.Tensor] = {}  # k -> unscaled loss, detached 0-dim (last stage)
        self._step_losses: list[torch.Tensor] = []  # losses of the micro-batches in the current update
        self.last_step_loss: float | None = None  # mean loss of the last update (last stage)
        self.nan_policy, self.nan_lr_factor = nan_policy, nan_lr_factor
        self.lr_factor = 1.0  # product of the guard's learning-rate cuts
        self.events: list[dict[str, Any]] = []  # non-finite micro-batches this stage dropped
        self._dropped: set[int] = set()  # split backward (I then W): dropped at I
        self._kept_since_update = self._all_dropped_updates = 0  # for the divergence stop
        self.n_dropped = 0  # micro-batches dropped by the guard so far
        self._tainted = False  # a non-finite gradient of this stage is in the accumulated sum
        self.predict_weights, self.predict_bound = predict_weights, predict_bound
        # weight prediction: the last applied update W − W_prev, and room for the live weights
        # during a predicted forward (both weight-sized, allocated once)
        self.last_update = [torch.zeros_like(p) for p in self.params] if predict_weights != "none" else None
        self._scratch = [torch.empty_like(p) for p in self.params] if predict_weights != "none" else None
        self.drift_sum = self.drift_count = 0  # backwards' Δ on this stage (for predict_weights="measured")
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
        self._prepared = -1  # the version whose update's first part (prepare_update) has run
        self._step_loss: float | None = None

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
            self._hold(k, (pytree.storage_bytes(x), 0, 0), "input")  # a view keeps its whole storage
        else:
            with self._by_reference(), self._measured("forward", x) as sizes, self._predicted():
                out, loss = self._compute(k, x)
            self.store[k] = (inp, out)
            self._hold(k, (sizes[0], sizes[1], 0), "forward")
            self.mb_bytes["input"] = pytree.storage_bytes(x)  # what recomputation would keep (sim.memory)
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
        with replayed_rng(state), self._by_reference(), self._measured("recomputed", x) as sizes:
            out, _ = self._compute(k, x)
        self._hold(k, (0, sizes[1], sizes[0]), "recomputed")
        return out

    @contextlib.contextmanager
    def _measured(self, what: str, x: Any):
        """Yields ``[activation bytes, weight-copy bytes]`` that the forward in the block saves;
        measured with ``SavedBytes`` the first time a ``what`` forward sees ``x``'s shapes and dtypes
        (saved sizes depend only on them), then reused: the hooks cost ≈ 4 % of a small forward."""
        key = (what, pytree.signature(x))
        sizes = self._sizes.get(key)
        if sizes is not None:
            yield sizes
            return
        sizes = [0, 0]
        # a recomputed forward's input is already counted as stored
        with SavedBytes(self.module, exclude=pytree.tensors(x) if what == "recomputed" else (),
                        by_value=self.compile_backend is not None) as saved:
            yield sizes
        sizes[:] = saved.activation_bytes, saved.weight_copy_bytes
        self._sizes[key] = sizes

    def _hold(self, k: int, sizes: tuple[int, int, int], what: str) -> None:
        """Counts ``sizes`` (stored, weight-copy, recomputed bytes) as held for ``k``."""
        self.mb_bytes[what] = sum(sizes)
        if sizes[1]:
            self.mb_bytes["weight_copies"] = sizes[1]
        held = self._held.setdefault(k, [0, 0, 0])
        for i, b in enumerate(sizes):
            held[i] += b
            self.held_bytes[i] += b
        h = self.held_bytes
        self.peak_bytes = [max(self.peak_bytes[0], h[0]), max(self.peak_bytes[1], h[1]),
                           max(self.peak_bytes[2], h[0] + h[2])]

    def _unhold(self, k: int) -> None:
        for i, b in enumerate(self._held.pop(k, (0, 0, 0))):
            self.held_bytes[i] -= b

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
                "stored_activation_bytes": self.peak_bytes[0], "activation_bytes": self.peak_bytes[2],
                "weight_copy_bytes": self.peak_bytes[1],
                "prediction_bytes": tensor_bytes((self.last_update or []) + (self._scratch or [])),
                "error_feedback_bytes": 0 if self.error_feedback is None else self.error_feedback.nbytes(),
                "per_micro_batch": dict(self.mb_bytes)}

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
            return self._drop(k, inp, self._incoming_reason())
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
        if self.nan_policy != "off" and not _finite(pytree.tensors(gx)):  # its weight gradient is in the sum now
            self._tainted = True
            return self._poison(inp, k, "input gradient (this stage's update is dropped)")
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
            return self._poison(inp, k, self._incoming_reason())
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
        if self.nan_policy != "off" and not _finite(pytree.tensors(gx)):
            self._dropped.add(k)
            return self._poison(inp, k, "input gradient")
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

    # -- [Note: non-finite guard] -------------------------------------------------------------
    # Checked per micro-batch: the loss (last stage) and the incoming gradient; a micro-batch that
    # fails contributes a zero gradient here and the stage sends a NaN-filled gradient upstream,
    # which every earlier stage recognises and drops in turn (stages downstream of the one that
    # found it have applied their finite part). The update still comes, with the other
    # micro-batches' gradients and the usual 1/a (1/m) scale. Checked per backward: the input
    # gradient this stage sends, and per update: the accumulated weight gradients (one norm). A
    # non-finite gradient made inside the stage is already in the sum, so that stage's whole
    # update becomes a zero gradient, and the micro-batch is dropped upstream as above. "lower-lr"
    # also multiplies the stage's learning rate by ``nan_lr_factor`` per event; "abort" raises
    # ``NonFiniteError``. Each event is logged with stage, micro-batch and weight version
    # (``events``). A clean run computes exactly what it computes with the guard off; on CUDA each
    # check is one host synchronisation; ``nan_policy="off"`` removes them.

    def _incoming_bad(self, k: int, grad: Any) -> bool:
        if self.nan_policy == "off":
            return False
        if self.is_last:
            return not math.isfinite(float(self.losses[k]))
        return not _finite(pytree.tensors(grad))

    def _incoming_reason(self) -> str:
        return "loss" if self.is_last else "gradient from the next stage"

    def _drop(self, k: int, inp, what: str) -> torch.Tensor | None:
        """Discards micro-batch ``k`` before its backward and returns the poison for upstream."""
        for p in self.grad_params:  # a zero contribution: the update still comes (momentum moves on)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        poison = self._poison(inp, k, what)
        self._release(k)
        return poison

    def _poison(self, inp, k: int | None, what: str) -> torch.Tensor | None:
        event = {"stage": self.stage, "mb": k, "version": self.version, "what": what, "policy": self.nan_policy}
        if self.nan_policy == "abort":
            where = "" if k is None else f" in micro-batch {k}"
            raise NonFiniteError(f"stage {self.stage}: non-finite {what}{where} at weight version {self.version} "
                                 "(nan_policy='abort'; 'skip' drops the micro-batch instead)")
        if self.nan_policy == "lower-lr":
            self._scale_lr(self.nan_lr_factor)
            event["lr_factor"] = self.lr_factor
        self.events.append(event)
        self.n_dropped += 1
        if self.n_dropped <= _LOGGED_DROPS:  # every drop is in metrics.jsonl; the log shows the first few
            more = " (further drops of this stage: metrics.jsonl only)" if self.n_dropped == _LOGGED_DROPS else ""
            log.warning("stage %d dropped %s at weight version %d: non-finite %s%s", self.stage,
                        "its update" if k is None else f"micro-batch {k}", self.version, what, more)
        if inp is None:
            return None
        return inp.pack([torch.full_like(t, math.nan) for t in inp.leaves])  # one per gradient-carrying leaf

    def _check_divergence(self) -> None:
        """Raises once every micro-batch of :data:`MAX_DROPPED_UPDATES` consecutive updates was
        dropped (an update follows at least one backward, so none kept means all dropped): the
        weights have diverged and skipping more data cannot help."""
        kept, self._kept_since_update = self._kept_since_update, 0
        self._all_dropped_updates = 0 if kept else self._all_dropped_updates + 1
        if self._all_dropped_updates >= MAX_DROPPED_UPDATES:
            raise NonFiniteError(
                f"stage {self.stage}: every micro-batch of the last {MAX_DROPPED_UPDATES} updates had a non-finite "
                f"loss or gradient (weight version {self.version}): training diverged; start again with a lower "
                "--lr" + ("" if self.nan_policy == "lower-lr" else " or --nan-policy lower-lr"))

    def _scale_lr(self, factor: float) -> None:
        self.lr_factor *= factor
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        if self.lr_scheduler is not None:  # LambdaLR recomputes lr from base_lrs each step
            self.lr_scheduler.base_lrs = [lr * factor for lr in self.lr_scheduler.base_lrs]

    def _release(self, k: int) -> None:
        """Forgets micro-batch ``k`` without using its gradients."""
        self._replay.pop(k, None)
        self._unhold(k)
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
        return self._moved(self.velocity, -float(drift), [p.detach().clone() for p in self.params])

    @property
    def predict_steps(self) -> float:
        """s of weight prediction: the stage's drift bound, or its mean measured drift so far
        (0 before its first backward); 0 when prediction is off."""
        if self.predict_weights == "bound":
            return float(self.predict_bound)
        if self.predict_weights == "measured" and self.drift_count:
            return self.drift_sum / self.drift_count
        return 0.0

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
        s = self.predict_steps
        if self.last_update is None or s == 0 or self.version == 0:
            return contextlib.nullcontext()
        return self._moved(self.last_update, s, self._scratch)

    @contextlib.contextmanager
    def _moved(self, deltas: list[torch.Tensor], alpha: float, saved: list[torch.Tensor]):
        """Runs the block on the live weights moved by ``alpha · deltas`` (in place: graphs built under
        ``SavedByReference`` follow them), then restores them exactly from ``saved`` (filled here; never a
        parameter swap, see versions.py)."""
        with torch.no_grad():
            for p, d, c in zip(self.params, deltas, saved):
                c.copy_(p)
                p.add_(d, alpha=alpha)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, c in zip(self.params, saved):
                    p.copy_(c)

    def _finish(self, k: int) -> None:
        """After the backward of ``k``: move stashed-version gradients to the live parameters."""
        self._kept_since_update += 1
        self._unhold(k)
        version = self.fwd_version.pop(k)
        self.drift_sum += self.version - version
        self.drift_count += 1
        if self.is_last:
            self._step_losses.append(self.losses.pop(k))
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
        return not (self.store or self.stash or self._step_losses or self._replay
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
            "lr_factor": self.lr_factor,
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
        self.lr_factor = state["lr_factor"]
        self.last_step_loss = state["last_step_loss"]

    def prepare_update(self) -> None:
        """The first part of ``U``, before clipping (runs once per update; a rank's clipper calls it
        for each of its stages before their norms are exchanged): the non-finite guard's update-time
        check, the divergence stop, the last stage's step loss and, with ``grad_sync``, the average
        over the replicas."""
        if self._prepared == self.version:
            return
        self._prepared = self.version
        if self.nan_policy != "off":
            grads = [p.grad for p in self.grad_params if p.grad is not None]
            if self._tainted or not _finite(grads):
                if not self._tainted:
                    self._poison(None, None, "accumulated weight gradient (this stage's update is dropped)")
                # without clipping a zero-gradient update, as for a dropped micro-batch; with clipping a
                # non-finite norm, which skips the update (on every stage under sync, [Note: clip scopes])
                fill = 0.0 if self.clipper is None else math.nan
                for g in grads:
                    g.fill_(fill)
                self._tainted = False
                self._kept_since_update = 0  # counts as an update without a usable micro-batch
        self._check_divergence()
        step_loss = None
        if self._step_losses:  # one host synchronisation per update, on the last stage only
            values = torch.stack(self._step_losses).tolist()
            step_loss = sum(values) / len(values)
            self._step_losses = []
        if self.grad_sync is not None:
            step_loss = self.grad_sync(self.grad_params, step_loss)
        self._step_loss = step_loss

    def update(self) -> None:
        """Applies the accumulated gradients, zeroes them and bumps the weight version.

        With ``grad_sync`` (data parallelism) the gradients are first averaged over the
        replicas; the last stage's step loss becomes the replicas' mean. With a ``clipper`` the
        gradients are then clipped, or the update is skipped (no optimizer step) when the norm it
        clips by is non-finite ([Note: clip scopes] in ``runtime/clipping.py``).
        """
        self.prepare_update()
        step_loss, self._step_loss = self._step_loss, None
        apply = True
        if self.clipper is not None:
            apply = self.clipper.clip(self)
        elif self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.grad_params, self.clip_grad_norm)
        self.peak_grad_bytes = max(self.peak_grad_bytes, tensor_bytes([p.grad for p in self.grad_params]))
        before = [p.detach().clone() for p in self.params] if self.velocity is not None else None
        if self.last_update is not None:
            with torch.no_grad():
                for d, p in zip(self.last_update, self.params):
                    d.copy_(p)
        if self.error_feedback is not None and apply:
            self.error_feedback.snapshot()
        if apply:  # a skipped update moves nothing: weights, moments and error feedback stay
            # in place: in-flight graphs (built under SavedByReference) read the new weights at their backward
            self.optimizer.step()
            if self.error_feedback is not None:  # on the stepped tensors, before the bf16 copy
                self.error_feedback.correct()
            if self.masters is not None:  # bf16 parameters ← rounded fp32 masters, in place
                copy_masters(self.params, self.masters)
        # the applied update W − W_prev, as the weights hold it (error feedback's correction included)
        if self.last_update is not None:
            with torch.no_grad():
                for d, p in zip(self.last_update, self.params):
                    d.neg_().add_(p)
        self.optimizer.zero_grad(set_to_none=True)
        if before is not None:  # PipeMare T2 velocity: δ ← γ δ + (1 − γ)(w_new − w_old)
            with torch.no_grad():
                for v, p, b in zip(self.velocity, self.params, before):
                    v.mul_(self.velocity_decay).add_(p - b, alpha=1.0 - self.velocity_decay)
        if self.backward_weights == "stashed":  # drop the old version once nothing in flight uses it
            entry = self.stash.get(self.version)
            if entry is not None and entry[1] == 0:
                del self.stash[self.version]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.version += 1
        if step_loss is not None:
            self.last_step_loss = step_loss

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


def _finite(tensors: list[torch.Tensor | None]) -> bool:
    """True if every element of ``tensors`` is finite (max |x| per tensor, NaN and ±inf propagate;
    one host synchronisation; 5× cheaper on small CPU tensors than ``get_total_norm``)."""
    ts = [t.detach().abs().amax().float() for t in tensors if t is not None]
    return not ts or bool(torch.isfinite(torch.stack(ts)).all())


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
