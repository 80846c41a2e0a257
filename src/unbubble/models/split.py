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
import functools
import logging
import math
import time
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


#: Hugging Face ``model_type``s :func:`split_model` supports, each with the rule its own forward
#: (transformers 5.x) uses for each decoder layer's attention mask: ``"full"`` (every layer causal),
#: ``"window"`` (every layer a sliding window when ``config.sliding_window`` is set: Mistral's
#: ``mask_function``), ``"layer_types"`` (``config.layer_types[i]``: Qwen2's and Gemma2's mapping).
#: Embedding scales live in the embedding module (Gemma's ``GemmaTextScaledWordEmbedding``), the
#: final-logit soft-cap is applied by the last stage (``config.final_logit_softcapping``).
HF_FAMILIES = {"gpt2": "full", "llama": "full", "gemma": "full", "mistral": "window", "mixtral": "window",
               "phi3": "window", "qwen2": "layer_types", "qwen3": "layer_types", "qwen2_moe": "layer_types",
               "gemma2": "layer_types"}


def detect_layout(model: nn.Module) -> str:
    """The layout of ``model``, one of :data:`LAYOUTS`: a Hugging Face model by its
    ``config.model_type`` (:data:`HF_FAMILIES`), else torchtitan's by its module names.

    Raises:
        ConfigError: an HF ``model_type`` split_model does not know, an HF model without ``lm_head``,
            or a non-HF model of no known layout (names the supported ones).
    """
    names = dict(model.named_children())
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str):
        if model_type not in HF_FAMILIES:
            raise ConfigError(f"model_type {model_type!r} ({type(model).__name__}) is not a family unbubble splits: "
                              f"{', '.join(sorted(HF_FAMILIES))} (decoder-only causal LMs whose forward it mirrors)")
        if "lm_head" not in names:
            raise ConfigError(f"{type(model).__name__} has no lm_head: split_model takes a causal LM "
                              f"({model_type}: its *ForCausalLM class)")
        return "hf-gpt2" if model_type == "gpt2" else "hf-llama"
    if {"tok_embeddings", "layers", "norm", "output"} <= set(names) and isinstance(model.layers, nn.ModuleDict):
        return "torchtitan"
    raise ConfigError(f"{type(model).__name__} has none of the layouts split_model knows (a Hugging Face causal LM "
                      f"of model_type {', '.join(sorted(HF_FAMILIES))}; torchtitan: tok_embeddings, layers "
                      "(ModuleDict), norm, output): give module_names_per_stage=[[names of stage 0], …]")


def attention_types(config) -> list[str]:
    """Each decoder layer's attention type, ``"full_attention"`` or ``"sliding_attention"``, as the
    model's own forward picks its mask (:data:`HF_FAMILIES`)."""
    rule = HF_FAMILIES[config.model_type]
    n = config.num_hidden_layers
    if rule == "layer_types":
        return list(config.layer_types)[:n]
    if rule == "window" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _check_hf_features(model: nn.Module) -> None:
    """Refuses what no stage can compute locally (one line each)."""
    config = model.config
    if getattr(config, "output_router_logits", False):
        raise ConfigError(f"{config.model_type} with output_router_logits=True: its load-balancing loss multiplies "
                          "expert counts summed over all layers by router probabilities summed over all layers, so "
                          "no stage can add its share locally (an asynchronous pipeline cannot train it exactly): set "
                          "config.output_router_logits=False")


