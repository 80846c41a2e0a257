"""Training GPT-2 on real text through a pipeline: the job the CLI runs.

``train(config)`` validates everything up front, tokenizes the corpus once (cached),
builds a :class:`~unbubble.runtime.job.PipelineJob` whose callables are picklable
partials of the functions below, runs it on the chosen engine and writes the run folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from unbubble.config import RESUME_OVERRIDES, TrainConfig
from unbubble.data import MicroBatchSampler, prepare_tokens, val_batches, val_overlap_warning
from unbubble.data.memmap import TokenData
from unbubble.data.sampler import check_split_sizes
from unbubble.errors import ConfigError, Diverged, PipelineFailure
from unbubble.lr import warmup_cosine
from unbubble.loggers import check_loggers
from unbubble.metrics import RunWriter
from unbubble.models import ModelConfig, build_stages, count_params, gpt_loss, make_config, partition_layers
from unbubble.models.split import causal_lm_loss
from unbubble.optim import build_optimizer
from unbubble.runtime.checkpoint import (Checkpointing, DamagedCheckpoint, complete_steps, init_checkpoint, load_stage,
                                         offset_batch)
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.launch import (choose_backend, install_stop_handlers, pass_on_late_stop, run_processes,
                                     run_torchrun, under_torchrun)
from unbubble.runtime.precision import cpu_has_native_bf16, slow_bf16_warning
from unbubble.runtime.telemetry import Listener, RunResult
from unbubble.safety import RunLock, check_memory, os_cause
from unbubble.schedules.registry import get_schedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Data:
    """Where a process finds the tokens (memmaps are reopened in each stage process)."""

    train_path: str
    val_path: str
    micro_batch_size: int
    seq_len: int
    seed: int
    eval_batches: int
    dtype: str = "uint16"  # of the token files (uint32 above a vocabulary of 65,536)
    eos_id: int | None = None  # set: --document-mask (positions restart after each EOS)


@functools.lru_cache(maxsize=4)
def _tokens(path: str, dtype: str = "uint16") -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r")


@functools.lru_cache(maxsize=4)
def _sampler(data: _Data) -> MicroBatchSampler:
    return MicroBatchSampler(_tokens(data.train_path, data.dtype), data.micro_batch_size, data.seq_len, data.seed)


def document_batch(x: torch.Tensor, y: torch.Tensor, eos_id: int) -> tuple[dict, torch.Tensor]:
    """A packed micro-batch as Hugging Face trains packed rows (``DataCollatorWithFlattening``): position
    ids restart at 0 after each EOS (and at the row's start), so the model's attention stays within
    each document; the target of an EOS (the next document's first token) is ``-100``, not counted.

    Args:
        x, y: ids and targets ``(B, T)`` int64 (``y`` = ``x`` shifted by one).
        eos_id: the tokenizer's end-of-document id.

    Returns:
        ``({"input_ids": x, "position_ids": (B, T) int64}, targets (B, T) int64)``.
    """
    t = torch.arange(x.shape[1]).expand_as(x)
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[:, 1:] = x[:, :-1] == eos_id  # a document starts after each EOS
    last_start = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
    return {"input_ids": x, "position_ids": t - last_start}, y.masked_fill(x == eos_id, -100)


def gpt_batch(data: _Data, k: int):
    """Micro-batch k: token ids and targets, each ``(micro_batch_size, seq_len)`` int64 (with
    ``--document-mask`` a dict of ids and restarting position ids, :func:`document_batch`)."""
    x, y = _sampler(data).get(k)
    return (x, y) if data.eos_id is None else document_batch(x, y, data.eos_id)


def gpt_val(data: _Data) -> list:
    """The fixed validation micro-batches."""
    # warned once, up front (build_job), not by every stage that evaluates
    batches = val_batches(_tokens(data.val_path, data.dtype), data.micro_batch_size, data.seq_len, data.eval_batches,
                          warn=False)
    return batches if data.eos_id is None else [document_batch(x, y, data.eos_id) for x, y in batches]


def gpt_stage(model: ModelConfig, n_stages: int, seed: int, seq_len: int, stage: int,
              loss_scale: float = 1.0) -> torch.nn.Module:
    """Builds only stage ``stage`` of the cost-balanced partition (any architecture; ``loss_scale`` is the
    schedule's, which a mixture of experts applies to its load-balancing loss)."""
    return build_stages(model, n_stages, seed, seq_len=seq_len, only=stage, loss_scale=loss_scale)[stage]


def stage_optimizer(name: str, lr: float, betas: tuple[float, float], weight_decay: float, delays: tuple[int, ...],
                    br_options: tuple[tuple[str, object], ...], params: list, stage: int) -> torch.optim.Optimizer:
    """One stage's optimizer, knowing its index and delay τ_s (``unbubble.optim.build_optimizer``)."""
    return build_optimizer(name, params, stage, len(delays), delays[stage], lr, betas, weight_decay,
                           br_stage_delays=list(delays), **dict(br_options))


def external_stages(cfg: TrainConfig, tokens: TokenData, n_stages: int, model: torch.nn.Module | None = None,
                    written: Path | None = None):
    """``(split_model of cfg.model, ModelShape)`` for an ``hf:`` / ``module:function`` model or a model
    object given in Python (``train_model``); ``written``: a resumed run's checkpoint folder, whose
    stages keep the layers they were written with (:func:`written_cuts`).

    Raises:
        ConfigError: a ``python`` run without its model object, a vocabulary smaller than the
            tokenizer's, seq_len beyond the model's positions, or what ``split_model`` refuses.
    """
    from unbubble.models.external import ModelShape, load_external
    from unbubble.models.split import count_layers, split_model

    given_in_python = model is not None  # train_model(model, untie=True); else --model hf:/module:, --untie
    if model is None:
        refuse_python_model(cfg)
        model = load_external(cfg.model, cfg.seed)
    n_layer, chunks = count_layers(model), n_stages // cfg.stages  # chunks: 2 on a V-shaped schedule
    if n_stages > n_layer:  # split_model's own message names its Python arguments
        why = f": {cfg.schedule} needs stages × {chunks} = {n_stages} model chunks" if chunks > 1 else ""
        raise ConfigError(f"stages={cfg.stages} is invalid: model {cfg.model!r} has {n_layer} layers{why} (set "
                          f"{'stages' if given_in_python else '--stages'} ≤ {n_layer // chunks}, or give a deeper model)")
    check_vocabulary(cfg.model, embedding_rows(model), tokens.tokenizer, tokens.vocab_size)
    if cfg.document_mask:
        if not hasattr(getattr(model, "config", None), "to_dict"):
            raise ConfigError(f"document_mask=True is for Hugging Face models (their attention reads packed rows from "
                              f"the position ids): model {cfg.model!r} is not one (drop --document-mask)")
        # The whole model builds a cache when use_cache, and HF then reads no packed rows from the position ids.
        kept, model.config.use_cache = {"use_cache": model.config.use_cache}, False
    cuts = written_cuts(written, model, n_stages) if written is not None else None
    split = split_model(model, n_stages, cuts=cuts, untie=cfg.untie,
                        untie_option="untie=True" if given_in_python else "--untie")
    if cfg.document_mask:  # the export generates with the cache its own config asks for
        split.config_for_export = kept
    shape = ModelShape.of(model, sum(len(layers) for layers in split.plan.layers))
    if shape.block_size is not None and cfg.seq_len > shape.block_size:
        raise ConfigError(f"seq_len={cfg.seq_len} is invalid: model {cfg.model!r} has {shape.block_size} positions "
                          f"(set --seq-len ≤ {shape.block_size})")
    return split, shape


def written_cuts(directory: Path, model: torch.nn.Module, n_stages: int) -> list[int] | None:
    """The first decoder layer of stages 1 … N−1 in the newest readable complete checkpoint of
    ``directory`` (from its stage files' parameter names; the tensors are not read), or None when there
    is none. A resumed run keeps the split its checkpoints hold: the split's costs may have changed since
    it started ([Note: the stage split's costs] in docs/architecture.md), and its stage files would then
    hold other layers than its stages."""
    from unbubble.models.split import count_layers, layer_container

    layer, n_layer = re.compile(re.escape(layer_container(model)) + r"\.(\d+)\."), count_layers(model)
    for step in reversed(complete_steps(directory, n_stages)):
        try:
            names = [load_stage(directory, step, s)["executor"]["model"] for s in range(n_stages)]
        except (ConfigError, KeyError, TypeError):  # damaged: attach_checkpoints says so, or passes over it
            continue
        firsts = [min((int(m.group(1)) for k in stage if (m := layer.match(k))), default=None) for stage in names]
        if None in firsts or firsts[0] != 0 or firsts != sorted(set(firsts)) or firsts[-1] >= n_layer:
            return None  # not a split of this model's layers: attach_checkpoints names the mismatch
        return firsts[1:]
    return None


def embedding_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's input token embedding (the ids it can read), or its config's ``vocab_size``."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if isinstance(emb, torch.nn.Embedding):
        return int(emb.num_embeddings)
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if emb is not None:
        return int(emb.num_embeddings)
    return getattr(getattr(model, "config", None), "vocab_size", None)


def check_vocabulary(model: str, rows: int | None, tokenizer: str, vocab_size: int) -> None:
    """Refuses a tokenizer whose ids exceed the model's vocabulary, before anything trains.

    Raises:
        ConfigError: one line naming both numbers.
    """
    if rows is not None and rows < vocab_size:
        fix = f"give a model with vocab_size ≥ {vocab_size:,}, or the model's own tokenizer with --tokenizer"
        if model.startswith("hf:") and tokenizer.startswith("hf:"):
            folder = Path(model[3:]).expanduser()
            folder = folder.parent if folder.is_file() else folder
            if folder.resolve() == Path(tokenizer[3:]).expanduser().resolve():  # it is the model's own
                fix = (f"the folder's tokenizer and config.json disagree: set vocab_size ≥ {vocab_size:,} in its "
                       "config.json (model.resize_token_embeddings for weights), or give another --tokenizer")
        raise ConfigError(f"tokenizer {tokenizer!r} has {vocab_size:,} ids (0–{vocab_size - 1:,}) but model={model!r} "
                          f"has {rows:,} embedding rows: ids ≥ {rows:,} would index past its vocabulary ({fix})")


def stage_ranges(job: PipelineJob, model, seq_len: int) -> list[range]:
    """The blocks of each stage: a split model's plan, or our presets' cost-balanced partition."""
    plan = getattr(job.stage_fn, "plan", None)
    if plan is not None:
        return [range(ls[0], ls[-1] + 1) if ls else range(0) for ls in plan.layers]
    return partition_layers(model, job.schedule.n_stages, seq_len)


def build_job(cfg: TrainConfig, tokens: TokenData, model_object: torch.nn.Module | None = None,
              written: Path | None = None) -> tuple[PipelineJob, ModelConfig]:
    """The pipeline job for ``cfg`` on prepared ``tokens``: a GPT-2 / Llama / MoE preset, or an
    external model (``hf:PATH``, ``module:function``, or ``model_object``) split by
    :func:`~unbubble.models.split.split_model` (as its checkpoints in ``written`` are, when resuming).

    Returns:
        ``(job, model)``: ``model`` the preset's config or the external model's
        :class:`~unbubble.models.external.ModelShape`.

    Raises:
        ConfigError: stages > layers, seq_len > block size, or a corpus too small for seq_len.
    """
    from unbubble.models.external import is_external

    external = model_object is not None or is_external(cfg.model)
    schedule = get_schedule(cfg.schedule, cfg.stages, cfg.steps, a=cfg.a, m=cfg.m, v=cfg.v)
    if external:  # split_model checks the stages against the layers, external_stages seq_len
        split, model = external_stages(cfg, tokens, schedule.n_stages, model_object, written)
    else:
        model = make_config(cfg.model, tokens.vocab_size)
    if not external and cfg.seq_len > model.block_size:
        raise ConfigError(f"seq_len={cfg.seq_len} is invalid: model {cfg.model!r} has block_size={model.block_size}, "
                          f"so seq_len must be ≤ {model.block_size} (set --seq-len)")
    if not external and schedule.virtual > 1 and schedule.n_stages > model.n_layer:
        if schedule.placement == "v":  # two chunks per device, always: --v is no way out
            raise ConfigError(f"stages={cfg.stages} is invalid: {cfg.schedule} holds 2 chunks per device in a V, so it "
                              f"needs stages × 2 = {schedule.n_stages} model chunks but model {cfg.model!r} has "
                              f"{model.n_layer} layers (set --stages ≤ {model.n_layer // 2}, or pick a deeper --model)")
        raise ConfigError(f"stages={cfg.stages} with v={cfg.v} is invalid: {cfg.schedule} needs stages × v = "
                          f"{schedule.n_stages} model chunks but model {cfg.model!r} has {model.n_layer} layers "
                          "(lower --v or --stages, or pick a deeper --model)")
    if not external:
        partition_layers(model, schedule.n_stages, cfg.seq_len)  # raises on stages > layers
    data = _Data(str(tokens.meta["dir"]) + "/train.bin", str(tokens.meta["dir"]) + "/val.bin",
                 cfg.micro_batch_size, cfg.seq_len, cfg.seed, cfg.eval_batches, str(tokens.train.dtype),
                 tokens.eos_id if cfg.document_mask else None)
    check_split_sizes(tokens.train.size, tokens.val.size, cfg.seq_len)
    MicroBatchSampler(tokens.train, cfg.micro_batch_size, cfg.seq_len, cfg.seed)  # validates sizes
    if cfg.micro_batch_size * cfg.seq_len > tokens.train.size:
        raise ConfigError(f"micro_batch_size={cfg.micro_batch_size} × seq_len={cfg.seq_len} = "
                          f"{cfg.micro_batch_size * cfg.seq_len:,} tokens per micro-batch exceeds the corpus's "
                          f"{tokens.train.size:,} training tokens (lower --micro-batch-size or --seq-len)")
    val_batches(tokens.val, cfg.micro_batch_size, cfg.seq_len, 1, warn=False)  # validates sizes
    overlap = val_overlap_warning(tokens.val.size, cfg.micro_batch_size, cfg.seq_len, cfg.eval_batches)
    if overlap is not None:
        log.warning(overlap)
    warmup = cfg.warmup_steps
    job = PipelineJob(
        stage_fn=split if external else functools.partial(gpt_stage, model, schedule.n_stages, cfg.seed, cfg.seq_len,
                                                          loss_scale=schedule.loss_scale),
        loss_fn=causal_lm_loss if external else gpt_loss,
        batch_fn=functools.partial(gpt_batch, data),
        optimizer_fn=functools.partial(
            stage_optimizer, "adamw" if cfg.optimizer in ("pipedream-lr", "staleness-lr") else cfg.optimizer, cfg.lr,
            (cfg.beta1, cfg.beta2), cfg.weight_decay, tuple(schedule.delay_bound(s) for s in range(schedule.n_stages)),
            (("br_source", cfg.br_source), ("br_geometry", cfg.br_geometry), ("br_freq", cfg.br_freq),
             ("br_max_precond_dim", cfg.br_max_precond_dim),
             ("br_allocation", cfg.br_allocation), ("muon_momentum", cfg.muon_momentum))),
        schedule=schedule,
        lr_lambda=functools.partial(warmup_cosine, total=cfg.lr_steps or cfg.steps, warmup=warmup,
                                    min_ratio=cfg.min_lr_ratio),
        val_fn=functools.partial(gpt_val, data),
        eval_interval=cfg.eval_interval,
        tokens_per_mb=cfg.micro_batch_size * cfg.seq_len,
        clip_grad_norm=cfg.clip_grad_norm,
        clip_scope=cfg.clip_scope or "sync",
        delay_lr={"pipedream-lr": "pipedream", "staleness-lr": "staleness"}.get(cfg.optimizer),
        dp=cfg.dp,
        nan_policy=cfg.nan_policy,
        nan_lr_factor=cfg.nan_lr_factor,
        seed=cfg.seed,
        precision=cfg.precision,
        recompute=cfg.recompute,
        predict_weights=cfg.predict_weights,
        error_feedback=cfg.error_feedback,
        order=cfg.order,
        compile_backend=cfg.compile_backend if cfg.compile else None,
    )
    return job, model


def resume_config(run_dir: str | Path, overrides: dict | None = None) -> TrainConfig:
    """The configuration of the run in ``run_dir`` (its ``config.yaml``), with ``overrides``
    of :data:`RESUME_OVERRIDES` only.

    Raises:
        ConfigError: no such run folder or config.yaml, or an override of another option.
    """
    from unbubble.config import load_config

    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"resume={str(path)!r} does not exist: give the folder of a previous unbubble train run")
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"resume={str(path)!r} is not a run folder: {str(path / 'config.yaml')!r} is missing "
                          "(give the folder a previous unbubble train wrote)")
    bad = sorted(set(overrides or {}) - set(RESUME_OVERRIDES))
    if bad:
        raise ConfigError(f"{bad[0]} cannot change on --resume: the run continues with {str(path / 'config.yaml')!r}; "
                          f"only {', '.join('--' + o.replace('_', '-') for o in RESUME_OVERRIDES)} may be given "
                          "(to change more, start a new run with --config)")
    cfg = load_config(path / "config.yaml", overrides=overrides or {})
    written = path / "config.json"  # written beside config.yaml when the run started
    if written.is_file():
        before = json.loads(written.read_text())
        now = cfg.to_dict()
        changed = [k for k in now if k not in RESUME_OVERRIDES and k in before and before[k] != now[k]]
        if changed:
            k = changed[0]
            raise ConfigError(f"{k} was edited in {str(path / 'config.yaml')!r} ({before[k]!r} → {now[k]!r}): a run "
                              "resumes with the configuration its checkpoints were written with (start a new run "
                              "with --config to change it)")
    return cfg


def refuse_python_model(cfg: TrainConfig) -> None:
    """Raises ConfigError when ``cfg`` is a run whose model was given in Python (``train_model``)
    and no model object came with it."""
    from unbubble.models.external import PYTHON_MODEL

    if cfg.model == PYTHON_MODEL:
        raise ConfigError("model='python': this run's model was given in Python; give it again "
                          "(unbubble.train_model(model, resume=RUN_DIR))")


def refuse_finished(run_dir: Path, steps: int) -> None:
    """Raises ConfigError when the run in ``run_dir`` trained all ``steps`` (its summary.json)."""
    summary = run_dir / "summary.json"
    done = json.loads(summary.read_text()) if summary.exists() else {}
    if done.get("steps_done") == steps and done.get("stopped_at_step") is None:
        raise ConfigError(f"run {str(run_dir)!r} already finished: its summary.json has all {steps} steps (start a new "
                          "run to train longer)")


def attach_checkpoints(job: PipelineJob, cfg: TrainConfig, run_dir: Path, resume: bool) -> PipelineJob:
    """Sets ``job.checkpoint`` for ``run_dir/checkpoints``; when resuming, picks the newest
    complete checkpoint and checks every stage's file against ``job`` before anything runs.

    Raises:
        ConfigError: nothing to resume, the run already finished, a file written by another
            configuration, or a damaged file in the oldest checkpoint left (a damaged newer one
            is passed over for the previous checkpoint, with a warning).
    """
    if not cfg.checkpoints:
        if resume:
            raise ConfigError(f"run {str(run_dir)!r} was configured with checkpoints=False: there is nothing to resume")
        if cfg.init_from is not None:
            raise ConfigError("init_from with checkpoints=False is invalid: the run starts by writing its own "
                              "checkpoint of the source's step (drop --no-checkpoints)")
        return job
    directory = run_dir / "checkpoints"
    if cfg.init_from is not None:  # [Note: starting from another layout's checkpoint] in runtime/checkpoint.py
        record = run_dir / "init_from.json"
        if not resume:
            final = cfg.final_checkpoint or 0 < cfg.checkpoint_every <= cfg.steps
            job = dataclasses.replace(job, checkpoint=Checkpointing(str(directory), cfg.checkpoint_every, 2, None, (),
                                                                    final))
            info = init_checkpoint(job, cfg.init_from, directory)
            record.write_text(json.dumps(dataclasses.asdict(info), indent=2) + "\n")
            log.info("starting from %s: step %d, micro-batch ids +%d, optimizer state %s", info.source, info.step,
                     info.data_offset, "carried by parameter name" if info.optimizer_carried else
                     "restarted (another optimizer)")
            job = dataclasses.replace(job, batch_fn=functools.partial(offset_batch, job.batch_fn, info.data_offset),
                                      checkpoint=Checkpointing(str(directory), cfg.checkpoint_every, 2, info.step, (),
                                                               final))
            return job
        if record.is_file():  # a resumed run that started from another's checkpoint keeps its data position
            offset = json.loads(record.read_text())["data_offset"]
            job = dataclasses.replace(job, batch_fn=functools.partial(offset_batch, job.batch_fn, offset))
    n = job.schedule.n_stages
    step, extra = None, ()
    if resume:
        for leftover in directory.glob("step-*/.stage-*.tmp-*"):  # a write cut short by a second signal
            leftover.unlink(missing_ok=True)
        refuse_finished(run_dir, job.schedule.steps)
        steps = complete_steps(directory, n)
        if not steps:  # stopped or crashed before its first checkpoint: start again from step 0
            log.warning("run %s has no complete checkpoint in %s: it restarts from step 0", run_dir, directory)
            steps = [0]
        step = steps[-1]
    # the last step's checkpoint: by default, or when the run is long enough to checkpoint anyway
    final = cfg.final_checkpoint or 0 < cfg.checkpoint_every <= cfg.steps
    if not (resume and step):
        return dataclasses.replace(job, checkpoint=Checkpointing(str(directory), cfg.checkpoint_every, 2, step, extra,
                                                                 final))
    older = [s for s in steps if s < step]
    while True:  # every file is checked here, so a bad one fails before any process starts
        try:
            extra = tuple(load_stage(directory, step, 0)["extra_cuts"])
            candidate = dataclasses.replace(job, checkpoint=Checkpointing(str(directory), cfg.checkpoint_every, 2,
                                                                          step, extra, final))
            for s in range(n):
                candidate.read_checkpoint(s, job.stage_fn(s))
        except DamagedCheckpoint as exc:
            if not older:
                raise DamagedCheckpoint(f"{exc}; there is no older checkpoint: delete "
                                        f"{str(directory / f'step-{step:08d}')!r} to start the run again from step 0") \
                    from None
            log.warning("%s; resuming from the previous checkpoint, step %d", exc, older[-1])
            step = older.pop()
            continue
        if step >= job.schedule.steps:
            raise ConfigError(f"run {str(run_dir)!r} already finished: its checkpoint is at the last step {step}")
        log.info("resuming run %s from step %d of %d (checkpoint %s)", run_dir, step, job.schedule.steps,
                 directory / f"step-{step:08d}")
        return candidate


def warn_if_bf16_is_emulated(cfg: TrainConfig, job: PipelineJob) -> None:
    """Logs one warning when bf16 is asked for on CPU stages that emulate it
    (:func:`~unbubble.runtime.precision.slow_bf16_warning`). The stages compute on CUDA only when
    the processes get NCCL, one device each (:func:`~unbubble.runtime.launch.choose_backend`)."""
    if cfg.precision == "fp32":
        return
    local = int(__import__("os").environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun() \
        else job.dp * job.schedule.n_ranks
    on_cpu = cfg.engine == "emulator" or choose_backend(local) == "gloo"
    message = slow_bf16_warning(cfg.precision, "cpu" if on_cpu else "cuda", cpu_has_native_bf16() if on_cpu else None)
    if message is not None:
        log.warning(message)


def run_job(job: PipelineJob, engine: str, listener: Listener | None = None, threads_per_stage: int = 1,
            timeout_s: float = 60.0) -> RunResult | None:
    """Runs a job on ``engine`` (``"emulator"`` or ``"processes"``; under torchrun, this rank's stage).

    SIGINT/SIGTERM stop the run at the next step boundary (``RunResult.stopped_at``), after a
    checkpoint when ``job.checkpoint`` is set; a second one stops at once.
    """
    if engine == "emulator":
        cuts = job.cuts()
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        install_stop_handlers(cuts)
        try:  # as many torch threads as one stage process has
            result = run_emulator(job, listener=listener, cuts=cuts, threads=threads_per_stage)
        except KeyboardInterrupt as exc:  # a second signal
            raise PipelineFailure(f"{exc or 'interrupted'}; the newest complete checkpoint, if any, is "
                                  "unchanged") from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if cuts.stop_requested and result.stopped_at in (None, job.schedule.steps):  # it cut nothing short
            pass_on_late_stop(handlers[signal.SIGINT], signal.SIGINT)
        return result
    if under_torchrun():
        return run_torchrun(job, listener=listener, timeout_s=timeout_s)
    return run_processes(job, listener=listener, threads_per_stage=threads_per_stage, timeout_s=timeout_s)


def resolve_run_tokenizer(cfg: TrainConfig):
    """``(cfg with its tokenizer resolved, the Tokenizer)``: ``auto`` becomes the ``hf:`` model folder's own
    tokenizer or ``byte`` (:func:`~unbubble.data.tokenizer.resolve_tokenizer`), so the run folder's
    config.yaml names the tokenizer the run used; an ``hf:`` model whose config.json has fewer ids than
    the tokenizer is refused here, before the corpus is tokenized.

    Raises:
        ConfigError: a tokenizer that is not the pretrained model folder's own (without
            ``--allow-tokenizer-mismatch``), an unreadable tokenizer, or too few embedding rows.
    """
    from unbubble.data.tokenizer import get_tokenizer, resolve_tokenizer
    from unbubble.models.external import hf_vocab_size

    name = resolve_tokenizer(cfg.tokenizer, cfg.model, cfg.allow_tokenizer_mismatch)
    if name != cfg.tokenizer:
        cfg = dataclasses.replace(cfg, tokenizer=name)
    tokenizer = get_tokenizer(name)
    if cfg.model.startswith("hf:"):
        check_vocabulary(cfg.model, hf_vocab_size(cfg.model), tokenizer.name, tokenizer.vocab_size)
    log.info("tokenizer %s: %d ids, EOS %d", tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id)
    return cfg, tokenizer


def save_tokenizer(tokenizer, directory: Path) -> None:
    """Writes a Hugging Face tokenizer's files into ``directory/model/`` beside the model's config, so
    ``unbubble export`` gives a folder that ``AutoTokenizer.from_pretrained`` reads too; byte and gpt2
    need no files."""
    from unbubble.data.tokenizer import HFTokenizer
    from unbubble.models.split import MODEL_DIR

    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(directory / MODEL_DIR)


def train(cfg: TrainConfig | None = None, listener_factory=None, resume: str | Path | None = None,
          resume_overrides: dict | None = None, started_at: float | None = None,
          model: torch.nn.Module | None = None, on_divergence: str = "raise") -> tuple[RunResult | None, Path | None]:
    """Validates ``cfg``, trains, and writes the run folder.

    Args:
        cfg: the run configuration (``None`` with ``resume``).
        listener_factory: ``f(writer, total_steps) -> Listener`` for live progress; default:
            the writer alone (JSONL metrics, no terminal output).
        resume: a run folder to continue from its newest complete checkpoint, with its own
            config.yaml ([Note: the checkpoint cut] in docs/architecture.md).
        resume_overrides: options of :data:`RESUME_OVERRIDES` to change when resuming.
        started_at: when the command started, epoch seconds: summary.json's ``startup_s`` counts
            from it to the end of the first optimizer step (default: this call; ``unbubble train``
            passes its process's start).
        model: a model object to train instead of ``cfg.model`` (``cfg.model`` is then ``"python"``;
            :func:`train_model`).
        on_divergence: ``"raise"``: a non-finite loss, validation loss or final weight stops the run
            with :class:`~unbubble.errors.Diverged`; ``"record"``: the run goes on and returns (a
            sweep tuning the learning rate records a diverged lr). summary.json's ``status`` says
            ``diverged`` either way ([Note: a diverged run fails] in ``metrics.py``).

    Returns:
        ``(result, run_dir)``; both ``None`` on non-zero torchrun ranks. ``result.stopped_at``
        is set when a signal stopped the run (a checkpoint of that step is in the run folder).

    Raises:
        ConfigError: any invalid value, file, checkpoint or combination — raised before anything in
            the run folder is written, so nothing existing is overwritten; a model that cannot fit
            this machine's memory (:func:`~unbubble.safety.check_memory`, before it is built); a run
            folder another live process holds (its ``.lock``: :class:`~unbubble.safety.RunLock`).
        Diverged: a non-finite loss, validation loss or final weight after the non-finite guard's
            skips; summary.json says ``"status": "diverged"``.
        PipelineFailure: a stage failed, or a signal stopped the run at once
            (:class:`~unbubble.errors.StartupInterrupted` before the first step). A new run that
            ends so before its first step removes its run folder; one that ends so later writes a
            summary.json whose ``status`` says how it ended.
    """
    started_at = time.time() if started_at is None else started_at
    rank0 = not under_torchrun() or int(__import__("os").environ.get("RANK", "0")) == 0
    lock, created, run_dir = None, False, None
    try:
        if resume is not None:
            cfg = resume_config(resume, resume_overrides)
            if model is None:
                refuse_python_model(cfg)
            if rank0:  # taken before the corpus is read: a busy or finished run is answered at once
                lock = RunLock(resume)  # a second writer is refused here, naming the first one's pid
                refuse_finished(Path(resume), cfg.steps)
        if on_divergence not in ("raise", "record"):
            raise ConfigError(f"on_divergence={on_divergence!r} is invalid: must be 'raise' or 'record'")
        cfg.validate()
        if cfg.switch_after and resume is None:
            from unbubble.switch import train_switched

            return train_switched(cfg, functools.partial(train, listener_factory=listener_factory,
                                                         started_at=started_at, model=model))
        if resume is None:  # the run folder's config.yaml then works from any folder
            cfg = cfg.with_absolute_paths()
        check_loggers(cfg)
        # only rank 0 owns the run folder: the others would find it already created (torchrun)
        if resume is not None:
            run_dir = Path(resume)
        else:
            run_dir = RunWriter.choose_dir(cfg) if rank0 else None
        cfg, tokenizer = resolve_run_tokenizer(cfg)
        tokens = prepare_tokens(cfg.corpus, tokenizer, Path(cfg.cache_dir).expanduser(), text_field=cfg.text_field)
        job, model = build_job(cfg, tokens, model, run_dir / "checkpoints" if resume is not None else None)
        if under_torchrun() and cfg.checkpoints and cfg.run_dir is None and resume is None:
            raise ConfigError("checkpoints under torchrun need --run-dir: every rank writes its stage's checkpoint "
                              "there (a folder all machines share), or give --no-checkpoints")
        if run_dir is None and cfg.run_dir is not None:  # torchrun rank > 0: same folder as rank 0
            run_dir = Path(cfg.run_dir)
        if not under_torchrun() and isinstance(model, ModelConfig.__args__):  # before any stage is built
            check_memory(cfg.model, model, job.schedule.n_stages, cfg.seq_len, cfg.micro_batch_size, cfg.optimizer,
                         cfg.precision, cfg.dp)
        created = resume is None and rank0 and run_dir is not None and not run_dir.exists()
        if rank0 and run_dir is not None and resume is None:  # one process writes a run folder
            try:  # ([Note: the run folder's lock])
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"run_dir={str(run_dir)!r} cannot be created: {os_cause(exc)} (set --run-dir)"
                                  ) from None
            lock = RunLock(run_dir)
        return _train_locked(cfg, job, model, tokens, tokenizer, run_dir, resume, rank0, listener_factory,
                             started_at, on_divergence)
    except BaseException:
        if lock is not None:
            lock.release()
        if created and run_dir.is_dir() and not any(run_dir.iterdir()):  # refused before writing: leave nothing
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()


def _train_locked(cfg: TrainConfig, job: PipelineJob, model, tokens: TokenData, tokenizer, run_dir: Path | None,
                  resume, rank0: bool, listener_factory, started_at: float, on_divergence: str = "raise"
                  ) -> tuple[RunResult | None, Path | None]:
    """:func:`train` once the run folder is this process's: checkpoints attached, the run, its summary."""
    if run_dir is not None:
        job = attach_checkpoints(job, cfg, run_dir, resume is not None)
    if rank0:  # only now: a bad model, corpus or checkpoint has already given its one error line
        log.info("config: %s", ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))
        warn_if_bf16_is_emulated(cfg, job)
    writer = None
    try:
        writer = RunWriter(run_dir, cfg, job, resume_step=job.start_step if resume is not None else None) \
            if rank0 else None
        if writer is not None:
            writer.stop_on_divergence = on_divergence == "raise"
            n = job.schedule.n_stages
            ranges = stage_ranges(job, model, cfg.seq_len)
            n_params = sum(count_params(job.stage_fn(s)) for s in range(n))
            writer.describe(model=model, n_params=n_params, ranges=ranges, tokens=tokens)
            if cfg.checkpoints and resume is None:
                save_tokenizer(tokenizer, run_dir / "checkpoints")
        listener = (listener_factory(writer, cfg.steps) if listener_factory and writer else writer)
        t0 = time.perf_counter()
        result = run_job(job, cfg.engine, listener, cfg.threads_per_stage, cfg.timeout_s)
    except BaseException as exc:  # a failure or a stop before the first step of a new run: nothing worth keeping
        if resume is None and rank0 and not under_torchrun() and (writer is None or not writer.last):
            if writer is not None:
                writer.discard()
            elif run_dir is not None:  # stopped while the folder was being made
                shutil.rmtree(run_dir, ignore_errors=True)  # (choose_dir: it was new or empty)
        elif writer is not None and writer.last:  # steps were done: the summary says how the run ended
            writer.finish_failed(exc)
        raise
    if writer is None or result is None:
        return None, None
    summary = writer.finish(result, time.perf_counter() - t0, started_at)
    if summary.get("status") == "diverged" and on_divergence == "raise":
        raise Diverged(summary["error"])
    return result, run_dir


