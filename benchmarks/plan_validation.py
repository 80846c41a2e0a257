"""How well `unbubble plan` predicts: measured runs on this machine, and published throughput ratios.

Part 1 (measured). The plan's cost model is the analytic one (FLOPs ÷ sustained FLOP/s, update
bytes ÷ memory bandwidth, a latency per message). On this CPU it is calibrated once: a short
calibration run (``unbubble train --engine processes``, 1F1B-flush, N = 2, m = 4) gives per-stage
median F, B and U (``unbubble.sim.measured.measured_costs``, blocking sends included; medians, as
the first step's actions are warm-up outliers) and link
latencies; the sustained FLOP/s is the analytic model's F + B FLOP count of that run's stages ÷ the
measured F + B seconds, the memory bandwidth the analytic U bytes ÷ the measured U seconds, the
latency the mean measured one, the link bandwidth what a measured 2-process gloo all-reduce of
the model's gradients implies (for the data-parallel configuration). With that hardware, ``unbubble.sim.plan.candidates`` predicts every
configuration of a fixed global batch on 2 devices (2 stage processes, one torch thread each: one
core per device on a 2-core machine); each configuration is then trained for real on the process
engine and its tokens/s read from ``summary.json`` (the whole run: tokens ÷ training wall time) and,
as the plan predicts it, in steady state from ``actions.jsonl`` (``SimResult.steady_tokens_per_s`` of
the measured trace, × dp). Printed: predicted ÷ measured per configuration, and whether the
predicted best is the measured best. The 1-minute load average is recorded before and after each
run: timings on a shared machine are only as good as its load.

Part 2 (published). The Zero Bubble paper (Qi et al., arXiv 2401.10241, Table 4: GPT-3-like 1.5B,
6.2B, 14.6B and 28.3B models on 8, 8, 16 and 32 A100-80G, sequence 1024, micro-batch 6, 3, 1, 1,
three micro-batch counts each) measured samples/s per GPU of 1F1B, ZB-1p and ZB-2p; the numbers are
``unbubble.sim.extrapolate.PAPER``. The plan searches the same setups (dp = 1, the paper's N, b and
m; bf16; no recomputation) with 1f1b-flush, zb-h1 and zb-h2 (the registry's handcrafted schedules
with ZB-1p's and ZB-2p's memory limits, not the paper's searched ones) and the ratios ZB/1F1B are
compared. The plan splits blocks by cost (the paper gives the first and last stage one block less),
so its absolute figures differ from ``unbubble extrapolate``'s. DualPipe (DeepSeek-V3 report,
arXiv 2412.19437, Table 2) publishes bubble and memory formulas, not measured throughput, so it has
no entry here.

Usage::

    python benchmarks/plan_validation.py --size tiny        # the script's check: calibration + 3 runs of 10 steps
    python benchmarks/plan_validation.py --size full --out runs/plan-validation   # 10 configurations of deep-cpu,
                                                            # 200 steps each: ≈ 6 min on an idle 2-core machine (estimate)
    python benchmarks/plan_validation.py --size full --model small-cpu
    python benchmarks/plan_validation.py --part published   # part 2 only (simulation, seconds)

``--out DIR`` keeps the run folders and writes ``plan_validation.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Per model: sequence length, sequences per update (the global batch) and the configurations
#: (schedule, N, dp, m or a, v) trained.
SETUPS = {
    "deep-cpu": dict(seq_len=64, sequences=16),
    "small-cpu": dict(seq_len=128, sequences=8),
}
CONFIGS = [
    ("1f1b-flush", 2, 1, 4, None), ("1f1b-flush", 2, 1, 8, None), ("1f1b-flush", 2, 1, 16, None),
    ("gpipe", 2, 1, 8, None), ("zb-h1", 2, 1, 8, None), ("interleaved-1f1b", 2, 1, 8, 2),
    ("paci", 2, 1, 4, None), ("paci", 2, 1, 8, None), ("1f1b-flush", 1, 2, 4, None), ("zbv", 2, 1, 8, None),
]
TINY = [CONFIGS[0], CONFIGS[6], CONFIGS[8]]
CALIBRATION = ("1f1b-flush", 2, 1, 4, None)


def load() -> float:
    return os.getloadavg()[0]


def train(run_dir: Path, model: str, setup: dict, config, steps: int, threads: int) -> dict:
    """One ``unbubble train --engine processes`` run; returns its summary and the loads around it."""
    name, n, dp, k, v = config
    per = setup["sequences"] // dp
    b = per // k
    opt = "--a" if name in ("paci", "paci-stashed") else "--m"
    cmd = ["unbubble", "-q", "train", "--engine", "processes", "--model", model, "--schedule", name,
           "--stages", str(n), "--dp", str(dp), "--micro-batch-size", str(b), "--seq-len", str(setup["seq_len"]),
           "--steps", str(steps), "--optimizer", "adamw", "--eval-interval", "0", "--eval-batches", "1",
           "--no-checkpoints", "--no-tensorboard", "--threads-per-stage", str(threads), "--run-dir", str(run_dir)]
    if name not in ("async-1f1b", "pipedream", "pipemare"):
        cmd += [opt, str(k)]
    if v is not None:
        cmd += ["--v", str(v)]
    before, t0 = load(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall, after = time.time() - t0, load()
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1], "cmd": cmd}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"summary": summary, "load_before": before, "load_after": after, "command_wall_s": wall, "cmd": cmd,
            "micro_batch_size": b}


def steady_measured(run_dir: Path, dp: int) -> float:
    """Steady-state tokens/s of a measured run, as the simulator defines it, × dp replicas."""
    from unbubble.sim.measured import load_run
    from unbubble.sim.result import SimResult

    run = load_run(run_dir)
    res = SimResult(run.schedule, run.trace, samples_per_mb=run.samples_per_mb, tokens_per_mb=run.tokens_per_mb)
    return res.steady_tokens_per_s * dp


def _allreduce_worker(rank: int, n_bytes: int, reps: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.zeros(n_bytes // 4)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(sorted(times)[len(times) // 2])
    dist.destroy_process_group()


def allreduce_seconds(n_bytes: int, reps: int = 20) -> float:
    """Median seconds of one gloo all-reduce of ``n_bytes`` (fp32) between 2 processes on this machine."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, n_bytes, reps, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    t = q.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return t


