"""Point-to-point transport of activations and gradients over ``torch.distributed``.

One receiver thread per incoming channel blocks in ``dist.recv`` and fills the stage's inbox, and sends
are non-blocking, so communication overlaps compute and the stage thread never spins. Each message is one
frame (payload, then a trailer naming the micro-batch, dtype and shape): one receive per message halved
the wake-ups between a send and the neighbour's next action.

Notes: [Note: shapes travel with each frame], [Note: trees in a frame], [Note: one process group per channel],
[Note: CUDA without host synchronisation], [Note: reaping gloo sends] in
docs/architecture.md#runtimetransportpy.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import queue
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from unbubble.runtime import pytree
from unbubble.schedules.actions import ActionKind

#: The dtypes a frame can carry (their index is written into the trailer).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_MAX_DIMS = 6
_K_BITS = 40  # header = destination stage << 40 | k (k < 2**40 micro-batches)
_END_BASE = 1 << (_K_BITS - 1)  # k ≥ this: an end-of-stream frame for stop step k − _END_BASE
#: ``kind`` of the message :meth:`P2PTransport.poll` returns for an end-of-stream frame (its
#: ``k`` is the stop step T).
END = "end"
_WORDS = 8  # trailer: header, dtype/ndim code (or _ANNOUNCE), 6 dims (or the new capacity)
_TRAIL = 8 * _WORDS  # trailer bytes, at the end of a frame (the payload starts at offset 0: aligned)
_ANNOUNCE = -1  # code word of an announcement frame: the channel's next frames have capacity word 2
_TREE = -2  # code word of a pytree frame ([Note: trees in a frame])
_LEAF_BYTES = 64  # per leaf of a tree frame: code, 6 dims, byte offset
_GROWTH = 1.25  # a capacity grows to at least this factor of the old one


def _payload_bytes(nbytes: int) -> int:
    """Payload room of a frame: ``nbytes`` rounded up to 8 so the int64 trailer after it is aligned."""
    return -(-nbytes // 8) * 8


def frame_bytes(max_payload_bytes: int) -> int:
    """Size of every frame on a channel whose capacity is ``max_payload_bytes`` payload bytes."""
    return _payload_bytes(max_payload_bytes) + _TRAIL


def grown_capacity(old: int, nbytes: int) -> int:
    """The capacity a channel of capacity ``old`` bytes announces for a payload of ``nbytes``
    that does not fit: ``nbytes``, or ``1.25 × old`` if that is more (multiples of 8)."""
    return max(_payload_bytes(nbytes), _payload_bytes(int(old * _GROWTH)))


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one payload, as the trailer's words 1–7 carry them."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor, stage: int, k: int) -> "TensorMeta":
        """The meta of ``tensor``, sent to ``stage`` for micro-batch ``k``.

        Raises:
            ValueError: more than 6 dimensions or a dtype outside :data:`DTYPES` (names the stage,
                the micro-batch and the shape).
        """
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in DTYPES:
            raise ValueError(f"micro-batch {k}'s tensor for stage {stage} has shape {tuple(tensor.shape)} and dtype "
                             f"{tensor.dtype}: the process engine sends at most {_MAX_DIMS} dimensions of dtypes "
                             f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)} (reshape it in the stage)")
        return cls(tuple(tensor.shape), tensor.dtype)

    def words(self) -> tuple[int, ...]:
        """Trailer words 1–7: ``ndim + 16 × dtype index``, then the dims padded with zeros."""
        return (len(self.shape) + 16 * DTYPES.index(self.dtype), *self.shape, *[0] * (_MAX_DIMS - len(self.shape)))

    @classmethod
    def from_words(cls, words) -> "TensorMeta":
        ndim, dt = words[0] % 16, words[0] // 16
        return cls(tuple(int(x) for x in words[1:1 + ndim]), DTYPES[dt])

    @property
    def nbytes(self) -> int:
        """Bytes of one tensor with this meta."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


_DEVICE_WORDS: collections.OrderedDict = collections.OrderedDict()  # (device, words) -> int64 tensor (CUDA)


