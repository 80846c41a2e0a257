"""``unbubble.pipelining.SchedulePACI`` on real gloo processes (torch's ``PipelineStage`` and P2P, no unbubble
launcher) against unbubble's single-process emulator on the same stage modules and micro-batches.

Starting N processes costs ≈ 7 s on 2 cores, so every scenario of one N runs in one launch (N = 2, then
N = 4); each result is checked against an independent reference: the emulator's PACI (losses, weights and
per-stage drift histogram, bit for bit), its 1F1B-flush, its run with a checkpoint cut, and for the
example its PACI on the example's own model.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import itertools
import queue
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from unbubble.pipelining import split_torchtitan_model
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from unbubble.schedules.policy import Cuts
from unbubble.testing import tiny_gpt_job

pytestmark = pytest.mark.multiproc
torch.set_num_threads(1)  # as in each process, so the emulator's arithmetic matches bit for bit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_pipelining_paci.py"


def _example():
    """``examples/torch_pipelining_paci.py`` as a module (registered first: its dataclass looks itself up)."""
    if "torch_pipelining_paci" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torch_pipelining_paci", EXAMPLE)
        mod = sys.modules["torch_pipelining_paci"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["torch_pipelining_paci"]


def _job(name: str, n: int, steps: int, a: int) -> PipelineJob:
    return tiny_gpt_job(get_schedule(name, n, steps, **({"m": a} if name == "1f1b-flush" else {"a": a})))


def _batches(job: PipelineJob, m: int, start: int = 0):
    """Endless ``(inputs, targets)`` batches of m of the job's micro-batches (ids b·m … b·m + m − 1)."""
    for b in itertools.count(start):
        mbs = [job.batch_fn(b * m + j) for j in range(m)]
        yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])


def _mean(losses: list[torch.Tensor]) -> float:
    values = torch.stack(losses).tolist()  # as the executor reduces a step's losses
    return sum(values) / len(values)


# -- what each process runs -----------------------------------------------------------------------------

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
    data, losses = _batches(job, m, start), []
    for t in range(sc["steps"] if steps is None else steps):
        opt.zero_grad()
        got: list = []
        schedule.step(data, losses=got)
        opt.step()
        if got:
            losses.append(_mean(got))
        if t + 1 == sc.get("drain_at"):
            schedule.drain()
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
        ex = _example()
        return ex.train(ex.Config(steps=sc["steps"], a=sc.get("a"), clip=sc["clip"], log=False))
    raise ValueError(kind)


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
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, port, scenarios, q)) for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n:
            try:
                rank, payload = q.get(timeout=1.0)
            except queue.Empty:
                assert time.monotonic() < deadline, "the gloo processes hung"
                assert all(p.exitcode in (None, 0) for p in procs), f"exit codes {[p.exitcode for p in procs]}"
                continue
            assert not isinstance(payload, str), f"rank {rank} failed: {payload}"
            out[rank] = torch.load(io.BytesIO(payload))
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(n)]


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


def test_two_processes_paci_flush_resume_and_the_example_equal_the_emulator():
    n = 2
    extra = [{"kind": "paci", "a": 4, "steps": 3, "flush": True}, {"kind": "torch-1f1b", "a": 4, "steps": 3},
             {"kind": "resume", "a": 2, "m": 2, "steps": 6, "t1": 3},
             {"kind": "example", "steps": 5, "clip": "none"}, {"kind": "example", "steps": 4, "clip": "global"}]
    results = _launch(n, PACI_2 + extra)
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
    ex = _example()
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


def test_four_processes_paci_equals_the_emulator_bit_for_bit():
    n = 4
    results = _launch(n, PACI_4)
    for i, sc in enumerate(PACI_4):
        emu = run_emulator(_job("paci", n, sc["steps"], sc["a"]))
        _assert_equals_emulator([results[r][i] for r in range(n)], emu, f"paci a={sc['a']} m={sc.get('m', sc['a'])}")
        assert emu.max_drift() == [-(-(n - 1 - s) // sc["a"]) for s in range(n)]
        assert [results[r][i]["in_flight_before"] for r in range(n)] == [n - 1 - s for s in range(n)]
