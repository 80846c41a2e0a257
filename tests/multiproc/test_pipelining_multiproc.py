"""``unbubble.pipelining.SchedulePACI`` on real gloo processes (torch's ``PipelineStage`` and P2P, no unbubble
launcher) against unbubble's single-process emulator on the same stage modules and micro-batches.

Starting N processes costs ≈ 7 s on 2 cores, so every scenario of one N runs in one launch (N = 2, then
4 processes, shared by the tests through module fixtures); each result is checked against an independent
reference: the emulator's PACI (losses, weights and per-stage drift histogram, bit for bit), its 1F1B-flush,
its run with a checkpoint cut, for the example its PACI on the example's own model, for HF Llama stages in
``TreeStage`` the emulator's PACI on ``split_model``'s stages, and for pp = 2 × dp = 2 with DDP-wrapped or
``fully_shard``-ed stages unbubble's own ``dp=2`` PACI run (the process engine, one more launch).
"""

from __future__ import annotations

import functools
import io
import itertools

import pytest
import torch

from unbubble.pipelining import split_torchtitan_model
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from unbubble.schedules.policy import Cuts
from helpers import example_module, job_batches as _batches, launch_gloo, tiny_gpt_job

pytestmark = pytest.mark.multiproc
torch.set_num_threads(1)  # as in each process, so the emulator's arithmetic matches bit for bit

def _job(name: str, n: int, steps: int, a: int) -> PipelineJob:
    return tiny_gpt_job(get_schedule(name, n, steps, **({"m": a} if name == "1f1b-flush" else {"a": a})))


def _mean(losses: list[torch.Tensor]) -> float:
    values = torch.stack(losses).tolist()  # as the executor reduces a step's losses
    return sum(values) / len(values)


# -- what each process runs -----------------------------------------------------------------------------

def _steps(schedule, opt, data, steps: int, drain_at: int | None = None) -> list[float]:
    """A training loop over ``schedule.step``: each step's mean loss where this rank has them (the last stage);
    drained after step ``drain_at`` (1-based) when given."""
    losses = []
    for t in range(steps):
        opt.zero_grad()
        got: list = []
        schedule.step(data, losses=got)
        opt.step()
        if got:
            losses.append(_mean(got))
        if t + 1 == drain_at:
            schedule.drain()
    return losses


def _paci_run(rank: int, n: int, sc: dict, module=None, opt_state=None, sched_state=None, steps=None):
    from torch.distributed.pipelining import PipelineStage

    from unbubble.pipelining import SchedulePACI

    a, m = sc["a"], sc.get("m", sc["a"])
    job = _job("paci", n, sc["steps"], a)
    module = job.stage_fn(rank) if module is None else module
    opt = job.optimizer_fn(list(module.named_parameters()), rank)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    schedule = SchedulePACI(PipelineStage(module, rank, n, torch.device("cpu")), m, job.loss_fn, a=a,
                            flush=sc.get("flush", False))
    start = 0
    if sched_state is not None:
        schedule.load_state_dict(sched_state)
        start = sched_state["next_micro_batch"] // m
    losses = _steps(schedule, opt, _batches(job, m, start), sc["steps"] if steps is None else steps, sc.get("drain_at"))
    in_flight_before = schedule.in_flight
    schedule.drain()
    return module, opt, schedule, {"losses": losses, "drift": dict(schedule.drift), "in_flight_before": in_flight_before,
                                   "in_flight": schedule.in_flight, "fwd_cache": len(schedule._pp_stage.fwd_cache)}


