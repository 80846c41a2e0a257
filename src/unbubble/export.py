"""A run's stage checkpoints as one model: a ``state_dict`` in the model's own names, or a Hugging
Face folder (``unbubble export RUN_DIR OUT``).

Stages built by :func:`unbubble.models.split.split_model` keep the model's fully-qualified names
([Note: stages keep the model's names]), so merging is a union of the stages' ``model`` entries:
``model.load_state_dict(merged_state_dict(run_dir))`` accepts it. The checkpoint folder of such a
run also holds ``model/`` (written once by the first checkpoint): the HF ``config.json`` and
``unbubble-model.json`` (the model class), from which :func:`export` writes a folder
``from_pretrained`` loads (``config.json`` + ``model.safetensors``).

Notes: [Note: what an export writes] in docs/architecture.md#exportpy.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import pickle
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from unbubble.errors import ConfigError, check_int
from unbubble.models.split import MODEL_DIR, MODEL_INFO
from unbubble.pipeline import merge_state_dicts
from unbubble.runtime.checkpoint import complete_steps, load_stage, stage_path
from unbubble.safety import atomic_save, lock_holder

#: the ``_metadata`` key of a ``.pt`` export that lists the weights tied in the model but trained untied
UNTIED_KEY = "unbubble_untied"
#: the ``_metadata`` key of a ``.pt`` export that says what model it is (:func:`load` builds it)
RECORD_KEY = "unbubble_model"
#: the file beside an HF export's config.json that names the run's tokenizer
EXPORT_INFO = "unbubble-export.json"
_STAGE_FILE = re.compile(r"^stage-(\d{3})\.pt$")

log = logging.getLogger(__name__)

#: the public functions (the module is ``unbubble.export`` in ``unbubble.__all__``)
__all__ = ["export", "load", "load_export", "sample", "merged_state_dict"]


def _has_steps(d: Path) -> bool:
    try:
        return d.is_dir() and any(p.name.startswith("step-") and p.is_dir() for p in d.iterdir())
    except OSError:  # a folder we may not list (an ancestor of OUT): not a checkpoint folder of ours
        return False


def checkpoint_dir(run_dir: str | Path) -> Path:
    """The folder of the ``step-*`` folders: ``RUN_DIR/checkpoints`` (``unbubble train``'s run
    folder) or ``RUN_DIR`` itself.

    Raises:
        ConfigError: ``run_dir`` does not exist or is a file; or neither holds a checkpoint, naming
            the training option that would have written one.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ConfigError(f"run_dir={str(run_dir)!r} does not exist: give a run folder (unbubble train's --run-dir) "
                          "or its checkpoints/ folder")
    if not run_dir.is_dir():
        raise ConfigError(f"run_dir={str(run_dir)!r} is a file, not a folder: give a run folder (unbubble train's "
                          "--run-dir) or its checkpoints/ folder")
    for d in (run_dir / "checkpoints", run_dir):
        if _has_steps(d):
            return d
    raise ConfigError(f"{str(run_dir)!r} holds no checkpoint (no step-* folder in it or in its checkpoints/): "
                      f"{_why_no_checkpoint(run_dir)}")


