"""Split a model you already have into pipeline stages, by module names (docs/models.md).

Named ``split`` beside ``partition``: ``partition.py`` balances *our* presets' blocks by an estimated
cost and builds their stage classes; this module takes a *foreign* decoder-only causal LM (any
Hugging Face ``*ForCausalLM`` whose decoder layers are one list, a torchtitan-layout model, or any
model with per-stage module names) and cuts it where it stands, without rewriting it.

Notes: [Note: stages keep the model's names], [Note: a stage runs the model's own forward] in
docs/architecture.md#modelssplitpy.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.models.partition import partition_by_cost

log = logging.getLogger(__name__)

#: the layouts :func:`split_model` recognises: a Hugging Face causal LM (any family whose decoder
#: layers are one list), torchtitan's by its module names
LAYOUTS = ("hf", "torchtitan")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which module names each stage owns.

    Attributes:
        layout: one of :data:`LAYOUTS`, or ``"names"`` (given per-stage names: the pruned model's own forward).
        names: per stage, the fully-qualified module names it owns, in order.
        layers: per stage, the original indices of its decoder layers.
        hf: for a Hugging Face model, what the stages need of its forward (:class:`HFTrace`), else None.
    """

    layout: str
    names: tuple[tuple[str, ...], ...]
    layers: tuple[tuple[int, ...], ...]
    hf: "HFTrace | None" = None


@dataclasses.dataclass(frozen=True)
class HFTrace:
    """What one forward of a Hugging Face model showed ([Note: a stage runs the model's own forward]).

    Attributes:
        layers: the decoder-layer list's fully-qualified name (``model.layers``, ``transformer.h``).
        before, after: modules holding parameters (or persistent buffers) outside the layers that
            the forward calls before the first layer (the first stage owns them) or after the last
            (the last stage owns them); a module it never calls goes to the first stage.
        outputs: per such module, ``(name, trailing size, dtype)`` of its tensor output, or
            ``(name, None, None)`` when it returns something else (what its stand-in returns).
        embedding: the input embedding's name (``get_input_embeddings``), or ``""``.
        layer_returns: 0 when a decoder layer returns its hidden states, n when a tuple of n, the
            hidden states first (older families: Falcon, GPT-Neo, MPT).
        layer_input: ``""`` when a layer takes its hidden states as its first positional argument,
            else the keyword the model passes them by.
    """

    layers: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    outputs: tuple[tuple[str, int | None, torch.dtype | None], ...]
    embedding: str
    layer_returns: int
    layer_input: str


def _is_hf(model: nn.Module) -> bool:
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def detect_layout(model: nn.Module) -> str:
    """The layout of ``model``, one of :data:`LAYOUTS`: a Hugging Face model by its ``config``,
    else torchtitan's by its module names.

    Raises:
        ConfigError: a non-HF model of no known layout (names the supported ones).
    """
    if _is_hf(model):
        return "hf"
    names = dict(model.named_children())
    # torchtitan's head is ``output`` up to 0.2.x, ``lm_head`` from 0.3.0 (its Llama3 and MoE models alike)
    if ({"tok_embeddings", "layers", "norm"} <= set(names) and ({"output", "lm_head"} & set(names))
            and isinstance(model.layers, nn.ModuleDict)):
        return "torchtitan"
    raise ConfigError(f"{type(model).__name__} has none of the layouts split_model knows (a Hugging Face causal LM; "
                      "torchtitan: tok_embeddings, layers (ModuleDict), norm, output or lm_head): give "
                      "module_names_per_stage=[[names of stage 0], …]")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _check_hf_features(model: nn.Module) -> None:
    """Refuses, in one line naming the feature, what cannot cross a stage boundary: a stage passes
    on only the hidden states, the padding mask and the position ids."""
    config = model.config
    text = _text_config(config)
    name = f"{config.model_type} ({type(model).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"{name} is an encoder-decoder model: split_model splits decoder-only causal LMs (the "
                          "decoder's layers read the encoder's output, which no stage boundary carries)")
    if getattr(text, "hidden_size_per_layer_input", None):
        raise ConfigError(f"{name} has per-layer input embeddings (hidden_size_per_layer_input="
                          f"{text.hidden_size_per_layer_input}): every layer reads a tensor computed from the token ids "
                          "beside the hidden states, which no stage boundary carries")
    if getattr(text, "num_kv_shared_layers", None):
        raise ConfigError(f"{name} shares keys and values across layers (num_kv_shared_layers="
                          f"{text.num_kv_shared_layers}): a layer reads another layer's keys and values, which no stage "
                          "boundary carries")
    # HF marks each checkpointed module (its is_gradient_checkpointing, deprecated, reads the same marks)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ConfigError(f"{name} has gradient checkpointing on (activation_checkpointing_enable() or "
                          "gradient_checkpointing_enable()): its recomputation "
                          "reruns a stage's layers outside the stage's forward; turn it off and recompute with "
                          "unbubble's recompute='full' (--recompute full)")
    if getattr(config, "output_router_logits", False):
        raise ConfigError(f"{config.model_type} with output_router_logits=True: its load-balancing loss multiplies "
                          "expert counts summed over all layers by router probabilities summed over all layers, so "
                          "no stage can add its share locally (an asynchronous pipeline cannot train it exactly): set "
                          "config.output_router_logits=False")


