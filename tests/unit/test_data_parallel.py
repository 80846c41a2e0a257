"""2-D parallelism pieces that need no second process: rank layout, replica data ids, the
message header, and gradient averaging's flatten / unflatten (a one-rank gloo group)."""

import pytest
import torch
import torch.distributed as dist

from unbubble.config import TrainConfig
from unbubble.errors import ConfigError
from unbubble.runtime.data_parallel import GradientAverager, Layout, replica_batch
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.transport import (TensorMeta, decode_header, encode_header, frame_bytes, frame_header,
                                       frame_payload, pack_frame)
from unbubble.schedules import get_schedule
from helpers import tiny_gpt_job


def test_layout_puts_one_replica_on_contiguous_ranks():
    lay = Layout(dp=3, pp=4)
    assert lay.world == 12
    assert [lay.split(g) for g in (0, 3, 4, 11)] == [(0, 0), (0, 3), (1, 0), (2, 3)]
    assert all(lay.global_rank(*lay.split(g)) == g for g in range(12))
    assert lay.replica_ranks(1) == [1, 5, 9]


def _ids(k):
    return k


def test_replicas_read_disjoint_data_ids_that_cover_the_stream_in_order():
    ids = sorted(replica_batch(_ids, 2, d, k) for k in range(4) for d in range(2))
    assert ids == list(range(8))
    job = tiny_gpt_job(get_schedule("paci", 2, steps=1, a=2))
    job.dp = 2
    ex = job.build_executor(0, replica=1)
    assert torch.equal(ex.batch_fn(3)[0], job.batch_fn(7)[0])
    job.dp = 1
    assert job.build_executor(0).batch_fn is job.batch_fn  # one replica: ids unchanged


def test_header_round_trips_and_rejects_out_of_range_ids():
    for stage, k in [(0, 0), (7, 12345), (15, 2**40 - 1)]:
        assert decode_header(encode_header(stage, k)) == (stage, k)
    with pytest.raises(ValueError, match="k=1099511627776"):
        encode_header(0, 2**40)


def test_frames_carry_payloads_of_any_size_and_dtype_padded_to_the_channel():
    payloads = [torch.randn(3, 5), torch.arange(7, dtype=torch.int32), torch.randn(2, dtype=torch.float64),
                torch.randn(4, 3).t()]  # the last one non-contiguous
    size = frame_bytes(max(t.numel() * t.element_size() for t in payloads))
    assert size % 8 == 0
    for stage, t in enumerate(payloads):
        frame = pack_frame(t, stage, 1000 + stage, size)
        assert frame.numel() == size and frame_header(frame) == (stage, 1000 + stage)
        got = frame_payload(frame, TensorMeta(tuple(t.shape), t.dtype))
        assert torch.equal(got, t) and got.data_ptr() == frame.data_ptr()  # a view at offset 0


def test_dp_is_validated_and_the_emulator_refuses_replicas():
    with pytest.raises(ConfigError, match=r"dp=0 is invalid: must be an integer ≥ 1 \(set --dp\)"):
        TrainConfig(dp=0)
    job = tiny_gpt_job(get_schedule("paci", 2, steps=1, a=1))
    job.dp = 2
    with pytest.raises(ConfigError, match="dp=2 is invalid for the emulator"):
        run_emulator(job)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_averager_buckets_restore_every_gradient_in_place(one_rank_group):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 4), (5,), (2, 2), (7,)]]
    want = []
    for i, p in enumerate(params):
        if i == 2:
            continue  # no gradient: becomes zeros
        p.grad = torch.randn(p.shape[::-1]).t() if p.dim() == 2 else torch.randn(p.shape)  # one non-contiguous
        want.append(p.grad.clone())
    want.insert(2, torch.zeros(2, 2))
    ids = [id(p.grad) for p in params if p.grad is not None]
    avg = GradientAverager(one_rank_group, dp=1, bucket_bytes=40)  # forces several buckets
    assert len(avg._buckets([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])) > 1
    assert avg(params, loss=2.5) == 2.5
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w)
    assert [id(p.grad) for i, p in enumerate(params) if i != 2] == ids  # same tensors, updated in place
    half = GradientAverager(one_rank_group, dp=2)  # the sum over one rank divided by D = 2
    assert half(params) is None
    assert torch.equal(params[0].grad, want[0] / 2)
