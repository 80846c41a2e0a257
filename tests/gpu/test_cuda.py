"""The CUDA path (NCCL, device tensors, no host synchronisation per message).

Skipped without CUDA (this repository's CI is CPU-only). What runs where:
* one device: a stage's F and B and the transport's header construction issue no
  host synchronisation (``torch.cuda.set_sync_debug_mode("error")`` turns one into an error);
* two devices: 1F1B-flush over NCCL equals the non-pipelined reference (rtol 1e-5);
* four devices: 2 replicas × 2 stages over NCCL equal one replica with twice the batch.
"""

import dataclasses
import functools

import pytest
import torch

from unbubble.runtime.launch import run_processes
from unbubble.runtime.transport import frame_bytes, frame_header, pack_frame
from unbubble.schedules import get_schedule
from unbubble.testing import train_without_pipeline
from helpers import tiny_gpt_job

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(gpus == 0, reason="needs CUDA")


def test_forward_backward_and_headers_do_not_synchronise_with_the_host():
    # the non-finite guard's check is one documented host synchronisation per micro-batch: off here
    job = dataclasses.replace(tiny_gpt_job(get_schedule("1f1b-flush", 2, steps=1, m=2)), nan_policy="off")
    dev = torch.device("cuda", 0)
    first, last = (job.build_executor(s, device=dev) for s in (0, 1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        for k in range(2):
            act = first.forward(k)
            last.forward(k, act)
            grad = last.backward(k)
            first.backward(k, grad)
            frame = pack_frame(act, 1, k, frame_bytes(act.numel() * act.element_size()))  # as send() does
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert frame_header(frame) == (1, 1)
    last.update()  # reads the step's losses: the one synchronisation per update (last stage)
    assert last.last_step_loss is not None


@pytest.mark.skipif(gpus < 2, reason="needs 2 CUDA devices")
def test_flush_over_nccl_equals_non_pipelined_reference():
    job = tiny_gpt_job(get_schedule("1f1b-flush", 2, steps=3, m=4), optimizer="sgd", lr=0.1)
    result = run_processes(job, backend="nccl")
    ref_states, ref_losses = train_without_pipeline(job)
    for got, want in zip(result.final_states, ref_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)


def _concatenated(batch_fn, dp, k):
    parts = [batch_fn(k * dp + d) for d in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.mark.skipif(gpus < 4, reason="needs 4 CUDA devices")
def test_two_replicas_over_nccl_equal_one_replica_with_twice_the_batch():
    sched = get_schedule("1f1b-flush", 2, steps=3, m=4)
    job = tiny_gpt_job(sched, optimizer="sgd", lr=0.1)
    job.dp = 2
    result = run_processes(job, backend="nccl")
    ref = tiny_gpt_job(sched, optimizer="sgd", lr=0.1)
    ref.batch_fn = functools.partial(_concatenated, job.batch_fn, 2)
    ref_states, _ = train_without_pipeline(ref)
    for got, want in zip(result.final_states, ref_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
