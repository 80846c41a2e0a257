"""Measured cost model: per-stage durations and link latencies calibrated from a real run's telemetry.

A run folder (``unbubble train``) holds ``config.json`` (the schedule and its sizes) and
``actions.jsonl``: one line per executed action with its stage, kind, micro-batch, ``start_s`` and
``end_s`` (seconds since the run's common start) and weight versions (``unbubble.metrics``).

Notes: docs/architecture.md#simmeasuredpy.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbubble.errors import ConfigError
from unbubble.schedules.actions import Action
from unbubble.schedules.registry import Schedule, get_schedule
from unbubble.sim.costs import KIND_INDEX, PipelineCosts, StageCosts
from unbubble.sim.engine import ActionRecord, Trace, placement_of

if TYPE_CHECKING:
    from unbubble.sim.memory import MemorySpec

_F, _B, _I, _W, _U = range(5)


@dataclass
class MeasuredRun:
    """A finished run read back from its folder.

    Attributes:
        path: the run folder.
        config: ``config.json`` as a dict.
        summary: ``summary.json`` as a dict (empty if absent).
        schedule: the schedule rebuilt from the config.
        trace: the measured actions, times shifted so the first action starts at 0 s.
    """

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    schedule: Schedule
    trace: Trace

    @property
    def samples_per_mb(self) -> int:
        return int(self.config.get("micro_batch_size", 1))

    @property
    def tokens_per_mb(self) -> int | None:
        c = self.config
        return c["micro_batch_size"] * c["seq_len"] if "micro_batch_size" in c and "seq_len" in c else None


def load_run(run_dir: str | Path) -> MeasuredRun:
    """Reads ``config.json``, ``summary.json`` and ``actions.jsonl`` of a run folder.

    Raises:
        ConfigError: the folder or a needed file is missing or malformed (the message names it).
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"run_dir={str(path)!r} is not a folder: give the folder `unbubble train` wrote")
    for name in ("config.json", "actions.jsonl"):
        if not (path / name).is_file():
            raise ConfigError(f"{path / name} is missing: a run folder needs config.json and actions.jsonl")
    try:
        config = json.loads((path / "config.json").read_text())
        summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
        lines = [json.loads(line) for line in (path / "actions.jsonl").read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} holds malformed JSON ({exc}): it is not a run folder of unbubble train") from None
    if not lines:
        raise ConfigError(f"{path / 'actions.jsonl'} is empty: the run recorded no action")
    kwargs = {k: config[k] for k in ("a", "m", "v") if k in config}
    try:
        schedule = get_schedule(config["schedule"], config["stages"], steps=config["steps"], **kwargs)
    except KeyError as exc:
        raise ConfigError(f"{path / 'config.json'} lacks {exc}: it is not a run folder of unbubble train") from None
    t0 = min(rec["start_s"] for rec in lines)
    records = []
    for rec in lines:
        weights = rec.get("v_B")
        records.append(ActionRecord(Action.parse(rec["action"]), rec["start_s"] - t0, rec["end_s"] - t0,
                                    rec["version"], weights))
    records.sort(key=lambda r: (r.start, r.action.stage))
    return MeasuredRun(path, config, summary, schedule, Trace(schedule.n_stages, records, n_ranks=schedule.n_ranks, placement=placement_of(schedule)))


def send_times(trace: Trace) -> list[float]:
    """Seconds a stage is held by sending one message (see "Blocking sends" above); 0 where unknown."""
    n = trace.n_stages
    prev: dict[int, tuple[int, float]] = {}
    gaps: list[list[float]] = [[] for _ in range(n)]
    for s, k, _, t0, t1, _, _ in trace.rows():
        if k == _U and s in prev and prev[s][0] in (_B, _I, _W):
            gaps[s].append(t0 - prev[s][1])
        prev[s] = (k, t1)
    base = statistics.median(gaps[0]) if gaps[0] else 0.0
    out = [max(0.0, statistics.median(g) - base) if g and s > 0 else None for s, g in enumerate(gaps)]
    known = [x for x in out if x is not None]
    fill = statistics.median(known) if known else 0.0
    return [fill if x is None else x for x in out]


