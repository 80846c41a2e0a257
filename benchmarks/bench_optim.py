"""Optimizer step time on GPT-2-small-shaped matrices: AdamW, Basis Rotation and SOAP, side by side.

What is measured, in one process and one run:

1. **Step time** of each optimizer on one GPT-2-small block's matrices (4 x 768x768 for q, k, v,
   out; 768x3072 and 3072x768 for the MLP; float32, fixed random gradients): ``torch.optim.AdamW``,
   ``unbubble.optim.BasisRotation`` (every source x geometry) and the SOAP of the PyPI package
   ``pytorch-optimizer`` (the peer users would pick), at refresh interval k in {1, 10, 100}.
   Each step is timed on its own and classed as a "plain" step or a "refresh" step (the step after
   which the bases were recomputed). Per optimizer family, the medians of both classes give the
   amortized time per step, ``plain + (refresh - plain) / k``; where the run covers whole refresh
   periods (k = 1 and k = 10) the directly measured mean is printed too. The cold-start ``eigh``
   (first step) is excluded: it is paid once per run.
2. **Extra optimizer memory** beyond AdamW's two moments, as a multiple of the parameters.
3. **Training-step overhead**: one local optimizer step of a GPT-2-small block as a middle pipeline
   stage at the CPU demo's batch (a micro-batches of B x T tokens, forward + backward each, then
   the update), with AdamW, Basis Rotation (2nd, bilateral; also with only the sides ≤ 768 rotated,
   and unilateral) and SOAP at k = 10.

Results are printed as tables and written as JSON (``--out``). Medians of ``--repeats`` style
samples are used throughout; ratios are against AdamW's median step and against SOAP at equal k.

Usage::

    python benchmarks/bench_optim.py                    # full run, ~5 min on 2 CPU cores
    python benchmarks/bench_optim.py --quick            # fewer steps, for a smoke check
    python benchmarks/bench_optim.py --train-step-only --ks 10 --threads 2   # part 3 alone, ~1.5 min
    python benchmarks/bench_optim.py --out results.json --threads 2

Requires ``pip install -e .[bench]`` (``pytorch-optimizer``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from unbubble.optim import BasisRotation, optimizer_state_bytes
from unbubble.optim import keys as K

BLOCK_SHAPES = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]  # GPT-2 small: q, k, v, out; MLP fc, proj
VARIANTS = [("2nd", "bilateral"), ("1st", "bilateral"), ("2nd", "unilateral"), ("1st", "unilateral")]


def block_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """The block's matrices, N(0, 0.02) as GPT-2, with fixed N(0, 1e-3) gradients."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in BLOCK_SHAPES:
        p = torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.02)
        p.grad = torch.randn(*shape, generator=g) * 1e-3
        params.append(p)
    return params


def soap_class() -> type[torch.optim.Optimizer]:
    try:
        from pytorch_optimizer import SOAP
    except ImportError:  # pragma: no cover - reported to the user
        sys.exit("bench_optim needs the SOAP of pytorch-optimizer: pip install -e '.[bench]'")
    return SOAP


