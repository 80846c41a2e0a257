"""Runtime throughput against torch.distributed.pipelining, and the runtime against the simulator.

What is measured (``unbubble bench``, or ``python benchmarks/bench_runtime.py``):

1. **Same model, same micro-batches, same processes.** N = 2 gloo processes (``--stages``) are spawned once and run,
   one after the other and in a rotating order each repeat: our ``1f1b-flush``, ``gpipe``, ``paci``
   (a = m, in its default deterministic order) and ``paci dynamic`` (the same schedule in the
   arrival-driven order, ``--order dynamic``) against ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B``. The model is
   the tiny GPT-2 preset (4 layers, d = 128, byte vocabulary 257) cut into N cost-balanced stages, AdamW,
   random tokens; micro-batch k is the same tensor for every system (torch gets step t's m micro-batches
   concatenated and splits them back along dim 0). Every system runs ``--steps`` optimizer steps of m
   micro-batches after an untimed warm-up run in the same processes. Reported per system: tokens/s
   (median over ``--repeats``), per-stage utilization, and the ratios to torch's schedules (median of the
   per-repeat ratios, so systems timed close together are compared).

   Timed region: ours from the start shared by all ranks (after building the stages and agreeing on
   shapes) to the last rank's last action; torch from a barrier after its first (shape-inferring) step
   to a barrier after the last step. Utilization = busy / wall, busy = wall time inside compute: ours
   the actions F, B, U; torch ``forward_one_chunk``, the loss, ``backward_one_chunk``, the gradient
   scaling and the optimizer step (its P2P waits are outside).

   **Compiled stages** (``compile``, on by default): ``1f1b-flush`` and ``paci`` run a second time with
   every stage under ``torch.compile`` (``compile_backend``, inductor; the loss eager), in the same
   rotation, so "compiled / eager" is the median of per-repeat ratios as above. Compilation happens in
   the untimed warm-up run; the compile time reported is that run's wall time minus the eager
   warm-up's (same 2 steps), with the graphs each stage compiled there (the compiled ``paci`` reuses
   the graphs the compiled flush built for the same stages, so its compile time is ≈ 0).

   **PACI on torch's PipelineStage** (``torch_stage``, on by default): ``unbubble.pipelining.SchedulePACI``
   (a = m) over torch's own ``PipelineStage``, the loop written as torchtitan's, against our ``paci``.

   **Gradient clipping** (``clip``, on by default; issue 34): max norm 1.0 (torchtitan's, Megatron's and
   nanoGPT's default) on our ``paci`` with each ``--clip-scope`` (``sync``: the exact global norm, a
   barrier per update; ``stale``: the global norm of update t − ⌈N/a⌉, no wait; ``stage``: each stage's
   own norm), on our ``1f1b-flush`` with ``sync``, and on the PipelineStage row with
   ``unbubble.runtime.clipping.PipelineClip`` ``sync`` and ``stale`` (in a process group of its own).
   Each is reported ÷ the same system without clipping (median of per-repeat ratios; the systems sit
   next to each other in the rotation, :func:`model_systems`), with the ms per step inside our ``U``
   actions (the optimizer step; with a clip also the norms and any wait for the global norm) and
   inside ``PipelineClip``.

2. **Synthetic stages, N = 8.** Each stage's forward takes F and its backward B (a one-scalar stage,
   tiny messages) by a calibrated sleep: ``time.sleep`` until the measured wake-up overshoot of this
   process (90th percentile, ≥ 0.5 ms) before the deadline, then a spin, so F and B are what the
   simulator is given:
   ``run_policies(schedule, UniformCosts(F, B, u=0))`` predicts the makespan of ``1f1b-flush`` (m = 8) and
   ``paci`` (a = 8); the runtime's makespan (median over repeats) is compared with it. A second
   prediction from the run's own measured action durations (``sim.measured.measured_costs``) separates
   the runtime's scheduling and messaging overhead from sleep inaccuracy. ``paci`` runs in both orders
   here too (deterministic and ``paci dynamic``).

The cost of reproducibility is the ratio ``paci / paci dynamic`` (tokens/s in part 1, makespan in
part 2): the deterministic order waits for the message its order names where the dynamic one runs
whatever arrived first ([Note: deterministic order] in ``unbubble/schedules/policy.py``).

Targets, reported, never asserted: our flush ≥ 0.95 × torch's 1F1B; PACI ≥ 0.95 × (m+N−1)/m × torch's
1F1B at equal micro-batches; synthetic N = 8 makespan within 5 % of the simulator (issue 7); PACI +
``stale`` ≥ 0.97 × PACI without clipping; PACI on torch's PipelineStage ≥ 0.95 × our PACI (issue 34).

Usage::

    unbubble bench                       # ≈ 6 min on 2 idle CPU cores (estimated; 11 min 49 s at load 7)
    unbubble bench --no-clip             # without the 6 clipped rows of the 15 in part 1 (≈ 4 min idle)
    python benchmarks/bench_runtime.py --only model --no-compile --repeats 12 --systems \
        "unbubble paci,unbubble paci + clip stale"   # one pair, many alternating repeats
    unbubble bench --quick               # 1 repeat, fewer steps (a smoke run, ≈ 1 min)
    unbubble bench --out bench.json      # also write the JSON
    unbubble bench --only model --stages 4   # the model comparison at N = 4 (unbubble train's default)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import queue
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unbubble.models import gpt_loss, make_config
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.worker import run_stage
from unbubble.schedules import get_schedule
from unbubble.schedules.actions import Action
from unbubble.sim import UniformCosts, run_policies
from unbubble.sim.engine import ActionRecord, Trace
from unbubble.sim.measured import measured_costs
from unbubble.testing import random_tokens
from unbubble.train import gpt_stage

OURS = ("1f1b-flush", "gpipe", "paci", "paci dynamic")  #: "<schedule>[ <order>]"; the default order: deterministic
#: our schedules with a gradient-norm clip (max norm 1.0) of each scope ([Note: clip scopes] in docs/architecture.md)
OURS_CLIP = ("paci + clip stale", "paci + clip sync", "paci + clip stage", "1f1b-flush + clip sync")
CLIP_SUFFIX = " + clip "


def _variant(name: str) -> tuple[str, str, str | None]:
    """``"paci dynamic"`` → ``("paci", "dynamic", None)``; ``"paci + clip stale"`` → ``("paci",
    "deterministic", "stale")``; a bare schedule name runs in the default order without clipping."""
    name, _, clip = name.partition(CLIP_SUFFIX)
    schedule, _, order = name.partition(" ")
    return schedule, order or "deterministic", clip or None
#: our schedules also timed with every stage under torch.compile (``--compile``)
COMPILED = ("1f1b-flush", "paci")
TORCH = ("ScheduleGPipe", "Schedule1F1B")
#: unbubble.pipelining.SchedulePACI on torch's PipelineStage (a = m), without clipping and with
#: unbubble.runtime.clipping.PipelineClip (max norm 1.0) of scope sync (blocking) and stale (s = ⌈N/a⌉)
TORCH_STAGE = ("PipelineStage", "PipelineStage + clip sync", "PipelineStage + clip stale")
TORCH_STAGE_ENGINE = "paci on torch"  #: rows "paci on torch PipelineStage[ + clip sync|stale]"
#: the rows --no-clip leaves out
CLIPPED = tuple(f"unbubble {s}" for s in OURS_CLIP) + tuple(f"{TORCH_STAGE_ENGINE} {s}" for s in TORCH_STAGE[1:])


@dataclass
class BenchConfig:
    """Sizes of both parts (defaults: ≈ 6 min on 2 idle CPU cores, estimated)."""

    n: int = 2  #: pipeline stages (processes) of the model comparison
    m: int = 4  #: micro-batches per step (PACI: a = m)
    steps: int = 12  #: optimizer steps per timed run
    repeats: int = 4
    micro_batch_size: int = 8
    seq_len: int = 128
    model: str = "tiny"
    vocab_size: int = 257
    lr: float = 1e-3
    threads: int = 1  #: torch threads per process
    sleep_n: int = 8  #: synthetic stages
    sleep_f: float = 0.05  #: synthetic forward (s)
    sleep_b: float = 0.10  #: synthetic backward (s)
    sleep_m: int = 8  #: synthetic micro-batches per step (PACI: a)
    sleep_steps: int = 3
    compile: bool = True  #: also time COMPILED with torch.compile'd stages
    compile_backend: str = "inductor"
    torch_stage: bool = True  #: also time TORCH_STAGE (unbubble.pipelining over torch's PipelineStage)
    clip: bool = True  #: also time the clipped rows (OURS_CLIP, and TORCH_STAGE's clipped ones)
    #: only these rows of part 1 ("unbubble paci", "paci on torch PipelineStage + clip stale", …; empty: all),
    #: e.g. a pair timed alternately over many repeats on a loaded machine
    systems: tuple[str, ...] = ()
    parts: tuple[str, ...] = field(default=("model", "synthetic"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world: int, cfg: BenchConfig, timeout_s: float = 900.0) -> list:
    """Runs ``target(rank, world, cfg, port, q)`` in ``world`` processes; returns rank-ordered results."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, cfg, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, payload = q.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(f"a benchmark process failed (exit codes {[p.exitcode for p in procs]})")
                continue
            if isinstance(payload, str):
                raise RuntimeError(f"benchmark rank {rank} failed: {payload}")
            out[rank] = payload
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world)]


