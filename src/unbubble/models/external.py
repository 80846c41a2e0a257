"""Models that are not our presets: ``--model hf:PATH``, ``--model module:function`` and a model object
given to :func:`unbubble.train.train_model` (trained through :mod:`unbubble.models.split`)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from unbubble.errors import ConfigError

log = logging.getLogger(__name__)
#: ``model`` of a run whose model object was given in Python (``train_model``): it cannot be rebuilt
#: from the configuration, so a resume must be given the object again.
PYTHON_MODEL = "python"
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")


def is_external(spec: str) -> bool:
    """True for ``hf:PATH``, ``module:function`` or :data:`PYTHON_MODEL` (not a preset name)."""
    return spec == PYTHON_MODEL or spec.startswith("hf:") or bool(_FACTORY.match(spec))


_DECODERS = "decoder-only causal language models (GPT-2, Llama, Qwen, Mistral, …)"


def _hf_config(spec: str) -> dict:
    """The parsed config.json of an ``hf:`` spec (a folder holding one, or a ``.json`` file).

    Raises:
        ConfigError: the path is missing, a file that is not ``.json``, not JSON, or has no ``model_type``.
    """
    path = Path(spec[3:]).expanduser()
    if path.is_file() and path.suffix != ".json":
        raise ConfigError(f"model={spec!r} is invalid: {str(path)!r} is a file, not a folder: give --model hf:FOLDER "
                          "(a Hugging Face model folder with config.json) or hf:FOLDER/config.json")
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        raise ConfigError(f"model={spec!r} is invalid: {str(path)!r} is neither a config.json nor a folder with "
                          "one (give --model hf:PATH of a local Hugging Face model or config)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model={spec!r} is invalid: {str(file)!r} is not valid JSON ({exc.msg} at line "
                          f"{exc.lineno}, column {exc.colno}): fix it, or write it again with "
                          "config.save_pretrained") from None
    except UnicodeDecodeError:
        raise ConfigError(f"model={spec!r} is invalid: {str(file)!r} is not valid JSON (not UTF-8 text): give the "
                          "config.json of a Hugging Face model") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ConfigError(f"model={spec!r} is invalid: {str(file)!r} has no \"model_type\" (a Hugging Face config "
                          "names its family, e.g. \"model_type\": \"llama\"): write it with config.save_pretrained")
    if config.get("is_encoder_decoder"):
        raise ConfigError(f"model={spec!r} is invalid: model_type={config['model_type']!r} is an encoder-decoder "
                          f"model (is_encoder_decoder: true): unbubble trains {_DECODERS}")
    return config


def hf_vocab_size(spec: str) -> int | None:
    """The ``vocab_size`` of an ``hf:`` model's config.json (its text config's for a multimodal one), or None."""
    config = _hf_config(spec)
    for c in (config, config.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def _current_folder_on_path() -> None:
    """Puts the current folder first on ``sys.path`` (once), as ``python -m`` does, so ``--model
    mymods:build`` finds ``mymods.py`` beside the command: the ``unbubble`` console script's path
    starts with its own folder instead. Stage processes started by spawn inherit the path."""
    import os
    import sys

    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def check_external(spec: str) -> None:
    """Checks ``spec`` without building the model (one line per problem).

    Raises:
        ConfigError: an ``hf:`` path that is missing, a file other than a ``.json`` config, a
            config.json that is not JSON, has no ``model_type`` or is an encoder-decoder's; or a
            ``module:function`` that does not import.
    """
    if spec == PYTHON_MODEL:
        return
    if spec.startswith("hf:"):
        _hf_config(spec)
        path = Path(spec[3:]).expanduser()
        if path.is_dir():  # a damaged weight file is named before anything else is read
            _check_safetensors(spec, path)
        return
    module, _, name = spec.partition(":")
    _current_folder_on_path()
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model={spec!r} is invalid: {type(exc).__name__}: {exc} (give --model module:function "
                          "naming a function of an importable module that returns the model)") from None
    if not callable(fn):
        raise ConfigError(f"model={spec!r} is invalid: {module}.{name} is not callable (give a function that returns "
                          "the model)")


def _check_loaded(spec: str, path: Path, info: dict) -> None:
    """Refuses a folder whose weights do not cover its model or hold parameters it lacks
    (``from_pretrained``'s loading info): transformers starts missing parameters from random weights
    and drops unexpected ones, so a config that disagrees with its weights would train silently."""
    parts = []
    for what, keys in (("missing from its weights", info.get("missing_keys")),
                       ("in its weights but not in the model", info.get("unexpected_keys"))):
        keys = sorted(keys or ())
        if keys:
            parts.append(f"{len(keys)} parameter(s) {what} ({', '.join(keys[:3])}{', …' if len(keys) > 3 else ''})")
    if parts:
        raise ConfigError(f"model={spec!r} is invalid: the weights in {path} do not match its config.json: "
                          f"{'; '.join(parts)} (give a folder whose config.json and weights belong together, as "
                          "save_pretrained writes them; a folder with config.json alone starts from random weights)")


def load_external(spec: str, seed: int) -> nn.Module:
    """Builds the model of ``spec``: an HF folder's weights (``from_pretrained``), or an HF config with
    random weights (``from_config`` after ``torch.manual_seed(seed)``); or ``module.function()``.

    Raises:
        ConfigError: as :func:`check_external`; transformers missing; a ``model_type`` without a
            causal-LM class in transformers (an encoder, an unknown family); a ``.safetensors`` file
            of the folder that cannot be read; weights that miss parameters of the folder's config or
            hold ones it lacks; a factory that returns no module.
    """
    check_external(spec)
    torch.manual_seed(seed)
    if spec.startswith("hf:"):
        try:
            import transformers
        except ImportError:
            raise ConfigError(f"model={spec!r} needs transformers: pip install 'unbubble[hf]'") from None
        _check_causal(spec, _hf_config(spec)["model_type"], transformers.__version__)
        path = Path(spec[3:]).expanduser()
        if path.is_dir() and any((path / w).is_file() for w in _WEIGHTS):
            _check_safetensors(spec, path)
            # fp32 whatever the files hold (bf16 too): --precision decides how the run computes, and
            # the bf16 mode keeps fp32 master weights of its own
            bars = transformers.utils.logging.is_progress_bar_enabled()
            verbosity = transformers.utils.logging.get_verbosity()
            transformers.utils.logging.disable_progress_bar()  # a bar per load would break the one-line errors
            transformers.utils.logging.set_verbosity_error()  # its load report: _check_loaded says it in one line
            try:
                model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                                output_loading_info=True)
            finally:
                transformers.utils.logging.set_verbosity(verbosity)
                if bars:
                    transformers.utils.logging.enable_progress_bar()
            _check_loaded(spec, path, info)
            log.info("%s: pretrained weights loaded (%s parameters)", path,
                     f"{sum(p.numel() for p in model.parameters()):,}")
            return model
        config = transformers.AutoConfig.from_pretrained(path)
        log.info("%s holds a config and no weights (%s): random initialization with seed %d", path,
                 ", ".join(_WEIGHTS), seed)
        return transformers.AutoModelForCausalLM.from_config(config)
    module, _, name = spec.partition(":")
    factory = getattr(importlib.import_module(module), name)
    required = _required_parameters(factory)
    if required:
        raise ConfigError(f"model={spec!r} is invalid: {module}.{name} needs argument(s) {', '.join(required)}; "
                          "--model module:function calls it with none (give a function that takes no arguments, e.g. "
                          f"one that calls {name}(...) with yours)")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={spec!r} is invalid: {module}.{name}() returned a {type(model).__name__}, not an "
                          "nn.Module")
    return model


def _check_causal(spec: str, model_type: str, version: str) -> None:
    """Refuses a ``model_type`` that ``AutoModelForCausalLM`` has no class for, in one line."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    except ImportError:  # another layout of transformers: from_config says it
        return
    if model_type not in causal:
        raise ConfigError(f"model={spec!r} is invalid: model_type={model_type!r} has no causal language model class "
                          f"in transformers {version} (AutoModelForCausalLM does not know it): unbubble trains "
                          f"{_DECODERS}")


def _check_safetensors(spec: str, folder: Path) -> None:
    """Reads the header of each ``*.safetensors`` file of ``folder`` (not the weights): a damaged
    or cut-short file is refused in one line instead of transformers' traceback."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception:  # noqa: BLE001 - safetensors' own error type; any failure means an unreadable file
            raise ConfigError(f"model={spec!r} is invalid: {str(file)!r} is not a readable safetensors file (its "
                              "header is damaged or the file is cut short): save or download the weights "
                              "again") from None


def _required_parameters(fn) -> list[str]:
    """The parameters ``fn`` cannot be called without ([] when its signature cannot be read)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           inspect.Parameter.KEYWORD_ONLY)]


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