def _state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _scenario(rank: int, n: int, sc: dict) -> dict:
    kind = sc["kind"]
    if kind == "paci":
        module, _, _, out = _paci_run(rank, n, sc)
        return {**out, "state": _state(module)}
    if kind == "resume":  # T1 steps, drain, checkpoint, T2 more; then a fresh stage resumed from the checkpoint
        t1, t2 = sc["t1"], sc["steps"] - sc["t1"]
        module, opt, schedule, _ = _paci_run(rank, n, sc, steps=t1)
        ckpt = {"model": _state(module), "opt": io.BytesIO(), "sched": schedule.state_dict()}
        torch.save(opt.state_dict(), ckpt["opt"])
        whole_sc = {**sc, "drain_at": t1}
        whole, _, _, whole_out = _paci_run(rank, n, whole_sc)
        fresh = _job("paci", n, sc["steps"], sc["a"]).stage_fn(rank)
        fresh.load_state_dict(ckpt["model"])
        ckpt["opt"].seek(0)
        resumed, _, _, resumed_out = _paci_run(rank, n, sc, module=fresh, opt_state=torch.load(ckpt["opt"]),
                                               sched_state=ckpt["sched"], steps=t2)
        return {"whole": {**whole_out, "state": _state(whole)}, "resumed": {**resumed_out, "state": _state(resumed)},
                "sched_state": ckpt["sched"]}
    if kind == "dcp":  # torchtitan's way: drain, then torch.distributed.checkpoint; a fresh stage loads it
        import os
        import pickle
        import tempfile

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        # flattened, as torchtitan's optimizer container: keys per parameter name (unflattened, the stages' param
        # groups share one key and DCP keeps one rank's)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)

        folder = os.path.join(tempfile.gettempdir(), f"unbubble-dcp-{os.getppid()}")  # one folder, both ranks
        t1, t2 = sc["t1"], sc["steps"] - sc["t1"]
        module, opt, schedule, _ = _paci_run(rank, n, sc, steps=t1)  # ends with schedule.drain()
        model_sd, optim_sd = get_state_dict(module, opt, options=flat)
        dcp.save({"model": model_sd, "optim": optim_sd,
                  f"schedule_{rank}": io.BytesIO(pickle.dumps(schedule.state_dict()))}, checkpoint_id=folder)
        whole, _, _, whole_out = _paci_run(rank, n, {**sc, "drain_at": t1})
        job = _job("paci", n, sc["steps"], sc["a"])
        fresh = job.stage_fn(rank)
        fresh_opt = job.optimizer_fn(list(fresh.named_parameters()), rank)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt, options=flat)
        state = {"model": model_sd, "optim": optim_sd, f"schedule_{rank}": io.BytesIO()}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=flat)
        sched_state = pickle.loads(state[f"schedule_{rank}"].getvalue())
        resumed, _, _, resumed_out = _paci_run(rank, n, sc, module=fresh, opt_state=fresh_opt.state_dict(),
                                               sched_state=sched_state, steps=t2)
        return {"whole": {**whole_out, "state": _state(whole)}, "resumed": {**resumed_out, "state": _state(resumed)},
                "sched_state": sched_state}
    if kind == "torch-1f1b":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        job, m = _job("1f1b-flush", n, sc["steps"], sc["a"]), sc["a"]
        module = job.stage_fn(rank)
        opt = job.optimizer_fn(list(module.named_parameters()), rank)
        schedule = Schedule1F1B(PipelineStage(module, rank, n, torch.device("cpu")), m, loss_fn=job.loss_fn)
        data, losses = _batches(job, m), []
        for _ in range(sc["steps"]):
            x, y = next(data)
            got: list = []
            schedule.step(*((x,) if rank == 0 else ()), target=y if rank == n - 1 else None, losses=got)
            opt.step()
            opt.zero_grad()
            if got:
                losses.append(_mean(got))
        return {"losses": losses, "state": _state(module)}
    if kind == "example":
        ex = example_module()
        return ex.train(ex.Config(steps=sc["steps"], a=sc.get("a"), clip=sc["clip"], log=False))
    if kind == "eval":  # PACI (drained at the end), then one forward-only batch through eval()
        module, opt, schedule, out = _paci_run(rank, n, sc)
        job = _job("paci", n, sc["steps"], sc["a"])
        x, y = next(_batches(job, sc["a"], start=1000))
        losses: list = []
        merged = schedule.eval(*((x,) if rank == 0 else ()), target=y if rank == n - 1 else None, losses=losses)
        return {**out, "state": _state(module), "eval_losses": losses,
                "eval_shape": None if merged is None else tuple(merged.shape)}
    if kind == "mask":
        return _mask_run(rank, n, sc)
    if kind == "hf":
        return _hf_run(rank, n, sc)
    if kind == "dp":
        return _dp_run(rank, n, sc)
    raise ValueError(kind)


# -- a model that needs its mask: per-micro-batch keyword inputs, batches of changing shapes ----------------

MASK_VOCAB, MASK_DIM = 32, 16


class MaskedBlock(torch.nn.Module):
    """One stage: [embedding] → masked self-attention (residual) → [head]; ``forward(h, mask)`` with ``mask`` a
    (B, T, T) bool (True: attend), required. Weights from ``seed``."""

    def __init__(self, first: bool, last: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(MASK_VOCAB, MASK_DIM) if first else None
        self.qkv = torch.nn.Linear(MASK_DIM, 3 * MASK_DIM)
        self.out = torch.nn.Linear(MASK_DIM, MASK_DIM)
        self.head = torch.nn.Linear(MASK_DIM, MASK_VOCAB) if last else None

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            raise ValueError("MaskedBlock needs its mask")
        h = self.embed(h) if self.embed is not None else h
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2) / MASK_DIM ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + self.out(att @ v)
        return self.head(h) if self.head is not None else h