def calibrated_hardware(run_dir: Path, model: str, setup: dict):
    """A ``Hardware`` whose FLOP/s, memory bandwidth and latency reproduce the calibration run, and
    whose link bandwidth reproduces a measured 2-process gloo all-reduce of the model's gradients
    (the plan's ring formula for 2 replicas: bytes / bandwidth + 2 latencies)."""
    from unbubble.sim.analytic import analytic_model, get_precision, make_model
    from unbubble.sim.hardware import Hardware
    from unbubble.sim.measured import load_run, measured_costs

    run = load_run(run_dir)
    mc = measured_costs(run.trace, statistic="median")  # the first step's warm-up actions are outliers
    cfg = make_model(model, 257, setup["seq_len"])
    unit = Hardware("unit", 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, gpus_per_node=2)
    ref = analytic_model(cfg, run.schedule.n_stages, unit, run.samples_per_mb, setup["seq_len"],
                         precision=get_precision("fp32"))
    flops = sum(s.f_s + s.b_s for s in ref.costs.stages) / sum(s.f_s + s.b_s for s in mc.stages)
    hbm = sum(s.u_s for s in ref.costs.stages) / max(1e-12, sum(s.u_s for s in mc.stages))
    lat = mc.latency_s if isinstance(mc.latency_s, float) else sum(mc.latency_s) / len(mc.latency_s)
    grad_bytes = int(sum(ref.memory.grads_bytes))
    ar = allreduce_seconds(grad_bytes)
    bw = grad_bytes / max(ar - 2 * lat, ar / 10)
    hw = Hardware("cpu-calibrated", peak_flops=flops, achievable=1.0, memory_bytes=64e9, hbm_bytes_per_s=hbm,
                  intra_node_bytes_per_s=bw, inter_node_bytes_per_s=bw, gpus_per_node=2,
                  intra_latency_s=lat, inter_latency_s=lat, source=f"calibrated from {run_dir}")
    ratio_bf = sum(s.b_s for s in mc.stages) / sum(s.f_s for s in mc.stages)
    return hw, {"flops": flops, "hbm_bytes_per_s": hbm, "latency_s": lat, "measured_B_over_F": ratio_bf,
                "allreduce_bytes": grad_bytes, "allreduce_s": ar, "link_bytes_per_s": bw,
                "stages": [dict(f=s.f_s, b=s.b_s, u=s.u_s) for s in mc.stages]}