def _init(rank: int, world: int, port: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))


def _run_ours(job: PipelineJob, rank: int) -> dict:
    """One run of our runtime on this rank: wall from the shared start, busy time of the actions, and
    the time inside its ``U`` actions (the optimizer step; with a clip also the norms and the wait for
    the global norm)."""
    msgs: list[tuple] = []
    run_stage(job, rank, msgs.append)
    records = [r for kind, _, recs in msgs if kind == "records" for r in recs]
    wall = next(p[1] for kind, _, p in msgs if kind == "final")
    return {"wall_s": wall, "busy_s": sum(end - start for _, start, end, _, _ in records),
            "update_s": sum(end - start for a, start, end, _, _ in records if "U" in a), "records": records}


# -- part 1: our schedules against torch.distributed.pipelining ------------------------------------

def _adamw(lr: float, params, stage: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def _model_job(cfg: BenchConfig, name: str, steps: int, compiled: bool = False) -> PipelineJob:
    model = make_config(cfg.model, cfg.vocab_size)
    name, order, clip = _variant(name)
    kw = {"a": cfg.m} if name == "paci" else {"m": cfg.m}
    return PipelineJob(
        stage_fn=functools.partial(gpt_stage, model, cfg.n, 0, cfg.seq_len),
        loss_fn=gpt_loss,
        batch_fn=functools.partial(random_tokens, cfg.vocab_size, cfg.micro_batch_size, cfg.seq_len, 0),
        optimizer_fn=functools.partial(_adamw, cfg.lr),
        schedule=get_schedule(name, cfg.n, steps, **kw),
        tokens_per_mb=cfg.micro_batch_size * cfg.seq_len,
        nan_policy="off",  # torch's schedules do no non-finite checks: the same work on both sides
        order=order,
        compile_backend=cfg.compile_backend if compiled else None,
        clip_grad_norm=1.0 if clip else None,  # torchtitan's, Megatron's and nanoGPT's default max norm
        clip_scope=clip or "sync",
    )


def _timed(busy: list[float], fn):
    """``fn`` wrapped to add its wall time to ``busy[0]`` (torch's compute calls, timed as our actions are)."""
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - t
    return call


def _run_torch(cfg: BenchConfig, name: str, rank: int, steps: int) -> dict:
    """``steps`` optimizer steps of torch.distributed.pipelining's ``name`` on this rank."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    job = _model_job(cfg, "1f1b-flush", steps)
    module = job.stage_fn(rank)
    stage = PipelineStage(module, rank, cfg.n, torch.device("cpu"))
    cls = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}[name]
    schedule = cls(stage, n_microbatches=cfg.m, loss_fn=gpt_loss)  # scale_grads: mean over micro-batches
    opt = job.optimizer_fn(list(module.parameters()), rank)

    def step(t: int) -> None:
        mbs = [job.batch_fn(t * cfg.m + j) for j in range(cfg.m)]  # the same micro-batches as ours
        if rank == 0:
            schedule.step(torch.cat([x for x, _ in mbs]), return_outputs=False)
        elif rank == cfg.n - 1:
            schedule.step(target=torch.cat([y for _, y in mbs]), return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)  # shape inference (untimed)
    busy = [0.0]  # wall time inside compute, as our actions are timed
    timed = functools.partial(_timed, busy)
    stage.forward_one_chunk = timed(stage.forward_one_chunk)
    stage.backward_one_chunk = timed(stage.backward_one_chunk)
    stage.perform_reduce_grad = timed(stage.perform_reduce_grad)
    schedule._maybe_compute_loss = timed(schedule._maybe_compute_loss)
    opt.step = timed(opt.step)
    dist.barrier()
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        step(t)
    busy = busy[0]
    dist.barrier()
    return {"wall_s": time.perf_counter() - t0, "busy_s": busy}


def _run_torch_stage_paci(cfg: BenchConfig, rank: int, steps: int, clip: str | None, clip_group=None) -> dict:
    """``steps`` PACI updates of ``unbubble.pipelining.SchedulePACI`` (a = m) over torch's ``PipelineStage`` on
    this rank, the loop written as torchtitan's; ``clip``: ``"sync"`` or ``"stale"``, a
    :class:`~unbubble.runtime.clipping.PipelineClip` of that scope (max norm 1.0, s = ⌈N/a⌉ under ``stale``;
    over ``clip_group``, the pipeline's ranks in a group of their own) between ``step()`` and
    ``optimizer.step()``, which is skipped when the norm is non-finite, as the class's docstring says."""
    import itertools

    from torch.distributed.pipelining import PipelineStage

    from unbubble.pipelining import SchedulePACI
    from unbubble.runtime.clipping import PipelineClip

    job = _model_job(cfg, "paci", steps)
    module = job.stage_fn(rank)
    stage = PipelineStage(module, rank, cfg.n, torch.device("cpu"))
    schedule = SchedulePACI(stage, cfg.m, gpt_loss)
    opt = job.optimizer_fn(list(module.parameters()), rank)
    clipper = PipelineClip(1.0, clip, a=cfg.m, group=clip_group) if clip else None

    def batches():  # step t's m micro-batches, the same tensors as every other system's
        for t in itertools.count():
            mbs = [job.batch_fn(t * cfg.m + j) for j in range(cfg.m)]
            yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])

    data = batches()
    clip_s = [0.0]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        schedule.step(data)
        if clipper is not None:
            t = time.perf_counter()
            norm = clipper(module.parameters())
            clip_s[0] += time.perf_counter() - t
            if not torch.isfinite(norm):
                return
        opt.step()

    step()  # shape inference and the first fill (untimed), as torch's rows
    busy = [0.0]
    timed = functools.partial(_timed, busy)
    stage.forward_one_chunk = timed(stage.forward_one_chunk)
    schedule._user_loss = timed(schedule._user_loss)  # the last stage's loss, outside forward_one_chunk
    stage.backward_one_chunk = timed(stage.backward_one_chunk)
    opt.step = timed(opt.step)
    clip_s[0] = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    schedule.drain()
    if clipper is not None:
        clipper.drain()  # stale: the last s updates' all-gathers
    busy = busy[0]
    dist.barrier()
    return {"wall_s": time.perf_counter() - t0, "busy_s": busy, "clip_s": clip_s[0]}


