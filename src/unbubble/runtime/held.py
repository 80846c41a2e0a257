"""The bytes a stage's in-flight micro-batches hold, measured (``StageExecutor.memory_bytes``)."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from unbubble.runtime import pytree
from unbubble.runtime.precision import SavedBytes


class HeldBytes:
    """What autograd saves per in-flight micro-batch k, from its forward until its backward ends.

    Three figures per k and summed (:attr:`now`, with peaks in :attr:`peak`): bytes stored from F
    (saved activations, or the input alone under recomputation), weight copies F saved (autocast's
    bf16 casts), and the activations of a forward recomputed for the backward.

    Args:
        module: the stage's module (``SavedBytes`` tells its weights from activations).
        by_value: the forward is compiled (``SavedBytes``'s ``by_value``).
    """

    def __init__(self, module: nn.Module, by_value: bool):
        self.module, self.by_value = module, by_value
        self._held: dict[int, list[int]] = {}
        self.now = [0, 0, 0]  # summed over k
        self.peak = [0, 0, 0]  # maxima of: stored, weight copies, stored + recomputed
        self.per_mb: dict[str, int] = {}  # one micro-batch's measured bytes (last forward / recompute)
        self._sizes: dict[tuple, list[int]] = {}  # (forward or recomputed, input shape, dtype) -> saved bytes

    @contextlib.contextmanager
    def measured(self, what: str, x: Any):
        """Yields ``[activation bytes, weight-copy bytes]`` that the forward in the block saves;
        measured with ``SavedBytes`` the first time a ``what`` forward sees ``x``'s shapes and dtypes
        (saved sizes depend only on them), then reused: the hooks cost ≈ 4 % of a small forward."""
        key = (what, pytree.signature(x))
        sizes = self._sizes.get(key)
        if sizes is not None:
            yield sizes
            return
        sizes = [0, 0]
        # a recomputed forward's input is already counted as stored
        with SavedBytes(self.module, exclude=pytree.tensors(x) if what == "recomputed" else (),
                        by_value=self.by_value) as saved:
            yield sizes
        sizes[:] = saved.activation_bytes, saved.weight_copy_bytes
        self._sizes[key] = sizes

    def hold(self, k: int, sizes: tuple[int, int, int], what: str) -> None:
        """Counts ``sizes`` (stored, weight-copy, recomputed bytes) as held for ``k``."""
        self.per_mb[what] = sum(sizes)
        if sizes[1]:
            self.per_mb["weight_copies"] = sizes[1]
        held = self._held.setdefault(k, [0, 0, 0])
        for i, b in enumerate(sizes):
            held[i] += b
            self.now[i] += b
        h = self.now
        self.peak = [max(self.peak[0], h[0]), max(self.peak[1], h[1]), max(self.peak[2], h[0] + h[2])]

    def release(self, k: int) -> None:
        """``k``'s backward has ended (or ``k`` was dropped): its bytes are free."""
        for i, b in enumerate(self._held.pop(k, (0, 0, 0))):
            self.now[i] -= b