def measured_part(model: str, size: str, out: Path, threads: int, steps: int | None = None) -> dict:
    from unbubble.schedules.registry import SCHEDULES
    from unbubble.sim.plan import Cluster, candidates

    setup = SETUPS[model]
    steps = steps or {"tiny": 10, "full": 200}[size]
    configs = [c for c in (TINY if size == "tiny" else CONFIGS) if c[0] in SCHEDULES]
    print(f"# Part 1: {model}, {setup['sequences']} sequences of {setup['seq_len']} tokens per update, "
          f"{steps} steps per run, process engine, {threads} torch thread(s) per stage", flush=True)
    cal_dir = out / "calibration"
    shutil.rmtree(cal_dir, ignore_errors=True)
    cal = train(cal_dir, model, setup, CALIBRATION, steps, threads)
    if "error" in cal:
        raise SystemExit(f"calibration run failed: {cal['error']}")
    hw, cal_info = calibrated_hardware(cal_dir, model, setup)
    print(f"calibration (1f1b-flush N=2 m=4, load {cal['load_before']:.2f}→{cal['load_after']:.2f}): "
          f"{hw.peak_flops / 1e9:.2f} GFLOP/s sustained (fp32 F+B), U bandwidth {hw.hbm_bytes_per_s / 1e9:.2f} GB/s, "
          f"latency {1e3 * hw.intra_latency_s:.2f} ms, measured B/F {cal_info['measured_B_over_F']:.2f}; gloo "
          f"all-reduce of {cal_info['allreduce_bytes'] / 1e6:.2f} MB in {1e3 * cal_info['allreduce_s']:.2f} ms: link "
          f"{hw.intra_node_bytes_per_s / 1e9:.2f} GB/s", flush=True)
    names = sorted({c[0] for c in configs})
    t0 = time.perf_counter()
    rows = candidates(model, Cluster(hw, 2), setup["sequences"] * setup["seq_len"], setup["seq_len"],
                      schedules=names, stages=(1, 2), v_values=(2,), recompute=(False,), precision="fp32",
                      vocab_size=257, predict_weights=False, token_overhead=None)
    plan_s = time.perf_counter() - t0
    def predicted(config):
        name, n, dp, k, v = config
        k = 1 if name in ("async-1f1b", "pipedream", "pipemare") else k
        return next((r for r in rows if (r.schedule, r.stages, r.dp, r.mb_per_update) == (name, n, dp, k)
                     and (v is None or r.v == v)), None)

    own = predicted(CALIBRATION)
    cal_steady = steady_measured(cal_dir, CALIBRATION[2])
    cal_info["self_check"] = {"predicted": own.tokens_per_s, "measured_steady": cal_steady,
                              "measured_summary": cal["summary"]["tokens_per_s"]}
    print(f"self-check, the calibration run itself: predicted {own.tokens_per_s:,.0f} tokens/s, measured "
          f"{cal_steady:,.0f} in steady state ({own.tokens_per_s / cal_steady:.3f}), "
          f"{cal['summary']['tokens_per_s']:,.0f} over the whole run", flush=True)
    results = []
    print("\n| configuration | N | dp | b | predicted tok/s | measured tok/s (summary) | measured steady tok/s "
          "| predicted ÷ measured (summary) | predicted ÷ steady | load before→after |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for cfg in configs:
        name, n, dp, k, v = cfg
        row = predicted(cfg)
        run_dir = out / (f"{name}-N{n}-dp{dp}-k{k}" + (f"-v{v}" if v else ""))
        shutil.rmtree(run_dir, ignore_errors=True)
        got = train(run_dir, model, setup, cfg, steps, threads)
        label = f"{name} {'a' if name.startswith('paci') else 'm'}={k}" + (f" v={v}" if v else "")
        if "error" in got or row is None:
            why = got.get("error", "the plan has no such row")
            print(f"| {label} | {n} | {dp} | — | — | — | — | — | — | skipped: {why} |", flush=True)
            results.append({"config": cfg, "error": why})
            continue
        meas = got["summary"]["tokens_per_s"]
        steady = steady_measured(run_dir, dp)
        print(f"| {label} | {n} | {dp} | {got['micro_batch_size']} | {row.tokens_per_s:,.0f} | {meas:,.0f} | "
              f"{steady:,.0f} | {row.tokens_per_s / meas:.3f} | {row.tokens_per_s / steady:.3f} | "
              f"{got['load_before']:.2f}→{got['load_after']:.2f} |", flush=True)
        results.append({"config": cfg, "label": label, "predicted_tokens_per_s": row.tokens_per_s,
                        "measured_tokens_per_s": meas, "measured_steady_tokens_per_s": steady,
                        "predicted_bubble": row.bubble, "measured_utilization": got["summary"]["utilization"],
                        "load_before": got["load_before"], "load_after": got["load_after"],
                        "train_wall_s": got["summary"]["train_wall_s"], "command": " ".join(got["cmd"])})
    ok = [r for r in results if "error" not in r]
    verdict = {}
    if ok:
        best_pred = max(ok, key=lambda r: r["predicted_tokens_per_s"])
        for key in ("measured_tokens_per_s", "measured_steady_tokens_per_s"):
            best = max(ok, key=lambda r: r[key])
            verdict[key] = {"measured_best": best["label"], "predicted_best": best_pred["label"],
                            "same": best is best_pred,
                            "measured_of_predicted_best": best_pred[key] / best[key]}
        ratios = sorted(r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] for r in ok)
        print(f"\npredicted ÷ measured (summary tokens/s): median {ratios[len(ratios) // 2]:.3f}, range "
              f"{ratios[0]:.3f}–{ratios[-1]:.3f} over {len(ok)} configurations; predicted best "
              f"{best_pred['label']}; measured best {verdict['measured_tokens_per_s']['measured_best']} (summary), "
              f"{verdict['measured_steady_tokens_per_s']['measured_best']} (steady); the predicted best ran at "
              f"{verdict['measured_tokens_per_s']['measured_of_predicted_best']:.3f}× the measured best. "
              f"Plan search: {plan_s:.2f} s.", flush=True)
    return {"model": model, "size": size, "steps": steps, "setup": setup, "calibration": cal_info,
            "calibration_load": [cal["load_before"], cal["load_after"]], "rows": results, "verdict": verdict,
            "plan_search_s": plan_s}


