"""``unbubble simulate``: throughput, bubbles, memory and drift of schedules on a cost model, with pictures."""

from __future__ import annotations

import logging
import math
import shutil
import textwrap
import time
from pathlib import Path

import click

from unbubble.errors import ConfigError, did_you_mean

log = logging.getLogger("unbubble.simulate")

FORMATS = ("table", "markdown", "csv")


def _schedule(name: str, stages: int, mb: int, a: int, m: int, v: int):
    """The schedule ``name`` running about ``mb`` micro-batches."""
    from unbubble.schedules.registry import get_schedule, schedule_info

    per_update = schedule_info(name).mb_per_update(a, m)
    return get_schedule(name, stages, steps=max(1, math.ceil(mb / per_update)), a=a, m=m, v=v)


def _default_m(names, stages: int, least: int = 8) -> int:
    """The smallest m ≥ ``least`` that every schedule of ``names`` accepts on ``stages`` ranks (each record's
    ``check``), or ``least`` when none up to 4·max(least, stages) does (the schedule's own error then says why)."""
    from unbubble.schedules.registry import REGISTRY

    checks = [REGISTRY[n].check for n in names if n in REGISTRY and REGISTRY[n].check is not None]
    for m in range(least, 4 * max(least, stages) + 1):
        if all(_fits(lambda c=c: c(stages, m)) for c in checks):
            return m
    return least


def _fits(build) -> bool:
    """Whether ``build()`` runs without a :class:`ConfigError`."""
    try:
        build()
    except ConfigError:
        return False
    return True


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"layers_per_stage={text!r} is invalid: give comma-separated block counts, e.g. 2,3,3,2 "
                          "(set --layers-per-stage)") from None


def _parse_uniform(text: str):
    import math

    from unbubble.sim.costs import UniformCosts

    try:
        vals = [float(x) for x in text.split(":")]
        # F and B take time (a zero-length pipeline has no timeline to draw); U may be 0
        if not 2 <= len(vals) <= 3 or not all(math.isfinite(v) for v in vals) or min(vals[:2]) <= 0 or min(vals) < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"uniform={text!r} is invalid: expected seconds as F:B[:U] with F, B > 0 and U ≥ 0, e.g. 1:2 or "
                          "1:2:0.1 (set --uniform)") \
            from None
    return UniformCosts(f=vals[0], b=vals[1], u=vals[2] if len(vals) > 2 else 0.0)


