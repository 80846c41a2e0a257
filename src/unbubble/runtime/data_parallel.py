"""Data parallelism across pipeline replicas: D replicas × R pipeline ranks (2-D parallelism).

The replicas of a stage average their gradients right before that stage's update and at no other time,
so PACI still needs no synchronisation across stages. The rank layout and which data each replica reads:
[Note: 2-D rank layout], [Note: replica data ids] in docs/architecture.md#runtimedata_parallelpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

#: Gradients are averaged in buckets of at most this many bytes (as DDP's default bucket).
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Layout:
    """Where each (replica, pipeline rank) lives; see [Note: 2-D rank layout].

    Attributes:
        dp: D, pipeline replicas (≥ 1).
        pp: R, processes per pipeline (stages, or stages / v when interleaved).
    """

    dp: int
    pp: int

    @property
    def world(self) -> int:
        """Processes in the run: D·R."""
        return self.dp * self.pp

    def global_rank(self, replica: int, rank: int) -> int:
        """The ``torch.distributed`` rank of pipeline rank ``rank`` in replica ``replica``."""
        return replica * self.pp + rank

    def split(self, global_rank: int) -> tuple[int, int]:
        """``(replica, pipeline rank)`` of a global rank."""
        return divmod(global_rank, self.pp)

    def replica_ranks(self, rank: int) -> list[int]:
        """Global ranks of pipeline rank ``rank`` in every replica (its data-parallel group)."""
        return [self.global_rank(d, rank) for d in range(self.dp)]


def replica_batch(batch_fn: Callable[[int], Any], dp: int, replica: int, k: int) -> Any:
    """Replica ``replica``'s micro-batch ``k``: ``batch_fn(k·dp + replica)``.

    See [Note: replica data ids]. Picklable through ``functools.partial``.
    """
    return batch_fn(k * dp + replica)


class GradientAverager:
    """Averages one pipeline rank's gradients over its D replicas (called at each ``U``).

    The gradients are flattened into buckets of at most :data:`BUCKET_BYTES` (per dtype and
    device), each all-reduced (sum) in the rank's data-parallel group and divided by D. On
    CUDA (NCCL) nothing here waits on the host; the last stage's step loss, a Python float,
    is averaged with one extra 1-element all-reduce (one host synchronisation per update).

    Args:
        group: the data-parallel process group ``{d·R + r : d < D}`` of this pipeline rank.
        dp: D.
        device: where the loss tensor is placed for the all-reduce (the gradients' device).
        bucket_bytes: largest bucket.
    """

    def __init__(self, group, dp: int, device: torch.device | None = None, bucket_bytes: int = BUCKET_BYTES):
        self.group, self.dp, self.bucket_bytes = group, dp, bucket_bytes
        self.device = device or torch.device("cpu")

    def _buckets(self, grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets: dict[tuple, list[list[torch.Tensor]]] = {}
        for g in grads:
            lists = buckets.setdefault((g.dtype, g.device), [[]])
            size = sum(t.numel() * t.element_size() for t in lists[-1])
            if lists[-1] and size + g.numel() * g.element_size() > self.bucket_bytes:
                lists.append([])
            lists[-1].append(g)
        return [b for lists in buckets.values() for b in lists]

    @torch.no_grad()
    def __call__(self, params: Sequence[torch.Tensor], loss: float | None = None) -> float | None:
        """Replaces every ``p.grad`` with the mean over the replicas (a missing gradient counts
        as zeros); returns the replicas' mean of ``loss`` (``None`` stays ``None``).

        Every replica must call this with the same parameters in the same order (and all or
        none of them with a loss): it is a collective of the data-parallel group.
        """
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in self._buckets([p.grad for p in params]):
            flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1)
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.dp)
            if len(bucket) > 1:
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            elif flat.data_ptr() != bucket[0].data_ptr():  # reshape copied (non-contiguous grad)
                bucket[0].copy_(flat.view_as(bucket[0]))
        if loss is None:
            return None
        t = torch.tensor([loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t.item()) / self.dp