def _device_words(words: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``words`` as an int64 tensor on ``device``, uploaded once per distinct shape from pinned
    memory without waiting (an LRU of 64 entries)."""
    key = (device, words)
    t = _DEVICE_WORDS.get(key)
    if t is None:
        t = torch.tensor(words, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        _DEVICE_WORDS[key] = t
        if len(_DEVICE_WORDS) > 64:
            _DEVICE_WORDS.popitem(last=False)
    else:
        _DEVICE_WORDS.move_to_end(key)
    return t


def _write_trailer(frame: torch.Tensor, header: int, words: tuple[int, ...]) -> None:
    trailer = frame[frame.numel() - _TRAIL:].view(torch.int64)
    if frame.device.type == "cpu":
        trailer.numpy()[:] = (header, *words)
    else:  # [Note: CUDA without host synchronisation]: kernels only
        trailer[:1].fill_(header)
        trailer[1:].copy_(_device_words(words, frame.device))


def pack_frame(tensor: torch.Tensor, stage: int, k: int, size: int, meta: TensorMeta | None = None) -> torch.Tensor:
    """A frame of ``size`` bytes (:func:`frame_bytes`) on ``tensor``'s device: its bytes at offset 0,
    then the trailer: the header of ``(stage, k)`` and the tensor's shape and dtype (``meta``,
    default :meth:`TensorMeta.of`).

    Raises:
        ValueError: the tensor cannot be described (:meth:`TensorMeta.of`).
    """
    meta = meta or TensorMeta.of(tensor, stage, k)
    nbytes = tensor.numel() * tensor.element_size()
    frame = torch.empty(size, dtype=torch.uint8, device=tensor.device)
    _write_trailer(frame, encode_header(stage, k), meta.words())
    frame[:nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return frame


def announce_frame(size: int, capacity: int, device: torch.device) -> torch.Tensor:
    """A frame of ``size`` bytes that tells the receiver the channel's next frames carry
    ``capacity`` payload bytes ([Note: shapes travel with each frame])."""
    frame = torch.empty(size, dtype=torch.uint8, device=device)
    _write_trailer(frame, 0, (_ANNOUNCE, capacity) + (0,) * (_WORDS - 3))
    return frame


def read_trailer(frame: torch.Tensor) -> list[int]:
    """The eight trailer words of a frame (on CUDA: waits for the current stream)."""
    return frame[frame.numel() - _TRAIL:].view(torch.int64).tolist()


def frame_header(frame: torch.Tensor) -> tuple[int, int]:
    """``(stage, k)`` of a frame (on CUDA: waits for the current stream)."""
    return decode_header(read_trailer(frame)[0])


def frame_payload(frame: torch.Tensor, meta: TensorMeta | None = None) -> torch.Tensor:
    """The payload of a frame as a tensor of ``meta`` (default: the shape in its trailer); a
    view, no copy."""
    meta = meta or TensorMeta.from_words(read_trailer(frame)[1:])
    return frame[:meta.nbytes].view(meta.dtype).view(meta.shape)


def _write_words(region: torch.Tensor, data: bytes) -> None:
    """Writes host bytes into a frame region (CUDA: one non-blocking upload from pinned memory)."""
    if region.device.type == "cpu":
        region.numpy()[:len(data)] = memoryview(data)
    else:
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8).pin_memory()
        region[:len(data)].copy_(host, non_blocking=True)


class TreeFrame:
    """A pytree payload laid out for one frame ([Note: trees in a frame]).

    Args:
        tree: the payload.
        stage: destination stage; ``k``: micro-batch (for error messages).
        forward: an activation (its gradient-carrying leaves are marked in the layout).
        previous: the layout last sent on this channel to ``stage`` (``None``: none yet).

    Raises:
        ValueError: a leaf the frame cannot describe (:meth:`TensorMeta.of`).
    """

    def __init__(self, tree: Any, stage: int, k: int, forward: bool, previous: pytree.Layout | None):
        self.leaves, self.layout = pytree.flatten(tree, grads=forward)
        self.metas = [TensorMeta.of(t, stage, k) for t in self.leaves]
        self.offsets, off = [], 0
        for m in self.metas:  # 16-aligned: a view as any dtype (complex128 included) starts on its element size
            self.offsets.append(off)
            off += -(-m.nbytes // 16) * 16
        self.words_at = off
        self.blob = b"" if previous == self.layout else pickle.dumps(self.layout)
        self.nbytes = off + _LEAF_BYTES * len(self.leaves) + _payload_bytes(len(self.blob))

    def pack(self, stage: int, k: int, size: int, device: torch.device) -> torch.Tensor:
        """The frame of ``size`` bytes (at least :func:`frame_bytes` of ``nbytes``)."""
        frame = torch.empty(size, dtype=torch.uint8, device=device)
        for t, m, o in zip(self.leaves, self.metas, self.offsets):
            frame[o:o + m.nbytes].view(t.dtype).view(t.shape).copy_(t)
        words = [w for m, o in zip(self.metas, self.offsets) for w in (*m.words(), o)]
        tail = torch.tensor(words, dtype=torch.int64).numpy().tobytes() + self.blob
        if tail:
            _write_words(frame[self.words_at:self.words_at + len(tail)], tail)
        _write_trailer(frame, encode_header(stage, k), (_TREE, len(self.leaves), len(self.blob), self.words_at, 0, 0, 0))
        return frame


def unpack_tree(frame: torch.Tensor, words: list[int], layouts: dict[int, pytree.Layout], stage: int) -> Any:
    """The pytree in a ``_TREE`` frame whose trailer is ``words`` (leaves are views of the frame);
    ``layouts``: the receiving thread's last layout per destination stage (updated here)."""
    n, blob_len, at = words[2], words[3], words[4]
    leaf_words = frame[at:at + _LEAF_BYTES * n].view(torch.int64).tolist() if n else []
    if blob_len:
        start = at + _LEAF_BYTES * n
        layouts[stage] = pickle.loads(frame[start:start + blob_len].cpu().numpy().tobytes())
    layout = layouts[stage]
    leaves = []
    for i, grad in zip(range(n), pytree.grad_mask(layout)):
        w = leaf_words[8 * i:8 * i + 8]
        meta = TensorMeta.from_words(w[:7])
        t = frame[w[7]:w[7] + meta.nbytes].view(meta.dtype).view(meta.shape)
        leaves.append(t.requires_grad_(True) if grad else t)
    return pytree.unflatten(leaves, layout)
