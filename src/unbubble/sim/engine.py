"""Discrete-event execution of per-rank policies.

Every rank (one stage, or the v virtual stages of an interleaved schedule) runs its own
:class:`~unbubble.schedules.policy.Policy` on a simulated clock; ties break by event creation order, so a
run is deterministic. With an ``execute`` hook each action also runs for real at its simulated start
(the emulator: docs/architecture.md#one-policy-three-engines). The semantics are written twice:
``_run_reference`` defines them, the numba kernel (``sim/kernel.py``) is the one fast path.

Notes: [Note: engine fast paths] in docs/architecture.md#simenginepy.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from unbubble.errors import ScheduleError
from unbubble.schedules.actions import Action, ActionKind, format_order
from unbubble.schedules.policy import ListPolicy, PaciPolicy, RankView, StageState
from unbubble.schedules.registry import Schedule
from unbubble.sim import kernel
from unbubble.sim.costs import KIND_INDEX, KINDS

_F, _B, _I, _W, _U = range(5)


class CostModel(Protocol):
    """What the engine needs from a cost model (seconds).

    ``send_latency`` must depend only on ``(src, dst)``. A cost model may also offer
    ``table(n_stages) -> [[seconds per KIND_INDEX]]`` (promising ``duration(a) ==
    table[a.stage][KIND_INDEX[a.kind]]``) and ``noise(n_stages) -> sampler | None`` (see
    :class:`~unbubble.sim.costs.PipelineCosts`); the engine then looks durations up
    without building actions.
    """

    def duration(self, action: Action) -> float: ...

    def send_latency(self, src: int, dst: int) -> float: ...


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One executed action.

    Attributes:
        action: what ran.
        start, end: simulated (or measured) times in seconds.
        version: the stage's weight version when the action started.
        weights: the version of the weights the action computed with (differs from
            ``version`` when a backward uses a stashed version, as in PipeDream).
    """

    action: Action
    start: float
    end: float
    version: int
    weights: int | None = None

    @property
    def weights_version(self) -> int:
        return self.version if self.weights is None else self.weights


#: One action of a trace: (stage, kind index F=0 B=1 I=2 W=3 U=4, mb or −1 for U, start_s, end_s,
#: version, weights version).
Row = tuple[int, int, int, float, float, int, int]


