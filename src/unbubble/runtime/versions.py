"""The one audited place where unbubble touches autograd's version counters.

[Note: backward on current weights]
Autograd saves parameters *by reference* and records their version counter. After an
in-place optimizer step, a backward whose graph was built before the step would read the
new weights — which is exactly PACI's semantics (DESIGN §2: input gradients use the
current weights, weight gradients use forward-time activations) — but stock PyTorch
refuses with "one of the variables needed for gradient computation has been modified by
an inplace operation". We restore each parameter's version counter after the step so the
check passes, and never copy a weight. Only parameters go through here: activations are
never modified in place, so the check still protects them. A stage under ``torch.compile`` keeps
this (its compiled backward holds the live parameters too): [Note: compiled stages] in ``compiled.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


@contextmanager
def keep_version_counters(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Runs an in-place update of ``params`` without bumping their autograd versions.

    Args:
        params: the tensors the block updates in place (a stage's parameters).

    Source: PACI, arXiv 2606.07881, §3 ("backward uses the current weights"); the
    mechanism is ``torch._C._autograd._unsafe_set_version_counter``.
    """
    params = tuple(params)
    saved = tuple(p._version for p in params)
    try:
        yield
    finally:
        torch._C._autograd._unsafe_set_version_counter(params, saved)
