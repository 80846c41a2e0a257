"""Does Basis Rotation's robustness to pipeline delay carry over to a mixture of experts?

Basis Rotation (arXiv 2602.03515) reports that its method "generalizes to MoE". ``moe-delay`` trains the
mixture-of-experts CPU preset and its dense twin (the same Llama-style decoder with one SwiGLU of equal
parameters per block) with AdamW, PipeDream-LR and Basis Rotation, without delay (N = 1) and under
PipeDream's stashed delays τ_s = N − 1 − s at N = 8, every method at its own tuned lr (sweep protocol of
``experiments.sweep``: lr grid on the first seed, the other seeds at the tuned lr, equal tokens). The delay
penalty of a method is its final validation loss at N = 8 minus that at N = 1 (means over seeds); the
claim holds here if Basis Rotation's penalty on the MoE model is as small, relative to AdamW's, as on the
dense one. Basis Rotation rotates each expert of the 3-D expert tensors in its own bases ([Note: batches
of matrices] in docs/architecture.md).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from unbubble.experiments.common import ExperimentOutput, experiment, md_table, provenance, say, write_csv
from unbubble.experiments.stats import mean_std
from unbubble.experiments.sweep import SweepSpec, raw_tables, run_sweep, tuned_lrs

log = logging.getLogger(__name__)

MODELS = {"moe": "moe-deep-cpu", "dense": "llama-deep-cpu"}
OPTIMIZERS = ("adamw", "pipedream-lr", "basis-rotation")


def moe_delay_spec(size: str, seeds: list[int] | None = None) -> dict[str, Any]:
    """The sweep: per model, AdamW and Basis Rotation at N ∈ {1, 8}, PipeDream-LR at N = 8 (at N = 1 it is
    AdamW); schedule ``pipedream`` (stashed, Δ = 0, τ_s = N − 1 − s)."""
    tiny = size == "tiny"
    methods = []
    for kind, model in MODELS.items():
        for opt in OPTIMIZERS:
            methods.append({"label": f"{kind} {opt}", "model": model, "optimizer": opt,
                            "stages": [2] if tiny else ([8] if opt == "pipedream-lr" else [1, 8])})
    return {
        "name": "moe-delay", "micro_batches": 8 if tiny else 480, "stages": [1, 8],
        "lrs": [3e-3, 1e-2] if not tiny else [1e-2], "seeds": seeds or ([0] if tiny else [0, 1, 2]),
        "evals": 2 if tiny else 4,
        "base": {"optimizer": "adamw", "schedule": "pipedream", "seq_len": 16 if tiny else 64, "micro_batch_size": 4 if tiny else 8,
                 "warmup_frac": 0.1, "warmup_min": 0, "min_lr_ratio": 0.1, "eval_batches": 2 if tiny else 8},
        "methods": methods,
    }


def _router(out: Path, run_id: str) -> dict[str, Any] | None:
    path = out / "runs" / run_id / "summary.json"
    return json.loads(path.read_text()).get("router") if path.is_file() else None


@experiment("moe-delay", "AdamW, PipeDream-LR and Basis Rotation under stashed delay (N = 8) on the MoE preset "
                         "and its dense twin")
def moe_delay(out: Path, size: str = "default", seeds: list[int] | None = None) -> ExperimentOutput:
    t0 = time.perf_counter()
    spec = SweepSpec.from_dict(moe_delay_spec(size, seeds))
    records = run_sweep(spec, out, workers=2, progress=say)
    best = tuned_lrs(records)
    deep = max(spec.stages) if size != "tiny" else 2
    rows, table, penalty = [], [], {}
    for kind in MODELS:
        for opt in OPTIMIZERS:
            label = f"{kind} {opt}"
            row: dict[str, Any] = {"model": MODELS[kind], "optimizer": opt}
            means = {}
            for n in (1, deep):
                lr = best.get((label, n))
                runs = [r for r in records if r["method"] == label and r["stages"] == n and r["lr"] == lr]
                losses = [r["final_val_loss"] for r in runs if r["final_val_loss"] is not None]
                if not runs:
                    row[f"N={n}"] = "—"
                    continue
                mean, std = mean_std(losses) if losses else (float("nan"), float("nan"))
                means[n] = mean
                spread = f" ± {std:.4f}" if len(losses) > 1 else ""  # one seed has no spread
                row[f"N={n}"] = f"{mean:.4f}{spread} (lr {lr:g}, {len(losses)} seed{'s' * (len(losses) != 1)})"
                if kind == "moe" and n == deep:
                    stats = _router(out, runs[0]["run_id"])
                    if stats:
                        row["router max load / dropped"] = (f"{stats['max_load']:.2f} / "
                                                            f"{100 * stats['mean_dropped_frac']:.1f} %")
                table.append({"model": MODELS[kind], "optimizer": opt, "stages": n, "lr": lr,
                              "losses": json.dumps(losses), "mean": mean})
            if 1 in means and deep in means:
                penalty[(kind, opt)] = means[deep] - means[1]
            row["delay penalty"] = f"{penalty[(kind, opt)]:+.4f}" if (kind, opt) in penalty else \
                ("— (N = 1 is AdamW)" if opt == "pipedream-lr" else "— (no N = 1 run)")
            row.setdefault("router max load / dropped", "—")
            rows.append(row)
    files = [write_csv(out / "moe_delay.csv", table)]
    wall = time.perf_counter() - t0
    md = (f"## moe-delay (Basis Rotation on a mixture of experts), N = 1 vs {deep}\n\n"
          f"Final validation loss (nats/token, byte-level KJV), mean ± sample std over seeds at each method's tuned "
          f"lr ({', '.join(f'{x:g}' for x in spec.lrs)} tried on seed {spec.seeds[0]}, one step beyond when the best was at "
          f"the edge); {spec.micro_batches} micro-batches of {spec.base['micro_batch_size']} × {spec.base['seq_len']} "
          f"tokens per run, warm-up {spec.base['warmup_frac']:.0%}, cosine to {spec.base['min_lr_ratio']:.0%}; schedule "
          f"pipedream (stashed weights, τ_s = N − 1 − s). Models: `moe-deep-cpu` (8 blocks, 4 experts, top-2, "
          "capacity factor 1.25, load-balancing coefficient 0.01) and `llama-deep-cpu` (the same decoder, one "
          f"SwiGLU of equal parameters). Delay penalty = mean at N = {deep} − mean at N = 1. Router statistics: "
          f"whole run of the seed-0 run at N = {deep} (max over blocks and experts of E × an expert's share; mean share of "
          "assignments dropped past capacity).\n\n"
          + md_table(rows) + "\n\n"
          "Paper (Basis Rotation, arXiv 2602.03515): the method generalizes to mixture-of-experts models.\n\n"
          + _verdict(penalty, deep) + "\n\n"
          + provenance(f"unbubble experiment moe-delay --size {size}", spec.seeds, wall,
                       engine="emulator, 2 runs at once on 1 torch thread each"))
    return ExperimentOutput("moe-delay", md, files, wall, data=raw_tables(out))


def _verdict(penalty: dict[tuple[str, str], float], deep: int) -> str:
    """One sentence per model: Basis Rotation's delay penalty beside AdamW's."""
    parts = []
    for kind in MODELS:
        br, adamw = penalty.get((kind, "basis-rotation")), penalty.get((kind, "adamw"))
        if br is None or adamw is None:
            continue
        parts.append(f"{MODELS[kind]}: Basis Rotation {br:+.4f} against AdamW {adamw:+.4f}")
    return f"Ours (delay penalty, N = 1 → {deep}): " + ("; ".join(parts) if parts else "not measured") + "."