class CostSource:
    """Builds the cost model (and memory sizes) for each schedule from the command's options."""

    def __init__(self, opts: dict):
        from unbubble.sim.costs import Straggler
        from unbubble.sim.hardware import get_hardware

        self.o = opts
        self.stragglers = tuple(Straggler.parse(s) for s in opts["straggler"])
        self.kind = "uniform" if opts["uniform"] else "measured" if opts["costs_from"] else "analytic"
        self.samples_per_mb, self.tokens_per_mb = 1, None
        self.description = ""
        self.recompute = opts["recompute"] == "full"
        self.measured_memory = self.measured_layers = None
        if self.kind == "measured":
            from unbubble.sim.measured import load_run, measured_costs, measured_memory

            run = load_run(opts["costs_from"])
            compiled = run.summary.get("compile_backend")
            # a compiled run's first forwards and backwards include compiling: medians leave them out
            self.measured = measured_costs(run.trace, statistic="median" if compiled else "mean")
            run_precision, run_recompute = run.summary.get("precision", "fp32"), run.summary.get("recompute", "none")
            if opts["precision"] not in (None, run_precision):
                raise ConfigError(f"precision={opts['precision']!r} differs from the calibration run's {run_precision!r}: "
                                  "measured costs hold for its precision (drop --precision, or calibrate from a run "
                                  f"with --precision {opts['precision']})")
            if run_recompute == "full" and not self.recompute:
                raise ConfigError("recompute='none' cannot be predicted from a run that recomputed (its backwards "
                                  "include a forward): calibrate from a run with --recompute none")
            if self.recompute and run_recompute == "none":
                self.measured = self.measured.with_recompute()
            self.measured_memory = measured_memory(run, recompute=self.recompute)
            layers = run.summary.get("stage_layers")
            if layers and len(layers) == run.schedule.n_stages:
                self.measured_layers = tuple(range(a, b) for a, b in layers)
            if opts["stages"] is None:
                opts["stages"] = run.schedule.n_stages
            if run.schedule.n_ranks != run.schedule.n_stages:
                raise ConfigError("--costs-from needs a run with one stage per device (not interleaved)")
            if opts["stages"] != run.schedule.n_stages:
                raise ConfigError(f"stages={opts['stages']} differs from the calibration run's "
                                  f"{run.schedule.n_stages} stages (set --stages {run.schedule.n_stages})")
            self.samples_per_mb, self.tokens_per_mb = run.samples_per_mb, run.tokens_per_mb
            self.description = (f"costs measured in {run.path} ({run_precision}, recompute {run_recompute}"
                                + (f", compiled with {compiled}: median durations)" if compiled else ")")
                                + (", + one forward per backward (--recompute full)"
                                   if self.recompute and run_recompute == "none" else ""))
        elif self.kind == "analytic":
            from unbubble.sim.analytic import make_model

            from unbubble.sim.analytic import get_precision

            self.hardware = get_hardware(opts["hardware"], opts["achievable"])
            self.config = make_model(opts["model"], opts["vocab_size"], opts["seq_len"])
            self.precision_name = opts["precision"] or "bf16"
            self.precision = get_precision(self.precision_name)
            self.samples_per_mb = opts["micro_batch_size"]
            self.tokens_per_mb = opts["micro_batch_size"] * self.config.block_size
            self.description = (f"{opts['model']} ({self.config.n_layer} blocks, width {self.config.n_embd}, "
                                f"V={self.config.vocab_size}, T={self.config.block_size}) on {self.hardware.name} "
                                f"({self.hardware.peak_flops / 1e12:.0f} TFLOP/s × {self.hardware.achievable:.2f}), "
                                f"{opts['micro_batch_size']} sequences per micro-batch, {self.precision_name}, "
                                f"recompute {opts['recompute']}")
        else:
            if opts["precision"] is not None:
                raise ConfigError("--precision needs the analytic model (--model) or is read from the run "
                                  "(--costs-from): uniform costs have no precision")
            self.uniform = _parse_uniform(opts["uniform"])
            self.description = (f"uniform costs F={self.uniform.f} s, B={self.uniform.b} s, U={self.uniform.u} s"
                                + (", + F per backward (--recompute full)" if self.recompute else ""))

    def for_schedule(self, schedule):
        """``(costs, memory spec or None, block ranges per stage or None)`` for one schedule (interleaved
        ones need per-virtual-stage costs)."""
        from unbubble.sim.costs import PipelineCosts, StageCosts

        o = self.o
        if self.kind == "analytic":
            from unbubble.sim.analytic import analytic_model

            v = schedule.n_stages // schedule.n_ranks
            layers = _parse_layers(o["layers_per_stage"])
            if layers is not None and v > 1 and len(layers) != schedule.n_stages:
                raise ConfigError(f"layers_per_stage={o['layers_per_stage']} is invalid for {schedule.name}: "
                                  f"stages={schedule.n_ranks} with {v} chunks per device needs {schedule.n_stages} "
                                  "block counts, one per chunk in pipeline order (set --layers-per-stage)")

            def model(n_ranks: int):
                return analytic_model(self.config, n_ranks, self.hardware, o["micro_batch_size"], virtual=v,
                                      layers_per_stage=layers, flash_attention=o["flash_attention"],
                                      jitter=o["jitter"], seed=o["seed"], stragglers=self.stragglers,
                                      precision=self.precision, recompute=self.recompute,
                                      placement=schedule.placement)

            try:
                am = model(schedule.n_ranks)
            except ConfigError as err:
                if v == 1 or layers is not None:
                    raise
                # the partition counts chunks (N·v), the user typed devices (N): name those, and the most
                # devices whose chunks this model's blocks fill (asked of the model itself, whatever its rule)
                fits = next((k for k in range(schedule.n_ranks - 1, 0, -1) if _fits(lambda: model(k))), None)
                if fits is None:
                    raise
                raise ConfigError(f"stages={schedule.n_ranks} with {v} chunks per device needs {schedule.n_stages} "
                                  f"chunks, but {o['model']} has {self.config.n_layer} blocks: at most {fits} stages "
                                  f"for {schedule.name} (set --stages {fits} or less, or pick a deeper --model)") \
                    from err
            self.last_model = am
            return am.costs, am.memory, am.stage_layers
        if schedule.n_stages != schedule.n_ranks:
            raise ConfigError(f"schedule={schedule.name!r} has {schedule.n_stages} virtual stages: it needs costs per "
                              "virtual stage, which only the analytic model gives (use --model)")
        if self.kind == "measured":
            base = self.measured
        else:
            u = self.uniform
            base = PipelineCosts(tuple(StageCosts(*u.table(1)[0]) for _ in range(schedule.n_stages)),
                                 latency_s=u.latency)
            if self.recompute:
                base = base.with_recompute()
        if o["jitter"] or self.stragglers:
            base = PipelineCosts(base.stages, base.message_bytes, base.bandwidth_bytes_per_s, base.latency_s,
                                 o["jitter"], o["seed"], self.stragglers)
        return base, self.measured_memory, self.measured_layers

    def global_op(self, schedule, scope: str):
        """The per-update global operation of ``scope`` for ``schedule`` ([Note: the barrier] in
        docs/architecture.md): on the analytic model the all-reduce latency of its hardware over the
        schedule's devices and each stage's local-norm time (gradient bytes ÷ memory bandwidth); on
        unit or measured costs no local-norm time and ``--allreduce-latency`` (default 0). Call after
        :meth:`for_schedule` for the same schedule."""
        from unbubble.sim.barrier import GlobalOp, for_analytic

        if scope == "none":
            return None
        lag, lam = self.o["clip_lag"], self.o["allreduce_latency"]
        if self.kind == "analytic":
            return for_analytic(self.last_model, scope, schedule.n_ranks, lag=lag, latency_s=lam)
        return GlobalOp(scope, lam or 0.0, 0.0, lag)


