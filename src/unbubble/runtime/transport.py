"""Point-to-point transport of activations and gradients over ``torch.distributed``.

Each stage process has one receiver thread per incoming channel (activations from the
previous stage, gradients from the next one). A thread blocks in ``dist.recv`` and
hands ``(k, tensor)`` to the stage's inbox, so the stage's own thread never spins: it
drains the inbox before each decision and blocks on it (with a timeout) only when its
policy has nothing to run. Sends are non-blocking (``dist.isend``) and reaped without
waiting, so communication overlaps compute in both directions. Shapes are agreed once at
start-up; then each message is one byte buffer (a "frame"): the payload's bytes, padded to the
largest payload of its channel (channels of interleaved ranks carry several stages) and to a
multiple of 8, then an 8-byte int64 header carrying ``(destination stage, global micro-batch id
k)``. The payload starts at offset 0, so the receiver's view of it is aligned like any tensor. One frame
per message rather than a header and a payload halves the receives and the thread wake-ups on
the path from one stage's send to its neighbour's next action (measured: the median hop latency
is ~2 wake-ups' worth of scheduler latency on a loaded machine). The receiver's payload is a view
into the frame; the sender copies its tensor into a fresh frame (a memcpy, or a device copy).

[Note: one process group per channel]
Every (replica, source rank, destination rank, direction) channel has its own two-member
process group, used by exactly one sending thread and one receiving thread. Messages of a
channel are therefore matched in issue order on both sides, which NCCL requires (two threads
issuing sends and receives on one communicator in different orders can deadlock), and gloo
needs no tags. ``P2PTransport`` creates the groups collectively at start-up; every rank creates
every channel's group in the same order (``channel_groups``).

[Note: CUDA without host synchronisation]
With NCCL frames are device tensors; the header is written by a fill kernel (``fill_``), not
copied from the host. The receiver thread receives on its own CUDA stream and reads the header there (``.item()`` waits for that receive only, never for the stage's
compute), then records an event after the payload's receive; the stage thread makes its compute
stream wait on that event and marks the payload as used by it (``record_stream``) — no host
synchronisation on the compute thread, per message or otherwise. ``isend`` orders itself after
the compute stream's work that produced the tensor (ProcessGroupNCCL does), and finished sends
are reaped with ``Work.is_completed()``, which polls an event instead of waiting.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from unbubble.schedules.actions import ActionKind

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_K_BITS = 40  # header = destination stage << 40 | k (k < 2**40 micro-batches)
_END_BASE = 1 << (_K_BITS - 1)  # k ≥ this: an end-of-stream frame for stop step k − _END_BASE
#: ``kind`` of the message :meth:`P2PTransport.poll` returns for an end-of-stream frame (its
#: ``k`` is the stop step T).
END = "end"
_HEAD = 8  # header bytes, at the end of a frame (the payload starts at offset 0: aligned)


def _payload_bytes(nbytes: int) -> int:
    """Payload room of a frame: ``nbytes`` rounded up to 8 so the int64 header after it is aligned."""
    return -(-nbytes // _HEAD) * _HEAD


def frame_bytes(max_payload_bytes: int) -> int:
    """Size of every frame on a channel whose largest payload has ``max_payload_bytes`` bytes."""
    return _payload_bytes(max_payload_bytes) + _HEAD


def pack_frame(tensor: torch.Tensor, stage: int, k: int, size: int) -> torch.Tensor:
    """A frame of ``size`` bytes (:func:`frame_bytes`) on ``tensor``'s device: its bytes at offset 0,
    then the header of ``(stage, k)`` in the last 8 bytes (written by a kernel, no host copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    frame = torch.empty(size, dtype=torch.uint8, device=tensor.device)
    frame[size - _HEAD:].view(torch.int64).fill_(encode_header(stage, k))
    frame[:nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return frame


def frame_header(frame: torch.Tensor) -> tuple[int, int]:
    """``(stage, k)`` of a frame (on CUDA: waits for the current stream)."""
    return decode_header(int(frame[frame.numel() - _HEAD:].view(torch.int64).item()))


def frame_payload(frame: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The payload of a frame as a tensor of ``meta`` (a view: no copy)."""
    return frame[:meta.nbytes].view(meta.dtype).view(meta.shape)
#: At most this many sends may be unfinished before the oldest is waited for.
MAX_PENDING_SENDS = 256


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


def act_channel(rank: int, n_ranks: int) -> tuple[int, int]:
    """``(source, destination)`` pipeline ranks of the activations rank ``rank`` sends."""
    return rank, (rank + 1) % n_ranks


def grad_channel(rank: int, n_ranks: int) -> tuple[int, int]:
    """``(source, destination)`` pipeline ranks of the gradients rank ``rank`` sends."""
    return rank, (rank - 1) % n_ranks


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of the tensors on one channel."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def encode(self) -> torch.Tensor:
        if len(self.shape) > 6:
            raise ValueError(f"activations with {len(self.shape)} dims are not supported (at most 6)")
        head = [len(self.shape), _DTYPES.index(self.dtype), *self.shape]
        return torch.tensor(head + [0] * (8 - len(head)), dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of one tensor with this meta."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def decode(cls, t: torch.Tensor) -> "TensorMeta":
        ndim, dt = int(t[0]), int(t[1])
        return cls(tuple(int(x) for x in t[2:2 + ndim]), _DTYPES[dt])


class PeerFailure(RuntimeError):
    """A neighbouring stage stopped sending (it died, hung or closed the connection)."""


class P2PTransport:
    """Sends and receives the activations and gradients of the stages one rank hosts.

    Rank r hosts stages r, r + R, r + 2R, … (R ranks; one stage per rank unless
    interleaved). Activations flow from stage s to s + 1, gradients from s to s − 1; each
    message is one frame: the payload, then its header ``(destination stage, k)``. With D replicas,
    replica d's pipeline rank r is global rank ``d·R + r`` ([Note: 2-D rank layout] in
    ``data_parallel.py``) and talks only to its own replica's ranks.

    Args:
        rank: this process's rank r in its pipeline (0 … R − 1).
        n_ranks: R.
        n_stages: pipeline stages (R·v).
        total_mb: micro-batches of the run (messages per stage and direction).
        replica: d, this process's replica.
        dp: D, replicas (every rank creates every replica's channel groups).
        device: where payloads live: a CUDA device with NCCL, ``None`` (CPU) with gloo.
    """

    def __init__(self, rank: int, n_ranks: int, n_stages: int, total_mb: int, replica: int = 0, dp: int = 1,
                 device: torch.device | str | None = None):
        self.rank, self.n_ranks, self.n_stages, self.total_mb = rank, n_ranks, n_stages, total_mb
        self.replica, self.base = replica, replica * n_ranks
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stages = list(range(rank, n_stages, n_ranks))
        self.inbox: queue.Queue = queue.Queue()
        self._pending_sends: collections.deque = collections.deque()
        self._threads: list[threading.Thread] = []
        self.in_meta: dict[int, TensorMeta] = {}  # stage -> meta of the activation it receives
        self.out_meta: dict[int, TensorMeta] = {}  # stage -> meta of its output (= gradient it receives)
        # [Note: one process group per channel]: (direction, replica, source rank) -> group
        keys, names = [], []
        if n_ranks > 1:
            for d in range(dp):
                for direction, channel in (("act", act_channel), ("grad", grad_channel)):
                    for r in range(n_ranks):
                        src, dst = channel(r, n_ranks)
                        names.append((direction, d, src))
                        keys.append(((direction, src, dst), [d * n_ranks + src, d * n_ranks + dst]))
        groups = dict(zip(names, channel_groups(keys)))
        prev, nxt = (rank - 1) % n_ranks, (rank + 1) % n_ranks
        self._send_group = {True: groups.get(("act", replica, rank)), False: groups.get(("grad", replica, rank))}
        self._recv_group = {True: groups.get(("act", replica, prev)), False: groups.get(("grad", replica, nxt))}

    def rank_of(self, stage: int) -> int:
        """Pipeline rank hosting ``stage``."""
        return stage % self.n_ranks

    # -- start-up ---------------------------------------------------------------------------
    def exchange_meta(self, probe_output) -> None:
        """Agrees on activation shapes stage by stage, first to last.

        Args:
            probe_output: ``probe_output(stage, input_meta) -> TensorMeta`` of ``stage``'s output
                given its incoming activation's meta (``None`` for stage 0).
        """
        for s in self.stages:
            if s > 0:
                src = self.rank_of(s - 1)
                if src == self.rank:
                    self.in_meta[s] = self.out_meta[s - 1]
                else:
                    buf = torch.zeros(8, dtype=torch.int64, device=self.device)
                    dist.recv(buf, self.base + src, group=self._recv_group[True])
                    self.in_meta[s] = TensorMeta.decode(buf.cpu())  # once per stage, at start-up
            if s < self.n_stages - 1:
                self.out_meta[s] = probe_output(s, self.in_meta.get(s))
                dst = self.rank_of(s + 1)
                if dst != self.rank:
                    dist.send(self.out_meta[s].encode().to(self.device), self.base + dst, group=self._send_group[True])
        # largest payload this rank sends per direction (= what the receiving rank computes)
        self._frame_bytes = {
            True: max([self.out_meta[s].nbytes for s in self.stages if s < self.n_stages - 1], default=0),
            False: max([self.in_meta[s].nbytes for s in self.stages if s > 0], default=0),
        }

    def start(self, start_mb: int = 0) -> None:
        """Starts one receiver thread per incoming (neighbour, direction) channel.

        Args:
            start_mb: micro-batches already done (a resumed run): each channel then carries
                ``total_mb − start_mb`` messages per stage.
        """
        remaining = self.total_mb - start_mb
        if self.n_ranks == 1:
            return  # every neighbour is on this rank: sends loop back into the inbox
        act_in = [s for s in self.stages if s > 0]
        grad_in = [s for s in self.stages if s < self.n_stages - 1]
        if act_in:
            self._spawn(ActionKind.F, self.rank_of(act_in[0] - 1), self._recv_group[True],
                        len(act_in) * remaining, self.in_meta)
        if grad_in:
            self._spawn(ActionKind.B, self.rank_of(grad_in[0] + 1), self._recv_group[False],
                        len(grad_in) * remaining, self.out_meta)

    def _spawn(self, kind: ActionKind, src_rank: int, group, count: int, metas: dict[int, TensorMeta]) -> None:
        src, device = self.base + src_rank, self.device
        size = frame_bytes(max(metas[s].nbytes for s in self.stages if s in metas))

        def loop() -> None:
            try:
                stream = None
                if self.cuda:  # [Note: CUDA without host synchronisation]
                    torch.cuda.set_device(device)
                    stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for _ in range(count):
                        frame = torch.empty(size, dtype=torch.uint8, device=device)
                        dist.recv(frame, src, group=group)
                        stage, k = frame_header(frame)  # CUDA: waits on this thread's stream only
                        if k >= _END_BASE:  # nothing follows on this channel
                            self.inbox.put((END, stage, k - _END_BASE, None, None))
                            return
                        payload = frame_payload(frame, metas[stage])
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
    def send(self, kind: ActionKind, stage: int, k: int, tensor: torch.Tensor) -> None:
        """Sends the output of F on ``stage`` (to stage + 1) or of B / I (to stage − 1);
        returns at once (``isend``; the tensor is kept alive until the send is reaped)."""
        forward = kind is ActionKind.F
        dst_stage = stage + 1 if forward else stage - 1
        dst = self.rank_of(dst_stage)
        if dst == self.rank:  # both stages on this rank
            self.inbox.put((ActionKind.F if forward else ActionKind.B, dst_stage, k, tensor, None))
            return
        frame = pack_frame(tensor, dst_stage, k, frame_bytes(self._frame_bytes[forward]))
        pending = self._pending_sends
        pending.append((dist.isend(frame, self.base + dst, group=self._send_group[forward]), frame))
        # reap without waiting where the backend can tell (NCCL polls an event; gloo's sends
        # report completion only through wait(), so the oldest are waited for past the cap)
        while pending and (len(pending) > MAX_PENDING_SENDS or (self.cuda and pending[0][0].is_completed())):
            pending.popleft()[0].wait()

    def send_end(self, forward: bool, step: int) -> None:
        """Sends the end-of-stream frame of a stop at ``step`` to the next rank (``forward``, after
        the last activation) or the previous one (after the last gradient); its receiver
        thread delivers ``(END, stage, step, None)`` and ends."""
        dst_stage = min(s for s in self.stages if s < self.n_stages - 1) + 1 if forward \
            else max(s for s in self.stages if s > 0) - 1
        dst = self.rank_of(dst_stage)
        if dst == self.rank or self.n_ranks == 1:
            return  # no receiver thread on a loop-back channel
        size = frame_bytes(self._frame_bytes[forward])
        frame = pack_frame(torch.zeros(0, device=self.device), dst_stage, _END_BASE + step, size)
        self._pending_sends.append((dist.isend(frame, self.base + dst, group=self._send_group[forward]), frame))

    def _reap(self) -> None:
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
