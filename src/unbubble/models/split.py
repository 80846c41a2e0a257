"""Split a model you already have into pipeline stages, by module names (DESIGN §10, "Split, don't rewrite").

Named ``split`` beside ``partition``: ``partition.py`` balances *our* presets' blocks by an estimated
cost and builds their stage classes; this module takes a *foreign* decoder-only causal LM (Hugging
Face ``GPT2LMHeadModel`` / ``LlamaForCausalLM``, a torchtitan-layout model, or any model with
per-stage module names) and cuts it where it stands, without rewriting it.

[Note: stages keep the model's names]
Each stage module holds copies of the submodules it owns under their original attribute paths, and
the decoder layers in an ``nn.ModuleDict`` keyed by their original index, so a stage's
``state_dict()`` keys are the model's own fully-qualified names (``transformer.h.5.attn.c_attn.weight``
on whichever stage holds block 5). The stages' state dicts merge into one ``model.state_dict()``
(``unbubble.export``), as torchtitan prunes a meta-device model per stage (its
``pipeline_module_split``). Parameter-free modules every stage needs (Llama's rotary embedding) are
copied into each stage; their buffers are non-persistent, so nothing is duplicated in a checkpoint.

What crosses a boundary of an HF model ([Note: stage boundaries carry pytrees]): a dict
``{"hidden_states", "attention_mask", "position_ids"}``. The 2-D padding mask and the position ids
travel; each stage rebuilds the 4-D causal mask (``transformers.masking_utils.create_causal_mask``,
as the whole model does once) and Llama's rotary tables from them, so ``attn_implementation="eager"``
is causal and respects padding on every stage. The first stage takes a dict batch (``input_ids``,
optional ``attention_mask``, ``position_ids``) or the token ids alone; the last returns the logits
``(B, T, vocab)``.

Tied weights: a parameter reachable under two names on two stages (GPT-2's ``transformer.wte.weight``
and ``lm_head.weight``) cannot be shared by asynchronous stages: :func:`split_model` refuses it in one
line, or with ``untie=True`` gives each stage its own copy and warns.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.models.partition import partition_by_cost

log = logging.getLogger(__name__)

#: the layouts :func:`split_model` recognises by their module names
LAYOUTS = ("hf-gpt2", "hf-llama", "torchtitan")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which module names each stage owns.

    Attributes:
        layout: one of :data:`LAYOUTS`, or ``"names"`` (given per-stage names: the pruned model's own forward).
        names: per stage, the fully-qualified module names it owns, in order.
        layers: per stage, the original indices of its decoder layers.
    """

    layout: str
    names: tuple[tuple[str, ...], ...]
    layers: tuple[tuple[int, ...], ...]


def detect_layout(model: nn.Module) -> str:
    """The layout of ``model`` by its module names, one of :data:`LAYOUTS`.

    Raises:
        ConfigError: none fits (names the layouts and the fix: ``module_names_per_stage``).
    """
    names = dict(model.named_children())
    if "transformer" in names and hasattr(model.transformer, "h") and "lm_head" in names:
        return "hf-gpt2"
    if "model" in names and hasattr(model.model, "layers") and "lm_head" in names:
        return "hf-llama"
    if {"tok_embeddings", "layers", "norm", "output"} <= set(names) and isinstance(model.layers, nn.ModuleDict):
        return "torchtitan"
    raise ConfigError(f"{type(model).__name__} has none of the layouts split_model knows (HF GPT-2: transformer.h + "
                      "lm_head; HF Llama: model.layers + lm_head; torchtitan: tok_embeddings, layers (ModuleDict), norm, "
                      "output): give module_names_per_stage=[[names of stage 0], …]")


def _layer_container(model: nn.Module, layout: str) -> tuple[str, nn.Module]:
    """``(name, module)`` of the decoder layers' container."""
    prefix = {"hf-gpt2": "transformer.h", "hf-llama": "model.layers", "torchtitan": "layers"}[layout]
    return prefix, model.get_submodule(prefix)


