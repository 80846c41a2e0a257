"""``unbubble predict RUN_DIR``: a real run's measured utilization and makespan beside the simulator's."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

FORMATS = ("table", "markdown", "csv")


def prediction_rows(run, statistic: str = "mean", blocking_sends: bool = True):
    """Per-device rows (measured vs predicted) and the simulated result for a loaded run.

    Predicted utilization counts compute only (the calibrated blocking-send time is left out, as the
    measured action records leave it out); ``predicted_busy_with_sends`` includes it. An emulator run
    is calibrated on its action durations only: its stages ran one after another in one process, so
    the gaps between them are no link's latency and it sent nothing (the prediction is then what
    ``unbubble train`` reports for it, up to ``statistic``).
    """
    import dataclasses

    from unbubble.sim.measured import measured_costs, send_times
    from unbubble.sim.result import schedule_policies
    from unbubble.sim.engine import run_policies

    emulated = run.config.get("engine") == "emulator"
    blocking_sends = blocking_sends and not emulated
    costs = measured_costs(run.trace, blocking_sends=blocking_sends, statistic=statistic)
    if emulated:
        costs = dataclasses.replace(costs, latency_s=0.0)
    pred = run_policies(run.schedule, costs, policies=schedule_policies(run.schedule))
    sends = send_times(run.trace) if blocking_sends else [0.0] * run.schedule.n_stages
    n, nr = run.schedule.n_stages, run.schedule.n_ranks
    n_send = [0] * n
    for s, k, _, _, _, _, _ in pred.rows():
        if (k == 0 and s < n - 1) or (k in (1, 2) and s > 0):
            n_send[s] += 1
    m_busy, p_busy = run.trace.busy_per_rank(), pred.busy_per_rank()
    m_span, p_span = run.trace.makespan, pred.makespan
    rows = []
    for r in range(nr):
        send_s = sum(n_send[s] * sends[s] for s in run.schedule.stages_of(r))
        rows.append({"rank": r, "measured_utilization": m_busy[r] / m_span,
                     "predicted_utilization": (p_busy[r] - send_s) / p_span,
                     "predicted_busy_with_sends": p_busy[r] / p_span,
                     "measured_busy_s": m_busy[r], "predicted_busy_s": p_busy[r] - send_s,
                     "send_s_per_message": sends[r] if nr == n else None})
    total = {"measured_makespan_s": m_span, "predicted_makespan_s": p_span,
             "error": (p_span - m_span) / m_span if m_span else None}
    return rows, total, pred


@click.command(context_settings={"show_default": True})
@click.argument("run_dir", type=click.Path())
@click.option("--statistic", default="mean", type=click.Choice(["mean", "median"], case_sensitive=False),
              help="Per-stage duration statistic used for the calibration.")
@click.option("--blocking-sends/--no-blocking-sends", default=True,
              help="Charge each stage the calibrated time its sends hold it (the process engine's sends block).")
@click.option("--out", default=None, type=click.Path(), help="Also write prediction.csv/.md and both timelines here.")
@click.option("--format", "fmt", default="table", type=click.Choice(FORMATS, case_sensitive=False), help="How tables are printed.")
def predict(run_dir: str, statistic: str, blocking_sends: bool, out: str | None, fmt: str) -> None:
    """Compare a real run's per-device utilization and makespan with the simulator's prediction.

    The simulator runs the run's own schedule on costs calibrated from the run's actions.jsonl
    (per-stage mean F/B/I/W/U durations, link latencies, blocking-send time), so the difference
    shows what the cost model leaves out: dispatch gaps, receive polling, contention spikes.
    """
    from unbubble.sim import report
    from unbubble.sim.measured import kind_medians, load_run

    run = load_run(run_dir)
    rows, total, pred = prediction_rows(run, statistic, blocking_sends)
    cols = [report.Column("rank", "device"),
            report.Column("measured_utilization", "measured util.", report._pct),
            report.Column("predicted_utilization", "predicted util.", report._pct),
            report.Column("predicted_busy_with_sends", "predicted incl. sends", report._pct),
            report.Column("measured_busy_s", "measured busy (s)", report._num(2)),
            report.Column("predicted_busy_s", "predicted busy (s)", report._num(2)),
            report.Column("send_s_per_message", "send (ms)", lambda v: "—" if v is None else f"{1e3 * v:.2f}")]
    med = kind_medians(run.trace)
    cost_rows = [{"rank": s, **{f"{k}_ms": 1e3 * v for k, v in m.items()}} for s, m in enumerate(med)]
    cost_cols = [report.Column("rank", "stage")] + [report.Column(f"{k}_ms", f"median {k} (ms)", report._num(2))
                                                    for k in "FBIWU"]
    sched = run.schedule
    title = (f"{sched.name}, N={sched.n_stages}, {sched.total_mb} micro-batches: makespan measured "
             f"{total['measured_makespan_s']:.3f} s, predicted {total['predicted_makespan_s']:.3f} s "
             f"({100 * total['error']:+.1f}%)")
    width = max(shutil.get_terminal_size().columns, 40)  # headers wrap to fit, as in unbubble simulate
    for table, c, t in ((rows, cols, title), (cost_rows, cost_cols, "measured action durations")):
        obj = report.render(table, c, fmt, title=t, width=width)
        if fmt == "table":
            from rich.console import Console

            Console(width=max(obj.width, width)).print(obj)
        else:
            click.echo(obj)
    if run.config.get("engine") == "emulator" and fmt == "table":
        click.echo(click.wrap_text(f"An emulator run: its {sched.n_stages} stages ran one after another in one process, so the "
                   "measured makespan and utilization are no device's; the predicted columns are its schedule on "
                   f"{sched.n_stages} devices at the measured action durations.", width=min(width, 100)))
    if out:
        from unbubble.sim.render import timeline_png, window_end

        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "prediction.csv").write_text(report.to_csv([{**r, **total} for r in rows]))
        (d / "prediction.md").write_text(f"{title}\n\n" + report.to_markdown(rows, cols))
        t_end = window_end(run.trace, sched.mb_per_step)
        timeline_png(run.trace, d / "timeline-measured.png", title=f"measured: {sched.name}", t_end=t_end)
        timeline_png(pred, d / "timeline-predicted.png", title=f"predicted: {sched.name}",
                     t_end=window_end(pred, sched.mb_per_step))
        if fmt == "table":
            click.echo(f"wrote {d}/: prediction.csv/.md, timeline-measured.png, timeline-predicted.png")
