"""The one place where unbubble lets a backward run on weights updated in place since its forward.

PACI's backward uses the current weights with forward-time activations; stock PyTorch refuses a backward
after an in-place step. :class:`SavedByReference` (public saved-tensor hooks) keeps saved tensors by
reference without copying any weight:
[Note: backward on current weights] in docs/architecture.md#runtimeversionspy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedByReference:
    """``saved_tensors_hooks`` under which a backward may follow in-place updates of ``params``
    ([Note: backward on current weights]).

    Call it for the context of each forward: ``with hooks(): out = module(x)``. A tensor saved there
    is kept by reference with its version; at the backward, a tensor whose version moved is refused
    unless it shares storage with one of ``params``. Hooks already active around the block (a user's
    offloading, a test's counter) still run and keep what they keep: the tensor goes to them and their
    unpacked tensor to the backward (``torch._C._autograd._top_saved_tensors_default_hooks``, as
    ``precision.SavedBytes`` chains them), without the version check, which their copies would defeat.

    Args:
        params: the tensors updated in place between forwards and backwards (a stage's parameters;
            FSDP2's sharded parameters, DTensors, by their local shard, which the optimizer updates).

    Raises:
        RuntimeError: (at a backward) a saved tensor other than a parameter was modified in place after
            its forward.

    Source: PACI, arXiv 2606.07881, §3 ("backward uses the current weights");
    ``torch.autograd.graph.saved_tensors_hooks``.
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self._storages = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                          for p in params}

    def _unpack(self, packed: tuple) -> torch.Tensor:
        t, version = packed
        if t._version != version and t.untyped_storage().data_ptr() not in self._storages:
            raise RuntimeError(f"a tensor of shape {tuple(t.shape)} saved by the stage's forward was modified in place "
                               f"before its backward (version {version} → {t._version}); only the stage's parameters "
                               "may change between a forward and its backward")
        return t

    def __call__(self):
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(lambda t: (t, t._version), self._unpack)
        pack, unpack = outer
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
