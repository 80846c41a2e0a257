"""``clip-study``: what global gradient clipping costs in quality
(docs/architecture.md#global-operations-are-barriers). 1F1B-flush + Muon with the exact global clip against
PACI + Muon + error feedback with each clip scope (``sync``, ``stale``, ``stage``) and without clipping, N = 8,
600 updates, clip 1.0 (:func:`~unbubble.experiments.study_specs.clip_study_spec`).

One resumable sweep; the unclipped rows are reused from horizon-study's published runs of
identical settings. The table gives each row's final validation loss (mean ± std over seeds, with
the min–max), its gap to flush + clip ``sync`` and to unclipped flush, and the share of updates the
clip was active on (from each run's ``summary.json``: a clip that never acts measures nothing).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from unbubble.experiments.common import ExperimentOutput, experiment, provenance, say
from unbubble.experiments.study_specs import clip_study_spec, horizon_study_spec
from unbubble.experiments.sweep import SweepSpec, raw_tables, read_tables, reuse_runs, run_sweep, write_tables

#: horizon-study's published runs: its unclipped 1× rows are reused.
PUBLISHED = Path(__file__).resolve().parents[3] / "docs" / "data" / "horizon-study"


def clipped_share(out: Path, run_id: str) -> float | None:
    """Share of a run's stage-updates its clip scaled down (``summary.json``'s ``clip``), or None
    when the run folder or the entry is missing (reused runs, unclipped runs)."""
    path = out / "runs" / run_id / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    clip, done = summary.get("clip"), summary.get("steps_done") or 0
    if not clip or not done or not clip.get("clipped"):
        return None
    return sum(clip["clipped"]) / (done * len(clip["clipped"]))


def rows(out: Path, size: str) -> list[dict[str, Any]]:
    """One row per method that finished (final val loss mean ± std and min–max, gaps, clip share)."""
    from unbubble.experiments.stats import mean_std

    spec = clip_study_spec(size)
    data = read_tables(out)
    best: dict[str, tuple[float, float]] = {}  # the tuned lr: the best seed-0 run of the method at budget 1
    for r in data.runs:
        if r["seed"] == spec["seeds"][0] and r["budget"] == 1.0 and r["final_val_loss"] is not None:
            if r["method"] not in best or r["final_val_loss"] < best[r["method"]][0]:
                best[r["method"]] = (r["final_val_loss"], r["lr"])
    lrs = {m: lr for m, (_, lr) in best.items()}
    finals = {m: [r for r in data.runs if r["method"] == m and r["lr"] == lr and r["budget"] == 1.0]
              for m, lr in lrs.items()}
    means = {m: statistics.fmean(r["final_val_loss"] for r in rs) for m, rs in finals.items() if rs}
    flush = spec["methods"][0]["label"]
    flush_sync = spec["methods"][2]["label"]
    out_rows = []
    for m in spec["methods"]:
        rs = finals.get(m["label"])
        if not rs:
            continue
        losses = [r["final_val_loss"] for r in rs]
        mu, sd = mean_std(losses)
        shares = [s for r in rs if (s := clipped_share(out, r["run_id"])) is not None]
        out_rows.append({
            "method": m["label"], "scope": m.get("clip_scope", "none"), "lr": lrs[m["label"]], "seeds": len(rs),
            "final val loss": f"{mu:.4f} ± {sd:.4f} ({min(losses):.4f}–{max(losses):.4f})",
            "gap to flush + sync": f"{mu - means[flush_sync]:+.4f}" if flush_sync in means else "—",
            "gap to flush": f"{mu - means[flush]:+.4f}" if flush in means else "—",
            "updates clipped": f"{100 * statistics.fmean(shares):.0f} %" if shares else "—",
            "commits": ", ".join(sorted({r.get("commit") or "unrecorded" for r in rs})),
        })
    return out_rows


@experiment("clip-study", "global clipping's cost in quality: flush + sync against PACI + error feedback with "
                          "sync, stale, stage and none (N = 8, clip 1.0)")
def clip_study(out: Path, size: str = "default", seeds: list[int] | None = None, analyze: Path | None = None,
               workers: int = 2) -> ExperimentOutput:
    """What global clipping costs; see the module docstring."""
    from unbubble.experiments.common import md_table, write_csv

    t0 = time.perf_counter()
    folder = out if analyze is None else analyze
    if analyze is None:
        d = clip_study_spec(size)
        spec = SweepSpec.from_dict({**d, "seeds": list(seeds)} if seeds else d)
        if (PUBLISHED / "runs.csv").is_file():
            reused = reuse_runs(spec, out, PUBLISHED, SweepSpec.from_dict(horizon_study_spec(size, "main")))
            if reused:
                say(f"{spec.name}: {len(reused)} run(s) of identical settings reused from {PUBLISHED}")
        write_tables(run_sweep(spec, out, workers=workers, progress=say), out)
    table = rows(folder, size)
    data = read_tables(folder)
    run_wall = sum(r["wall_s"] for r in data.runs)
    md = ("## clip-study (what global clipping costs in quality), N=8\n\n" + (md_table(table) if table else "—")
          + "\n\n" + provenance(f"unbubble experiment clip-study --size {size}", sorted({r["seed"] for r in data.runs}),
                                time.perf_counter() - t0 if analyze is None else run_wall / workers,
                                engine=f"emulator, {len(data.runs)} runs, {workers} at a time on 1 torch thread each"))
    files = [write_csv(out / "clip_study.csv", table)] if table else []
    return ExperimentOutput("clip-study", md, files, time.perf_counter() - t0,
                            data=raw_tables(out) if analyze is None else [])