#: At most this many sends may be unfinished before the oldest is waited for.
MAX_PENDING_SENDS = 256


class SendReaper:
    """Keeps each sent frame alive until its ``isend`` is done, waiting on a thread of its own
    ([Note: reaping gloo sends]).

    Args:
        cap: at most this many sends unfinished; ``submit`` blocks while that many are.

    ``submit(work, frame)`` hands over one started send (any object with ``wait()``) and the
    buffer it reads; the reaper waits for them in submission order and then releases the frame.
    ``close()`` waits for every submitted send and ends the thread.

    Raises:
        The first exception a ``wait()`` raised, from the next ``submit`` or from ``close``.
    """

    def __init__(self, cap: int = MAX_PENDING_SENDS) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(cap)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, _frame = item
            try:
                if self._error is None:  # after a failure the rest are only released
                    work.wait()
            except BaseException as exc:  # noqa: BLE001 - raised on the stage's thread
                self._error = exc
            del item, work, _frame  # the frame's memory goes back now, not at the next send
            self._slots.release()

    def submit(self, work: Any, frame: torch.Tensor) -> None:
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="send-reaper", daemon=True)
            self._thread.start()
        self._slots.acquire()
        self._queue.put((work, frame))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def encode_header(stage: int, k: int) -> int:
    """The int64 header of a message for ``stage`` carrying micro-batch ``k``."""
    if not 0 <= k < 2**_K_BITS or not 0 <= stage < 2**(62 - _K_BITS):
        raise ValueError(f"header (stage={stage}, k={k}) out of range: need 0 ≤ k < 2**{_K_BITS}")
    return (stage << _K_BITS) | k


