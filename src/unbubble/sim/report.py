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
    """How a row key is shown: header text and a formatter (the CSV keeps raw values)."""

    key: str
    header: str
    fmt: Callable[[Any], str] = str


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
    Column("ranks", "devices"),
    Column("micro_batches", "micro-batches"),
    Column("makespan_s", "makespan (s)", _secs),
    Column("steady_samples_per_s", "samples/s (steady)", _num(2)),
    Column("steady_samples_per_s_per_device", "samples/s/device", _num(3)),
    Column("steady_tokens_per_s", "tokens/s (steady)", _num(0)),
    Column("speedup", "× first", _num(3)),
    Column("mean_bubble", "bubble (mean)", _pct),
    Column("max_bubble", "bubble (worst)", _pct),
    Column("max_drift", "max Δ"),
    Column("max_delay", "max τ"),
    Column("peak_memory_bytes", "peak GB", _gb),
    Column("fits", "fits", _fits),
]

STAGE_COLUMNS = [
    Column("rank", "device"),
    Column("stages", "stages"),
    Column("utilization", "utilization", _pct),
    Column("bubble", "bubble", _pct),
    Column("max_drift", "max Δ"),
    Column("max_delay", "max τ"),
    Column("weights", "weights GB", _gb),
    Column("grads", "grads GB", _gb),
    Column("optimizer", "optimizer GB", _gb),
    Column("activations", "activations GB", _gb),
    Column("stash", "stash GB", _gb),
    Column("peak", "peak GB", _gb),
    Column("peak_in_flight", "in flight"),
    Column("peak_versions", "versions"),
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
        stages = list(range(r, n, nr))
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


def to_rich(rows: Sequence[dict], columns: Sequence[Column], title: str = ""):
    """A ``rich.table.Table`` for the terminal."""
    from rich.table import Table

    cols = _present(rows, columns)
    table = Table(title=title or None, show_lines=False)
    for c in cols:
        table.add_column(c.header, justify="left" if c.key in ("schedule", "stages") else "right")
    for r in rows:
        table.add_row(*(c.fmt(r.get(c.key)) for c in cols))
    return table


def render(rows: Sequence[dict], columns: Sequence[Column], fmt: str, title: str = ""):
    """``fmt`` ∈ {table, markdown, csv}: a rich table, or text."""
    if fmt == "markdown":
        return (f"### {title}\n\n" if title else "") + to_markdown(rows, columns)
    if fmt == "csv":
        return to_csv(rows, columns)
    return to_rich(rows, columns, title)