def _why_no_checkpoint(run_dir: Path) -> str:
    """The option that would have written a checkpoint, read from the run's config.json."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        cfg = None
    if not isinstance(cfg, dict):
        return ("train with unbubble train (it writes the last step's weights unless given --no-final-checkpoint), "
                "or give a PipelineJob checkpoint=Checkpointing(folder)")
    if cfg.get("checkpoints") is False:
        return "the run was trained with --no-checkpoints; train it again without that flag"
    if cfg.get("final_checkpoint") is False:
        return (f"the run was trained with --no-final-checkpoint and {cfg.get('steps')} steps, fewer than "
                f"--checkpoint-every {cfg.get('checkpoint_every')}; train it again without --no-final-checkpoint")
    return "the run stopped before its first checkpoint; train it again (unbubble train writes the last step's weights)"


def _is_run_folder(d: Path) -> bool:
    """A folder ``unbubble train`` wrote (config.yaml beside summary.json or checkpoints/), or a
    checkpoint folder (``step-*`` folders)."""
    if not d.is_dir():
        return False
    ours = (d / "config.yaml").is_file() and ((d / "summary.json").is_file() or (d / "checkpoints").is_dir())
    return ours or _has_steps(d)


def check_out(run_dir: str | Path, out: str | Path, force: bool = False) -> None:
    """Refuses an export destination that would overwrite a run or anything unasked (one line).

    Args:
        run_dir: the run exported.
        out: the destination: a folder (HF) or a ``.pt`` file (a folder for a non-HF run without
            ``.pt`` gets ``model.pt`` inside).
        force: allow an existing non-empty folder or an existing file (never a run folder).

    Raises:
        ConfigError: ``out`` is a run folder or inside one (the run exported, a folder ``unbubble
            train`` wrote, a checkpoint folder), a non-empty folder or a file without ``force``, a
            file where a folder is wanted, or a folder where a ``.pt`` file is wanted.
    """
    o = Path(out).expanduser().resolve()
    run = Path(run_dir).expanduser().resolve()
    ck = checkpoint_dir(run_dir).resolve()
    for d in (o, *o.parents):
        if d in (run, ck) or _is_run_folder(d):
            where = "is the run folder" if d == o else "is inside the run folder"
            raise ConfigError(f"out={str(out)!r} {where} {str(d)!r}: export never writes into a run (it would "
                              "overwrite the run's own files, and --force does not change that): give OUT outside it")
    if o.suffix == ".pt":
        if o.is_dir():
            raise ConfigError(f"out={str(out)!r} is a folder: give a path ending in .pt for a state dict file, or "
                              "one without .pt for a folder")
        if o.is_file() and not force:
            raise ConfigError(f"out={str(out)!r} already exists: give a new path, or --force to replace that file")
        return
    if o.is_file():
        raise ConfigError(f"out={str(out)!r} is a file: give a folder path, or one ending in .pt for a state dict "
                          "file")
    if o.is_dir() and any(o.iterdir()) and not force:
        raise ConfigError(f"out={str(out)!r} is a folder that is not empty: give a new or empty folder, or --force "
                          "to write into it (replacing the files of the same names)")


def _n_stages(directory: Path) -> int:
    counts = [sum(1 for f in d.iterdir() if _STAGE_FILE.match(f.name)) for d in directory.iterdir()
              if d.is_dir() and d.name.startswith("step-")]
    return max(counts, default=0)


def merged_state_dict(run_dir: str | Path, step: int | None = None,
                      owners: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The stages' weights of one complete checkpoint merged into one ``state_dict``: under
    ``--precision bf16`` the fp32 masters ([Note: what an export writes]).

    Args:
        run_dir: a run folder or a checkpoint folder (:func:`checkpoint_dir`).
        step: the checkpoint's step (default: the newest complete one).
        owners: filled with each name's stage, when given.

    Raises:
        ConfigError: as :func:`checkpoint_dir`; no complete checkpoint, no such step, a name held by
            two stages (stages not built with the model's names, e.g. ``unbubble train``'s own
            presets), or a bf16 checkpoint whose masters are not named.
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
    states = (_with_masters(load_stage(directory, step, s)["executor"], stage_path(directory, step, s))
              for s in range(n))
    merged = merge_state_dicts(states, owners, what="checkpoints")
    return {name: t.clone() for name, t in merged.items()}  # copies: not views of the memory-mapped files


def _with_masters(executor: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """A stage file's ``model`` state, its bf16 parameters replaced by their fp32 masters (a
    ``--precision bf16`` run; [Note: what an export writes]); other floating tensors in the
    masters' dtype. Names that share one tensor (tied within the stage) all get the master.

    Raises:
        ConfigError: a bf16 checkpoint that does not name its masters (written before they were named).
    """
    state, masters = executor["model"], executor.get("masters")
    if masters is None:
        return state
    names = executor.get("master_names")
    if names is None or len(names) != len(masters):
        raise ConfigError(f"checkpoint file {str(path)!r} was trained with --precision bf16 but does not name its "
                          "fp32 master weights (written by an older unbubble): exporting its bf16 parameters would "
                          "drop the masters' low bits; export a checkpoint written by this version")
    def key(t):  # one tensor saved under two names loads as one storage: the same address and layout
        return (t.data_ptr(), tuple(t.shape), t.stride()) if t.numel() else None

    by_name = dict(zip(names, masters))
    by_tensor = {key(state[n]): m for n, m in by_name.items() if n in state and key(state[n]) is not None}
    dtype = masters[0].dtype if masters else torch.float32
    out = {}
    for name, t in state.items():
        m = by_name.get(name, by_tensor.get(key(t)))
        out[name] = m if m is not None else t.to(dtype) if t.is_floating_point() else t
    return out


#: the embedding and head names of the presets (GPTStage, LlamaStage, MoEStage): one tensor in a
#: tied single-stage model, two on any multi-stage run ([Note: untied head] in docs/architecture.md)
PRESET_TIED = ["wte.weight", "lm_head.weight"]


def untied_names(run_dir: str | Path, owners: dict[str, int]) -> list[list[str]]:
    """The groups of parameter names that are one tensor in the model but were trained on
    different stages (``untie=True``), from ``model/`` (:func:`unbubble.models.split.save_model_files`); ``[]`` when the
    run recorded none.

    Args:
        run_dir: a run folder or a checkpoint folder.
        owners: each merged name's stage (``merged_state_dict(..., owners=...)``).

    Raises:
        ConfigError: as :func:`checkpoint_dir`.
    """
    info_path = checkpoint_dir(run_dir) / MODEL_DIR / MODEL_INFO
    if not info_path.is_file():  # a preset's embedding and head are tied unless on two stages
        groups = [PRESET_TIED] if _run_config(run_dir).get("model") in _preset_names() else []
    else:
        groups = json.loads(info_path.read_text()).get("tied", [])
    return [g for g in groups if len({owners[n] for n in g if n in owners}) > 1]


def _is_hf(directory: Path) -> bool:
    return (directory / MODEL_DIR / MODEL_INFO).is_file() and (directory / MODEL_DIR / "config.json").is_file()


def load_model(run_dir: str | Path, step: int | None = None) -> Any:
    """The HF model of a run, its weights from the checkpoint (``from_config`` + ``load_state_dict``).

    Raises:
        ConfigError: the run has no ``model/`` folder (not an HF model), or transformers is missing.
    """
    directory = checkpoint_dir(run_dir)
    info_path = directory / MODEL_DIR / MODEL_INFO
    if not _is_hf(directory):
        raise ConfigError(f"{str(directory)!r} has no {MODEL_DIR}/config.json: not a Hugging Face model's run "
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


def export(run_dir: str | Path, out: str | Path, step: int | None = None, force: bool = False) -> Path:
    """Writes a run's model: an HF folder (``config.json`` + ``model.safetensors``) when the run
    trained a split HF model and ``out`` does not end in ``.pt``, else ``torch.save`` of the merged
    ``state_dict`` to ``out`` (``out/model.pt`` for a folder): the weights a resume starts from
    (fp32 masters under bf16), an untied run's untied names recorded ([Note: what an export writes]).

    Args:
        run_dir: a run folder or a checkpoint folder.
        out: the destination (see :func:`check_out`).
        step: the checkpoint's step (default: the newest complete one).
        force: write into a non-empty folder or over an existing file, saying what was replaced.

    Returns:
        The path written.

    Raises:
        ConfigError: as :func:`check_out`, :func:`merged_state_dict` and :func:`load_model`.
    """
    out = Path(out)
    directory = checkpoint_dir(run_dir)
    check_out(run_dir, out, force)
    step = _say_if_training(directory, step)
    if _is_hf(directory) and out.suffix != ".pt":
        model = load_model(run_dir, step)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.export-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            _copy_tokenizer(directory / MODEL_DIR, Path(tmp))
            (Path(tmp) / EXPORT_INFO).write_text(json.dumps(_record(run_dir, None, [])) + "\n")
            out.mkdir(exist_ok=True)
            replaced = [f.name for f in sorted(Path(tmp).iterdir()) if (out / f.name).exists()]
            for f in sorted(Path(tmp).iterdir()):
                if (out / f.name).is_dir():
                    shutil.rmtree(out / f.name)
                os.replace(f, out / f.name)
        _say_replaced(out, replaced)
        return out
    owners: dict[str, int] = {}
    state = collections.OrderedDict(merged_state_dict(run_dir, step, owners))
    untied = untied_names(run_dir, owners)
    if out.suffix != ".pt":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "model.pt"
        check_out(run_dir, out, force)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    existed = out.is_file()
    record = {UNTIED_KEY: untied, RECORD_KEY: _record(run_dir, state, untied)}
    state._metadata = collections.OrderedDict({"": record})  # type: ignore[attr-defined]
    atomic_save(state, out)
    if untied:  # said once the file is there
        pair = "; ".join(" and ".join(g) for g in untied)
        if record[RECORD_KEY].get("model") in _preset_names():  # our stages refuse a tied load themselves
            log.info("%s: %s were trained untied (separate tensors): unbubble.export.load(%r) builds the model "
                     "untied and loads it", out, pair, str(out))
        else:
            log.warning("%s: %s were trained untied (separate tensors): load it into a model built untied "
                        "(tie_word_embeddings=False); a tied model keeps only one of them (unbubble.export.load_export "
                        "refuses that)", out, pair)
    _say_replaced(out.parent, [out.name] if existed else [])
    return out


def _say_if_training(directory: Path, step: int | None) -> int | None:
    """Warns when the run still trains: its newest checkpoint is not its last ([Note: what an export writes]).

    Returns:
        The step to export: ``step``, or while the run trains the newest complete one, the step the
        warning names (the run may complete a newer checkpoint before the files are read).
    """
    run = directory.parent if directory.name == "checkpoints" else directory
    who = lock_holder(run)
    if who is None:
        return step
    steps = complete_steps(directory, _n_stages(directory))
    if step is None and steps:
        step = steps[-1]
    if step not in steps:  # none yet, or no such step: merged_state_dict's error says which there are
        return step
    log.warning("%s is still training (process %s on %s, started %s): this export holds step %s, not the run's final "
                "weights; export again when it ends", run, who.get("pid", "?"), who.get("host", "?"),
                who.get("started", "?"), step)
    return step


def _copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The run's Hugging Face tokenizer files (``model/``, written by ``unbubble train``) beside the
    exported weights, so ``AutoTokenizer.from_pretrained(OUT)`` reads the tokenizer the run trained on."""
    from unbubble.data.tokenizer import _tokenizer_files, has_tokenizer_files

    if has_tokenizer_files(model_dir):
        for f in _tokenizer_files(model_dir):
            shutil.copyfile(f, out / f.name)


