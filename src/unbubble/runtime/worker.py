"""One stage process of the distributed runtime: the policy decides on real arrivals."""

from __future__ import annotations

import io
import logging
import signal
import time
from typing import Callable

import torch
import torch.distributed as dist

from unbubble.optim import optimizer_state_bytes
from unbubble.runtime.checkpoint import CutWriter
from unbubble.runtime.clipping import attach_dist
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.data_parallel import GradientAverager, Layout
from unbubble.runtime.transport import END, P2PTransport, PeerFailure, channel_groups
from unbubble.runtime.telemetry import process_memory
from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import CutPolicy, Cuts, ListPolicy, RankView, StageState, resume_position, \
    resume_state

log = logging.getLogger(__name__)

#: A message from a stage to the coordinator: ``(kind, stage, payload)``.
Sink = Callable[[tuple], None]


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
    executor's ``clip_stats``, [Note: clip scopes] in ``clipping.py``); other replicas,
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
    sched = job.schedule
    n = sched.n_stages
    layout = Layout(job.dp, sched.n_ranks)
    replica, prank = layout.split(rank)
    primary = replica == 0  # replica 0 reports; the others' weights are identical
    stages = sched.stages_of(prank)
    # [Note: 2-D rank layout]: every rank creates every data-parallel group, in the same order
    dp_groups = channel_groups([(("dp", r), layout.replica_ranks(r)) for r in range(sched.n_ranks)]) \
        if job.dp > 1 else None
    averager = GradientAverager(dp_groups[prank], job.dp, device) if dp_groups else None
    execs = {s: job.build_executor(s, replica=replica, grad_sync=averager, device=device) for s in stages}
    cuts = cuts or job.cuts()
    start = job.start_step
    m = sched.mb_per_step
    torch.manual_seed(job.seed + 1_000_003 * (rank + 1))  # outside forwards (each forward seeds its own)
    if start:
        for ex in execs.values():
            job.load_checkpoint(ex)
    # [Note: clip scopes]: one group per replica's pipeline ranks, created by every rank in the same order
    clipper = None
    if job.clip_grad_norm is not None:
        clip_groups = channel_groups([(("clip", d), [layout.global_rank(d, r) for r in range(sched.n_ranks)])
                                      for d in range(job.dp)])
        clipper = attach_dist(job, execs, prank, clip_groups[replica], device)
    if primary and job.wants_snapshot(0) and not start:
        for s, ex in execs.items():
            sink(("snapshot", s, (0, to_bytes(ex.module.state_dict()))))
    transport = P2PTransport(prank, sched.n_ranks, n, sched.total_mb, replica=replica, dp=job.dp, device=device,
                             placement=sched.ranks)
    transport.start(start * m)
    inner = ListPolicy(replay) if replay is not None else sched.policy(prank, job.order)
    states = {s: StageState(s, n, sched.total_mb) for s in stages}
    view = states[prank] if len(stages) == 1 else RankView(list(states.values()))
    if start:
        for st in states.values():
            resume_state(st, start, m)
        if isinstance(inner, ListPolicy):
            view.n_actions = resume_position(inner.actions, stages, start)
    policy = CutPolicy(inner, cuts)
    inputs: dict[tuple[ActionKind, int, int], torch.Tensor] = {}
    writer = CutWriter(job, cuts, enabled=primary)
    end_sent = {True: not any(s < n - 1 for s in stages), False: not any(s > 0 for s in stages)}
    stage0_group = dp_groups[0] if dp_groups and prank == 0 else None

    def at_stop() -> None:
        """After a stop is placed: save stages at T, send end frames once their part is done."""
        t = cuts.stop_step
        writer.at_stop(execs.values())
        if not end_sent[True] and all(states[s].n_fwd >= t * m for s in stages if s < n - 1):
            transport.send_end(True, t)
            end_sent[True] = True
        if not end_sent[False] and all(ex.version >= t for ex in execs.values()):
            transport.send_end(False, t)
            end_sent[False] = True

    # set-up is done: a stop signal the launcher blocked during the rendezvous arrives now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    # a start time shared by every rank (host tensors), taken once all have finished setting up
    dist.barrier(group=control_group)
    t_ref = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t_ref, src=0, group=control_group)
    t0 = float(t_ref[0])
    if rank == 0:
        sink(("start", 0, t0))
    records: list[tuple[str, float, float, int, int]] = []
    last: Action | None = None

    def take(messages) -> None:
        for kind, s, k, payload in messages:
            if kind is END:  # k: the stop step placed upstream
                if cuts.stop_step is None:
                    cuts.stop_step = k
                continue
            inputs[(kind, s, k)] = payload
            (states[s].fwd_ready if kind is ActionKind.F else states[s].bwd_ready).add(k)

    while not policy.done(view):
        take(transport.poll())
        if cuts.stop_step is not None:
            at_stop()
        action = policy.next_action(view)
        if action is None:
            if cuts.stop_step is not None:
                at_stop()
                if policy.done(view):
                    break
            try:
                take(transport.poll(block_s=recv_timeout_s))
            except PeerFailure as exc:
                raise PeerFailure(f"rank {rank}: {exc}; last action {last or 'none'}") from exc
            continue
        s = action.stage
        ex = execs[s]
        payload = None
        if action.kind is ActionKind.F and s > 0:
            payload = inputs.pop((ActionKind.F, s, action.mb))
        elif action.kind in (ActionKind.B, ActionKind.I) and s < n - 1:
            payload = inputs.pop((ActionKind.B, s, action.mb))
        version, weights = ex.version, ex.weights_version(action)
        t_start = time.time() - t0
        out = ex.run(action, payload)
        end = time.time() - t0
        if out is not None:  # first, so the neighbour's wait is not lengthened by bookkeeping
            transport.send(action.kind, s, action.mb, out)
        records.append((str(action), t_start, end, version, weights))
        view.apply(action)
        last = action
        if on_action is not None:
            on_action(action)
        for event in ex.events:
            sink(("event", s, event))
        ex.events.clear()
        if action.kind is ActionKind.U:
            if stage0_group is not None and s == 0:  # replicas of stage 0 agree on the stop
                flag = torch.tensor([float(cuts.stop_requested), float(-(-states[0].n_fwd // m))], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=stage0_group)
                if flag[0] > 0 and cuts.stop_step is None:
                    cuts.stop_step = int(flag[1])
            writer.after_update(ex)
            if not primary:
                records = []
                continue
            sink(("records", s, records))
            records = []
            if ex.is_last and ex.last_step_loss is not None:
                sink(("step_loss", s, ex.last_step_loss))
            if job.wants_snapshot(ex.version):
                sink(("snapshot", s, (ex.version, to_bytes(ex.module.state_dict()))))
    if cuts.stop_step is not None:
        at_stop()
    if clipper is not None and clipper.exchange is not None:  # stale: the last s updates' collectives
        clipper.exchange.drain()
    transport.close()
    wall = time.time() - t0
    if cuts.stop_step is not None:  # before "final"/"done": the launcher stops reading once all have come
        sink(("stopped", prank, cuts.stop_step))
    if not primary:
        for s in execs:
            sink(("done", s, wall))
        return cuts.stop_step
    if records:
        sink(("records", prank, records))
    for s, ex in execs.items():
        memory = {**ex.memory_bytes(), **{f"process_{k}": v for k, v in process_memory().items()}}
        sink(("final", s, (to_bytes(ex.module.state_dict()), wall, optimizer_state_bytes(ex.optimizer), memory,
                           dict(ex.clip_stats))))
    return cuts.stop_step
