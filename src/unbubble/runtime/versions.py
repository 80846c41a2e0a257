"""The one place where unbubble lets a backward run on weights updated in place since its forward.

[Note: backward on current weights]
Autograd saves parameters *by reference* and records their version counter. After an
in-place optimizer step, a backward whose graph was built before the step would read the
new weights — which is exactly PACI's semantics (docs/architecture.md#schedules-and-their-semantics: input gradients use the
current weights, weight gradients use forward-time activations) — but stock PyTorch
refuses with "one of the variables needed for gradient computation has been modified by
an inplace operation". Every stage forward (and the last stage's loss) therefore runs under
:class:`SavedByReference`, a pair of ``torch.autograd.graph.saved_tensors_hooks`` (public,
documented): saved tensors are kept by reference, so a backward reads the current weights with
the forward's activations, and no weight is ever copied. The hook path skips autograd's version
check; the hooks put it back for everything that is not a parameter: a saved activation modified
in place still raises at its backward. One mechanism for both ways unbubble trains: its own
executor (``StageExecutor``, every engine) and ``unbubble.pipelining.SchedulePACI`` on torch's
``PipelineStage``, whose optimizer step is the user's and which so cannot restore version
counters after it (the executor used to, with the private ``_unsafe_set_version_counter``).
A stage under ``torch.compile`` keeps this: [Note: compiled stages] in ``compiled.py``.
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