def measured_costs(trace: Trace, blocking_sends: bool = True, statistic: str = "mean") -> PipelineCosts:
    """Per-stage median durations and per-boundary latencies of a measured trace (see the module docstring).

    Args:
        trace: a measured run (``load_run(...).trace``).
        blocking_sends: add each stage's send time (:func:`send_times`) to the actions that send.
        statistic: ``"mean"`` or ``"median"`` duration per stage and kind.

    Raises:
        ConfigError: a stage ran no forward or no backward (nothing to calibrate from), or an
            unknown statistic.
    """
    if statistic not in ("mean", "median"):
        raise ConfigError(f"statistic={statistic!r} is invalid: use 'mean' or 'median'")
    stat = statistics.fmean if statistic == "mean" else statistics.median
    n = trace.n_stages
    durations: list[list[list[float]]] = [[[] for _ in range(5)] for _ in range(n)]
    start: dict[tuple[int, int, int], float] = {}
    end: dict[tuple[int, int, int], float] = {}
    for s, k, mb, t0, t1, _, _ in trace.rows():
        durations[s][k].append(t1 - t0)
        start[(s, k, mb)], end[(s, k, mb)] = t0, t1
    sends = send_times(trace) if blocking_sends else [0.0] * n
    stages = []
    for s in range(n):
        med = [stat(d) if d else None for d in durations[s]]
        f, b, i, w, u = med
        if f is None or (b is None and i is None):
            raise ConfigError(f"stage {s} ran no forward or no backward in the trace: cannot calibrate its costs")
        if b is None:
            b = i + (w or 0.0)
        if i is None:
            i = w = b / 2
        w = w if w is not None else b - i
        if blocking_sends:
            send = sends[s]
            f += send if s < n - 1 else 0.0
            b, i = (b + send, i + send) if s > 0 else (b, i)
        stages.append(StageCosts(f, b, i, w, u or 0.0))
    latency = []
    for s in range(n - 1):
        gaps = [start[(s + 1, _F, mb)] - t for (st, k, mb), t in end.items() if st == s and k == _F
                and (s + 1, _F, mb) in start]
        for back in (_B, _I):
            gaps += [start[(s, c, mb)] - t for (st, k, mb), t in end.items() if st == s + 1 and k == back
                     for c in (_B, _I) if (s, c, mb) in start]
        latency.append(max(0.0, min(gaps)) if gaps else 0.0)
    return PipelineCosts(tuple(stages), latency_s=tuple(latency) if n > 1 else 0.0)


def kind_medians(trace: Trace) -> list[dict[str, float]]:
    """Per stage ``{kind: median seconds}`` of the kinds it ran (for reports)."""
    per = [{} for _ in range(trace.n_stages)]
    acc: dict[tuple[int, int], list[float]] = {}
    for s, k, _, t0, t1, _, _ in trace.rows():
        acc.setdefault((s, k), []).append(t1 - t0)
    names = {v: k.value for k, v in KIND_INDEX.items()}
    for (s, k), d in sorted(acc.items()):
        per[s][names[k]] = statistics.median(d)
    return per


def measured_memory(run: MeasuredRun, recompute: bool | None = None) -> "MemorySpec | None":
    """Per-stage sizes measured by a run (``summary.json``'s ``memory``, ``StageExecutor.memory_bytes``),
    as a :class:`~unbubble.sim.memory.MemorySpec` for ``peak_memory``.

    Weights are the parameters plus the fp32 masters (``bf16``), gradients the largest accumulated
    gradient, the optimizer its state, extra bytes weight prediction's buffers. One micro-batch holds what its forward saved (activations and
    autocast's weight copies): ``per_micro_batch.forward``, or, from a run that recomputed,
    ``recomputed + input``; with ``recompute`` it keeps only ``input`` and re-creates the rest at
    its backward (``MemorySpec.with_recompute``).

    Args:
        run: a run folder read by :func:`load_run`.
        recompute: predict full recomputation (default: as the run did).

    Returns:
        The spec, or ``None`` when the run's summary has no measured memory (older runs).
    """
    from unbubble.sim.memory import MemorySpec

    stages = run.summary.get("memory") or []
    if len(stages) != run.schedule.n_stages:
        return None
    ran_recompute = run.summary.get("recompute", "none") == "full"
    recompute = ran_recompute if recompute is None else recompute
    total, inputs = [], []
    for m in stages:
        pm = m["per_micro_batch"]
        total.append(float(pm["recomputed"] + pm["input"] if ran_recompute else pm["forward"]))
        inputs.append(float(pm["input"]))
    spec = MemorySpec(tuple(float(m["param_bytes"] + m["master_bytes"]) for m in stages),
                      tuple(float(m["grad_bytes"]) for m in stages),
                      tuple(float(m["optimizer_state_bytes"]) for m in stages), tuple(total),
                      extra_bytes=tuple(float(m.get("prediction_bytes", 0) + m.get("error_feedback_bytes", 0))
                                        for m in stages))
    return spec.with_recompute(tuple(inputs)) if recompute else spec


def compute_costs(trace: Trace) -> PipelineCosts:
    """Each stage's median measured F, B and U of ``trace`` as costs, links taking no time: the
    compute an emulated run measured (its wall-clock gaps are the other stages' turns, not links).

    Raises:
        KeyError: a stage ran no F or no B."""
    return PipelineCosts(tuple(StageCosts.from_fb(d["F"], d["B"], d.get("U", 0.0)) for d in kind_medians(trace)))


def simulated_on_measured(schedule: Schedule, trace: Trace) -> Trace | None:
    """``schedule`` simulated on ``trace``'s median measured F, B and U per stage (compute only: links
    take no time): what an emulated run's schedule does on ``schedule.n_ranks`` devices. The emulator's
    own ``sim_trace`` orders the actions on unit costs (F = 1, B = 2), so its utilization describes no
    machine; this trace's does. ``None`` where a stage ran no F or B.

    Source of the utilization an emulated run reports (``summary.json``'s ``simulated_utilization``,
    its TensorBoard series, the end line of ``unbubble train``)."""
    from unbubble.sim.result import simulate

    try:
        return simulate(schedule, compute_costs(trace)).trace
    except (ConfigError, KeyError, ValueError, ZeroDivisionError):
        return None
