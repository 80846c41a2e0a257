"""What a stage process reports to the launcher (``worker.run_stage``'s sink): one dataclass per kind.

The local launcher receives them through a multiprocessing queue, ``run_torchrun`` gathers them
on rank 0; both hand them to ``launch._Collector``, which dispatches on the type. Each report also
unpacks as the triple ``(kind, stage, payload)`` that earlier releases sent (for code that reads a
sink's list directly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

#: One executed action: ``(str(action), start_s, end_s, weight version, version its weights had)``,
#: times in seconds since the start shared by all ranks.
Record = tuple[str, float, float, int, int]


class Report:
    """Base of the reports; ``kind`` names it in the ``(kind, stage, payload)`` triple."""

    kind: ClassVar[str]

    def _triple(self) -> tuple[str, int, Any]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        return iter(self._triple())


@dataclass(frozen=True)
class Started(Report):
    """Rank 0's training loop starts at ``t0`` (epoch seconds, after set-up)."""

    t0: float
    kind: ClassVar[str] = "start"

    def _triple(self):
        return self.kind, 0, self.t0


@dataclass(frozen=True)
class Records(Report):
    """The actions ``stage``'s rank ran since its previous report (sent after each update)."""

    stage: int
    records: list[Record]
    kind: ClassVar[str] = "records"

    def _triple(self):
        return self.kind, self.stage, self.records


@dataclass(frozen=True)
class StepLoss(Report):
    """The last stage's mean loss of one update (with D > 1 the replicas' mean)."""

    stage: int
    loss: float
    kind: ClassVar[str] = "step_loss"

    def _triple(self):
        return self.kind, self.stage, self.loss


@dataclass(frozen=True)
class Snapshot(Report):
    """``stage``'s module weights at ``version`` (``worker.to_bytes``), for evaluation."""

    stage: int
    version: int
    state: bytes
    kind: ClassVar[str] = "snapshot"

    def _triple(self):
        return self.kind, self.stage, (self.version, self.state)


@dataclass(frozen=True)
class Final(Report):
    """Replica 0's end of ``stage``: its weights (``worker.to_bytes``), training wall time (s),
    optimizer-state bytes (``optim.optimizer_state_bytes``), ``memory`` (the executor's
    ``memory_bytes()`` and the process's ``process_rss_bytes``, ``process_peak_rss_bytes``) and the
    executor's ``clip_stats`` ([Note: clip scopes] in docs/architecture.md)."""

    stage: int
    state: bytes
    wall_s: float
    optimizer_bytes: dict[str, Any]
    memory: dict[str, Any]
    clip_stats: dict[str, int]
    kind: ClassVar[str] = "final"

    def _triple(self):
        return self.kind, self.stage, (self.state, self.wall_s, self.optimizer_bytes, self.memory, self.clip_stats)


@dataclass(frozen=True)
class Done(Report):
    """The end of ``stage`` on a replica d > 0 (whose weights equal replica 0's): its wall time (s)."""

    stage: int
    wall_s: float
    kind: ClassVar[str] = "done"

    def _triple(self):
        return self.kind, self.stage, self.wall_s


@dataclass(frozen=True)
class Event(Report):
    """A micro-batch or update that ``stage``'s non-finite guard or clipper dropped (every replica
    reports its own)."""

    stage: int
    event: dict[str, Any]
    kind: ClassVar[str] = "event"

    def _triple(self):
        return self.kind, self.stage, self.event


@dataclass(frozen=True)
class Stopped(Report):
    """A stop signal ended the run at step ``step``; sent by pipeline rank ``rank`` before its
    final reports."""

    rank: int
    step: int
    kind: ClassVar[str] = "stopped"

    def _triple(self):
        return self.kind, self.rank, self.step


@dataclass(frozen=True)
class Failed(Report):
    """The stage process of global rank ``rank`` raised: ``"ExceptionType: message"``."""

    rank: int
    text: str
    kind: ClassVar[str] = "error"

    def _triple(self):
        return self.kind, self.rank, self.text
