"""The run configuration of unbubble train, validated up front."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from unbubble.errors import ConfigError
from unbubble.schedules.registry import SCHEDULES

ENGINES = ("emulator", "processes")
TOKENIZERS = ("byte", "gpt2")
OPTIMIZERS = ("adamw", "basis-rotation", "nesterov", "nadam", "pipedream-lr")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything that defines a training run (defaults: the CPU demo of the README)."""

    schedule: str = field(default="paci", metadata={"help": 'Pipeline schedule: one of unbubble schedules.'})
    stages: int = field(default=4, metadata={"help": "Pipeline depth N (one process per stage with engine='processes')."})
    a: int = field(default=4, metadata={"help": 'PACI accumulation factor: backward passes per local optimizer step (= micro-batches per step).'})
    m: int = field(default=4, metadata={"help": 'Micro-batches per optimizer step of gpipe, 1f1b-flush, interleaved-1f1b, zb-h1, zb-h2 and pipedream-2bw.'})
    v: int = field(default=2, metadata={"help": "Virtual stages (model chunks) per rank for interleaved-1f1b."})
    micro_batch_size: int = field(default=8, metadata={"help": 'Sequences per micro-batch.'})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence (≤ the model's block size)."})
    steps: int = field(default=800, metadata={"help": 'Optimizer steps per stage.'})
    lr: float = field(default=1e-2, metadata={"help": 'Peak learning rate (the default suits the tiny CPU preset; the PACI paper used 3e-4 for GPT-2 Medium).'})
    min_lr_ratio: float = field(default=0.1, metadata={"help": 'Cosine decay ends at lr × min_lr_ratio (PACI paper: 10 %).'})
    warmup_frac: float = field(default=0.01, metadata={"help": 'Linear warm-up over this fraction of the steps (PACI paper: 1 %).'})
    beta1: float = field(default=0.9, metadata={"help": "AdamW β1 (PACI paper: 0.9)."})
    beta2: float = field(default=0.95, metadata={"help": "AdamW β2 (PACI paper: 0.95)."})
    weight_decay: float = field(default=0.1, metadata={"help": 'AdamW decoupled weight decay, applied to matrices only (β and wd as in the PACI paper).'})
    optimizer: Literal["adamw", "basis-rotation", "nesterov", "nadam", "pipedream-lr"] = field(
        default="adamw", metadata={"help": "adamw; basis-rotation (Adam in a rotated eigenbasis, arXiv 2602.03515); "
                                           "nesterov (PipeNAG delay correction); nadam; pipedream-lr (AdamW with the "
                                           "stage's lr ÷ τ_s^(1−min(t/K,1)))."})
    br_source: Literal["2nd", "1st"] = field(default="2nd", metadata={"help": "Basis Rotation: eigenbasis from EMA(GGᵀ), EMA(GᵀG) (2nd) or from the momentum (1st)."})
    br_geometry: Literal["bilateral", "unilateral"] = field(default="bilateral", metadata={"help": "Basis Rotation: rotate both sides of each matrix, or only the smaller one."})
    br_freq: int = field(default=10, metadata={"help": "Basis Rotation: refresh the bases every k steps (one power-iteration step + QR)."})
    br_allocation: Literal["uniform", "stage-aware", "inverse"] = field(default="uniform", metadata={"help": "Basis Rotation: how a fixed refresh budget is split across stages (stage-aware: staler stages refresh more often)."})
    stage_aware: bool = field(default=False, metadata={"help": "Shorthand for --br-allocation stage-aware."})
    clip_grad_norm: float | None = field(default=None, metadata={"help": 'Per-stage gradient-norm clipping; off by default (global clipping needs cross-stage sync).'})
    model: str = field(default="tiny", metadata={"help": 'Model preset (tiny, small-cpu, gpt2, gpt2-medium, gpt2-large, gpt2-xl).'})
    corpus: str = field(default="kjv", metadata={"help": 'kjv, shakespeare, a text file, or a folder of .txt files.'})
    tokenizer: Literal["byte", "gpt2"] = field(default="byte", metadata={"help": 'byte (vocabulary 257, fast on CPU) or gpt2 (offline GPT-2 BPE, vocabulary 50257).'})
    engine: Literal["emulator", "processes"] = field(default="processes", metadata={"help": 'processes: one torch.distributed process per stage; emulator: all stages in this process.'})
    seed: int = field(default=0, metadata={"help": "Seed of the initial weights and of the data order."})
    eval_interval: int = field(default=50, metadata={"help": 'Evaluate the version-v weights every this many steps (and at the end).'})
    eval_batches: int = field(default=8, metadata={"help": 'Validation micro-batches per evaluation.'})
    threads_per_stage: int = field(default=1, metadata={"help": 'torch threads in each stage process (processes engine).'})
    cache_dir: str = field(default_factory=lambda: os.environ.get("UNBUBBLE_CACHE_DIR", "~/.cache/unbubble"),
                           metadata={"help": "Where tokenized corpora are stored (env UNBUBBLE_CACHE_DIR)."})
    run_dir: str | None = field(default=None, metadata={"help": 'Run folder; default runs/<time>-<schedule>-N<stages>. An existing non-empty folder is refused.'})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks types, ranges and combinations that need no file or model.

        Raises:
            ConfigError: the first invalid value, named with what is valid and the option to set.
        """
        def pos_int(name: str, lo: int = 1) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}={v!r} is invalid: must be an integer ≥ {lo} (set --{_flag(name)})")

        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is unknown: valid schedules are "
                              f"{', '.join(SCHEDULES)} (set --schedule)")
        if self.stage_aware:
            if self.br_allocation == "inverse":
                raise ConfigError("stage_aware=True contradicts br_allocation='inverse': give one of them")
            self.br_allocation = "stage-aware"
        for name in ("stages", "a", "m", "v", "br_freq", "micro_batch_size", "seq_len", "steps", "eval_batches", "threads_per_stage"):
            pos_int(name)
        pos_int("eval_interval", 0)
        pos_int("seed", 0)
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ConfigError(f"lr={self.lr!r} is invalid: must be > 0 (set --lr)")
        for name in ("beta1", "beta2", "min_lr_ratio", "warmup_frac"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1 + (name == "min_lr_ratio")):
                rng = "[0, 1]" if name == "min_lr_ratio" else "[0, 1)"
                raise ConfigError(f"{name}={v!r} is invalid: must be in {rng} (set --{_flag(name)})")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay!r} is invalid: must be ≥ 0 (set --weight-decay)")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm!r} is invalid: must be > 0 or unset")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine={self.engine!r} is unknown: valid engines are {', '.join(ENGINES)} (set --engine)")
        for name, valid in (("optimizer", OPTIMIZERS), ("br_source", ("2nd", "1st")),
                            ("br_geometry", ("bilateral", "unilateral")),
                            ("br_allocation", ("uniform", "stage-aware", "inverse"))):
            if getattr(self, name) not in valid:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be one of {', '.join(valid)} "
                                  f"(set --{_flag(name)})")
        if self.tokenizer not in TOKENIZERS:
            raise ConfigError(f"tokenizer={self.tokenizer!r} is unknown: valid tokenizers are "
                              f"{', '.join(TOKENIZERS)} (set --tokenizer)")

    @property
    def mb_per_step(self) -> int:
        """Micro-batches per optimizer step: a for paci, 1 for async-1f1b, pipedream and
        pipemare (an update after every backward), m otherwise."""
        if self.schedule == "paci":
            return self.a
        return 1 if self.schedule in ("async-1f1b", "pipedream", "pipemare") else self.m

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")