def decode_header(code: int) -> tuple[int, int]:
    """``(stage, k)`` of a header made by :func:`encode_header`."""
    return code >> _K_BITS, code & ((1 << _K_BITS) - 1)


_GROUPS: dict[tuple, Any] = {}


def channel_groups(keys: list[tuple[Any, list[int]]]) -> list[Any]:
    """Process groups for ``keys`` = ``[(name, global ranks), …]``, created once per process.

    A collective: every rank must call it with the same keys in the same order (see
    [Note: one process group per channel]). Ranks outside a group get
    ``GroupMember.NON_GROUP_MEMBER``. Cached per default process group.
    """
    world = id(dist.group.WORLD)
    out = []
    for name, ranks in keys:
        key = (world, name, tuple(ranks))
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(sorted(set(ranks)))
        out.append(_GROUPS[key])
    return out


def pipeline_channels(placement: Sequence[int]) -> list[tuple[bool, int, int, int]]:
    """The point-to-point channels of one pipeline: ``(forward, source rank, destination rank,
    stage boundaries it carries)`` for every boundary s → s + 1 whose stages live on two ranks
    (``placement[s]``: the rank of stage s); activations go forward, gradients back. Stages on one
    rank hand over locally and need none. Every rank computes the same list in the same order."""
    count: dict[tuple[bool, int, int], int] = {}
    for s in range(len(placement) - 1):
        a, b = placement[s], placement[s + 1]
        if a != b:
            for key in ((True, a, b), (False, b, a)):
                count[key] = count.get(key, 0) + 1
    return [(fwd, src, dst, c) for (fwd, src, dst), c in count.items()]


class PeerFailure(RuntimeError):
    """A neighbouring stage stopped sending (it died, hung or closed the connection)."""


