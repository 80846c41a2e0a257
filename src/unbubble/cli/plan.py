"""``unbubble plan``: the fastest schedule × N × m × v × recompute × a × dp for a model, a cluster and a batch."""

from __future__ import annotations

import logging
import shutil
import textwrap
import time

import click

from unbubble.errors import ConfigError
from unbubble.schedules.clip import SIM_SCOPES
from unbubble.sim.hardware import HARDWARE

log = logging.getLogger("unbubble.plan")

FORMATS = ("table", "markdown", "csv")


def _ints(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{name}={text!r} is invalid: give comma-separated integers, e.g. 2,4 "
                          f"(set --{name.replace('_', '-')})") from None


def _overhead_note(rows, given: float | None, error_feedback: bool, predict_weights: bool,
                   updates: int | None = None) -> str:
    """Which token overhead each delayed schedule got: given, measured (with its source), or none."""
    from unbubble.sim import plan as planner

    delayed = list(dict.fromkeys(r.schedule for r in rows if r.max_delay > 0))
    if not delayed:
        return "No searched configuration is delayed (max τ = 0): every row computes 1F1B-flush's updates, overhead 1."
    if given is not None:
        return (f"Token overhead {given:g} (given with --token-overhead) applied to every delayed row "
                f"({', '.join(delayed)}); the others compute 1F1B-flush's updates: overhead 1.")
    parts = []
    for name in delayed:
        found = planner.measured_overhead(name, error_feedback, predict_weights, updates)
        if found:
            parts.append(f"{name} {found[1]}")
    missing = [n for n in delayed if planner.measured_overhead(n, error_feedback, predict_weights) is None]
    line = (f"Token overhead applied for a run of {updates:,} updates (--updates), the measurement with Muon at the "
            "nearest measured length (deep-cpu, N=8, a=4; docs/results.md): " if updates else
            "Token overhead applied, as measured with Muon (" + planner.MEASURED_SETTING + "): ") + (
        "; ".join(parts) if parts else "none of the searched schedules") + "."
    if missing:
        line += (f" Not measured for {', '.join(missing)}: left out of the time-to-target table (give "
                 "--token-overhead X to rank them).")
    return line + " Rows without delay (synchronous, or N = 1) compute 1F1B-flush's updates: overhead 1."


def _columns(time_to_target: bool, barrier: bool = False):
    from unbubble.sim.report import Column, _gb, _num, _pct

    yes = lambda v: "full" if v else "none"  # noqa: E731
    cols = [Column("rank", "#"), Column("label", "schedule"), Column("stages", "N"), Column("dp", "dp"),
            Column("micro_batch_size", "b", hide=3), Column("recompute", "recompute", yes, hide=4)]
    if time_to_target:
        cols += [Column("effective_tokens_per_s", "tokens/s ÷ overhead", _num(0)),
                 Column("token_overhead", "overhead", _num(2), hide=3),
                 Column("vs_sync", "× fastest sync", _num(3)),
                 Column("tokens_per_s", "tokens/s", _num(0), hide=2)]
    else:
        cols += [Column("tokens_per_s", "tokens/s", _num(0)), Column("vs_first", "× first", _num(3), hide=5)]
    if barrier:
        cols += [Column("vs_no_barrier", "× no barrier", _num(3))]
    cols += [Column("peak_memory_bytes", "peak GB", _gb), Column("bubble", "bubble", _pct, hide=1),
             Column("max_delay", "max τ", hide=6)]
    return cols


def _print(obj, fmt: str, width: int | None) -> None:
    if fmt == "table":
        from rich.console import Console

        Console(width=max(obj.width, width or 0)).print(obj)
    else:
        click.echo(obj)


@click.command(context_settings={"show_default": True})
@click.option("--model", default="gpt2-medium", help="Model preset (tiny … gpt2-xl, small-cpu, deep-cpu, llama-1b, "
                                                      "llama-8b, mixtral-8x7b, zb-1.5b …; see `unbubble simulate --help`).")
@click.option("--gpus", default="8xH200", help=f"Cluster as COUNTxGPU from the hardware table ({', '.join(HARDWARE)}): "
                                               "1 to a node's 8, or whole nodes.")
@click.option("--global-batch-tokens", default=262_144, type=int,
              help="Tokens per update of the whole cluster (the default: the PACI paper's 256 sequences of 1024).")
@click.option("--seq-len", default=None, type=int, help="Tokens per sequence [default: the model's block size].")
@click.option("--memory-gb", default=None, type=float, help="Memory per device, GB [default: the table's].")
@click.option("--link-gb-s", default=None, type=float,
              help="Bandwidth between two devices of a node, GB/s one direction [default: the table's].")
@click.option("--inter-node-gb-s", default=None, type=float,
              help="Bandwidth per device between nodes, GB/s one direction [default: the table's].")
@click.option("--achievable", default=None, type=float, help="Fraction of peak FLOP/s reached [default: the table's].")
@click.option("--precision", default="bf16", type=click.Choice(["fp32", "bf16-autocast", "bf16"], case_sensitive=False),
              help="Bytes and compute speed of training precision.")