_FIRST = {"hf-gpt2": ("transformer.wte", "transformer.wpe", "transformer.drop"), "hf-llama": ("model.embed_tokens",),
          "torchtitan": ("tok_embeddings",)}
_LAST = {"hf-gpt2": ("transformer.ln_f", "lm_head"), "hf-llama": ("model.norm", "lm_head"),
         "torchtitan": ("norm", "output")}
_EVERY = {"hf-gpt2": (), "hf-llama": ("model.rotary_emb",), "torchtitan": ()}


def plan_split(model: nn.Module, n_stages: int | None = None, cuts: Sequence[int] | None = None,
               module_names_per_stage: Sequence[Sequence[str]] | None = None) -> Plan:
    """Which modules each stage owns: embeddings on the first, decoder layers split evenly by
    parameter count (``partition_by_cost``: the smallest largest stage) or at ``cuts``, final norm and
    head on the last.

    Args:
        model: the whole model.
        n_stages: N (with neither ``cuts`` nor names).
        cuts: the first layer index of stages 1 … N−1 (increasing); N = len(cuts) + 1.
        module_names_per_stage: per stage, module names (torchtitan's ``module_names_per_stage``):
            any model; each stage then runs the pruned model's own ``forward``.

    Raises:
        ConfigError: no stage count, cuts out of order, an empty stage, an unknown name.
    """
    if module_names_per_stage is not None:
        known = dict(model.named_modules())
        for s, names in enumerate(module_names_per_stage):
            for name in names:
                if name not in known:
                    raise ConfigError(f"module_names_per_stage[{s}] names {name!r}, which {type(model).__name__} does "
                                      "not have (names are model.named_modules() keys)")
        return Plan("names", tuple(tuple(n) for n in module_names_per_stage), ((),) * len(module_names_per_stage))
    layout = detect_layout(model)
    prefix, layers = _layer_container(model, layout)
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else [str(i) for i in range(len(layers))]
    n_layer = len(keys)
    if cuts is not None:
        cuts = list(cuts)
        if n_stages is not None and n_stages != len(cuts) + 1:
            raise ConfigError(f"n_stages={n_stages} and cuts={cuts} disagree: cuts gives {len(cuts) + 1} stages")
        bounds = [0, *cuts, n_layer]
        if any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ConfigError(f"cuts={cuts} are invalid: must increase strictly within 1…{n_layer - 1} "
                              f"(the model has {n_layer} layers; every stage gets at least one)")
        groups = [range(b, c) for b, c in zip(bounds, bounds[1:])]
    else:
        if n_stages is None or n_stages < 1 or n_stages > n_layer:
            raise ConfigError(f"n_stages={n_stages} is invalid: must be 1…{n_layer} (the model has {n_layer} layers)"
                              " or give cuts=[…]")
        costs = [float(sum(p.numel() for p in layers._modules[k].parameters())) for k in keys]
        groups = partition_by_cost(costs, n_stages)
    n = len(groups)
    names, idx = [], []
    for s, group in enumerate(groups):
        own = list(_EVERY[layout])
        if s == 0:
            own = [*_FIRST[layout], *own]
        own += [f"{prefix}.{keys[i]}" for i in group]
        if s == n - 1:
            own += list(_LAST[layout])
        names.append(tuple(own))
        idx.append(tuple(int(keys[i]) if keys[i].isdigit() else i for i in group))
    return Plan(layout, tuple(names), tuple(idx))


def _owner(fqn: str, names: Sequence[str]) -> bool:
    return any(fqn == n or fqn.startswith(n + ".") for n in names)


