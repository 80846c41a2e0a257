"""Tables of simulated (and measured) runs: one row per schedule, one per device, drift histograms.

Rows are plain dicts with SI values (seconds, bytes, fractions); a :class:`Column` knows how to
print its key. The same rows render to the terminal (rich), markdown and CSV, so the three always agree.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unbubble.sim.result import SimResult


@dataclass(frozen=True)
class Column:
    """How a row key is shown: header text and a formatter (the CSV keeps raw values).

    Attributes:
        hide: the order in which a terminal too narrow for the whole table hides this column
            (1 first; 0: always shown). Markdown and CSV keep every column.
    """

    key: str
    header: str
    fmt: Callable[[Any], str] = str
    hide: int = 0


def _num(digits: int) -> Callable[[Any], str]:
    return lambda v: "—" if v is None else f"{v:,.{digits}f}"


def _pct(v: Any) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _gb(v: Any) -> str:
    return "—" if v is None else f"{v / 1e9:.2f}"


def _secs(v: Any) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}"


def _fits(v: Any) -> str:
    return "—" if v is None else ("yes" if v else "NO")


SUMMARY_COLUMNS = [
    Column("schedule", "schedule"),
    Column("ranks", "devices", hide=1),
    Column("micro_batches", "micro-batches", hide=2),
    Column("makespan_s", "makespan (s)", _secs, hide=4),
    Column("steady_samples_per_s", "samples/s (steady)", _num(2), hide=7),
    Column("steady_samples_per_s_per_device", "samples/s/device", _num(3), hide=3),
    Column("steady_tokens_per_s", "tokens/s (steady)", _num(0), hide=9),
    Column("speedup", "× first", _num(3)),
    Column("clip_scope", "clip", hide=12),
    Column("vs_no_barrier", "× no barrier", _num(3)),
    Column("mean_bubble", "bubble (mean)", _pct),
    Column("max_bubble", "bubble (worst)", _pct, hide=6),
    Column("max_drift", "max Δ", hide=10),
    Column("max_delay", "max τ", hide=5),
    Column("peak_memory_bytes", "peak GB", _gb, hide=11),
    Column("fits", "fits", _fits, hide=8),
]

STAGE_COLUMNS = [
    Column("rank", "device"),
    Column("stages", "stages", hide=1),
    Column("utilization", "utilization", _pct, hide=9),
    Column("bubble", "bubble", _pct),
    Column("max_drift", "max Δ", hide=10),
    Column("max_delay", "max τ", hide=4),
    Column("weights", "weights GB", _gb, hide=7),
    Column("grads", "grads GB", _gb, hide=6),
    Column("optimizer", "optimizer GB", _gb, hide=8),
    Column("activations", "activations GB", _gb, hide=11),
    Column("stash", "stash GB", _gb, hide=5),
    Column("peak", "peak GB", _gb),
    Column("peak_in_flight", "in flight", hide=3),
    Column("peak_versions", "versions", hide=2),
]


def summary_rows(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """One row per result; ``speedup`` is steady throughput relative to the first result."""
    rows = [r.summary() for r in results]
    base = rows[0]["steady_samples_per_s"] if rows else None
    for row in rows:
        row["speedup"] = row["steady_samples_per_s"] / base if base else None
    return rows


def stage_rows(result: SimResult) -> list[dict[str, Any]]:
    """One row per device: utilization, drift and the memory split (bytes)."""
    nr, n = result.n_ranks, result.schedule.n_stages
    util = result.utilization()
    drift, delay = result.trace.max_drift(), result.trace.max_delay()
    rows = []
    for r in range(nr):
        stages = result.trace.stages_of(r)
        row: dict[str, Any] = {
            "schedule": result.label, "rank": r, "stages": " ".join(map(str, stages)),
            "utilization": util[r], "bubble": 1 - util[r],
            "max_drift": max(drift[s] for s in stages), "max_delay": max(delay[s] for s in stages),
        }
        if result.memory is not None:
            m = result.memory[r]
            row.update(weights=m.weights, grads=m.grads, optimizer=m.optimizer + m.extra, activations=m.activations,
                       stash=m.stash, peak=m.peak, peak_in_flight=m.peak_in_flight, peak_versions=m.peak_versions)
        rows.append(row)
    return rows


def drift_rows(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """``schedule, stage, drift, micro_batches`` for every Δ value seen (the drift histogram per stage)."""
    out = []
    for res in results:
        for s, hist in enumerate(res.trace.drift_histogram()):
            for d in sorted(hist):
                out.append({"schedule": res.label, "stage": s, "drift": d, "micro_batches": hist[d]})
    return out


def _present(rows: Sequence[dict], columns: Sequence[Column]) -> list[Column]:
    """The columns some row has a value for."""
    return [c for c in columns if any(r.get(c.key) is not None for r in rows)]


def to_markdown(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A GitHub markdown table (columns absent from every row are dropped)."""
    cols = _present(rows, columns)
    lines = ["| " + " | ".join(c.header for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c.fmt(r.get(c.key)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[dict], columns: Sequence[Column] | None = None) -> str:
    """CSV text with raw values (seconds, bytes, fractions) and the row keys as header."""
    keys = [c.key for c in _present(rows, columns)] if columns else list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k) for k in keys})
    return buf.getvalue()


