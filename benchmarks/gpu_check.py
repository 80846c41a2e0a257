"""GPU check: the CUDA tests, then precision × recomputation on gpt2-medium shapes, beside the simulator.

One prepared script for a machine with CUDA (``python benchmarks/gpu_check.py``):

1. runs ``pytest tests/gpu`` (NCCL, device tensors, no host synchronisation);
2. trains ``--schedule`` (default PACI, a = 8) on gpt2-medium shapes (24 blocks, d = 1024,
   V = 50257, T = 1024) cut into ``--stages`` (8) stages, all on one GPU in the emulator's order,
   for each ``--precision`` fp32 / bf16-autocast / bf16 with ``--recompute`` none and full, on random
   tokens, and measures tokens/s (after ``--warmup`` untimed steps), the bytes every stage's executor
   measured (``StageExecutor.memory_bytes``: weights, fp32 masters, activations, weight copies) and
   the allocator's peak for the whole GPU;
3. beside each: the analytic simulator's prediction (``sim.analytic.analytic_model`` on the
   ``--hardware`` preset, flash attention since the model uses ``scaled_dot_product_attention``):
   peak activation bytes per stage counted over the run's own action order, weight bytes, and
   tokens/s of one GPU running every stage in turn (the sum of the action durations), and of the
   pipeline on N GPUs.

4. with ``--compile`` (the default; ``--no-compile`` skips it): 1F1B-flush and ``--schedule`` in
   ``--compile-precision`` (bf16) with every stage under ``torch.compile`` (``--compile-backend``,
   inductor), each beside
   the same run eager: tokens/s compiled ÷ eager, and the compile time (the compiled run's warm-up
   steps minus the eager run's).

Prints the tables and writes JSON (``--out``, default ``gpu_check.json``). On a machine without CUDA
it says so and exits 0. ``--device cpu --model tiny`` runs step 2–3 on the CPU (a smoke test of the
script itself; the hardware prediction is then not meant to match).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16-autocast", "bf16")
RECOMPUTE = ("none", "full")


def _batch(vocab: int, b: int, t: int, device: str, k: int):
    g = torch.Generator().manual_seed(k)
    buf = torch.randint(0, vocab, (b, t + 1), generator=g)
    return buf[:, :-1].contiguous().to(device), buf[:, 1:].contiguous().to(device)


def _stage(config, n: int, loss_scale: float, device: str, stage: int):
    from unbubble.models import build_stages

    return build_stages(config, n, 0, only=stage, loss_scale=loss_scale)[stage].to(device)


def _adamw(params, stage):
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def measure(model: str, schedule: str, n: int, a: int, m: int, b: int, steps: int, warmup: int, precision: str,
            recompute: str, device: str, hardware: str, compile_backend: str | None = None) -> dict:
    """One run and its prediction; see the module docstring."""
    from unbubble.models.gpt2 import gpt_loss
    from unbubble.models.registry import make_config
    from unbubble.runtime.emulator import run_emulator
    from unbubble.runtime.job import PipelineJob
    from unbubble.schedules import get_schedule
    from unbubble.sim.analytic import analytic_model, get_precision
    from unbubble.sim.hardware import get_hardware
    from unbubble.sim.memory import peak_memory

    config = make_config(model, 50257 if model.startswith("gpt2") else 257)
    t = config.block_size
    sched = get_schedule(schedule, n, steps=warmup + steps, a=a, m=m)
    job = PipelineJob(functools.partial(_stage, config, n, sched.loss_scale, device), gpt_loss,
                      functools.partial(_batch, config.vocab_size, b, t, device), _adamw, sched,
                      precision=precision, recompute=recompute, compile_backend=compile_backend)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    res = run_emulator(job)
    if device == "cuda":
        torch.cuda.synchronize()
    # tokens/s after the warm-up steps, between ends of the last stage's updates (each reads the
    # step's losses: the host waits for the device there, so these times are not launch times)
    us = [r.end for r in res.trace.records if r.action.kind.value == "U" and r.action.stage == n - 1]
    t_start = us[warmup - 1] if warmup else 0.0
    tok_per_s = steps * sched.mb_per_step * b * t / (us[-1] - t_start)
    am = analytic_model(config, n, get_hardware(hardware), b, precision=get_precision(precision),
                        flash_attention=True, recompute=recompute == "full")
    predicted = peak_memory(res.sim_trace, am.memory)
    busy = sum(sum(s.as_list()[:2]) + s.u_s / sched.mb_per_step for s in am.costs.stages)  # F + B (+ U) per mb
    from unbubble.sim.result import simulate

    pipe = simulate(sched, am.costs, samples_per_mb=b, tokens_per_mb=b * t)
    return {
        "precision": precision, "recompute": recompute, "schedule": schedule, "stages": n, "micro_batch_size": b,
        "compile_backend": compile_backend, "warmup_s": t_start, "tokens_per_s": tok_per_s, "predicted_tokens_per_s_one_device": b * t / busy,
        "predicted_tokens_per_s_n_devices": pipe.steady_tokens_per_s,
        "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "activation_bytes": [mm["activation_bytes"] + mm["weight_copy_bytes"] for mm in res.memory],
        "predicted_activation_bytes": [p.activations for p in predicted],
        "weight_bytes": [mm["param_bytes"] + mm["master_bytes"] for mm in res.memory],
        # parameters (+ fp32 masters under bf16, which the analytic model counts in its optimizer bytes)
        "predicted_weight_bytes": [n_p * (get_precision(precision).weight_bytes + (4 if precision == "bf16" else 0))
                                   for n_p in am.params],
        "memory": res.memory,
    }


def _mb(x) -> str:
    return "—" if x is None else f"{x / 2 ** 20:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--schedule", default="paci")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--a", type=int, default=8)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    ap.add_argument("--compile-precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu first")
    ap.add_argument("--out", default="gpu_check.json")
    o = ap.parse_args(argv)
    if o.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine: nothing to check (run it where `nvidia-smi` shows a GPU)")
        return 0
    out: dict = {"device": torch.cuda.get_device_name(0) if o.device == "cuda" else "cpu", "args": vars(o)}
    if o.device == "cuda" and not o.skip_tests:
        t0 = time.time()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/gpu")])
        out["tests_gpu"] = {"exit_code": rc, "seconds": time.time() - t0}
        print(f"tests/gpu: exit {rc}")
    rows = []
    for precision in PRECISIONS:
        for recompute in RECOMPUTE:
            try:
                r = measure(o.model, o.schedule, o.stages, o.a, o.m, o.micro_batch_size, o.steps, o.warmup,
                            precision, recompute, o.device, o.hardware)
            except torch.OutOfMemoryError as exc:
                r = {"precision": precision, "recompute": recompute, "error": f"out of memory: {exc}"[:200]}
            rows.append(r)
            out["runs"] = rows
            Path(o.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n{o.model}, {o.schedule}, N={o.stages}, b={o.micro_batch_size} on {out['device']}; MiB per stage "
          f"measured / predicted ({o.hardware} analytic model); tok/s measured (all stages on one device) / "
          "predicted one device / predicted N devices")
    print(f"{'precision':14} {'recompute':9} {'tok/s':>9} {'pred 1':>9} {'pred N':>9} {'GPU peak':>9}  "
          "activations per stage (meas/pred)  |  weights per stage (meas/pred)")
    for r in rows:
        if "error" in r:
            print(f"{r['precision']:14} {r['recompute']:9} {r['error']}")
            continue
        acts = " ".join(f"{_mb(x)}/{_mb(y)}" for x, y in zip(r["activation_bytes"], r["predicted_activation_bytes"]))
        ws = " ".join(f"{_mb(x)}/{_mb(y)}" for x, y in zip(r["weight_bytes"], r["predicted_weight_bytes"]))
        print(f"{r['precision']:14} {r['recompute']:9} {r['tokens_per_s']:9.0f} "
              f"{r['predicted_tokens_per_s_one_device']:9.0f} {r['predicted_tokens_per_s_n_devices']:9.0f} "
              f"{_mb(r['gpu_peak_allocated_bytes']):>9}  {acts}  |  {ws}")
    if not o.no_compile:
        out["compiled"] = compare_compiled(o, rows, out)
    print(f"wrote {o.out}")
    return 0


def compare_compiled(o, rows: list[dict], out: dict) -> list[dict]:
    """Step 4: 1F1B-flush and ``o.schedule``, eager and under torch.compile (``o.compile_backend``), in
    ``o.compile_precision`` without recomputation; prints tokens/s, the ratio and the compile time."""
    pairs = []
    for schedule in dict.fromkeys(("1f1b-flush", o.schedule)):
        pair = {}
        for backend in (None, o.compile_backend):
            known = [r for r in rows if backend is None and schedule == o.schedule and "error" not in r
                     and (r["precision"], r["recompute"]) == (o.compile_precision, "none")]
            try:
                pair[backend or "eager"] = known[0] if known else measure(
                    o.model, schedule, o.stages, o.a, o.m, o.micro_batch_size, o.steps, o.warmup,
                    o.compile_precision, "none", o.device, o.hardware, compile_backend=backend)
            except torch.OutOfMemoryError as exc:
                pair[backend or "eager"] = {"error": f"out of memory: {exc}"[:200]}
        eager, comp = pair["eager"], pair[o.compile_backend]
        ok = "error" not in eager and "error" not in comp
        pairs.append({"schedule": schedule, "precision": o.compile_precision,
                      "eager_tokens_per_s": eager.get("tokens_per_s"), "compiled_tokens_per_s": comp.get("tokens_per_s"),
                      "compiled_over_eager": comp["tokens_per_s"] / eager["tokens_per_s"] if ok else None,
                      "compile_s": comp["warmup_s"] - eager["warmup_s"] if ok and o.warmup else None,
                      "errors": [r["error"] for r in (eager, comp) if "error" in r]})
        out["compiled"] = pairs
        Path(o.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\ntorch.compile ({o.compile_backend}) against eager, {o.compile_precision}, recompute none; compile time = the "
          f"compiled run's {o.warmup} warm-up step(s) minus the eager run's")
    print(f"{'schedule':12} {'eager tok/s':>12} {'compiled':>10} {'ratio':>6} {'compile s':>10}")
    for p in pairs:
        if p["errors"]:
            print(f"{p['schedule']:12} {'; '.join(p['errors'])}")
            continue
        cs = "—" if p["compile_s"] is None else f"{p['compile_s']:.1f}"
        print(f"{p['schedule']:12} {p['eager_tokens_per_s']:12.0f} {p['compiled_tokens_per_s']:10.0f} "
              f"{p['compiled_over_eager']:6.3f} {cs:>10}")
    return pairs


if __name__ == "__main__":
    sys.exit(main())