def _say_replaced(folder: Path, names: list[str]) -> None:
    if names:
        log.warning("--force: replaced %s in %s", ", ".join(names), folder)


def load_export(model: torch.nn.Module, path: str | Path, strict: bool = True) -> Any:
    """``model.load_state_dict`` of a ``.pt`` export, refusing a model that ties weights the run
    trained untied ([Note: what an export writes]).

    Returns:
        What ``load_state_dict`` returns (missing and unexpected keys).

    Raises:
        ConfigError: names the export records as untied are one tensor in ``model``.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    untied = getattr(state, "_metadata", {}).get("", {}).get(UNTIED_KEY, [])
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in untied:
        ids = {id(params[n]) for n in group if n in params}
        if len(ids) == 1 and sum(n in params for n in group) > 1:
            raise ConfigError(f"{str(path)!r} holds {' and '.join(group)} as separate tensors (trained untied), but "
                              f"they are one tied tensor in this {type(model).__name__}: loading would keep only one; "
                              "build the model untied (e.g. tie_word_embeddings=False) and load again")
    return model.load_state_dict(state, strict=strict)


def _preset_names() -> set[str]:
    from unbubble.models import PRESETS

    return set(PRESETS)


def _run_config(run_dir: str | Path) -> dict:
    """The run's config.json (beside its checkpoints/ folder), or ``{}``."""
    directory = checkpoint_dir(run_dir)
    for folder in (directory.parent, directory):
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict) and "model" in cfg:
            return cfg
    return {}