def published_part() -> dict:
    from unbubble.sim.analytic import ZB_MODELS
    from unbubble.sim.extrapolate import PAPER
    from unbubble.sim.hardware import HARDWARE
    from unbubble.sim.plan import Cluster, candidates

    print("\n# Part 2: the Zero Bubble paper's setups (arXiv 2401.10241, Table 4, A100-80G), plan vs paper", flush=True)
    print("\n| model | N | m | b | paper ZB-1p/1F1B | plan zb-h1/1f1b-flush | paper ZB-2p/1F1B | plan zb-h2/1f1b-flush "
          "| paper 1F1B samples/s/GPU | plan 1F1B | plan ÷ paper |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    out = []
    t0 = time.perf_counter()
    for mdl, z in ZB_MODELS.items():
        n, b = z["stages"], z["micro_batch_size"]
        for i, m in enumerate(z["m"]):
            rows = candidates(mdl, Cluster(HARDWARE["a100-80g"], n), m * b * 1024, schedules=("1f1b-flush", "zb-h1", "zb-h2"),
                              stages=(n,), recompute=(False,), token_overhead=None, max_micro_batches=m)
            got = {r.schedule: r.tokens_per_s / 1024 / n for r in rows if r.mb_per_update == m}
            paper = {col: PAPER[mdl][col][i][0] for col in ("1F1B", "ZB-1p", "ZB-2p")}
            rec = {"model": mdl, "N": n, "m": m, "b": b, "paper": paper, "plan_samples_per_s_per_gpu": got,
                   "paper_zb1_over_1f1b": paper["ZB-1p"] / paper["1F1B"],
                   "plan_zbh1_over_1f1b": got["zb-h1"] / got["1f1b-flush"],
                   "paper_zb2_over_1f1b": paper["ZB-2p"] / paper["1F1B"],
                   "plan_zbh2_over_1f1b": got["zb-h2"] / got["1f1b-flush"]}
            out.append(rec)
            print(f"| {mdl} | {n} | {m} | {b} | {rec['paper_zb1_over_1f1b']:.3f} | {rec['plan_zbh1_over_1f1b']:.3f} | "
                  f"{rec['paper_zb2_over_1f1b']:.3f} | {rec['plan_zbh2_over_1f1b']:.3f} | {paper['1F1B']:g} | "
                  f"{got['1f1b-flush']:.3g} | {got['1f1b-flush'] / paper['1F1B']:.3f} |", flush=True)
    err1 = [r["plan_zbh1_over_1f1b"] / r["paper_zb1_over_1f1b"] for r in out]
    err2 = [r["plan_zbh2_over_1f1b"] / r["paper_zb2_over_1f1b"] for r in out]
    print(f"\nplan ratio ÷ paper ratio: ZB-1p {min(err1):.3f}–{max(err1):.3f}, ZB-2p {min(err2):.3f}–{max(err2):.3f} "
          f"over {len(out)} setups ({time.perf_counter() - t0:.1f} s of simulation). DualPipe: no measured throughput "
          "published (DeepSeek-V3, arXiv 2412.19437, Table 2 gives bubble and memory formulas only).", flush=True)
    return {"rows": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--model", choices=tuple(SETUPS), default="deep-cpu")
    p.add_argument("--part", choices=("measured", "published", "both"), default="both")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run [default: 10 tiny, 200 full]")
    p.add_argument("--out", default=None, help="folder for the run folders and plan_validation.json "
                                                "[default: a temporary folder, removed]")
    a = p.parse_args()
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="plan-validation-"))
    out.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_at_start": load(),
              "cpus": os.cpu_count(), "argv": sys.argv[1:]}
    try:
        if a.part in ("measured", "both"):
            report["measured"] = measured_part(a.model, a.size, out, a.threads, a.steps)
        if a.part in ("published", "both"):
            report["published"] = published_part()
        report["load_at_end"] = load()
        if a.out:
            (out / "plan_validation.json").write_text(json.dumps(report, indent=2) + "\n")
            print(f"\nwrote {out / 'plan_validation.json'}")
    finally:
        if not a.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
