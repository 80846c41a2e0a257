"""A run's stage checkpoints as one model: a ``state_dict`` in the model's own names, or a Hugging
Face folder (``unbubble export RUN_DIR OUT``).

Stages built by :func:`unbubble.models.split.split_model` keep the model's fully-qualified names
([Note: stages keep the model's names]), so merging is a union of the stages' ``model`` entries:
``model.load_state_dict(merged_state_dict(run_dir))`` accepts it. The checkpoint folder of such a
run also holds ``model/`` (written once by the first checkpoint): the HF ``config.json`` and
``unbubble-model.json`` (the model class), from which :func:`export` writes a folder
``from_pretrained`` loads (``config.json`` + ``model.safetensors``).

[Note: what an export writes]
* **The weights a resume would start from.** Under ``--precision bf16`` the stage files hold bf16
  parameters and their fp32 masters; the export takes the fp32 masters (by the parameter names the
  checkpoint stores with them), so nothing is rounded away. Other floating tensors of such a run
  (buffers, frozen parameters) are written in the masters' dtype (fp32; their bf16 values exactly).
* **Untied stays untied.** A weight tied in the model but trained untied (``untie=True``: GPT-2's
  ``transformer.wte.weight`` and ``lm_head.weight``) is two tensors after training. The folder export
  writes ``tie_word_embeddings=False`` into its config.json, so ``from_pretrained`` builds an untied
  model. A ``.pt`` state dict records the untied names in its ``_metadata`` (which ``torch.save``
  keeps and ``load_state_dict`` ignores); :func:`load_export` refuses to load it into a model where
  those names are one tensor (a tied model's ``load_state_dict`` would silently keep only the later
  one), and the export warns once in one line. Plain ``model.load_state_dict`` cannot be stopped:
  build the model untied.
* **Nothing is overwritten unasked.** The output may not be inside a run folder (the run exported,
  any folder ``unbubble train`` wrote, any checkpoint folder) or be the run folder itself, whatever
  ``force`` says; an existing non-empty folder or an existing file is refused unless ``force``, and
  then the export says what it replaced. An HF folder is written to a temporary folder beside OUT
  and moved in, file by file.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from unbubble.errors import ConfigError
from unbubble.pipeline import merge_state_dicts
from unbubble.runtime.checkpoint import complete_steps, load_stage, stage_path

#: the folder beside the ``step-*`` folders that describes the model (HF runs)
MODEL_DIR = "model"
MODEL_INFO = "unbubble-model.json"
#: the ``_metadata`` key of a ``.pt`` export that lists the weights tied in the model but trained untied
UNTIED_KEY = "unbubble_untied"
_STAGE_FILE = re.compile(r"^stage-(\d{3})\.pt$")

log = logging.getLogger(__name__)


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


def untied_names(run_dir: str | Path, owners: dict[str, int]) -> list[list[str]]:
    """The groups of parameter names that are one tensor in the model but were trained on
    different stages (``untie=True``), from ``model/`` (:func:`save_model_files`); ``[]`` when the
    run recorded none.

    Args:
        run_dir: a run folder or a checkpoint folder.
        owners: each merged name's stage (``merged_state_dict(..., owners=...)``).

    Raises:
        ConfigError: as :func:`checkpoint_dir`.
    """
    info_path = checkpoint_dir(run_dir) / MODEL_DIR / MODEL_INFO
    if not info_path.is_file():
        return []
    groups = json.loads(info_path.read_text()).get("tied", [])
    return [g for g in groups if len({owners[n] for n in g if n in owners}) > 1]


def save_model_files(directory: str | Path, model: torch.nn.Module, untied: bool) -> None:
    """Writes ``directory/model/`` once: an HF model's ``config.json``, and :data:`MODEL_INFO`
    (the model class and, with ``untied``, the names of each tensor the model ties, which
    :func:`untied_names` reads). A model that is neither HF nor untied gets nothing."""
    out = Path(directory) / MODEL_DIR
    hf = hasattr(getattr(model, "config", None), "save_pretrained")
    groups: dict[int, list[str]] = {}
    if untied:
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
    tied = [names for names in groups.values() if len(names) > 1]
    if (out / MODEL_INFO).is_file() or not (hf or tied):
        return
    out.mkdir(parents=True, exist_ok=True)
    if hf:
        config = model.config
        if untied and getattr(config, "tie_word_embeddings", False):
            config = type(config).from_dict({**config.to_dict(), "tie_word_embeddings": False})
        config.save_pretrained(out)
    cls = type(model)
    (out / MODEL_INFO).write_text(json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}", "tied": tied}) + "\n")


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
    if _is_hf(directory) and out.suffix != ".pt":
        model = load_model(run_dir, step)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.export-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            _copy_tokenizer(directory / MODEL_DIR, Path(tmp))
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
    if untied:
        state._metadata = collections.OrderedDict({"": {UNTIED_KEY: untied}})  # type: ignore[attr-defined]
        log.warning("%s: %s were trained untied (separate tensors): load it into a model built untied "
                    "(tie_word_embeddings=False); a tied model keeps only one of them (unbubble.export.load_export "
                    "refuses that)", out, "; ".join(" and ".join(g) for g in untied))
    torch.save(state, out)
    _say_replaced(out.parent, [out.name] if existed else [])
    return out


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
