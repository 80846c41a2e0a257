"""The large-scale comparison: the Zero Bubble paper's four setups, every schedule, throughput and memory.

Setups (arXiv 2401.10241, §5.1, Table 3): GPT-3-like models of 1.5B, 6.2B, 14.6B and 28.3B parameters
on 8, 8, 16 and 32 A100-80G, sequence length 1024, micro-batch sizes 6, 3, 1, 1 and three micro-batch
counts each; the first and last stage hold one block less. Interleaved 1F1B (and looped-bfs and
interleaved-zb, when asked for) uses one block per virtual stage, as the paper did ("the maximum number
of chunks"), so v = blocks per middle device and the first
and last virtual stage hold only the embedding or the head. ZB-H1 and ZB-H2 are the registry's
handcrafted zero-bubble schedules; the paper measured its automatically searched ZB-1p and ZB-2p, which
have the same memory limits (p·M_B and 2p·M_B). PACI updates after a = m local backwards (the same global
batch); PipeDream updates after every micro-batch. Paper numbers: Table 4 (measured samples per GPU per
second and peak memory).

Also: :func:`speedups`, PACI's steady-state speed-up over 1F1B-flush at equal micro-batch size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from unbubble.errors import ConfigError
from unbubble.schedules.registry import SCHEDULES, get_schedule, schedule_info, schedule_name, stage_rank
from unbubble.sim.analytic import ZB_MODELS, analytic_model, make_model, zb_layers_per_stage
from unbubble.sim.hardware import Hardware
from unbubble.sim.result import SimResult, simulate

#: Schedules of the table, with the name of the paper's column they stand beside.
COLUMNS: list[tuple[str, str | None]] = [
    ("1f1b-flush", "1F1B"), ("interleaved-1f1b", "1F1B-I"), ("zb-h1", "ZB-1p"), ("zb-h2", "ZB-2p"),
    ("pipedream", None), ("paci", None),
]

#: Zero Bubble paper, Table 4: (samples per GPU per second, peak memory GB) per model, column, m.
PAPER: dict[str, dict[str, list[tuple[float, float]]]] = {
    "zb-1.5b": {"ZB-2p": [(14.5, 59), (14.8, 59), (14.9, 59)], "ZB-1p": [(12.9, 32), (13.4, 32), (14.2, 32)],
                "1F1B": [(11.8, 30), (12.5, 30), (13.6, 30)], "1F1B-I": [(13.1, 40), (13.4, 40), (13.9, 40)]},
    "zb-6.2b": {"ZB-2p": [(4.32, 70), (4.35, 70), (4.39, 70)], "ZB-1p": [(3.88, 42), (4.00, 42), (4.20, 42)],
                "1F1B": [(3.50, 39), (3.70, 39), (4.03, 39)], "1F1B-I": [(4.01, 48), (4.08, 48), (4.19, 48)]},
    "zb-14.6b": {"ZB-2p": [(1.81, 51), (1.83, 51), (1.85, 51)], "ZB-1p": [(1.61, 33), (1.67, 33), (1.76, 33)],
                 "1F1B": [(1.40, 32), (1.49, 32), (1.64, 32)], "1F1B-I": [(1.54, 39), (1.59, 39), (1.66, 39)]},
    "zb-28.3b": {"ZB-2p": [(0.99, 74), (1.00, 74), (1.00, 74)], "ZB-1p": [(0.87, 44), (0.90, 44), (0.96, 44)],
                 "1F1B": [(0.76, 43), (0.80, 43), (0.88, 43)], "1F1B-I": [(0.82, 58), (0.85, 58), (0.90, 58)]},
}


@dataclass(frozen=True)
class Cell:
    """One (model, m, schedule) of the table.

    Attributes:
        samples_per_s_per_gpu: predicted steady-state throughput (sequences/s per device).
        peak_memory_gb: predicted peak memory of the fullest device (10⁹ bytes).
        mean_bubble: idle fraction averaged over devices.
        max_drift, max_delay: largest Δ and τ of any stage.
        fits: the fullest device fits in the hardware's memory.
        paper: the paper's measured (samples/s per GPU, GB), if any.
    """

    model: str
    stages: int
    m: int
    schedule: str
    samples_per_s_per_gpu: float
    peak_memory_gb: float
    mean_bubble: float
    max_drift: int
    max_delay: int
    fits: bool | None
    paper: tuple[float, float] | None


def _run(name: str, model: str, m: int, hardware: Hardware, flash_attention: bool) -> SimResult:
    z = ZB_MODELS[model]
    cfg = make_model(model)
    n, b = z["stages"], z["micro_batch_size"]
    k = (cfg.n_layer + 2) // n
    info = schedule_info(name)
    if "v" in info.takes:  # interleaved-1f1b, and looped-bfs and interleaved-zb on the same chunks
        v = k
        am = analytic_model(cfg, n, hardware, b, virtual=v, layers_per_stage=[0] + [1] * (n * v - 2) + [0],
                            flash_attention=flash_attention)
        sched = get_schedule(name, n, steps=3, m=m, v=v)
    else:
        am = analytic_model(cfg, n, hardware, b, layers_per_stage=zb_layers_per_stage(cfg.n_layer, n),
                            flash_attention=flash_attention)
        # asynchronous: 6 updates of m micro-batches (6·m updates of 1 each), synchronous: 3 steps
        steps = (6 if info.asynchronous else 3) * (m // info.mb_per_update(m, m))
        sched = get_schedule(name, n, steps=steps, a=m, m=m)
    return simulate(sched, am.costs, am.memory, samples_per_mb=am.samples_per_mb, tokens_per_mb=am.tokens_per_mb)


def extrapolate(hardware: Hardware, schedules: Sequence[str] | None = None, models: Sequence[str] | None = None,
                flash_attention: bool = False) -> list[Cell]:
    """Simulates every (model, m, schedule) of the Zero Bubble setups.

    Args:
        hardware: device type (the paper used ``a100-80g``).
        schedules: registry names (default: those of :data:`COLUMNS` that are registered).
        models: keys of ``ZB_MODELS`` (default: all four).
        flash_attention: drop the attention-score activations (the paper's memory includes them).

    Returns:
        One :class:`Cell` per model, micro-batch count and schedule, in table order.

    Raises:
        ConfigError: an unknown schedule or model name.
    """
    names = [s for s, _ in COLUMNS if s in SCHEDULES] if schedules is None else \
        [schedule_name(s, "--schedules") for s in schedules]
    models = list(ZB_MODELS) if models is None else list(models)
    for mdl in models:
        if mdl not in ZB_MODELS:
            raise ConfigError(f"model={mdl!r} is not a Zero Bubble setup: valid ones are {', '.join(ZB_MODELS)}")
    paper_col = dict(COLUMNS)
    cells = []
    for mdl in models:
        z = ZB_MODELS[mdl]
        for i, m in enumerate(z["m"]):
            for name in names:
                r = _run(name, mdl, m, hardware, flash_attention)
                s = r.summary()
                col = paper_col.get(name)
                paper = PAPER[mdl][col][i] if col and hardware.name == "a100-80g" else None
                cells.append(Cell(mdl, z["stages"], m, name, s["steady_samples_per_s_per_device"],
                                  s["peak_memory_bytes"] / 1e9, s["mean_bubble"], s["max_drift"], s["max_delay"],
                                  s["fits"], paper))
    return cells


@dataclass(frozen=True)
class Speedup:
    """PACI (a = m) against 1F1B-flush (m) at equal micro-batch size, steady state.

    Attributes:
        m: micro-batches per step (PACI: per local update).
        predicted: simulated throughput ratio.
        analytic: (m + N − 1)/m, the ratio with F:B fixed, free updates and balanced stages
            (docs/architecture.md#schedules-and-their-semantics).
        paci_bubble, flush_bubble: mean idle fractions.
    """

    m: int
    predicted: float
    analytic: float
    paci_bubble: float
    flush_bubble: float


def speedups(model: str, hardware: Hardware, n_stages: int = 8, ms: Sequence[int] = (4, 8, 16, 32),
             micro_batch_size: int = 16, seq_len: int | None = None, uniform: bool = False) -> list[Speedup]:
    """PACI's speed-up over 1F1B-flush for each m (the PACI paper's setup: GPT-2 Medium, 8 stages, 16
    sequences of 1024 tokens per micro-batch).

    Args:
        model: ``--model`` name.
        hardware: device type.
        n_stages: N.
        ms: micro-batch counts m (= a for PACI).
        micro_batch_size, seq_len: micro-batch shape.
        uniform: use unit costs (F = 1, B = 2, free U, no latency) instead of the analytic model.
    """
    from unbubble.sim.costs import UniformCosts

    cfg = make_model(model, seq_len=seq_len)
    am = analytic_model(cfg, n_stages, hardware, micro_batch_size, seq_len)
    costs = UniformCosts(f=1.0, b=2.0) if uniform else am.costs
    out = []
    for m in ms:
        flush = simulate(get_schedule("1f1b-flush", n_stages, steps=8, m=m), costs)
        paci = simulate(get_schedule("paci", n_stages, steps=max(16, 256 // m), a=m), costs)
        out.append(Speedup(m, paci.steady_samples_per_s / flush.steady_samples_per_s, (m + n_stages - 1) / m,
                           paci.summary()["mean_bubble"], flush.summary()["mean_bubble"]))
    return out


#: Schedules that compute 1F1B-flush's updates (the same loss curve on another clock): the one list
#: every "fastest synchronous schedule" of the break-even analyses is chosen from. DualPipeV runs its
#: overlapped pairs at the cost model's ``overlap`` (0 unless set: the parts one after the other).
SYNCHRONOUS = ("1f1b-flush", "zb-h1", "zb-h2", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")

#: Chunks per rank of the schedules in :data:`~unbubble.schedules.registry.VIRTUAL` in these comparisons:
#: the registry's default (``--v``), Megatron's usual choice; every chunk does 1/v of its rank's stage
#: (:func:`chunk_costs`).
COMPARE_V = 2

#: The ``memory`` choices of :func:`synchronous_options`.
MEMORY_LIMITS = ("any", "1f1b")


def _chunk_links(value, n_stages: int, v: int, placement: str = "loop"):
    """A per-boundary link value of N stages for the N·v − 1 chunk boundaries: chunk j sends to chunk
    j + 1 over the boundary between their ranks (ranks r and r + 1 use boundary r); the loop's
    wrap-around link (rank N − 1 to rank 0) gets the mean of the N − 1 boundaries, and the V's turn
    (chunks N − 1 and N, both on rank N − 1) is a local hand-over (the engine gives it no latency)."""
    if not isinstance(value, tuple):
        return value
    wrap = sum(value) / len(value) if value else 0.0
    out = []
    for j in range(n_stages * v - 1):
        a, b = stage_rank(j, n_stages, placement), stage_rank(j + 1, n_stages, placement)
        out.append(value[min(a, b)] if abs(a - b) == 1 else wrap)
    return tuple(out)


def chunk_costs(costs, n_stages: int, v: int, placement: str = "loop"):
    """Costs of the N·v chunks of a schedule in :data:`~unbubble.schedules.registry.VIRTUAL` (or a V-shaped
    one, ``placement="v"``, v = 2), assuming each rank's stage splits evenly into v chunks (chunk j on
    rank r does 1/v of stage r's F, B, I, W and U; r = j mod N, or min(j, 2N − 1 − j) in a V; links as
    in :func:`_chunk_links`). ``UniformCosts`` get every duration divided by v; ``v = 1`` returns
    ``costs``."""
    from unbubble.sim.costs import PipelineCosts, StageCosts, Straggler, UniformCosts

    if v == 1:
        return costs
    rank = [stage_rank(j, n_stages, placement) for j in range(n_stages * v)]
    if isinstance(costs, UniformCosts):
        return dataclasses.replace(costs, f=costs.f / v, b=costs.b / v, u=costs.u / v,
                                   i=None if costs.i is None else costs.i / v,
                                   w=None if costs.w is None else costs.w / v,
                                   stage_scale=tuple(costs.stage_scale[rank[j]]
                                                     for j in range(n_stages * v)) if costs.stage_scale else ())
    if not isinstance(costs, PipelineCosts):
        raise ConfigError(f"costs of type {type(costs).__name__} cannot be split into chunks: give PipelineCosts "
                          "or UniformCosts")
    chunks = tuple(StageCosts(x.f_s / v, x.b_s / v, x.i_s / v, x.w_s / v, x.u_s / v)
                   for j in range(n_stages * v) for x in [costs.stages[rank[j]]])
    return dataclasses.replace(
        costs, stages=chunks, message_bytes=_chunk_links(costs.message_bytes, n_stages, v, placement),
        bandwidth_bytes_per_s=_chunk_links(costs.bandwidth_bytes_per_s, n_stages, v, placement),
        latency_s=_chunk_links(costs.latency_s, n_stages, v, placement),
        stragglers=tuple(Straggler(j, st.slowdown, st.start_s, st.end_s)
                         for st in costs.stragglers for j in range(n_stages * v) if rank[j] == st.stage))


@functools.lru_cache(maxsize=512)
def peak_activations(name: str, n_stages: int, m: int, v: int = COMPARE_V) -> float | None:
    """Activation memory of the busiest device in one step of synchronous schedule ``name``, in
    stage-sized micro-batches (a chunk of a :data:`~unbubble.schedules.registry.VIRTUAL` schedule counts
    1/v): the simulator's memory model (:func:`unbubble.sim.memory.peak_memory`) on unit costs, with a split backward
    holding a micro-batch's activations until its W (the upper bound). The per-rank action order
    is fixed, so the count does not depend on the costs. None when ``name`` does not run at (N, m)."""
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.memory import MemorySpec

    try:
        sched = get_schedule(name, n_stages, 1, m=m, v=v)
    except ConfigError:
        return None
    k = sched.virtual
    spec = MemorySpec.uniform(sched.n_stages, act=1.0 / k, act_w=1.0 / k)
    return max(r.activations for r in simulate(sched, chunk_costs(UniformCosts(), n_stages, k, sched.placement),
                                               spec).memory)


def synchronous_options(n_stages: int, m: int, schedules: Sequence[str] = SYNCHRONOUS, memory: str = "any",
                        v: int = COMPARE_V) -> list[str]:
    """The schedules of ``schedules`` that run at N stages and m micro-batches per update (interleaved
    1F1B needs N | m, interleaved-zb m a multiple of max(1, ⌊m/N⌋)), with ``v`` chunks per rank where
    they take ``--v``; with ``memory="1f1b"`` only those whose busiest device holds no more
    activations than 1F1B-flush's (:func:`peak_activations`), i.e. 1F1B-flush's activation memory.

    Raises:
        ConfigError: ``memory`` is not one of :data:`MEMORY_LIMITS`.
    """
    if memory not in MEMORY_LIMITS:
        raise ConfigError(f"memory={memory!r} is invalid: choose one of {', '.join(MEMORY_LIMITS)}")
    limit = peak_activations("1f1b-flush", n_stages, m) if memory == "1f1b" else None
    out = []
    for s in schedules:
        peak = peak_activations(s, n_stages, m, v)
        if peak is None or (limit is not None and peak > limit + 1e-9):
            continue
        out.append(s)
    return out


def async_over_sync(costs, n_stages: int, m: int, a: int | None = None, schedules: Sequence[str] = SYNCHRONOUS,
                    memory: str = "any", v: int = COMPARE_V, paci_op=None, sync_op=None) -> tuple[float, str]:
    """PACI's steady-state throughput over the fastest synchronous schedule's at m micro-batches per
    update: the speed-up asynchrony buys, which its token overhead must stay below to pay (break-even).

    Args:
        costs: per-stage costs of the N stages (``PipelineCosts`` or ``UniformCosts``); the schedules
            with several chunks per device run on :func:`chunk_costs` (each stage split evenly into
            its chunks). Or a function ``schedule -> costs`` giving each schedule's own per-chunk
            costs (e.g. the analytic model's whole-block split, ``analytic_model(…, virtual=…,
            placement=…)``).
        n_stages: N.
        m: micro-batches per update of the synchronous schedules (PACI: a = m unless ``a`` is given).
        a: PACI's accumulation factor (default m).
        schedules: the synchronous schedules to compare with (default :data:`SYNCHRONOUS`); those
            that do not run at (N, m) are skipped (:func:`synchronous_options`), and so are those
            whose chunks a ``costs`` function cannot build (more chunks than the model has blocks).
        memory: ``"any"``, or ``"1f1b"`` for only the schedules within 1F1B-flush's activation memory
            (:func:`peak_activations`; PACI holds N micro-batches, 1F1B-flush min(m, N)).
        v: chunks per rank of the schedules in :data:`~unbubble.schedules.registry.VIRTUAL`.
        paci_op, sync_op: the per-update global operation of PACI's run and of the synchronous
            schedules' (:class:`~unbubble.sim.barrier.GlobalOp`, e.g. the gradient-norm all-reduce of
            global clipping with scope ``sync`` or ``stale``; [Note: the barrier] in docs/architecture.md),
            or a function ``schedule -> GlobalOp`` (each schedule's own per-chunk local-norm times);
            ``None``: none, the table without a barrier.

    Returns:
        ``(ratio, fastest synchronous schedule)``; ratios over 1 mean PACI is faster; a schedule in
        :data:`~unbubble.schedules.registry.VIRTUAL` is named with its v (``"interleaved-zb v=2"``).
    """
    a = m if a is None else a
    costs_for = costs if callable(costs) else \
        (lambda sched: chunk_costs(costs, n_stages, sched.virtual, sched.placement))

    def op_for(op, sched):
        return op(sched) if callable(op) else op

    paci_sched = get_schedule("paci", n_stages, steps=max(16, 256 // a), a=a)
    paci = simulate(paci_sched, costs_for(paci_sched), global_op=op_for(paci_op, paci_sched)).steady_samples_per_s
    best, name = 0.0, ""
    for s in synchronous_options(n_stages, m, schedules, memory, v):
        sched = get_schedule(s, n_stages, steps=4, m=m, v=v)
        try:
            chunk = costs_for(sched)
        except ConfigError:  # the model cannot be cut into this schedule's chunks (fewer blocks than chunks)
            continue
        rate = simulate(sched, chunk, global_op=op_for(sync_op, sched)).steady_samples_per_s
        if rate > best:
            best, name = rate, sync_label(s, v)
    return paci / best, name


def sync_label(name: str, v: int = COMPARE_V) -> str:
    """``name``, with `` v=…`` for the schedules in :data:`~unbubble.schedules.registry.VIRTUAL`."""
    return f"{name} v={v}" if "v" in schedule_info(name).takes else name


def _label(name: str) -> str:
    return {"1f1b-flush": "1F1B", "interleaved-1f1b": "1F1B-I", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2",
            "pipedream": "PipeDream", "paci": "PACI", "pipedream-2bw": "2BW", "gpipe": "GPipe"}.get(name, name)


def markdown(cells: Sequence[Cell], hardware: Hardware, command: str,
             speedup_rows: dict[str, list[Speedup]] | None = None) -> str:
    """The extrapolation page: throughput and memory tables (predicted, paper in brackets) and speed-ups."""
    names = list(dict.fromkeys(c.schedule for c in cells))
    keys = list(dict.fromkeys((c.model, c.stages, c.m) for c in cells))
    by = {(c.model, c.m, c.schedule): c for c in cells}
    paper_note = ("in brackets: the Zero Bubble paper's measurement, Table 4; its ZB-1p/ZB-2p stand beside ZB-H1/ZB-H2"
                  if hardware.name == "a100-80g" else "no paper numbers for this hardware")
    with_paper = [c for c in cells if c.paper is not None]
    accuracy = []
    if with_paper:
        import statistics

        ratios = sorted(c.samples_per_s_per_gpu / c.paper[0] for c in with_paper)
        gb = [c.peak_memory_gb - c.paper[1] for c in with_paper]
        accuracy = [
            "",
            f"Against the {len(with_paper)} measured cells: predicted/measured throughput has median "
            f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}–{ratios[-1]:.3f}); the offset is the achievable "
            "fraction (an end-to-end figure that already contains bubbles), which scales every throughput alike, "
            "so ratios between schedules (third table) carry no such offset. Predicted minus measured peak memory: "
            f"median {statistics.median(gb):+.1f} GB (range {min(gb):+.1f} to {max(gb):+.1f} GB).",
        ]
    out = [
        "# Extrapolation: the Zero Bubble paper's setups, every schedule",
        "",
        "Generated by",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Hardware `{hardware.name}`: {hardware.peak_flops / 1e12:.1f} TFLOP/s BF16 × achievable "
        f"{hardware.achievable:.2f}, {hardware.memory_bytes / 1e9:.0f} GB. Source: {hardware.source}.",
        "",
        "Setups (arXiv 2401.10241, Table 3): GPT-3-like models, sequence 1024, vocabulary 50304, first and last stage "
        "one block short; 1.5B and 6.2B on 8 devices (micro-batch 6 and 3), 14.6B on 16 and 28.3B on 32 "
        "(micro-batch 1). Interleaved 1F1B: one block per virtual stage. PACI updates after a = m backwards; "
        "PipeDream after every micro-batch. Throughput is the simulator's steady state (`SimResult."
        "steady_samples_per_s`); memory is the fullest device's peak, counted from the trace "
        "(`unbubble.sim.memory`).",
        *accuracy,
        "",
        f"## Throughput: samples per second per device ({paper_note})",
        "",
        "| model | devices | m | " + " | ".join(_label(n) for n in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]

    def cell_txt(c: Cell, i: int) -> str:
        v = c.samples_per_s_per_gpu if i == 0 else c.peak_memory_gb
        txt = f"{v:.3g}" if i == 0 else f"{v:.0f}"
        if c.paper is not None:
            txt += f" ({c.paper[i]:g})"
        if i == 1 and c.fits is False:
            txt += " ✗"
        return txt

    for mdl, n, m in keys:
        out.append(f"| {mdl[3:].upper()} | {n} | {m} | " + " | ".join(cell_txt(by[(mdl, m, s)], 0) for s in names) + " |")
    out += ["", f"## Peak memory per device, GB ({paper_note}; ✗: over {hardware.memory_bytes / 1e9:.0f} GB)", "",
            "| model | devices | m | " + " | ".join(_label(n) for n in names) + " |",
            "|---|---|---|" + "---|" * len(names)]
    for mdl, n, m in keys:
        out.append(f"| {mdl[3:].upper()} | {n} | {m} | " + " | ".join(cell_txt(by[(mdl, m, s)], 1) for s in names) + " |")
    if "paci" in names and "1f1b-flush" in names:
        out += ["", "## Speed-up over 1F1B (ratios do not depend on the achievable fraction)", "",
                "| model | m | PACI / 1F1B | ZB-H2 / 1F1B | paper ZB-2p / 1F1B | PACI memory / 1F1B |",
                "|---|---|---|---|---|---|"]
        for mdl, n, m in keys:
            base = by[(mdl, m, "1f1b-flush")]
            paci = by[(mdl, m, "paci")]
            zb2 = by.get((mdl, m, "zb-h2"))
            paper = (f"{base.paper and PAPER[mdl]['ZB-2p'][ZB_MODELS[mdl]['m'].index(m)][0] / base.paper[0]:.3f}"
                     if base.paper else "—")
            out.append(f"| {mdl[3:].upper()} | {m} | {paci.samples_per_s_per_gpu / base.samples_per_s_per_gpu:.3f} | "
                       + (f"{zb2.samples_per_s_per_gpu / base.samples_per_s_per_gpu:.3f}" if zb2 else "—")
                       + f" | {paper} | {paci.peak_memory_gb / base.peak_memory_gb:.2f} |")
    if speedup_rows:
        out += ["", "## PACI / 1F1B-flush at N = 8 against (m + N − 1)/m", "",
                "Steady-state throughput ratio, a = m, equal micro-batch size (16 sequences of 1024 tokens). With "
                "uniform costs the simulator gives (m + N − 1)/m exactly; the analytic model adds the optimizer "
                "step and the head's extra cost on the last stage, which holds both schedules back.", "",
                "| m | analytic (m+N−1)/m | " + " | ".join(speedup_rows) + " | PACI paper (measured) |",
                "|---|---|" + "---|" * len(speedup_rows) + "---|"]
        paper_sp = {8: "1.84", 16: "1.41"}
        ms = [s.m for s in next(iter(speedup_rows.values()))]
        for i, m in enumerate(ms):
            first = next(iter(speedup_rows.values()))[i]
            out.append(f"| {m} | {first.analytic:.4g} | " + " | ".join(f"{v[i].predicted:.3f}" for v in
                                                                      speedup_rows.values())
                       + f" | {paper_sp.get(m, '—')} |")
    return "\n".join(out) + "\n"