def model_systems(cfg: BenchConfig) -> list[tuple[str, str]]:
    """``(engine, name)`` of every system of part 1, in the order of the first repeat (each later repeat
    rotates it by one). Systems whose ratio is reported sit next to each other, so that they are timed
    close together whatever the rotation: each clipped row beside its unclipped one, and torch's
    PipelineStage rows next to our ``paci``."""
    clip = cfg.clip
    ours = ["1f1b-flush"] + (["1f1b-flush + clip sync"] if clip else []) + ["gpipe", "paci dynamic"]
    stage = [s for s in TORCH_STAGE[1:] if clip] + [TORCH_STAGE[0]] if cfg.torch_stage else []
    paci = ["paci"] + ([s for s in OURS_CLIP if s.startswith("paci")] if clip else [])  # stale (the target) next
    out = ([("unbubble", s) for s in ours] + [("unbubble", f"{s} compiled") for s in COMPILED if cfg.compile]
           + [("torch", s) for s in TORCH] + [(TORCH_STAGE_ENGINE, s) for s in stage]
           + [("unbubble", s) for s in paci])
    if cfg.systems:
        names = [f"{e} {n}" for e, n in out]
        unknown = [s for s in cfg.systems if s not in names]
        if unknown:
            raise ValueError(f"unknown systems {unknown}: choose among {names}")
        out = [(e, n) for e, n in out if f"{e} {n}" in cfg.systems]
    return out


