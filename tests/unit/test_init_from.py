"""``unbubble train --init-from``: a run that starts from another layout's checkpoint ([Note: starting from another
layout's checkpoint] in ``runtime/checkpoint.py``), against the same two phases run by hand through the library."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from unbubble.config import TrainConfig
from unbubble.data import prepare_tokens
from unbubble.errors import ConfigError
from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule
from unbubble.train import build_job, resolve_run_tokenizer, train

K, T = 3, 7  # phase 1: K updates of 1F1B-flush on N = 2; phase 2: PACI on N = 3 up to update T


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _cfg(cache_dir: str, run_dir, **kw) -> TrainConfig:
    base = dict(engine="emulator", model="tiny", steps=T, seq_len=32, micro_batch_size=2, eval_interval=0,
                eval_batches=1, optimizer="adamw", lr=1e-2, warmup_min=2, cache_dir=cache_dir, run_dir=str(run_dir),
                tensorboard=False, error_feedback=0.0)
    return TrainConfig(**{**base, **kw})


def _stage_files(run_dir, step: int, n: int) -> list[dict]:
    return [torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / f"stage-{s:03d}.pt", weights_only=True)
            for s in range(n)]


def _with_weights(stage_fn, weights: dict, stage: int):
    module = stage_fn(stage)
    module.load_state_dict({k: weights[k] for k in module.state_dict()})
    return module


def _with_moments(optimizer_fn, moments: dict, named: list, stage: int):
    opt = optimizer_fn(named, stage)
    name_of = {id(p): n for n, p in named}
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {k: v.clone() for k, v in moments[name_of[id(p)]].items()}
    return opt


def _shifted(lr_lambda, shift: int, u: int) -> float:
    return lr_lambda(u + shift)


def test_paci_from_a_1f1b_checkpoint_at_another_depth_equals_the_two_phases_by_hand(tmp_path, cache_dir):
    """Phase 1: 1F1B-flush on N = 2, m = 4, for K = 3 updates (``train``). Phase 2: ``train(init_from=phase 1)`` with
    PACI on N = 3, a = 2, up to update T = 7. Reference, by hand through the library: phase 1's stage files read with
    torch.load, weights merged by name into phase 2's stages, AdamW moments put in by parameter name, the
    learning-rate schedule shifted by K, the micro-batch ids continuing after phase 1's 12, and the emulator runs
    PACI for T − K updates. Weight for weight equal (max difference 0), losses too. ``--resume`` of the new run
    from the checkpoint it started with gives the same again (its data position kept); a mismatch of model, or
    too few steps, is refused in one line; another optimizer takes the weights and starts from no state."""
    run1, run2 = tmp_path / "flush", tmp_path / "paci"
    train(_cfg(cache_dir, run1, schedule="1f1b-flush", stages=2, m=4, steps=K))
    cfg2 = _cfg(cache_dir, run2, schedule="paci", stages=3, a=2, init_from=str(run1))
    result, _ = train(cfg2)
    info = json.loads((run2 / "init_from.json").read_text())
    assert info["step"] == K and info["optimizer_carried"] and info["data_offset"] == K * 4 - K * 2
    assert result.start_step == K and len(result.step_losses) == T - K

    # by hand
    files = _stage_files(run1, K, 2)
    weights = {k: v for f in files for k, v in f["executor"]["model"].items()}
    cfg2, tokenizer = resolve_run_tokenizer(cfg2)
    tokens = prepare_tokens(cfg2.corpus, tokenizer, cfg2.cache_dir)
    job, _ = build_job(dataclasses.replace(cfg2, init_from=None, run_dir=None), tokens)
    # phase 1's optimizers keep their state by position over their groups: name the positions by building the
    # same optimizer over each phase-1 stage's own parameters (its module, as phase 1 built it)
    job1, _ = build_job(dataclasses.replace(_cfg(cache_dir, run1, schedule="1f1b-flush", stages=2, m=4, steps=K),
                                            run_dir=None, tokenizer=cfg2.tokenizer), tokens)
    moments = {}
    for s, f in enumerate(files):
        named = [(n, p) for n, p in job1.stage_fn(s).named_parameters()]
        built = job1.optimizer_fn(named, s)
        name_of = {id(p): n for n, p in named}
        order = [name_of[id(p)] for g in built.param_groups for p in g["params"]]
        saved = f["executor"]["optimizer"]
        for i, name in zip([i for g in saved["param_groups"] for i in g["params"]], order):
            moments[name] = saved["state"][i]
    by_hand = dataclasses.replace(
        job, schedule=get_schedule("paci", 3, T - K, a=2),
        stage_fn=functools.partial(_with_weights, job.stage_fn, weights),
        optimizer_fn=functools.partial(_with_moments, job.optimizer_fn, moments),
        lr_lambda=functools.partial(_shifted, job.lr_lambda, K),
        batch_fn=lambda k: job.batch_fn(k + K * 4), val_fn=None, checkpoint=None)  # phase 1 read ids 0 … 11
    ref = run_emulator(by_hand)
    diff = max((result.final_states[s][k] - v).abs().max().item() for s in range(3)
               for k, v in ref.final_states[s].items())
    print(f"PACI N=3 from the 1F1B N=2 checkpoint at step {K}: max weight difference {diff} against the by-hand run")
    assert diff == 0.0
    assert result.step_losses == ref.step_losses

    # --resume of that run, from the checkpoint it started with (step 3): the same data position, the same weights
    import shutil

    copy = tmp_path / "paci-resumed"
    shutil.copytree(run2, copy)
    shutil.rmtree(copy / "checkpoints" / f"step-{T:08d}")
    (copy / "summary.json").unlink()
    resumed, _ = train(resume=str(copy))
    assert resumed.step_losses == result.step_losses
    assert all(torch.equal(resumed.final_states[s][k], v) for s in range(3) for k, v in result.final_states[s].items())

    with pytest.raises(ConfigError, match=r"^init_from='.*step-00000003' holds another model: parameter "
                                          r"'h\.0\.attn\.c_attn\.bias' is \[384\] there and \[192\] in this run "
                                          r"\(give the same --model, tokenizer and --untie\)$"):
        train(_cfg(cache_dir, tmp_path / "other", model="deep-cpu", schedule="paci", stages=2, init_from=str(run1)))
    with pytest.raises(ConfigError, match=r"^init_from='.*' is at step 3, and this run has steps=3: give more steps "
                                          r"than 3 \(the update counter continues from the checkpoint\)$"):
        train(_cfg(cache_dir, tmp_path / "short", schedule="paci", stages=2, steps=3, init_from=str(run1)))
    # another optimizer: the weights are taken, its state starts empty (recorded)
    train(_cfg(cache_dir, tmp_path / "muon", schedule="paci", stages=2, optimizer="muon", steps=K + 1,
               init_from=str(run1 / "checkpoints" / f"step-{K:08d}")))
    assert json.loads((tmp_path / "muon" / "init_from.json").read_text())["optimizer_carried"] is False