def make_optimizer(name: str, params: list[torch.nn.Parameter], k: int) -> torch.optim.Optimizer:
    """AdamW, "br-<source>-<geometry>" or "soap", all with betas (0.9, 0.999), wd 0.01, lr 1e-3."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    if name == "soap":
        return soap_class()(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, precondition_frequency=k)
    _, source, geometry = name.split("-")
    return BasisRotation(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, source=source,
                         geometry=geometry, update_freq=k)


def refresh_counter(
    name: str, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], k: int,
) -> Callable[[], int]:
    """A function returning how many refreshes have happened so far (to class each timed step)."""
    if name.startswith("br-"):
        return lambda: opt.state[params[-1]][K.REFRESHES]
    if name == "soap":  # pytorch-optimizer: group step s (after the init step) refreshes when (s - 1) % k == 0
        return lambda: sum(1 for s in range(2, opt.param_groups[0]["step"] + 1) if (s - 1) % k == 0)
    return lambda: 0


class Timed:
    """One optimizer on its own copy of the block, timed step by step."""

    def __init__(self, name: str, k: int, n_steps: int) -> None:
        self.name, self.k, self.n_steps = name, k, n_steps
        self.params = block_params()
        self.opt = make_optimizer(name, self.params, k)
        self.refreshes = refresh_counter(name, self.opt, self.params, k)
        t0 = time.perf_counter()
        self.opt.step()  # cold start: eigh of every factor (Basis Rotation, SOAP); state allocation
        self.cold_start_s = time.perf_counter() - t0
        self.plain: list[float] = []
        self.refresh: list[float] = []
        self.every: list[float] = []

    def step(self) -> None:
        before = self.refreshes()
        t0 = time.perf_counter()
        self.opt.step()
        dt = time.perf_counter() - t0
        self.every.append(dt)
        (self.refresh if self.refreshes() > before else self.plain).append(dt)

    def result(self) -> dict[str, Any]:
        memory = optimizer_state_bytes(self.opt)
        return {"name": self.name, "k": self.k, "cold_start_s": self.cold_start_s, "plain_s": self.plain,
                "refresh_s": self.refresh, "all_s": self.every, "extra_per_param": memory["extra_per_param"],
                "state_bytes": memory["state_bytes"], "param_bytes": memory["param_bytes"]}


def time_interleaved(specs: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Times every (name, k, n_steps) optimizer in round-robin, one step each per round.

    Interleaving spreads any background load on the machine over all optimizers alike, so the
    ratios stay meaningful on a shared machine.
    """
    timed = []
    for name, k, n in specs:
        timed.append(Timed(name, k, n))
        print(f"  built {name} k={k} (cold start {timed[-1].cold_start_s:.1f} s)", flush=True)
    rounds = max(n for _, _, n in specs)
    for r in range(rounds):
        for t in timed:
            if len(t.every) < t.n_steps:
                t.step()
        print(f"  round {r + 1}/{rounds}", flush=True)
    return [t.result() for t in timed]


def summarize(runs: list[dict[str, Any]], ks: list[int]) -> dict[int, dict[str, Any]]:
    """Amortized per-step time for each k from the family's pooled plain and refresh steps.

    ``amortized = plain + (refresh - plain) / k``, once from the medians and once from the minima
    (the minimum is the better estimate of the intrinsic cost when other processes share the CPU).
    """
    plain = [t for r in runs for t in r["plain_s"]]
    refresh = [t for r in runs for t in r["refresh_s"]]
    out = {}
    for k in ks:
        run = next(r for r in runs if r["k"] == k)
        n = len(run["all_s"])
        whole_periods = n >= k and n % k == 0 and len(run["refresh_s"]) == n // k
        row: dict[str, Any] = {"cold_start_s": run["cold_start_s"], "extra_per_param": run["extra_per_param"],
                               "direct_ms": _ms(statistics.fmean(run["all_s"])) if whole_periods else None}
        for stat, fn in (("median", statistics.median), ("min", min)):
            p = fn(plain) if plain else None
            r = fn(refresh) if refresh else None
            amortized = r if p is None else p if r is None else p + (r - p) / k
            row[f"plain_ms_{stat}"], row[f"refresh_ms_{stat}"] = _ms(p), _ms(r)
            row[f"amortized_ms_{stat}"] = _ms(amortized)
        out[k] = row
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


#: The training-step comparison: AdamW first (the reference), Basis Rotation as the paper runs it (2nd,
#: bilateral), two cheaper members (sides ≤ 768 rotated, SOAP's max_precond_dim knob; unilateral: the
#: smaller side only; both change the preconditioner, see BasisRotation), and SOAP.
TRAIN_STEP_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("adamw", {}), ("basis-rotation", {}), ("br max_precond_dim=768", {"max_precond_dim": 768}),
    ("br unilateral", {"geometry": "unilateral"}), ("soap", {}),
]