def _model_worker(rank: int, world: int, cfg: BenchConfig, port: int, q) -> None:
    try:
        from unbubble.runtime.compiled import compile_stats

        _init(rank, world, port, cfg.threads)
        systems = model_systems(cfg)
        # PipelineClip's collectives in a group of their own, apart from the schedule's sends (created once)
        clip_group = dist.new_group(list(range(world))) \
            if any(e == TORCH_STAGE_ENGINE and CLIP_SUFFIX in n for e, n in systems) else None
        results = []
        for rep in range(-1, cfg.repeats):  # rep −1: warm-up of every system in these processes (compiles)
            steps = cfg.steps if rep >= 0 else 2
            shift = max(rep, 0) % len(systems)
            for engine, name in systems[shift:] + systems[:shift]:
                dist.barrier()
                if engine == "unbubble":
                    graphs = compile_stats()["frames"]
                    variant = name.removesuffix(" compiled")  # "paci dynamic compiled" → "paci dynamic"
                    res = _run_ours(_model_job(cfg, variant, steps, compiled=variant != name), rank)
                    res.pop("records")
                    res["graphs_compiled"] = compile_stats()["frames"] - graphs
                elif engine == TORCH_STAGE_ENGINE:
                    res = _run_torch_stage_paci(cfg, rank, steps, _variant(name)[2], clip_group)
                else:
                    res = _run_torch(cfg, name, rank, steps)
                results.append({"repeat": rep, "engine": engine, "schedule": name, **res})
        dist.destroy_process_group()
        q.put((rank, results))
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
        q.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def bench_model(cfg: BenchConfig) -> dict:
    """Part 1: tokens/s, utilization and ratios of our schedules against torch's (N = cfg.n processes)."""
    per_rank = _spawn(_model_worker, cfg.n, cfg)
    tokens = cfg.steps * cfg.m * cfg.micro_batch_size * cfg.seq_len
    runs: dict[str, list[dict]] = {}
    warmup: dict[str, dict] = {}  # system -> the untimed first run (2 steps): wall and graphs compiled
    for i, row in enumerate(per_rank[0]):
        walls = [per_rank[r][i]["wall_s"] for r in range(cfg.n)]
        wall = max(walls)
        if row["repeat"] < 0:
            warmup[f"{row['engine']} {row['schedule']}"] = {
                "wall_s": wall, "graphs_compiled": [per_rank[r][i].get("graphs_compiled", 0) for r in range(cfg.n)]}
            continue
        runs.setdefault(f"{row['engine']} {row['schedule']}", []).append({
            "repeat": row["repeat"], "wall_s": wall, "tokens_per_s": tokens / wall,
            "utilization": [per_rank[r][i]["busy_s"] / wall for r in range(cfg.n)],
            "busy_ms_per_mb": [1e3 * per_rank[r][i]["busy_s"] / (cfg.steps * cfg.m) for r in range(cfg.n)],
            **({"clip_ms_per_step": [1e3 * per_rank[r][i]["clip_s"] / cfg.steps for r in range(cfg.n)]}
               if "clip_s" in per_rank[0][i] else {}),
            **({"update_ms_per_step": [1e3 * per_rank[r][i]["update_s"] / cfg.steps for r in range(cfg.n)]}
               if "update_s" in per_rank[0][i] else {}),
        })
    systems = {}
    for name, rs in runs.items():
        systems[name] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "utilization": [statistics.median(r["utilization"][s] for r in rs) for s in range(cfg.n)],
            "busy_ms_per_mb": [statistics.median(r["busy_ms_per_mb"][s] for r in rs) for s in range(cfg.n)],
            **({key: [statistics.median(r[key][s] for r in rs) for s in range(cfg.n)]
                for key in ("clip_ms_per_step", "update_ms_per_step") if key in rs[0]}),
            "runs": rs,
        }

    def ratio(a: str, b: str) -> float:
        by_rep = {r["repeat"]: r["tokens_per_s"] for r in runs[b]}
        return statistics.median(r["tokens_per_s"] / by_rep[r["repeat"]] for r in runs[a])

    bubble = (cfg.m + cfg.n - 1) / cfg.m
    ts = f"{TORCH_STAGE_ENGINE} {TORCH_STAGE[0]}"
    pairs = [  # (ratio, numerator, denominator); those whose systems did not run (cfg.systems, flags) are left out
        ("flush / torch 1F1B", "unbubble 1f1b-flush", "torch Schedule1F1B"),
        ("gpipe / torch GPipe", "unbubble gpipe", "torch ScheduleGPipe"),
        ("paci / torch 1F1B", "unbubble paci", "torch Schedule1F1B"),
        ("paci / flush", "unbubble paci", "unbubble 1f1b-flush"),
        ("paci deterministic / dynamic order", "unbubble paci", "unbubble paci dynamic"),
        ("torch 1F1B / torch GPipe", "torch Schedule1F1B", "torch ScheduleGPipe"),
    ]
    # each clip scope against the same schedule without clipping, timed in the same repeat
    pairs += [(f"{name} / {_variant(name)[0]}", f"unbubble {name}", f"unbubble {_variant(name)[0]}")
              for name in OURS_CLIP]
    # what a user who needs global clipping decides by: PACI on each scope against the exact clip on 1F1B-flush
    pairs += [(f"paci + clip {scope} / 1f1b-flush + clip sync", f"unbubble paci + clip {scope}",
               "unbubble 1f1b-flush + clip sync") for scope in ("sync", "stale")]
    # unbubble.pipelining: PACI over torch's PipelineStage, beside our runtime's and torch's 1F1B, and clipped
    pairs += [(f"{ts} / unbubble paci", ts, "unbubble paci"), (f"{ts} / torch 1F1B", ts, "torch Schedule1F1B")]
    pairs += [(f"{TORCH_STAGE_ENGINE} {name} / {TORCH_STAGE[0]}", f"{TORCH_STAGE_ENGINE} {name}", ts)
              for name in TORCH_STAGE[1:]]
    ratios = {key: ratio(a, b) for key, a, b in pairs if a in runs and b in runs}
    # the schedule's own gain, free of compute slowing down when both processes compute at once:
    # the ratio of mean utilizations (= of tokens/s at equal busy time per micro-batch)
    util = {name: statistics.fmean(s["utilization"]) for name, s in systems.items()}
    # (the second: the orders' own difference, idle time waiting for the message the order names, likewise
    # free of the machine's load, which changes compute speed from one run to the next by up to 2× here)
    for key, a, b in (("paci / flush utilization", "unbubble paci", "unbubble 1f1b-flush"),
                      ("paci deterministic / dynamic utilization", "unbubble paci", "unbubble paci dynamic")):
        if a in util and b in util:
            ratios[key] = util[a] / util[b]
    compiled = {}
    for name in (COMPILED if cfg.compile else ()):
        eager, comp = f"unbubble {name}", f"unbubble {name} compiled"
        if eager not in runs or comp not in runs:
            continue
        ratios[f"{name} compiled / eager"] = ratio(comp, eager)
        # compile time: what the compiled system's warm-up run took beyond the eager one's (same 2 steps);
        # graphs compiled there per stage (a later system reuses the graphs of the same stages: ≈ 0 s)
        compiled[name] = {"compile_s": warmup[comp]["wall_s"] - warmup[eager]["wall_s"],
                          "warmup_wall_s": warmup[comp]["wall_s"], "eager_warmup_wall_s": warmup[eager]["wall_s"],
                          "graphs_compiled": warmup[comp]["graphs_compiled"]}
    targets = {}
    for key, name, target in (
            ("flush >= 0.95 x torch 1F1B", "flush / torch 1F1B", 0.95),  # issue 7
            ("paci >= 0.95 x (m+N-1)/m x torch 1F1B", "paci / torch 1F1B", 0.95 * bubble),
            # issue 34: clipping without a barrier costs PACI (almost) nothing; torch's PipelineStage keeps up
            ("paci + clip stale >= 0.97 x paci", "paci + clip stale / paci", 0.97),
            ("paci on torch PipelineStage >= 0.95 x unbubble paci", f"{ts} / unbubble paci", 0.95)):
        if name in ratios:
            targets[key] = {"value": ratios[name], "target": target, "met": ratios[name] >= target}
    return {"systems": systems, "ratios": ratios, "bubble_ratio": bubble, "targets": targets,
            "tokens_per_run": tokens, "compiled": compiled}