class CarryMask(torch.nn.Module):
    """The emulator's stage (one argument): ``{"h", "mask"}`` in, the block's output with the mask passed on out."""

    def __init__(self, block: MaskedBlock):
        super().__init__()
        self.block = block

    def forward(self, x: dict):
        out = self.block(x["h"], mask=x["mask"])
        return out if self.block.head is not None else {"h": out, "mask": x["mask"]}


def _mask_block(n: int, stage: int) -> MaskedBlock:
    return MaskedBlock(stage == 0, stage == n - 1, seed=100 + stage)


def _mask_emu_stage(n: int, stage: int) -> torch.nn.Module:
    return CarryMask(_mask_block(n, stage))


def _mask_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, MASK_VOCAB), y.reshape(-1))


def _mask_opt(named: list, stage: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.1)


def _mask_mb(m: int, shapes: tuple, k: int):
    """Micro-batch k: tokens (B, T), a block-diagonal causal mask (B, T, T) (two documents per row, cut at a
    position of its own) and next tokens; (B, T) = ``shapes[(k // m) % len(shapes)]``, one shape per batch."""
    b_rows, t = shapes[(k // m) % len(shapes)]
    g = torch.Generator().manual_seed(5000 + k)
    x = torch.randint(0, MASK_VOCAB, (b_rows, t), generator=g)
    y = torch.randint(0, MASK_VOCAB, (b_rows, t), generator=g)
    cut = torch.randint(1, t, (b_rows,), generator=g) if t > 1 else torch.ones(b_rows, dtype=torch.long)
    pos = torch.arange(t)
    doc = (pos[None, :] >= cut[:, None]).long()  # (B, T): 0 before the cut, 1 after
    mask = (pos[None, :, None] >= pos[None, None, :]) & (doc[:, :, None] == doc[:, None, :])
    return {"h": x, "mask": mask}, y


def _mask_job(name: str, n: int, steps: int, a: int, shapes: tuple) -> PipelineJob:
    return PipelineJob(stage_fn=functools.partial(_mask_emu_stage, n), loss_fn=_mask_loss,
                       batch_fn=functools.partial(_mask_mb, a, shapes), optimizer_fn=_mask_opt,
                       schedule=get_schedule(name, n, steps, **({"m": a} if name == "1f1b-flush" else {"a": a})))


def _mask_batches(m: int, shapes: tuple):
    """Endless MicroBatches of m of :func:`_mask_mb`'s micro-batches: what torchtitan 0.3.0's step hands over."""
    from unbubble.pipelining import MicroBatches

    for b in itertools.count():
        mbs = [_mask_mb(m, shapes, b * m + j) for j in range(m)]
        yield MicroBatches(arg_mbs=[(x["h"],) for x, _ in mbs], kwarg_mbs=[{"mask": x["mask"]} for x, _ in mbs],
                           target_mbs=[y for _, y in mbs])


def _mask_run(rank: int, n: int, sc: dict) -> dict:
    """SchedulePACI on MaskedBlock stages, the mask a per-micro-batch keyword input on every stage: through an
    iterator of MicroBatches (``form="iter"``) or torch's pre-split ``step(arg_mbs=, kwarg_mbs=, target_mbs=)``."""
    from torch.distributed.pipelining import PipelineStage

    from unbubble.pipelining import SchedulePACI

    a, shapes = sc["a"], tuple(sc["shapes"])
    module = _mask_block(n, rank)
    opt = _mask_opt(list(module.named_parameters()), rank)
    schedule = SchedulePACI(PipelineStage(module, rank, n, torch.device("cpu")), a, _mask_loss, a=a)
    data, losses = _mask_batches(a, shapes), []
    for _ in range(sc["steps"]):
        opt.zero_grad()
        got: list = []
        if sc["form"] == "iter":
            schedule.step(data, losses=got)
        else:
            mb = next(data)
            schedule.step(arg_mbs=mb.arg_mbs if rank == 0 else None, kwarg_mbs=mb.kwarg_mbs,
                          target_mbs=mb.target_mbs if rank == n - 1 else None, losses=got)
        opt.step()
        if got:
            losses.append(_mean(got))
    in_flight_before = schedule.in_flight
    schedule.drain()
    return {"losses": losses, "drift": dict(schedule.drift), "state": {f"block.{k}": v for k, v in _state(module).items()},
            "in_flight_before": in_flight_before, "in_flight": schedule.in_flight,
            "fwd_cache": len(schedule._pp_stage.fwd_cache)}


def _hf_batches(padded: bool, m: int, start: int = 0):
    """Endless dict batches of m of ``helpers.lm_batch``'s micro-batches (ids b·m … b·m + m − 1)."""
    from helpers import lm_batch

    for b in itertools.count(start):
        mbs = [lm_batch(padded, b * m + j) for j in range(m)]
        yield {key: torch.cat([x[key] for x, _ in mbs]) for key in mbs[0][0]}, torch.cat([y for _, y in mbs])


def _hf_run(rank: int, n: int, sc: dict) -> dict:
    """HF Llama split by ``split_model`` (dict boundaries) in ``TreeStage``, built by the torchtitan drop-in builder
    with torchtitan's ``(loss, metrics)`` loss; then drained and evaluated on one more batch."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import PipelineStage

    from unbubble.models.split import causal_lm_loss, split_model
    from unbubble.pipelining import TreeStage, build_pipeline_schedule
    from helpers import hf_adamw, tiny_hf_llama

    a, padded = sc["a"], sc["padded"]
    part = split_model(tiny_hf_llama(), n)(rank)
    opt = hf_adamw(part.parameters(), rank)
    stage = PipelineStage(TreeStage(part), rank, n, torch.device("cpu"))
    schedule = build_pipeline_schedule(
        parallelism=SimpleNamespace(pipeline_parallel_schedule="PACI", pipeline_parallel_schedule_csv=None),
        local_batch_size=a, stages=[stage], loss_fn=lambda out, y: (causal_lm_loss(out, y), {}), scale_grads=True)
    losses = _steps(schedule, opt, _hf_batches(padded, a), sc["steps"])
    schedule.drain()
    x, y = next(_hf_batches(padded, a, start=1000))
    eval_losses: list = []
    logits = schedule.eval(**(x if rank == 0 else {}), target=y if rank == n - 1 else None, losses=eval_losses)
    return {"losses": losses, "drift": dict(schedule.drift), "state": _state(part), "in_flight": schedule.in_flight,
            "fwd_cache": len(stage.fwd_cache), "eval_losses": eval_losses,
            "eval_shape": None if logits is None else tuple(logits.shape)}


_MESH = {}


def _dp_run(rank: int, world: int, sc: dict) -> dict:
    """pp × dp processes, rank g = d·pp + r ([Note: 2-D rank layout]): SchedulePACI on a DDP-wrapped or
    fully_shard-ed stage module, replica d reading the data ids k·dp + d (``replica_batch``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from unbubble.pipelining import SchedulePACI, clip_grad_norm_pp

    pp = sc["pp"]
    dp = world // pp
    replica, prank = divmod(rank, pp)
    if (dp, pp) not in _MESH:  # rows are pipelines, columns data-parallel groups (torchtitan's ["dp", "pp"])
        _MESH[dp, pp] = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    mesh = _MESH[dp, pp]
    a, m = sc["a"], sc["m"]
    job = _job("paci", pp, sc["steps"], a)
    module = job.stage_fn(prank)
    reductions: list[int] = []  # DDP: all-reduces per bucket, counted by a comm hook doing DDP's own reduction
    if sc["wrap"] == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(group, bucket):
            reductions.append(len(reductions))
            return allreduce_hook(group, bucket)

        part = DistributedDataParallel(module, process_group=mesh.get_group("dp"))
        part.register_comm_hook(mesh.get_group("dp"), counting_hook)
    else:
        part = fully_shard(module, mesh=mesh["dp"])
    opt = job.optimizer_fn(list(module.named_parameters()), prank)
    schedule = SchedulePACI(PipelineStage(part, prank, pp, torch.device("cpu"), group=mesh.get_group("pp")), m,
                            job.loss_fn, a=a)

    def batches():
        for b in itertools.count():
            mbs = [job.batch_fn((b * m + j) * dp + replica) for j in range(m)]
            yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])

    data, losses, per_step, norms = batches(), [], [], []
    for _ in range(sc["steps"]):
        opt.zero_grad()
        got: list = []
        before = len(reductions)
        schedule.step(data, losses=got)
        per_step.append(len(reductions) - before)
        # the pipeline's norm of the reduced gradients; max_norm = inf scales by exactly 1.0
        norms.append(float(clip_grad_norm_pp(module.parameters(), float("inf"), group=mesh.get_group("pp"))))
        opt.step()
        if got:
            losses.append(_mean(got))
    schedule.drain()
    x, y = _dp_eval_batch(job, m, dp, replica)
    eval_losses: list = []
    schedule.eval(*((x,) if prank == 0 else ()), target=y if prank == pp - 1 else None, losses=eval_losses)
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in module.state_dict().items()}
    return {"losses": losses, "drift": dict(schedule.drift), "state": state, "in_flight": schedule.in_flight,
            "reductions": per_step, "norms": norms, "eval_losses": eval_losses}


