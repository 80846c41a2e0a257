"""Independent references for users' own checks: a run resumed from a checkpoint against the same run whole,
a synchronous schedule against its stages composed into one model, deterministic random tokens, and a
Hugging Face family's split against its unsplit model's own training loop (:func:`verdict`, the check of
every family in docs/models.md; the tiny models and the loop are ``unbubble.models.hf_zoo``'s).

The fixtures of unbubble's own tests (tiny jobs, models and batches) live in ``tests/helpers.py``."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable

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


@dataclasses.dataclass
class Verdict:
    """What split_model does with one family: ``kind`` is ``"exact"`` (1F1B-flush on 2 and 4 stages
    equals the unsplit loop), ``"refused"`` (one line, ``detail``), ``"cannot run unsplit"`` (the
    unsplit model's own forward/backward fails on CPU in fp32, ``detail``), ``"not a decoder"``,
    ``"differs"`` (the probe passed but training differs: a silent error), ``"fails"`` (the split raised
    while training). ``diffs``: stages -> max |difference| of losses and final weights."""

    family: str
    kind: str
    detail: str = ""
    features: list[str] = dataclasses.field(default_factory=list)
    changed: dict[str, float | None] = dataclasses.field(default_factory=dict)
    diffs: dict[int, float] = dataclasses.field(default_factory=dict)
    drift: list[int] | None = None
    bound: list[int] | None = None
    seconds: float = 0.0


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def verdict(model_type: str, stages: tuple[int, ...] = (2, 4), steps: int = 2, m: int = 2,
            paci: bool = True, check_features: bool | tuple[str, ...] = True,
            split_fn: Callable | None = None) -> Verdict:
    """Trains ``model_type``'s tiny model split (1F1B-flush on each of ``stages``, the emulator) against
    :func:`~unbubble.models.hf_zoo.train_unsplit`, and PACI (a=2) on the largest, recording what happened (:class:`Verdict`).

    ``check_features``: measure each feature's effect on the logits (``hf_zoo.feature_changes_logits``),
    or only the named ones. ``split_fn(model, n_stages)`` splits (default ``split_model``; a test passes a wrong one to show a
    wrong split is caught)."""
    import time

    from unbubble.errors import ConfigError
    from unbubble.models.hf_zoo import (batch, feature_changes_logits, features, not_a_decoder, takes_attention_mask,
                                        tiny_model, train_unsplit)
    from unbubble.models.split import causal_lm_loss, count_layers, split_model
    from unbubble.runtime.emulator import run_emulator
    from unbubble.runtime.job import PipelineJob
    from unbubble.schedules import get_schedule

    t0 = time.perf_counter()
    why = not_a_decoder(model_type)
    if why:
        return Verdict(model_type, "not a decoder", why)
    v = Verdict(model_type, "exact")
    try:
        model = tiny_model(model_type)
        pad = takes_attention_mask(model)
        probe = copy.deepcopy(model)
        x, y = batch(0, pad)
        nn.functional.cross_entropy(probe(**x).logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100).backward()
    except Exception as exc:  # noqa: BLE001 - the family's own code fails: nothing to split
        v.kind, v.detail = "cannot run unsplit", _one_line(exc)
        v.seconds = time.perf_counter() - t0
        return v
    feats = features(model_type)
    v.features = [name for name, _ in feats]
    if check_features:
        wanted = set(check_features) if isinstance(check_features, tuple) else {name for name, _ in feats}
        v.changed = {name: feature_changes_logits(model_type, off, model) if off else None
                     for name, off in feats if name in wanted}
        model.train()
    batch_fn = functools.partial(batch, padding=pad)
    try:
        runs = [n for n in stages if n <= count_layers(model)]
        splits = {n: (split_fn or split_model)(model, n) for n in runs}
    except ConfigError as exc:
        v.kind, v.detail = "refused", str(exc).splitlines()[0]
        v.seconds = time.perf_counter() - t0
        return v
    except Exception as exc:  # noqa: BLE001 - a crash is not a refusal: recorded as such
        v.kind, v.detail = "fails", "split_model raised " + _one_line(exc)
        v.seconds = time.perf_counter() - t0
        return v

    def adamw(params, stage=0):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    ref, losses = train_unsplit(model, steps, m, batch_fn)
    want = ref.state_dict()
    try:
        for n, split in splits.items():
            job = PipelineJob(stage_fn=split, loss_fn=causal_lm_loss, batch_fn=batch_fn, optimizer_fn=adamw,
                              schedule=get_schedule("1f1b-flush", n, steps=steps, m=m))
            result = run_emulator(job)
            merged = {k: t for state in result.final_states for k, t in state.items()}
            if set(merged) != set(want):
                v.kind, v.detail = "differs", f"N={n}: the stages' names differ from the model's: " \
                    f"{sorted(set(merged) ^ set(want))[:3]}"
                break
            diffs = [abs(a - b) for a, b in zip(result.step_losses, losses, strict=True)]
            v.diffs[n] = max(diffs + [float((merged[k].float() - want[k].float()).abs().max()) for k in want])
        if v.kind == "exact" and any(d != 0 for d in v.diffs.values()):
            v.kind = "differs"
            v.detail = ", ".join(f"N={n}: {d:.3g}" for n, d in v.diffs.items())
        if paci and v.kind == "exact":
            n = runs[-1]
            job = PipelineJob(stage_fn=splits[n], loss_fn=causal_lm_loss, batch_fn=batch_fn, optimizer_fn=adamw,
                              schedule=get_schedule("paci", n, steps=4, a=2))
            v.drift = run_emulator(job).max_drift()
            v.bound = [job.schedule.delay_bound(s) for s in range(n)]
    except Exception as exc:  # noqa: BLE001
        v.kind, v.detail = "fails", "training the split raised " + _one_line(exc)
    v.seconds = time.perf_counter() - t0
    return v