def train_model(model: torch.nn.Module, schedule: str = "paci", run_dir: str | Path | None = None,
                resume: str | Path | None = None, progress: bool = True, **options) -> tuple[RunResult | None, Path | None]:
    """Trains a model you already have with ``unbubble train``'s whole run: the run folder (config,
    metrics.jsonl, actions.jsonl, summary.json, loss.png, TensorBoard), checkpoints and resume, the
    non-finite guard, ``unbubble report`` on the folder, and the progress and end lines.

    The model is split by :func:`~unbubble.models.split.split_model` (a Hugging Face causal LM,
    torchtitan layout) and trained on ``options["corpus"]`` with ``options["tokenizer"]`` as ``unbubble train``
    would; its config records ``model: python``.

    Args:
        model: the whole model (its vocabulary at least the tokenizer's).
        schedule: any ``--schedule``.
        run_dir: the run folder (default: ``runs/<time>-<schedule>``).
        resume: a run folder of an earlier ``train_model`` run with this model: continue it.
        progress: print the step lines and the end line (as the CLI does).
        **options: any other :class:`~unbubble.config.TrainConfig` field (``stages``, ``steps``, ``a``,
            ``lr``, ``engine``, ``untie``, …); ``final_checkpoint`` is on, as for ``unbubble train``, so
            the last step's weights are there for ``unbubble.export``.

    Returns:
        ``(result, run_dir)`` as :func:`train`.

    Raises:
        ConfigError: an unknown option or invalid value (one line), and what :func:`train` raises.
    """
    from unbubble.models.external import PYTHON_MODEL

    from unbubble.progress import ProgressListener, end_lines, setup_logging

    listeners: list = []

    def factory(writer, total):  # the CLI's progress bar (plain step lines off a terminal)
        for lst in listeners:  # a switch_after run's first phase has ended (its writer is closed)
            lst.close()
        listeners.append(ProgressListener(writer, total, max(total // 20, 1), "", writer.resume_step or 0))
        return listeners[-1]

    root = logging.getLogger("unbubble")
    configured = root.handlers[:], root.level, root.propagate
    if progress and not root.hasHandlers():  # a plain script: show the step lines as the CLI does
        setup_logging(0)

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = sorted(set(options) - names)
    if bad:
        raise ConfigError(f"{bad[0]}={options[bad[0]]!r} is not an option of train_model: give TrainConfig fields "
                          "(as unbubble train --help lists them, with _ for -)")
    config = getattr(model, "config", None)  # --document-mask trains with use_cache=False: the caller keeps its own
    own_cache = getattr(config, "use_cache", None)
    try:
        if resume is not None:
            result, run_dir = train(listener_factory=factory if progress else None, resume=resume, model=model)
        else:
            cfg = TrainConfig(model=PYTHON_MODEL, schedule=schedule, run_dir=None if run_dir is None else str(run_dir),
                              **options)
            result, run_dir = train(cfg, listener_factory=factory if progress else None, model=model)
        if result is not None and listeners:
            listeners[-1].finish(json.loads((run_dir / "summary.json").read_text()))
    finally:
        if own_cache is not None:
            config.use_cache = own_cache
        for lst in listeners:
            lst.close()
        root.handlers[:], root.level, root.propagate = configured[0], configured[1], configured[2]
    if result is not None and progress:  # the end lines of unbubble train
        for line in end_lines(resume_config(run_dir), result, run_dir, json.loads((run_dir / "summary.json").read_text())):
            print(line)
    return result, run_dir