def _layer_list(model: nn.Module) -> str:
    """The decoder-layer list of an HF model: ``base_model_pp_plan``'s ``layers`` under its
    ``base_model_prefix``, else the outermost ``nn.ModuleList`` of ``num_hidden_layers`` entries.

    Raises:
        ConfigError: a feature no stage boundary carries (:func:`_check_hf_features`), or no decoder-layer list."""
    _check_hf_features(model)
    prefix = getattr(model, "base_model_prefix", "")
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    if "layers" in plan and prefix and isinstance(getattr(model, prefix, None), nn.Module):
        name = f"{prefix}.layers"
        if isinstance(getattr(model.get_submodule(prefix), "layers", None), nn.ModuleList):
            return _check_layer_inputs(model, name)
    n = getattr(_text_config(model.config), "num_hidden_layers", None)
    for fqn, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and n:
            return _check_layer_inputs(model, fqn)
    raise ConfigError(f"{model.config.model_type} ({type(model).__name__}) has no list of decoder layers "
                      f"(an nn.ModuleList of its num_hidden_layers={n} layers): split_model cuts between the layers "
                      "of such a list")


def _check_layer_inputs(model: nn.Module, layers: str) -> str:
    """``layers``, unless its layers read the token embeddings beside the hidden states (Zamba's
    hybrid layers concatenate ``original_hidden_states``): on a later stage those would be the
    embedding's stand-in zeros, a difference too small at initialisation for the probe to see
    (Zamba: 5e-6 in the logits, 0.04 in the weights after 2 updates).

    Raises:
        ConfigError: naming the input."""
    import inspect

    for layer in model.get_submodule(layers):
        if "original_hidden_states" in inspect.signature(layer.forward).parameters:
            raise ConfigError(f"{model.config.model_type} ({type(model).__name__})'s layers read the token embeddings "
                              "beside the hidden states (original_hidden_states), which no stage boundary carries")
    return layers


def _owners(model: nn.Module, layers: str) -> list[str]:
    """Modules outside the decoder layers that hold parameters or persistent buffers themselves."""
    out = []
    for fqn, module in model.named_modules():
        if fqn == layers or fqn.startswith(layers + "."):
            continue
        persistent = [k for k in module._buffers if k not in module._non_persistent_buffers_set]
        if module._parameters or persistent:
            out.append(fqn)
    return out


