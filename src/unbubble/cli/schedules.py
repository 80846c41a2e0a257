"""``unbubble schedules``: list the schedules with one line of semantics each, or export one
synchronous schedule as a CSV torch.distributed.pipelining loads (``--export NAME``)."""

import os
import textwrap

import click

from unbubble.errors import ConfigError, did_you_mean
from unbubble.schedules.registry import REGISTRY, SCHEDULES, names_where

#: Columns of the list: each schedule's line wraps under its description column to fit them.
WIDTH = 100


@click.command()
@click.option("--export", "export_name", metavar="NAME",
              help="Write NAME's action list for one step as a CSV that torch.distributed.pipelining's _load_csv "
                   "accepts (synchronous schedules), to OUT or stdout, instead of listing.")
@click.option("--stages", type=int, help="With --export: pipeline depth N (ranks).")
@click.option("--m", type=int, help="With --export: micro-batches per step.")
@click.option("--v", type=int, help="With --export interleaved-1f1b, looped-bfs or interleaved-zb: virtual stages per rank (default 2).")
@click.argument("out", required=False, type=click.Path(dir_okay=False))
def schedules(export_name: str | None, stages: int | None, m: int | None, v: int | None, out: str | None) -> None:
    """List the available pipeline schedules, or export one (--export NAME --stages N --m M [OUT.csv])."""
    if export_name is None:
        if (stages, m, v, out) != (None, None, None, None):
            raise ConfigError("--stages, --m, --v and OUT are options of --export NAME: add --export, "
                              "e.g. unbubble schedules --export 1f1b-flush --stages 4 --m 8 out.csv")
        width = max(map(len, SCHEDULES))
        for name, line in SCHEDULES.items():  # wrapped under its column: every line fits WIDTH
            click.echo(textwrap.fill(line, WIDTH, initial_indent=f"{name:<{width}}  ",
                                     subsequent_indent=" " * (width + 2), break_on_hyphens=False,
                                     break_long_words=False))
        return
    from unbubble.schedules.actions import export_torch_csv
    from unbubble.schedules.registry import get_schedule

    if export_name not in SCHEDULES:
        raise ConfigError(f"--export {export_name} is unknown{did_you_mean(export_name, SCHEDULES)}: valid schedules "
                          f"are {', '.join(SCHEDULES)}")
    if REGISTRY[export_name].asynchronous:
        sync = ", ".join(names_where(lambda r: not r.asynchronous))
        raise ConfigError(f"--export {export_name} is invalid: it is asynchronous (U inside a step) and torch's "
                          f"CSV steps the optimizer only between steps; synchronous schedules are {sync}")
    from unbubble.config import check_schedule_options

    try:  # --v where the schedule takes none, as train refuses it
        check_schedule_options([export_name], {k: val for k, val in (("m", m), ("v", v)) if val is not None})
    except ConfigError as err:  # this command names the schedule with --export
        raise ConfigError(str(err).replace("change --schedule", "change --export")) from None
    missing = [f"--{k}" for k, val in (("stages", stages), ("m", m)) if val is None]
    if missing:
        raise ConfigError(f"--export {export_name} needs {' and '.join(missing)}: the exported step is one of N ranks "
                          f"and m micro-batches, e.g. unbubble schedules --export {export_name} --stages 4 --m 8 "
                          "out.csv")
    if out == "-":
        out = None
    if out is not None:
        folder = os.path.dirname(out) or "."
        if not os.path.isdir(folder):
            raise ConfigError(f"out={out!r} is invalid: the folder {folder!r} does not exist (create it first, or "
                              "write to an existing folder; '-' or no OUT prints to stdout)")
    sched = get_schedule(export_name, stages, steps=1, m=m, v=v)
    text = export_torch_csv(sched.compound_order())  # DualPipeV's overlapped F+B: one OVERLAP_F_B cell
    if out is None:
        click.echo(text, nl=False)
    else:
        try:
            with open(out, "w") as f:
                f.write(text)
        except OSError as err:
            raise ConfigError(f"out={out!r} cannot be written: {err.strerror or err}") from None
    # The file cannot carry this note: torch's reader takes every line as a rank.
    click.echo(f"{'wrote ' + out if out else 'written'}: {export_name}, {sched.n_ranks} ranks, one step of m={m} "
               "micro-batches; U omitted (torch reduces each stage's gradients after its m-th backward and steps "
               "the optimizer after schedule.step())", err=True)
