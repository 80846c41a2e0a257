"""Single-process emulator: the simulator with real stage executors attached (docs/architecture.md#one-policy-three-engines)."""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from unbubble.errors import ConfigError, ScheduleError, check_int
from unbubble.optim import optimizer_state_bytes
from unbubble.runtime.checkpoint import CutWriter
from unbubble.runtime.clipping import attach_local, clip_summary
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.telemetry import Listener, RunResult, Telemetry, snapshot
from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import CutPolicy, Cuts, ListPolicy
from unbubble.sim.costs import UniformCosts
from unbubble.sim.engine import ActionRecord, CostModel, run_policies

log = logging.getLogger(__name__)


def run_emulator(job: PipelineJob, costs: CostModel | None = None, replay: list[list[Action]] | None = None,
                 listener: Listener | None = None, modules: list[torch.nn.Module] | None = None,
                 cuts: Cuts | None = None, threads: int | None = 1) -> RunResult:
    """Trains ``job`` with every stage in this process, in the order a cost model gives.

    Each action runs for real at its simulated start time, so the run is deterministic:
    the same job, costs and seed give bit-identical weights. The per-stage action order
    (``result.trace.order()``) can be replayed by the process engine.

    Args:
        job: what to train.
        costs: durations used to order the actions (default: F=1, B=2, U=0, no latency).
        replay: per-stage action lists to follow instead of the schedule's policies (else
            ``job.order`` picks them; with the default costs both orders give the same run).
        listener: receives per-step losses and evaluations.
        modules: pre-built stage modules (else ``job.stage_fn`` builds them).
        cuts: the run's cut points (default ``job.cuts()``); setting ``cuts.stop_requested``
            (a signal handler does) stops the run at the next step boundary, after a checkpoint
            when ``job.checkpoint`` is set.
        threads: torch's intra-op threads during the run (``torch.set_num_threads``, restored
            afterwards); ``None`` keeps the caller's setting. One, as in each stage process of
            the process engine: small per-stage kernels gain nothing from more, and on a shared
            machine oversubscribed OpenMP threads slow them down (5 PACI steps of an 8-layer GPT on
            4 stages, 2 cores at load 5–8: 54–71 s on 2 threads, 16.5–17.2 s on one).

    With ``job.checkpoint.resume_step = V`` every stage starts from its saved state; the
    simulated schedule is replayed from step 0 and actions before the cut after V are skipped,
    so the resumed run executes exactly what the uninterrupted one executes after that cut.

    Returns:
        A :class:`RunResult` whose ``trace`` holds measured wall times and ``sim_trace`` the
        simulated ones.

    Raises:
        ScheduleError: the schedule deadlocks.
        ConfigError: ``job.dp > 1`` (data parallelism needs the process engine).
    """
    if job.dp != 1:
        raise ConfigError(f"dp={job.dp} is invalid for the emulator: it runs one replica (dp=1); "
                          "use the processes engine for data parallelism (set --engine processes)")
    if threads is not None:
        check_int("threads", threads, 1, "the emulator's torch threads; None keeps torch's setting")
    previous = torch.get_num_threads()
    used = previous if threads is None else threads
    log.info("emulator: %d stages in one process, %d torch thread%s (--threads-per-stage)", job.schedule.n_stages,
             used, "" if used == 1 else "s")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(job, costs, replay, listener, modules, cuts)
    finally:
        torch.set_num_threads(previous)


