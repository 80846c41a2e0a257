"""One stage process of the distributed runtime: the policy decides on real arrivals."""

from __future__ import annotations

import io
import logging
import signal
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbubble.optim import optimizer_state_bytes
from unbubble.runtime.checkpoint import CutWriter
from unbubble.runtime.clipping import attach_dist
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.data_parallel import GradientAverager, Layout
from unbubble.runtime.reports import Done, Event, Final, Record, Records, Report, Snapshot, Started, StepLoss, \
    Stopped
from unbubble.runtime.transport import END, P2PTransport, PeerFailure, channel_groups
from unbubble.runtime.telemetry import process_memory
from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import CutPolicy, Cuts, ListPolicy, RankView, StageState, resume_position, \
    resume_state

log = logging.getLogger(__name__)

#: Where a stage's reports go (``runtime/reports.py``: one dataclass per kind).
Sink = Callable[[Report], None]


def to_bytes(state: dict) -> bytes:
    """Serialises a state dict (tensors moved to the CPU first; no-op for CPU tensors)."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def run_stage(job: PipelineJob, rank: int, sink: Sink, replay: list[Action] | None = None,
              recv_timeout_s: float = 300.0, device: torch.device | None = None, control_group=None,
              cuts: Cuts | None = None, on_action: Callable[[Action], None] | None = None) -> int | None:
    """Runs the stages of one rank until its policy is done; ``torch.distributed`` must be
    initialised with ``job.dp × R`` ranks. Global rank ``rank = d·R + r`` runs pipeline rank
    r of replica d ([Note: 2-D rank layout] in ``data_parallel.py``): stage r, or the v stages
    ``r, r + R, …`` when interleaved. May be called again (same job sizes or not) in the same
    process group: the channel groups are created once.

    Reports to ``sink`` (replica 0): ``("start", 0, t0)`` once (rank 0: the training loop's
    start in epoch seconds, after set-up), ``("records", stage, [(action, start_s, end_s, version,
    weights), …])`` and ``("step_loss", stage, loss)`` after each update (with D > 1 the loss is
    the replicas' mean), ``("snapshot", stage, (version, bytes))`` for evaluation, and
    ``("final", stage, (state_bytes, wall_s, optimizer_bytes, memory, clip_stats))`` at the end (memory: the executor's
    ``memory_bytes()`` and this process's ``process_rss_bytes``, ``process_peak_rss_bytes``; clip_stats: the
    executor's ``clip_stats``, [Note: clip scopes] in docs/architecture.md); other replicas,
    whose weights equal replica 0's, report only ``("done", stage, wall_s)``. Times are seconds
    since a start shared by all ranks. ``("event", stage, event)`` reports a micro-batch the
    non-finite guard dropped (every replica reports its own); ``("stopped", stage, T)`` before
    its final report when a stop signal ended the run at step T.

    Checkpoints ([Note: the checkpoint cut]): with ``job.checkpoint`` set, replica 0 writes each
    hosted stage's file at every cut; with ``resume_step`` set, every rank starts from the files
    of that step. A stop (``cuts.stop_requested``, set by a signal handler) is placed by stage 0
    at its next step boundary T (with D > 1 the replicas of stage 0 agree on T with an
    all-reduce after each update) and travels down the pipeline as an end-of-stream frame
    behind the last activation before T; each stage finishes the micro-batches before T,
    saves at update T and sends an end frame upstream on its gradient channel, so every
    receiver thread ends without a timeout.

    Args:
        job: the job (every rank holds the same one).
        rank: this process's global rank (= pipeline rank when ``job.dp == 1``).
        sink: where reports go.
        replay: this rank's recorded action list (follow it instead of the policy).
        recv_timeout_s: longest wait for a neighbour's message before failing.
        device: the CUDA device of this rank under NCCL; ``None`` on CPU (gloo).
        control_group: a gloo group of all ranks for host-side control messages (the shared
            start time) when the default group is NCCL; ``None`` uses the default group.
        cuts: this process's cut points and stop flag (default ``job.cuts()``).
        on_action: called after each action (the launcher's heartbeat and last-action record).

    Returns:
        The step T the run stopped at, or ``None`` if it ran to the end.

    Raises:
        PeerFailure: a neighbour stopped sending within ``recv_timeout_s``.
        ConfigError: a checkpoint to resume is missing, damaged or from another configuration.
    """
    run = _RankRun(job, rank, sink, replay, device, cuts or job.cuts())
    run.start(control_group)
    run.loop(recv_timeout_s, on_action)
    return run.finish()


class _RankRun:
    """One call of :func:`run_stage`: the rank's executors, transport and policy (set up in the
    constructor, in the same order on every rank: the collectives that create groups and exchange
    sizes must match), its training loop and its final reports."""

    def __init__(self, job: PipelineJob, rank: int, sink: Sink, replay: list[Action] | None,
                 device: torch.device | None, cuts: Cuts):
        self.job, self.rank, self.sink, self.device, self.cuts = job, rank, sink, device, cuts
        sched = job.schedule
        self.n, self.m, start = sched.n_stages, sched.mb_per_step, job.start_step
        layout = Layout(job.dp, sched.n_ranks)
        self.replica, self.prank = layout.split(rank)
        self.primary = self.replica == 0  # replica 0 reports; the others' weights are identical
        self.stages = sched.stages_of(self.prank)
        # [Note: 2-D rank layout]: every rank creates every data-parallel group, in the same order
        dp_groups = channel_groups([(("dp", r), layout.replica_ranks(r)) for r in range(sched.n_ranks)]) \
            if job.dp > 1 else None
        averager = GradientAverager(dp_groups[self.prank], job.dp, device) if dp_groups else None
        self.execs = {s: job.build_executor(s, replica=self.replica, grad_sync=averager, device=device)
                      for s in self.stages}
        torch.manual_seed(job.seed + 1_000_003 * (rank + 1))  # outside forwards (each forward seeds its own)
        if start:
            for ex in self.execs.values():
                job.load_checkpoint(ex)
        # [Note: clip scopes]: one group per replica's pipeline ranks, created by every rank in the same order
        self.clipper = None
        if job.clip_grad_norm is not None:
            clip_groups = channel_groups([(("clip", d), [layout.global_rank(d, r) for r in range(sched.n_ranks)])
                                          for d in range(job.dp)])
            self.clipper = attach_dist(job, self.execs, self.prank, clip_groups[self.replica], device)
        if self.primary and job.wants_snapshot(0) and not start:
            for s, ex in self.execs.items():
                sink(Snapshot(s, 0, to_bytes(ex.module.state_dict())))
        self.transport = P2PTransport(self.prank, sched.n_ranks, self.n, sched.total_mb, replica=self.replica,
                                      dp=job.dp, device=device, placement=sched.ranks)
        self.transport.start(start * self.m)
        self.policy, self.states, self.view = self._policy(replay, start)
        self.inputs: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
        self.writer = CutWriter(job, cuts, enabled=self.primary)
        # whether this rank's end frame has gone downstream (True) / upstream (False); none to send on an edge
        self.end_sent = {True: not any(s < self.n - 1 for s in self.stages), False: not any(s > 0 for s in self.stages)}
        self.stage0_group = dp_groups[0] if dp_groups and self.prank == 0 else None
        self.records: list[Record] = []
        self.t0 = 0.0

    def _policy(self, replay: list[Action] | None, start: int) -> tuple[CutPolicy, dict[int, StageState], Any]:
        """The rank's policy (its recorded list, or the schedule's) behind the cut points, its stages'
        states and the view the policy reads; positioned at step ``start`` after a resume."""
        sched = self.job.schedule
        inner = ListPolicy(replay) if replay is not None else sched.policy(self.prank, self.job.order)
        states = {s: StageState(s, self.n, sched.total_mb) for s in self.stages}
        view = states[self.prank] if len(self.stages) == 1 else RankView(list(states.values()))
        if start:
            for st in states.values():
                resume_state(st, start, self.m)
            if isinstance(inner, ListPolicy):
                view.n_actions = resume_position(inner.actions, self.stages, start)
        return CutPolicy(inner, self.cuts), states, view

    def start(self, control_group) -> None:
        """Unblocks stop signals and agrees on the start time shared by all ranks."""
        # set-up is done: a stop signal the launcher blocked during the rendezvous arrives now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
        # a start time shared by every rank (host tensors), taken once all have finished setting up
        dist.barrier(group=control_group)
        t_ref = torch.tensor([time.time()], dtype=torch.float64)
        dist.broadcast(t_ref, src=0, group=control_group)
        self.t0 = float(t_ref[0])
        if self.rank == 0:
            self.sink(Started(self.t0))

    def at_stop(self) -> None:
        """After a stop is placed: save stages at T, send end frames once their part is done."""
        t, m, n = self.cuts.stop_step, self.m, self.n
        self.writer.at_stop(self.execs.values())
        if not self.end_sent[True] and all(self.states[s].n_fwd >= t * m for s in self.stages if s < n - 1):
            self.transport.send_end(True, t)
            self.end_sent[True] = True
        if not self.end_sent[False] and all(ex.version >= t for ex in self.execs.values()):
            self.transport.send_end(False, t)
            self.end_sent[False] = True

    def take(self, messages) -> None:
        """Stores arrived activations and gradients (marking them ready) and end frames' stop steps."""
        for kind, s, k, payload in messages:
            if kind is END:  # k: the stop step placed upstream
                if self.cuts.stop_step is None:
                    self.cuts.stop_step = k
                continue
            self.inputs[(kind, s, k)] = payload
            (self.states[s].fwd_ready if kind is ActionKind.F else self.states[s].bwd_ready).add(k)

    def loop(self, recv_timeout_s: float, on_action: Callable[[Action], None] | None) -> None:
        """Runs the policy's actions as their inputs arrive until it is done (or stopped)."""
        policy, view, cuts = self.policy, self.view, self.cuts
        last: Action | None = None
        while not policy.done(view):
            self.take(self.transport.poll())
            if cuts.stop_step is not None:
                self.at_stop()
            action = policy.next_action(view)
            if action is None:
                if cuts.stop_step is not None:
                    self.at_stop()
                    if policy.done(view):
                        break
                try:
                    self.take(self.transport.poll(block_s=recv_timeout_s))
                except PeerFailure as exc:
                    raise PeerFailure(f"rank {self.rank}: {exc}; last action {last or 'none'}") from exc
                continue
            self.run_action(action)
            last = action
            if on_action is not None:
                on_action(action)
            ex = self.execs[action.stage]
            for event in ex.events:
                self.sink(Event(action.stage, event))
            ex.events.clear()
            if action.kind is ActionKind.U:
                self.after_update(ex)

    def run_action(self, action: Action) -> None:
        """Runs one action with its arrived input, sends its output, records its times."""
        s, ex = action.stage, self.execs[action.stage]
        payload = None
        if action.kind is ActionKind.F and s > 0:
            payload = self.inputs.pop((ActionKind.F, s, action.mb))
        elif action.kind in (ActionKind.B, ActionKind.I) and s < self.n - 1:
            payload = self.inputs.pop((ActionKind.B, s, action.mb))
        version, weights = ex.version, ex.weights_version(action)
        t_start = time.time() - self.t0
        out = ex.run(action, payload)
        end = time.time() - self.t0
        if out is not None:  # first, so the neighbour's wait is not lengthened by bookkeeping
            self.transport.send(action.kind, s, action.mb, out)
        self.records.append((str(action), t_start, end, version, weights))
        self.view.apply(action)

    def after_update(self, ex) -> None:
        """After an update of ``ex``: stage 0's replicas agree on a stop, a cut is saved, and replica 0
        reports the records, the step loss and a snapshot when evaluation wants one."""
        cuts, s = self.cuts, ex.stage
        if self.stage0_group is not None and s == 0:  # replicas of stage 0 agree on the stop
            flag = torch.tensor([float(cuts.stop_requested), float(-(-self.states[0].n_fwd // self.m))],
                                device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.stage0_group)
            if flag[0] > 0 and cuts.stop_step is None:
                cuts.stop_step = int(flag[1])
        self.writer.after_update(ex)
        records, self.records = self.records, []
        if not self.primary:
            return
        self.sink(Records(s, records))
        if ex.is_last and ex.last_step_loss is not None:
            self.sink(StepLoss(s, ex.last_step_loss))
        if self.job.wants_snapshot(ex.version):
            self.sink(Snapshot(s, ex.version, to_bytes(ex.module.state_dict())))

    def finish(self) -> int | None:
        """Saves a stop's cut, drains the clip exchange, closes the transport and sends the final
        reports; returns the stop step (``None``: ran to the end)."""
        cuts = self.cuts
        if cuts.stop_step is not None:
            self.at_stop()
        if self.clipper is not None and self.clipper.exchange is not None:  # stale: the last s updates' collectives
            self.clipper.exchange.drain()
        self.transport.close()
        wall = time.time() - self.t0
        if cuts.stop_step is not None:  # before Final/Done: the launcher stops reading once all have come
            self.sink(Stopped(self.prank, cuts.stop_step))
        if not self.primary:
            for s in self.execs:
                self.sink(Done(s, wall))
            return cuts.stop_step
        if self.records:
            self.sink(Records(self.prank, self.records))
        for s, ex in self.execs.items():
            memory = {**ex.memory_bytes(), **{f"process_{k}": v for k, v in process_memory().items()}}
            self.sink(Final(s, to_bytes(ex.module.state_dict()), wall, optimizer_state_bytes(ex.optimizer), memory,
                            dict(ex.clip_stats)))
        return cuts.stop_step