class P2PTransport:
    """Sends and receives the activations and gradients of the stages one rank hosts.

    Rank r hosts the stages ``placement`` gives it (default r, r + R, r + 2R, …: R ranks, one stage
    per rank unless interleaved; a V-shaped schedule's r and 2R − 1 − r). Activations flow from
    stage s to s + 1, gradients from s to s − 1, over one channel per (direction, source rank,
    destination rank) (:func:`pipeline_channels`); each
    message is one frame: the payload, then its trailer ``(destination stage, k)``, shape and dtype
    ([Note: shapes travel with each frame]). With D replicas,
    replica d's pipeline rank r is global rank ``d·R + r`` ([Note: 2-D rank layout] in
    docs/architecture.md) and talks only to its own replica's ranks.

    Args:
        rank: this process's rank r in its pipeline (0 … R − 1).
        n_ranks: R.
        n_stages: pipeline stages (R·v).
        total_mb: micro-batches of the run (messages per stage and direction).
        replica: d, this process's replica.
        dp: D, replicas (every rank creates every replica's channel groups).
        device: where payloads live: a CUDA device with NCCL, ``None`` (CPU) with gloo.
        placement: the rank of each stage (``Schedule.ranks``); default ``s mod R``.
    """

    def __init__(self, rank: int, n_ranks: int, n_stages: int, total_mb: int, replica: int = 0, dp: int = 1,
                 device: torch.device | str | None = None, placement: Sequence[int] | None = None):
        self.rank, self.n_ranks, self.n_stages, self.total_mb = rank, n_ranks, n_stages, total_mb
        self.replica, self.base = replica, replica * n_ranks
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.placement = tuple(s % n_ranks for s in range(n_stages)) if placement is None else tuple(placement)
        self.stages = [s for s in range(n_stages) if self.placement[s] == rank]
        self.inbox: queue.Queue = queue.Queue()
        self._pending_sends: collections.deque = collections.deque()  # CUDA: polled with is_completed()
        self._reaper = None if self.cuda else SendReaper()  # gloo: [Note: reaping gloo sends]
        self._threads: list[threading.Thread] = []
        self.channels = pipeline_channels(self.placement)
        # payload bytes of the frames this rank sends, per (forward?, destination rank)
        self._capacity = {(fwd, dst): 0 for fwd, src, dst, _ in self.channels if src == rank}
        # the last pytree layout sent per (forward?, destination stage) ([Note: trees in a frame])
        self._layouts: dict[tuple[bool, int], pytree.Layout] = {}
        # [Note: one process group per channel]: (forward?, replica, source, destination) -> group
        keys, names = [], []
        for d in range(dp):
            for fwd, src, dst, _ in self.channels:
                names.append((fwd, d, src, dst))
                keys.append((("act" if fwd else "grad", src, dst), [d * n_ranks + src, d * n_ranks + dst]))
        self._groups = dict(zip(names, channel_groups(keys)))

    def rank_of(self, stage: int) -> int:
        """Pipeline rank hosting ``stage``."""
        return self.placement[stage]

    # -- start-up ---------------------------------------------------------------------------
    def start(self, start_mb: int = 0) -> None:
        """Starts one receiver thread per incoming (neighbour, direction) channel.

        Args:
            start_mb: micro-batches already done (a resumed run): each channel then carries
                ``total_mb − start_mb`` messages per stage.
        """
        remaining = self.total_mb - start_mb
        for fwd, src, dst, boundaries in self.channels:  # none when every neighbour is on this rank
            if dst == self.rank:
                self._spawn(ActionKind.F if fwd else ActionKind.B, src, self._groups[(fwd, self.replica, src, dst)],
                            boundaries * remaining)

    def _spawn(self, kind: ActionKind, src_rank: int, group, count: int) -> None:
        src, device = self.base + src_rank, self.device

        def loop() -> None:
            try:
                stream = None
                if self.cuda:  # [Note: CUDA without host synchronisation]
                    torch.cuda.set_device(device)
                    stream = torch.cuda.Stream(device)
                size, received = frame_bytes(0), 0  # [Note: shapes travel with each frame]
                layouts: dict[int, pytree.Layout] = {}  # [Note: trees in a frame]
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    while received < count:
                        frame = torch.empty(size, dtype=torch.uint8, device=device)
                        dist.recv(frame, src, group=group)
                        words = read_trailer(frame)  # CUDA: waits on this thread's stream only
                        if words[1] == _ANNOUNCE:
                            size = frame_bytes(words[2])
                            continue
                        stage, k = decode_header(words[0])
                        if k >= _END_BASE:  # nothing follows on this channel
                            self.inbox.put((END, stage, k - _END_BASE, None, None))
                            return
                        received += 1
                        if words[1] == _TREE:
                            payload = unpack_tree(frame, words, layouts, stage)
                        else:
                            payload = frame_payload(frame, TensorMeta.from_words(words[1:]))
                        event = None
                        if stream is not None:
                            event = torch.cuda.Event()
                            event.record(stream)
                        self.inbox.put((kind, stage, k, payload, event))
            except Exception as exc:  # noqa: BLE001 - forwarded to the stage's thread
                self.inbox.put((None, src, None, exc, None))

        th = threading.Thread(target=loop, name=f"recv-{kind.value}-from-{src}", daemon=True)
        th.start()
        self._threads.append(th)

    # -- steady state -----------------------------------------------------------------------
    def send(self, kind: ActionKind, stage: int, k: int, tensor: Any) -> None:
        """Sends the output of F on ``stage`` (to stage + 1) or of B / I (to stage − 1), a tensor
        or a pytree ([Note: trees in a frame]); returns at once (``isend``; the frame is kept
        alive until the send is reaped)."""
        forward = kind is ActionKind.F
        dst_stage = stage + 1 if forward else stage - 1
        dst = self.rank_of(dst_stage)
        if dst == self.rank:  # both stages on this rank
            self.inbox.put((ActionKind.F if forward else ActionKind.B, dst_stage, k, tensor, None))
            return
        group = self._groups[(forward, self.replica, self.rank, dst)]
        if not isinstance(tensor, torch.Tensor):
            key = (forward, dst_stage)
            tree = TreeFrame(tensor, dst_stage, k, forward, self._layouts.get(key))  # raises before any send
            self._fit(forward, tree.nbytes, dst)
            frame = tree.pack(dst_stage, k, frame_bytes(self._capacity[(forward, dst)]), self.device)
            self._layouts[key] = tree.layout
            self._submit(dist.isend(frame, self.base + dst, group=group), frame)
            return
        meta = TensorMeta.of(tensor, dst_stage, k)  # raises before anything is sent
        self._fit(forward, tensor.numel() * tensor.element_size(), dst)
        frame = pack_frame(tensor, dst_stage, k, frame_bytes(self._capacity[(forward, dst)]), meta)
        self._submit(dist.isend(frame, self.base + dst, group=group), frame)

    def _submit(self, work: Any, frame: torch.Tensor) -> None:
        """Keeps ``frame`` alive until its send ``work`` is done, without waiting here: NCCL's
        sends are polled ([Note: CUDA without host synchronisation]), gloo's are waited for
        by the reaper thread ([Note: reaping gloo sends])."""
        if self._reaper is not None:
            self._reaper.submit(work, frame)
            return
        pending = self._pending_sends
        pending.append((work, frame))
        while pending and (len(pending) > MAX_PENDING_SENDS or pending[0][0].is_completed()):
            pending.popleft()[0].wait()

    def _fit(self, forward: bool, nbytes: int, dst: int) -> None:
        """Announces a larger capacity on the ``forward`` channel if ``nbytes`` does not fit
        ([Note: shapes travel with each frame])."""
        old = self._capacity[(forward, dst)]
        if nbytes <= old:
            return
        new = grown_capacity(old, nbytes)
        frame = announce_frame(frame_bytes(old), new, self.device)
        self._submit(dist.isend(frame, self.base + dst, group=self._groups[(forward, self.replica, self.rank, dst)]),
                     frame)
        self._capacity[(forward, dst)] = new

    def send_end(self, forward: bool, step: int) -> None:
        """Sends the end-of-stream frame of a stop at ``step`` on every channel this rank sends on
        in that direction (``forward``: after the last activation; else after the last gradient);
        each receiver thread delivers ``(END, stage, step, None)`` and ends. Local hand-overs
        have no receiver thread and get none."""
        for fwd, src, dst, _ in self.channels:
            if fwd != forward or src != self.rank:
                continue
            dst_stage = next(s + 1 if forward else s for s in range(self.n_stages - 1)
                             if (self.placement[s], self.placement[s + 1]) == ((src, dst) if forward else (dst, src)))
            size = frame_bytes(self._capacity[(forward, dst)])
            frame = pack_frame(torch.zeros(0, device=self.device), dst_stage, _END_BASE + step, size)
            self._submit(dist.isend(frame, self.base + dst, group=self._groups[(forward, self.replica, src, dst)]), frame)

    def _reap(self) -> None:
        if self._reaper is not None:
            self._reaper.close()
        while self._pending_sends:
            self._pending_sends.popleft()[0].wait()

    def poll(self, block_s: float | None = None) -> list[tuple[ActionKind, int, int, torch.Tensor]]:
        """Returns the messages ``(kind, stage, k, payload)`` that have arrived; waits up to
        ``block_s`` seconds for one. Payloads are ready for use on this thread's current stream.

        Raises:
            PeerFailure: a receiver thread failed, or nothing arrived within ``block_s``.
        """
        out = []
        inbox = self.inbox
        if block_s is not None:
            try:
                out.append(inbox.get(timeout=block_s))
            except queue.Empty:
                raise PeerFailure(f"no message from a neighbouring rank for {block_s:.0f} s") from None
        while inbox.qsize():  # only this thread takes from the inbox, so get_nowait succeeds
            out.append(inbox.get_nowait())
        msgs = []
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        for kind, stage, k, payload, event in out:
            if kind is END:
                msgs.append((kind, stage, k, None))
                continue
            if kind is None:
                raise PeerFailure(f"receiving from rank {stage} failed: {payload}") from payload
            if event is not None:  # [Note: CUDA without host synchronisation]
                stream.wait_event(event)
                payload.record_stream(stream)
            msgs.append((kind, stage, k, payload))
        return msgs

    def close(self) -> None:
        """Waits for outstanding sends and receiver threads."""
        self._reap()
        for th in self._threads:
            th.join(timeout=60)