@click.option("--vocab-size", default=None, type=int, help="Vocabulary [default: the published model's].")
@click.option("--schedules", default=None, help="Comma-separated schedules to search [default: every registered one].")
@click.option("--stages", default=None, help="Comma-separated pipeline depths N [default: every divisor of the GPUs].")
@click.option("--v", "v_values", default="2,4", help="Chunks per device tried for interleaved-1f1b, looped-bfs, "
                                                    "interleaved-zb.")
@click.option("--recompute", default="auto", type=click.Choice(["auto", "none", "full"], case_sensitive=False),
              help="auto: full recomputation where a configuration does not fit without it.")
@click.option("--max-micro-batches", default=None, type=int,
              help="Largest m (or a) tried [default: every divisor of the sequences per replica].")
@click.option("--token-overhead", default=None, type=float,
              help="Tokens an asynchronous run needs to reach the synchronous loss ÷ the synchronous run's, for "
                   "every asynchronous schedule [default: the one measured for the schedule and its remedies with "
                   "Muon at the --updates nearest measured: paci with error feedback 1.33 (600 updates) or ≥ 1.07 "
                   "(2,400), 1.41/1.23/1.09 with --predict-weights alone (600/1,200/2,400), 1.79 with neither "
                   "(600; deep-cpu, N=8, a=4); the other asynchronous schedules were not measured and are "
                   "ranked by time to target only with this option].")
@click.option("--updates", default=2400, type=click.IntRange(1), show_default=True,
              help="Optimizer updates of the run planned for: the measured token overhead falls with training "
                   "length (PACI with error feedback: 1.33 at 600 updates, ≥ 1.07 at 2,400), so the plan takes the "
                   "measurement nearest to it and says which.")
@click.option("--error-feedback/--no-error-feedback", default=True,
              help="Error feedback on the asynchronous schedules (unbubble train's default): its buffers in their "
                   "memory, and the token overhead measured with it.")
@click.option("--predict-weights/--no-predict-weights", default=False,
              help="Weight prediction on paci and async-1f1b: its buffers in their memory, and the token overhead "
                   "measured with it.")
@click.option("--flash-attention/--no-flash-attention", default=False, help="Attention scores are not stored.")
@click.option("--clip-scope", default="none", type=click.Choice(SIM_SCOPES, case_sensitive=False),
              help="Per-update global operation of every configuration, as `unbubble train --clip-scope` (global "
                   "gradient clipping, the non-finite check): sync, a blocking gradient-norm all-reduce over the "
                   "pipeline's devices (a barrier per update); stale, non-blocking, update t clipped with the norm "
                   "of update t − s; stage, a local norm. Rows then give tokens/s with it and × no barrier.")
@click.option("--clip-lag", default=None, type=int,
              help="s of --clip-scope stale [default: the runtime's, ⌈N/a⌉ for asynchronous schedules, 1 for "
                   "flushed ones].")