def _widths(rows: Sequence[dict], cols: Sequence[Column]) -> list[tuple[int, int]]:
    """``(narrowest, widest)`` text width of each column: headers and labels wrapped at every space, or
    not wrapped (numbers never wrap)."""
    out = []
    for c in cols:
        texts = [c.header] + [c.fmt(r.get(c.key)) for r in rows]
        out.append((max(len(w) for t in texts for w in t.split()), max(len(t) for t in texts)))
    return out


def _border(n_cols: int) -> int:
    return 3 * n_cols + 1  # a space either side of every cell, a rule between and around them


def to_rich(rows: Sequence[dict], columns: Sequence[Column], title: str = "", width: int | None = None):
    """A ``rich.table.Table`` for the terminal.

    Args:
        width: characters available: columns are hidden in their :attr:`Column.hide` order until the
            table fits with wrapped headers, a caption names them, and the widest columns give up
            characters until the table is at most ``width`` wide. ``None``: every column, unwrapped.
    """
    from rich.table import Table

    cols = _present(rows, columns)
    hidden: list[Column] = []
    if width is not None:
        for c in sorted((c for c in cols if c.hide), key=lambda c: c.hide):
            if sum(lo for lo, _ in _widths(rows, cols)) + _border(len(cols)) <= width:
                break
            cols.remove(c)
            hidden.append(c)
    limits = _widths(rows, cols)
    sizes = [hi for _, hi in limits]
    while width is not None and sum(sizes) + _border(len(cols)) > width:
        j = max(range(len(cols)), key=lambda j: (sizes[j] > limits[j][0], sizes[j]))
        if sizes[j] <= limits[j][0]:
            break  # only the always-shown columns are left and they do not fit: let the terminal wrap
        sizes[j] -= 1
    caption = f"hidden to fit {width} columns: {', '.join(c.header for c in hidden)} (--wide shows them)" \
        if hidden else None
    table = Table(title=title or None, caption=caption, show_lines=False, width=sum(sizes) + _border(len(cols)))
    for c, size in zip(cols, sizes):
        table.add_column(c.header, justify="left" if c.key in ("schedule", "stages") else "right", width=size)
    for r in rows:
        table.add_row(*(c.fmt(r.get(c.key)) for c in cols))
    return table


def render(rows: Sequence[dict], columns: Sequence[Column], fmt: str, title: str = "", width: int | None = None):
    """``fmt`` ∈ {table, markdown, csv}: a rich table (fitted to ``width`` characters, see :func:`to_rich`),
    or text."""
    if fmt == "markdown":
        return (f"### {title}\n\n" if title else "") + to_markdown(rows, columns)
    if fmt == "csv":
        return to_csv(rows, columns)
    return to_rich(rows, columns, title, width)


