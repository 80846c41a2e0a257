"""Summaries of a run's action trace shared by the TensorBoard logger and ``unbubble report``.

All functions take a :class:`~unbubble.sim.engine.Trace` (a finished run's ``RunResult.trace``, or
``unbubble.sim.measured.load_run(run_dir).trace`` read back from ``actions.jsonl``); times are seconds.
"""

from __future__ import annotations

import bisect

import numpy as np

from unbubble.sim.engine import Trace

_U = 4  # kind index of U in Trace rows


def utilization_timeline(trace: Trace, edges: np.ndarray | list[float] | None = None,
                         bins: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Busy fraction of every rank in consecutive time windows.

    Args:
        trace: the run.
        edges: window boundaries in seconds, increasing (``len = windows + 1``); default ``bins``
            equal windows from 0 to the makespan.
        bins: number of equal windows when ``edges`` is not given.

    Returns:
        ``(edges (W + 1,), utilization (ranks, W))``: the fraction of each window, in [0, 1], during
        which the rank executed an action (stage s runs on rank ``s % ranks``).
    """
    if edges is None:
        edges = np.linspace(0.0, max(trace.makespan, 1e-12), bins + 1)
    edges = np.asarray(edges, dtype=float)
    width = np.diff(edges)
    busy = np.zeros((trace.ranks, len(width)))
    nr = trace.ranks
    e = edges.tolist()
    for s, _, _, start, end, _, _ in trace.rows():
        if end <= start:
            continue
        j = max(bisect.bisect_right(e, start) - 1, 0)
        while j < len(width) and e[j] < end:
            busy[s % nr, j] += max(0.0, min(end, e[j + 1]) - max(start, e[j]))
            j += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        util = np.where(width > 0, busy / np.where(width > 0, width, 1.0), 0.0)
    return edges, np.clip(util, 0.0, 1.0)


def step_ends(trace: Trace) -> list[float]:
    """End time of each optimizer step: the end of the last stage's ``U`` number 1, 2, … (seconds)."""
    last = trace.n_stages - 1
    return [end for s, k, _, _, end, _, _ in trace.rows() if s == last and k == _U]


def step_utilization(trace: Trace) -> tuple[list[int], np.ndarray]:
    """Per-rank utilization within each optimizer step (windows between the last stage's updates).

    Returns:
        ``(steps [1..T], utilization (ranks, T))``; empty when the last stage made no update.
    """
    ends = sorted(step_ends(trace))
    if not ends:
        return [], np.zeros((trace.ranks, 0))
    _, util = utilization_timeline(trace, edges=[0.0, *ends])
    return list(range(1, len(ends) + 1)), util


def drift_values(trace: Trace) -> list[list[int]]:
    """Per stage, Δ = v_B − v_F of every micro-batch's backward (B or I), in trace order."""
    out: list[list[int]] = [[] for _ in range(trace.n_stages)]
    for (stage, _), d in sorted(trace.drift().items()):
        out[stage].append(d)
    return out
