"""Every causal-LM family the installed transformers registers, as a tiny random-init model with its
distinctive features switched on, and the unsplit model's own training loop as the reference its
split is checked against (docs/models.md, "Every family of the installed transformers").

A family is a ``model_type`` of ``transformers``' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Its tiny
config is the config class's defaults shrunk generically (:data:`SMALL`: 4 layers, hidden 32, vocab
256, 4 experts, low-rank dims of 8, …; per-layer lists such as ``layer_types`` re-patterned to 4
layers keeping every kind the default mixes) plus a per-family override (:data:`OVERRIDES`) that
switches on what the family adds (sliding windows, multipliers, soft-caps, …; :data:`FEATURES`
names them and gives the override that switches each off, so a test can check it changes the logits).

Nothing here depends on ``unbubble``: :func:`train_unsplit` is the independent reference (the
model's own ``forward``, ``torch.nn.functional.cross_entropy``, one ``torch.optim.AdamW``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable

import torch
from torch import nn

#: layers of every tiny model (1F1B-flush is checked on 2 and 4 stages)
N_LAYERS = 4
#: vocabulary of every tiny model
VOCAB = 256
#: sliding window (shorter than :data:`SEQ`, so a forgotten window changes late positions)
WINDOW = 4
#: micro-batch: rows × tokens
ROWS, SEQ = 2, 12

#: config field -> its tiny value, applied when the family's config has the field
SMALL: dict[str, Any] = {
    # sizes
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": N_LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "n_embd": 32, "n_layer": N_LAYERS, "n_head": 4, "n_positions": 64, "n_inner": 64, "n_ctx": 64,
    "num_layers": N_LAYERS, "num_heads": 4, "d_model": 32, "embedding_dim": 32, "num_blocks": N_LAYERS,
    "ffn_dim": 64, "n_layers": N_LAYERS, "n_heads": 4, "dim_ff": 64, "dff": 64, "d_inner": 64,
    "ffn_hidden_size": 64, "attention_hidden_size": 32, "kv_channels": 8, "num_kv_heads": 2,
    "intermediate_size_mlp": 64, "dense_intermediate_size": 64, "mlp_only_intermediate_size": 64,
    "first_dense_intermediate_size": 64, "prefix_dense_intermediate_size": 64, "context_length": 64,
    "max_seq_len": 64, "seq_length": 64, "rotary_dim": 4, "d_head": 8, "dim_head": 8,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "top_k_experts": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "shared_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16, "shared_experts_intermediate_size": 16,
    "expert_ffn_hidden_size": 16, "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "num_expert_group": 2, "first_k_dense_replace": 1, "num_dense_layers": 1,
    "output_router_logits": False, "router_jitter_noise": 0.0, "input_jitter_noise": 0.0,
    # multi-head latent attention
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "o_lora_rank": 16, "o_groups": 2,
    # sparse-attention indexers
    "index_topk": 4, "index_head_dim": 8, "index_n_heads": 2, "indexer_n_heads": 2, "indexer_head_dim": 8,
    "indexer_kv_heads": 1, "index_num_heads": 2,
    # linear attention, state-space and convolution mixers
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4, "linear_conv_kernel_dim": 4,
    "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_n_groups": 1, "mamba_chunk_size": 8, "mamba_d_ssm": 64, "mamba_headdim": 16, "mamba_num_heads": 4,
    "mamba_head_dim": 16, "mamba_ngroups": 1, "ssm_state_size": 8, "state_size": 8, "chunk_size": 8,
    "n_mamba_heads": 4, "time_step_rank": 4, "mamba_dt_rank": 4, "expand": 2, "conv_kernel": 4, "n_groups": 1,
    "num_codebooks": 2,
    # other attention variants' sizes
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": WINDOW,
    "d_rel": 4, "rel_extent": 16, "unpadded_vocab_size": VOCAB, "n_layers_per_attn_res_block": 2,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "laurel_rank": 4,
    "pronunciation_vocab_size": 32, "shape_vocab_size": 32, "pronunciation_embed_dim": 8, "shape_embed_dim": 8,
    "emb_dim": 32, "decoder_layers": N_LAYERS, "decoder_attention_heads": 4, "decoder_ffn_dim": 64,
    "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "ple_embed_dim": 8, "hc_lowrank": 8,
    # no dropout, no noise: the split and the unsplit model draw no random numbers
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    "dropout": 0.0, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "activation_dropout": 0.0,
    "embedding_dropout": 0.0, "residual_dropout": 0.0, "emb_pdrop": 0.0,
    "resid_dropout": 0.0, "embed_dropout": 0.0, "mlp_dropout": 0.0, "dropout_p": 0.0, "layerdrop": 0.0,
    "decoder_layerdrop": 0.0, "encoder_layerdrop": 0.0,
    # an encoder family's causal-LM head is its encoder run causally
    "is_decoder": True,
    # attention windows, chunks and layer mixes shorter than SEQ (so forgetting one changes late positions)
    "sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2, "attention_window_size": WINDOW,
    "attention_chunk_size": WINDOW, "local_attention_window_len": WINDOW, "window_size": WINDOW,
    # whatever the real checkpoint does, a tiny model keeps its own head (split_model refuses tied weights)
    "tie_word_embeddings": False,
}

#: config field -> (feature, value that switches it on, value that switches it off), applied when the family's
#: config has the field (even where its default leaves the feature off: Mistral-style windows, soft-caps)
FEATURE_FIELDS: dict[str, tuple[str, Any, Any]] = {
    "sliding_window": ("sliding window", WINDOW, 64),
    "attention_chunk_size": ("chunked attention", WINDOW, 64),
    "final_logit_softcapping": ("final-logit soft-cap", 1.0, None),
    "attn_logit_softcapping": ("attention soft-cap", 1.0, None),
    "logit_scale": ("logit scale", 0.25, 1.0),
    "logits_scaling": ("logit scaling", 4.0, 1.0),
    "embedding_multiplier": ("embedding multiplier", 4.0, 1.0),
    "residual_multiplier": ("residual multiplier", 0.5, 1.0),
    "attention_multiplier": ("attention multiplier", 0.5, 1.0),
    "lm_head_multiplier": ("head multiplier", 0.5, 1.0),
    "scale_emb": ("embedding scale", 4.0, 1.0),
    "embedding_scale": ("embedding scale", 4.0, 1.0),
    "query_pre_attn_scalar": ("query scalar", 2, 8),
}

#: family -> config fields that switch its distinctive features on (beyond :data:`SMALL`)
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [1, 3]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "use_mamba_kernels": False},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"] * 2},
    "lfm2": {"layer_types": ["conv", "full_attention"] * 2, "full_attn_idxs": [1, 3]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 2},
    "dory": {"n_input_layers": 1, "n_output_layers": 1},
    "zamba": {"attention_hidden_size": 64},  # its shared attention reads [hidden, embeddings]
    "zamba2": {"attention_hidden_size": 64},
    "deepseek_v2": {"num_experts_per_tok": 2, "topk_group": 1, "n_group": 2},
    "dots3_note_text": {"num_key_value_heads": 4, "per_layer_config": None, "head_dim": 16},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gemma3n_text": {"num_kv_shared_layers": 2, "altup_num_inputs": 2},
    "gemma4_text": {"per_layer_config": None},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "mamba2": {"num_heads": 4, "head_dim": 16},
    "kolibri1_1": {"head_dim": 16},
    "zaya": {"num_experts_per_tok": 1},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "xlstm": {"mode": "train", "chunk_size": 4, "hidden_size": 128, "embedding_dim": 128, "num_heads": 8},
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [3, 4], "local_attn_chunk_length": 4,
                 "lsh_attn_chunk_length": 4, "num_hashes": 1, "num_buckets": 2},
    "dbrx": {"d_model": 32, "n_heads": 4, "n_layers": N_LAYERS, "max_seq_len": 64,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
}

#: family -> what to do to the built model before it runs (Xmod needs a language)
AFTER_BUILD: dict[str, Callable[[nn.Module], None]] = {
    "xmod": lambda model: model.set_default_language("en_XX"),
}

#: families of the mapping that are not text decoders, beyond what :func:`not_a_decoder` reads off the config
NOT_A_DECODER: dict[str, str] = {
    "fuyu": "multimodal (image patches into a Persimmon decoder)",
    "gemma4_assistant": "speculative-decoding drafter (reads the target model's hidden states)",
    "gemma4_unified_assistant": "speculative-decoding drafter (reads the target model's hidden states)",
}

#: family -> [(feature, config fields that switch it off)]: each must change the logits
FEATURES: dict[str, list[tuple[str, dict[str, Any]]]] = {}


def causal_lm_types() -> list[str]:
    """The ``model_type`` of every causal LM the installed transformers registers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


