"""Point-to-point transport of activations and gradients over ``torch.distributed``.

Each stage process has one receiver thread per incoming channel (activations from the
previous stage, gradients from the next one). A thread blocks in ``dist.recv`` and
hands ``(k, tensor)`` to the stage's inbox, so the stage's own thread never spins: it
drains the inbox before each decision and blocks on it (with a timeout) only when its
policy has nothing to run. Messages are a 1-element int64 header carrying the global
micro-batch id k, then the payload, whose shape was agreed once at start-up.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbubble.schedules.actions import ActionKind

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_ACT_TAG, _GRAD_TAG = 0, 1


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
    message carries ``[destination stage, k]`` then the payload.

    Args:
        rank: this process's rank in the pipeline.
        n_ranks: R.
        n_stages: pipeline stages (R·v).
        total_mb: micro-batches of the run (messages per stage and direction).
    """

    def __init__(self, rank: int, n_ranks: int, n_stages: int, total_mb: int):
        self.rank, self.n_ranks, self.n_stages, self.total_mb = rank, n_ranks, n_stages, total_mb
        self.stages = list(range(rank, n_stages, n_ranks))
        self.inbox: queue.Queue = queue.Queue()
        self._pending_sends: list = []
        self._threads: list[threading.Thread] = []
        self.in_meta: dict[int, TensorMeta] = {}  # stage -> meta of the activation it receives
        self.out_meta: dict[int, TensorMeta] = {}  # stage -> meta of its output (= gradient it receives)

    def rank_of(self, stage: int) -> int:
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
                buf = torch.zeros(8, dtype=torch.int64)
                dist.recv(buf, self.rank_of(s - 1), tag=_ACT_TAG)
                self.in_meta[s] = TensorMeta.decode(buf)
            if s < self.n_stages - 1:
                self.out_meta[s] = probe_output(s, self.in_meta.get(s))
                dist.send(self.out_meta[s].encode(), self.rank_of(s + 1), tag=_ACT_TAG)

    def start(self) -> None:
        """Starts one receiver thread per incoming (neighbour, direction) channel."""
        act_in = [s for s in self.stages if s > 0]
        grad_in = [s for s in self.stages if s < self.n_stages - 1]
        if act_in:
            self._spawn(ActionKind.F, self.rank_of(act_in[0] - 1), _ACT_TAG, len(act_in) * self.total_mb, self.in_meta)
        if grad_in:
            self._spawn(ActionKind.B, self.rank_of(grad_in[0] + 1), _GRAD_TAG, len(grad_in) * self.total_mb,
                        self.out_meta)

    def _spawn(self, kind: ActionKind, src: int, tag: int, count: int, metas: dict[int, TensorMeta]) -> None:
        def loop() -> None:
            try:
                for _ in range(count):
                    head = torch.zeros(2, dtype=torch.int64)
                    dist.recv(head, src, tag=tag)
                    stage, k = int(head[0]), int(head[1])
                    meta = metas[stage]
                    payload = torch.empty(meta.shape, dtype=meta.dtype)
                    dist.recv(payload, src, tag=tag)
                    self.inbox.put((kind, stage, k, payload))
            except Exception as exc:  # noqa: BLE001 - forwarded to the stage's thread
                self.inbox.put((None, src, None, exc))

        th = threading.Thread(target=loop, name=f"recv-{kind.value}-from-{src}", daemon=True)
        th.start()
        self._threads.append(th)

    # -- steady state -----------------------------------------------------------------------
    def send(self, kind: ActionKind, stage: int, k: int, tensor: torch.Tensor) -> None:
        """Sends the output of F on ``stage`` (to stage + 1) or of B / I (to stage − 1)."""
        forward = kind is ActionKind.F
        dst_stage = stage + 1 if forward else stage - 1
        dst, tag = self.rank_of(dst_stage), (_ACT_TAG if forward else _GRAD_TAG)
        tensor = tensor.contiguous()
        self._pending_sends.append((dist.isend(torch.tensor([dst_stage, k], dtype=torch.int64), dst, tag=tag), None))
        self._pending_sends.append((dist.isend(tensor, dst, tag=tag), tensor))
        if len(self._pending_sends) > 64:
            self._reap()

    def _reap(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    def poll(self, block_s: float | None = None) -> list[tuple[ActionKind, int, int, torch.Tensor]]:
        """Returns the messages ``(kind, stage, k, payload)`` that have arrived; waits up to
        ``block_s`` seconds for one.

        Raises:
            PeerFailure: a receiver thread failed, or nothing arrived within ``block_s``.
        """
        out = []
        try:
            if block_s is not None:
                out.append(self.inbox.get(timeout=block_s))
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            if block_s is not None and not out:
                raise PeerFailure(f"no message from a neighbouring rank for {block_s:.0f} s") from None
        for kind, src, _, payload in out:
            if kind is None:
                raise PeerFailure(f"receiving from rank {src} failed: {payload}") from payload
        return out

    def close(self) -> None:
        """Waits for outstanding sends and receiver threads."""
        self._reap()
        for th in self._threads:
            th.join(timeout=60)