@click.command(context_settings={"show_default": True})
@click.option("--schedule", default="paci", help="Schedule to simulate (see `unbubble schedules`).")
@click.option("--compare", default="", help="Comma-separated schedules to run beside it on the same costs and "
                                             "micro-batch count, e.g. 1f1b-flush,zb-h2,pipedream.")
@click.option("--stages", default=None, type=int,
              help="Pipeline depth N (devices) [default: 8, or the calibration run's with --costs-from].")
@click.option("--a", default=8, type=int, help="PACI accumulation factor (backward passes per local update).")
@click.option("--m", default=None, type=int,
              help="Micro-batches per step of synchronous schedules and pipedream-2bw [default: 8; 2N where "
                   "dualpipev is simulated, which needs m ≥ 2N].")
@click.option("--v", default=2, type=int, help="Virtual stages (model chunks) per device of interleaved-1f1b, looped-bfs and interleaved-zb.")
@click.option("--micro-batches", default=None, type=int,
              help="Micro-batches each schedule processes [default: 16 steps of the first schedule].")
@click.option("--model", default="gpt2-medium",
              help="Analytic cost model: a preset (tiny … gpt2-xl, llama-tiny … llama-8b, moe-tiny, moe-deep-cpu, "
                   "mixtral-8x7b) or a Zero Bubble model (zb-1.5b … zb-28.3b).")
@click.option("--hardware", default="h200", help="Device preset: a100-80g, h100, h200.")
@click.option("--achievable", default=None, type=float, help="Fraction of peak FLOP/s reached [default: the preset's].")
@click.option("--micro-batch-size", default=16, type=int, help="Sequences per micro-batch.")
@click.option("--seq-len", default=None, type=int, help="Tokens per sequence [default: the model's block size].")
@click.option("--vocab-size", default=None, type=int, help="Vocabulary [default: the published model's: 50257 GPT-2, 128256 llama-*, "
                                                                  "32000 moe-*/mixtral, 50304 zb-*].")
@click.option("--layers-per-stage", default=None,
              help="Blocks per stage, e.g. 2,3,3,2, one count per chunk in pipeline order: N counts, or N·v where a "
                   "device holds several chunks (zbv, dualpipev: 2N; interleaved-1f1b, looped-bfs, interleaved-zb: "
                   "N·--v). Refused with a --compare whose schedules have different chunk counts "
                   "[default: cost-balanced].")
@click.option("--precision", default=None, type=click.Choice(["fp32", "bf16-autocast", "bf16"], case_sensitive=False),
              help="Bytes and compute speed of the analytic model's training precision [default: bf16; with "
                   "--costs-from, the run's].")
@click.option("--recompute", default="none", type=click.Choice(["none", "full"], case_sensitive=False),
              help="full: every stage keeps only its input per micro-batch and each backward re-runs the forward "
                   "(one more F per B; peak activations = inputs in flight + one micro-batch's).")