def stage_parts(stage: int, n_stages: int, layers: Sequence[range]) -> str:
    """What stage ``stage`` of ``n_stages`` holds: ``embedding + blocks 0–2``, ``block 23 + LM head``."""
    r = layers[stage]
    parts = ["embedding"] if stage == 0 else []
    if len(r) == 1:
        parts.append(f"block {r.start}")
    elif len(r) > 1:
        parts.append(f"blocks {r.start}–{r.stop - 1}")
    if stage == n_stages - 1:
        parts.append("LM head")
    return " + ".join(parts)


def bottleneck_line(result: SimResult, layers: Sequence[range] | None = None, min_bubble: float = 0.10) -> str | None:
    """Why a schedule idles: the device with the most work, when the mean bubble exceeds ``min_bubble``.

    Work is the busy time of every device in the trace (its F, B, I, W and U); if the busiest does
    r× the mean device's work, the others wait for it and at least 1 − 1/r of the mean device's
    time is idle whatever the schedule; the rest of the bubble is the schedule's fill, drain and flushes.

    Args:
        result: a simulated run.
        layers: block indices of each stage (``AnalyticModel.stage_layers``, or a run's summary), to name
            what the busiest stage holds and show the split; ``None`` if unknown.
        min_bubble: returns ``None`` at or below this mean bubble.

    Returns:
        One line (``None`` when the bubble is small), e.g. ``stage 7 is the bottleneck: block 23 + LM head, …``.
    """
    util = result.utilization()
    bubble = 1.0 - sum(util) / len(util)
    if not bubble > min_bubble:
        return None
    busy = result.trace.busy_per_rank()
    nr, n = len(busy), result.schedule.n_stages
    mean = sum(busy) / nr
    r = max(range(nr), key=busy.__getitem__)
    ratio = busy[r] / mean if mean > 0 else 1.0
    head = f"{result.label}: {bubble:.1%} mean bubble"
    if ratio < 1.02:
        return f"{head}, every device does the same work (±2 %): the bubble is the schedule's fill, drain and flushes"
    stages = result.trace.stages_of(r)
    who = f"stage {r}" if nr == n else f"device {r} (stages {', '.join(map(str, stages))})"
    what = ""
    if layers is not None and len(layers) == n:
        split = ",".join(str(len(x)) for x in layers)
        what = f"{'; '.join(stage_parts(s, n, layers) for s in stages)} (blocks per stage {split}), "
    return (f"{head}; {who} is the bottleneck: {what}{busy[r] / sum(busy):.1%} of the work, {ratio:.2f}× the mean "
            f"{'stage' if nr == n else 'device'}: the others wait for it (imbalance alone: {1 - 1 / ratio:.1%} bubble)")


def barrier_line(result: SimResult, without: SimResult | None = None) -> str | None:
    """What the run's per-update global operation cost ([Note: the barrier] in docs/architecture.md):
    the throughput against the same schedule without it, the share of time the devices idled waiting
    for the all-reduce, and for ``stale`` the norm's lag. ``None`` without an active global operation."""
    op, log = result.global_op, result.trace.global_op_log
    if op is None or log is None:
        return None
    waits = [0.0] * result.n_ranks
    for (r, _), w in log.waits().items():
        waits[r] += w
    span = result.makespan_s or 1.0
    worst = max(range(len(waits)), key=waits.__getitem__)
    vs = (f"{result.steady_samples_per_s / without.steady_samples_per_s:.3f}× its steady throughput without it; "
          if without is not None else "")
    lag = f"stale clips update t with the global norm of update t − {log.lag}; " if op.scope == "stale" else ""
    what = {"sync": "a blocking gradient-norm all-reduce per update", "stale": "a non-blocking gradient-norm "
            "all-reduce per update", "stage": "a local gradient norm per update, no all-reduce"}[op.scope]
    return (f"{result.label}: {what} (latency {op.latency_s * 1e6:.3g} µs); {vs}{lag}devices idle waiting for it "
            f"{sum(waits) / len(waits) / span:.1%} of the run on average (device {worst}: {waits[worst] / span:.1%})")
