"""PACI in a training loop shaped like torchtitan's, on torch.distributed.pipelining (CPU, gloo).

    torchrun --nproc-per-node 2 examples/torch_pipelining_paci.py                 # 12 steps, ≈ 10 s on 2 cores
    torchrun --nproc-per-node 4 examples/torch_pipelining_paci.py --steps 40 --a 2
    torchrun --nproc-per-node 2 examples/torch_pipelining_paci.py --clip stale     # global norm of update t − ⌈N/a⌉: no wait
    torchrun --nproc-per-node 2 examples/torch_pipelining_paci.py --clip stage     # no per-step synchronisation

A small decoder-only model in torchtitan's layout (``tok_embeddings``, ``layers`` as an ``nn.ModuleDict``
keyed by index, ``norm``, ``output``; ``forward`` skips the parts that are ``None``) is built whole on every
rank, pruned to the rank's stage by ``unbubble.pipelining.pipeline_paci`` (the shape of torchtitan's
``pipelining_fn``) and trained with ``SchedulePACI``. ``Trainer.train_step`` below is written the way
torchtitan's is: ``zero_grad``, ``pp_schedule.step``, gradient clipping over the pipeline, a non-finite
check, ``optimizer.step``, ``lr_scheduler.step``. The only PACI-specific line is that ``step`` takes the data
iterator ([Note: the step contract] in docs/architecture.md). Data: each sequence counts upward
from a random start modulo the vocabulary, so the next token is predictable and the loss falls fast.
The last stage prints ``step | loss | grad norm | lr | s/step``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from unbubble.pipelining import clip_grad_norm_pp, pipeline_paci
from unbubble.runtime.clipping import PipelineClip


@dataclass(kw_only=True, slots=True)
class Config:
    """What the example trains (defaults: a 12-step run of a 4-layer model)."""

    steps: int = 12
    """training steps = PACI updates of every stage"""
    n_microbatches: int = 4
    """micro-batches per batch of the data iterator (torchtitan: local_batch_size / microbatch_size)"""
    a: int | None = None
    """PACI's accumulation factor: backwards per step and update (default n_microbatches)"""
    micro_batch_size: int = 4
    seq_len: int = 32
    vocab_size: int = 64
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 4
    lr: float = 3e-3
    warmup_steps: int = 2
    max_norm: float = 1.0
    clip: str = "global"
    """"global" (torchtitan's clip over the pipeline group: one all-reduce per step, every rank waits for the
    slowest), "stale" (the global norm of update t − ⌈N/a⌉ from a non-blocking all-gather: no rank waits;
    unbubble.runtime.clipping.PipelineClip), "stage" (each stage by its own norm, no synchronisation) or "none\""""
    seed: int = 0
    log: bool = True


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP: ``(B, T, C) → (B, T, C)``."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """torchtitan's layout: the pipeline split deletes what a stage does not own and sets it to ``None``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg.dim, cfg.n_heads) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T) → (B, T, C)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h  # (B, T, V) on the last stage


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss: logits ``(B, T, V)``, labels ``(B, T)`` int64."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def micro_batch(cfg: Config, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch k (deterministic in k): inputs and labels ``(micro_batch_size, seq_len)`` int64."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + k)
    start = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, 1), generator=g)
    seq = (start + torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1], seq[:, 1:]


def batches(cfg: Config, start: int = 0):
    """Endless iterator of ``(inputs, labels)`` batches of ``n_microbatches`` micro-batches (torchtitan's
    data_iterator), from batch ``start`` on."""
    m = cfg.n_microbatches
    for b in itertools.count(start):
        mbs = [micro_batch(cfg, b * m + j) for j in range(m)]
        yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])


def build_model(cfg: Config) -> Decoder:
    torch.manual_seed(cfg.seed)  # the same whole model on every rank before the split
    return Decoder(cfg)