# -- part 2: synthetic sleep stages against the simulator -------------------------------------------

def calibrated_sleep(seconds: float, margin_s: float) -> None:
    """Sleeps ``seconds`` precisely: ``time.sleep`` until ``margin_s`` before the deadline (the
    calibrated wake-up overshoot), then a spin until the deadline."""
    deadline = time.perf_counter() + seconds
    if seconds > margin_s:
        time.sleep(seconds - margin_s)
    while time.perf_counter() < deadline:
        pass


class _Sleep(torch.autograd.Function):
    """y = x·w; the forward takes ``f_s`` seconds, the backward ``b_s`` (calibrated sleeps)."""

    @staticmethod
    def forward(ctx, x, w, f_s: float, b_s: float, margin_s: float):
        calibrated_sleep(f_s, margin_s)
        ctx.save_for_backward(x, w)
        ctx.b_s, ctx.margin_s = b_s, margin_s
        return x * w

    @staticmethod
    def backward(ctx, g):
        calibrated_sleep(ctx.b_s, ctx.margin_s)
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum().reshape(1), None, None, None


class SleepStage(torch.nn.Module):
    """A stage whose forward costs ``f_s`` and backward ``b_s`` seconds (one scalar weight)."""

    def __init__(self, f_s: float, b_s: float, margin_s: float):
        super().__init__()
        self.f_s, self.b_s, self.margin_s = f_s, b_s, margin_s
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.f_s, self.b_s, self.margin_s)


