"""The process engine's frames ([Note: shapes travel with each frame] in docs/architecture.md),
checked in-process; the multi-process runs are in tests/multiproc/test_processes.py."""

import threading
import time
import weakref

import pytest
import torch

from unbubble.runtime.transport import (DTYPES, TensorMeta, announce_frame, frame_bytes, frame_header, frame_payload,
                                       grown_capacity, pack_frame, read_trailer, SendReaper)


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


class _Send:
    """A started send that finishes when the test says so (gloo's Work: completion only via wait())."""

    def __init__(self, error: Exception | None = None):
        self.done, self.error = threading.Event(), error

    def wait(self):
        assert self.done.wait(10)
        if self.error is not None:
            raise self.error


def _released(ref, timeout=5.0):
    deadline = time.monotonic() + timeout
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    return ref() is None


def test_the_reaper_frees_each_frame_once_its_send_is_done_without_the_sender_waiting():
    # regression: gloo frames were kept until 256 sends were pending: +128 MiB per stage process
    reaper, sends, refs = SendReaper(cap=8), [], []
    for _ in range(3):
        frame, send = torch.empty(1 << 20, dtype=torch.uint8), _Send()
        reaper.submit(send, frame)  # returns at once: nothing has been sent yet
        sends.append(send)
        refs.append(weakref.ref(frame))
        del frame
    assert all(r() is not None for r in refs)
    sends[0].done.set()
    assert _released(refs[0]) and refs[1]() is not None and refs[2]() is not None  # in issue order
    sends[2].done.set()
    time.sleep(0.05)
    assert refs[2]() is not None  # still behind send 1
    sends[1].done.set()
    reaper.close()
    assert all(r() is None for r in refs)


def test_the_reaper_bounds_unfinished_sends():
    reaper, sends = SendReaper(cap=2), [_Send(), _Send(), _Send()]
    reaper.submit(sends[0], torch.zeros(1))
    reaper.submit(sends[1], torch.zeros(1))
    blocked = threading.Thread(target=reaper.submit, args=(sends[2], torch.zeros(1)))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # a third unfinished send waits for a slot
    sends[0].done.set()
    blocked.join(5)
    assert not blocked.is_alive()
    for send in sends:
        send.done.set()
    reaper.close()


def test_a_failed_send_is_raised_on_the_senders_thread_at_close_or_at_the_next_send():
    reaper = SendReaper(cap=4)
    bad = _Send(RuntimeError("connection closed by peer"))
    bad.done.set()
    reaper.submit(bad, torch.zeros(1))
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        reaper.close()
    reaper = SendReaper(cap=4)
    reaper.submit(bad, torch.zeros(1))
    deadline = time.monotonic() + 5
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        while time.monotonic() < deadline:
            reaper.submit(_done_send(), torch.zeros(1))
            time.sleep(0.01)


def _done_send() -> _Send:
    send = _Send()
    send.done.set()
    return send