def tied_across_stages(model: nn.Module, plan: Plan) -> list[tuple[str, str, int, int]]:
    """Parameters reachable under two names owned by two stages: ``(name a, name b, stage a, stage b)``."""
    by_id: dict[int, list[tuple[str, int]]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        stage = next((s for s, names in enumerate(plan.names) if _owner(fqn, names)), None)
        if stage is not None:
            by_id.setdefault(id(p), []).append((fqn, stage))
    out = []
    for uses in by_id.values():
        for fqn, stage in uses[1:]:
            if stage != uses[0][1]:
                out.append((uses[0][0], fqn, uses[0][1], stage))
    return out


def _get(model: nn.Module, fqn: str) -> nn.Module:
    return model.get_submodule(fqn)


def _place(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Puts ``module`` at ``fqn`` under ``root``, creating plain containers on the way (a numeric
    last part under a layer container goes into an ``nn.ModuleDict``)."""
    parts = fqn.split(".")
    node = root
    for i, part in enumerate(parts[:-1]):
        child = node._modules.get(part)
        if child is None:
            child = nn.ModuleDict() if parts[i + 1].isdigit() else nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(parts[-1], module)


class HFStage(nn.Module):
    """One stage of a Hugging Face GPT-2 or Llama causal LM ([Note: stages keep the model's names]).

    Args:
        config: the model's ``PretrainedConfig`` (its attention implementation picks the mask format).
        layout: ``"hf-gpt2"`` or ``"hf-llama"``.
        layers: the original indices of this stage's decoder layers.
        first, last: whether it holds the embeddings / the final norm and head.

    Input: a dict batch (``input_ids`` ``(B, T)`` int64, optional ``attention_mask`` ``(B, T)`` 0/1,
    ``position_ids``) or the ids tensor on the first stage; else the previous stage's dict. Output:
    ``{"hidden_states" (B, T, C), "attention_mask", "position_ids"}``, or the logits ``(B, T, V)`` on the last.
    """

    def __init__(self, config, layout: str, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.config, self.layout, self.layer_ids = config, layout, tuple(layers)
        self.first, self.last = first, last

    def _layers(self):
        root = self.transformer.h if self.layout == "hf-gpt2" else self.model.layers
        return [root[str(i)] for i in self.layer_ids]

    def forward(self, x: Any) -> Any:
        if self.first:
            batch = x if isinstance(x, dict) else {"input_ids": x}
            ids = batch["input_ids"]
            mask, pos = batch.get("attention_mask"), batch.get("position_ids")
            if pos is None:  # as the whole model does without a cache
                pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            if self.layout == "hf-gpt2":
                t = self.transformer
                h = t.drop(t.wte(ids) + t.wpe(pos))
            else:
                h = self.model.embed_tokens(ids)
        else:
            h, mask, pos = x["hidden_states"], x["attention_mask"], x["position_ids"]
        layers = self._layers()
        if layers:
            from transformers.masking_utils import create_causal_mask

            causal = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=mask, cache=None,
                                        position_ids=pos)
            if self.layout == "hf-gpt2":
                for block in layers:
                    h = block(h, None, causal, None, use_cache=False, position_ids=pos)
            else:
                rope = self.model.rotary_emb(h, position_ids=pos)  # recomputed on every stage: no parameters
                for layer in layers:
                    h = layer(h, attention_mask=causal, position_embeddings=rope, position_ids=pos, cache=None,
                              use_cache=False)
            if isinstance(h, tuple):  # older transformers return (hidden_states, …)
                h = h[0]
        if self.last:
            norm = self.transformer.ln_f if self.layout == "hf-gpt2" else self.model.norm
            return self.lm_head(norm(h))
        return {"hidden_states": h, "attention_mask": mask, "position_ids": pos}


def _prune(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` keeping only the modules in ``names`` (and what they contain):
    others become ``None`` at the top level, or are deleted from a ``ModuleDict`` / ``ModuleList``
    (a ``ModuleList`` becomes a ``ModuleDict`` keyed by the original indices), as torchtitan prunes."""
    keep = set(names)

    def kept_below(fqn: str) -> bool:
        return any(n == fqn or n.startswith(fqn + ".") for n in keep)

    stage = copy.deepcopy(model)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in list(module._modules.items()):
            fqn = f"{prefix}{name}"
            if child is None or fqn in keep:
                continue
            if not kept_below(fqn):
                if isinstance(module, (nn.ModuleDict, nn.ModuleList)):
                    del module._modules[name]
                else:
                    module._modules[name] = None
                continue
            if isinstance(child, nn.ModuleList):
                child = nn.ModuleDict(dict(child.named_children()))
                module._modules[name] = child
            visit(child, fqn + ".")

    visit(stage, "")
    return stage


def build_stage(model: nn.Module, plan: Plan, stage: int, untie: bool = False) -> nn.Module:
    """Stage ``stage`` of ``plan`` (copies; ``model`` is not changed)."""
    names = plan.names[stage]
    if plan.layout in ("names", "torchtitan"):
        return _prune(model, names)
    out = HFStage(model.config, plan.layout, plan.layers[stage], stage == 0, stage == len(plan.names) - 1)
    memo: dict = {}  # one memo per stage: weights tied within a stage stay one tensor
    for fqn in names:
        _place(out, fqn, copy.deepcopy(_get(model, fqn), memo))
    return out


class SplitModel:
    """A picklable ``stage_fn`` (``PipelineJob.stage_fn``): ``split(stage)`` builds a fresh copy
    of stage ``stage`` every call (deterministic: the same weights every call and process).

    Attributes:
        model: the whole model (kept on the CPU, unchanged).
        plan: the :class:`Plan`.
        untie: tied weights across stages were untied (each stage its own copy).
    """

    def __init__(self, model: nn.Module, plan: Plan, untie: bool = False):
        self.model, self.plan, self.untie = model, plan, untie

    @property
    def n_stages(self) -> int:
        return len(self.plan.names)

    def __call__(self, stage: int) -> nn.Module:
        return build_stage(self.model, self.plan, stage, self.untie)

    def stages(self) -> list[nn.Module]:
        return [self(s) for s in range(self.n_stages)]

    def save_model_files(self, directory: str) -> None:
        """Writes what export needs beside the checkpoints (an HF model's config; ``unbubble.export``)."""
        from unbubble.export import save_model_files

        save_model_files(directory, self.model, self.untie)


def split_model(model: nn.Module, n_stages: int | None = None, *, cuts: Sequence[int] | None = None,
                module_names_per_stage: Sequence[Sequence[str]] | None = None, untie: bool = False) -> SplitModel:
    """Splits a decoder-only causal LM into pipeline stages ([Note: stages keep the model's names]).

    Args:
        model: an HF ``GPT2LMHeadModel`` or ``LlamaForCausalLM``, a torchtitan-layout model
            (``tok_embeddings``, ``layers`` as a ``ModuleDict``, ``norm``, ``output``; its own ``forward``
            must skip modules that are ``None``), or any model with ``module_names_per_stage``.
        n_stages: N: layers split evenly by parameter count.
        cuts: the first layer index of stages 1 … N−1 instead.
        module_names_per_stage: per-stage module names (any model; the pruned model's own forward runs).
        untie: give each stage its own copy of a weight tied across stages (GPT-2's ``wte`` / ``lm_head``),
            with a warning; without it such a model is refused.

    Returns:
        A :class:`SplitModel`: ``split(s)`` builds stage s, usable as ``PipelineJob.stage_fn``.

    Raises:
        ConfigError: an unknown layout, a bad stage count or cut, or weights tied across stages
            (one line naming both parameters and the fix).
    """
    plan = plan_split(model, n_stages, cuts, module_names_per_stage)
    for a, b, sa, sb in tied_across_stages(model, plan):
        if not untie:
            raise ConfigError(f"{a} (stage {sa}) and {b} (stage {sb}) are one tied tensor on two stages, which "
                              "asynchronous stages cannot share: pass untie=True to train two copies (with a warning), "
                              "or untie them in the model (e.g. tie_word_embeddings=False)")
        warnings.warn(f"untie=True: {a} (stage {sa}) and {b} (stage {sb}) were one tied tensor; each stage now trains "
                      "its own copy, so they drift apart", stacklevel=2)
    return SplitModel(model, plan, untie)


def causal_lm_loss(logits: torch.Tensor, targets: Any) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``
    int64 (already shifted; ``-100`` ignored), or a dict holding them as ``"labels"``."""
    labels = targets["labels"] if isinstance(targets, dict) else targets
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
