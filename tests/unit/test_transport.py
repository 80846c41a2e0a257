"""The process engine's frames ([Note: shapes travel with each frame] in runtime/transport.py),
checked in-process; the multi-process runs are in tests/multiproc/test_processes.py."""

import pytest
import torch

from unbubble.runtime.transport import (DTYPES, TensorMeta, announce_frame, frame_bytes, frame_header, frame_payload,
                                       grown_capacity, pack_frame, read_trailer)


@pytest.mark.parametrize("tensor", [torch.randn(3, 5), torch.randn(1, 2, 1, 3, 1, 2), torch.tensor(2.5),
                                    torch.arange(6, dtype=torch.int16).view(2, 3), torch.tensor([True, False, True]),
                                    torch.randn(4, 3, dtype=torch.bfloat16).t(), torch.zeros(0, 8)])
def test_a_frame_carries_its_payloads_shape_and_dtype(tensor):
    size = frame_bytes(1024)  # a channel's capacity larger than the payload: padded
    frame = pack_frame(tensor, 3, 77, size)
    assert frame.numel() == size == 1024 + 64 and frame_header(frame) == (3, 77)
    got = frame_payload(frame)  # the shape comes from the trailer
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    assert got.numel() == 0 or got.data_ptr() == frame.data_ptr()  # a view at offset 0


def test_meta_words_round_trip_for_every_dtype():
    for dtype in DTYPES:
        meta = TensorMeta((4, 1, 9), dtype)
        assert TensorMeta.from_words(list(meta.words())) == meta


def test_an_announcement_frame_names_the_next_capacity():
    frame = announce_frame(frame_bytes(40), 4096, torch.device("cpu"))
    words = read_trailer(frame)
    assert frame.numel() == 104 and words[1] == -1 and words[2] == 4096


def test_capacity_grows_to_the_payload_or_by_a_quarter():
    assert grown_capacity(0, 100) == 104  # rounded up to 8
    assert grown_capacity(1000, 1008) == 1256  # 1.25 × 1000 = 1250, rounded up to 8
    assert grown_capacity(1000, 5000) == 5000


def test_a_tensor_the_trailer_cannot_describe_is_refused_with_stage_micro_batch_and_shape():
    with pytest.raises(ValueError) as info:
        pack_frame(torch.zeros(1, 1, 1, 1, 1, 1, 2), 2, 9, frame_bytes(64))
    assert str(info.value) == (
        "micro-batch 9's tensor for stage 2 has shape (1, 1, 1, 1, 1, 1, 2) and dtype torch.float32: the process "
        "engine sends at most 6 dimensions of dtypes float32, float16, bfloat16, float64, int64, int32, int16, int8, "
        "uint8, bool, complex64, complex128 (reshape it in the stage)")