def _run(job: PipelineJob, costs: CostModel | None, replay: list[list[Action]] | None, listener: Listener | None,
         modules: list[torch.nn.Module] | None, cuts: Cuts | None) -> RunResult:
    n = job.schedule.n_stages
    execs = [job.build_executor(s, None if modules is None else modules[s]) for s in range(n)]
    cuts = cuts or job.cuts()
    start = job.start_step
    torch.manual_seed(job.seed)  # outside forwards (each forward seeds its own)
    if start:
        for ex in execs:  # one process: one RNG stream, equal in every stage's file
            job.load_checkpoint(ex, restore_rng=ex.stage == 0)
    clippers = attach_local(job, execs)  # [Note: clip scopes]; after the load: a resume's stale norms
    barrier = bool(clippers) and job.clip_scope == "sync"
    telemetry = Telemetry(job, listener, start_step=start)
    if job.wants_snapshot(0) and not start:
        for ex in execs:
            telemetry.add_snapshot(ex.stage, 0, snapshot(ex.module))
    mailbox: dict[tuple[int, ActionKind, int], torch.Tensor] = {}
    skip_mb = start * job.schedule.mb_per_step
    updates_seen = [0] * n  # U actions replayed per stage, to skip those before the cut
    writer = CutWriter(job, cuts)
    t0 = time.perf_counter()
    telemetry.set_start(time.time())  # after the evaluation of version 0, as wall_s

    def skipped(action: Action) -> bool:
        """Before the resumed cut: not run (counted once per action, in order)."""
        if action.kind is ActionKind.U:
            return updates_seen[action.stage] < start
        return action.mb < skip_mb

    # [Note: the emulator's barrier] Under clip_scope="sync" a rank's update t waits until every
    # rank has reached its update t (the process engine's blocking all-gather). The simulated clock
    # has no barrier, so actions are queued per rank in the simulated order and each runs as soon
    # as what it needs is there: its input in the mailbox, for an update the global norm. Each
    # rank keeps its order, so the run computes what the process engine computes.
    queues: list[deque[Action]] = [deque() for _ in range(job.schedule.n_ranks)]

    def ready(action: Action) -> bool:
        if skipped(action):
            return True
        s, kind = action.stage, action.kind
        if kind is ActionKind.F and s > 0:
            return (s, ActionKind.F, action.mb) in mailbox
        if kind in (ActionKind.B, ActionKind.I) and s < n - 1:
            return (s, ActionKind.B, action.mb) in mailbox
        if kind is ActionKind.U:
            return clippers[job.schedule.rank_of(s)].ready(execs[s])
        return True

    def execute(action: Action) -> None:
        if not barrier:
            return run(action)
        queues[job.schedule.rank_of(action.stage)].append(action)
        progress = True
        while progress:
            progress = False
            for q in queues:
                while q and ready(q[0]):
                    run(q.popleft())
                    progress = True

    def run(action: Action) -> None:
        ex = execs[action.stage]
        if action.kind is ActionKind.U:
            updates_seen[action.stage] += 1
            if updates_seen[action.stage] <= start:
                return
        elif action.mb < skip_mb:
            return
        payload = None
        if action.kind is ActionKind.F and not ex.is_first:
            payload = mailbox.pop((action.stage, ActionKind.F, action.mb))
        elif action.kind in (ActionKind.B, ActionKind.I) and not ex.is_last:
            payload = mailbox.pop((action.stage, ActionKind.B, action.mb))
        version, weights = ex.version, ex.weights_version(action)
        t_start = time.perf_counter() - t0
        out = ex.run(action, payload)
        telemetry.add_record(ActionRecord(action, t_start, time.perf_counter() - t0, version, weights))
        if out is not None:
            forward = action.kind is ActionKind.F
            mailbox[(action.stage + 1 if forward else action.stage - 1,
                     ActionKind.F if forward else ActionKind.B, action.mb)] = out
        while ex.events:
            telemetry.add_event(ex.events.pop(0))
        if action.kind is ActionKind.U:
            if ex.is_last and ex.last_step_loss is not None:
                telemetry.add_step_loss(ex.last_step_loss)
            if job.wants_snapshot(ex.version):
                telemetry.add_snapshot(action.stage, ex.version, snapshot(ex.module))
            writer.after_update(ex)
        if cuts.stop_step is not None:
            writer.at_stop(execs)

    policies = [ListPolicy(acts) for acts in replay] if replay is not None else \
        [job.schedule.policy(r, job.order) for r in range(job.schedule.n_ranks)]
    policies = [CutPolicy(p, cuts) for p in policies]
    sim = run_policies(job.schedule, costs or UniformCosts(), execute, policies)
    stuck = [(r, q[0]) for r, q in enumerate(queues) if q]
    if stuck:
        raise ScheduleError(f"clip_scope='sync' deadlocks schedule {job.schedule.name!r}: "
                            + ", ".join(f"rank {r} waits at {a}" for r, a in stuck))
    wall = time.perf_counter() - t0
    return telemetry.result([ex.module.state_dict() for ex in execs], wall, sim_trace=sim,
                            optimizer_bytes=[optimizer_state_bytes(ex.optimizer) for ex in execs],
                            stopped_at=cuts.stop_step, memory=[ex.memory_bytes() for ex in execs],
                            clip=clip_summary(job, [ex.clip_stats for ex in execs]))
