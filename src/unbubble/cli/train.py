"""``unbubble train``: train GPT-2 on real text through a pipeline."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import typing

import click
import cloup

from unbubble.config import AUTO_FIELDS, RESUME_OVERRIDES, TrainConfig, check_schedule_options
from unbubble.errors import ConfigError, PipelineFailure, SecondSignal, StartupInterrupted
from unbubble.progress import ProgressListener, end_lines

log = logging.getLogger("unbubble.train")


#: The sections of ``unbubble train --help``, in order, each with its options most used first
#: (every :class:`TrainConfig` field, and the three options of the command itself, in exactly one).
HELP_SECTIONS: dict[str, tuple[str, ...]] = {
    "Schedule": ("schedule", "stages", "a", "m", "v", "dp", "order"),
    "Model": ("model", "untie"),
    "Data": ("corpus", "text_field", "tokenizer", "allow_tokenizer_mismatch", "document_mask", "seq_len", "micro_batch_size", "eval_interval", "eval_batches", "seed",
             "cache_dir"),
    "Optimizer and remedies": ("steps", "lr", "optimizer", "error_feedback", "predict_weights", "clip_grad_norm",
                               "clip_scope", "warmup_frac", "warmup_min", "min_lr_ratio", "weight_decay", "beta1",
                               "beta2", "muon_momentum", "br_source", "br_geometry", "br_freq", "br_max_precond_dim",
                               "br_allocation", "stage_aware"),
    "Precision and speed": ("engine", "precision", "recompute", "compile", "compile_backend", "threads_per_stage"),
    "Run folder and logging": ("config", "print_config", "run_dir", "tensorboard", "wandb"),
    "Reliability": ("resume", "init_from", "switch_after", "lr_steps", "checkpoints", "checkpoint_every", "final_checkpoint", "nan_policy", "nan_lr_factor",
                    "timeout_s"),
}


class _Auto(click.ParamType):
    """A value of ``inner``'s type, or ``auto`` (None: the schedule's default, see
    :data:`~unbubble.config.AUTO_FIELDS`)."""

    def __init__(self, inner) -> None:
        self.inner = click.types.convert_type(inner)
        self.name = f"{self.inner.name}|auto"

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.lower() == "auto"):
            return None
        try:
            return self.inner.convert(value, param, ctx)
        except click.BadParameter:
            self.fail(f"{value!r} is neither auto nor a {self.inner.name}", param, ctx)


def _field_option(f: dataclasses.Field, hint):
    """The ``cloup.option`` decorator of one :class:`TrainConfig` field: its type, default and help."""
    args = typing.get_args(hint)
    helptext = f.metadata.get("help", "")
    if typing.get_origin(hint) is typing.Literal:
        # validated by TrainConfig, so a bad value gets the same one-line error as the rest
        typ = str
        helptext += f" One of: {', '.join(args)}."
    elif type(None) in args:
        typ = next(a for a in args if a is not type(None))
    else:
        typ = hint
    flag = "--" + f.name.replace("_", "-")
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if f.name in AUTO_FIELDS:  # 'auto' as in a config file: the default of the run's schedule
        return cloup.option(flag, f.name, type=_Auto(typ), default=None, show_default="auto", help=helptext)
    if hint is bool:  # --x/--no-x, so a flag can turn off what a --config file turned on
        return cloup.option(f"{flag}/--no-{flag[2:]}", f.name, default=default, help=helptext)
    return cloup.option(flag, f.name, type=typ, default=default, show_default=True, help=helptext)


_COMMAND_OPTIONS = {
    "config": cloup.option("--config", "config", default=None, type=click.Path(dir_okay=False),
                           help="YAML file of options (a run folder's config.yaml, or --print-config output); flags "
                                "given on the command line win over it."),
    "print_config": cloup.option("--print-config", is_flag=True,
                                 help="Print the effective configuration as YAML and exit (schedule-dependent "
                                      "defaults as auto, so it runs with any --schedule)."),
    "resume": cloup.option("--resume", "resume", default=None, type=click.Path(file_okay=False),
                           help="Continue the run in this folder from its newest complete checkpoint, with its own "
                                "config.yaml (only " + ", ".join("--" + o.replace("_", "-") for o in RESUME_OVERRIDES)
                                + " may be given too)."),
}


def _options(fn):
    """One ``--flag`` per :class:`TrainConfig` field (and ``--config``, ``--print-config``,
    ``--resume``), in the sections of :data:`HELP_SECTIONS`."""
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    placed = [name for names in HELP_SECTIONS.values() for name in names]
    missing = [name for name in [*fields, *_COMMAND_OPTIONS] if name not in placed]
    sections = {**HELP_SECTIONS, "Other": tuple(missing)} if missing else HELP_SECTIONS
    for title, names in reversed(sections.items()):
        fn = cloup.option_group(title, *[_COMMAND_OPTIONS[n] if n in _COMMAND_OPTIONS else
                                         _field_option(fields[n], hints[n]) for n in names])(fn)
    return fn


def _stopped_at_once(signal_: SecondSignal, listeners: list,
                     failure: PipelineFailure | None = None) -> PipelineFailure:
    """The failure a second stop signal ends ``unbubble train`` with: the line naming the kept
    checkpoint and the --resume command, where the run folder is known and kept (a new run stopped
    before its first step has been removed), else ``failure`` or the signal's own words."""
    from unbubble.runtime.launch import stopped_at_once

    writer = listeners[-1].writer if listeners else None
    if writer is not None and writer.dir.is_dir():
        return PipelineFailure(stopped_at_once(signal_.signame, writer.job.checkpoint, writer.job.schedule.n_stages,
                                               writer.dir))
    return failure or PipelineFailure(str(signal_))


