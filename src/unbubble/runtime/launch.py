"""Process engine: one process per pipeline rank and replica on this machine, or under ``torchrun``.

A run has ``job.dp × R`` processes ([Note: 2-D rank layout] in ``data_parallel.py``). The backend
is NCCL with one CUDA device per process when CUDA has enough devices, else gloo on the CPU.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unbubble.runtime.job import PipelineJob
from unbubble.runtime.telemetry import Listener, RunResult, Telemetry
from unbubble.runtime.worker import from_bytes, run_stage
from unbubble.schedules.actions import Action
from unbubble.sim.engine import ActionRecord

log = logging.getLogger(__name__)


class PipelineFailure(RuntimeError):
    """A stage process failed; the message names the stage and its error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_backend(local_processes: int, backend: str | None = None) -> str:
    """``backend`` if given, else ``"nccl"`` when CUDA has a device for each of this machine's
    ``local_processes``, else ``"gloo"``.

    Raises:
        ConfigError: ``backend`` is not gloo or nccl, or nccl without enough CUDA devices.
    """
    from unbubble.errors import ConfigError

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= local_processes else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend={backend!r} is invalid: must be gloo or nccl")
    if backend == "nccl" and gpus < local_processes:
        raise ConfigError(f"backend='nccl' needs one CUDA device per process: {local_processes} processes here "
                          f"but {gpus} devices (use backend='gloo')")
    return backend


def _init(backend: str, local_rank: int, **kwargs):
    """Initialises the default group; returns ``(device, control group)`` for :func:`run_stage`."""
    device = None
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, **kwargs)
    control = dist.new_group(backend="gloo") if backend == "nccl" else None  # host-side control messages
    return device, control


def _rank_name(job: PipelineJob, rank: int) -> int | str:
    """How errors name a process: its stage (one replica) or ``"s (replica d)"``."""
    if job.dp == 1:
        return rank
    d, r = divmod(rank, job.schedule.n_ranks)
    return f"{r} (replica {d})"


def _stage_entry(rank: int, job: PipelineJob, replay, q, port: int, threads: int, timeout_s: float,
                 backend: str = "gloo") -> None:
    torch.set_num_threads(threads)
    try:
        device, control = _init(backend, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=job.dp * job.schedule.n_ranks, timeout=timedelta(seconds=timeout_s))
        run_stage(job, rank, q.put, replay, recv_timeout_s=timeout_s, device=device, control_group=control)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit 1
        q.put(("error", _rank_name(job, rank), f"{type(exc).__name__}: {exc}"))
        traceback.print_exc()
        sys.stderr.flush()
        q.close()
        q.join_thread()  # flush the report before the hard exit
        os._exit(1)


class _Collector:
    """Turns stage reports into telemetry (shared by the local launcher and torchrun)."""

    def __init__(self, job: PipelineJob, listener: Listener | None):
        self.job = job
        self.telemetry = Telemetry(job, listener)
        self.finals: dict[int, tuple[dict, float, dict]] = {}
        self.done_walls: list[float] = []  # from replicas d > 0

    @property
    def complete(self) -> bool:
        """Every stage of every replica has finished."""
        n = self.job.schedule.n_stages
        return len(self.finals) == n and len(self.done_walls) == (self.job.dp - 1) * n

    def handle(self, msg: tuple) -> None:
        kind, stage, payload = msg
        if kind == "records":
            for action, start, end, version, weights in payload:
                self.telemetry.add_record(ActionRecord(Action.parse(action), start, end, version, weights))
        elif kind == "step_loss":
            self.telemetry.add_step_loss(payload)
        elif kind == "snapshot":
            version, data = payload
            self.telemetry.add_snapshot(stage, version, from_bytes(data))
        elif kind == "final":
            data, wall, opt_bytes = payload
            self.finals[stage] = (from_bytes(data), wall, opt_bytes)
        elif kind == "done":
            self.done_walls.append(payload)
        elif kind == "error":
            raise PipelineFailure(f"stage {stage} failed: {payload}")

    def result(self) -> RunResult:
        n = self.job.schedule.n_stages
        wall = max([f[1] for f in self.finals.values()] + self.done_walls)
        return self.telemetry.result([self.finals[s][0] for s in range(n)], wall,
                                     optimizer_bytes=[self.finals[s][2] for s in range(n)])