def lr_lambda(cfg: Config, step: int) -> float:
    """Linear warm-up, then cosine to 10 % (a function of the update count only)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    p = min((step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1), 1.0)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * p))


class Trainer:
    """The parts of torchtitan's ``Trainer`` that a pipeline-parallel step touches."""

    def __init__(self, cfg: Config, group: dist.ProcessGroup | None = None):
        self.cfg, self.group = cfg, group
        self.pp_schedule, self.model_parts, self.pp_has_first_stage, self.pp_has_last_stage = pipeline_paci(
            build_model(cfg), device=torch.device("cpu"), loss_fn=cross_entropy, n_microbatches=cfg.n_microbatches,
            a=cfg.a, group=group)
        params = [p for m in self.model_parts for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_lambda(cfg, s))
        self.step = 0
        self.stale_clip = PipelineClip(cfg.max_norm, "stale", a=cfg.a or cfg.n_microbatches, group=group) \
            if cfg.clip == "stale" else None

    def train_step(self, data_iterator) -> tuple[float, float]:
        """One training step, torchtitan's order. Returns ``(mean loss of this step on the last stage, or
        −1 elsewhere; total grad norm)``."""
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        # PACI: this stage's next a backwards; the first stage reads ahead through the iterator
        self.pp_schedule.step(data_iterator, losses=losses)
        loss = torch.stack(losses).mean().item() if self.pp_has_last_stage else -1.0
        params = [p for m in self.model_parts for p in m.parameters()]
        if self.cfg.clip == "global":  # over the pipeline: every rank holds the same update's gradients now
            grad_norm = clip_grad_norm_pp(params, self.cfg.max_norm, self.group)
        elif self.cfg.clip == "stale":  # no wait: the norm of update t − s, whose all-gather every rank has entered
            grad_norm = self.stale_clip(params)
        elif self.cfg.clip == "stage":
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if not torch.isfinite(grad_norm):
            if self.cfg.clip != "stale":  # with "global" every rank stops at the same update
                raise FloatingPointError(f"step {self.step + 1}: non-finite gradient norm {float(grad_norm)}")
            # stale: this rank skips the update (its own norm now; every rank when the global norm arrives)
            print(f"step {self.step + 1}: non-finite gradient norm, update skipped on this stage", flush=True)
        else:
            self.optimizer.step()  # PACI's local update U of this stage
        self.lr_scheduler.step()
        self.step += 1
        return loss, float(grad_norm)

    def train(self) -> list[float]:
        data_iterator = batches(self.cfg)
        losses = []
        for _ in range(self.cfg.steps):
            t0 = time.perf_counter()
            loss, norm = self.train_step(data_iterator)
            if self.pp_has_last_stage:
                losses.append(loss)
                if self.cfg.log:
                    print(f"step {self.step:3d} | loss {loss:.4f} | grad norm {norm:.3f} | "
                          f"lr {self.lr_scheduler.get_last_lr()[0]:.2e} | {time.perf_counter() - t0:.3f} s/step",
                          flush=True)
        self.pp_schedule.drain()  # nothing in flight: evaluate or checkpoint the model parts now
        if self.stale_clip is not None:
            self.stale_clip.drain()  # the last s updates' all-gathers
        return losses


def train(cfg: Config, group: dist.ProcessGroup | None = None) -> dict:
    """Trains on an initialised process group; returns this rank's losses, stage weights and drift counts."""
    trainer = Trainer(cfg, group)
    losses = trainer.train()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()},
            "drift": dict(trainer.pp_schedule.drift), "steps": trainer.pp_schedule.steps}


def main(argv: list[str] | None = None) -> None:
    d = Config()  # slots: the defaults live on an instance
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--a", type=int, default=None)
    p.add_argument("--n-microbatches", type=int, default=d.n_microbatches)
    p.add_argument("--clip", choices=["global", "stale", "stage", "none"], default=d.clip)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        cfg = Config(steps=args.steps, a=args.a, n_microbatches=args.n_microbatches, clip=args.clip)
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"PACI a={cfg.a or cfg.n_microbatches} on {dist.get_world_size()} torch PipelineStages, "
                  f"{cfg.n_microbatches} micro-batches of {cfg.micro_batch_size}×{cfg.seq_len} tokens per batch, "
                  f"clip={cfg.clip}, torchrun rank {os.environ.get('RANK')}", flush=True)
        train(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
