"""Input checks shared by the optimizers and the factory; every message follows STYLE's template
(integers: :func:`unbubble.errors.check_int`).

``name=value is invalid: <what is valid> (<the fix>)`` and raises ``ConfigError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from unbubble.errors import ConfigError, did_you_mean


def _fail(name: str, value: Any, valid: str, fix: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: {valid} ({fix})")


def check_choice(name: str, value: Any, choices: Sequence[str], fix: str) -> None:
    """Raises ConfigError unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        _fail(name, value, f"must be one of {', '.join(choices)}{hint}", fix)


def check_nonneg(name: str, value: Any, fix: str) -> None:
    """Raises ConfigError unless ``value`` is a finite real number ≥ 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        _fail(name, value, "must be a finite number ≥ 0", fix)


def check_unit(name: str, value: Any, fix: str) -> None:
    """Raises ConfigError unless ``value`` is a real number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        _fail(name, value, "must be in [0, 1)", fix)


def check_betas(betas: Any, fix1: str = "set --beta1", fix2: str = "set --beta2") -> None:
    """Raises ConfigError unless ``betas`` is a pair of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        _fail("betas", betas, "must be a pair (beta1, beta2)", f"{fix1}, {fix2}")
    check_unit("beta1", betas[0], fix1)
    check_unit("beta2", betas[1], fix2)
