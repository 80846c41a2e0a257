"""What to train: the picklable description every engine runs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from unbubble.runtime.checkpoint import Checkpointing, DamagedCheckpoint, check_fingerprint, fingerprint, load_stage, \
    rng_state, save_stage, set_rng_state
from unbubble.runtime.clipping import check_rank_updates
from unbubble.runtime.compiled import check_compile
from unbubble.runtime.data_parallel import replica_batch
from unbubble.runtime.executor import BatchFn, LossFn, StageExecutor
from unbubble.runtime.precision import check_modes, to_bf16
from unbubble.optim.lr_rescheduling import PipeDreamLR, StalenessLR
from unbubble.schedules.clip import check_clip
from unbubble.schedules.policy import Cuts, check_order
from unbubble.schedules.registry import Schedule

StageFn = Callable[[int], nn.Module]
OptimizerFn = Callable[[list[nn.Parameter], int], torch.optim.Optimizer]
LrLambda = Callable[[int], float]


@dataclass
class PipelineJob:
    """A pipeline training job, independent of the engine that runs it.

    Every callable must be picklable (a module-level function or a
    ``functools.partial`` of one) because the process engine rebuilds the job in each
    stage process.

    Attributes:
        stage_fn: ``stage_fn(stage) -> nn.Module`` builds 0-based stage ``stage``; called
            once per stage and process, it must be deterministic (same weights every call).
        loss_fn: ``loss_fn(last_stage_output, targets) -> scalar`` mean loss.
        batch_fn: ``batch_fn(k) -> (inputs, targets)`` for global micro-batch id k; with
            ``dp`` replicas, replica d's micro-batch k calls ``batch_fn(k·dp + d)``
            ([Note: replica data ids] in docs/architecture.md).
        optimizer_fn: ``optimizer_fn(named_params, stage) -> Optimizer`` for one stage, given
            the stage's ``(name, parameter)`` pairs (which every ``torch.optim`` optimizer accepts).
        schedule: the pipeline schedule (N, micro-batches per step, steps).
        lr_lambda: multiplier of the base learning rate after ``u`` local updates
            (``torch.optim.lr_scheduler.LambdaLR`` semantics); ``None`` keeps it constant.
        val_fn: ``val_fn() -> list[(inputs, targets)]`` validation micro-batches; ``None``
            disables evaluation.
        eval_interval: evaluate the weights of version v (every stage after v updates)
            for every v that is a multiple of this; 0 evaluates only the final weights.
        tokens_per_mb: tokens in one micro-batch (for tokens/s); ``None`` reports samples.
        clip_grad_norm: X, the gradient-norm clipping threshold (off if None); ``clip_scope`` says
            which norm each update is clipped by.
        clip_scope: ``"sync"`` (the exact global norm of this update over all stages and replicas:
            one all-gather per update, a barrier), ``"stale"`` (the global norm of update t − s,
            s = ⌈N/a⌉ for the asynchronous schedules and 1 for the flushed ones: no rank waits
            in steady state) or ``"stage"`` (the stage's own norm against X·√(P_i/P)); a non-finite
            norm skips the update ([Note: clip scopes] in docs/architecture.md).
        delay_lr: per-stage learning-rate scaling by the stage's staleness τ_s: ``"pipedream"``
            (or True) multiplies it by τ_s^−(1 − min(u/K, 1)) (PipeDream-LR; always on for the
            pipemare schedule, where it is PipeMare's T1); ``"staleness"`` by 1/(1 + τ_s) for the
            whole run (staleness-aware SGD); None or False: off.
        delay_lr_anneal_steps: K of that rescaling (default: a tenth of the steps).
        dp: D, data-parallel pipeline replicas (process engine only): D·R processes, the
            replicas of a stage average their gradients right before each of its updates.
            Each optimizer step then consumes D·mb_per_step micro-batches of data.
        checkpoint: where and how often stages save their state, and the step to resume
            from ([Note: the checkpoint cut] in docs/architecture.md); ``None``: never.
        nan_policy: the non-finite guard (skip, lower-lr, abort, off; [Note: non-finite guard]
            in ``guard.py``).
        nan_lr_factor: learning-rate factor per dropped micro-batch with ``"lower-lr"``.
        seed: the training RNG (dropout): each forward of micro-batch k on stage s draws from a
            generator seeded from (``seed``, replica, s, k), so every engine, order and resume draws
            the same masks ([Note: random numbers per micro-batch] in ``runtime/executor.py``).
        precision: ``"fp32"``, ``"bf16-autocast"`` or ``"bf16"`` (bf16 parameters stepped from fp32
            masters); [Note: precision and version semantics] in docs/architecture.md.
        recompute: ``"none"`` or ``"full"`` (each stage keeps only its input per in-flight
            micro-batch and re-runs its forward, on the backward's weights, before the backward).
        predict_weights: ``"none"``, ``"bound"`` or ``"measured"``: forwards run on the last applied
            update extrapolated s_i updates ahead (s_i: the stage's drift bound ⌈(N−i)/a⌉, or its mean
            measured drift); [Note: weight prediction] in ``runtime/executor.py``.
        error_feedback: c of error feedback (0 = off): every stage's update applies
            x_{t+1} = x_t − u_t − c·(u_t − u_{t−1}), u_t the optimizer's full step, the first plain
            ([Note: error feedback] in docs/architecture.md).
        order: how an asynchronous schedule's stages order their actions ([Note: deterministic
            order] in ``schedules/policy.py``): ``"deterministic"`` (a fixed per-stage order: the
            same losses run to run on every engine, and the process engine equals the emulator)
            or ``"dynamic"`` (a backward goes first whenever its gradient has arrived: on real
            processes the order follows arrival times and varies run to run). Both keep the
            back-pressure q_i < N+1−i and the drift bound ⌈(N−i)/a⌉; synchronous schedules
            follow their lists either way.
        compile_backend: ``None`` runs every stage eagerly; ``"inductor"`` or ``"aot_eager"`` runs each
            stage's module under ``torch.compile`` with that backend (the loss stays eager); [Note:
            compiled stages] in ``runtime/compiled.py``.
    """

    stage_fn: StageFn
    loss_fn: LossFn
    batch_fn: BatchFn
    optimizer_fn: OptimizerFn
    schedule: Schedule
    lr_lambda: LrLambda | None = None
    val_fn: Callable[[], list[tuple[Any, Any]]] | None = None
    eval_interval: int = 0
    tokens_per_mb: int | None = None
    clip_grad_norm: float | None = None
    clip_scope: str = "sync"
    delay_lr: str | bool | None = None
    delay_lr_anneal_steps: int | None = None
    dp: int = 1
    checkpoint: Checkpointing | None = None
    nan_policy: str = "skip"
    nan_lr_factor: float = 0.5
    seed: int = 0
    precision: str = "fp32"
    recompute: str = "none"
    predict_weights: str = "none"
    error_feedback: float = 0.0
    order: str = "deterministic"
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        check_order(self.order)  # here, before any stage process starts
        check_clip(self.clip_grad_norm, self.clip_scope)
        if self.clip_grad_norm is not None and self.clip_scope != "stage":
            check_rank_updates(self.schedule)

    def build_executor(self, stage: int, module: nn.Module | None = None, replica: int = 0,
                       grad_sync=None, device: torch.device | None = None) -> StageExecutor:
        """Builds stage ``stage``'s module, optimizer and executor.

        Args:
            stage: 0-based stage index.
            module: a pre-built stage module (else ``stage_fn(stage)``).
            replica: d, the data-parallel replica (selects its data ids).
            grad_sync: the executor's gradient averaging over replicas (``None`` if D = 1).
            device: where the module and its micro-batches live (``None``: as built).
        """
        module = self.stage_fn(stage) if module is None else module
        if device is not None:
            module = module.to(device)
        check_modes(self.precision, self.recompute, device)
        if self.compile_backend is not None:
            check_compile(self.compile_backend, self.schedule.name)
        masters = to_bf16(module) if self.precision == "bf16" else None
        # (name, parameter) pairs: torch optimizers accept them, and Basis Rotation uses the
        # names to keep embeddings and the head on AdamW; under bf16 the optimizer steps the fp32 masters
        params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if masters is not None:
            params = [(name, m) for (name, _), m in zip(params, masters)]
        optimizer = self.optimizer_fn(params, stage)
        lr_lambda = self.lr_lambda
        delay_lr = self.delay_lr or self.schedule.info.delay_lr  # the optimizer's, or the schedule's own (PipeMare T1)
        if delay_lr == "staleness":
            lr_lambda = StalenessLR(self.schedule.delay_bound(stage), self.lr_lambda)
        elif delay_lr:  # PipeMare T1 / PipeDream-LR, per stage
            anneal = self.delay_lr_anneal_steps or max(self.schedule.steps // 10, 1)
            lr_lambda = PipeDreamLR(self.schedule.delay_bound(stage), anneal, self.lr_lambda)
        sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        batch_fn = self.batch_fn if self.dp == 1 else functools.partial(replica_batch, self.batch_fn, self.dp, replica)
        return StageExecutor(
            stage, self.schedule.n_stages, module, self.loss_fn if stage == self.schedule.n_stages - 1 else None,
            batch_fn, optimizer, self.schedule.loss_scale, sched, None,  # clipping: the engine's clipping.RankClipper
            backward_weights=self.schedule.backward_weights, grad_sync=grad_sync, device=device,
            nan_policy=self.nan_policy, nan_lr_factor=self.nan_lr_factor,
            precision=self.precision, masters=masters, recompute=self.recompute,
            predict_weights=self.predict_weights, predict_bound=self.schedule.delay_bound(stage),
            compile_backend=self.compile_backend, error_feedback=self.error_feedback,
            # replicas draw different masks for their different data
            rng_seed=self.seed + 1_000_003 * replica,
        )

    # -- checkpoints ([Note: the checkpoint cut]) --------------------------------------------------
    def cuts(self) -> Cuts:
        """This job's cut points (one object per process, shared by its policies)."""
        ck = self.checkpoint
        return Cuts(self.schedule.mb_per_step, every=0 if ck is None else ck.every,
                    extra=() if ck is None else ck.extra_cuts, decide=self.dp == 1)

    @property
    def start_step(self) -> int:
        """The update the run starts after (0, or the checkpoint it resumes)."""
        ck = self.checkpoint
        return 0 if ck is None or ck.resume_step is None else ck.resume_step

    def save_checkpoint(self, ex: StageExecutor, stop_step: int | None = None) -> None:
        """Writes stage ``ex``'s file for the cut at its current version."""
        ck = self.checkpoint
        extra = tuple(sorted(set(ck.extra_cuts) | ({stop_step} if stop_step is not None else set())))
        model_files = getattr(self.stage_fn, "save_model_files", None)  # a split HF model: config.json (export.py)
        if model_files is not None and ex.stage == 0:
            model_files(ck.directory)
        save_stage(ck.directory, ex.version, ex.stage, {
            "executor": ex.state_dict(), "rng": rng_state(ex.device),
            "next_mb": ex.version * self.schedule.mb_per_step, "extra_cuts": list(extra),
            "fingerprint": fingerprint(self, ex.stage, ex.module)}, keep=ck.keep)

    def read_checkpoint(self, stage: int, module: nn.Module) -> dict[str, Any]:
        """Stage ``stage``'s file of the checkpoint of ``checkpoint.resume_step``, checked against
        this job and ``module`` (tensors are memory-mapped, not read, until used).

        Raises:
            ConfigError: missing or unreadable file, one written by another configuration, or one
                that belongs to another step's folder.
        """
        ck = self.checkpoint
        data = load_stage(ck.directory, ck.resume_step, stage)
        check_fingerprint(data.get("fingerprint"), fingerprint(self, stage, module),
                          f"{ck.directory}/step-{ck.resume_step:08d}")
        version = data["executor"]["version"]
        if version != ck.resume_step:
            raise DamagedCheckpoint(f"checkpoint file {ck.directory}/step-{ck.resume_step:08d}/stage-{stage:03d}.pt "
                                    f"holds weight version {version}, not {ck.resume_step}: it belongs to another "
                                    "step's folder")
        return data

    def load_checkpoint(self, ex: StageExecutor, restore_rng: bool = True) -> None:
        """Restores stage ``ex`` from the checkpoint of ``checkpoint.resume_step``.

        Raises:
            ConfigError: as :meth:`read_checkpoint`.
        """
        data = self.read_checkpoint(ex.stage, ex.module)
        ex.load_state_dict(data["executor"])
        if restore_rng:
            set_rng_state(data["rng"], ex.device)

    def wants_snapshot(self, version: int) -> bool:
        """True if the weights of ``version`` are to be evaluated."""
        if self.val_fn is None:
            return False
        if version == 0:
            return True  # the starting point of every validation curve
        last = version == self.schedule.steps
        return last or (self.eval_interval > 0 and version % self.eval_interval == 0)


@torch.no_grad()
def evaluate(job: PipelineJob, modules: list[nn.Module]) -> float:
    """Mean validation loss of the full pipeline model made of ``modules`` (one per stage).

    Returns:
        Mean of ``job.loss_fn`` over ``job.val_fn()``'s micro-batches (nats/token for a LM).
    """
    batches = job.val_fn()
    total = 0.0
    for x, y in batches:
        for m in modules:
            x = m(x)
        total += float(job.loss_fn(x, y))
    return total / max(len(batches), 1)
