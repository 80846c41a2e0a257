"""Gradient clipping on real gloo processes equals the emulator bit for bit, for every scope
([Note: clip scopes] in docs/architecture.md): one spawn of 3 stage processes runs every job in turn."""

import dataclasses
import functools
import io
from datetime import timedelta

import pytest
import torch

from unbubble.runtime.checkpoint import Checkpointing
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from helpers import example_module, launch_gloo, tiny_gpt_config, tiny_gpt_job

pytestmark = pytest.mark.multiproc
torch.set_num_threads(1)  # as in each stage process, so the emulator's arithmetic matches bit for bit
N = 3


def _worker(rank: int, world: int, port: int, jobs: list, q) -> None:
    import torch.distributed as dist

    from unbubble.runtime.worker import from_bytes, run_stage

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        results = []
        for job in jobs:
            if isinstance(job, dict):  # the torchtitan-shaped example on torch's PipelineStage
                ex = example_module()
                results.append(ex.train(ex.Config(**job, log=False)))
                continue
            msgs: list[tuple] = []
            run_stage(job, rank, msgs.append)
            finals = {s: p for kind, s, p in msgs if kind == "final"}
            results.append({"states": {s: from_bytes(p[0]) for s, p in finals.items()},
                            "clip": {s: p[4] for s, p in finals.items()},
                            "losses": [p for kind, _, p in msgs if kind == "step_loss"]})
        buf = io.BytesIO()
        torch.save(results, buf)
        q.put((rank, buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        q.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _launch(jobs: list, world: int = N, timeout_s: float = 400.0) -> list[list[dict]]:
    return launch_gloo(_worker, world, jobs, timeout_s)


def test_every_scope_on_processes_equals_the_emulator_bit_for_bit(tmp_path):
    paci = tiny_gpt_job(get_schedule("paci", N, 6, a=2), lr=0.05)
    six = tiny_gpt_job(get_schedule("interleaved-1f1b", N, 3, m=3, v=2), lr=0.05,
                       config=tiny_gpt_config(n_layer=6))
    ck = Checkpointing(str(tmp_path / "ck"), every=3, keep=10)
    jobs = {
        "paci sync": dataclasses.replace(paci, clip_grad_norm=0.3, clip_scope="sync"),
        "paci stale": dataclasses.replace(paci, clip_grad_norm=0.3, clip_scope="stale"),
        "paci stage": dataclasses.replace(paci, clip_grad_norm=0.3, clip_scope="stage"),
        "flush sync": dataclasses.replace(tiny_gpt_job(get_schedule("1f1b-flush", N, 3, m=3), lr=0.05),
                                          clip_grad_norm=0.3),
        "interleaved stale": dataclasses.replace(six, clip_grad_norm=0.3, clip_scope="stale"),
        "paci stale, checkpointed": dataclasses.replace(paci, clip_grad_norm=0.3, clip_scope="stale", checkpoint=ck),
        "paci stale, resumed at 3": dataclasses.replace(paci, clip_grad_norm=0.3, clip_scope="stale",
                                                        checkpoint=dataclasses.replace(ck, resume_step=3)),
    }
    results = _launch(list(jobs.values()))
    for i, (what, job) in enumerate(jobs.items()):
        if job.checkpoint is not None and job.checkpoint.resume_step is None:  # the same cuts, its own folder
            job = dataclasses.replace(job, checkpoint=dataclasses.replace(ck, directory=str(tmp_path / "emu")))
        emu = run_emulator(job)  # a resumed job reads the processes' own checkpoint files
        got = {s: st for r in range(N) for s, st in results[r][i]["states"].items()}
        clip = {s: c for r in range(N) for s, c in results[r][i]["clip"].items()}
        assert sorted(got) == list(range(job.schedule.n_stages)), what
        for s, want in enumerate(emu.final_states):
            assert all(torch.equal(got[s][k], v) for k, v in want.items()), f"{what}: stage {s}"
        last = job.schedule.rank_of(job.schedule.n_stages - 1)
        assert results[last][i]["losses"] == emu.step_losses, what
        stats = [clip[s] for s in range(job.schedule.n_stages)]
        assert [c["clipped"] for c in stats] == emu.clip["clipped"] and any(emu.clip["clipped"]), what
        assert [c["skipped"] for c in stats] == emu.clip["skipped"], what
    # the resumed run continues the checkpointed one exactly
    whole, resumed = results[N - 1][5], results[N - 1][6]
    assert resumed["losses"] == whole["losses"][3:]
    for r in range(N):
        for s, st in results[r][6]["states"].items():
            assert all(torch.equal(st[k], v) for k, v in results[r][5]["states"][s].items())


def _concatenated(batch_fn, dp: int, k: int):
    parts = [batch_fn(k * dp + d) for d in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_two_replicas_clip_by_the_norm_of_their_averaged_gradients():
    """2 replicas × 2 stages: the norm is taken after the data-parallel average, so both scopes equal
    one replica with twice the batch (to rounding: the batched forward sums in another order)."""
    sched = get_schedule("1f1b-flush", 2, steps=3, m=2)
    base = tiny_gpt_job(sched, optimizer="sgd", lr=0.1)
    jobs = [dataclasses.replace(base, dp=2, clip_grad_norm=0.3, clip_scope=scope) for scope in ("sync", "stale")]
    results = _launch(jobs, world=4)
    for i, job in enumerate(jobs):
        ref = run_emulator(dataclasses.replace(job, dp=1, batch_fn=functools.partial(_concatenated, base.batch_fn, 2)))
        assert any(ref.clip["clipped"])
        for s in range(2):
            assert results[s][i]["clip"][s]["clipped"] == ref.clip["clipped"][s]
            for name, want in ref.final_states[s].items():
                torch.testing.assert_close(results[s][i]["states"][s][name], want, rtol=1e-5, atol=1e-7)


def test_the_example_on_torch_pipeline_stages_with_clip_stale_equals_the_emulator():
    """examples/torch_pipelining_paci.py --clip stale (PipelineClip) on 2 ranks, a = 1 (s = ⌈2/1⌉ = 2)
    and a = 2 (s = 1): bit-equal weights to the emulator's PACI with clip_scope='stale'."""
    runs = [{"steps": 6, "a": 1, "clip": "stale", "max_norm": 0.2}, {"steps": 5, "a": 2, "clip": "stale", "max_norm": 0.2}]
    results = _launch(runs, world=2)
    ex = example_module()
    for i, run in enumerate(runs):
        cfg = ex.Config(**run, log=False)
        job = PipelineJob(stage_fn=functools.partial(_example_stage, cfg), loss_fn=ex.cross_entropy,
                          batch_fn=functools.partial(ex.micro_batch, cfg), optimizer_fn=_example_adamw(cfg),
                          schedule=get_schedule("paci", 2, cfg.steps, a=cfg.a), lr_lambda=functools.partial(ex.lr_lambda, cfg),
                          clip_grad_norm=cfg.max_norm, clip_scope="stale")
        emu = run_emulator(job)
        assert any(emu.clip["clipped"]) and emu.clip["lag"] == -(-2 // cfg.a)
        for s in range(2):
            assert all(torch.equal(results[s][i]["state"][k], v) for k, v in emu.final_states[s].items()), (run, s)
        assert results[1][i]["losses"] == pytest.approx(emu.step_losses, rel=1e-6, abs=0)


def _example_stage(cfg, stage: int):
    from unbubble.pipelining import split_torchtitan_model

    return split_torchtitan_model(example_module().build_model(cfg), stage, 2)


def _example_adamw(cfg):
    def make(params, stage):
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return make
