"""``unbubble plan``: which schedule, pipeline depth, micro-batching and data parallelism to run.

Given a model, a cluster and a global batch, :func:`plan` simulates every registered schedule × depth ×
micro-batching × chunks per rank × recomputation × data-parallel degree on the analytic cost model, keeps
what fits in memory and ranks it by predicted tokens/s, and by time to the synchronous loss given a token
overhead.

Notes: docs/architecture.md#simplanpy.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unbubble.errors import ConfigError, check_int, did_you_mean
from unbubble.sim.hardware import GB, HARDWARE, Hardware

if TYPE_CHECKING:
    from unbubble.models.registry import ModelConfig

#: Token overhead of asynchrony measured in horizon-study (docs/results.md): PACI a = 4 + Muon +
#: ``--error-feedback 1`` reached 1F1B-flush + Muon's final loss with 1.33 ± 0.01 × its tokens
#: (deep-cpu, byte-level KJV, N = 8, 600 updates, 2 seeds, each against its own synchronous seed).
DEFAULT_TOKEN_OVERHEAD = 1.33
TOKEN_OVERHEAD_SOURCE = ("PACI a=4 + Muon + --error-feedback 1 vs 1F1B-flush + Muon, deep-cpu, N=8, 600 updates, "
                         "2 seeds, paired: 1.33 ± 0.01 (docs/results.md, horizon-study)")
#: Token overheads measured per (schedule, error feedback, weight prediction), with Muon against
#: 1F1B-flush + Muon at each one's tuned lr (deep-cpu, byte-level KJV, N = 8, a = m = 4, 600
#: updates, 2 seeds; docs/results.md, overhead-study and horizon-study): the value and its words.
MEASURED_TOKEN_OVERHEADS: dict[tuple[str, bool, bool], tuple[float, str]] = {
    ("paci", True, False): (1.33, "1.33 ± 0.01 with error feedback (horizon-study)"),
    ("paci", True, True): (1.33, "1.33 ± 0.03 with error feedback and prediction (horizon-study)"),
    ("paci", False, True): (1.41, "1.41 ± 0.00 with prediction (overhead-study)"),
    ("paci", False, False): (1.79, "1.79 ± 0.03 without a remedy (overhead-study)"),
}
MEASURED_SETTING = "deep-cpu, N=8, a=4, 600 updates, 2 seeds, docs/results.md"
#: The same overheads at longer training (updates → value and words; docs/results.md, pays-study and
#: horizon-study): the overhead falls with the run's length, so a plan takes the measurement nearest
#: (in log updates) to the run it plans for (:func:`measured_overhead`). 600 updates are the rows above.
MEASURED_BY_UPDATES: dict[tuple[str, bool, bool], dict[int, tuple[float, str]]] = {
    ("paci", True, False): {2400: (1.07, "≥ 1.07 with error feedback at 2,400 updates (pays-study, 3 seeds paired: > 1.08, 1.08, 1.04)")},
    ("paci", False, True): {1200: (1.23, "1.23 ± 0.02 with prediction at 1,200 updates (horizon-study)"),
                            2400: (1.09, "1.09 ± 0.03 with prediction at 2,400 updates (horizon-study)")},
}
#: the run length ``unbubble plan`` plans for unless given (--updates): the longest measured
DEFAULT_PLAN_UPDATES = 2400


def measured_overhead(schedule: str, error_feedback: bool, predict_weights: bool,
                      updates: int | None = None) -> tuple[float, str] | None:
    """The token overhead measured for ``schedule`` with these remedies (each only where the schedule
    takes it, as its :class:`~unbubble.schedules.registry.ScheduleInfo` says: error feedback on the
    asynchronous schedules, prediction on paci and async-1f1b) at the measured run length nearest to ``updates``
    optimizer updates (in log updates; ``None``: 600, the overhead-study's), and its words naming
    that length; ``None`` where none was measured."""
    from unbubble.schedules.registry import REGISTRY

    info = REGISTRY.get(schedule)
    key = (schedule, bool(error_feedback and info is not None and info.error_feedback),
           bool(predict_weights and info is not None and info.predicts))
    if key not in MEASURED_TOKEN_OVERHEADS:
        return None
    value, words = MEASURED_TOKEN_OVERHEADS[key]
    by_length = {600: (value, words.replace(" (", " at 600 updates (", 1)), **MEASURED_BY_UPDATES.get(key, {})}
    if updates is None:
        return MEASURED_TOKEN_OVERHEADS[key]
    nearest = min(by_length, key=lambda u: (abs(math.log(updates / u)), -u))
    return by_length[nearest]

#: Chunks per rank tried for the schedules in ``VIRTUAL`` (v = 1 would repeat their one-chunk
#: counterparts: interleaved-1f1b v=1 is 1f1b-flush, looped-bfs v=1 gpipe).
DEFAULT_V = (2, 4)

_GPUS = re.compile(r"^\s*(\d+)\s*[x×*]\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*$")


@dataclass(frozen=True)
class Cluster:
    """Devices of one type.

    Attributes:
        hardware: the device type (``unbubble.sim.hardware``; memory, FLOP/s, links, node size).
        gpus: number of devices.
    """

    hardware: Hardware
    gpus: int

    def __post_init__(self) -> None:
        check_int("gpus", self.gpus, 1, "set --gpus COUNTxGPU")

    def describe(self) -> str:
        hw = self.hardware
        return (f"{self.gpus}× {hw.name} ({hw.memory_bytes / GB:.0f} GB, {hw.peak_flops / 1e12:.1f} TFLOP/s × "
                f"{hw.achievable:.2f}, links {hw.intra_node_bytes_per_s / GB:.0f} GB/s in a node of "
                f"{hw.gpus_per_node}, {hw.inter_node_bytes_per_s / GB:.0f} GB/s between nodes)")


def parse_gpus(text: str, *, memory_gb: float | None = None, link_gb_s: float | None = None,
               inter_node_gb_s: float | None = None, achievable: float | None = None) -> Cluster:
    """A cluster from ``COUNTxGPU`` (``8xH200``, ``16xa100-80g``) and the hardware table
    (:data:`unbubble.sim.hardware.HARDWARE`), with optional overrides.

    A count is valid when it fits in one node (1 … ``gpus_per_node``) or fills whole nodes (a
    multiple of ``gpus_per_node``): the table describes nodes of that many devices.

    Args:
        text: ``COUNTxGPU``; the GPU name is a preset of the table, case-insensitive.
        memory_gb: device memory in GB (10⁹ bytes) instead of the table's.
        link_gb_s: one-direction bandwidth between two devices of a node, GB/s, instead of the table's.
        inter_node_gb_s: one-direction bandwidth per device between nodes, GB/s.
        achievable: fraction of peak FLOP/s reached, in (0, 1].

    Raises:
        ConfigError: a malformed text, an unknown GPU (with a did-you-mean), a count the table has
            no node shape for, or an override ≤ 0.
    """
    match = _GPUS.match(str(text))
    if not match:
        raise ConfigError(f"gpus={text!r} is invalid: give COUNTxGPU, e.g. 8xH200 (set --gpus)")
    count, name = int(match.group(1)), match.group(2).lower()
    if name not in HARDWARE:
        raise ConfigError(f"gpus={text!r} names an unknown GPU {name!r}{did_you_mean(name, HARDWARE)}: the hardware "
                          f"table has {', '.join(HARDWARE)} (set --gpus)")
    hw = HARDWARE[name]
    per_node = hw.gpus_per_node
    if count < 1 or (count > per_node and count % per_node):
        raise ConfigError(f"gpus={text!r} is not a cluster the hardware table describes: a {hw.name} node holds "
                          f"{per_node}, so give 1–{per_node} devices or whole nodes ({per_node}, {2 * per_node}, "
                          f"{3 * per_node}, …) (set --gpus)")
    changes = {}
    for opt, value, field_name in (("memory_gb", memory_gb, "memory_bytes"), ("link_gb_s", link_gb_s,
                                                                              "intra_node_bytes_per_s"),
                                   ("inter_node_gb_s", inter_node_gb_s, "inter_node_bytes_per_s")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{opt}={value!r} is invalid: must be a finite number > 0 "
                              f"(set --{opt.replace('_', '-')})")
        changes[field_name] = float(value) * GB
    if achievable is not None:
        changes["achievable"] = achievable
    return Cluster(hw.with_(**changes) if changes else hw, count)


@dataclass(frozen=True)
class PlanRow:
    """One simulated configuration.

    Attributes:
        schedule: registry name.
        stages: pipeline depth N (devices per replica).
        dp: data-parallel replicas D (N·D = the cluster's devices).
        v: model chunks per device (``Schedule.virtual``; 1 unless the schedule places several).
        mb_per_update: micro-batches per update and replica: m (synchronous), a (PACI), or 1 for
            schedules that update after every backward.
        micro_batch_size: sequences per micro-batch b.
        seq_len: tokens per sequence s.
        recompute: full activation recomputation.
        asynchronous: the schedule never flushes (its token overhead applies).
        tokens_per_s: predicted steady-state tokens/s of the whole cluster.
        peak_memory_bytes: predicted peak memory of the fullest device (bytes).
        capacity_bytes: device memory (bytes).
        bubble: mean idle fraction of the devices in steady state, in [0, 1).
        max_delay: largest staleness τ of any stage (0 for flushed schedules).
        token_overhead: tokens to the synchronous run's loss ÷ its tokens (1 for rows without delay;
            ``None`` where none was measured for the schedule and none given).
        clip_scope: the per-update global operation simulated (``none``, ``stage``, ``sync``, ``stale``).
        no_barrier_tokens_per_s: tokens/s of the same configuration without it (``None`` when
            ``clip_scope`` is ``none``).
    """

    schedule: str
    stages: int
    dp: int
    v: int
    mb_per_update: int
    micro_batch_size: int
    seq_len: int
    recompute: bool
    asynchronous: bool
    tokens_per_s: float
    peak_memory_bytes: float
    capacity_bytes: float
    bubble: float
    max_delay: int
    token_overhead: float | None = 1.0
    clip_scope: str = "none"
    no_barrier_tokens_per_s: float | None = None

    @property
    def fits(self) -> bool:
        """The fullest device's peak is within its memory."""
        return self.peak_memory_bytes <= self.capacity_bytes

    @property
    def effective_tokens_per_s(self) -> float | None:
        """Tokens/s ÷ the token overhead: the rate at which the run approaches the synchronous
        run's loss (time-to-target ∝ 1 / this); ``None`` without a token overhead."""
        return None if self.token_overhead is None else self.tokens_per_s / self.token_overhead

    @property
    def global_batch_tokens(self) -> int:
        return self.dp * self.mb_per_update * self.micro_batch_size * self.seq_len

    @property
    def label(self) -> str:
        """``paci a=8``, ``interleaved-1f1b m=16 v=2``, ``pipedream``."""
        from unbubble.schedules.registry import REGISTRY

        out = self.schedule
        if self.mb_per_update > 1 or not self.asynchronous:
            out += f" {'a' if 'a' in REGISTRY[self.schedule].takes else 'm'}={self.mb_per_update}"
        if self.v > 1:
            out += f" v={self.v}"
        return out

    @property
    def vs_no_barrier(self) -> float | None:
        """tokens/s with the global operation ÷ without it (``None`` without one)."""
        return None if self.no_barrier_tokens_per_s is None else self.tokens_per_s / self.no_barrier_tokens_per_s

    def as_dict(self) -> dict:
        """The row with its derived values (for tables and CSV)."""
        return {**dataclasses.asdict(self), "label": self.label, "fits": self.fits,
                "effective_tokens_per_s": self.effective_tokens_per_s, "vs_no_barrier": self.vs_no_barrier}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _with_allreduce(costs, grads_bytes: Sequence[float], dp: int, hw: Hardware, n_ranks: int, rank_of) -> object:
    """``costs`` with each stage's U extended by a ring all-reduce of its gradients over ``dp`` replicas."""
    from unbubble.sim.costs import StageCosts

    if dp == 1:
        return costs
    stages = []
    for s, (st, g) in enumerate(zip(costs.stages, grads_bytes)):
        r = rank_of(s)
        links = [hw.link(r + d * n_ranks, r + ((d + 1) % dp) * n_ranks) for d in range(dp)]
        lat, bw = max(x[0] for x in links), min(x[1] for x in links)
        t = 2 * (dp - 1) / dp * g / bw + 2 * (dp - 1) * lat
        stages.append(StageCosts(st.f_s, st.b_s, st.i_s, st.w_s, st.u_s + t))
    return dataclasses.replace(costs, stages=tuple(stages))


def _steps(schedule_asynchronous: bool, mb: int, n_stages: int) -> int:
    """Updates simulated: 2 for flushed schedules (every step alike, so the steady window, the
    second step, is exact: ``tests/unit/test_plan.py`` checks it against 4 steps for every
    registered flushed schedule), and for asynchronous ones 8 updates and at least 8·N
    micro-batches (the steady window leaves out the fill)."""
    if not schedule_asynchronous:
        return 2
    return max(8, -(-8 * n_stages // mb))


def _resolve_model(model, vocab_size: int | None, seq_len: int | None):
    from unbubble.sim.analytic import make_model

    if isinstance(model, str):
        return make_model(model, vocab_size, seq_len)
    if seq_len is not None and seq_len != model.block_size:
        model = dataclasses.replace(model, block_size=seq_len)
    return model


def candidates(model: "str | ModelConfig", cluster: Cluster, global_batch_tokens: int, seq_len: int | None = None, *,
               schedules: Sequence[str] | None = None, stages: Sequence[int] | None = None,
               v_values: Sequence[int] = DEFAULT_V, recompute: Sequence[bool] = (False, True),
               precision: str = "bf16", vocab_size: int | None = None, flash_attention: bool = False,
               predict_weights: bool = False, error_feedback: bool = True,
               token_overhead: float | str | None = "measured", updates: int | None = None,
               max_micro_batches: int | None = None, clip_scope: str = "none",
               clip_lag: int | None = None) -> list[PlanRow]:
    """Every configuration of the search, simulated, whether it fits in memory or not (see the
    module docstring for the model). Arguments as :func:`plan`; rows in search order.

    Raises:
        ConfigError: as :func:`plan`, except that nothing fitting is not an error here.
    """
    from unbubble.schedules.registry import REGISTRY, SCHEDULES, get_schedule, schedule_name
    from unbubble.sim.analytic import analytic_model, get_precision
    from unbubble.sim.result import simulate

    if not isinstance(cluster, Cluster):
        raise ConfigError(f"cluster={cluster!r} is invalid: give a Cluster (unbubble.sim.plan.parse_gpus)")
    cfg = _resolve_model(model, vocab_size, seq_len)
    s_len = cfg.block_size
    check_int("global_batch_tokens", global_batch_tokens, 1, "set --global-batch-tokens")
    if global_batch_tokens % s_len:
        lo = global_batch_tokens // s_len * s_len
        near = f"{lo} or {lo + s_len}" if lo else f"{s_len} (one sequence) or more"
        raise ConfigError(f"global_batch_tokens={global_batch_tokens} is not a multiple of seq_len={s_len}: a batch "
                          f"holds whole sequences, e.g. {near} (set --global-batch-tokens or --seq-len)")
    sequences = global_batch_tokens // s_len
    names = list(SCHEDULES) if schedules is None else [schedule_name(s, "--schedules") for s in schedules]
    if not names:
        raise ConfigError("schedules=() is empty: give at least one schedule (set --schedules)")
    gpus = cluster.gpus
    depths = _divisors(gpus) if stages is None else list(stages)
    for n in depths:
        check_int("stages", n, 1, "set --stages")
        if gpus % n:
            raise ConfigError(f"stages={n} does not divide gpus={gpus}: every replica needs N devices "
                              f"(N·dp = gpus; divisors: {', '.join(map(str, _divisors(gpus)))}) (set --stages)")
    for v in v_values:
        check_int("v", v, 1, "set --v")
    if max_micro_batches is not None:
        check_int("max_micro_batches", max_micro_batches, 1, "set --max-micro-batches")
    if token_overhead not in (None, "measured") and (
            isinstance(token_overhead, bool) or not isinstance(token_overhead, (int, float))
            or not 0 < token_overhead < math.inf):
        raise ConfigError(f"token_overhead={token_overhead!r} is invalid: must be a finite number > 0, the tokens an "
                          "asynchronous run needs ÷ the synchronous run's (set --token-overhead)")
    if not any(sequences % (gpus // n) == 0 for n in depths):
        raise ConfigError(f"global_batch_tokens={global_batch_tokens} ({sequences} sequences of {s_len}) cannot be "
                          f"split evenly over the data-parallel replicas of any depth in {depths} (dp = gpus/N = "
                          f"{sorted({gpus // n for n in depths})}): give a multiple of "
                          f"{min(gpus // n for n in depths) * s_len} tokens (set --global-batch-tokens)")
    from unbubble.sim.barrier import GlobalOp, check_scope, for_analytic

    check_scope(clip_scope)
    if clip_lag is not None:
        GlobalOp("stale", lag=clip_lag)  # validates it
        if clip_scope != "stale":
            raise ConfigError(f"clip_lag={clip_lag} is the lag of clip scope stale, not {clip_scope}: set "
                              "--clip-scope stale or drop --clip-lag")
    prec = get_precision(precision)
    hw = cluster.hardware
    rows: list[PlanRow] = []
    unsplittable: list[str] = []  # why the model does not split at a depth: the reason when nothing runs
    for name in names:
        for n in depths:
            dp = gpus // n
            if sequences % dp:
                continue
            per_replica = sequences // dp
            ks = [k for k in _divisors(per_replica) if max_micro_batches is None or k <= max_micro_batches]
            for v in (v_values if "v" in REGISTRY[name].takes else (None,)):
                seen_fixed = set()
                for k in ks:
                    try:
                        probe = get_schedule(name, n, 1, a=k, m=k, v=v)
                    except ConfigError:
                        continue  # (N, k, v) this schedule does not run at
                    mb = probe.mb_per_step
                    if mb != k:  # updates after a fixed number of backwards (1): one configuration
                        if mb in seen_fixed or per_replica % mb:
                            continue
                        seen_fixed.add(mb)
                    b = per_replica // mb
                    sched = get_schedule(name, n, _steps(probe.asynchronous, mb, n), a=k, m=k, v=v)
                    fitted = False
                    for rc in sorted(set(bool(x) for x in recompute)):
                        if rc and fitted:
                            continue  # recomputing only adds work: never faster than the fitting row without
                        try:
                            am = analytic_model(cfg, n, hw, b, s_len, virtual=sched.virtual, placement=sched.placement,
                                                precision=prec, flash_attention=flash_attention, recompute=rc,
                                                predict_weights=predict_weights and REGISTRY[name].predicts,
                                                error_feedback=error_feedback and REGISTRY[name].error_feedback)
                        except ConfigError as exc:
                            unsplittable.append(str(exc))
                            break  # e.g. more chunks than blocks
                        costs = _with_allreduce(am.costs, am.memory.grads_bytes, dp, hw, sched.n_ranks,
                                                sched.rank_of)
                        res = simulate(sched, costs, am.memory, samples_per_mb=b, tokens_per_mb=b * s_len)
                        plain = None
                        if clip_scope != "none":
                            plain = res.steady_tokens_per_s * dp
                            res = simulate(sched, costs, am.memory, samples_per_mb=b, tokens_per_mb=b * s_len,
                                           global_op=for_analytic(am, clip_scope, n, lag=clip_lag))
                        rate_mb = res.steady_samples_per_s / b  # micro-batches per second, one replica
                        util = [x / sched.total_mb * rate_mb for x in res.trace.busy_per_rank()]
                        delay = max(sched.delay_bound(s) for s in range(sched.n_stages))
                        if delay == 0 or token_overhead is None:
                            overhead = 1.0
                        elif token_overhead == "measured":
                            found = measured_overhead(name, error_feedback, predict_weights, updates)
                            overhead = found[0] if found else None
                        else:
                            overhead = token_overhead
                        row = PlanRow(
                            name, n, dp, sched.virtual, mb, b, s_len, rc, sched.asynchronous,
                            res.steady_tokens_per_s * dp, max(r.peak for r in res.memory), hw.memory_bytes,
                            max(0.0, 1.0 - sum(util) / len(util)), delay,
                            overhead, clip_scope, plain)
                        rows.append(row)
                        fitted = row.fits
    if not rows and unsplittable:
        raise ConfigError(f"no configuration of {', '.join(names)} runs at stages {depths}: {unsplittable[0]}")
    if not rows:
        raise ConfigError(f"no configuration of {', '.join(names)} runs at stages {depths} with "
                          f"{sequences} sequences per update: give more tokens per batch, other --stages or more "
                          "schedules")
    return rows


def plan(model: "str | ModelConfig", cluster: Cluster, global_batch_tokens: int, seq_len: int | None = None, *,
         schedules: Sequence[str] | None = None, stages: Sequence[int] | None = None,
         v_values: Sequence[int] = DEFAULT_V, recompute: Sequence[bool] = (False, True), precision: str = "bf16",
         vocab_size: int | None = None, flash_attention: bool = False, predict_weights: bool = False,
         error_feedback: bool = True, token_overhead: float | str | None = "measured", updates: int | None = None,
         max_micro_batches: int | None = None, clip_scope: str = "none", clip_lag: int | None = None) -> list[PlanRow]:
    """The configurations that fit in memory, fastest first.

    Args:
        model: a preset name of ``make_model`` (``gpt2-medium``, ``deep-cpu``, ``llama-1b``, ``zb-1.5b`` …)
            or a model config.
        cluster: devices and their type (:func:`parse_gpus`).
        global_batch_tokens: tokens per update of the whole cluster G (a multiple of ``seq_len``).
        seq_len: tokens per sequence s (default the model's block size).
        schedules: registry names to search (default every one of ``SCHEDULES``).
        stages: pipeline depths N to search (default every divisor of the device count).
        v_values: chunks per rank tried for the schedules in ``VIRTUAL``.
        recompute: the recomputation settings tried (``(False, True)``: both).
        precision: ``bf16``, ``bf16-autocast`` or ``fp32`` (bytes and speed of the analytic model).
        vocab_size: V (default the published model's).
        flash_attention: attention scores are not stored.
        predict_weights: count weight prediction's buffers for paci and async-1f1b.
        error_feedback: count error feedback's buffers for the asynchronous schedules (the default,
            as ``unbubble train``'s, and as the default overhead was measured).
        token_overhead: tokens an asynchronous run needs to reach the synchronous loss ÷ the
            synchronous run's: ``"measured"`` (the default) takes each schedule's and remedy's
            measurement (:func:`measured_overhead`; ``None`` in a row where there is none), a number
            applies to every delayed row, ``None`` counts 1.
        updates: the optimizer updates of the run planned for: ``"measured"`` takes the measurement at
            the nearest measured length (the overhead falls with training: PACI with error feedback
            1.33 at 600 updates, ≥ 1.07 at 2,400); ``None``: 600.
        max_micro_batches: largest m (or a) tried (default: every divisor of the sequences per replica).
        clip_scope: the per-update global operation of every configuration (``none``; ``stage``, ``sync``
            or ``stale`` as ``unbubble train --clip-scope``; see the module docstring).
        clip_lag: s of ``stale`` (default the runtime's, :func:`unbubble.schedules.clip.stale_lag`: ⌈N/a⌉ for
            asynchronous schedules, 1 for flushed ones).

    Returns:
        :class:`PlanRow` s that fit, by predicted tokens/s (highest first; ties: fewer stages,
        less memory). Rank them by time-to-target with :func:`by_time_to_target`.

    Raises:
        ConfigError: an unknown model or schedule, a global batch that is not a multiple of
            ``seq_len`` or cannot be split over the replicas, stages that do not divide the device
            count, a token overhead ≤ 0, or no configuration that fits in memory (the message gives
            the smallest peak memory found and its configuration).
    """
    rows = candidates(model, cluster, global_batch_tokens, seq_len, schedules=schedules, stages=stages,
                      v_values=v_values, recompute=recompute, precision=precision, vocab_size=vocab_size,
                      flash_attention=flash_attention, predict_weights=predict_weights,
                      error_feedback=error_feedback, token_overhead=token_overhead, updates=updates,
                      max_micro_batches=max_micro_batches,
                      clip_scope=clip_scope, clip_lag=clip_lag)
    return rank(rows)


def rank(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """The rows of :func:`candidates` that fit in memory, by predicted tokens/s (highest first;
    ties: fewer stages, less memory).

    Raises:
        ConfigError: no row fits (the message gives the smallest peak memory and its configuration).
    """
    fitting = [r for r in rows if r.fits]
    if rows and not fitting:
        least = min(rows, key=lambda r: r.peak_memory_bytes)
        raise ConfigError(f"no configuration fits in {least.capacity_bytes / GB:.3g} GB per device: the smallest "
                          f"need is {least.peak_memory_bytes / GB:.3g} GB ({least.label}, N={least.stages}, "
                          f"dp={least.dp}, b={least.micro_batch_size}, recompute "
                          f"{'full' if least.recompute else 'none'}) (set --memory-gb, or more --gpus)")
    return sorted(fitting, key=lambda r: (-_sig(r.tokens_per_s), r.stages, r.peak_memory_bytes))


def by_time_to_target(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """``rows`` by predicted time to the synchronous run's loss, soonest first: by
    :attr:`PlanRow.effective_tokens_per_s` (tokens/s ÷ token overhead; synchronous rows keep
    their tokens/s). Rows without a token overhead are left out."""
    return sorted((r for r in rows if r.token_overhead is not None),
                  key=lambda r: (-_sig(r.effective_tokens_per_s), r.stages, r.peak_memory_bytes))


def best_per_schedule(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """The first row of each schedule in ``rows`` (of a ranked list: each schedule's best), in order."""
    seen: set[str] = set()
    out = []
    for r in rows:
        if r.schedule not in seen:
            seen.add(r.schedule)
            out.append(r)
    return out


def _sig(x: float) -> float:
    """``x`` to 9 significant digits: rates equal but for rounding rank as ties."""
    return float(f"{x:.9g}")
