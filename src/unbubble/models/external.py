"""Models that are not our presets: ``--model hf:PATH``, ``--model module:function`` and a model object
given to :func:`unbubble.train.train_model` (trained through :mod:`unbubble.models.split`)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import torch
from torch import nn

from unbubble.errors import ConfigError

#: ``model`` of a run whose model object was given in Python (``train_model``): it cannot be rebuilt
#: from the configuration, so a resume must be given the object again.
PYTHON_MODEL = "python"
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")


def is_external(spec: str) -> bool:
    """True for ``hf:PATH``, ``module:function`` or :data:`PYTHON_MODEL` (not a preset name)."""
    return spec == PYTHON_MODEL or spec.startswith("hf:") or bool(_FACTORY.match(spec))


def check_external(spec: str) -> None:
    """Checks ``spec`` without building the model (one line per problem).

    Raises:
        ConfigError: an ``hf:`` path with no config.json, or a ``module:function`` that does not import.
    """
    if spec == PYTHON_MODEL:
        return
    if spec.startswith("hf:"):
        path = Path(spec[3:]).expanduser()
        if not (path.is_file() or (path / "config.json").is_file()):
            raise ConfigError(f"model={spec!r} is invalid: {str(path)!r} is neither a config.json nor a folder with "
                              "one (give --model hf:PATH of a local Hugging Face model or config)")
        return
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model={spec!r} is invalid: {type(exc).__name__}: {exc} (give --model module:function "
                          "naming a function of an importable module that returns the model)") from None
    if not callable(fn):
        raise ConfigError(f"model={spec!r} is invalid: {module}.{name} is not callable (give a function that returns "
                          "the model)")


def load_external(spec: str, seed: int) -> nn.Module:
    """Builds the model of ``spec``: an HF folder's weights (``from_pretrained``), or an HF config with
    random weights (``from_config`` after ``torch.manual_seed(seed)``); or ``module.function()``.

    Raises:
        ConfigError: as :func:`check_external`; transformers missing; a factory that returns no module.
    """
    check_external(spec)
    torch.manual_seed(seed)
    if spec.startswith("hf:"):
        try:
            import transformers
        except ImportError:
            raise ConfigError(f"model={spec!r} needs transformers: pip install 'unbubble[hf]'") from None
        path = Path(spec[3:]).expanduser()
        if path.is_dir() and any((path / w).is_file() for w in _WEIGHTS):
            return transformers.AutoModelForCausalLM.from_pretrained(path)
        config = transformers.AutoConfig.from_pretrained(path)
        return transformers.AutoModelForCausalLM.from_config(config)
    module, _, name = spec.partition(":")
    model = getattr(importlib.import_module(module), name)()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={spec!r} is invalid: {module}.{name}() returned a {type(model).__name__}, not an "
                          "nn.Module")
    return model


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a run folder records about a model (``summary.json``'s ``model``): fields of its config,
    ``None`` where the model does not say."""

    n_layer: int | None
    n_head: int | None
    n_embd: int | None
    block_size: int | None
    vocab_size: int | None

    @classmethod
    def of(cls, model: nn.Module, n_layer: int) -> "ModelShape":
        c = getattr(model, "config", None)

        def first(*names):
            return next((getattr(c, n) for n in names if getattr(c, n, None) is not None), None)

        vocab = first("vocab_size")
        if vocab is None:  # a model without a config: the output embedding's rows
            emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
            vocab = None if emb is None else emb.num_embeddings
        return cls(n_layer, first("n_head", "num_attention_heads"), first("n_embd", "hidden_size"),
                   first("n_positions", "max_position_embeddings"), vocab)
