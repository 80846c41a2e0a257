"""Pictures of a trace: a timeline PNG (a row per device, as in the papers' figures) and a Chrome trace.

Colours follow the Zero Bubble paper's figures (arXiv 2401.10241, Fig. 2–3): F blue, B (full backward)
teal, I (input gradient) green, W (weight gradient) dark green, U (optimizer step) gold. Each box is
labelled with its micro-batch id when it is wide enough; boxes of later virtual stages (interleaved
1F1B) are drawn lighter and labelled ``k.c`` (micro-batch k, chunk c).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from unbubble.sim.engine import Trace

KIND_COLORS = {0: "#4C72B0", 1: "#2A9D8F", 2: "#55A868", 3: "#1F5130", 4: "#E9C46A"}  # F B I W U
KIND_NAMES = "FBIWU"


def window_end(trace: Trace, mb_per_step: int, steps: int = 2) -> float:
    """End time (s) of the last action that touches one of the first ``steps`` steps' micro-batches
    (at least 2·N of them), so a timeline shows the fill and a steady stretch."""
    k_max = max(steps * mb_per_step, 2 * trace.ranks)
    return max((r[4] for r in trace.rows() if 0 <= r[2] < k_max), default=trace.makespan)


def timeline_png(trace: Trace, path: str | Path, *, title: str = "", t_end: float | None = None,
                 dpi: int = 110) -> Path:
    """Draws actions that start before ``t_end`` (default: the whole run) to a PNG.

    Args:
        trace: the run.
        path: output file.
        title: figure title.
        t_end: right edge of the window (seconds).
        dpi: resolution.

    Returns:
        The path written.
    """
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t_end = trace.makespan if t_end is None else t_end
    nr = trace.ranks
    fig_w = 14.0
    fig, ax = plt.subplots(figsize=(fig_w, 0.45 * nr + 1.4))
    px_per_s = fig_w * dpi * 0.85 / max(t_end, 1e-12)
    spans: dict[tuple[int, bool], dict[int, list[tuple[float, float]]]] = {}  # (kind, later chunk) -> rank -> boxes
    labels = []
    for s, k, mb, start, end, _, _ in trace.rows():
        if start >= t_end:
            continue
        r, chunk = s % nr, s // nr
        spans.setdefault((k, chunk % 2 == 1), {}).setdefault(r, []).append((start, end - start))
        text = f"{mb}.{chunk}" if nr < trace.n_stages else str(mb)
        if mb >= 0 and (end - start) * px_per_s >= 4.5 * len(text):
            labels.append((start + (end - start) / 2, r, text))
    for (k, light), per_rank in spans.items():
        for r, boxes in per_rank.items():
            ax.broken_barh(boxes, (r - 0.4, 0.8), facecolors=KIND_COLORS[k], edgecolor="white", linewidth=0.3,
                           alpha=0.55 if light else 1.0)
    fontsize = max(4.0, min(8.0, 80.0 / max(nr, 1)))
    for x, r, text in labels:
        ax.text(x, r, text, ha="center", va="center", fontsize=fontsize, color="white")
    ax.set_ylim(nr - 0.5, -0.5)
    ax.set_yticks(range(nr))
    ax.set_yticklabels([f"device {r}" for r in range(nr)], fontsize=8)
    ax.set_xlim(0, t_end)
    ax.set_xlabel("simulated time (s)")
    present = sorted({k for k, _ in spans})
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in present],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(present), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def chrome_trace(trace: Trace, path: str | Path, *, name: str = "unbubble") -> Path:
    """Writes a Chrome-trace JSON (open in ``chrome://tracing`` or https://ui.perfetto.dev).

    One complete event (``ph: "X"``) per action, microseconds, a thread per device; ``args`` hold the
    stage, micro-batch, kind, weight version and the version the action computed with.
    """
    events: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": name}}]
    for r in range(trace.ranks):
        events.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": f"device {r}"}})
        events.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}})
    nr = trace.ranks
    for s, k, mb, start, end, ver, w in trace.rows():
        label = f"{s}{KIND_NAMES[k]}{'' if mb < 0 else mb}"
        events.append({"name": label, "cat": KIND_NAMES[k], "ph": "X", "pid": 0, "tid": s % nr,
                       "ts": start * 1e6, "dur": (end - start) * 1e6,
                       "args": {"stage": s, "mb": None if mb < 0 else mb, "version": ver, "weights": w}})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
