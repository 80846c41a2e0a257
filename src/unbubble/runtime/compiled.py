"""``--compile``: each stage's module under ``torch.compile``, with PACI's version semantics kept.

The executor calls ``torch.compile(module)`` (same parameters, names and checkpoints) for every forward;
the loss stays eager. Why a backward on the current weights survives compilation, and what is refused
(the schedules that split the backward into I and W, :data:`SPLIT_BACKWARD_SCHEDULES`: one compiled
backward cannot be split):
[Note: compiled stages] in docs/architecture.md#runtimecompiledpy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unbubble.errors import ConfigError, did_you_mean
from unbubble.schedules.registry import REGISTRY, names_where

#: ``--compile-backend``: inductor (generated kernels, the default of ``torch.compile``) or
#: aot_eager (the AOTAutograd graphs run op by op: compiles in a fraction of a second, for tests
#: and for checking a model traces).
COMPILE_BACKENDS = ("inductor", "aot_eager")

#: ``functional_call`` names of a compiled module's parameters: ``OptimizedModule`` holds the
#: stage's module as ``_orig_mod``.
COMPILED_PREFIX = "_orig_mod."

#: Schedules refused under ``--compile``: their backward is split into I (input gradient) and W
#: (weight gradient), but a compiled stage's backward is one autograd node that computes both, so
#: I would run the whole backward and W run it again (and AOTAutograd's donated buffers forbid the
#: second run). torch refuses them too (``_check_torch_compile_compatibility`` in
#: ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble).
SPLIT_BACKWARD_SCHEDULES = names_where(lambda r: r.split_backward)

#: Graphs Dynamo may keep per code object before it stops compiling it. Every stage of a model
#: class shares its ``forward``'s cache, so the emulator (all stages in one process) needs more
#: than the default 8: stage structures × {grad, no-grad} × {static, dynamic shapes} × {parameters,
#: stashed tensors}.
RECOMPILE_LIMIT = 64


def check_backend(backend: str) -> None:
    """Raises ConfigError for a backend not in :data:`COMPILE_BACKENDS` (one line)."""
    if backend not in COMPILE_BACKENDS:
        raise ConfigError(f"compile_backend={backend!r} is invalid{did_you_mean(backend, COMPILE_BACKENDS)}: must be "
                          f"one of {', '.join(COMPILE_BACKENDS)} (set --compile-backend)")


def check_compile(backend: str, schedule: str) -> None:
    """Refuses, in one line, a backend not in :data:`COMPILE_BACKENDS` or a schedule of
    :data:`SPLIT_BACKWARD_SCHEDULES`.

    Raises:
        ConfigError: naming the value, what is valid and the option to change.
    """
    check_backend(backend)
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        chunked = "v" in REGISTRY[schedule].takes
        instead = "interleaved-1f1b (the same v stages per device)" if chunked else "1f1b-flush or paci"
        raise ConfigError(f"compile=True is invalid with schedule={schedule!r}: its backward is split into I and W, "
                          "but a compiled stage's backward is one autograd node that computes both (I would run the "
                          f"whole backward and W run it again); use --schedule {instead}, or drop --compile")


def compile_stage(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """``torch.compile(module, backend=backend)`` with automatic dynamic shapes ([Note: compiled stages]).

    Args:
        module: the stage's module (its parameters stay the module's own; nothing is copied).
        backend: one of :data:`COMPILE_BACKENDS`.

    Sets two process-wide Dynamo options: ``recompile_limit`` to at least :data:`RECOMPILE_LIMIT`,
    and ``fail_on_recompile_limit_hit`` (a function past the limit raises instead of running eagerly).

    Returns:
        The compiled callable; compilation happens at its first call.

    Raises:
        ConfigError: an unknown backend.
    """
    check_backend(backend)
    import torch._dynamo.config as dynamo_config

    # past the limit Dynamo would silently run the stage eagerly: raise it, and fail instead
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(module, backend=backend, dynamic=None)


def compile_stats() -> dict[str, Any]:
    """Dynamo's counters in this process: ``frames`` compiled (each a graph set: forward, its
    backward, and the recompiles a guard failure or new shape caused) and ``unique_graphs``."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"]), "unique_graphs": int(counters["stats"]["unique_graphs"])}