@click.option("--flash-attention/--no-flash-attention", default=False,
              help="Attention scores are not stored (smaller activations).")
@click.option("--uniform", default=None, help="Unit costs F:B[:U] in seconds instead of the analytic model.")
@click.option("--costs-from", default=None, type=click.Path(), help="Calibrate costs from a run folder of "
                                                                  "`unbubble train` (its actions.jsonl).")
@click.option("--jitter", default=0.0, type=float, help="σ of a mean-one log-normal factor on every duration.")
@click.option("--seed", default=0, type=int, help="Seed of the jitter.")
@click.option("--straggler", multiple=True, help="STAGE:SLOWDOWN[:START_S[:END_S]] (repeatable).")
@click.option("--out", default=None, type=click.Path(), help="Folder for the PNG timelines, Chrome traces and tables "
                                                             "[default: runs/<time>-simulate-<schedule>-N<stages>].")
@click.option("--checkpoint-every", default=0, type=int, help="Drain the pipeline after every K-th update, as a "
              "run that checkpoints every K steps does (0: never), to see what checkpoints cost.")
@click.option("--clip-scope", default="none",
              help="Per-update global operation, as `unbubble train --clip-scope` (global gradient clipping, the "
                   "global non-finite check): none; stage (local norm only); sync (a blocking gradient-norm "
                   "all-reduce over every stage: a barrier per update); stale (non-blocking, update t clipped with "
                   "the norm of update t − s). Comma-separated to compare, e.g. sync,stale; every schedule is also "
                   "run without it (none) and reported with its × no barrier.")
@click.option("--clip-lag", default=None, type=int,
              help="s of --clip-scope stale [default: the runtime's, ⌈N/a⌉ for asynchronous schedules (a: "
                   "micro-batches per update), 1 for flushed ones].")
@click.option("--allreduce-latency", default=None, type=float,
              help="Seconds of the clip's all-reduce [default: a ring over the devices on --hardware's links; 0 "
                   "with --uniform or --costs-from].")
@click.option("--timeline-steps", default=2, type=int, help="Steps of each schedule drawn in its timeline.")
@click.option("--format", "fmt", default="table", type=click.Choice(FORMATS, case_sensitive=False), help="How tables are printed.")
@click.option("--wide", is_flag=True, help="Print every table column (by default a terminal too narrow for a "
                                           "table hides its least important columns and names them).")