def trace_hf(model: nn.Module) -> HFTrace:
    """One forward of ``model`` on 4 token ids (no gradients, eval mode; the model is not changed)
    with hooks that record the order of its calls: which modules outside the decoder layers run
    before them (the first stage's) and after them (the last stage's), and how a layer takes and
    returns its hidden states.

    Raises:
        ConfigError: a feature no stage boundary carries (:func:`_check_hf_features`), no decoder-layer
            list, a module with parameters that runs between the layers (used by layers of several
            stages) or contains them, layers that run out of order or twice, or a model whose forward
            fails on the ids.
    """
    layers_name = _layer_list(model)
    layers = model.get_submodule(layers_name)
    owners = _owners(model, layers_name)
    for fqn in owners:
        if fqn == "" or layers_name.startswith(fqn + "."):
            what = type(model.get_submodule(fqn)).__name__
            direct = [*model.get_submodule(fqn)._parameters, *model.get_submodule(fqn)._buffers]
            raise ConfigError(f"{fqn or 'the model'} ({what}) holds parameters itself ({', '.join(direct)}) and "
                              f"contains the decoder layers ({layers_name}): no stage can own them alone")
    events: list[tuple[str, Any]] = []
    shapes: dict[str, tuple[int | None, torch.dtype | None]] = {}
    kinds: list[tuple[int, str]] = []

    def on_layer(i, module, args, kwargs):
        events.append(("layer", i))
        kinds.append((-1, "" if args else "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs), "")))

    def off_layer(i, module, args, kwargs, out):
        n, how = kinds[-1]
        kinds[-1] = (len(out) if isinstance(out, tuple) else 0, how)

    def on_owner(fqn, module, args):
        events.append(("owner", fqn))

    def off_owner(fqn, module, args, out):
        shapes.setdefault(fqn, (out.shape[-1], out.dtype) if isinstance(out, torch.Tensor) and out.dim() else
                          (None, None))

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(functools.partial(on_layer, i), with_kwargs=True))
        hooks.append(layer.register_forward_hook(functools.partial(off_layer, i), with_kwargs=True))
    for fqn in owners:
        module = model.get_submodule(fqn)
        hooks.append(module.register_forward_pre_hook(functools.partial(on_owner, fqn)))
        hooks.append(module.register_forward_hook(functools.partial(off_owner, fqn)))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    vocab = getattr(_text_config(model.config), "vocab_size", None) or 2
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(input_ids=torch.arange(1, 5, device=device).remainder(vocab).unsqueeze(0))
    except Exception as exc:  # noqa: BLE001 - the model's own forward on its own ids
        raise ConfigError(f"{type(model).__name__}'s own forward fails on 4 token ids: {type(exc).__name__}: {exc} "
                          "(split_model runs it once to see which modules run before and after the layers)") from None
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    ran = [i for kind, i in events if kind == "layer"]
    if ran != list(range(len(layers))):
        raise ConfigError(f"{type(model).__name__}'s forward runs the {len(layers)} decoder layers of {layers_name} in "
                          f"the order {ran}: split_model cuts a list the forward runs once each, in order")
    first = events.index(("layer", 0))
    last = len(events) - 1 - events[::-1].index(("layer", ran[-1]))
    before, after = [], []
    for fqn in owners:
        at = [j for j, e in enumerate(events) if e == ("owner", fqn)]
        if any(first < j < last for j in at) or (at and at[0] < first and at[-1] > last):
            raise ConfigError(f"{fqn} ({type(model.get_submodule(fqn)).__name__}) holds parameters and runs between "
                              f"the decoder layers: layers on several stages would share it, which no stage boundary "
                              "carries")
        (after if at and at[0] > last else before).append(fqn)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding = next((fqn for fqn, m in model.named_modules() if m is emb), "") if emb is not None else ""
    returns = {n for n, _ in kinds}
    inputs = {how for _, how in kinds}
    if len(returns) > 1 or len(inputs) > 1:
        raise ConfigError(f"{type(model).__name__}'s decoder layers differ in how they take or return their hidden "
                          f"states (returns {sorted(returns)}, inputs {sorted(inputs)}): split_model needs one way")
    return HFTrace(layers_name, tuple(before), tuple(after),
                   tuple((fqn, *shapes.get(fqn, (None, None))) for fqn in owners), embedding, returns.pop(),
                   inputs.pop())


def _parts(model: nn.Module, layout: str, trace: HFTrace | None = None) \
        -> tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(layer container, first stage's, last stage's, every stage's module names)``; an HF
    model's from its :class:`HFTrace`."""
    if layout == "torchtitan":
        return "layers", ("tok_embeddings",), ("norm", "lm_head" if hasattr(model, "lm_head") else "output"), ()
    return trace.layers, trace.before, trace.after, ()


def count_layers(model: nn.Module) -> int:
    """The decoder layers of a model :func:`split_model` takes (its stages hold 1 … this many).

    Raises:
        ConfigError: a model of no known layout (as :func:`split_model`)."""
    return len(model.get_submodule(layer_container(model)))


def layer_container(model: nn.Module) -> str:
    """The name of the decoder layers' container of a model :func:`split_model` takes (``model.layers``,
    ``transformer.h``, …; torchtitan's ``layers``): a stage's parameter names start with it and a layer index.

    Raises:
        ConfigError: a model of no known layout (as :func:`split_model`)."""
    return _layer_list(model) if detect_layout(model) == "hf" else "layers"


def plan_split(model: nn.Module, n_stages: int | None = None, cuts: Sequence[int] | None = None,
               module_names_per_stage: Sequence[Sequence[str]] | None = None) -> Plan:
    """Which modules each stage owns: embeddings on the first, decoder layers split by cost
    (``partition_by_cost``: the smallest largest stage) or at ``cuts``, final norm and head on the last.

    A module's cost is its :func:`matmul_params` (forward FLOPs per token are about twice it), and the
    last stage's includes the head's V·C: with a large vocabulary the head stage gets fewer layers
    (Llama-3-8B's head costs 2.4 of its layers; splitting by layer parameters alone left that stage
    at 1.3× the others on 4 stages).

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
    trace = trace_hf(model) if layout == "hf" else None
    prefix, first, last, every = _parts(model, layout, trace)
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
        costs = [matmul_params(layers._modules[k]) for k in keys]
        # one sum over each end's modules: a BERT-style head lists cls.predictions and its children
        ends = [matmul_params(*(model.get_submodule(n) for n in names)) for names in (first, last)]
        groups = partition_by_cost(costs, n_stages, first_extra=ends[0], last_extra=ends[1])
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
    return Plan(layout, tuple(names), tuple(idx), trace)


def matmul_params(*modules: nn.Module) -> float:
    """Parameters of ``modules`` a token multiplies with (a tied head's weight included), leaving out
    ``nn.Embedding`` tables: a lookup costs no matmul, while the head's ``(V, C)`` weight costs 2·V·C
    FLOPs per token ([Note: the stage split's costs] in docs/architecture.md). Each parameter counts
    once, however many of the modules hold it (a module and its child, a bias shared by two modules)."""
    numel = {id(p): p.numel() for module in modules for m in module.modules() if not isinstance(m, nn.Embedding)
             for p in m.parameters(recurse=False)}
    return float(sum(numel.values()))


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


class _Handoff(Exception):
    """Raised by the hook on a stage's last layer: ends the model's forward there with its output."""

    def __init__(self, hidden_states: torch.Tensor):
        super().__init__("a stage's last layer ran")
        self.hidden_states = hidden_states


class _Slot:
    """The hidden states a stage received, which the hook on its first layer puts in place of the layer's
    input, and (under ``torch.compile``) those its last layer handed on."""

    def __init__(self):
        self.received: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None


def _receive(slot: _Slot, keyword: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if keyword:
        return args, {**kwargs, keyword: slot.received}
    return (slot.received, *args[1:]), kwargs


def _hand_off(slot: _Slot, module: nn.Module, args: tuple, output: Any) -> None:
    h = output[0] if isinstance(output, tuple) else output
    if torch.compiler.is_compiling():
        # Dynamo breaks the graph where an exception leaves a frame: the forward runs on through the
        # stand-ins instead, and the compiled graph drops what does not lead to the stage's output
        slot.sent = h
        return
    raise _Handoff(h)


class StandInLayer(nn.Module):
    """A decoder layer another stage holds: returns its hidden states unchanged, as the layer returns
    them (the tensor, or a tuple of :attr:`HFTrace.layer_returns` with the tensor first), and keeps
    the layer's plain attributes the model's forward reads (``attention_type``, ``layer_idx``, …).
    No parameters."""

    def __init__(self, layer: nn.Module, returns: int, keyword: str):
        super().__init__()
        plain = (str, int, float, bool, type(None))
        # class-level ones too (Inkling2's attention_type is a class attribute of each layer kind)
        for cls in reversed(type(layer).__mro__[:type(layer).__mro__.index(nn.Module)]):
            for key, value in vars(cls).items():
                if not key.startswith("_") and isinstance(value, plain):
                    setattr(self, key, value)
        for key, value in vars(layer).items():
            if not key.startswith("_") and key != "training" and not isinstance(value, (nn.Module, torch.Tensor)):
                setattr(self, key, value)
        self._returns, self._keyword = returns, keyword

    def forward(self, *args, **kwargs):
        h = kwargs[self._keyword] if self._keyword else args[0]
        return (h, *(None,) * (self._returns - 1)) if self._returns else h


class StandIn(nn.Module):
    """A module outside the layers another stage holds. Before the layers (the token embedding on
    later stages): returns zeros of the trailing size ``size`` the module returns (``(…, C)`` for ids
    ``(…)``, ``(…, C)`` for a float ``(…, C')``), so whatever the model multiplies or adds them to
    stays what the stage's first layer replaces. After the layers (the final norm and head on earlier
    stages, reached only under ``torch.compile``), or where the module returns no tensor
    (``size=None``): returns its first input. No parameters; a zero-size non-persistent buffer follows the
    stage's dtype and device (``.to(torch.bfloat16)``)."""

    def __init__(self, size: int | None, dtype: torch.dtype | None):
        super().__init__()
        self.size = size
        self.register_buffer("like", torch.zeros(0, dtype=dtype or torch.float32), persistent=False)

    def zeros(self, lead: Sequence[int]) -> torch.Tensor:
        return torch.zeros(*lead, self.size, dtype=self.like.dtype, device=self.like.device)

    def forward(self, *args, **kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        if self.size is None or not isinstance(x, torch.Tensor):
            return x
        return self.zeros(x.shape[:-1] if x.is_floating_point() else x.shape)


class HFStage(nn.Module):
    """One stage of a Hugging Face causal LM, running the model's own ``forward``
    ([Note: a stage runs the model's own forward]).

    Args:
        model: a copy of the model in which the modules other stages own are :class:`StandIn` /
            :class:`StandInLayer` (its children become the stage's: its names are the model's).
        trace: the model's :class:`HFTrace`.
        layers: the original indices of this stage's decoder layers (contiguous).
        first, last: whether it holds the embeddings / the final norm and head.

    Input: on the first stage a dict batch (``input_ids`` ``(B, T)`` int64, optional
    ``attention_mask`` ``(B, T)`` 0/1, ``position_ids`` ``(B, T)``, other keyword inputs of the
    model) or the ids tensor; else the previous stage's dict. Output: ``{"hidden_states" (B, T, C),
    "attention_mask", "position_ids", …}`` (the batch's own, ``None`` where it gave none), or the
    logits ``(B, T, V)`` on the last stage.
    """

    def __init__(self, model: nn.Module, trace: HFTrace, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        # not submodules: the stage's state_dict keys are the model's own names
        self.__dict__["_model"], self.__dict__["_slot"] = model, _Slot()
        self.config, self.layer_ids, self.first, self.last = model.config, tuple(layers), first, last
        embedding = model.get_submodule(trace.embedding) if trace.embedding else None
        self.__dict__["_zeros"] = embedding.zeros if isinstance(embedding, StandIn) else None
        container = model.get_submodule(trace.layers)
        if not first:
            container[self.layer_ids[0]].register_forward_pre_hook(
                functools.partial(_receive, self._slot, trace.layer_input), with_kwargs=True)
        if not last:
            container[self.layer_ids[-1]].register_forward_hook(functools.partial(_hand_off, self._slot))

    def train(self, mode: bool = True) -> "HFStage":
        super().train(mode)
        self._model.training = mode
        return self

    def forward(self, x: Any) -> Any:
        if self.first:
            call = dict(x) if isinstance(x, dict) else {"input_ids": x}
            h = None
        else:
            h = x["hidden_states"]
            call = {k: v for k, v in x.items() if k != "hidden_states" and v is not None}
            # the model's embeddings on this stage: zeros, which the first layer's hook replaces
            call["inputs_embeds"] = self._zeros(h.shape[:-1]) if self._zeros is not None else torch.zeros_like(h)
        slot = self._slot
        slot.received = h
        try:
            out = self._model(**call)
        except _Handoff as stop:
            h = stop.hidden_states
        else:
            if self.last:
                return out.logits if hasattr(out, "logits") else out[0]
            h = slot.sent  # compiled: the forward ran on to its end
            if h is None:
                raise RuntimeError(f"stage with layers {self.layer_ids} ran the model's forward to its end without its "
                                   "last layer")
        finally:
            slot.received = slot.sent = None
        carry = {k: v for k, v in call.items() if k not in ("input_ids", "inputs_embeds", "use_cache")}
        return {"hidden_states": h, "attention_mask": carry.pop("attention_mask", None),
                "position_ids": carry.pop("position_ids", None), **carry}


def _hf_stage(meta: nn.Module, plan: Plan, stage: int) -> HFStage:
    """Stage ``stage`` of an HF plan: a copy of the (meta-device) model with stand-ins for what the
    stage does not own (the copy never copies them)."""
    trace, own, mine = plan.hf, set(plan.names[stage]), set(plan.layers[stage])
    memo: dict = {}  # one memo per stage: weights tied within a stage stay one tensor
    for i, layer in enumerate(meta.get_submodule(trace.layers)):
        if i not in mine:
            memo[id(layer)] = StandInLayer(layer, trace.layer_returns, trace.layer_input)
    after = set(trace.after)  # reached only under torch.compile (_hand_off), and then dropped: pass-through
    for name, size, dtype in trace.outputs:
        if name not in own:
            memo[id(meta.get_submodule(name))] = StandIn(None if name in after else size, dtype)
    return HFStage(copy.deepcopy(meta, memo), trace, plan.layers[stage], stage == 0, stage == len(plan.names) - 1)


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
    out = _hf_stage(meta, plan, stage) if plan.layout == "hf" else prune(meta, names)
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
        config_for_export: config values training changed that the model's own config.json keeps
            (``--document-mask`` trains with ``use_cache=False``; the exported model generates with its cache).
    """

    def __init__(self, model: nn.Module, plan: Plan, untie: bool = False):
        self.model, self.plan, self.untie = model, plan, untie
        self.probe: Probe | None = None  # split_model's check (verify_split), when it ran
        self.config_for_export: dict[str, Any] = {}
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
        save_model_files(directory, self.model, self.untie, self.config_for_export)


#: Largest |difference| the probe accepts, relative to max(1, max |logit| of the whole model), by
#: dtype: fp32 chains the same kernels in the same order (measured: 0 on all 145 exact families of
#: docs/models.md), half precision rounds per stage. At 1e-5 a split that fed later layers zeros for the
#: token embeddings (Zamba's hybrid layers) passed at 5e-6 and trained 0.04 apart in 2 updates.
PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 5e-3}


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
    if layout == "hf":
        cfg = _text_config(model.config)
        most = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 64
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        used = any("sliding" in str(t) for t in types) if types else getattr(cfg, "use_sliding_window", True)
        window = window if isinstance(window, int) and used else None
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
    prefix = plan.hf.layers if plan.layout == "hf" else "layers"
    return [f"{prefix}.{layers[-1]}" if layers else None for layers in plan.layers[:-1]]


def verify_split(model: nn.Module, split: "SplitModel") -> Probe:
    """Checks that the chained stages compute what the whole model computes: one
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
    except Exception as exc:  # noqa: BLE001 - the model's own code: one line, not its traceback
        shape = tuple((inputs["input_ids"] if isinstance(inputs, dict) else inputs).shape)
        raise ConfigError(f"{type(model).__name__}'s own forward fails on the probe batch of {shape[0]}×{shape[1]} "
                          f"tokens: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (pass "
                          "verify=False to split it unchecked)") from None
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    whole = whole.logits if hasattr(whole, "logits") else whole
    dtype = whole.dtype
    tol = PROBE_TOLERANCE.get(dtype, 1e-6) * max(1.0, float(whole.abs().max()))
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
        model: a Hugging Face causal LM (``*ForCausalLM``, ``GPT2LMHeadModel``: its decoder layers one list;
            each stage runs its own forward, [Note: a stage runs the model's own forward]), a torchtitan-layout model
            (``tok_embeddings``, ``layers`` as a ``ModuleDict``, ``norm``, ``output``; its own ``forward``
            must skip modules that are ``None``), or any model with ``module_names_per_stage``.
        n_stages: N: layers split by cost (:func:`plan_split`: the head's V·C counts on the last stage).
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
        ConfigError: an unknown layout, a bad stage count or cut, names that drop, repeat or reorder a
            layer, a feature no stage boundary carries (:func:`trace_hf`: per-layer input embeddings,
            keys and values shared across layers, MoE router logits, encoder-decoder, no layer list),
            weights tied across stages (one line naming both parameters and the fix), or stages that
            do not compute what the whole model computes (``verify``).
    """
    plan = plan_split(model, n_stages, cuts, module_names_per_stage)
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


#: The folder beside a run's checkpoints that describes its model, and the file in it naming the class
#: and the tied tensors (read by ``unbubble.export``).
MODEL_DIR = "model"
MODEL_INFO = "unbubble-model.json"


def save_model_files(directory: str | Path, model: torch.nn.Module, untied: bool,
                     config_for_export: dict[str, Any] | None = None) -> None:
    """Writes ``directory/model/`` once: an HF model's ``config.json`` (with ``config_for_export``'s
    values), and :data:`MODEL_INFO` (the model class and, with ``untied``, the names of each tensor the
    model ties, which :func:`unbubble.export.untied_names` reads). A model that is neither HF nor
    untied gets nothing."""
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
        config, changes = model.config, dict(config_for_export or {})
        if untied and getattr(config, "tie_word_embeddings", False):
            changes["tie_word_embeddings"] = False
        if changes:
            config = type(config).from_dict({**config.to_dict(), **changes})
        config.save_pretrained(out)
    cls = type(model)
    (out / MODEL_INFO).write_text(json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}", "tied": tied}) + "\n")
