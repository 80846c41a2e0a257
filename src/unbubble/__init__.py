"""unbubble: bubble-free asynchronous pipeline-parallel training for PyTorch.

The public API is the names in ``unbubble.__all__`` below and the command line (``unbubble COMMAND
--help``); every other module and name is internal: it may change without notice and is documented in
its module's docstring (docs/architecture.md#public-api). The names are imported on first
use, so ``import unbubble`` (and ``import unbubble.schedules``, ``import unbubble.sim``) imports no torch.

* Train: :func:`train_model` (a model you already have, the whole run of ``unbubble train``);
  :class:`PipelineJob` with :func:`run_emulator` (one process) or :func:`run_processes` (one process
  per stage) for your own stages, batches and optimizer.
* Split: :func:`split_model` (a decoder-only model into stages that keep its parameter names) and
  :func:`causal_lm_loss` (the loss of its last stage).
* torch.distributed.pipelining: :class:`SchedulePACI` (PACI over torch's ``PipelineStage``),
  :func:`pipeline_paci` (a model cut and scheduled for one rank), :func:`clip_grad_norm_pp` (a global
  clip over the pipeline), :class:`PipelineClip` (the same with a choice of barrier).
* Checkpoints: the module :mod:`unbubble.export` (``unbubble export`` in Python): ``export.export``
  writes a run as one ``state_dict`` or a Hugging Face folder, ``export.load`` builds the model an export
  describes, ``export.load_export`` loads one into a model you built, ``export.sample`` writes text.
* Schedules and the simulator: :func:`get_schedule`, :func:`simulate`, :func:`plan`.
* Errors: :class:`ConfigError`, the one-line refusal of a bad argument (a ``ValueError``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: each public name -> the module that defines it (its home); a name whose home is ``unbubble.<name>`` is
#: that module itself
_HOMES = {
    "train_model": "unbubble.train",
    "PipelineJob": "unbubble.runtime.job",
    "run_emulator": "unbubble.runtime.emulator",
    "run_processes": "unbubble.runtime.launch",
    "split_model": "unbubble.models.split",
    "causal_lm_loss": "unbubble.models.split",
    "SchedulePACI": "unbubble.pipelining",
    "pipeline_paci": "unbubble.pipelining",
    "clip_grad_norm_pp": "unbubble.pipelining",
    "PipelineClip": "unbubble.runtime.clipping",
    "export": "unbubble.export",  # the module: ``unbubble.export`` cannot also name its function
    "get_schedule": "unbubble.schedules.registry",
    "simulate": "unbubble.sim.result",
    "plan": "unbubble.sim.plan",
    "ConfigError": "unbubble.errors",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    """A public name, imported from its home module on first use (PEP 562), so that ``import unbubble``
    stays free of torch; the submodules (``unbubble.schedules`` …) import as usual."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'unbubble' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home == f"unbubble.{name}" else getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
