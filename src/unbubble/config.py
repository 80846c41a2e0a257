"""The run configuration of unbubble train, validated up front."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from unbubble.errors import ConfigError, check_int, did_you_mean
from unbubble.schedules.clip import CLIP_SCOPES, check_clip
from unbubble.schedules.policy import check_order  # [Note: deterministic order]
from unbubble.schedules.registry import OPTIONS, names_where, schedule_info, schedule_name

#: the largest count option (steps, a, m, sizes): 2^31 − 1, far past any run and within every index type
MAX_COUNT = 2**31 - 1

ENGINES = ("emulator", "processes")
TOKENIZERS = ("auto", "byte", "gpt2")  # or hf:FOLDER
#: What a stage does with a non-finite micro-batch ([Note: non-finite guard] in docs/architecture.md).
NAN_POLICIES = ("skip", "lower-lr", "abort", "off")
#: Weight prediction modes, and the schedules it applies to (the records' ``predicts``: a current-weights
#: backward with delay).
PREDICT_MODES = ("none", "bound", "measured")
PREDICT_SCHEDULES = names_where(lambda r: r.predicts)
#: The schedules error feedback applies to (the records' ``error_feedback``: the asynchronous ones, τ > 0);
#: their default is ``DEFAULT_ERROR_FEEDBACK`` (schedules/registry.py).
ERROR_FEEDBACK_SCHEDULES = names_where(lambda r: r.error_feedback)
#: Fields whose default depends on the schedule. A configuration file holds ``auto`` for such a field
#: when its value is the schedule's default (:func:`config_to_yaml`), and ``auto`` reads back as the
#: default of whatever schedule the run has, so ``--print-config`` output for one schedule runs with
#: ``--schedule`` of another; a value other than the default is written as it is.
AUTO_FIELDS = ("error_feedback", "clip_scope")
OPTIMIZERS = ("adamw", "basis-rotation", "nesterov", "nadam", "pipedream-lr", "staleness-lr", "muon")


#: The schedule options and the schedules that read them (``get_schedule``); every other schedule
#: ignores them, so a flag given for one of those is refused (:func:`check_schedule_options`).
SCHEDULE_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    opt: (names_where(lambda r, opt=opt: opt in r.takes), meaning) for opt, meaning in OPTIONS.items()}


def check_schedule_options(schedules, given: dict) -> None:
    """Refuses ``--a``, ``--m`` or ``--v`` given explicitly (``given``: option -> value) when none of
    ``schedules`` reads it: the run would silently do something else than asked.

    Raises:
        ConfigError: one line naming the value, the schedules that take the option, and what the
            given schedule uses instead.
    """
    schedules = list(schedules)
    for opt, meaning in OPTIONS.items():
        takers = names_where(lambda r, opt=opt: opt in r.takes)
        if opt not in given or any(s in takers for s in schedules):
            continue
        effect = "has no effect on"
        if len(schedules) == 1:
            s = schedules[0]
            info = schedule_info(s)
            what = f"schedule={s!r}"
            if opt == "v" and info.placement == "v":  # they have chunks per device, always two
                effect, what = "does not apply to", what + ", which always holds two chunks per device in a V"
            elif info.updates_every_backward and opt != "v":
                what += ", which updates after every backward"
            elif opt == "a" and "m" in info.takes:
                what += ", whose micro-batches per step are --m"
            elif opt == "m" and "a" in info.takes:
                what += ", whose backward passes per update are --a"
        else:
            what = f"schedules {', '.join(schedules)}"
        takes = "takes" if len(takers) == 1 else "take"
        raise ConfigError(f"{opt}={given[opt]} {effect} {what}: only {', '.join(takers)} {takes} --{opt} "
                          f"({meaning}); drop --{opt} or change --schedule")


def _listed(names) -> str:
    """``a, b and c``."""
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


#: Options ``unbubble train --resume`` lets change: how the run executes, not what it computes.
RESUME_OVERRIDES = ("engine", "threads_per_stage", "timeout_s", "cache_dir", "final_checkpoint", "compile",
                    "compile_backend")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything that defines a training run (defaults: the CPU demo of the README)."""

    schedule: str = field(default="paci", metadata={"help": 'Pipeline schedule: one of unbubble schedules.'})
    stages: int = field(default=4, metadata={"help": "Pipeline depth N (one process per stage with engine='processes')."})
    dp: int = field(default=1, metadata={"help": "Data-parallel pipeline replicas D: D × stages processes; the replicas of a stage average their gradients at each of its updates (replica d reads micro-batch ids k·D + d)."})
    a: int = field(default=4, metadata={"help": 'PACI accumulation factor: backward passes per local optimizer step (= micro-batches per step).'})
    m: int = field(default=4, metadata={"help": f'Micro-batches per optimizer step of {_listed(SCHEDULE_OPTIONS["m"][0])} (dualpipev: m ≥ 2N).'})
    v: int = field(default=2, metadata={"help": f"Virtual stages (model chunks) per rank for {_listed(SCHEDULE_OPTIONS['v'][0])}."})
    micro_batch_size: int = field(default=8, metadata={"help": 'Sequences per micro-batch.'})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence (≤ the model's block size)."})
    steps: int = field(default=800, metadata={"help": 'Optimizer steps per stage.'})
    lr: float = field(default=1e-2, metadata={"help": 'Peak learning rate (the default suits the tiny CPU preset; the PACI paper used 3e-4 for GPT-2 Medium).'})
    min_lr_ratio: float = field(default=0.1, metadata={"help": 'Cosine decay ends at lr × min_lr_ratio (PACI paper: 10 %).'})
    warmup_frac: float = field(default=0.01, metadata={"help": 'Linear warm-up over this fraction of the steps (PACI paper: 1 %), but never fewer than --warmup-min updates: a short run at 1 % would warm up in 1–2 updates. At equal tokens a fraction of the steps is the same number of tokens for every schedule.'})
    warmup_min: int = field(default=20, metadata={"help": 'Fewest warm-up updates (capped at a fifth of the steps); 0 lets --warmup-frac alone decide.'})
    beta1: float = field(default=0.9, metadata={"help": "AdamW β1 (PACI paper: 0.9)."})
    beta2: float = field(default=0.95, metadata={"help": "AdamW β2 (PACI paper: 0.95)."})
    weight_decay: float = field(default=0.1, metadata={"help": 'AdamW decoupled weight decay, applied to matrices only (β and wd as in the PACI paper).'})
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon's momentum μ on hidden matrices (Nesterov form, torch.optim.Muon; 0.95 as in Jordan et al. 2024). Higher momentum is a delay remedy (Zmushko et al. 2026, arXiv 2606.30634)."})
    predict_weights: Literal["none", "bound", "measured"] = field(default="none", metadata={"help": f"Weight prediction for {_listed(PREDICT_SCHEDULES)} (SpecTrain arXiv 1809.02839, PipeOptim arXiv 2312.00839): each forward on stage i runs on W + s_i·(W − W_prev), the last applied update extrapolated s_i updates ahead; s_i = the stage's drift bound ⌈(N−i)/a⌉ (bound) or its mean measured drift so far (measured). The backward keeps the current weights; one weight-sized buffer per stage."})
    error_feedback: float | None = field(default=None, metadata={"help": "Error feedback for delayed gradients, coefficient c: each update applies x_{t+1} = x_t − u_t − c·(u_t − u_{t−1}), u_t the optimizer's full step (Zmushko et al., arXiv 2606.30634). Default (auto in a config file): 1 on the asynchronous schedules, the best remedy measured (horizon-study, docs/results.md), 0 on the synchronous ones; 0 turns it off. Two fp32 weight-sized buffers per stage."})
    optimizer: Literal["adamw", "basis-rotation", "nesterov", "nadam", "pipedream-lr", "staleness-lr", "muon"] = field(
        default="muon", metadata={"help": "muon (the default: torch.optim.Muon on hidden matrices, AdamW on embeddings, head, norms and biases, arXiv 2502.16982; the optimizer overhead-study supports for PACI); "
                                           "adamw; basis-rotation (Adam in a rotated eigenbasis, arXiv 2602.03515); "
                                           "nesterov (PipeNAG); nadam; pipedream-lr (AdamW, the stage's lr ÷ "
                                           "τ_s^(1−min(t/K,1)), K = steps/10); staleness-lr (AdamW, the stage's lr ÷ "
                                           "(1 + τ_s), arXiv 1511.05950)."})
    br_source: Literal["2nd", "1st"] = field(default="2nd", metadata={"help": "Basis Rotation: eigenbasis from EMA(GGᵀ), EMA(GᵀG) (2nd) or from the momentum (1st)."})
    br_geometry: Literal["bilateral", "unilateral"] = field(default="bilateral", metadata={"help": "Basis Rotation: rotate both sides of each matrix, or only the smaller one."})
    br_freq: int = field(default=10, metadata={"help": "Basis Rotation: refresh the bases every k steps (one power-iteration step + QR)."})
    br_max_precond_dim: int = field(default=10_000, metadata={"help": "Basis Rotation: sides of a matrix longer than this stay unrotated (SOAP's max_precond_dim). 768 on a GPT-2-small block rotates only its 768-wide sides: +20 % training step over AdamW instead of +78 % (benchmarks/bench_optim.py), a different preconditioner."})
    br_allocation: Literal["uniform", "stage-aware", "inverse"] = field(default="uniform", metadata={"help": "Basis Rotation: how a fixed refresh budget is split across stages (stage-aware: staler stages refresh more often)."})
    stage_aware: bool = field(default=False, metadata={"help": "Shorthand for --br-allocation stage-aware."})
    clip_grad_norm: float | None = field(default=None, metadata={"help": "Clip each update's gradients to this norm (torchtitan, Megatron and nanoGPT use 1.0); which norm: --clip-scope. Off by default."})
    clip_scope: str | None = field(default=None, metadata={"help": "Which norm --clip-grad-norm clips by. Default (auto in a config file): stale on the asynchronous schedules (clip-study, docs/results.md: the same loss as sync at clip 1.0, within the seed spread, and no barrier), sync on the synchronous ones. sync: this update's exact norm over all stages (and --dp replicas), as torchtitan: one all-gather per update, a barrier (PACI's staggered stages stall). stale: the global norm of update t−s, s = ⌈N/a⌉ for the asynchronous schedules, 1 for the flushed ones: no stage waits; updates t < s clip like stage. stage: each stage's own norm against X·√(P_i/P). A non-finite norm skips the update (logged; summary.json's clip). See docs/concepts.md, gradient clipping over the pipeline."})
    model: str = field(default="tiny", metadata={"help": 'Model preset: GPT-2 (tiny, small-cpu, deep-cpu, deep32-cpu, wide-cpu, gpt2, gpt2-medium, gpt2-large, gpt2-xl), Llama-style (llama-tiny, llama-deep-cpu, llama-1b, llama-8b) or mixture of experts (moe-tiny, moe-deep-cpu, mixtral-8x7b); or your own: hf:PATH (a local Hugging Face config.json or model folder; random init without weights; needs the [hf] extra) or module:function (a function of an importable module returning the model), split by unbubble.models.split.'})
    untie: bool = field(default=False, metadata={"help": "With an hf: or module: model whose weights are tied across two stages (GPT-2's embedding and head): give each stage its own copy (warns) instead of refusing the model."})
    corpus: str = field(default="kjv", metadata={"help": 'kjv, shakespeare, a text file, a folder of .txt files, a .jsonl/.json (or .jsonl.gz), .parquet or .arrow file (or a folder of them), a datasets.save_to_disk folder (read with datasets; the text in --text-field), or a folder with train.bin and val.bin (pre-tokenised uint16 ids of --tokenizer, nanoGPT format). Tokenized once into a cache (--cache-dir) keyed by the content and the tokenizer.'})
    text_field: str = field(default="text", metadata={"help": "The column holding each document's text in a .jsonl/.json/.parquet/.arrow or save_to_disk corpus."})
    tokenizer: str = field(default="auto", metadata={"help": 'auto (an hf:FOLDER model with tokenizer files: that tokenizer; else byte), byte (vocabulary 257, fast on CPU), gpt2 (offline GPT-2 BPE, vocabulary 50257) or hf:FOLDER (a Hugging Face tokenizer folder, read offline by AutoTokenizer). A model folder with weights refuses another tokenizer than its own unless --allow-tokenizer-mismatch.'})
    allow_tokenizer_mismatch: bool = field(default=False, metadata={"help": "Train an hf:FOLDER model with pretrained weights on another tokenizer's ids than its own (its embeddings then read ids they were not trained on)."})
    document_mask: bool = field(default=False, metadata={"help": "Packed documents stay apart: positions restart after each EOS and attention stays within a document (as Hugging Face's packed rows); the prediction of a document's first token from the previous one is not counted. For hf: models and the GPT-2 presets (the Llama and MoE presets refuse it)."})
    engine: Literal["emulator", "processes"] = field(default="processes", metadata={"help": 'processes: one torch.distributed process per stage; emulator: all stages in this process.'})
    order: Literal["deterministic", "dynamic"] = field(default="deterministic", metadata={"help": "Action order of the asynchronous schedules: deterministic (a fixed 1F1B order per stage: the same losses every run, on both engines) or dynamic (a backward runs as soon as its gradient has arrived: on the processes engine the losses differ from run to run). Both keep the drift bound ⌈(N−i)/a⌉; synchronous schedules ignore it."})
    seed: int = field(default=0, metadata={"help": "Seed of the initial weights and of the data order."})
    eval_interval: int = field(default=50, metadata={"help": 'Evaluate the version-v weights every this many steps, at step 0 and at the end (0: at step 0 and the end only).'})
    eval_batches: int = field(default=8, metadata={"help": 'Validation micro-batches per evaluation.'})
    checkpoints: bool = field(default=True, metadata={"help": "Save checkpoints into RUN/checkpoints (every --checkpoint-every steps, at the last step unless --no-final-checkpoint, and when SIGINT/SIGTERM stops the run; the newest two are kept); continue with --resume RUN, export the weights with unbubble export RUN OUT."})
    switch_after: int = field(default=0, metadata={"help": "Train the first K updates synchronously (1F1B-flush with m = a on the same stages), then switch to --schedule at that update boundary; the learning-rate schedule is the whole run's. The synchronous phase is its own run in RUN/synchronous; the asynchronous one starts from its checkpoint as --init-from does (optimizer state carried; error-feedback history, stale clip norms and drift start empty). 0: no switch. See docs/concepts.md, synchronous then asynchronous."})
    lr_steps: int | None = field(default=None, metadata={"help": "Length of the learning-rate schedule in updates (its warm-up and cosine), default --steps: a run that trains only the first --steps updates of a longer schedule (what --switch-after's synchronous phase does)."})
    init_from: str | None = field(default=None, metadata={"help": "Start from another run's checkpoint (its run folder, checkpoints folder or one step-VVVVVVVV folder) under any --schedule, --stages or --dp: weights by the model's parameter names, the optimizer state by name when the optimizer is the same (AdamW/Muon moments), the update counter and the data position continuing from its step; --steps counts from 0 as in the source. Refused in one line for another model. See docs/concepts.md, starting from another layout."})
    checkpoint_every: int = field(default=100, metadata={"help": "Checkpoint after every K-th update, the first after update K (0: none but the last step's and a stop's). Asynchronous schedules drain the pipeline once per K steps for it."})
    final_checkpoint: bool = field(default=True, metadata={"help": "Checkpoint the last step, so unbubble export has the trained weights (as nanoGPT and Hugging Face's Trainer save at the end). --no-final-checkpoint: a run shorter than --checkpoint-every steps then writes none unless a signal stops it (a longer run checkpoints its last step anyway)."})
    nan_policy: Literal["skip", "lower-lr", "abort", "off"] = field(default="skip", metadata={"help": "A micro-batch with a non-finite loss or gradient: skip (it contributes nothing; logged), lower-lr (skip and multiply that stage's lr by --nan-lr-factor), abort (stop with an error), off (no checks)."})
    nan_lr_factor: float = field(default=0.5, metadata={"help": "Learning-rate factor per dropped micro-batch with --nan-policy lower-lr, in (0, 1]."})
    precision: Literal["fp32", "bf16-autocast", "bf16"] = field(default="fp32", metadata={"help": "fp32; bf16-autocast (fp32 weights, forwards under torch.autocast: an in-flight micro-batch's input gradient uses its forward-time bf16 weights and holds a bf16 copy of them); bf16 (bf16 weights updated in place from fp32 master copies and fp32 moments, gradients summed in fp32: the backward uses the current weights, as in fp32)."})
    recompute: Literal["none", "full"] = field(default="none", metadata={"help": "full: each stage keeps only its input per in-flight micro-batch and re-runs its forward, on the weights the backward uses (v_B) and with the forward's RNG state, right before the backward (one more forward per backward)."})
    compile: bool = field(default=False, metadata={"help": "torch.compile each stage's module (the loss stays eager) with --compile-backend; every schedule keeps its weight-version semantics, except zb-h1, zb-h2, interleaved-zb, zbv and dualpipev, which are refused (a compiled backward cannot be split into I and W). Compiling takes seconds to minutes per stage: with the processes engine raise --timeout-s above that."})
    compile_backend: Literal["inductor", "aot_eager"] = field(default="inductor", metadata={"help": "torch.compile backend of --compile: inductor (generated kernels) or aot_eager (AOTAutograd graphs run op by op: compiles in well under a second; for checking that a model traces)."})
    timeout_s: float = field(default=60.0, metadata={"help": "Seconds a stage process waits for a neighbour before the run fails (processes engine, torchrun)."})
    threads_per_stage: int = field(default=1, metadata={"help": 'torch threads in each stage process (processes engine), and in the emulator.'})
    cache_dir: str = field(default_factory=lambda: os.environ.get("UNBUBBLE_CACHE_DIR", "~/.cache/unbubble"),
                           metadata={"help": "Where tokenized corpora are stored (env UNBUBBLE_CACHE_DIR)."})
    run_dir: str | None = field(default=None, metadata={"help": 'Run folder; default runs/<time>-<schedule>-N<stages>. An existing non-empty folder is refused.'})
    tensorboard: bool = field(default=True, metadata={"help": "Write TensorBoard event files into the run folder (tensorboard --logdir runs)."})
    wandb: bool = field(default=False, metadata={"help": "Also log to Weights & Biases in offline mode (needs the wandb package; wandb sync uploads later)."})

    def __post_init__(self) -> None:
        self.validate()

    def _canonical_case(self) -> None:
        """A choice given in another case is that choice ('MUON', 'FP32', 'Dynamic'), as a schedule name
        is (:func:`~unbubble.schedules.registry.schedule_name`); anything else is left to the checks."""
        import typing

        choices = {name: typing.get_args(hint) for name, hint in _field_types().items()
                   if typing.get_origin(hint) is typing.Literal}
        choices["clip_scope"] = CLIP_SCOPES
        for name, valid in choices.items():
            value = getattr(self, name)
            if isinstance(value, str) and value not in valid:
                same = [v for v in valid if v.lower() == value.lower()]
                if same:
                    setattr(self, name, same[0])

    def validate(self) -> None:
        """Checks types, ranges and combinations that need no file or model.

        Raises:
            ConfigError: the first invalid value, named with what is valid and the option to set.
        """
        self._canonical_case()

        def pos_int(name: str, lo: int = 1, hi: int | None = MAX_COUNT) -> None:
            v = getattr(self, name)
            check_int(name, v, lo, f"set --{_flag(name)}")
            if hi is not None and v > hi:  # numpy and torch index with int64; no run gets near this
                raise ConfigError(f"{name}={v} is too large: must be at most {hi:,} (2^31 − 1) (set --{_flag(name)})")

        self.schedule = schedule_name(self.schedule)
        if self.stage_aware:
            if self.br_allocation == "inverse":
                raise ConfigError("stage_aware=True contradicts br_allocation='inverse': give one of them")
            self.br_allocation = "stage-aware"
        for name in ("stages", "dp", "a", "m", "v", "br_freq", "br_max_precond_dim", "micro_batch_size", "seq_len", "steps", "eval_batches", "threads_per_stage"):
            pos_int(name)
        pos_int("eval_interval", 0)
        per_update = max(self.a if self.a is not None else 1, self.m if self.m is not None else 1)
        if self.steps * per_update > MAX_COUNT:
            raise ConfigError(f"steps={self.steps} × {per_update:,} micro-batches per update = "
                              f"{self.steps * per_update:,} micro-batches is too many: must be at most {MAX_COUNT:,} "
                              "(lower --steps, --a or --m)")
        if self.run_dir is not None and not str(self.run_dir).strip():
            raise ConfigError(f"run_dir={self.run_dir!r} is empty: give a folder name, or leave --run-dir out for "
                              "runs/<time>-<schedule>-N<stages>")
        pos_int("warmup_min", 0)
        pos_int("seed", 0, hi=None)
        pos_int("checkpoint_every", 0)
        pos_int("switch_after", 0)
        if self.lr_steps is not None:
            pos_int("lr_steps", self.steps)
        if self.switch_after:
            self._check_switch()
        if self.nan_policy not in NAN_POLICIES:
            raise ConfigError(f"nan_policy={self.nan_policy!r} is invalid{did_you_mean(self.nan_policy, NAN_POLICIES)}: must be one of {', '.join(NAN_POLICIES)} "
                              "(set --nan-policy)")
        if isinstance(self.nan_lr_factor, bool) or not (isinstance(self.nan_lr_factor, (int, float))
                                                        and 0 < self.nan_lr_factor <= 1):
            raise ConfigError(f"nan_lr_factor={self.nan_lr_factor!r} is invalid: must be in (0, 1] "
                              "(set --nan-lr-factor)")
        if isinstance(self.timeout_s, bool) or not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s={self.timeout_s!r} is invalid: must be a number of seconds > 0 "
                              "(set --timeout-s)")
        if isinstance(self.lr, bool) or not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise ConfigError(f"lr={self.lr!r} is invalid: must be a finite number > 0 (set --lr)")
        for name in ("beta1", "beta2", "min_lr_ratio", "warmup_frac"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1 + (name == "min_lr_ratio")):
                rng = "[0, 1]" if name == "min_lr_ratio" else "[0, 1)"
                raise ConfigError(f"{name}={v!r} is invalid: must be in {rng} (set --{_flag(name)})")
        if isinstance(self.muon_momentum, bool) or not (isinstance(self.muon_momentum, (int, float))
                                                         and 0 <= self.muon_momentum < 1):
            raise ConfigError(f"muon_momentum={self.muon_momentum!r} is invalid: must be in [0, 1) (set --muon-momentum)")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay!r} is invalid: must be ≥ 0 (set --weight-decay)")
        if self.clip_scope is not None and self.clip_grad_norm is None:
            raise ConfigError(f"clip_scope={self.clip_scope!r} has no effect without clip_grad_norm: set "
                              "--clip-grad-norm X, or drop --clip-scope")
        if self.clip_grad_norm is not None and self.clip_scope is None:  # clip-study: stale costs no loss, no barrier
            self.clip_scope = schedule_info(self.schedule).default_clip_scope
        check_clip(self.clip_grad_norm, self.clip_scope if self.clip_grad_norm is not None else "sync")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine={self.engine!r} is unknown{did_you_mean(self.engine, ENGINES)}: valid engines are {', '.join(ENGINES)} (set --engine)")
        if self.dp > 1 and self.engine == "emulator":  # an option conflict: found before any file is read
            raise ConfigError(f"dp={self.dp} is invalid with engine='emulator' (one replica): use --engine processes "
                              "or --dp 1")
        check_order(self.order)
        for name, valid in (("optimizer", OPTIMIZERS), ("br_source", ("2nd", "1st")),
                            ("br_geometry", ("bilateral", "unilateral")),
                            ("br_allocation", ("uniform", "stage-aware", "inverse"))):
            if getattr(self, name) not in valid:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid{did_you_mean(getattr(self, name), valid)}: must be one of {', '.join(valid)} "
                                  f"(set --{_flag(name)})")
        from unbubble.runtime.precision import check_modes  # imports torch: only when validating

        check_modes(self.precision, self.recompute)
        from unbubble.models.registry import check_preset

        from unbubble.models.external import check_external, is_external

        if is_external(self.model):
            check_external(self.model)
        else:
            check_preset(self.model)  # before the corpus is read or a line is printed
            if self.untie:
                raise ConfigError(f"untie=True has no effect on model={self.model!r}: a preset's head is untied from "
                                  "its embedding whenever the two sit on different stages; --untie is for hf:PATH and "
                                  "module:function models (drop --untie)")
        if self.predict_weights not in PREDICT_MODES:
            raise ConfigError(f"predict_weights={self.predict_weights!r} is invalid{did_you_mean(self.predict_weights, PREDICT_MODES)}: must be one of "
                              f"{', '.join(PREDICT_MODES)} (set --predict-weights)")
        if self.predict_weights != "none":
            info = schedule_info(self.schedule)
            if not info.predicts:
                why = "is synchronous: no delay to predict across" if not info.asynchronous else {
                    "stashed": "has no drift to predict across: its backward runs on the weights of its forward",
                    "corrected": "corrects the delay with its own velocity estimate (PipeMare's T2)",
                }[info.backward_weights]
                valid = ", ".join(names_where(lambda r: r.predicts))
                raise ConfigError(f"predict_weights={self.predict_weights!r} is for the never-flushed schedules whose "
                                  f"backward runs on the current weights ({valid}): schedule="
                                  f"{self.schedule!r} {why} (set --predict-weights none)")
            if self.recompute != "none":
                raise ConfigError(f"predict_weights={self.predict_weights!r} is invalid with recompute="
                                  f"{self.recompute!r}: a recomputed forward runs on the backward's weights, so the "
                                  "predicted forward would not be the one differentiated (set --recompute none)")
        if self.error_feedback is None:  # the default: on where it corrects a delay (horizon-study's best remedy)
            self.error_feedback = schedule_info(self.schedule).default_error_feedback
        c = self.error_feedback
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ConfigError(f"error_feedback={c!r} is invalid: must be a finite number ≥ 0 (0 = off; set --error-feedback)")
        if c and not schedule_info(self.schedule).error_feedback:
            valid = ", ".join(names_where(lambda r: r.error_feedback))
            raise ConfigError(f"error_feedback={c!r} is for asynchronous schedules ({valid}): "
                              f"schedule={self.schedule!r} is synchronous, so u_t − u_(t−1) corrects no delay "
                              "(set --error-feedback 0)")
        from unbubble.runtime.compiled import check_backend, check_compile

        check_backend(self.compile_backend)
        if self.compile:
            check_compile(self.compile_backend, self.schedule)
        if self.run_dir is not None and os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise ConfigError(f"run_dir={self.run_dir!r} is a file, not a folder: give a new folder (set --run-dir); "
                              "nothing was overwritten")
        from unbubble.data.tokenizer import check_tokenizer_spec

        check_tokenizer_spec(self.tokenizer)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"text_field={self.text_field!r} is invalid: must be a column name such as 'text' "
                              "(set --text-field)")
        if self.document_mask and not (self.model.startswith("hf:") or self.model == "python"):
            from unbubble.models.gpt2 import GPTConfig
            from unbubble.models.registry import FAMILY_OF, PRESETS

            if FAMILY_OF.get(self.model) is not GPTConfig:
                gpt = ", ".join(n for n in PRESETS if FAMILY_OF[n] is GPTConfig)
                raise ConfigError(f"document_mask=True is not supported by model={self.model!r}: its attention spans "
                                  f"the whole packed row; --document-mask is for the GPT-2 presets ({gpt}) and "
                                  "hf:FOLDER models (drop --document-mask, or change --model)")

    @property
    def mb_per_step(self) -> int:
        """Micro-batches per optimizer step: ``a`` for the schedules that take ``--a`` (paci,
        paci-stashed), 1 for those that update after every backward, ``m`` otherwise (the
        schedule's record, :meth:`~unbubble.schedules.registry.ScheduleInfo.mb_per_update`)."""
        return schedule_info(self.schedule).mb_per_update(self.a, self.m)

    @property
    def warmup_steps(self) -> int:
        """Linear warm-up updates: max(round(warmup_frac · T), min(warmup_min, T // 5)) with T the
        learning-rate schedule's length (``lr_steps``, default ``steps``)."""
        total = self.lr_steps or self.steps
        return max(round(self.warmup_frac * total), min(self.warmup_min, total // 5))

    def _check_switch(self) -> None:
        """``switch_after``: an asynchronous schedule that steps after a fixed number of backward passes,
        0 < K < steps, and a run that can hand its checkpoint on."""
        k = self.switch_after
        if not schedule_info(self.schedule).switchable:
            valid = ", ".join(names_where(lambda r: r.switchable))
            raise ConfigError(f"switch_after={k} is invalid with schedule={self.schedule!r}: it switches a run from "
                              f"1F1B-flush to an asynchronous schedule ({valid}; set --schedule)")
        if k >= self.steps:
            raise ConfigError(f"switch_after={k} is invalid with steps={self.steps}: the switch must come before the "
                              f"last update (give 1 … {self.steps - 1}; set --switch-after)")
        for name, bad in (("init_from", self.init_from is not None), ("checkpoints", not self.checkpoints),
                          ("lr_steps", self.lr_steps is not None)):
            if bad:
                raise ConfigError(f"switch_after={k} cannot be combined with {name}={getattr(self, name)!r}: the "
                                  "synchronous phase's checkpoint starts the asynchronous one, on the whole run's "
                                  f"learning-rate schedule (drop --{_flag(name).replace('checkpoints', 'no-checkpoints')})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_absolute_paths(self) -> TrainConfig:
        """This configuration with ``hf:PATH`` and a corpus path (a file or folder, not a built-in
        corpus name) made absolute: the run folder's ``config.yaml`` then resumes (``--resume``) and
        repeats (``--config``) from any working directory, not only the one the run started in."""
        from pathlib import Path

        from unbubble.data.corpus import BUILTIN_CORPORA

        changes = {}
        if self.model.startswith("hf:"):
            changes["model"] = "hf:" + str(Path(self.model[3:]).expanduser().resolve())
        if self.corpus not in BUILTIN_CORPORA and Path(self.corpus).expanduser().exists():
            changes["corpus"] = str(Path(self.corpus).expanduser().resolve())
        if self.tokenizer.startswith("hf:"):
            changes["tokenizer"] = "hf:" + str(Path(self.tokenizer[3:]).expanduser().resolve())
        if self.init_from is not None and Path(self.init_from).expanduser().exists():
            changes["init_from"] = str(Path(self.init_from).expanduser().resolve())
        return dataclasses.replace(self, **changes) if changes else self


def _flag(name: str) -> str:
    return name.replace("_", "-")


# Configuration files ---------------------------------------------------------------------------
# `unbubble train --config run.yaml` reads a YAML mapping of TrainConfig fields; flags given on the
# command line win over the file; every run folder gets the effective configuration as config.yaml
# (and config.json), so `--config RUN/config.yaml --run-dir NEW` repeats a run.

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _field_types() -> dict[str, object]:
    import typing

    return typing.get_type_hints(TrainConfig)


def check_field(name: str, value: object, where: str = "config") -> object:
    """Type-checks one configuration value read from a file and returns it normalised.

    Integers are accepted for float fields (``lr: 1`` → 1.0), and so are strings that parse as
    floats, since YAML 1.1 reads ``1e-3`` (no dot) as a string. Ranges and combinations are left
    to :meth:`TrainConfig.validate`.

    Args:
        name: a :class:`TrainConfig` field.
        value: the value as parsed (YAML scalars: bool, int, float, str, None).
        where: the source named in errors (the file name).

    Raises:
        ConfigError: one line naming the key, the value and the expected type.
    """
    import typing

    hint = _field_types()[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    if name in AUTO_FIELDS and isinstance(value, str) and value.lower() == "auto":  # the schedule's default
        return None
    if value is None:
        if optional:
            return None
        hint_name = "one of " + ", ".join(args) if typing.get_origin(hint) is typing.Literal else _TYPE_NAMES.get(hint, str(hint))
        raise ConfigError(f"{where}: {name} is empty (null): expected {hint_name}")
    if optional:
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where}: {name}={value!r} is invalid{did_you_mean(value, typing.get_args(hint))}: must be one of {', '.join(typing.get_args(hint))}")
        return value
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(hint)
    if ok is None:  # a type this loader does not know (a field added later): leave it to validate()
        return value
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if not ok(value):
        raise ConfigError(f"{where}: {name}={value!r} has the wrong type {type(value).__name__}: expected "
                          f"{_TYPE_NAMES[hint]}")
    return float(value) if hint is float else value


def config_from_dict(data: dict, overrides: dict | None = None, where: str = "config") -> TrainConfig:
    """A validated :class:`TrainConfig` from a mapping of field names (``-`` or ``_``) to values.

    Args:
        data: e.g. a parsed YAML file; keys missing from it keep their defaults.
        overrides: values that win over ``data`` (the command-line flags given explicitly).
        where: the source named in errors.

    Raises:
        ConfigError: an unknown key (named, with the closest valid key and all valid keys), a
            wrong type, or any error of :meth:`TrainConfig.validate`.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of option names to values (key: value lines), "
                          f"got a {type(data).__name__}")
    valid = [f.name for f in dataclasses.fields(TrainConfig)]
    values: dict[str, object] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(name, valid)}: valid keys are {', '.join(valid)}")
        if name in values:
            raise ConfigError(f"{where}: key {name!r} is given twice (as {name} and {name.replace('_', '-')})")
        values[name] = check_field(name, value, where)
    from_file = set(values) - set(overrides or {})
    values.update(overrides or {})
    try:
        return TrainConfig(**values)
    except ConfigError as exc:
        name = str(exc).split("=", 1)[0]
        if name in from_file:  # the file's value is the bad one: say where it came from
            raise ConfigError(f"{where}: {exc}") from None
        raise


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> TrainConfig:
    """Reads a YAML configuration file (the format of a run folder's ``config.yaml``).

    Args:
        path: the file; an empty file means all defaults.
        overrides: values that win over the file (``unbubble train --config f.yaml --steps 100``).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: a missing or unreadable file, invalid YAML (with line and column), an unknown
            key, a wrong type, or an invalid value; always one line.
    """
    where = str(path)
    data = read_yaml(read_text_file(path, "config", "give a YAML file such as a run folder's config.yaml (set --config)"),
                     where)
    return config_from_dict({} if data is None else data, overrides, where)


def read_text_file(path: str | os.PathLike, name: str, fix: str) -> str:
    """The UTF-8 text of the file given as ``name`` (``fix``: what to give instead, for the
    messages).

    Raises:
        ConfigError: one line: the file does not exist, is not text, or cannot be read.
    """
    where = str(path)
    try:
        return open(path, encoding="utf-8").read()
    except FileNotFoundError:
        raise ConfigError(f"{name}={where!r} does not exist: {fix}") from None
    except UnicodeDecodeError as exc:  # an image, a checkpoint, ...: say what it is not, not the codec's words
        raise ConfigError(f"{name}={where!r} is not a text file (byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start} is not UTF-8): {fix}") from None
    except OSError as exc:
        raise ConfigError(f"{name}={where!r} cannot be read: {type(exc).__name__}: {exc}".splitlines()[0]) from None


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def read_yaml(text: str, where: str) -> Any:
    """``text`` parsed as YAML (safe types only), refusing a key given twice in one mapping (PyYAML
    would keep the last silently).

    Raises:
        ConfigError: not YAML (with the line and column) or a duplicate key (with both lines).
    """
    import yaml

    class _Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{where}: key {key!r} is given twice (lines {seen[key]} and {line}): keep one")
            seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=True)

    _Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    # YAML 1.1 reads 1e-3 (no dot) as a string; every reader here means the number
    _Strict.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))
    try:
        return yaml.load(text, Loader=_Strict)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None


def schedule_default(name: str, schedule: str) -> object:
    """The value ``auto`` stands for in field ``name`` (one of :data:`AUTO_FIELDS`) under ``schedule``."""
    if name == "error_feedback":
        return schedule_info(schedule).default_error_feedback
    if name == "clip_scope":  # with --clip-grad-norm: the scope clip-study found free (docs/results.md)
        return schedule_info(schedule).default_clip_scope
    raise KeyError(name)


def config_to_yaml(cfg: TrainConfig) -> str:
    """The configuration as YAML, every field with its help as a comment; :func:`load_config`
    reads it back to an equal configuration. A field of :data:`AUTO_FIELDS` that holds its
    schedule's default is written ``auto``, so the file also runs with another ``--schedule``."""
    import yaml

    lines = ["# unbubble train configuration: unbubble train --config THIS_FILE [--flag value ...]",
             "# (flags given on the command line win over this file; a repeated run needs a new --run-dir;",
             "# auto: the default of the run's schedule, so the file runs with any --schedule)"]
    for f in dataclasses.fields(TrainConfig):
        helptext = f.metadata.get("help")
        if helptext:
            lines.append(f"# {helptext}")
        value = getattr(cfg, f.name)
        if f.name in AUTO_FIELDS and value == schedule_default(f.name, cfg.schedule):
            lines.append(f"{f.name}: auto")
            continue
        lines.append(yaml.safe_dump({f.name: value}, allow_unicode=True, default_flow_style=False,
                                    width=1000).rstrip("\n"))
    return "\n".join(lines) + "\n"
