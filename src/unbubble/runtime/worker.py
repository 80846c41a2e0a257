"""One stage process of the distributed runtime: the policy decides on real arrivals."""

from __future__ import annotations

import io
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from unbubble.optim import optimizer_state_bytes
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.transport import P2PTransport, PeerFailure, TensorMeta
from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import ListPolicy, RankView, StageState

log = logging.getLogger(__name__)

#: A message from a stage to the coordinator: ``(kind, stage, payload)``.
Sink = Callable[[tuple], None]


def to_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def _probe(executor, meta: TensorMeta | None) -> TensorMeta:
    """Shape of the stage's output, from one no-grad forward (eval mode, RNG untouched)."""
    module = executor.module
    was_training = module.training
    module.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        x = executor.batch_fn(0)[0] if meta is None else torch.zeros(meta.shape, dtype=meta.dtype)
        out = module(x)
    module.train(was_training)
    return TensorMeta(tuple(out.shape), out.dtype)


def run_stage(job: PipelineJob, rank: int, sink: Sink, replay: list[Action] | None = None,
              recv_timeout_s: float = 300.0) -> None:
    """Runs the stages of one rank until its policy is done; ``torch.distributed`` must be
    initialised (rank = stage, or the v stages ``rank, rank + N, …`` when interleaved).

    Reports to ``sink``: ``("records", stage, [(action, start_s, end_s, version, weights), …])``
    and ``("step_loss", stage, loss)`` after each update, ``("snapshot", stage, (version,
    bytes))`` for evaluation, and ``("final", stage, (state_bytes, wall_s, optimizer_bytes))`` at the end.
    Times are seconds since a start shared by all ranks.

    Args:
        job: the job (every rank holds the same one).
        rank: this process's pipeline rank.
        sink: where reports go.
        replay: this rank's recorded action list (follow it instead of the policy).
        recv_timeout_s: longest wait for a neighbour's message before failing.

    Raises:
        PeerFailure: a neighbour stopped sending within ``recv_timeout_s``.
    """
    sched = job.schedule
    n = sched.n_stages
    stages = list(range(rank, n, sched.n_ranks))
    execs = {s: job.build_executor(s) for s in stages}
    if job.wants_snapshot(0):
        for s, ex in execs.items():
            sink(("snapshot", s, (0, to_bytes(ex.module.state_dict()))))
    transport = P2PTransport(rank, sched.n_ranks, n, sched.total_mb)
    transport.exchange_meta(lambda s, meta: _probe(execs[s], meta))
    transport.start()
    policy = ListPolicy(replay) if replay is not None else sched.policy(rank)
    states = {s: StageState(s, n, sched.total_mb) for s in stages}
    view = states[rank] if len(stages) == 1 else RankView(list(states.values()))
    inputs: dict[tuple[ActionKind, int, int], torch.Tensor] = {}

    t_ref = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t_ref, src=0)  # a start time shared by every rank
    t0 = float(t_ref[0])
    records: list[tuple[str, float, float, int, int]] = []
    last: Action | None = None

    def take(messages) -> None:
        for kind, s, k, payload in messages:
            inputs[(kind, s, k)] = payload
            (states[s].fwd_ready if kind is ActionKind.F else states[s].bwd_ready).add(k)

    while not policy.done(view):
        take(transport.poll())
        action = policy.next_action(view)
        if action is None:
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
        start = time.time() - t0
        out = ex.run(action, payload)
        records.append((str(action), start, time.time() - t0, version, weights))
        if out is not None:
            transport.send(action.kind, s, action.mb, out)
        view.apply(action)
        last = action
        if action.kind is ActionKind.U:
            sink(("records", s, records))
            records = []
            if ex.is_last and ex.last_step_loss is not None:
                sink(("step_loss", s, ex.last_step_loss))
            if job.wants_snapshot(ex.version):
                sink(("snapshot", s, (ex.version, to_bytes(ex.module.state_dict()))))
    transport.close()
    if records:
        sink(("records", rank, records))
    for s, ex in execs.items():
        sink(("final", s, (to_bytes(ex.module.state_dict()), time.time() - t0, optimizer_state_bytes(ex.optimizer))))
