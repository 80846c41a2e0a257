"""A run's stage checkpoints as one model: a ``state_dict`` in the model's own names, or a Hugging
Face folder (``unbubble export RUN_DIR OUT``).

Stages built by :func:`unbubble.models.split.split_model` keep the model's fully-qualified names
([Note: stages keep the model's names]), so merging is a union of the stages' ``model`` entries:
``model.load_state_dict(merged_state_dict(run_dir))`` accepts it. The checkpoint folder of such a
run also holds ``model/`` (written once by the first checkpoint): the HF ``config.json`` and
``unbubble-model.json`` (the model class), from which :func:`export` writes a folder
``from_pretrained`` loads (``config.json`` + ``model.safetensors``). A weight tied in the model but
trained untied (``untie=True``) is exported untied (``tie_word_embeddings=False``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from unbubble.errors import ConfigError
from unbubble.runtime.checkpoint import complete_steps, load_stage

#: the folder beside the ``step-*`` folders that describes the model (HF runs)
MODEL_DIR = "model"
MODEL_INFO = "unbubble-model.json"
_STAGE_FILE = re.compile(r"^stage-(\d{3})\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    """The folder of the ``step-*`` folders: ``RUN_DIR/checkpoints`` (``unbubble train``'s run
    folder) or ``RUN_DIR`` itself.

    Raises:
        ConfigError: neither holds a checkpoint.
    """
    run_dir = Path(run_dir)
    for d in (run_dir / "checkpoints", run_dir):
        if d.is_dir() and any(p.name.startswith("step-") for p in d.iterdir()):
            return d
    raise ConfigError(f"{str(run_dir)!r} holds no checkpoint (no step-* folder in it or in its checkpoints/): "
                      "train with checkpoints (unbubble train --run-dir …, or PipelineJob.checkpoint)")


def _n_stages(directory: Path) -> int:
    counts = [sum(1 for f in d.iterdir() if _STAGE_FILE.match(f.name)) for d in directory.iterdir()
              if d.is_dir() and d.name.startswith("step-")]
    return max(counts, default=0)


def merged_state_dict(run_dir: str | Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The stages' weights of one complete checkpoint merged into one ``state_dict``.

    Args:
        run_dir: a run folder or a checkpoint folder (:func:`checkpoint_dir`).
        step: the checkpoint's step (default: the newest complete one).

    Raises:
        ConfigError: no complete checkpoint, no such step, or a name held by two stages (stages not
            built with the model's names, e.g. ``unbubble train``'s own presets).
    """
    directory = checkpoint_dir(run_dir)
    n = _n_stages(directory)
    steps = complete_steps(directory, n)
    if not steps:
        raise ConfigError(f"{str(directory)!r} has no complete checkpoint (a file for each of {n} stages)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"step={step} has no complete checkpoint in {str(directory)!r}: complete steps are "
                          f"{', '.join(map(str, steps))} (set --step)")
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for s in range(n):
        state = load_stage(directory, step, s)["executor"]["model"]
        for name, t in state.items():
            if name in merged:
                raise ConfigError(f"{name!r} is in the checkpoints of stages {owner[name]} and {s}: the stages do not "
                                  "use the model's names (split the model with unbubble.models.split.split_model)")
            merged[name], owner[name] = t.clone(), s  # a copy: not a view of the memory-mapped file
    return merged


def save_model_files(directory: str | Path, model: torch.nn.Module, untied: bool) -> None:
    """Writes ``directory/model/`` once: an HF model's ``config.json`` and :data:`MODEL_INFO`."""
    out = Path(directory) / MODEL_DIR
    if (out / MODEL_INFO).is_file() or not hasattr(getattr(model, "config", None), "save_pretrained"):
        return
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    if untied and getattr(config, "tie_word_embeddings", False):
        config = type(config).from_dict({**config.to_dict(), "tie_word_embeddings": False})
    config.save_pretrained(out)
    cls = type(model)
    (out / MODEL_INFO).write_text(json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}"}) + "\n")


def load_model(run_dir: str | Path, step: int | None = None) -> Any:
    """The HF model of a run, its weights from the checkpoint (``from_config`` + ``load_state_dict``).

    Raises:
        ConfigError: the run has no ``model/`` folder (not an HF model), or transformers is missing.
    """
    directory = checkpoint_dir(run_dir)
    info_path = directory / MODEL_DIR / MODEL_INFO
    if not info_path.is_file():
        raise ConfigError(f"{str(directory)!r} has no {MODEL_DIR}/{MODEL_INFO}: not a Hugging Face model's run "
                          "(export writes a state dict file instead: give OUT ending in .pt)")
    try:
        import importlib

        import transformers
    except ImportError:
        raise ConfigError("exporting a Hugging Face model needs transformers: pip install 'unbubble[hf]'") from None
    module, _, name = json.loads(info_path.read_text())["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    config = transformers.AutoConfig.from_pretrained(directory / MODEL_DIR)
    model = cls(config)
    model.load_state_dict(merged_state_dict(run_dir, step), strict=True)
    return model


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Writes a run's model: an HF folder (``config.json`` + ``model.safetensors``) when the run
    trained a split HF model and ``out`` does not end in ``.pt``, else ``torch.save`` of the merged
    ``state_dict`` to ``out``.

    Returns:
        The path written.

    Raises:
        ConfigError: as :func:`merged_state_dict` and :func:`load_model`.
    """
    out = Path(out)
    hf = (checkpoint_dir(run_dir) / MODEL_DIR / MODEL_INFO).is_file()
    if hf and out.suffix != ".pt":
        load_model(run_dir, step).save_pretrained(out, safe_serialization=True)
        return out
    state = merged_state_dict(run_dir, step)
    if out.suffix != ".pt":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "model.pt"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out
