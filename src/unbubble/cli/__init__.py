"""``unbubble`` command line: one module per command, all thin layers over the Python API."""

from __future__ import annotations

import sys

import click

from unbubble.errors import ConfigError, NonFiniteError, PipelineFailure, ScheduleError, StartupInterrupted
from unbubble.progress import err_console, setup_logging  # noqa: F401 - the CLI's console and logging



class _ClosedPipeSafe:
    """A text stream whose writes are dropped once its reader has gone (``BrokenPipeError``): a
    run piped through ``tee`` keeps running when Ctrl-C ends ``tee``, so it still writes its stop
    checkpoint."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone = True
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone = True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_pipes() -> None:
    """Wraps ``sys.stdout`` and ``sys.stderr`` in :class:`_ClosedPipeSafe` (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ClosedPipeSafe):
            setattr(sys, name, _ClosedPipeSafe(stream))




def abort(message: str, status: int = 2) -> None:
    """Prints one error line and exits with ``status`` (2: bad input, 1: the run failed)."""
    err_console.print("[bold red]error:[/] ", markup=True, end="")
    err_console.print(message, markup=False, emoji=False, highlight=False, soft_wrap=True)
    sys.exit(status)


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (ConfigError, ScheduleError) as exc:
            abort(str(exc).splitlines()[0] if isinstance(exc, ConfigError) else str(exc))
        except StartupInterrupted as exc:
            abort(str(exc), status=130)
        except (PipelineFailure, NonFiniteError) as exc:
            abort(str(exc), status=1)
        except OSError as exc:  # a read-only folder, a full disk, a name too long: one line, never a traceback
            from unbubble.safety import os_error_line

            abort(os_error_line(exc), status=1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", count=True, help="More log output (repeatable).")
@click.option("-q", "--quiet", count=True, help="Less log output.")
@click.version_option(package_name="unbubble")
def cli(verbose: int, quiet: int) -> None:
    """unbubble: bubble-free asynchronous pipeline-parallel training (PACI, 1F1B-flush, ...)."""
    setup_logging(verbose - quiet)


from unbubble.cli import schedules as _schedules  # noqa: E402
from unbubble.cli import train as _train  # noqa: E402

cli.add_command(_train.train)
cli.add_command(_schedules.schedules)
cli.add_command(__import__("unbubble.cli.simulate", fromlist=["simulate"]).simulate)
cli.add_command(__import__("unbubble.cli.extrapolate", fromlist=["extrapolate"]).extrapolate)
cli.add_command(__import__("unbubble.cli.predict", fromlist=["predict"]).predict)
cli.add_command(__import__("unbubble.cli.plan", fromlist=["plan"]).plan)
cli.add_command(__import__("unbubble.cli.bench", fromlist=["bench"]).bench)
cli.add_command(__import__("unbubble.cli.report", fromlist=["report"]).report)
cli.add_command(__import__("unbubble.cli.experiment", fromlist=["experiment"]).experiment)
cli.add_command(__import__("unbubble.cli.sweep", fromlist=["sweep"]).sweep)
cli.add_command(__import__("unbubble.cli.export", fromlist=["export"]).export)


def spawn_without_the_cli() -> None:
    """Keeps the CLI out of the stage processes. Python's ``spawn`` re-imports the ``__main__``
    script in every child, and for the ``unbubble`` console script that is this package (click,
    rich, every command's module), which no stage uses (≈ 140 modules). ``multiprocessing`` does
    not re-import a ``__main__`` that is a package's ``__main__`` module, so the script is named
    one; a stage imports only what unpickling its job needs (torch and the runtime)."""
    import importlib.machinery
    import os

    script = sys.modules.get("__main__")
    if script is not None and getattr(script, "__spec__", None) is None and \
            os.path.basename(getattr(script, "__file__", "") or "") == "unbubble":
        script.__spec__ = importlib.machinery.ModuleSpec("unbubble.__main__", None)


def main() -> None:
    survive_closed_pipes()
    spawn_without_the_cli()
    cli(prog_name="unbubble")
