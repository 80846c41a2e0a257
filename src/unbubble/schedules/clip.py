"""The clip-scope vocabulary shared by the runtime (``runtime/clipping.py``) and the simulator
(``sim/barrier.py``): the scopes, the stale norm's lag and their validation (torch-free).

What each scope does is [Note: clip scopes] and why the lag is ⌈N/a⌉ is [Note: stale lag], both in
docs/architecture.md#global-operations-are-barriers. A schedule's default scope is its record's
(:attr:`~unbubble.schedules.registry.ScheduleInfo.default_clip_scope`).
"""

from __future__ import annotations

import math
from typing import Any

from unbubble.errors import ConfigError, check_int, did_you_mean

#: ``--clip-scope`` of a training run: where the gradient norm a stage clips by comes from.
CLIP_SCOPES = ("sync", "stale", "stage")
#: The scope that means no clipping: the simulator's ``--clip-scope`` (a run without a global operation).
NO_SCOPE = "none"
#: ``--clip-scope`` of the simulator and the planner: no global operation, then from cheapest to dearest
#: per update (a local norm, a blocking all-reduce) and the non-blocking one.
SIM_SCOPES = (NO_SCOPE, "stage", "sync", "stale")
#: The scopes whose norm is global, so an all-reduce per update over the pipeline.
GLOBAL_SCOPES = ("sync", "stale")

_POST_VALIDATE = ("clip_scope='post-validate' is refused: under PACI later micro-batches' forwards already ran "
                  "on the eagerly stepped weights, so rolling the step back cannot be exact, and for the synchronous "
                  "schedules it is not implemented (use sync: exact, or stale: no barrier; set --clip-scope)")


def check_scope(scope: Any, valid: tuple[str, ...] = CLIP_SCOPES) -> None:
    """Refuses a ``scope`` not in ``valid`` (:data:`CLIP_SCOPES`, or :data:`SIM_SCOPES` for the
    simulator), with the closest valid one.

    Raises:
        ConfigError: one line naming the value, what is valid and ``--clip-scope``.
    """
    if scope not in valid:
        raise ConfigError(f"clip_scope={scope!r} is invalid{did_you_mean(str(scope), valid)}: must be one of "
                          f"{', '.join(valid)} (set --clip-scope)")


def check_clip(max_norm: Any, scope: Any) -> None:
    """Validates a training run's ``clip_grad_norm`` (a finite number > 0, or ``None``) and ``clip_scope``.

    Raises:
        ConfigError: one line naming the value and what is valid.
    """
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                 or not (0 < max_norm < math.inf)):
        raise ConfigError(f"clip_grad_norm={max_norm!r} is invalid: must be a finite number > 0 or unset "
                          "(set --clip-grad-norm)")
    if scope == "post-validate":
        raise ConfigError(_POST_VALIDATE)
    check_scope(scope)


def stale_lag(n_stages: int, a: int, asynchronous: bool = True) -> int:
    """s of ``clip_scope="stale"``: update t is clipped with the global norm of update t − s.

    ⌈N/a⌉ for an asynchronous schedule of N stages and a micro-batches per update — a forward of
    stage j waits for the backward N − j micro-batches earlier (its in-flight cap), so a stage
    reaching update t implies every stage has started update t − ⌈N/a⌉ — and 1 for a flushed one.
    ⌈N/a⌉ = ⌊(N − 1)/a⌋ + 1 ≤ ⌈(N − 1)/a⌉ + 1 ([Note: stale lag] in docs/architecture.md).

    Raises:
        ConfigError: ``n_stages`` or ``a`` is not an integer ≥ 1.
    """
    for name, v in (("stages", n_stages), ("a", a)):
        check_int(name, v)
    return -(-n_stages // a) if asynchronous else 1
