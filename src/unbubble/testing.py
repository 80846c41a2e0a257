"""Independent references for users' own checks: a run resumed from a checkpoint against the same run whole,
a synchronous schedule against its stages composed into one model, and deterministic random tokens.

The fixtures of unbubble's own tests (tiny jobs, models and batches) live in ``tests/helpers.py``."""

from __future__ import annotations

import torch
from torch import nn

from unbubble.runtime.job import PipelineJob


def random_tokens(vocab_size: int, micro_batch_size: int, seq_len: int, seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch k of random token ids: ``(x, y)``, each ``(micro_batch_size, seq_len)`` int64."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + k)
    t = torch.randint(0, vocab_size, (micro_batch_size, seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


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
    """Independent reference for synchronous *schedules*: the job's own stages composed into one
    model, trained in one process with one optimizer per stage, mean loss over each step's
    micro-batches. It checks a schedule, not a split: composed from the same stages, it agrees with
    any splitting error (docs/architecture.md#testing), so a split model's job is refused; compare those against the
    unsplit model's own loop.

    Returns:
        ``(state_dicts per stage, mean training loss per step)``.

    Raises:
        TypeError: ``job.stage_fn`` is a ``split_model`` split.
    """
    from unbubble.models.split import SplitModel

    if isinstance(job.stage_fn, SplitModel):
        raise TypeError("train_without_pipeline composes the split's own stages, so it cannot catch a splitting "
                        "error: compare a split model against the unsplit model's own training loop")
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
