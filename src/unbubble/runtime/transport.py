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
    """Sends and receives one stage's activations and gradients.

    Args:
        stage: 0-based stage (= rank in the pipeline group).
        n_stages: pipeline depth N.
        total_mb: micro-batches each channel carries.
        ranks: global rank of each stage (identity for a single pipeline).
    """

    def __init__(self, stage: int, n_stages: int, total_mb: int, ranks: list[int] | None = None):
        self.stage, self.n_stages, self.total_mb = stage, n_stages, total_mb
        self.ranks = ranks or list(range(n_stages))
        self.inbox: queue.Queue = queue.Queue()
        self._pending_sends: list = []
        self._threads: list[threading.Thread] = []
        self.act_meta: TensorMeta | None = None  # of the activations this stage receives
        self.out_meta: TensorMeta | None = None  # of the activations this stage sends (= gradients it receives)

    # -- start-up ---------------------------------------------------------------------------
    def exchange_meta(self, probe_output) -> None:
        """Agrees on activation shapes, first stage to last (each stage's output feeds the next).

        Args:
            probe_output: ``probe_output(input_meta) -> TensorMeta`` of this stage's output,
                given the incoming activation's meta (``None`` on the first stage).
        """
        if self.stage > 0:
            buf = torch.zeros(8, dtype=torch.int64)
            dist.recv(buf, self.ranks[self.stage - 1], tag=_ACT_TAG)
            self.act_meta = TensorMeta.decode(buf)
        if self.stage < self.n_stages - 1:
            self.out_meta = probe_output(self.act_meta)
            dist.send(self.out_meta.encode(), self.ranks[self.stage + 1], tag=_ACT_TAG)

    def start(self) -> None:
        """Starts the receiver threads."""
        if self.stage > 0:
            self._spawn(ActionKind.F, self.ranks[self.stage - 1], _ACT_TAG, self.act_meta)
        if self.stage < self.n_stages - 1:
            self._spawn(ActionKind.B, self.ranks[self.stage + 1], _GRAD_TAG, self.out_meta)

    def _spawn(self, kind: ActionKind, src: int, tag: int, meta: TensorMeta) -> None:
        def loop() -> None:
            try:
                for _ in range(self.total_mb):
                    head = torch.zeros(1, dtype=torch.int64)
                    dist.recv(head, src, tag=tag)
                    payload = torch.empty(meta.shape, dtype=meta.dtype)
                    dist.recv(payload, src, tag=tag)
                    self.inbox.put((kind, int(head[0]), payload))
            except Exception as exc:  # noqa: BLE001 - forwarded to the stage's thread
                self.inbox.put((None, src, exc))

        th = threading.Thread(target=loop, name=f"recv-{kind.value}-from-{src}", daemon=True)
        th.start()
        self._threads.append(th)

    # -- steady state -----------------------------------------------------------------------
    def send(self, kind: ActionKind, k: int, tensor: torch.Tensor) -> None:
        """Sends the output of F (to the next stage) or of B (to the previous stage)."""
        dst = self.ranks[self.stage + 1] if kind is ActionKind.F else self.ranks[self.stage - 1]
        tag = _ACT_TAG if kind is ActionKind.F else _GRAD_TAG
        tensor = tensor.contiguous()
        self._pending_sends.append((dist.isend(torch.tensor([k], dtype=torch.int64), dst, tag=tag), None))
        self._pending_sends.append((dist.isend(tensor, dst, tag=tag), tensor))
        if len(self._pending_sends) > 64:
            self._reap()

    def _reap(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    def poll(self, block_s: float | None = None) -> list[tuple[ActionKind, int, torch.Tensor]]:
        """Returns the messages that have arrived; waits up to ``block_s`` seconds for one.

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
                raise PeerFailure(f"no message from a neighbouring stage for {block_s:.0f} s") from None
        for kind, src, payload in out:
            if kind is None:
                raise PeerFailure(f"receiving from rank {src} failed: {payload}") from payload
        return out

    def close(self) -> None:
        """Waits for outstanding sends and receiver threads."""
        self._reap()
        for th in self._threads:
            th.join(timeout=60)