class Trace:
    """Everything a run did, in start order.

    The simulator stores its records compactly (one :data:`Row` per action, or the compiled
    kernel's seven numpy columns, turned into rows when first iterated) and builds the
    :class:`ActionRecord` list only when ``records`` is first read; engines that measure real
    runs append ``ActionRecord`` objects to ``records`` directly. Every analysis below is one
    pass over :meth:`rows`, which serves either form; ``makespan`` and ``busy_per_rank`` read the
    columns directly when there are columns (same values: a max, and per-rank sums in row order).

    Args:
        n_stages: pipeline stages (N·v when interleaved).
        records: initial records (default: none).
        n_ranks: devices; stage s runs on rank ``s % n_ranks`` (default: one per stage).
        placement: the rank of each stage where it is not ``s % n_ranks`` (a V-shaped schedule's
            ``Schedule.ranks``); it sets ``n_ranks``.
    """

    def __init__(self, n_stages: int, records: list[ActionRecord] | None = None, n_ranks: int | None = None,
                 placement: tuple[int, ...] | None = None):
        self.n_stages = n_stages
        self.n_ranks = n_ranks if placement is None else max(placement) + 1
        self.placement = placement
        self._records: list[ActionRecord] | None = [] if records is None else records
        self._rows: list[Row] | None = None
        self._actions: list[Action] | None = None  # one per row, or None
        self._stage_lists: list[list[Action] | None] | None = None  # per stage, in execution order
        self._cols: tuple | None = None  # (stage, kind, mb, start_s, end_s, version, weights) numpy columns
        self._bwd_cols: tuple | None = None  # _backward_columns() once computed (() = not applicable)
        #: what a per-update global operation did (:class:`~unbubble.sim.barrier.GlobalOpLog`), or None
        self.global_op_log = None

    @classmethod
    def _from_rows(cls, n_stages: int, n_ranks: int | None, rows: list[Row], actions: list[Action] | None = None,
                   stage_lists: list[list[Action] | None] | None = None,
                   placement: tuple[int, ...] | None = None) -> "Trace":
        t = cls(n_stages, n_ranks=n_ranks, placement=placement)
        t._records, t._rows, t._actions, t._stage_lists = None, rows, actions, stage_lists
        return t

    @classmethod
    def _from_columns(cls, n_stages: int, n_ranks: int | None, cols: tuple,
                      stage_lists: list[list[Action] | None] | None = None) -> "Trace":
        t = cls._from_rows(n_stages, n_ranks, None, stage_lists=stage_lists)  # type: ignore[arg-type]
        t._cols = cols
        return t

    def _materialize(self) -> None:
        """Builds the row tuples from the columns (once)."""
        if self._rows is None and self._records is None and self._cols is not None:
            self._rows = list(zip(*(c.tolist() for c in self._cols)))

    @property
    def ranks(self) -> int:
        """Ranks (devices): ``n_ranks``, or one per stage."""
        return self.n_ranks or self.n_stages

    def rank_of(self, stage: int) -> int:
        """The rank that ran ``stage``."""
        return self.placement[stage] if self.placement is not None else stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` ran, in increasing order."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]

    @property
    def records(self) -> list[ActionRecord]:
        """Executed actions in start order (a list engines may append to)."""
        if self._records is None:
            self._materialize()
            rows, acts, lists = self._rows, self._actions, self._stage_lists
            made: dict[tuple[int, int, int], Action] = {}
            count = [0] * self.n_stages
            out = []
            for j, (s, k, mb, start, end, ver, w) in enumerate(rows):
                if acts is not None:
                    act = acts[j]
                elif lists is not None and lists[s] is not None:
                    act = lists[s][count[s]]
                    count[s] += 1
                else:
                    act = made.get((s, k, mb))
                    if act is None:
                        act = made[(s, k, mb)] = Action(s, KINDS[k], None if mb < 0 else mb)
                out.append(ActionRecord(act, start, end, ver, w))
            self._records, self._rows, self._actions, self._stage_lists, self._cols = out, None, None, None, None
        return self._records

    def rows(self) -> Iterator[Row]:
        """One :data:`Row` per action, in start order (kind indices as in ``costs.KIND_INDEX``)."""
        self._materialize()
        if self._rows is not None:
            return iter(self._rows)
        kidx = KIND_INDEX
        return ((r.action.stage, kidx[r.action.kind], -1 if r.action.mb is None else r.action.mb,
                 r.start, r.end, r.version, r.weights_version) for r in self._records)

    def __len__(self) -> int:
        if self._cols is not None and self._records is None:
            return len(self._cols[0])
        return len(self._rows) if self._rows is not None else len(self._records)

    def order(self) -> list[list[Action]]:
        """Per-rank action order (feed it to replay mode)."""
        out: list[list[Action]] = [[] for _ in range(self.ranks)]
        for r in self.records:
            out[self.rank_of(r.action.stage)].append(r.action)
        return out

    @property
    def makespan(self) -> float:
        """Seconds from time 0 to the last end."""
        if self._cols is not None and self._records is None:
            return float(self._cols[4].max()) if len(self._cols[4]) else 0.0
        return max((r[4] for r in self.rows()), default=0.0)

    def busy_per_rank(self) -> list[float]:
        """Seconds each rank spent executing actions."""
        nr = self.ranks
        if self._cols is not None and self._records is None:  # bincount adds in row order, as the loop below
            s, _, _, start, end = self._cols[:5]
            ranks = s % nr if self.placement is None else np.asarray(self.placement)[s]
            return np.bincount(ranks, weights=end - start, minlength=nr).tolist()
        busy = [0.0] * self.ranks
        for s, _, _, start, end, _, _ in self.rows():
            busy[self.rank_of(s)] += end - start
        return busy

    def busy(self, rank: int) -> float:
        """Seconds ``rank`` spent executing actions."""
        return self.busy_per_rank()[rank]

    def utilization(self) -> list[float]:
        """Busy / makespan per rank (1 − bubble fraction)."""
        span = self.makespan or 1.0
        return [b / span for b in self.busy_per_rank()]

    def columns(self) -> tuple | None:
        """The seven :data:`Row` fields as numpy arrays (int64, float64 for the times), when the trace
        came from the compiled kernel and nothing has turned it into records; else ``None``."""
        return self._cols if self._records is None else None

    def _backward_columns(self):
        """Column traces only: ``(stage, mb, v_F, version, weights)`` of every B/I row in row order,
        or ``None`` (no columns, or not exactly one earlier F per backward: the row loops decide)."""
        cols = self.columns()
        if cols is None:
            return None
        if self._bwd_cols is not None:
            return self._bwd_cols or None
        s, k, mb, _, _, ver, w = cols
        isf, isb = k == _F, (k == _B) | (k == _I)
        size = self.n_stages * (int(mb.max()) + 1 if len(mb) else 1)
        key = s * (size // self.n_stages) + mb
        kf, kb = key[isf], key[isb]
        first = np.full(size, len(k), np.int64)
        first[kf] = np.flatnonzero(isf)
        if (len(kf) and np.bincount(kf, minlength=size).max() > 1 or len(kb) and np.bincount(kb, minlength=size).max() > 1
                or (first[kb] > np.flatnonzero(isb)).any()):
            self._bwd_cols = ()
            return None
        vf = np.zeros(size, np.int64)
        vf[kf] = ver[isf]
        self._bwd_cols = (s[isb], mb[isb], vf[kb], ver[isb], w[isb])
        return self._bwd_cols

    def _per_stage_max(self, stage, values) -> list[int]:
        out = np.zeros(self.n_stages, np.int64)
        np.maximum.at(out, stage, values)
        return out.tolist()

    def versions(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(stage, mb) -> (v_F, v_B)``: the weight versions its forward and backward (B or I) used."""
        bc = self._backward_columns()
        if bc is not None:
            s, mb, vf, _, w = (c.tolist() for c in bc)
            return dict(zip(zip(s, mb), zip(vf, w)))
        fwd: dict[tuple[int, int], int] = {}
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for s, k, mb, _, _, ver, w in self.rows():
            if k == _F:
                fwd[(s, mb)] = ver
            elif k == _B or k == _I:
                out[(s, mb)] = (fwd[(s, mb)], w)
        return out

    def drift(self) -> dict[tuple[int, int], int]:
        """``(stage, mb) -> Δ = v_B − v_F`` (docs/architecture.md#terms)."""
        bc = self._backward_columns()
        if bc is not None:
            s, mb, vf, _, w = bc
            return dict(zip(zip(s.tolist(), mb.tolist()), (w - vf).tolist()))
        return {key: vb - vf for key, (vf, vb) in self.versions().items()}

    def delays(self) -> dict[tuple[int, int], int]:
        """``(stage, mb) -> τ``: updates between the version its gradient was computed on
        (v_F) and the stage's version when the gradient was produced (then applied)."""
        bc = self._backward_columns()
        if bc is not None:
            s, mb, vf, ver, _ = bc
            return dict(zip(zip(s.tolist(), mb.tolist()), (ver - vf).tolist()))
        fwd: dict[tuple[int, int], int] = {}
        out: dict[tuple[int, int], int] = {}
        for s, k, mb, _, _, ver, _ in self.rows():
            if k == _F:
                fwd[(s, mb)] = ver
            elif k == _B or k == _I:
                out[(s, mb)] = ver - fwd[(s, mb)]
        return out

    def max_delay(self) -> list[int]:
        """Largest τ per stage."""
        bc = self._backward_columns()
        if bc is not None:
            return self._per_stage_max(bc[0], bc[3] - bc[2])
        out = [0] * self.n_stages
        for (stage, _), d in self.delays().items():
            if d > out[stage]:
                out[stage] = d
        return out

    def max_drift(self) -> list[int]:
        """Largest Δ seen on each stage."""
        bc = self._backward_columns()
        if bc is not None:
            return self._per_stage_max(bc[0], bc[4] - bc[2])
        out = [0] * self.n_stages
        for (stage, _), d in self.drift().items():
            if d > out[stage]:
                out[stage] = d
        return out

    def drift_histogram(self) -> list[dict[int, int]]:
        """Per stage, ``{Δ: number of micro-batches with that drift}`` (keys in order of first occurrence)."""
        out: list[dict[int, int]] = [{} for _ in range(self.n_stages)]
        bc = self._backward_columns()
        if bc is not None:
            s, d = bc[0], bc[4] - bc[2]
            if len(d):
                lo = int(d.min())
                width = int(d.max()) - lo + 1
                key = s * width + (d - lo)
                counts = np.bincount(key, minlength=self.n_stages * width)
                first = np.full(len(counts), len(key), np.int64)
                np.minimum.at(first, key, np.arange(len(key)))
                present = np.flatnonzero(counts)
                for j in present[np.argsort(first[present], kind="stable")].tolist():
                    stage, x = divmod(j, width)
                    out[stage][x + lo] = int(counts[j])
            return out
        for (stage, _), d in self.drift().items():
            out[stage][d] = out[stage].get(d, 0) + 1
        return out


Execute = Callable[[Action], None]


def run_policies(schedule: Schedule, costs: CostModel, execute: Execute | None = None,
                 policies: list | None = None, *, fast: bool = True, global_op=None) -> Trace:
    """Runs every rank's policy on a simulated clock.

    A rank (= a stage, or the v virtual stages of interleaved 1F1B) runs one action at a
    time; F's output reaches stage s+1 and B's (or I's) gradient reaches stage s−1 after the
    send latency.

    Args:
        schedule: what to run (stages, micro-batch count, policies).
        costs: per-action durations and send latencies, seconds (see :class:`CostModel`).
        execute: called with each action at its simulated start, in start-time order;
            the emulator runs real computation here.
        policies: per-rank policies overriding ``schedule.policy`` (replay mode).
        fast: allow the compiled kernel where it applies ([Note: engine fast paths]); ``False``
            always runs the reference.
        global_op: a per-update global operation (:class:`~unbubble.sim.barrier.GlobalOp`, e.g. the
            gradient-norm all-reduce of global clipping; [Note: the barrier] in docs/architecture.md);
            runs on the reference path, its log in ``Trace.global_op_log``. ``None`` or scope
            ``none``: no such operation.

    Returns:
        The :class:`Trace` with simulated start/end times and versions.

    Raises:
        ScheduleError: no rank can act but some are not done (deadlock); the message
            shows each stuck stage's state and the actions executed so far.
        ConfigError: the cost model does not fit the schedule (e.g. another stage count).

    Cost (``benchmarks/bench_sim.py``, N = 32, 10,000 micro-batches, CPU time): 0.14–0.25 µs per
    action on the compiled kernel (numba, the ``fast`` extra), 2–4 µs on the reference (without
    numba every run takes it); the higher ends with jittered costs.
    """
    n, n_ranks = schedule.n_stages, schedule.n_ranks
    pols = policies if policies is not None else [schedule.policy(r) for r in range(n_ranks)]
    table = costs.table(n) if hasattr(costs, "table") else None
    noise = costs.noise(n) if table is not None and hasattr(costs, "noise") else None
    fdelay = [costs.send_latency(s, s + 1) if s + 1 < n else 0.0 for s in range(n)]
    bdelay = [costs.send_latency(s, s - 1) if s > 0 else 0.0 for s in range(n)]
    stashed = getattr(schedule, "backward_weights", "current") == "stashed"
    if global_op is not None and not global_op.active:
        global_op = None
    out = None
    if (fast and global_op is None and execute is None and table is not None and n_ranks == n
            and all(type(p) is PaciPolicy or type(p) is ListPolicy and not p.overlaps for p in pols)):
        out = kernel.run(n, schedule.total_mb, pols, table, noise, fdelay, bdelay, stashed)
    if out is not None:
        cols, states, stage_lists = out
        views = states
        trace = Trace._from_columns(n, n_ranks, cols, stage_lists=stage_lists)
    else:
        rows, actions, states, views, gop_log = _run_reference(schedule, pols, costs, table, noise, fdelay, bdelay,
                                                               execute, stashed, global_op)
        trace = Trace._from_rows(n, n_ranks, rows, actions=actions, placement=placement_of(schedule))
        trace.global_op_log = gop_log
    stuck = [r for r in range(n_ranks) if not pols[r].done(views[r])]
    if stuck:
        lines = [
            f"stage {s}: in_flight={states[s].in_flight} fwd_ready={sorted(states[s].fwd_ready)} "
            f"bwd_ready={sorted(states[s].bwd_ready)} done F={states[s].n_fwd} B={states[s].n_bwd} v={states[s].version}"
            for r in stuck for s in _stages_of(schedule, r)
        ]
        barrier = (f" under the global operation (clip scope {global_op.scope}: a rank's updates of one step are "
                   "not consecutive in its list, so one waits for the all-reduce another has not joined)"
                   if global_op is not None else "")
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocked{barrier}: stages {stuck} cannot act\n" + "\n".join(lines)
            + "\nexecuted so far:\n" + format_order(trace.order())
        )
    return trace


def placement_of(schedule) -> tuple[int, ...] | None:
    """The schedule's stage → rank map where it is not s mod N (V-shaped schedules)."""
    return schedule.ranks if getattr(schedule, "placement", "loop") != "loop" else None


def _stages_of(schedule, rank: int) -> list[int]:
    if hasattr(schedule, "stages_of"):
        return schedule.stages_of(rank)
    return list(range(rank, schedule.n_stages, schedule.n_ranks))


def _compound_scale(costs, table, first: Action, second: Action) -> float:
    """The factor both parts of a compound action (:class:`~unbubble.schedules.actions.Overlap`)
    take of their own durations: (d₁ + d₂ − φ·min(d₁, d₂)) / (d₁ + d₂), φ = ``costs.overlap``
    (default 0: the parts run one after the other)."""
    phi = getattr(costs, "overlap", 0.0)
    if not phi:
        return 1.0
    d1, d2 = ((table[a.stage][KIND_INDEX[a.kind]] if table is not None else costs.duration(a)) for a in (first, second))
    return (d1 + d2 - phi * min(d1, d2)) / (d1 + d2) if d1 + d2 > 0 else 1.0


def _update_run(pol, view, stage: int) -> list[int]:
    """The stages whose ``U`` run consecutively from the rank's next action (a ``U`` of ``stage``): a
    rank that hosts several chunks updates them together at the end of its step ([Note: the barrier]).
    Rule-based policies (PACI) update one stage per rank."""
    inner = getattr(pol, "inner", pol)
    acts = getattr(inner, "actions", None)
    if acts is None:
        return [stage]
    out, i = [], view.n_actions
    while i < len(acts) and acts[i].kind is ActionKind.U:
        out.append(acts[i].stage)
        i += 1
    return out if stage in out else [stage]


def _run_reference(schedule, pols, costs, table, noise, fdelay, bdelay, execute, stashed, global_op=None):
    """The engine's semantics: ask each idle rank's policy; see [Note: engine fast paths]. With a
    ``global_op``, each ``U`` also waits for the all-reduce its step needs ([Note: the barrier] in
    docs/architecture.md)."""
    n, n_ranks, total = schedule.n_stages, schedule.n_ranks, schedule.total_mb
    states = [StageState(s, n, total) for s in range(n)]
    stages_of = [_stages_of(schedule, r) for r in range(n_ranks)]
    rank_of = [0] * n
    for r, ss in enumerate(stages_of):
        for s in ss:
            rank_of[s] = r
    # two stages on one rank hand over locally: no link latency between them
    fdelay = [0.0 if s + 1 < n and rank_of[s] == rank_of[s + 1] else fdelay[s] for s in range(n)]
    bdelay = [0.0 if s > 0 and rank_of[s] == rank_of[s - 1] else bdelay[s] for s in range(n)]
    overlaps = [getattr(p, "overlaps", frozenset()) for p in pols]
    scale_next = [1.0] * n_ranks  # the factor of a compound's second part, set when its first runs
    views = states if n_ranks == n else [RankView([states[s] for s in stages_of[r]]) for r in range(n_ranks)]
    rows: list[Row] = []
    actions: list[Action] = []
    fwd_version: dict[tuple[int, int], int] = {}
    busy_until = [0.0] * n_ranks
    fin: list[deque] = [deque() for _ in range(n)]  # (arrival_s, mb) of activations for stage s, arrival order
    bin_: list[deque] = [deque() for _ in range(n)]  # (arrival_s, mb) of gradients for stage s
    events: list[tuple[float, int, int]] = [(0.0, r, r) for r in range(n_ranks)]
    seq = n_ranks
    gop_log = None
    if global_op is not None:
        from unbubble.sim.barrier import GlobalOpLog

        scope, lam, lag = global_op.scope, global_op.latency_s, global_op.lag_for(schedule)
        nu = global_op.norms(n)
        gop_log = GlobalOpLog(scope, lag, norm_s=nu)
        reached_t = [0] * n  # the last update each stage has reached
        contrib: dict[int, list] = {}  # t -> [stages reached, latest reached + ν]
        completed = gop_log.completed  # t -> R_t
        waiting: dict[int, set[int]] = {}  # t -> ranks waiting for R_t to become known
        # each rank's pending first U of an update: (stage, t, ν of the run, reached, run)
        lead: list[tuple | None] = [None] * n_ranks

    def wake(t: float, rank: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, rank))
        seq += 1

    while events:
        t, _, r = heapq.heappop(events)
        if t < busy_until[r]:
            continue
        for s in stages_of[r]:
            for q, ready in ((fin[s], states[s].fwd_ready), (bin_[s], states[s].bwd_ready)):
                while q and q[0][0] <= t:
                    ready.add(q.popleft()[1])
        action = pols[r].next_action(views[r])
        if action is None:
            continue
        s, k = action.stage, KIND_INDEX[action.kind]
        extra = 0.0
        if gop_log is not None and k == _U:  # [Note: the barrier]
            t_up = states[s].version + 1
            if reached_t[s] < t_up:  # the rank reaches update t: local norms, then its share of the all-reduce
                run = _update_run(pols[r], views[r], s)
                nu_run = sum(nu[x] for x in run)
                lead[r] = (s, t_up, nu_run, t, tuple(run))
                for x in run:
                    tx = states[x].version + 1
                    reached_t[x] = tx
                    c = contrib.setdefault(tx, [0, -math.inf])
                    c[0] += 1
                    c[1] = max(c[1], t + nu_run)
                    if c[0] == n and scope != "stage":
                        completed[tx] = c[1] + lam
                        for rr in waiting.pop(tx, ()):
                            wake(t, rr)
            first = lead[r] is not None and lead[r][0] == s and lead[r][1] == t_up
            nu_here = lead[r][2] if first else 0.0
            need = t_up if scope == "sync" else t_up - lag if scope == "stale" else 0
            if need >= 1:
                if need not in completed:
                    waiting.setdefault(need, set()).add(r)
                    continue
                if t < completed[need] - nu_here:
                    wake(completed[need] - nu_here, r)
                    continue
            if first:
                _, _, _, reached, run = lead[r]
                gop_log.updates.append((r, run, t_up, reached, t))
                lead[r] = None
                extra = nu_here
        mb = -1 if action.mb is None else action.mb
        st = states[s]
        if table is None:
            d = costs.duration(action)
        else:
            d = table[s][k] if noise is None else noise(s, k, t)
        d += extra
        if overlaps[r]:  # a compound action: both parts take _compound_scale of their durations
            pos = views[r].n_actions
            if pos in overlaps[r]:
                scale_next[r] = _compound_scale(costs, table, action, pols[r].inner.actions[pos + 1]
                                                if hasattr(pols[r], "inner") else pols[r].actions[pos + 1])
                d *= scale_next[r]
            elif pos - 1 in overlaps[r]:
                d *= scale_next[r]
        end = t + d
        if execute is not None:
            execute(action)
        weights = st.version
        if k == _F:
            fwd_version[(s, mb)] = st.version
        elif stashed and k != _U:
            weights = fwd_version[(s, mb)]
        rows.append((s, k, mb, t, end, st.version, weights))
        actions.append(action)
        views[r].apply(action)
        busy_until[r] = end
        wake(end, r)
        if k == _F and s + 1 < n:
            fin[s + 1].append((end + fdelay[s], mb))
            wake(end + fdelay[s], rank_of[s + 1])
        elif (k == _B or k == _I) and s > 0:
            bin_[s - 1].append((end + bdelay[s], mb))
            wake(end + bdelay[s], rank_of[s - 1])
    return rows, actions, states, views, gop_log