_SECONDARY = ("PeerFailure", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(first: tuple, q, wait_s: float = 2.0) -> tuple:
    """Among the errors stages report within ``wait_s``, the one that is not a neighbour's
    reaction to another failure (a closed connection, a receive timeout)."""
    errors, deadline = [first], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            msg = q.get(timeout=0.1)
        except queue.Empty:
            continue
        if msg[0] == "error":
            errors.append(msg)
    primary = [e for e in errors if not any(mark in e[2] for mark in _SECONDARY)]
    return (primary or errors)[0]


def run_processes(job: PipelineJob, replay: list[list[Action]] | None = None, listener: Listener | None = None,
                  threads_per_stage: int = 1, timeout_s: float = 300.0, backend: str | None = None) -> RunResult:
    """Trains ``job`` with ``job.dp × R`` spawned processes (one per pipeline rank and replica)
    over ``torch.distributed``.

    Args:
        job: what to train; must be picklable.
        replay: per-rank action lists to follow (e.g. an emulator run's ``trace.order()``):
            the run is then bit-identical to that run (every replica follows them).
        listener: receives per-step losses and evaluations (in this, the coordinating process).
        threads_per_stage: ``torch.set_num_threads`` in each stage process.
        timeout_s: a stage waiting longer than this for a neighbour fails the run.
        backend: ``"gloo"`` or ``"nccl"``; default :func:`choose_backend` (NCCL when CUDA has
            a device per process).

    Returns:
        A :class:`RunResult`; ``trace`` holds wall-clock times (seconds since the shared
        start) and ``wall_s`` the slowest stage's training time (start-up excluded).

    Raises:
        PipelineFailure: a stage process raised or died; every other stage is terminated.
    """
    n = job.schedule.n_ranks
    world = job.dp * n
    backend = choose_backend(world, backend)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_stage_entry, name=f"unbubble-rank-{g}",
                    args=(g, job, None if replay is None else replay[g % n], q, port, threads_per_stage, timeout_s,
                          backend))
        for g in range(world)
    ]
    for p in procs:
        p.start()
    collector = _Collector(job, listener)
    try:
        while not collector.complete:
            try:
                msg = q.get(timeout=0.5)
            except queue.Empty:
                dead = [(s, p.exitcode) for s, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    s, code = dead[0]
                    try:  # its error report may still be in the queue
                        msg = q.get(timeout=1.0)
                        collector.handle(_root_cause(msg, q) if msg[0] == "error" else msg)
                    except queue.Empty:
                        pass
                    raise PipelineFailure(f"stage {_rank_name(job, s)} exited with code {code} without a report")
                continue
            if msg[0] == "error":
                msg = _root_cause(msg, q)
            collector.handle(msg)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return collector.result()


def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (RANK/WORLD_SIZE are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_torchrun(job: PipelineJob, replay: list[list[Action]] | None = None, listener: Listener | None = None,
                 timeout_s: float = 300.0, backend: str | None = None) -> RunResult | None:
    """Runs this process's pipeline rank when launched by ``torchrun``: WORLD_SIZE = D·R,
    global rank ``d·R + r`` ([Note: 2-D rank layout]; ``--nnodes D --nproc-per-node R`` puts
    one replica on each machine). NCCL on ``cuda:LOCAL_RANK`` when CUDA has a device per
    local process (LOCAL_WORLD_SIZE), else gloo.

    Reports are gathered on rank 0 at the end, which returns the :class:`RunResult`; other
    ranks return ``None``.

    Raises:
        ConfigError: WORLD_SIZE differs from dp × pipeline ranks.
    """
    from unbubble.errors import ConfigError

    world = int(os.environ["WORLD_SIZE"])
    n = job.schedule.n_ranks
    if world != job.dp * n:
        raise ConfigError(f"WORLD_SIZE={world} does not match dp × pipeline ranks = {job.dp} × {n} = {job.dp * n}: "
                          "launch one process per stage and replica (torchrun --nnodes … --nproc-per-node … with "
                          "nnodes × nproc-per-node = dp × stages)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend)
    device, control = _init(backend, local_rank, timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    messages: list[tuple] = []
    run_stage(job, rank, messages.append, None if replay is None else replay[rank % n], recv_timeout_s=timeout_s,
              device=device, control_group=control)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(messages, gathered, dst=0, group=control)
    dist.destroy_process_group()
    if rank != 0:
        return None
    collector = _Collector(job, listener)
    for stage_msgs in gathered:
        for msg in stage_msgs:
            if msg[0] == "records":
                collector.handle(msg)
    for stage_msgs in gathered:
        for msg in stage_msgs:
            if msg[0] != "records":
                collector.handle(msg)
    return collector.result()