def _parts(model: nn.Module, layout: str) -> tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(layer container, first stage's, last stage's, every stage's module names)``. A decoder HF
    model's come from its own ``base_model_pp_plan`` (``embed_tokens``, ``layers``, ``norm`` under
    ``base_model_prefix``) and ``lm_head``; its parameter-free rotary embedding goes to every stage."""
    if layout == "hf-gpt2":
        return "transformer.h", ("transformer.wte", "transformer.wpe", "transformer.drop"), \
            ("transformer.ln_f", "lm_head"), ()
    if layout == "torchtitan":
        return "layers", ("tok_embeddings",), ("norm", "output"), ()
    prefix = model.base_model_prefix
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    if not {"embed_tokens", "layers", "norm"} <= set(plan):
        raise ConfigError(f"{type(model).__name__} declares no base_model_pp_plan with embed_tokens, layers and norm: "
                          "split_model cannot tell its stages apart")
    every = (f"{prefix}.rotary_emb",) if hasattr(model.get_submodule(prefix), "rotary_emb") else ()
    return f"{prefix}.layers", (f"{prefix}.embed_tokens",), (f"{prefix}.norm", "lm_head"), every


def count_layers(model: nn.Module) -> int:
    """The decoder layers of a model :func:`split_model` takes (its stages hold 1 … this many).

    Raises:
        ConfigError: a model of no known layout (as :func:`split_model`)."""
    return len(model.get_submodule(_parts(model, detect_layout(model))[0]))


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
        if isinstance(getattr(getattr(model, "config", None), "model_type", None), str):
            raise ConfigError(f"module_names_per_stage with a Hugging Face model ({type(model).__name__}): its forward "
                              "does not skip the parts a stage lacks; split it by n_stages or cuts=[first layer of "
                              "stages 1…N−1]")
        known = dict(model.named_modules())
        for s, names in enumerate(module_names_per_stage):
            for name in names:
                if name not in known:
                    raise ConfigError(f"module_names_per_stage[{s}] names {name!r}, which {type(model).__name__} does "
                                      "not have (names are model.named_modules() keys)")
        plan = Plan("names", tuple(tuple(n) for n in module_names_per_stage), ((),) * len(module_names_per_stage))
        _check_names_cover(model, plan)
        return plan
    layout = detect_layout(model)
    prefix, first, last, every = _parts(model, layout)
    layers = model.get_submodule(prefix)
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
        own = list(every)
        if s == 0:
            own = [*first, *own]
        own += [f"{prefix}.{keys[i]}" for i in group]
        if s == n - 1:
            own += list(last)
        names.append(tuple(own))
        idx.append(tuple(int(keys[i]) if keys[i].isdigit() else i for i in group))
    return Plan(layout, tuple(names), tuple(idx))


def _check_names_cover(model: nn.Module, plan: Plan) -> None:
    """Every parameter on exactly one stage, and a numbered container's entries (the
    decoder layers) in order across the stages: a split that drops, repeats or reorders a layer
    trains another model.

    Raises:
        ConfigError: naming the first parameter (or layer) on no stage, on two, or out of order.
    """
    for fqn, _ in model.named_parameters():
        stages = [s for s, names in enumerate(plan.names) if _owner(fqn, names)]
        if not stages:
            raise ConfigError(f"module_names_per_stage leaves {fqn} on no stage: every parameter must be on exactly "
                              "one (the stages together are the whole model)")
        if len(stages) > 1 or sum(_owner(fqn, [n]) for n in plan.names[stages[0]]) > 1:
            where = f"stages {stages}" if len(stages) > 1 else f"stage {stages[0]} twice"
            raise ConfigError(f"module_names_per_stage puts {fqn} on {where}: every parameter must be on exactly "
                              "one stage")
    last: tuple[str, int, int] | None = None  # (container, index, stage) of the latest numbered entry
    for s, names in enumerate(plan.names):
        for name in names:
            head, _, tail = name.rpartition(".")
            if not tail.isdigit():
                continue
            if last is not None and last[0] == head and int(tail) <= last[1]:
                raise ConfigError(f"module_names_per_stage puts {name} (stage {s}) after {head}.{last[1]} (stage "
                                  f"{last[2]}): layers must follow the model's order across the stages")
            last = (head, int(tail), s)


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


@functools.lru_cache(maxsize=None)
def _cache_argument(fn) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"  # transformers < 5.2x


def _no_cache(fn) -> dict[str, None]:
    """``{name: None}`` for a transformers mask function's cache argument, by this version's name."""
    return {_cache_argument(fn): None}


class HFStage(nn.Module):
    """One stage of a Hugging Face causal LM of :data:`HF_FAMILIES` ([Note: stages keep the model's names]).

    Every layer gets what the model's own forward gives it: the causal mask of its attention type
    (full or sliding window, :func:`attention_types`), built by transformers' own
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` from the 2-D padding mask and the
    position ids; packed rows (position ids restarting mid-row, no mask) as the whole model treats
    them: one causal row with restarting positions under ``config.use_cache`` (its default: the
    model then builds a cache, and HF detects no packing), each document attending only within
    itself with ``use_cache=False``; the rotary tables; on the last stage the final norm, the head and the
    final-logit soft-cap (Gemma2's ``final_logit_softcapping``).

    Args:
        config: the model's ``PretrainedConfig`` (its attention implementation picks the mask format).
        layout: ``"hf-gpt2"`` or ``"hf-llama"`` (every decoder family with ``base_model_pp_plan``).
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
        types = attention_types(config) if layout == "hf-llama" else ["full_attention"] * config.num_hidden_layers
        self.attention_types = tuple(types[i] for i in self.layer_ids)

    def _layers(self):
        root = self.transformer.h if self.layout == "hf-gpt2" else self.model.layers
        return [root[str(i)] for i in self.layer_ids]

    def _masks(self, h: torch.Tensor, mask: Any, pos: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        # The whole model builds a cache when config.use_cache (the default), and HF then reads no
        # packed rows from the position ids; without one it attends within each packed document.
        packed = None if getattr(self.config, "use_cache", False) else pos
        return {kind: build[kind](config=self.config, inputs_embeds=h, attention_mask=mask, position_ids=packed,
                                  **_no_cache(build[kind])) for kind in sorted(set(self.attention_types))}

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
                h = self.model.embed_tokens(ids)  # Gemma's scale is the embedding module's own
        else:
            h, mask, pos = x["hidden_states"], x["attention_mask"], x["position_ids"]
        layers = self._layers()
        if layers:
            masks = self._masks(h, mask, pos)
            if self.layout == "hf-gpt2":
                for block in layers:
                    h = block(h, None, masks["full_attention"], None, use_cache=False, position_ids=pos)
            else:
                rope = self.model.rotary_emb(h, position_ids=pos)  # recomputed on every stage: no parameters
                for layer, kind in zip(layers, self.attention_types):
                    h = layer(h, attention_mask=masks[kind], position_embeddings=rope, position_ids=pos, cache=None,
                              use_cache=False)
                    if isinstance(h, tuple):  # older transformers return (hidden_states, …)
                        h = h[0]
            if isinstance(h, tuple):
                h = h[0]
        if self.last:
            norm = self.transformer.ln_f if self.layout == "hf-gpt2" else self.model.norm
            logits = self.lm_head(norm(h))
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap is not None:  # as Gemma2ForCausalLM.forward
                logits = torch.tanh(logits / cap) * cap
            return logits
        return {"hidden_states": h, "attention_mask": mask, "position_ids": pos}


def prune(model: nn.Module, names: Sequence[str], in_place: bool = False) -> nn.Module:
    """``model`` keeping only the modules in ``names`` (and what they contain), as torchtitan prunes: others become
    ``None`` at the top level, or are deleted from a ``ModuleDict`` / ``ModuleList`` (a ``ModuleList`` becomes a
    ``ModuleDict`` keyed by the original indices). A deep copy of ``model`` (a :func:`skeleton` when a stage is
    built), or with ``in_place`` the model itself (``unbubble.pipelining.split_torchtitan_model``: one process,
    one stage)."""
    keep = set(names)

    def kept_below(fqn: str) -> bool:
        return any(n == fqn or n.startswith(fqn + ".") for n in keep)

    stage = model if in_place else copy.deepcopy(model)

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


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s structure with every parameter and buffer on the meta device (no
    data; tied tensors stay one), as torchtitan builds a model before it materialises a stage."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def tensors_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under each of its names (tied ones under both)."""
    return {**{n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
            **{n: b.detach() for n, b in model.named_buffers(remove_duplicate=False)}}


def materialize(stage: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Gives a meta-device stage its own copies of its tensors, looked up by the model's names
    ([Note: stages keep the model's names]); a tensor tied within the stage stays one."""
    made: dict[int, torch.Tensor] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for key, t in list(table.items()):
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    data = tensors[f"{prefix}.{key}" if prefix else key].clone()  # the stage trains it in place
                    made[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if kind == "_parameters" else data
                table[key] = made[id(t)]
    return stage


def build_stage(model: nn.Module, plan: Plan, stage: int, untie: bool = False,
                tensors: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Stage ``stage`` of ``plan``: its modules copied from ``model``'s :func:`skeleton` (so the
    whole model is never copied), then given their own copies of ``tensors`` (default: ``model``'s;
    ``model`` is not changed)."""
    names = plan.names[stage]
    meta = model if tensors is not None else skeleton(model)
    if plan.layout in ("names", "torchtitan"):
        out = prune(meta, names)
    else:
        out = HFStage(meta.config, plan.layout, plan.layers[stage], stage == 0, stage == len(plan.names) - 1)
        memo: dict = {}  # one memo per stage: weights tied within a stage stay one tensor
        for fqn in names:
            _place(out, fqn, copy.deepcopy(_get(meta, fqn), memo))
    return materialize(out, tensors if tensors is not None else tensors_by_name(model))


class SplitModel:
    """A picklable ``stage_fn`` (``PipelineJob.stage_fn``): ``split(stage)`` builds a fresh copy
    of stage ``stage`` every call (deterministic: the same weights every call and process).

    Pickled (to each stage process), it carries the model's :func:`skeleton` and its tensors by
    name, which ``torch.multiprocessing`` hands over in shared memory: a stage process copies only
    its own stage's tensors, never the whole model.

    Attributes:
        model: the whole model (kept on the CPU, unchanged); in a stage process its skeleton.
        plan: the :class:`Plan`.
        untie: tied weights across stages were untied (each stage its own copy).
        probe: what :func:`verify_split` measured (None when it did not run).
    """

    def __init__(self, model: nn.Module, plan: Plan, untie: bool = False):
        self.model, self.plan, self.untie = model, plan, untie
        self.probe: Probe | None = None  # split_model's check (verify_split), when it ran
        self._tensors: dict[str, torch.Tensor] | None = None  # set when unpickled: self.model is then meta

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._tensors is None:
            state["model"], state["_tensors"] = skeleton(self.model), tensors_by_name(self.model)
        return state

    @property
    def n_stages(self) -> int:
        return len(self.plan.names)

    def __call__(self, stage: int) -> nn.Module:
        return build_stage(self.model, self.plan, stage, self.untie, self._tensors)

    def stages(self) -> list[nn.Module]:
        return [self(s) for s in range(self.n_stages)]

    def save_model_files(self, directory: str) -> None:
        """Writes what export needs beside the checkpoints (an HF model's config; ``unbubble.export``)."""
        from unbubble.export import save_model_files

        save_model_files(directory, self.model, self.untie)


#: Largest |difference| the probe accepts, relative to max(1, max |logit| of the whole model), by
#: dtype: fp32 chains the same kernels in the same order (measured: 0), half precision rounds per stage.
PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclasses.dataclass(frozen=True)
class Probe:
    """What :func:`verify_split` measured: the largest |difference| of the chained stages' logits
    and loss against the whole model's, the probe's shape ``(B, T)`` and its cost in seconds."""

    logits: float
    loss: float
    shape: tuple[int, int]
    seconds: float


def probe_batch(model: nn.Module, layout: str) -> tuple[Any, torch.Tensor]:
    """``(inputs, labels)`` of the split check: 2 rows of random ids (seeded), for an HF model a dict
    with a padding mask (row 0 left-padded) and position ids, longer than its sliding window where
    one is set (so a window the split forgot changes the logits); labels ``-100`` on the padding."""
    g = torch.Generator().manual_seed(0)
    if layout.startswith("hf-"):
        cfg = model.config
        most = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 64
        window = getattr(cfg, "sliding_window", None) if layout == "hf-llama" and \
            "sliding_attention" in attention_types(cfg) else None
        t = min(most, max(16, (window or 0) + 4))
        ids = torch.randint(0, cfg.vocab_size, (2, t), generator=g)
        mask = torch.ones(2, t, dtype=torch.long)
        mask[0, :min(3, t // 4)] = 0
        labels = torch.randint(0, cfg.vocab_size, (2, t), generator=g).masked_fill(mask == 0, -100)
        pos = torch.arange(t).unsqueeze(0).expand(2, t)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}, labels
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ConfigError(f"{type(model).__name__} has no nn.Embedding to draw a probe batch from: pass "
                          "verify=False to split it unchecked")
    freqs = getattr(model, "freqs_cis", None)
    t = min(16, freqs.shape[0]) if isinstance(freqs, torch.Tensor) else 16
    ids = torch.randint(0, emb.num_embeddings, (2, t), generator=g)
    return ids, torch.randint(0, emb.num_embeddings, (2, t), generator=g)


def _last_modules(model: nn.Module, plan: Plan) -> list[str | None]:
    """Per stage but the last, the whole model's module whose output is that stage's output."""
    if plan.layout == "names":
        return [names[-1] if names else None for names in plan.names[:-1]]
    prefix = _parts(model, plan.layout)[0]
    return [f"{prefix}.{layers[-1]}" if layers else None for layers in plan.layers[:-1]]


def verify_split(model: nn.Module, split: "SplitModel") -> Probe:
    """Checks that the chained stages compute what the whole model computes (DESIGN §11): one
    probe batch (:func:`probe_batch`) through ``model`` and through fresh stages, in eval mode
    without gradients, comparing every stage's output with the whole model's at the same layer,
    the logits and the :func:`causal_lm_loss`. Costs one forward of the whole model and one of the
    stages on 2 rows, and building the stages once.

    Returns:
        :class:`Probe`.

    Raises:
        ConfigError: a stage raised on the probe, or a difference beyond :data:`PROBE_TOLERANCE`:
            one line naming the first diverging stage, its layers and the max difference.
    """
    t0 = time.perf_counter()
    plan = split.plan
    inputs, labels = probe_batch(model, plan.layout)
    was = model.training
    seen: dict[str, Any] = {}
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda mod, args, out, name=name: seen.__setitem__(name, out[0] if isinstance(out, tuple) else out))
        for name in _last_modules(model, plan) if name is not None]
    try:
        model.eval()
        with torch.no_grad():
            whole = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    whole = whole.logits if hasattr(whole, "logits") else whole
    dtype = whole.dtype
    tol = PROBE_TOLERANCE.get(dtype, 1e-5) * max(1.0, float(whole.abs().max()))
    x = inputs
    lasts = _last_modules(model, plan)
    shape = tuple((inputs["input_ids"] if isinstance(inputs, dict) else inputs).shape)
    what = f"a probe batch of {shape[0]}×{shape[1]} tokens" + (" with a padding mask" if isinstance(inputs, dict) else "")
    for s in range(split.n_stages):
        stage = split(s).eval()
        try:
            with torch.no_grad():
                x = stage(x)
        except Exception as exc:  # noqa: BLE001 - any failure of a stage on the probe is the user's split
            raise ConfigError(f"stage {s} of the split fails on {what}: {type(exc).__name__}: {exc} (the stage's "
                              "modules cannot run without the parts other stages hold; split by layers instead, or "
                              "pass verify=False if you know why)") from None
        if s < split.n_stages - 1:
            mine = x["hidden_states"] if isinstance(x, dict) else x
            ref = seen.get(lasts[s]) if lasts[s] is not None else None
            if isinstance(mine, torch.Tensor) and isinstance(ref, torch.Tensor) and mine.shape == ref.shape:
                d = float((mine.float() - ref.float()).abs().max())
                if not d <= tol:
                    raise ConfigError(_diverged(s, plan, d, what))
    d = float((x.float() - whole.float()).abs().max()) if x.shape == whole.shape else math.inf
    loss = abs(float(causal_lm_loss(x, labels)) - float(causal_lm_loss(whole, labels))) \
        if x.shape == whole.shape else math.inf
    if not (d <= tol and loss <= tol):
        raise ConfigError(_diverged(split.n_stages - 1, plan, d, what) + f" (loss by {loss:.3g})")
    probe = Probe(d, loss, shape, time.perf_counter() - t0)
    log.info("split checked: %d stages equal the whole model on %s (max difference %.3g, %.2f s)",
             split.n_stages, what, d, probe.seconds)
    return probe


def _diverged(s: int, plan: Plan, d: float, what: str) -> str:
    layers = plan.layers[s]
    held = "" if not layers else f" (layer {layers[0]})" if len(layers) == 1 else f" (layers {layers[0]}–{layers[-1]})"
    return (f"the split does not compute what the whole model computes: stage {s}{held} differs by {d:.3g} on {what}; "
            "the stages miss something the model's own forward does (report it with the model's config), or pass "
            "verify=False if you know why")


def split_model(model: nn.Module, n_stages: int | None = None, *, cuts: Sequence[int] | None = None,
                module_names_per_stage: Sequence[Sequence[str]] | None = None, untie: bool = False,
                verify: bool = True, untie_option: str = "untie=True") -> SplitModel:
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
        verify: check the split before training (:func:`verify_split`: one probe batch through the
            whole model and the chained stages; one forward of each); its result is ``split.probe``.
        untie_option: how the refusal and the warning name ``untie`` (``unbubble train`` passes
            ``--untie``).

    Returns:
        A :class:`SplitModel`: ``split(s)`` builds stage s, usable as ``PipelineJob.stage_fn``.

    Raises:
        ConfigError: an unknown layout or ``model_type``, a bad stage count or cut, names that drop,
            repeat or reorder a layer, a feature no stage can compute locally (MoE router logits),
            weights tied across stages (one line naming both parameters and the fix), or stages that
            do not compute what the whole model computes (``verify``).
    """
    plan = plan_split(model, n_stages, cuts, module_names_per_stage)
    if plan.layout.startswith("hf-"):
        _check_hf_features(model)
    for a, b, sa, sb in tied_across_stages(model, plan):
        if not untie:
            raise ConfigError(f"{a} (stage {sa}) and {b} (stage {sb}) are one tied tensor on two stages, which "
                              f"asynchronous stages cannot share: pass {untie_option} to train two copies (with a warning), "
                              "or untie them in the model (e.g. tie_word_embeddings=False)")
        # logged, not warnings.warn: the command line shows it as its other warnings, without a source line
        log.warning("%s: %s (stage %d) and %s (stage %d) were one tied tensor; each stage now trains its own copy, so "
                    "they drift apart", untie_option, a, sa, b, sb)
    split = SplitModel(model, plan, untie)
    split.probe = verify_split(model, split) if verify else None
    return split


def causal_lm_loss(logits: torch.Tensor, targets: Any) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``
    int64 (already shifted; ``-100`` ignored), or a dict holding them as ``"labels"``."""
    labels = targets["labels"] if isinstance(targets, dict) else targets
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
