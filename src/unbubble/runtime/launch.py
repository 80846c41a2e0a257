"""Process engine: one process per stage on this machine, or under ``torchrun``."""

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


def _stage_entry(stage: int, job: PipelineJob, replay, q, port: int, threads: int, timeout_s: float) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=stage,
                                world_size=job.schedule.n_ranks, timeout=timedelta(seconds=timeout_s))
        run_stage(job, stage, q.put, replay, recv_timeout_s=timeout_s)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit 1
        q.put(("error", stage, f"{type(exc).__name__}: {exc}"))
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
        elif kind == "error":
            raise PipelineFailure(f"stage {stage} failed: {payload}")

    def result(self) -> RunResult:
        n = self.job.schedule.n_stages
        wall = max(f[1] for f in self.finals.values())
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
                  threads_per_stage: int = 1, timeout_s: float = 300.0) -> RunResult:
    """Trains ``job`` with one spawned process per stage, over ``torch.distributed`` (gloo).

    Args:
        job: what to train; must be picklable.
        replay: per-stage action lists to follow (e.g. an emulator run's ``trace.order()``):
            the run is then bit-identical to that run.
        listener: receives per-step losses and evaluations (in this, the coordinating process).
        threads_per_stage: ``torch.set_num_threads`` in each stage process.
        timeout_s: a stage waiting longer than this for a neighbour fails the run.

    Returns:
        A :class:`RunResult`; ``trace`` holds wall-clock times (seconds since the shared
        start) and ``wall_s`` the slowest stage's training time (start-up excluded).

    Raises:
        PipelineFailure: a stage process raised or died; every other stage is terminated.
    """
    n = job.schedule.n_ranks
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_stage_entry, name=f"unbubble-stage-{s}",
                    args=(s, job, None if replay is None else replay[s], q, port, threads_per_stage, timeout_s))
        for s in range(n)
    ]
    for p in procs:
        p.start()
    collector = _Collector(job, listener)
    try:
        while len(collector.finals) < job.schedule.n_stages:
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
                    raise PipelineFailure(f"stage {s} exited with code {code} without a report")
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
                 timeout_s: float = 300.0) -> RunResult | None:
    """Runs this process's stage when launched by ``torchrun`` (rank = stage).

    Reports are gathered on rank 0 at the end, which returns the :class:`RunResult`; other
    ranks return ``None``.

    Raises:
        ConfigError: WORLD_SIZE differs from the number of stages.
    """
    from unbubble.errors import ConfigError

    world = int(os.environ["WORLD_SIZE"])
    if world != job.schedule.n_ranks:
        raise ConfigError(f"WORLD_SIZE={world} does not match the pipeline's {job.schedule.n_ranks} ranks: "
                          "launch one process per stage (torchrun --nproc-per-node … with nnodes × nproc = stages)")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    messages: list[tuple] = []
    run_stage(job, rank, messages.append, None if replay is None else replay[rank], recv_timeout_s=timeout_s)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(messages, gathered, dst=0)
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
