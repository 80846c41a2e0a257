"""One stage process of the distributed runtime: the policy decides on real arrivals."""

from __future__ import annotations

import io
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from unbubble.runtime.job import PipelineJob
from unbubble.runtime.transport import P2PTransport, PeerFailure, TensorMeta
from unbubble.schedules.actions import Action, ActionKind
from unbubble.schedules.policy import ListPolicy, StageState

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


def run_stage(job: PipelineJob, stage: int, sink: Sink, replay: list[Action] | None = None,
              recv_timeout_s: float = 300.0) -> None:
    """Runs one stage until its policy is done; ``torch.distributed`` must be initialised.

    Reports to ``sink``: ``("records", stage, [(action, start_s, end_s, version), …])`` and
    ``("step_loss", stage, loss)`` after each update, ``("snapshot", stage, (version, bytes))``
    for evaluation, and ``("final", stage, (state_bytes, wall_s))`` at the end. Times are
    seconds since a start shared by all ranks.

    Args:
        job: the job (every rank holds the same one).
        stage: 0-based stage index (the rank).
        sink: where reports go.
        replay: this stage's recorded action list (follow it instead of the policy).
        recv_timeout_s: longest wait for a neighbour's message before failing.

    Raises:
        PeerFailure: a neighbour stopped sending within ``recv_timeout_s``.
    """
    n = job.schedule.n_stages
    ex = job.build_executor(stage)
    if job.wants_snapshot(0):
        sink(("snapshot", stage, (0, to_bytes(ex.module.state_dict()))))
    transport = P2PTransport(stage, n, job.schedule.total_mb)
    transport.exchange_meta(lambda meta: _probe(ex, meta))
    transport.start()
    policy = ListPolicy(replay) if replay is not None else job.schedule.policy(stage)
    state = StageState(stage, n, job.schedule.total_mb)
    inputs: dict[tuple[ActionKind, int], torch.Tensor] = {}

    t_ref = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t_ref, src=0)  # a start time shared by every rank
    t0 = float(t_ref[0])
    records: list[tuple[str, float, float, int]] = []
    last: Action | None = None

    def take(messages) -> None:
        for kind, k, payload in messages:
            inputs[(kind, k)] = payload
            (state.fwd_ready if kind is ActionKind.F else state.bwd_ready).add(k)

    while not policy.done(state):
        take(transport.poll())
        action = policy.next_action(state)
        if action is None:
            try:
                take(transport.poll(block_s=recv_timeout_s))
            except PeerFailure as exc:
                raise PeerFailure(f"stage {stage}: {exc}; last action {last or 'none'}") from exc
            continue
        payload = None
        if (action.kind is ActionKind.F and stage > 0) or (action.kind is ActionKind.B and stage < n - 1):
            payload = inputs.pop((action.kind, action.mb))
        version = ex.version
        start = time.time() - t0
        out = ex.run(action, payload)
        records.append((str(action), start, time.time() - t0, version))
        if out is not None:
            transport.send(action.kind, action.mb, out)
        state.apply(action)
        last = action
        if action.kind is ActionKind.U:
            sink(("records", stage, records))
            records = []
            if ex.is_last and ex.last_step_loss is not None:
                sink(("step_loss", stage, ex.last_step_loss))
            if job.wants_snapshot(ex.version):
                sink(("snapshot", stage, (ex.version, to_bytes(ex.module.state_dict()))))
    transport.close()
    if records:
        sink(("records", stage, records))
    sink(("final", stage, (to_bytes(ex.module.state_dict()), time.time() - t0)))
