"""Small deterministic jobs and independent references, for tests and users' own checks."""

from __future__ import annotations

import functools

import torch
from torch import nn

from unbubble.models import GPTConfig, ModelConfig, build_stages, gpt_loss
from unbubble.runtime.job import PipelineJob
from unbubble.schedules.registry import Schedule


def random_tokens(vocab_size: int, micro_batch_size: int, seq_len: int, seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch k of random token ids: ``(x, y)``, each ``(micro_batch_size, seq_len)`` int64."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + k)
    t = torch.randint(0, vocab_size, (micro_batch_size, seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _stage(config: ModelConfig, n_stages: int, seed: int, loss_scale: float, stage: int) -> nn.Module:
    return build_stages(config, n_stages, seed, only=stage, loss_scale=loss_scale)[stage]


def _sgd(lr: float, params: list, stage: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def _adamw(lr: float, params: list, stage: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def tiny_gpt_config(n_layer: int = 4, vocab_size: int = 64, block_size: int = 16) -> GPTConfig:
    """A GPT-2 shaped model small enough for unit tests (≈ 60k parameters)."""
    return GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size)


def tiny_gpt_job(schedule: Schedule, optimizer: str = "adamw", lr: float = 1e-2, seed: int = 0,
                 micro_batch_size: int = 2, config: ModelConfig | None = None) -> PipelineJob:
    """A picklable pipeline job on random tokens (used by the tests of every engine); GPT-2 unless
    ``config`` is another architecture's."""
    config = config or tiny_gpt_config()
    opt = {"adamw": _adamw, "sgd": _sgd}[optimizer]
    return PipelineJob(
        stage_fn=functools.partial(_stage, config, schedule.n_stages, seed, schedule.loss_scale),
        loss_fn=gpt_loss,
        batch_fn=functools.partial(random_tokens, config.vocab_size, micro_batch_size, config.block_size, seed),
        optimizer_fn=functools.partial(opt, lr),
        schedule=schedule,
    )


def assert_resume_is_bit_identical(job: PipelineJob, step: int) -> None:
    """Runs ``job`` (whose ``checkpoint`` saves at ``step``) on the emulator whole, then resumed
    from ``step``, and asserts the resumed run gives the same later losses and final weights, bit for bit."""
    import dataclasses

    from unbubble.runtime.emulator import run_emulator

    full = run_emulator(job)
    resumed = run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=step)))
    assert resumed.step_losses == full.step_losses[step:]
    for got, want in zip(resumed.final_states, full.final_states):
        assert all(torch.equal(got[k], want[k]) for k in want)


def train_without_pipeline(job: PipelineJob) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Independent reference for synchronous schedules: the same stages composed into one
    model, trained in one process with one optimizer per stage, mean loss over each step's
    micro-batches.

    Returns:
        ``(state_dicts per stage, mean training loss per step)``.
    """
    sched = job.schedule
    stages = [job.stage_fn(s) for s in range(sched.n_stages)]
    opts = [job.optimizer_fn([p for p in m.parameters() if p.requires_grad], s) for s, m in enumerate(stages)]
    model = nn.Sequential(*stages)
    losses = []
    for t in range(sched.steps):
        total = 0.0
        for k in range(t * sched.mb_per_step, (t + 1) * sched.mb_per_step):
            x, y = job.batch_fn(k)
            loss = job.loss_fn(model(x), y)
            (loss * sched.loss_scale).backward()
            total += loss.item()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(total / sched.mb_per_step)
    return [m.state_dict() for m in stages], losses