def time_training_steps(k: int, steps: int, a: int, batch: int, seq_len: int) -> list[dict[str, Any]]:
    """Time of one local step (a x (F + B) + U) of a GPT-2-small block as a middle stage, per optimizer.

    AdamW, Basis Rotation (2nd, bilateral; matrices rotated, biases and norms AdamW), the cheaper members
    of ``TRAIN_STEP_VARIANTS`` and SOAP, each on its own copy of the stage, interleaved step by step. Returns mean and median over ``steps``
    steps after a cold-start step (with k = 10 and 10 steps, exactly one refresh is included).
    """
    from unbubble.models.gpt2 import GPTStage, make_config

    config = make_config("gpt2", vocab_size=257)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq_len, config.n_embd, generator=g)  # (B, T, C) from the previous stage
    grad_out = torch.randn(batch, seq_len, config.n_embd, generator=g) * 1e-3  # dL/d(output), next stage
    runs = []
    for name, options in TRAIN_STEP_VARIANTS:
        stage = GPTStage(config, range(1, 2), first=False, last=False, seed=0)
        params = [p for p in stage.parameters() if p.requires_grad]
        if name == "adamw":
            opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01)
        elif name == "soap":
            opt = soap_class()(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, precondition_frequency=k)
        else:
            matrices = [p for p in params if p.dim() == 2]
            rest = [p for p in params if p.dim() != 2]
            opt = BasisRotation([{"params": matrices}, {"params": rest, "rotate": False, "weight_decay": 0.0}],
                                lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, update_freq=k, **options)
        runs.append({"optimizer": name, "stage": stage, "opt": opt, "times": []})

    def one_step(run: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        for _ in range(a):
            run["stage"](x).backward(grad_out / a)
        run["opt"].step()
        run["opt"].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for run in runs:
        one_step(run)  # cold start
    for _ in range(steps):
        for run in runs:
            run["times"].append(one_step(run))
    return [{"optimizer": r["optimizer"], "k": k, "n": steps, "step_ms_mean": _ms(statistics.fmean(r["times"])),
             "step_ms_median": _ms(statistics.median(r["times"])), "step_ms_min": _ms(min(r["times"]))}
            for r in runs]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 10, 100], help="refresh intervals k")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (smoke check)")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--no-train-step", action="store_true", help="skip the training-step overhead part")
    parts.add_argument("--train-step-only", action="store_true", help="run only the training-step overhead part")
    parser.add_argument("--a", type=int, default=4, help="micro-batches per local step (PACI a; CPU demo: 4)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per micro-batch (CPU demo: 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (CPU demo: 128)")
    parser.add_argument("--out", default="bench_optim.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    soap_class()
    load_start = os.getloadavg()
    ks = sorted(set(args.ks))
    n_for = (lambda k: 2 if k == 1 else 3) if args.quick else (lambda k: 5 if k == 1 else (2 * k if k <= 10 else 6))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"block {BLOCK_SHAPES[0]}x4 + {BLOCK_SHAPES[4]} + {BLOCK_SHAPES[5]} "
          f"({sum(a * b for a, b in BLOCK_SHAPES) / 1e6:.2f}M params), k in {ks}", flush=True)

    results: dict[str, dict[int, dict[str, Any]]] = {}
    adamw_ms = adamw_min = None
    if not args.train_step_only:
        families = {"soap": ks, "br-2nd-bilateral": ks, **{f"br-{s}-{g}": ks for s, g in VARIANTS[1:]}}
        specs = [("adamw", 1, 5 if args.quick else 20)]
        specs += [(name, k, n_for(k)) for name, fam_ks in families.items() for k in fam_ks]
        runs = time_interleaved(specs)
        adamw_ms = _ms(statistics.median(runs[0]["all_s"]))
        results = {
            name: summarize([r for r in runs if r["name"] == name], fam_ks) for name, fam_ks in families.items()
        }

        adamw_min = _ms(min(runs[0]["all_s"]))
        print("\nOptimizer step, one GPT-2-small block. amortized = plain + (refresh - plain) / k, from medians "
              "(and minima); direct = measured mean over whole refresh periods; ratios at equal k")
        header = (f"{'optimizer':<18}{'k':>4}{'plain ms':>10}{'refresh ms':>11}{'amort. ms':>10}{'(min)':>8}"
                  f"{'direct':>8}{'x AdamW':>9}{'(min)':>7}{'x SOAP':>8}{'(min)':>7}{'mem':>7}")
        print(header)
        print("-" * len(header))
        print(f"{'adamw':<18}{'-':>4}{adamw_ms:>10.1f}{'-':>11}{adamw_ms:>10.1f}{adamw_min:>8.1f}{adamw_ms:>8.1f}"
              f"{1.0:>8.1f}x{1.0:>6.1f}x{'-':>8}{'-':>7}{0.0:>6.1f}x")
        for name, per_k in results.items():
            for k, r in per_k.items():
                soap = results["soap"][k]
                r["x_adamw_median"] = r["amortized_ms_median"] / adamw_ms
                r["x_adamw_min"] = r["amortized_ms_min"] / adamw_min
                r["x_soap_median"] = r["amortized_ms_median"] / soap["amortized_ms_median"]
                r["x_soap_min"] = r["amortized_ms_min"] / soap["amortized_ms_min"]
                print(f"{name:<18}{k:>4}{_f(r['plain_ms_median'], 10)}{_f(r['refresh_ms_median'], 11)}"
                      f"{r['amortized_ms_median']:>10.1f}{r['amortized_ms_min']:>8.1f}{_f(r['direct_ms'], 8, '.0f')}"
                      f"{r['x_adamw_median']:>8.1f}x{r['x_adamw_min']:>6.1f}x{r['x_soap_median']:>7.2f}x"
                      f"{r['x_soap_min']:>6.2f}x{r['extra_per_param']:>6.1f}x")

    train: list[dict[str, Any]] = []
    if not args.no_train_step:
        steps = 3 if args.quick else 10
        train = time_training_steps(10, steps, args.a, args.micro_batch_size, args.seq_len)
        base = train[0]
        print(f"\nTraining step of a GPT-2-small block as a middle stage: a={args.a} micro-batches of "
              f"{args.micro_batch_size}x{args.seq_len} tokens (F+B each) + update, k=10 ({steps} steps, "
              f"one refresh included in the mean)")
        print(f"{'optimizer':<24}{'mean ms':>9}{'min ms':>9}{'overhead vs AdamW (mean)':>26}{'(min)':>8}")
        for t in train:
            t["overhead_vs_adamw_mean"] = t["step_ms_mean"] / base["step_ms_mean"] - 1
            t["overhead_vs_adamw_min"] = t["step_ms_min"] / base["step_ms_min"] - 1
            print(f"{t['optimizer']:<24}{t['step_ms_mean']:>9.0f}{t['step_ms_min']:>9.0f}"
                  f"{100 * t['overhead_vs_adamw_mean']:>25.0f}%{100 * t['overhead_vs_adamw_min']:>7.0f}%")

    load_end = os.getloadavg()
    if load_start[0] > 1.0 or load_end[0] > torch.get_num_threads() + 1.0:  # this run itself adds ~threads
        print(f"\nwarning: 1-min load average {load_start[0]:.1f} before, {load_end[0]:.1f} after, on "
              f"{os.cpu_count()} CPUs: other processes competed for the CPU; prefer the (min) columns")
    report = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": load_end,
        "block_shapes": BLOCK_SHAPES, "adamw_step_ms_median": adamw_ms, "adamw_step_ms_min": adamw_min,
        "optimizers": {name: {str(k): v for k, v in per_k.items()} for name, per_k in results.items()},
        "training_step": train,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}")
    return report


def _f(value: float | None, width: int, fmt: str = ".1f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


if __name__ == "__main__":
    main()