def _dp_eval_batch(job: PipelineJob, m: int, dp: int, replica: int):
    """Replica ``replica``'s evaluation batch: m micro-batches of data ids far past training."""
    mbs = [job.batch_fn((1000 * m + j) * dp + replica) for j in range(m)]
    return torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])


def _worker(rank: int, n: int, port: int, scenarios: list[dict], q) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        results = []
        for sc in scenarios:
            dist.barrier()
            results.append(_scenario(rank, n, sc))
        buf = io.BytesIO()
        torch.save(results, buf)  # bytes: shared-memory tensors would die with this process
        q.put((rank, buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        q.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _launch(n: int, scenarios: list[dict], timeout_s: float = 240.0) -> list[list[dict]]:
    """Runs ``scenarios`` one after the other on ``n`` gloo processes; returns ``[rank][scenario] -> result``."""
    return launch_gloo(_worker, n, scenarios, timeout_s)


# -- checks ---------------------------------------------------------------------------------------------

def _assert_equals_emulator(per_rank: list[dict], emu, what: str) -> None:
    n = len(per_rank)
    assert per_rank[n - 1]["losses"] == emu.step_losses, what
    hist = emu.trace.drift_histogram()
    for s, res in enumerate(per_rank):
        for name, want in emu.final_states[s].items():
            assert torch.equal(res["state"][name], want), f"{what}: stage {s} {name}"
        assert res["drift"] == hist[s], f"{what}: stage {s} drift"
        assert res["in_flight"] == 0 and res["fwd_cache"] == 0, f"{what}: stage {s} left work in flight"


PACI_2 = [{"kind": "paci", "a": 1, "steps": 6}, {"kind": "paci", "a": 2, "steps": 5},
          {"kind": "paci", "a": 4, "steps": 4}, {"kind": "paci", "a": 2, "m": 3, "steps": 5},
          {"kind": "paci", "a": 4, "m": 3, "steps": 4}]
PACI_4 = [{"kind": "paci", "a": 1, "steps": 8}, {"kind": "paci", "a": 2, "steps": 6},
          {"kind": "paci", "a": 4, "steps": 4}, {"kind": "paci", "a": 2, "m": 3, "steps": 5},
          {"kind": "paci", "a": 3, "m": 2, "steps": 4}]


EXTRA_2 = [{"kind": "paci", "a": 4, "steps": 3, "flush": True}, {"kind": "torch-1f1b", "a": 4, "steps": 3},
           {"kind": "resume", "a": 2, "m": 2, "steps": 6, "t1": 3},
           {"kind": "example", "steps": 5, "clip": "none"}, {"kind": "example", "steps": 4, "clip": "global"}]
TREE_2 = [{"kind": "hf", "a": 2, "steps": 4, "padded": True}, {"kind": "eval", "a": 2, "steps": 3}]
# (B, T) of each batch in turn: fixed; then shorter, longer, a smaller and a larger micro-batch size
MASK_FIXED, MASK_CHANGING = ((2, 8),), ((2, 8), (2, 4), (2, 12), (1, 12), (3, 6), (2, 8))
MASK_2 = [{"kind": "mask", "form": "iter", "a": 2, "steps": 5, "shapes": MASK_FIXED},
          {"kind": "mask", "form": "presplit", "a": 2, "steps": 4, "shapes": MASK_FIXED},
          {"kind": "mask", "form": "iter", "a": 2, "steps": 7, "shapes": MASK_CHANGING},
          {"kind": "mask", "form": "presplit", "a": 3, "steps": 6, "shapes": MASK_CHANGING}]
DCP_2 = [{"kind": "dcp", "a": 2, "steps": 6, "t1": 3}]
DP_4 = [{"kind": "dp", "wrap": "ddp", "pp": 2, "a": 2, "m": 3, "steps": 5},
        {"kind": "dp", "wrap": "fsdp", "pp": 2, "a": 2, "m": 3, "steps": 5}]


@pytest.fixture(scope="module")
def two_processes() -> list[list[dict]]:
    """One launch of 2 gloo processes for every N = 2 scenario (``[rank][scenario]``)."""
    return _launch(2, PACI_2 + EXTRA_2 + TREE_2 + MASK_2 + DCP_2)


@pytest.fixture(scope="module")
def four_processes() -> list[list[dict]]:
    """One launch of 4 gloo processes: N = 4 PACI, then pp = 2 × dp = 2 with DDP and FSDP2 stages."""
    return _launch(4, PACI_4 + DP_4)


def test_two_processes_paci_flush_resume_and_the_example_equal_the_emulator(two_processes):
    n = 2
    results = two_processes
    by = lambda i: [results[r][i] for r in range(n)]  # noqa: E731
    for i, sc in enumerate(PACI_2):
        emu = run_emulator(_job("paci", n, sc["steps"], sc["a"]))
        _assert_equals_emulator(by(i), emu, f"paci a={sc['a']} m={sc.get('m', sc['a'])}")
        assert emu.max_drift() == [-(-(n - 1 - s) // sc["a"]) for s in range(n)]  # the bound ⌈(N−i)/a⌉, attained
        assert by(i)[0]["in_flight_before"] == n - 1  # carried over at the end, then drained
    i = len(PACI_2)
    flushed, torch_1f1b, resume, example, clipped = (by(i + j) for j in range(5))
    emu_flush = run_emulator(_job("1f1b-flush", n, 3, 4))
    _assert_equals_emulator(flushed, emu_flush, "flush=True vs unbubble 1f1b-flush")
    assert all(r["in_flight_before"] == 0 for r in flushed)
    # torch's own Schedule1F1B: the same updates (its 1/m on the summed gradients is exact for m = 4)
    assert torch_1f1b[n - 1]["losses"] == emu_flush.step_losses
    for s in range(n):
        assert all(torch.equal(torch_1f1b[s]["state"][k], v) for k, v in emu_flush.final_states[s].items())
    # drain + checkpoint: the run drained at step 3 equals the emulator's run with a cut there, and the
    # fresh stages resumed from the checkpoint continue it bit for bit
    emu_cut = run_emulator(_job("paci", n, 6, 2), cuts=Cuts(mb_per_step=2, extra=(3,)))
    _assert_equals_emulator([r["whole"] for r in resume], emu_cut, "drained at step 3")
    assert emu_cut.step_losses != run_emulator(_job("paci", n, 6, 2)).step_losses  # the cut changes the run
    assert resume[0]["sched_state"]["next_micro_batch"] == 6 and resume[0]["sched_state"]["steps"] == 3
    assert resume[n - 1]["resumed"]["losses"] == emu_cut.step_losses[3:]
    for s in range(n):
        assert all(torch.equal(resume[s]["resumed"]["state"][k], v) for k, v in resume[s]["whole"]["state"].items())
    # the torchtitan-shaped example: without clipping it is the emulator's PACI on the example's own model
    ex = example_module()
    cfg = ex.Config(steps=5, clip="none", log=False)
    job = PipelineJob(stage_fn=lambda s: split_torchtitan_model(ex.build_model(cfg), s, n), loss_fn=ex.cross_entropy,
                      batch_fn=functools.partial(ex.micro_batch, cfg),
                      optimizer_fn=lambda params, s: torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                                                                       weight_decay=0.1),
                      schedule=get_schedule("paci", n, cfg.steps, a=cfg.n_microbatches),
                      lr_lambda=functools.partial(ex.lr_lambda, cfg))
    emu_ex = run_emulator(job)
    # the example logs torchtitan's float32 mean of a step's losses, the emulator a float64 mean: the
    # micro-batch losses are the same, their means differ in the last bits; the weights are bit-equal
    assert example[n - 1]["losses"] == pytest.approx(emu_ex.step_losses, rel=1e-6, abs=0)
    assert len(emu_ex.step_losses) == 5
    for s in range(n):
        assert all(torch.equal(example[s]["state"][k], v) for k, v in emu_ex.final_states[s].items())
        assert example[s]["steps"] == 5
    # with torchtitan's global clip (max norm 1.0): every rank clipped by the same norm; the loss falls
    losses = clipped[n - 1]["losses"]
    assert len(losses) == 4 and all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]
    assert clipped[n - 1]["losses"][0] == example[n - 1]["losses"][0]  # the first forward precedes any update


def test_four_processes_paci_equals_the_emulator_bit_for_bit(four_processes):
    n = 4
    results = four_processes
    for i, sc in enumerate(PACI_4):
        emu = run_emulator(_job("paci", n, sc["steps"], sc["a"]))
        _assert_equals_emulator([results[r][i] for r in range(n)], emu, f"paci a={sc['a']} m={sc.get('m', sc['a'])}")
        assert emu.max_drift() == [-(-(n - 1 - s) // sc["a"]) for s in range(n)]
        assert [results[r][i]["in_flight_before"] for r in range(n)] == [n - 1 - s for s in range(n)]


def _chained(stages: list, x, y: torch.Tensor, m: int, loss_fn) -> list[torch.Tensor]:
    """Independent reference for eval(): each of m micro-batches through the stage modules in turn, no pipeline."""
    from unbubble.pipelining import _chunk

    out = []
    with torch.no_grad():
        for xj, yj in zip(_chunk(x, m, "x"), _chunk(y, m, "y")):
            h = xj
            for module in stages:
                h = module(h)
            out.append(loss_fn(h, yj))
    return out


def test_two_processes_hf_llama_in_tree_stages_and_eval_equal_the_emulator(two_processes):
    """``split_model``'s HF Llama stages (dict boundaries: hidden states, a padding mask, position ids) in
    ``TreeStage``, built by the torchtitan drop-in ``build_pipeline_schedule`` with a ``(loss, metrics)`` loss:
    losses, weights and drift equal the emulator's PACI on the same split, bit for bit. ``eval()`` after
    ``drain()``: its losses equal the final weights' stages chained by hand on the same batch, bit for bit."""
    from unbubble.models.split import causal_lm_loss, split_model
    from helpers import HF_SEQ, HF_VOCAB, hf_job, tiny_hf_llama

    n, first = 2, len(PACI_2) + len(EXTRA_2)
    hf, plain = ([two_processes[r][first + j] for r in range(n)] for j in range(2))
    sc = TREE_2[0]
    emu = run_emulator(hf_job(tiny_hf_llama(), "paci", n, padded=sc["padded"], steps=sc["steps"], m=sc["a"]))
    _assert_equals_emulator(hf, emu, "HF Llama in TreeStage")
    assert len(emu.step_losses) == sc["steps"] and emu.max_drift() == [1, 0]
    split = split_model(tiny_hf_llama(), n)
    stages = [split(s) for s in range(n)]
    for s, module in enumerate(stages):
        module.load_state_dict(emu.final_states[s])
    x, y = next(_hf_batches(sc["padded"], sc["a"], start=1000))
    want = _chained(stages, x, y, sc["a"], causal_lm_loss)
    assert len(hf[n - 1]["eval_losses"]) == sc["a"]
    assert all(torch.equal(g, w) for g, w in zip(hf[n - 1]["eval_losses"], want))
    assert hf[n - 1]["eval_shape"] == (2 * sc["a"], HF_SEQ, HF_VOCAB) and hf[0]["eval_losses"] == []
    # the same for a tensor boundary (tiny GPT), the eval continuing no run
    sc = TREE_2[1]
    job = _job("paci", n, sc["steps"], sc["a"])
    emu = run_emulator(job)
    _assert_equals_emulator(plain, emu, "paci before eval")
    stages = [job.stage_fn(s) for s in range(n)]
    for s, module in enumerate(stages):
        module.load_state_dict(emu.final_states[s])
    x, y = next(_batches(job, sc["a"], start=1000))
    want = _chained(stages, x, y, sc["a"], job.loss_fn)
    assert all(torch.equal(g, w) for g, w in zip(plain[n - 1]["eval_losses"], want)) and len(want) == sc["a"]
    assert plain[n - 1]["eval_shape"] == (2 * sc["a"], 16, 64) and plain[0]["eval_shape"] is None  # merged logits


def test_pp2_dp2_ddp_and_fsdp_stages_equal_unbubbles_own_dp_run_bit_for_bit(four_processes):
    """4 gloo processes, pp = 2 × dp = 2 (rank d·2 + r): SchedulePACI with each stage module wrapped in
    DistributedDataParallel, then sharded by fully_shard (FSDP2), over its column of the ["dp", "pp"] mesh, replica d
    reading data ids k·2 + d; unbubble's own PACI with ``job.dp = 2`` (the process engine, GradientAverager at each U)
    is the reference: the replicas' mean step loss, every replica's final weights and each stage's drift histogram
    equal it bit for bit, so gradients were reduced exactly once per update, over all a micro-batches (DDP: one
    all-reduce per step, counted); ``eval()`` after ``drain()`` equals the reference's weights chained by hand."""
    from unbubble.runtime.launch import run_processes

    sc = DP_4[0]
    job = _job("paci", sc["pp"], sc["steps"], sc["a"])
    job.dp = 2
    ref = run_processes(job)
    hist = ref.trace.drift_histogram()
    assert len(ref.step_losses) == sc["steps"]
    stages = [job.stage_fn(s) for s in range(sc["pp"])]
    for s, module in enumerate(stages):
        module.load_state_dict(ref.final_states[s])
    norms = {}
    for i, sc in enumerate(DP_4, start=len(PACI_4)):
        per = [four_processes[g][i] for g in range(4)]
        last = [per[d * 2 + 1]["losses"] for d in range(2)]
        assert last[0] != last[1], "the replicas read the same data"
        assert [(x0 + x1) / 2 for x0, x1 in zip(*last)] == ref.step_losses, sc["wrap"]
        assert len({tuple(res["norms"]) for res in per}) == 1, f"{sc['wrap']}: ranks clipped by different norms"
        for d in range(2):  # eval() after drain(): each replica's batch through the final weights, chained by hand
            x, y = _dp_eval_batch(job, sc["m"], 2, d)
            want = _chained(stages, x, y, sc["m"], job.loss_fn)
            got = per[d * 2 + 1]["eval_losses"]
            assert len(got) == sc["m"] and all(torch.equal(g, w) for g, w in zip(got, want)), f"{sc['wrap']} eval"
        norms[sc["wrap"]] = per[0]["norms"]
        for g, res in enumerate(per):
            for name, want in ref.final_states[g % 2].items():
                assert torch.equal(res["state"][name], want), f"{sc['wrap']}: rank {g} {name}"
            assert res["drift"] == hist[g % 2] and res["in_flight"] == 0, f"{sc['wrap']}: rank {g}"
            if sc["wrap"] == "ddp":  # the tiny stage is one bucket: one all-reduce per update, in the a-th backward
                assert res["reductions"] == [1] * sc["steps"], f"rank {g}: all-reduces per step {res['reductions']}"
    # clip_grad_norm_pp over the pipeline sees the same update under both: FSDP2's norm is gathered from shards
    # (another summation order, hence approx)
    assert norms["fsdp"] == pytest.approx(norms["ddp"], rel=1e-6) and all(x > 0 for x in norms["ddp"])


def _max_diff(per_rank: list[dict], emu) -> float:
    return max((per_rank[s]["state"][k] - v).abs().max().item() for s in range(len(per_rank))
               for k, v in emu.final_states[s].items())


def test_two_processes_per_micro_batch_masks_and_changing_shapes_equal_the_emulator(two_processes):
    """A model that needs its mask (MaskedBlock: masked self-attention, a block-diagonal causal mask per
    micro-batch) on 2 gloo processes, the mask a per-micro-batch keyword input of every stage's module.
    Through an iterator of MicroBatches: PACI, bit for bit the emulator's PACI, where the mask crosses the
    stage boundary inside the activation (CarryMask). Through torch's pre-split step(arg_mbs=, kwarg_mbs=,
    target_mbs=): with a = m every call ends drained, bit for bit the emulator's 1F1B-flush. Batches whose
    sequence length gets shorter (8 → 4), longer (4 → 12, 6 → 8), and whose micro-batch size gets smaller
    (2 → 1) and larger (1 → 3), with micro-batches of the old shape in flight across the change: the same,
    bit for bit (max weight difference 0), in both forms."""
    n, first = 2, len(PACI_2) + len(EXTRA_2) + len(TREE_2)
    for i, sc in enumerate(MASK_2):
        got = [two_processes[r][first + i] for r in range(n)]
        name = "paci" if sc["form"] == "iter" else "1f1b-flush"
        emu = run_emulator(_mask_job(name, n, sc["steps"], sc["a"], sc["shapes"]))
        what = f"{sc['form']} a={sc['a']} shapes={sc['shapes']}"
        assert _max_diff(got, emu) == 0.0, what
        _assert_equals_emulator(got, emu, what)
        assert got[0]["in_flight_before"] == (1 if sc["form"] == "iter" else 0), what  # PACI's read-ahead, or none


def test_two_processes_paci_checkpointed_with_dcp_after_drain_continues_as_the_drained_run(two_processes):
    """torchtitan's checkpointing: PACI for 3 steps on 2 gloo ranks, ``drain()``, then torch.distributed.checkpoint
    (``get_state_dict`` of the stage and its AdamW, ``dcp.save``, and the schedule's ``state_dict()``); fresh stages
    and optimizers ``dcp.load`` it (``set_state_dict``) and run 3 more steps. They continue the uninterrupted run
    drained after step 3 bit for bit: losses and weights, and its drift histogram from the checkpoint on."""
    n, i = 2, len(PACI_2) + len(EXTRA_2) + len(TREE_2) + len(MASK_2)
    per_rank = [two_processes[r][i] for r in range(n)]
    whole, resumed = per_rank[n - 1]["whole"], per_rank[n - 1]["resumed"]
    assert resumed["losses"] == whole["losses"][3:] and len(resumed["losses"]) == 3
    for r in range(n):
        w, got = per_rank[r]["whole"], per_rank[r]["resumed"]
        assert all(torch.equal(got["state"][k], v) for k, v in w["state"].items()), f"rank {r}"
        assert got["drift"] == w["drift"] and got["in_flight"] == 0, f"rank {r}"
        assert per_rank[r]["sched_state"]["steps"] == 3