def _sleep_stage(f_s: float, b_s: float, margin_s: float, stage: int) -> SleepStage:
    return SleepStage(f_s, b_s, margin_s)


def _sleep_batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(4, 16, generator=g), torch.zeros(4, 16)


def _mean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def _sgd(params, stage: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def sleep_margin(samples: int = 40, probe_s: float = 0.005) -> float:
    """The wake-up overshoot of ``time.sleep`` on this machine now: its 90th percentile (s), at least
    0.5 ms (a busy machine wakes sleepers late)."""
    over = []
    for _ in range(samples):
        t = time.perf_counter()
        time.sleep(probe_s)
        over.append(time.perf_counter() - t - probe_s)
    over.sort()
    return max(0.0005, over[int(0.9 * (len(over) - 1))])


SLEEP_SYSTEMS = ("1f1b-flush", "paci", "paci dynamic")


def _sleep_job(cfg: BenchConfig, name: str, margin_s: float, steps: int | None = None) -> PipelineJob:
    name, order, _ = _variant(name)
    kw = {"a": cfg.sleep_m} if name == "paci" else {"m": cfg.sleep_m}
    return PipelineJob(stage_fn=functools.partial(_sleep_stage, cfg.sleep_f, cfg.sleep_b, margin_s), loss_fn=_mean_loss,
                       batch_fn=_sleep_batch, optimizer_fn=_sgd,
                       schedule=get_schedule(name, cfg.sleep_n, steps or cfg.sleep_steps, **kw), nan_policy="off",
                       order=order)


def _sleep_worker(rank: int, world: int, cfg: BenchConfig, port: int, q) -> None:
    try:
        _init(rank, world, port, 1)
        margin = sleep_margin()
        results = []
        for rep in range(-1, cfg.repeats):
            for name in SLEEP_SYSTEMS:
                dist.barrier()
                res = _run_ours(_sleep_job(cfg, name, margin, None if rep >= 0 else 1), rank)
                if rep >= 0:
                    results.append({"repeat": rep, "schedule": name, **res})
        dist.destroy_process_group()
        q.put((rank, {"margin_s": margin, "runs": results}))
    except BaseException as exc:  # noqa: BLE001
        q.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def bench_synthetic(cfg: BenchConfig) -> dict:
    """Part 2: makespan of the runtime against ``run_policies`` with the sleeps' costs (N = cfg.sleep_n)."""
    per_rank = _spawn(_sleep_worker, cfg.sleep_n, cfg)
    nominal = UniformCosts(f=cfg.sleep_f, b=cfg.sleep_b, u=0.0)
    out = {"f_s": cfg.sleep_f, "b_s": cfg.sleep_b, "sleep_margins_s": [p["margin_s"] for p in per_rank],
           "schedules": {}}
    for name in SLEEP_SYSTEMS:
        job = _sleep_job(cfg, name, 0.0)
        policies = [job.schedule.policy(r, job.order) for r in range(cfg.sleep_n)]  # the order the runtime ran
        predicted = run_policies(job.schedule, nominal, policies=policies).makespan
        spans, calibrated = [], []
        for rep in range(cfg.repeats):
            records = []
            for r in range(cfg.sleep_n):
                run = next(x for x in per_rank[r]["runs"] if x["repeat"] == rep and x["schedule"] == name)
                records += [ActionRecord(Action.parse(a), s, e, v, w) for a, s, e, v, w in run["records"]]
            trace = Trace(cfg.sleep_n, records)
            spans.append(trace.makespan)
            calibrated.append(run_policies(job.schedule, measured_costs(trace, blocking_sends=False),
                                           policies=[job.schedule.policy(r, job.order)
                                                     for r in range(cfg.sleep_n)]).makespan)
        span = statistics.median(spans)
        out["schedules"][name] = {
            "runtime_makespan_s": span, "runtime_makespans_s": spans,
            "simulated_makespan_s": predicted, "ratio": span / predicted,
            "within_5pct": abs(span / predicted - 1) <= 0.05,
            "simulated_from_measured_durations_s": statistics.median(calibrated),
        }
    sch = out["schedules"]  # same micro-batches: the bubble ratio, where stages do not share cores
    out["paci_speedup_over_flush"] = {
        "runtime": sch["1f1b-flush"]["runtime_makespan_s"] / sch["paci"]["runtime_makespan_s"],
        "simulated": sch["1f1b-flush"]["simulated_makespan_s"] / sch["paci"]["simulated_makespan_s"],
    }
    # tokens/s ratio of the orders = inverse makespan ratio (the same micro-batches), per repeat
    out["paci_deterministic_over_dynamic"] = statistics.median(
        d / f for d, f in zip(sch["paci dynamic"]["runtime_makespans_s"], sch["paci"]["runtime_makespans_s"]))
    return out


# -- report -------------------------------------------------------------------------------------------

def run(cfg: BenchConfig) -> dict:
    """Runs the selected parts; returns the JSON-ready results."""
    out = {"config": asdict(cfg), "machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                                              "platform": platform.platform(), "cpus": os.cpu_count()}}
    # other work on the machine takes cores from the stage processes: the load is part of the result
    out["machine"]["load_avg_1min_before"] = os.getloadavg()[0]
    if "model" in cfg.parts:
        out["model"] = bench_model(cfg)
    if "synthetic" in cfg.parts:
        out["synthetic"] = bench_synthetic(cfg)
    out["machine"]["load_avg_1min_after"] = os.getloadavg()[0]
    return out


def format_report(res: dict) -> str:
    """Plain-text tables of :func:`run`'s results."""
    cfg, mach = res["config"], res["machine"]
    lines = [f"machine: {mach['cpus']} CPUs, torch {mach['torch']}, 1-min load average "
             f"{mach['load_avg_1min_before']:.1f} before / {mach['load_avg_1min_after']:.1f} after"
             + ("  (other work shares the cores: expect noise)" if mach["load_avg_1min_before"] > 1 else "")]
    if "model" in res:
        mod = res["model"]
        lines.append(f"Same model and micro-batches, N={cfg['n']} gloo processes, m={cfg['m']} (PACI a={cfg['m']}), "
                     f"{cfg['steps']} steps × {cfg['repeats']} repeats, {cfg['threads']} thread(s) per process")
        lines.append(f"{'system':44} {'tokens/s':>10}  {'utilization':>11}  busy ms per micro-batch, per stage")
        for name, s in mod["systems"].items():
            lines.append(f"{name:44} {s['tokens_per_s']:>10,.0f}  {' '.join(f'{u:.2f}' for u in s['utilization']):>11}  "
                         f"{' '.join(f'{b:.1f}' for b in s['busy_ms_per_mb'])}")
        lines.append("")
        lines.append(f"{'ratio (median of per-repeat ratios)':56} {'value':>7}")
        for name, v in mod["ratios"].items():
            lines.append(f"{name:56} {v:>7.3f}")
        lines.append(f"{'(m+N-1)/m':56} {mod['bubble_ratio']:>7.3f}")
        for name in TORCH_STAGE[1:]:
            clipped = mod["systems"].get(f"{TORCH_STAGE_ENGINE} {name}", {}).get("clip_ms_per_step")
            if clipped:
                lines.append(f"{TORCH_STAGE_ENGINE} {name}: ms per step inside PipelineClip, per stage "
                             + " ".join(f"{c:.2f}" for c in clipped) + " (any wait for the global norm included)")
        updates = [(name, mod["systems"][f"unbubble {name}"]["update_ms_per_step"])
                   for name in ("paci", "1f1b-flush") + OURS_CLIP if "update_ms_per_step" in
                   mod["systems"].get(f"unbubble {name}", {})]
        if any(CLIP_SUFFIX in name for name, _ in updates):
            lines.append("ms per step inside our update actions U (optimizer step; with a clip also the norms and "
                         "any wait for the global norm), per stage: "
                         + "; ".join(f"{name} {' '.join(f'{u:.2f}' for u in us)}" for name, us in updates))
        for name, t in mod["targets"].items():
            lines.append(f"target {name}: {t['value']:.3f} vs {t['target']:.3f} -> {'met' if t['met'] else 'NOT met'}")
        for name, c in mod.get("compiled", {}).items():
            lines.append(f"{name} compiled ({cfg.get('compile_backend', 'inductor')}): {mod['ratios'][name + ' compiled / eager']:.3f} "
                         f"× eager tokens/s; compile time {c['compile_s']:.1f} s (first run {c['warmup_wall_s']:.1f} s "
                         f"vs eager {c['eager_warmup_wall_s']:.1f} s; graphs compiled per stage "
                         f"{' '.join(str(g) for g in c['graphs_compiled'])}"
                         + (": the stage processes reuse the graphs an earlier variant compiled, same model "
                            "and shapes" if not any(c["graphs_compiled"]) else "") + ")")
    if "synthetic" in res:
        syn = res["synthetic"]
        lines.append("")
        lines.append(f"Synthetic sleep stages, N={cfg['sleep_n']}, F={syn['f_s'] * 1e3:.0f} ms, "
                     f"B={syn['b_s'] * 1e3:.0f} ms, m=a={cfg['sleep_m']}, {cfg['sleep_steps']} steps")
        lines.append(f"{'schedule':13} {'runtime s':>10} {'simulated s':>12} {'ratio':>7} {'sim(measured) s':>16}")
        for name, s in syn["schedules"].items():
            lines.append(f"{name:13} {s['runtime_makespan_s']:>10.3f} {s['simulated_makespan_s']:>12.3f} "
                         f"{s['ratio']:>7.3f} {s['simulated_from_measured_durations_s']:>16.3f}"
                         f"  within 5%: {'yes' if s['within_5pct'] else 'NO'}")
        sp = syn["paci_speedup_over_flush"]
        lines.append(f"paci speed-up over 1f1b-flush at equal micro-batches: runtime {sp['runtime']:.3f}, "
                     f"simulator {sp['simulated']:.3f}")
        if "paci_deterministic_over_dynamic" in syn:
            lines.append(f"paci throughput, deterministic / dynamic order (median of per-repeat ratios): "
                         f"{syn['paci_deterministic_over_dynamic']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--stages", dest="n", type=int, default=None)
    p.add_argument("--m", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["model", "synthetic"], default=None)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--compile-backend", choices=["inductor", "aot_eager"], default="inductor")
    p.add_argument("--no-torch-stage", action="store_true", help="skip paci on torch PipelineStage (unbubble.pipelining)")
    p.add_argument("--no-clip", action="store_true", help="skip the rows with gradient clipping (sync, stale, stage)")
    p.add_argument("--systems", default=None,
                   help="comma-separated rows of part 1 to run, e.g. 'unbubble paci,unbubble paci + clip stale' "
                        "(default: all)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = quick_config() if a.quick else BenchConfig()
    for name in ("repeats", "steps", "n", "m"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    if a.only:
        cfg.parts = (a.only,)
    cfg.compile, cfg.compile_backend = not a.no_compile, a.compile_backend
    cfg.torch_stage = not a.no_torch_stage
    cfg.clip = not a.no_clip
    if a.systems:
        cfg.systems = tuple(x.strip() for x in a.systems.split(",") if x.strip())
        try:
            model_systems(cfg)  # an unknown name fails here, before any process starts
        except ValueError as exc:
            p.error(str(exc))
    res = run(cfg)
    print(format_report(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def quick_config() -> BenchConfig:
    """A smoke run: one repeat, fewer steps."""
    return BenchConfig(steps=3, repeats=1, sleep_steps=2)


if __name__ == "__main__":
    main()