def _given(kwargs: dict) -> dict:
    """The options given explicitly on the command line (not defaults)."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    return {k: v for k, v in kwargs.items()
            if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}


def _effective_config(kwargs: dict) -> TrainConfig:
    """The configuration from ``--config`` (if given) with the flags given explicitly on top."""
    from unbubble.config import load_config

    path = kwargs.pop("config")
    if path is None:
        return TrainConfig(**kwargs)
    return load_config(path, overrides=_given(kwargs))


@cloup.command(context_settings={"show_default": True})
@_options
def train(print_config: bool, resume: str | None, **kwargs) -> None:
    """Train a GPT-2-style model on real text across a pipeline of stages.

    Defaults: PACI (a = 4) with Muon and error feedback on 4 stage processes, the tiny preset,
    byte-level King James Bible, 800 steps: 13 min 43 s on 2 CPU cores shared with other jobs (load 7–10),
    ending at validation loss ≈ 1.06. The run folder (runs/<time>-<schedule>-N<stages>/) gets
    config.yaml, metrics.jsonl, actions.jsonl, summary.json, loss.png and TensorBoard events.

    `--config run.yaml` reads options from a file (flags given win over it; `--print-config >
    run.yaml` writes one). Ctrl-C or SIGTERM stops at the next step after a checkpoint (exit 130)
    and `--resume RUN` continues; a second signal stops at once.
    """
    from unbubble.runtime.telemetry import process_start_epoch
    from unbubble.train import resume_config, train as run_training

    if resume is not None:
        given = _given(kwargs)
        if given.pop("config", None) is not None:
            raise ConfigError("--config and --resume exclude each other: --resume continues with the run's own "
                              "config.yaml")
        cfg = resume_config(resume, given)
    else:
        cfg = _effective_config(kwargs)
        # flags typed for this run (a --config file holds every field, so its a, m, v are not "given")
        check_schedule_options([cfg.schedule], _given(kwargs))
    if print_config:
        from unbubble.config import config_to_yaml

        click.echo(config_to_yaml(cfg), nl=False)
        return
    listeners = []

    def factory(writer, total):
        for lst in listeners:  # a --switch-after run's first phase has ended (its writer is closed)
            lst.close()
        starting = f"starting {cfg.stages * cfg.dp} stage processes…" if cfg.engine == "processes" else ""
        listeners.append(ProgressListener(writer, total, max(total // 20, 1), starting, writer.resume_step or 0))
        return listeners[-1]

    try:
        if resume is not None:
            result, run_dir = run_training(listener_factory=factory, resume=resume, resume_overrides=_given(kwargs),
                                           started_at=process_start_epoch())
        else:
            result, run_dir = run_training(cfg, listener_factory=factory, started_at=process_start_epoch())
    except SecondSignal as exc:  # under torchrun it comes straight from the stage's own handler
        for lst in listeners:
            lst.close()
        raise _stopped_at_once(exc, listeners) from None
    except (KeyboardInterrupt, StartupInterrupted) as exc:  # a stop before the first step
        for lst in listeners:  # the bar's line ends before the message
            lst.close()
        after = f"the run folder is unchanged; continue with: unbubble train --resume {resume}" if resume else \
            "nothing of the new run was kept"
        what = str(exc) if isinstance(exc, StartupInterrupted) else "interrupted before the first step"
        raise StartupInterrupted(f"{what}; {after}") from None
    except PipelineFailure as exc:
        for lst in listeners:
            lst.close()
        if isinstance(exc.__context__, SecondSignal) and listeners:  # name the kept checkpoint and the command
            raise _stopped_at_once(exc.__context__, listeners, exc) from None
        raise
    except BaseException:
        for lst in listeners:
            lst.close()
        raise
    if result is None:  # a torchrun rank other than 0
        for lst in listeners:
            lst.close()
        return
    summary = json.loads((run_dir / "summary.json").read_text())  # the whole run, across resumes
    listeners[-1].finish(summary)
    for lst in listeners:
        lst.close()
    for line in end_lines(cfg, result, run_dir, summary):
        click.echo(line)
    if result.stopped_at is not None:
        if cfg.checkpoints:
            click.echo(f"stopped at step {result.stopped_at} of {cfg.steps}; checkpoint "
                       f"{run_dir}/checkpoints/step-{result.stopped_at:08d}; continue with: "
                       f"unbubble train --resume {run_dir}")
        else:
            click.echo(f"stopped at step {result.stopped_at} of {cfg.steps}; no checkpoint (--no-checkpoints)")
        sys.exit(130)