@click.option("--top", default=10, type=int, help="Rows printed per table.")
@click.option("--all-configs", is_flag=True, help="Rank every configuration (default: each schedule's best).")
@click.option("--format", "fmt", default="table", type=click.Choice(FORMATS, case_sensitive=False), help="How tables are printed.")
@click.option("--wide", is_flag=True, help="Print every table column (by default a narrow terminal hides some).")
def plan(model: str, gpus: str, global_batch_tokens: int, seq_len: int | None, memory_gb: float | None,
         link_gb_s: float | None, inter_node_gb_s: float | None, achievable: float | None, precision: str,
         vocab_size: int | None, schedules: str | None, stages: str | None, v_values: str, recompute: str,
         max_micro_batches: int | None, token_overhead: float | None, updates: int, error_feedback: bool,
         predict_weights: bool,
         flash_attention: bool, clip_scope: str, clip_lag: int | None, top: int, all_configs: bool, fmt: str,
         wide: bool) -> None:
    """Which schedule, pipeline depth and micro-batching to run: a search on the simulator.

    Searches every schedule × pipeline depth N × micro-batches per update (m, or a for PACI) ×
    chunks per device v × recomputation × data-parallel replicas dp (N·dp = GPUs) for a global
    batch of --global-batch-tokens, on the analytic cost model of --gpus (the simulator of
    `unbubble simulate`; data-parallel gradient all-reduce added to each update), keeps the
    configurations whose fullest device fits in memory, and prints them by predicted tokens/s,
    then by predicted time to the synchronous run's loss: an asynchronous schedule's tokens/s ÷
    its token overhead (measured for PACI with Muon and each remedy, or --token-overhead).
    """
    from unbubble.sim import plan as planner
    from unbubble.sim.analytic import make_model

    if top < 1:
        raise ConfigError(f"top={top} is invalid: must be an integer ≥ 1 (set --top)")
    cluster = planner.parse_gpus(gpus, memory_gb=memory_gb, link_gb_s=link_gb_s, inter_node_gb_s=inter_node_gb_s,
                                 achievable=achievable)
    config = make_model(model, vocab_size, seq_len)
    overhead = "measured" if token_overhead is None else token_overhead
    names = [s.strip() for s in schedules.split(",") if s.strip()] if schedules else None
    rc = {"auto": (False, True), "none": (False,), "full": (True,)}[recompute]
    t0 = time.perf_counter()
    rows = planner.candidates(config, cluster, global_batch_tokens, schedules=names, stages=_ints(stages, "stages"),
                              v_values=_ints(v_values, "v") or planner.DEFAULT_V, recompute=rc, precision=precision,
                              flash_attention=flash_attention, predict_weights=predict_weights,
                              error_feedback=error_feedback,
                              token_overhead=overhead, updates=updates, max_micro_batches=max_micro_batches,
                              clip_scope=clip_scope, clip_lag=clip_lag)
    ranked = planner.rank(rows)
    elapsed = time.perf_counter() - t0
    columns = max(shutil.get_terminal_size().columns, 40)
    seqs = global_batch_tokens // config.block_size
    head = (f"{model} ({config.n_layer} blocks, width {config.n_embd}, V={config.vocab_size}, T={config.block_size}, "
            f"{precision}) on {cluster.describe()}; global batch {global_batch_tokens:,} tokens ({seqs} sequences) "
            f"per update. {len(ranked)} of {len(rows)} configurations fit in memory (searched in {elapsed:.1f} s).")
    log.debug("%d configurations simulated in %.2f s", len(rows), elapsed)
    pick = (lambda rs: rs) if all_configs else planner.best_per_schedule
    by_rate = pick(ranked)[:top]
    best_sync = next((r for r in ranked if not r.asynchronous), None)
    first = by_rate[0].tokens_per_s
    t1 = [{**r.as_dict(), "rank": i + 1, "vs_first": r.tokens_per_s / first} for i, r in enumerate(by_rate)]
    by_ttt = pick([r for r in planner.by_time_to_target(ranked) if r.max_delay > 0])[:top]
    t2 = [{**r.as_dict(), "rank": i + 1,
           "vs_sync": r.effective_tokens_per_s / best_sync.tokens_per_s if best_sync else None}
          for i, r in enumerate(by_ttt)]
    what = "every configuration" if all_configs else "each schedule's best configuration"
    title1 = f"by predicted tokens/s ({what})"
    against = (f"; × fastest sync: against {best_sync.label}, N={best_sync.stages}, dp={best_sync.dp}, "
               f"{best_sync.tokens_per_s:,.0f} tokens/s (> 1: asynchrony pays)" if best_sync else "")
    divisor = f"token overhead {token_overhead:g}" if token_overhead is not None else "its measured token overhead"
    title2 = (f"asynchronous schedules (max τ > 0) by predicted time to the synchronous loss: tokens/s ÷ {divisor} "
              f"({what}{against})")
    if fmt == "csv":
        from unbubble.sim.report import to_csv

        click.echo(to_csv([{**r.as_dict(), "ranking": "tokens_per_s", "rank": i + 1} for i, r in enumerate(by_rate)]
                          + [{**r.as_dict(), "ranking": "time_to_target", "rank": i + 1}
                             for i, r in enumerate(by_ttt)]), nl=False)
        return
    from unbubble.sim.report import render

    width = None if wide or fmt != "table" else columns
    if fmt == "table":
        click.echo(textwrap.fill(head, columns, break_on_hyphens=False))
    else:
        click.echo(head + "\n")
    barrier = clip_scope != "none"
    _print(render(t1, _columns(False, barrier), fmt, title=title1, width=width), fmt, width)
    if t2:
        _print(render(t2, _columns(True, barrier), fmt, title=title2, width=width), fmt, width)
    notes = [_overhead_note(rows, token_overhead, error_feedback, predict_weights, updates),
             "Predicted on the analytic cost model (unbubble.sim.analytic) and the simulator's memory model; "
             "data-parallel all-reduce added to each update, not overlapped."]
    if barrier:
        from unbubble.sim.barrier import allreduce_latency

        what = {"sync": "a blocking gradient-norm all-reduce over each pipeline's devices per update (a barrier: "
                        "no stage steps before every stage has finished the update's backwards)",
                "stale": "a non-blocking gradient-norm all-reduce per update, update t clipped with the norm of "
                         f"update t − {clip_lag if clip_lag else 's (⌈N/a⌉ asynchronous, 1 flushed)'}",
                "stage": "a local gradient norm per update (no all-reduce)"}[clip_scope]
        node = min(cluster.gpus, cluster.hardware.gpus_per_node)
        notes.append(f"--clip-scope {clip_scope}: {what}; all-reduce latency from the hardware table, a ring "
                     f"({allreduce_latency(cluster.hardware, node) * 1e6:.3g} µs over {node} devices of a node); "
                     "× no barrier: tokens/s ÷ the same configuration's without it.")
    for line in notes:
        click.echo(textwrap.fill(line, columns, break_on_hyphens=False) if fmt == "table" else "\n" + line)