#: the most parameters a tiny model may have (a config :data:`SMALL` does not shrink is not built)
MAX_PARAMS = 2_000_000


def not_a_decoder(model_type: str) -> str | None:
    """Why ``model_type`` is not a text decoder to split (an encoder-decoder; a composite config whose
    text decoder is registered on its own or that feeds it images/audio), or ``None``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in NOT_A_DECODER:
        return NOT_A_DECODER[model_type]
    d = _defaults(model_type)
    if d.get("is_encoder_decoder"):
        return "encoder-decoder"
    subs = sorted(getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {})
    text = f"{model_type}_text"
    if "text_config" in subs and text in causal_lm_types():
        return f"composite config: its text decoder is {text}"
    if {"vision_config", "audio_config", "vq_config", "audio_encoder_config", "patcher_config"} & set(subs):
        return "multimodal composite (" + ", ".join(subs) + ")"
    return None


def model_class(model_type: str) -> type:
    """The ``*ForCausalLM`` class transformers registers for ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


@functools.lru_cache(maxsize=None)
def _defaults(model_type: str) -> dict[str, Any]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return cls().to_dict()
        except Exception:  # noqa: BLE001 - defaults that do not validate together (gemma4_assistant's)
            return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _layer_count(d: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks"):
        if isinstance(d.get(key), int):
            return d[key]
    return None


def _repattern(values: list, n: int) -> list:
    """A per-layer list shrunk to ``n`` layers keeping every kind it mixes: its first ``n`` entries
    if they hold every distinct value, else the distinct values in turn (Gemma3's five sliding
    layers then one full become sliding, full, sliding, full)."""
    kinds = list(dict.fromkeys(map(repr, values)))
    head = values[:n]
    if len(set(map(repr, head))) == len(kinds):
        return head
    by_repr = {repr(v): v for v in values}
    return [copy.deepcopy(by_repr[kinds[i % len(kinds)]]) for i in range(n)]


def tiny_fields(model_type: str) -> dict[str, Any]:
    """The config fields of ``model_type``'s tiny model (what differs from its config class's defaults)."""
    d = _defaults(model_type)
    # a field whose default is None is a feature the family leaves off (an indexer, experts): not switched on here
    out = {k: v for k, v in SMALL.items() if k in d and (d[k] is not None or k in ("head_dim", "num_key_value_heads"))}
    out.update({k: on for k, (_, on, _) in FEATURE_FIELDS.items() if k in d})
    if "kv_lora_rank" in d:  # multi-head latent attention: every head its own keys and values
        out["num_key_value_heads"] = out["num_attention_heads"]
    n0 = _layer_count(d)
    if n0:
        for key, value in d.items():
            if isinstance(value, list) and len(value) == n0 and n0 != N_LAYERS and key not in out:
                # one kind throughout: left to the config, which derives it from the switches above
                # (Qwen2's use_sliding_window and max_window_layers)
                out[key] = _repattern(value, N_LAYERS) if len(set(map(repr, value))) > 1 else None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in d and d[key] is not None:
            out[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    out.update(OVERRIDES.get(model_type, {}))
    return out


def tiny_config(model_type: str, **extra):
    """The tiny config of ``model_type`` (eager attention), ``extra`` fields on top."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its notes on fields a family ignores
        try:
            cfg = CONFIG_MAPPING[model_type](**{**tiny_fields(model_type), **extra})
        finally:
            transformers.logging.set_verbosity(verbosity)
        cfg._attn_implementation = "eager"
    return cfg


def tiny_model(model_type: str, seed: int = 0, guard: bool = True, **extra) -> nn.Module:
    """A random-init tiny causal LM of ``model_type`` (fp32, CPU, train mode); with ``guard`` it is first
    built on the meta device and refused above :data:`MAX_PARAMS` (a config left large)."""
    cfg = tiny_config(model_type, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = 0
        if guard:
            with torch.device("meta"):
                n = sum(p.numel() for p in model_class(model_type)(cfg).parameters())
        if n > MAX_PARAMS:
            raise ValueError(f"the tiny {model_type} has {n:,} parameters (> {MAX_PARAMS:,}): its config keeps a "
                             "large size under a field SMALL does not shrink")
        torch.manual_seed(seed)
        model = model_class(model_type)(cfg)
    if model_type in AFTER_BUILD:
        AFTER_BUILD[model_type](model)
    return model.float().train()


def takes_attention_mask(model: nn.Module) -> bool:
    return "attention_mask" in inspect.signature(model.forward).parameters


def batch(k: int, padding: bool = True, vocab: int = VOCAB) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Micro-batch k: ``({"input_ids" (ROWS, SEQ)[, "attention_mask"]}, labels (ROWS, SEQ))``, labels
    already shifted; with ``padding`` row 0 left-padded by 2 + k mod 3 (mask 0, label -100)."""
    g = torch.Generator().manual_seed(1000 + k)
    ids = torch.randint(3, vocab, (ROWS, SEQ + 1), generator=g)  # 0–2 are the special ids
    x, y = {"input_ids": ids[:, :-1]}, ids[:, 1:].clone()
    if padding:
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        mask[0, :2 + k % 3] = 0
        x["attention_mask"] = mask
        y[mask == 0] = -100
    return x, y


def train_unsplit(model: nn.Module, steps: int, m: int, batch_fn: Callable[[int], tuple[dict, torch.Tensor]],
                  lr: float = 1e-2) -> tuple[nn.Module, list[float]]:
    """The reference: a copy of ``model`` trained the ordinary way on one torch thread —
    ``model(**x).logits``, ``torch.nn.functional.cross_entropy`` (fp32, ``-100`` ignored), the mean
    over ``m`` micro-batches per update, one ``torch.optim.AdamW(lr, weight_decay=0.1)``.

    Returns:
        ``(trained copy, mean loss per update)``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = copy.deepcopy(model).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        losses = []
        for t in range(steps):
            total = 0.0
            for k in range(t * m, (t + 1) * m):
                x, y = batch_fn(k)
                logits = model(**x).logits
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
                (loss / m).backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total / m)
        return model, losses
    finally:
        torch.set_num_threads(threads)


def features(model_type: str) -> list[tuple[str, dict[str, Any]]]:
    """``model_type``'s distinctive features switched on in its tiny config, each ``(name, the config
    fields that switch it off)``: :data:`FEATURE_FIELDS` it has, per-layer kinds (``layer_types``:
    off = every layer full attention), mixtures of experts (off = one expert per token)."""
    fields = tiny_fields(model_type)
    cfg = tiny_config(model_type)
    d = _defaults(model_type)
    out = [(name, {k: off}) for k, (name, _, off) in FEATURE_FIELDS.items() if k in d]
    for key in ("layer_types", "layers_block_type", "block_types", "attn_layers"):
        kinds = getattr(cfg, key, None)
        if isinstance(kinds, list) and len(set(map(str, kinds))) > 1:
            kinds = list(kinds)
            out.append((f"{key}: " + "/".join(dict.fromkeys(map(str, kinds))), {key: [kinds[-1]] * len(kinds)}))
    for key in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"):
        if fields.get(key, 1) > 1:
            out.append((f"MoE ({fields.get(key)} of 4 experts)", {key: 1}))
            break
    if "kv_lora_rank" in fields:
        out.append(("MLA", {}))
    if "no_rope_layers" in fields:
        out.append(("no-rope layers", {"no_rope_layers": [1] * N_LAYERS}))
    return out


def feature_changes_logits(model_type: str, off: dict[str, Any], model: nn.Module | None = None) -> float | None:
    """Largest |logit difference| between the tiny model and the same weights with ``off`` applied
    (None when ``off`` cannot be applied: an unbuildable config or other shapes)."""
    model = model if model is not None else tiny_model(model_type)
    try:
        plain = tiny_model(model_type, guard=False, **off)
        plain.load_state_dict(model.state_dict())
    except Exception:  # noqa: BLE001 - the switch changes shapes: not comparable
        return None
    x, _ = batch(0, takes_attention_mask(model))
    with torch.no_grad():
        return float((model.eval()(**x).logits - plain.eval()(**x).logits).abs().max())
