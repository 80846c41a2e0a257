"""Bring your own model: cut an ``nn.Sequential`` into pipeline stages and train it with any schedule.

A :class:`~unbubble.runtime.job.PipelineJob` needs a picklable, deterministic *stage function*
``stage_fn(stage) -> nn.Module`` that every engine calls once per stage; :class:`StageBuilder` builds one
from a function that returns your whole model. How it cuts, and the optimizer helpers:
docs/architecture.md#pipelinepy.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.schedules.registry import Schedule

__all__ = ["split_sequential", "merge_state_dicts", "StageBuilder", "torch_optimizer", "pipeline_optimizer"]


def split_sequential(seq: nn.Sequential, cut_points: Sequence[str | int]) -> list[nn.Sequential]:
    """Cuts ``seq`` before each named child into ``len(cut_points) + 1`` contiguous stages.

    The stages share the children (no copy): stage s is an ``nn.Sequential`` of the children
    from cut point s − 1 (the first child for s = 0) up to, not including, cut point s, under
    their original names, so ``stage.state_dict()`` keys equal the whole model's keys.

    Args:
        seq: the model, an ``nn.Sequential`` whose children run one after the other
            (children are top-level only: cut a nested block by flattening it first).
        cut_points: names of the children that *start* stages 1 … N−1, in model order: the
            names given in an ``OrderedDict`` (``"fc2"``), or positions (``2`` or ``"2"``) for
            an unnamed ``nn.Sequential``. Empty gives one stage.

    Returns:
        N = ``len(cut_points) + 1`` stage modules; ``nn.Sequential(*stages)`` computes what
        ``seq`` computes.

    Raises:
        ConfigError: a cut point that is not a child (the message lists the valid names), the
            first child (stage 0 would be empty), a repeated one, or cut points out of model order.
    """
    if not isinstance(seq, nn.Sequential):
        raise ConfigError(f"model={type(seq).__name__} is invalid: split_sequential needs an nn.Sequential "
                          "(wrap your layers in one, or give StageBuilder a list of stage modules)")
    names = [name for name, _ in seq.named_children()]
    index = {name: i for i, name in enumerate(names)}
    starts = []
    for cut in cut_points:
        key = str(cut) if isinstance(cut, int) and not isinstance(cut, bool) else cut
        if not isinstance(key, str) or key not in index:
            if isinstance(cut, int) and not isinstance(cut, bool) and 0 <= cut < len(names):
                key = names[cut]  # a position in a named Sequential
            else:
                raise ConfigError(f"cut point {cut!r} is not a child of the model: valid cut points are "
                                  f"{', '.join(names[1:])} (top-level children, in order)")
        i = index[key]
        if i == 0:
            raise ConfigError(f"cut point {cut!r} is the first child: stage 0 would be empty "
                              f"(valid cut points are {', '.join(names[1:])})")
        if starts and i <= starts[-1]:
            what = "repeated" if i == starts[-1] else f"before {names[starts[-1]]!r}"
            raise ConfigError(f"cut point {cut!r} is {what}: cut points must be distinct and in model order "
                              f"({', '.join(names)})")
        starts.append(i)
    bounds = [0, *starts, len(names)]
    children = list(seq.named_children())
    return [nn.Sequential(OrderedDict(children[lo:hi])) for lo, hi in zip(bounds, bounds[1:])]


def merge_state_dicts(states: Iterable[dict[str, torch.Tensor]], owners: dict[str, int] | None = None,
                      what: str = "state dicts") -> dict[str, torch.Tensor]:
    """One ``state_dict`` for the whole model from the stages' ``state_dict``\\ s: the one merge of stage states
    (``unbubble.export.merged_state_dict`` merges a checkpoint's stage files with it).

    Args:
        states: per stage (0-based, in order), as in ``RunResult.final_states``; stages made by
            :func:`split_sequential` or ``unbubble.models.split.split_model`` keep the model's key names.
        owners: filled with each key's stage, when given.
        what: what ``states`` are, for the error message (``"checkpoints"``).

    Returns:
        The union of the dicts, for ``model.load_state_dict``.

    Raises:
        ConfigError: a key appears in two stages (the stages do not use the model's names).
    """
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for s, state in enumerate(states):
        for key, value in state.items():
            if key in merged:
                raise ConfigError(f"{key!r} is in the {what} of stages {owner[key]} and {s}: the stages do not use the "
                                  "model's names (cut them with unbubble.pipeline.split_sequential or "
                                  "unbubble.models.split.split_model)")
            merged[key], owner[key] = value, s
    if owners is not None:
        owners.update(owner)
    return merged


@dataclass(frozen=True)
class StageBuilder:
    """A picklable, deterministic ``stage_fn`` for :class:`~unbubble.runtime.job.PipelineJob`.

    Each call builds the whole model with ``build()`` under ``torch.manual_seed(seed)`` (the global
    random state is saved and restored around it), cuts it, and returns one stage, so every
    process gets identical initial weights. Building the whole model per stage is fine for models
    that fit one host; for larger ones write a ``stage_fn`` that builds only its layers.

    Args:
        build: a module-level function (or ``functools.partial`` of one) returning either an
            ``nn.Sequential`` (cut at ``cut_points``) or a list of stage modules (the stages,
            ``cut_points`` must be ``None``).
        cut_points: see :func:`split_sequential`; ``None`` when ``build`` returns the stages.
        seed: seed of the initial weights.

    Raises:
        ConfigError: (when called) bad cut points, or ``build`` returned something that is neither.
    """

    build: Callable[[], nn.Module | Sequence[nn.Module]]
    cut_points: tuple[str | int, ...] | None = None
    seed: int = 0
    _n: list = field(default_factory=list, init=False, compare=False, repr=False)  # cached stage count

    def __post_init__(self) -> None:
        if self.cut_points is not None:
            object.__setattr__(self, "cut_points", tuple(self.cut_points))

    def stages(self) -> list[nn.Module]:
        """All stages, freshly built (weights as for every other call)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.build()
        if self.cut_points is not None:
            return split_sequential(model, self.cut_points)
        if isinstance(model, nn.Module) and not isinstance(model, (nn.ModuleList, nn.Sequential)):
            raise ConfigError(f"build() returned a {type(model).__name__}: give cut_points to split an "
                              "nn.Sequential, or return a list of stage modules")
        stages = list(model)
        if not stages or not all(isinstance(m, nn.Module) for m in stages):
            raise ConfigError("build() returned no stage modules: return an nn.Sequential with cut_points, "
                              "or a non-empty list of nn.Module stages")
        return stages

    @property
    def n_stages(self) -> int:
        """Pipeline depth N this builder produces (builds the model once to count)."""
        if not self._n:
            self._n.append(len(self.stages()))
        return self._n[0]

    def __call__(self, stage: int) -> nn.Module:
        """Stage ``stage`` (0-based) of a fresh build."""
        stages = self.stages()
        if not 0 <= stage < len(stages):
            raise ConfigError(f"stage={stage} is invalid: the model has {len(stages)} stages (0..{len(stages) - 1})")
        return stages[stage]

    def model(self) -> nn.Sequential:
        """The whole model (freshly built, same initial weights), e.g. for a non-pipelined reference."""
        return nn.Sequential(*self.stages())


def _torch_optimizer(cls: type, kwargs: dict[str, Any], params: list, stage: int) -> torch.optim.Optimizer:
    return cls(params, **kwargs)


def torch_optimizer(cls: type[torch.optim.Optimizer], **kwargs: Any) -> Callable[[list, int], torch.optim.Optimizer]:
    """A picklable ``optimizer_fn`` that gives every stage ``cls(params, **kwargs)``.

    Example: ``torch_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.0)``. ``params`` are
    the stage's ``(name, parameter)`` pairs, which every ``torch.optim`` optimizer accepts.
    """
    return functools.partial(_torch_optimizer, cls, dict(kwargs))


def _pipeline_optimizer(name: str, n_stages: int, delays: tuple[int, ...], lr: float, betas: tuple[float, float],
                        weight_decay: float, options: dict[str, Any], params: list, stage: int) -> torch.optim.Optimizer:
    from unbubble.optim import build_optimizer

    return build_optimizer(name, params, stage, n_stages, delays[stage], lr, betas, weight_decay,
                           br_stage_delays=list(delays), **options)


def pipeline_optimizer(name: str, schedule: Schedule, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                       weight_decay: float = 0.0, **options: Any) -> Callable[[list, int], torch.optim.Optimizer]:
    """A picklable ``optimizer_fn`` for unbubble's stage-aware optimizers.

    Each stage s gets ``unbubble.optim.build_optimizer(name, …, delay=schedule.delay_bound(s))``,
    so the delay-aware ones know their staleness τ_s.

    Args:
        name: ``"adamw"``, ``"basis-rotation"`` (arXiv 2602.03515), ``"nesterov"`` (PipeNAG) or ``"nadam"``.
        schedule: the job's schedule (for N and every stage's τ_s).
        lr: peak learning rate.
        betas: (β1, β2).
        weight_decay: decoupled weight decay on matrices.
        **options: ``build_optimizer`` options (``br_source``, ``br_geometry``, ``br_freq``,
            ``br_allocation``, ``eps``, …).

    Raises:
        ConfigError: (when called) an unknown name or option, or a value out of range.
    """
    delays = tuple(schedule.delay_bound(s) for s in range(schedule.n_stages))
    return functools.partial(_pipeline_optimizer, name, schedule.n_stages, delays, lr, tuple(betas), weight_decay,
                             dict(options))
