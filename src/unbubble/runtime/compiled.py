"""``--compile``: each stage's module under ``torch.compile``, with PACI's version semantics kept.

[Note: compiled stages]
A compiled stage is ``torch.compile(module)`` (an ``OptimizedModule`` around the stage's own
module, which keeps its parameters, names and ``state_dict``, so checkpoints and evaluation are
unchanged); the executor calls it for every forward and recomputed forward. The loss is not
compiled: the last stage's ``loss_fn`` (any user function) runs eagerly on the compiled module's
output.

Why the semantics of [Note: backward on current weights] (``versions.py``) survive: Dynamo
lifts the parameters into graph inputs, and AOTAutograd saves what the backward graph needs
through ``ctx.save_for_backward`` of one autograd function. A saved graph input is the live
parameter itself (the tests find both Linear weights of a stage saved with the parameters'
storage, and no copy), so after the in-place update (the forward ran under ``SavedByReference``,
which also sees what ``save_for_backward`` saves) the compiled backward reads the current weights,
as the eager one does. What could break it: a saved tensor *derived* from a weight (a contiguous transposed copy,
a dtype cast), which would freeze the forward-time weights into the backward, or an activation
the partitioner rematerialises in the backward from a parameter (the weight gradient would then
see the current weights instead of the forward-time activations). Neither is assumed away:
``tests/unit/test_compile.py`` runs a stage forward, updates it in place, runs the backward, and
checks the input and weight gradients against the eager executor's (which the delayed references
pin down) and against both wrong answers, for ``aot_eager`` and ``inductor``. bf16-autocast saves
its bf16 weight casts compiled as eagerly (the input gradient then uses the forward-time bf16
weights, as [Note: precision and version semantics] states for eager autocast).

Weight stashing calls ``torch.func.functional_call`` on the compiled module with the stashed
tensors under the ``_orig_mod.`` prefix: the first stashed forward recompiles once (plain
tensors instead of ``nn.Parameter``), later versions reuse that graph.

Recompilation: ``torch.compile``'s default ``dynamic=None`` compiles the first shape statically
and, when a later call changes a dimension, recompiles once with that dimension symbolic
("automatic dynamic shapes"), so micro-batches of varying batch size or length cost at most one
more graph, not one per shape. Other graphs a stage may need: the no-grad forward of
``--recompute full`` (grad mode is guarded), and the first stashed forward. All stages of one
model class share the cache of its ``forward``, so :func:`compile_stage` raises Dynamo's
recompile limit to :data:`RECOMPILE_LIMIT` and makes hitting it an error: a stage never falls
back to eager silently. :func:`compile_stats` reads Dynamo's counters so tests and
``unbubble bench`` can count the graphs.

Memory is measured as for eager stages, except that weight copies are recognised by value
(``SavedBytes(by_value=True)``): the compiled function's saved tensors have no per-op ``grad_fn``
chain to follow. Split backward (zb-h1, zb-h2, interleaved-zb, zbv, dualpipev) is refused: see :data:`SPLIT_BACKWARD_SCHEDULES`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unbubble.errors import ConfigError, did_you_mean

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
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zb-h2", "interleaved-zb", "zbv", "dualpipev")

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
        instead = "interleaved-1f1b (the same v stages per device)" if schedule == "interleaved-zb" else "1f1b-flush or paci"
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