def simulate(**o) -> None:
    """Simulate pipeline schedules: throughput, bubbles, peak memory per device, drift.

    Writes to the output folder: summary.{csv,md}, stages.{csv,md} (per device: utilization and the
    memory split into weights, gradients, optimizer state, activations and stashed versions),
    drift.csv (histogram of Δ per stage), and per schedule a timeline PNG and a Chrome trace
    (open in chrome://tracing or ui.perfetto.dev).

    The defaults differ from `unbubble train`'s on purpose: they describe the PACI paper's GPU
    setting (gpt2-medium on 8 H200s, a = m = 8, 16 sequences of the model's block size), which a
    CPU cannot train, while train's describe its CPU demo (tiny, 4 stages, a = m = 4, 8 × 128
    tokens). For train's model and batch on --hardware, give its flags (--model tiny --stages 4
    --a 4 --m 4 --micro-batch-size 8 --seq-len 128 --vocab-size 257); for a train run on its own
    machine, calibrate with --costs-from RUN.
    """
    from unbubble.schedules.registry import schedule_name
    from unbubble.sim import report
    from unbubble.sim.render import chrome_trace, timeline_png, window_end
    from unbubble.sim.result import simulate as run_sim

    names = list(dict.fromkeys(schedule_name(s, "--schedule / --compare")  # each once, in the order given
                               for s in [o["schedule"]] + [s.strip() for s in o["compare"].split(",") if s.strip()]))
    for opt in ("a", "m", "v"):  # before any division by them
        if o[opt] is not None and o[opt] < 1:
            raise ConfigError(f"{opt}={o[opt]} is invalid: must be an integer ≥ 1 (set --{opt})")
    from click.core import ParameterSource

    from unbubble.config import check_schedule_options
    from unbubble.schedules.registry import REGISTRY

    ctx = click.get_current_context()
    check_schedule_options(names, {k: o[k] for k in ("a", "m", "v")
                                   if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)})
    if o["uniform"] and o["costs_from"]:
        raise ConfigError("--uniform and --costs-from are exclusive: pick one cost model")
    if o["checkpoint_every"] < 0:
        raise ConfigError(f"checkpoint_every={o['checkpoint_every']} is invalid: must be an integer ≥ 0 "
                          "(set --checkpoint-every)")
    if o["timeline_steps"] < 1:
        raise ConfigError(f"timeline_steps={o['timeline_steps']} is invalid: must be ≥ 1 (set --timeline-steps)")
    scopes = _clip_scopes(o)
    source = CostSource(o)
    if o["stages"] is None:
        o["stages"] = 8
    if o["stages"] < 1:
        raise ConfigError(f"stages={o['stages']} is invalid: must be an integer ≥ 1 (set --stages)")
    if o["m"] is None:  # 8, or the smallest m above it that every compared schedule runs at (dualpipev: m ≥ 2N)
        o["m"] = _default_m(names, o["stages"])
    if o["micro_batches"] is not None:  # 0 is not "the default"
        if o["micro_batches"] < 1:
            raise ConfigError(f"micro_batches={o['micro_batches']} is invalid: must be ≥ 1 (set --micro-batches)")
        for opt in ("a", "m"):  # fewer micro-batches than one update takes: the run would apply none
            takers = [n for n in names if opt in REGISTRY[n].takes]
            if takers and o[opt] > o["micro_batches"]:
                raise ConfigError(f"{opt}={o[opt]} exceeds micro_batches={o['micro_batches']}: {takers[0]} updates "
                                  f"after {o[opt]} micro-batches, so the run would apply no update (give "
                                  f"--micro-batches {o[opt]} or more, or --{opt} {o['micro_batches']} or less)")
    first = _schedule(names[0], o["stages"], 1, o["a"], o["m"], o["v"])
    if o["layers_per_stage"] is not None and source.kind == "analytic":
        chunks = {name: _schedule(name, o["stages"], 1, o["a"], o["m"], o["v"]).n_stages for name in names}
        if len(set(chunks.values())) > 1:
            raise ConfigError(f"layers_per_stage={o['layers_per_stage']} is invalid with --compare: one list of block "
                              "counts fits one chunk count, but at stages=" + str(o["stages"]) + " "
                              + ", ".join(f"{n} has {c}" for n, c in chunks.items())
                              + " (compare schedules with as many chunks, or drop --layers-per-stage)")
    mb = o["micro_batches"] if o["micro_batches"] is not None else 16 * first.mb_per_step
    log.info("simulating %s on N=%d devices, %d micro-batches each; %s", ", ".join(names), o["stages"], mb,
             source.description)
    out = Path(o["out"] or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-simulate-{names[0]}-N{o['stages']}")
    plans = []  # every schedule's costs first: a schedule the model cannot split refuses before a file is written
    for name in names:
        sched = _schedule(name, o["stages"], mb, o["a"], o["m"], o["v"])
        if sched.total_mb != mb:  # whole updates only
            log.warning("%s: %d micro-batches simulated, not %d: %d whole updates of %d (give --micro-batches %d)",
                        name, sched.total_mb, mb, sched.steps, sched.mb_per_step, sched.total_mb)
        plans.append((sched, *source.for_schedule(sched)))
    out.mkdir(parents=True, exist_ok=True)
    results, notes, scope_of, vs_none = [], [], [], []
    for sched, costs, memory, layers in plans:
        plain = None
        for scope in scopes:
            t0 = time.perf_counter()
            res = run_sim(sched, costs, memory, samples_per_mb=source.samples_per_mb,
                          tokens_per_mb=source.tokens_per_mb, checkpoint_every=o["checkpoint_every"],
                          global_op=source.global_op(sched, scope))
            log.debug("%s: %d actions simulated in %.2f s", res.label, len(res.trace), time.perf_counter() - t0)
            slug = res.label.replace(" ", "").replace("(", "-").replace(")", "").replace("=", "")
            timeline_png(res.trace, out / f"timeline-{slug}.png", title=f"{res.label}, N={o['stages']}",
                         t_end=window_end(res.trace, sched.mb_per_step, o["timeline_steps"]))
            chrome_trace(res.trace, out / f"trace-{slug}.json", name=res.label)
            results.append(res)
            plain = res if scope == "none" else plain
            scope_of.append(scope)
            vs_none.append(res.steady_samples_per_s / plain.steady_samples_per_s if plain is not None else None)
            # the imbalance is the schedule's: named once, on its run without the barrier
            notes.append(report.bottleneck_line(res, layers) if scope == "none" else report.barrier_line(res, plain))
    notes = [line for line in notes if line]

    summary = report.summary_rows(results)
    if scopes != ["none"]:
        for row, scope, vs in zip(summary, scope_of, vs_none):
            row.update(clip_scope=scope, vs_no_barrier=vs)
    stages = [row for res in results for row in report.stage_rows(res)]
    drift = report.drift_rows(results)
    (out / "summary.csv").write_text(report.to_csv(summary, report.SUMMARY_COLUMNS))
    (out / "summary.md").write_text(f"{source.description}\n\n" + report.to_markdown(summary, report.SUMMARY_COLUMNS)
                                    + "".join(f"\n{line}\n" for line in notes))
    stage_cols = [report.Column("schedule", "schedule")] + report.STAGE_COLUMNS
    (out / "stages.csv").write_text(report.to_csv(stages, stage_cols))
    (out / "stages.md").write_text(report.to_markdown(stages, stage_cols))
    (out / "drift.csv").write_text(report.to_csv(drift))

    columns = max(shutil.get_terminal_size().columns, 40)  # $COLUMNS, else the terminal's, else 80
    width = None if o["wide"] else columns
    _print(report.render(summary, report.SUMMARY_COLUMNS, o["fmt"], title="schedules", width=width), o["fmt"], width)
    for res in results:
        _print(report.render(report.stage_rows(res), report.STAGE_COLUMNS, o["fmt"], title=f"{res.label}: per device",
                             width=width), o["fmt"], width)
    for line in notes:
        if o["fmt"] == "table":
            click.echo(textwrap.fill(line, columns, subsequent_indent="  ", break_on_hyphens=False))
        else:  # stdout keeps only the table text
            log.info("%s", line)
    if o["fmt"] == "table":
        click.echo(textwrap.fill(f"wrote {out}/: summary.csv/.md, stages.csv/.md, drift.csv, timeline-*.png, "
                                 "trace-*.json", columns, subsequent_indent="  ", break_long_words=False,
                                 break_on_hyphens=False))


def _clip_scopes(o: dict) -> list[str]:
    """The clip scopes to simulate, ``none`` first (every schedule is also reported without a barrier).

    Raises:
        ConfigError: an unknown scope, a --clip-lag below 1 or without stale, a negative --allreduce-latency.
    """
    import math

    from unbubble.sim.barrier import SCOPES

    scopes = [x.strip() for x in str(o["clip_scope"]).split(",") if x.strip()]
    if not scopes:
        raise ConfigError(f"clip_scope={o['clip_scope']!r} is empty: give one or more of {', '.join(SCOPES)} "
                          "(set --clip-scope)")
    for x in scopes:
        if x not in SCOPES:
            raise ConfigError(f"clip_scope={x!r} is invalid{did_you_mean(x, SCOPES)}: must be one of "
                              f"{', '.join(SCOPES)}, or several separated by commas (set --clip-scope)")
    if o["clip_lag"] is not None:
        if o["clip_lag"] < 1:
            raise ConfigError(f"clip_lag={o['clip_lag']} is invalid: the stale norm's lag must be an integer ≥ 1 "
                              "updates (set --clip-lag)")
        if "stale" not in scopes:
            raise ConfigError("--clip-lag is the lag of --clip-scope stale: add stale to --clip-scope, or drop "
                              "--clip-lag")
    lam = o["allreduce_latency"]
    if lam is not None and not (0 <= lam < math.inf):
        raise ConfigError(f"allreduce_latency={lam!r} is invalid: must be a finite number ≥ 0 seconds "
                          "(set --allreduce-latency)")
    if lam is not None and scopes in (["none"], ["none", "stage"], ["stage"]):
        raise ConfigError("--allreduce-latency applies to --clip-scope sync or stale (an all-reduce): add one, "
                          "or drop --allreduce-latency")
    return ["none"] + [x for x in dict.fromkeys(scopes) if x != "none"]


def _print(obj, fmt: str, width: int | None) -> None:
    """Prints a table ``width`` characters wide at most (``None``: as wide as it needs), or text."""
    if fmt == "table":
        from rich.console import Console

        Console(width=max(obj.width, width or 0)).print(obj)
    else:
        click.echo(obj)