def _record(run_dir: str | Path, state: dict | None, untied: list[list[str]]) -> dict:
    """What an export is: the run's ``model`` (a preset name, ``hf:PATH`` or ``module:function``),
    tokenizer, seed and vocabulary (the embedding's rows), and the untied names."""
    cfg = _run_config(run_dir)
    vocab = None
    if state is not None:
        emb = next((t for n, t in state.items() if n.endswith(("wte.weight", "embed_tokens.weight"))), None)
        vocab = None if emb is None else int(emb.shape[0])
    return {"model": cfg.get("model"), "tokenizer": cfg.get("tokenizer"), "seed": cfg.get("seed"),
            "vocab_size": vocab, "untied": untied}


def export_record(path: str | Path) -> dict:
    """What a ``.pt`` export says it is (``{}`` for one written before exports recorded it, or
    not by :func:`export`): ``model``, ``tokenizer``, ``seed``, ``vocab_size``, ``untied``."""
    state = _load_pt(path)
    meta = getattr(state, "_metadata", {}).get("", {})
    return dict(meta.get(RECORD_KEY) or {})


def _load_pt(path: str | Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise ConfigError(f"{str(path)!r} is not a state dict unbubble export wrote (torch.load: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def _whole_preset_model(preset: str, vocab_size: int, untied: bool) -> torch.nn.Module:
    """The whole model of a preset (one stage holding every block), untied when the run trained
    its embedding and head apart."""
    from unbubble.models import make_config, stage_class
    from unbubble.models.gpt2 import GPTConfig, GPTStage

    config = make_config(preset, vocab_size)
    layers = range(config.n_layer)
    if isinstance(config, GPTConfig):
        return GPTStage(config, layers, True, True, 0, tie=not untied)
    if untied and getattr(config, "tie_embeddings", False):
        config = dataclasses.replace(config, tie_embeddings=False)
    return stage_class(config)(config, layers, True, True, 0)


def load(path: str | Path, step: int | None = None) -> torch.nn.Module:
    """The trained model of an export or a run, built whole and loaded: one call whatever the run
    trained ([Note: what an export writes]).

    * a ``.pt`` file :func:`export` wrote (or a folder holding ``model.pt``) of a preset run: the
      preset's whole model (``GPTStage`` / ``LlamaStage`` / ``MoEStage`` holding every block, untied
      when the run trained the embedding and the head apart), its weights loaded strictly;
    * an HF folder :func:`export` wrote: ``transformers.AutoModelForCausalLM.from_pretrained``;
    * a run folder or its ``checkpoints/``: the same, straight from its newest (or ``step``'s)
      checkpoint.

    The model is in ``eval()`` mode on the CPU; ``model.tokenizer`` is the run's tokenizer
    (:func:`unbubble.data.get_tokenizer`) when the export names it, for :func:`sample`.

    Args:
        path: the export or the run.
        step: with a run folder, the checkpoint's step (default: the newest complete one).

    Returns:
        The model: called on token ids ``(B, T)`` int64 it returns logits ``(B, T, V)`` (an HF model's
        output carries them in ``.logits``).

    Raises:
        ConfigError: no such file or folder, a ``.pt`` file that does not say what model it is (written
            before exports recorded it: build the model and use :func:`load_export`), a model that is
            neither a preset nor an HF folder, or weights that do not fit the model.
    """
    from unbubble.data import get_tokenizer

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"path={str(p)!r} does not exist: give what unbubble export wrote (a .pt file or a folder) "
                          "or a run folder")
    if p.is_dir() and (p / "model.pt").is_file():
        p = p / "model.pt"
    if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        model = _from_pretrained(p)
        info = json.loads((p / EXPORT_INFO).read_text()) if (p / EXPORT_INFO).is_file() else {}
    elif p.is_dir():
        directory = checkpoint_dir(p)
        if _is_hf(directory):
            model, info = load_model(p, step).eval(), _record(p, None, [])
        else:
            owners: dict[str, int] = {}
            state = merged_state_dict(p, step, owners)
            info = _record(p, state, untied_names(p, owners))
            model = _build_and_load(info, state, str(p))
    else:
        state = _load_pt(p)
        info = dict(getattr(state, "_metadata", {}).get("", {}).get(RECORD_KEY) or {})
        if not info:
            raise ConfigError(f"{str(p)!r} does not say what model it is (written by an older unbubble export, or not "
                              "by unbubble export): build the model yourself and load it with "
                              "unbubble.export.load_export(model, path)")
        model = _build_and_load(info, state, str(p))
    name = info.get("tokenizer")
    if name == "auto":  # recorded before the run resolved it: a preset's auto is the byte tokenizer
        name = "byte" if info.get("model") in _preset_names() else None
    if name:
        try:
            model.tokenizer = get_tokenizer(name)
        except ConfigError as exc:  # e.g. an hf: tokenizer folder that has moved: the weights still load
            log.warning("%s: the run's tokenizer is not available (%s); give sample() a tokenizer", path, exc)
    return model


def _from_pretrained(folder: Path) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("loading a Hugging Face export needs transformers: pip install 'unbubble[hf]'") from None
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _build_and_load(info: dict, state: dict, where: str) -> torch.nn.Module:
    """The whole model ``info`` names, ``state`` loaded into it strictly."""
    from unbubble.models import PRESETS

    name = info.get("model")
    if name in PRESETS:
        model = _whole_preset_model(name, int(info["vocab_size"]), bool(info.get("untied")))
    elif isinstance(name, str) and name.startswith("hf:"):
        from unbubble.models.external import load_external

        model = load_external(name, int(info.get("seed") or 0))
        if info.get("untied") and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            config = type(model.config).from_dict({**model.config.to_dict(), "tie_word_embeddings": False})
            model = type(model)(config)
    else:
        raise ConfigError(f"{where!r} holds the weights of model={name!r}, which unbubble.export.load cannot build "
                          "(a preset or hf:FOLDER): build the model yourself and load it with "
                          "unbubble.export.load_export(model, path)")
    untied = info.get("untied") or []
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in untied:  # the same check as load_export
        if len({id(params[n]) for n in group if n in params}) == 1 and sum(n in params for n in group) > 1:
            raise ConfigError(f"{where!r} holds {' and '.join(group)} as separate tensors (trained untied), but they "
                              f"are one tied tensor in this {type(model).__name__}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"{where!r} does not fit model={name!r}: {str(exc).splitlines()[0]}") from None
    return model.eval()


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: str, tokens: int = 100, temperature: float = 1.0, top_k: int | None = 50,
           seed: int = 0, tokenizer: Any = None) -> str:
    """Text the model writes after ``prompt``: ``tokens`` tokens drawn one at a time from
    softmax(logits / ``temperature``) over the ``top_k`` likeliest (``temperature=0``: the likeliest).

    Args:
        model: what :func:`load` returns (a stage holding the whole model, or an HF model).
        prompt: the text to continue (non-empty).
        tokens: how many tokens to add (≥ 1).
        temperature: ≥ 0; 0 is greedy.
        top_k: draw among this many likeliest tokens (None: all).
        seed: the draws' seed (the same seed, the same text).
        tokenizer: default ``model.tokenizer`` (set by :func:`load`).

    Returns:
        The prompt and its continuation, decoded.

    Raises:
        ConfigError: no tokenizer, an empty prompt, ``tokens`` < 1 or a negative temperature.
    """
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("sample needs a tokenizer: give tokenizer=unbubble.data.get_tokenizer(NAME)")
    if not prompt:
        raise ConfigError("prompt='' is invalid: give some text to continue")
    check_int("tokens", tokens)
    if not temperature >= 0:
        raise ConfigError(f"temperature={temperature!r} is invalid: must be ≥ 0 (0: the likeliest token)")
    config = getattr(model, "config", None)
    window = getattr(config, "block_size", None) or getattr(config, "n_positions", None) or \
        getattr(config, "max_position_embeddings", None) or 1024
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)  # (1, T)
    for _ in range(tokens):
        out = model(ids[:, -window:])
        logits = (out.logits if hasattr(out, "logits") else out)[0, -1].float()  # (V,)
        logits = logits[:tokenizer.vocab_size]  # a padded vocabulary's extra rows never come out
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(ids[0].tolist())
