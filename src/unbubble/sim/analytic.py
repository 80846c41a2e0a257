"""Analytic cost model: durations and memory of every stage from a model shape and a hardware preset.

Models: GPT-2, Llama-style and mixture-of-experts presets (``unbubble.models.registry``) and the Zero Bubble
paper's GPT-3-like shapes. Parameter counts per block come from ``unbubble.models.partition.block_shape``
(a mixture of experts holds all E experts but a token computes with k of them).

Notes: docs/architecture.md#simanalyticpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unbubble.errors import ConfigError, check_int, did_you_mean
from unbubble.sim.costs import PipelineCosts, StageCosts, Straggler
from unbubble.sim.hardware import Hardware
from unbubble.sim.memory import MemorySpec

if TYPE_CHECKING:
    from unbubble.models.registry import ModelConfig

#: GPT-3-like models of the Zero Bubble paper's experiments (arXiv 2401.10241, §5.1, Table 3): layers,
#: heads, width, sequence length, pipeline depth, micro-batch size and micro-batch counts. Vocabulary:
#: GPT-2 BPE padded by Megatron-LM to a multiple of 128 (50304).
ZB_MODELS: dict[str, dict] = {
    "zb-1.5b": dict(n_layer=22, n_head=24, n_embd=2304, block_size=1024, stages=8, micro_batch_size=6, m=(24, 32, 64)),
    "zb-6.2b": dict(n_layer=30, n_head=32, n_embd=4096, block_size=1024, stages=8, micro_batch_size=3, m=(24, 32, 64)),
    "zb-14.6b": dict(n_layer=46, n_head=40, n_embd=5120, block_size=1024, stages=16, micro_batch_size=1,
                     m=(48, 64, 128)),
    "zb-28.3b": dict(n_layer=62, n_head=48, n_embd=6144, block_size=1024, stages=32, micro_batch_size=1,
                     m=(96, 128, 256)),
}
ZB_VOCAB = 50304


def model_names() -> list[str]:
    """Names ``--model`` accepts: the presets of ``unbubble.models.registry`` and :data:`ZB_MODELS`."""
    from unbubble.models.registry import PRESETS

    return list(PRESETS) + list(ZB_MODELS)


def make_model(name: str, vocab_size: int | None = None, seq_len: int | None = None) -> "ModelConfig":
    """A model shape by name.

    Args:
        name: a preset of ``unbubble.models.registry`` (``tiny`` … ``gpt2-xl``, ``llama-tiny`` … ``llama-8b``,
            ``moe-tiny``, ``mixtral-8x7b`` …) or a Zero Bubble model (``zb-1.5b`` … ``zb-28.3b``).
        vocab_size: V (default: the published model's, 50257 for GPT-2, 128256 for Llama 3, 32000 for
            Mixtral; 50304 for the Zero Bubble models).
        seq_len: block size T (default: the preset's).

    Raises:
        ConfigError: unknown name (the message lists the valid ones) or invalid sizes.
    """
    from unbubble.models.gpt2 import GPTConfig
    from unbubble.models.registry import PRESETS, make_config

    for option, value in (("seq_len", seq_len), ("vocab_size", vocab_size)):  # named as the user typed them
        if value is not None:
            check_int(option, value, 1, f"set --{option.replace('_', '-')}")
    if name in ZB_MODELS:
        z = ZB_MODELS[name]
        return GPTConfig(n_layer=z["n_layer"], n_head=z["n_head"], n_embd=z["n_embd"],
                         block_size=seq_len or z["block_size"], vocab_size=vocab_size or ZB_VOCAB)
    if name not in PRESETS:
        raise ConfigError(f"model={name!r} is unknown{did_you_mean(name, model_names())}: valid models are {', '.join(model_names())} (set --model)")
    return make_config(name, vocab_size, seq_len)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter and per moved parameter (mixed-precision Adam by default: ``--precision bf16``).

    Attributes:
        weight_bytes: compute copy of a parameter (BF16: 2).
        grad_bytes: gradient accumulation buffer (FP32: 4).
        optimizer_bytes: FP32 master weight + Adam's two moments (12).
        activation_bytes: bytes per activation element sent between stages (BF16: 2), which is
            also what a stage keeps per element of its input under recomputation.
        update_bytes_per_param: device-memory traffic of one Adam step per parameter: read the
            gradient (4), read and write master weight and moments (24), write the BF16 copy (2).
        saved_scale: multiplies Korthikanti's 16-bit activation count (2 for FP32 tensors; the
            formula's 1-byte dropout masks are then overcounted, a small overestimate).
        compute_factor: multiplies every compute duration (FP32 matmuls run as TF32, whose dense
            peak is half the BF16 one on A100, H100 and H200: 156/312, 494.7/989.5 TFLOP/s).
        weight_copy_bytes: bytes per weight-matrix parameter that every in-flight micro-batch
            holds (``bf16-autocast`` saves its own BF16 cast of each matrix: 2).
    """

    weight_bytes: float = 2.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 12.0
    activation_bytes: float = 2.0
    update_bytes_per_param: float = 30.0
    saved_scale: float = 1.0
    compute_factor: float = 1.0
    weight_copy_bytes: float = 0.0


#: ``--precision`` → :class:`Precision` (the runtime's modes, ``unbubble.runtime.precision``). fp32:
#: 4-byte weights and gradients, Adam moments 8, update traffic 4 + 8 + 16; bf16-autocast: the same
#: state, BF16 compute, a BF16 weight copy per in-flight micro-batch, and FP32 activations between
#: stages (the residual stream adds BF16 matmul outputs to FP32 inputs).
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(4.0, 4.0, 8.0, 4.0, 28.0, saved_scale=2.0, compute_factor=2.0),
    "bf16-autocast": Precision(4.0, 4.0, 8.0, 4.0, 28.0, weight_copy_bytes=2.0),
    "bf16": Precision(),
}


def get_precision(name: str) -> Precision:
    """The :class:`Precision` of a ``--precision`` mode.

    Raises:
        ConfigError: unknown name (the message lists the modes).
    """
    if name not in PRECISIONS:
        raise ConfigError(f"precision={name!r} is invalid{did_you_mean(name, PRECISIONS)}: must be one of {', '.join(PRECISIONS)} (set --precision)")
    return PRECISIONS[name]


@dataclass(frozen=True)
class AnalyticModel:
    """Costs and memory of one pipelined model on one hardware type.

    Attributes:
        costs: per-stage durations (s) and links, ready for ``run_policies``.
        memory: per-stage sizes (bytes) for ``peak_memory``.
        stage_layers: block indices of each stage (N·v stages when interleaved; may be empty for a stage
            holding only the embedding or the head).
        params: parameters per stage.
        tokens_per_mb: tokens in one micro-batch (b·s).
        samples_per_mb: sequences in one micro-batch (b).
        model_flops_per_mb: F + B FLOPs of the whole model for one micro-batch (for MFU).
        hardware: the preset used.
        n_ranks: devices (stage s runs on rank s mod n_ranks).
    """

    costs: PipelineCosts
    memory: MemorySpec
    stage_layers: tuple[range, ...]
    params: tuple[int, ...]
    tokens_per_mb: int
    samples_per_mb: int
    model_flops_per_mb: float
    hardware: Hardware
    n_ranks: int


def zb_layers_per_stage(n_layer: int, n_stages: int) -> list[int]:
    """The Zero Bubble paper's split: the first and last stage hold one block less than the others
    (they also hold the embedding and the loss), i.e. ``n_layer = k·N − 2`` (arXiv 2401.10241, §5.1).

    Raises:
        ConfigError: ``n_layer + 2`` is not a multiple of ``n_stages`` (or N < 2).
    """
    if n_stages < 2 or (n_layer + 2) % n_stages:
        raise ConfigError(f"layers={n_layer} cannot be split as k·N − 2 over stages={n_stages}: "
                          "give --layers-per-stage or use the balanced split")
    k = (n_layer + 2) // n_stages
    return [k - 1] + [k] * (n_stages - 2) + [k - 1]


def analytic_model(config: "ModelConfig", n_stages: int, hardware: Hardware, micro_batch_size: int,
                   seq_len: int | None = None, *, virtual: int = 1, layers_per_stage: Sequence[int] | None = None,
                   precision: Precision = Precision(), flash_attention: bool = False, jitter: float = 0.0,
                   seed: int = 0, stragglers: Sequence[Straggler] = (), recompute: bool = False,
                   predict_weights: bool = False, error_feedback: bool = False,
                   placement: str = "loop") -> AnalyticModel:
    """Builds the per-stage costs and memory sizes of ``config`` split over ``n_stages · virtual`` stages.

    Args:
        config: model shape (``GPTConfig``, ``LlamaConfig`` or ``MoEConfig``).
        n_stages: devices N ≥ 1.
        hardware: the device type (``unbubble.sim.hardware``).
        micro_batch_size: sequences per micro-batch b ≥ 1.
        seq_len: tokens per sequence s (default ``config.block_size``).
        virtual: stages per device (interleaved 1F1B, V-shaped schedules); stage j runs on device j mod N,
            or with ``placement="v"`` (v = 2) on device min(j, 2N − 1 − j): the links follow it.
        layers_per_stage: blocks of each of the N·v stages in pipeline order (zeros allowed for the first
            and last stage, which then hold only the embedding or the head); default: the cost-balanced
            contiguous split of ``unbubble.models.partition.partition_layers``, or with several chunks per
            device ``partition_for_devices`` (the devices balanced, not the chunks).
        precision: bytes per parameter and activation (:data:`PRECISIONS`).
        flash_attention: attention scores are not stored (drops Korthikanti's 5as² term).
        jitter, seed, stragglers: passed to :class:`~unbubble.sim.costs.PipelineCosts`.
        recompute: full activation recomputation: a stage keeps its input per micro-batch (token ids,
            8 bytes each, on the first stage; s·b·h activations otherwise) and every backward
            re-runs the forward first (``PipelineCosts.with_recompute``, ``MemorySpec.with_recompute``).
        predict_weights: weight prediction (``--predict-weights``): two weight-sized buffers per stage
            (the last applied update and the live weights during a predicted forward) as ``extra_bytes``.
        error_feedback: error feedback (``--error-feedback``): two fp32 buffers per parameter of the
            stage (the last uncorrected update and the weights before a step, shaped like the fp32
            tensors the optimizer steps), added to ``extra_bytes``.

    Returns:
        The :class:`AnalyticModel`.

    Raises:
        ConfigError: sizes out of range, or ``layers_per_stage`` that does not sum to ``n_layer``.
    """
    from unbubble.models.partition import (block_shape, component_costs, embedding_params, final_norm_params,
                                           partition_for_devices, partition_layers)

    for name, v in (("stages", n_stages), ("micro_batch_size", micro_batch_size), ("virtual", virtual)):
        check_int(name, v, 1, f"set --{name.replace('_', '-')}")
    n = n_stages * virtual
    T = config.block_size if seq_len is None else seq_len
    emb_f, block_f, head_f = component_costs(config, T)  # forward FLOPs per token; validates seq_len
    if layers_per_stage is None and virtual == 1:
        ranges = partition_layers(config, n, T)
    elif layers_per_stage is None:  # several chunks per device: balance the devices, not the chunks
        from unbubble.schedules.registry import stage_rank

        ranges = partition_for_devices(config, [stage_rank(j, n_stages, placement) for j in range(n)], T)
    else:
        counts = list(layers_per_stage)
        if len(counts) != n or any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != config.n_layer:
            raise ConfigError(f"layers_per_stage={counts} is invalid: need {n} counts ≥ 0 summing to "
                              f"n_layer={config.n_layer}")
        if any(c == 0 for c in counts[1:-1]):
            raise ConfigError(f"layers_per_stage={counts} is invalid: only the first and last stage may be empty")
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        ranges = [range(starts[j], starts[j + 1]) for j in range(n)]
    h, V, b, a = config.n_embd, config.vocab_size, micro_batch_size, config.n_head
    tokens = b * T
    sbh = tokens * h
    p = precision
    shape = block_shape(config)
    block_params = shape.params
    block_mat = shape.active_matrix_params  # weight-matrix parameters a token uses (W: 2 FLOPs per token each)
    attn = 0 if flash_attention else 5 * a * T
    sc = p.saved_scale
    block_mb, block_mw = sc * tokens * (34 * h + attn), sc * 32 * sbh  # bytes, Korthikanti §4.1 / ZB Table 1

    stages, params, mem = [], [], {"w": [], "g": [], "o": [], "a": [], "aw": []}
    for j, r in enumerate(ranges):
        first, last = j == 0, j == n - 1
        fwd = sum(block_f[i] for i in r) + (emb_f if first else 0.0) + (head_f if last else 0.0)
        wmat = len(r) * block_mat + (h * V if last else 0)
        f_s = fwd * tokens / hardware.flops * p.compute_factor
        b_s = 2 * f_s
        w_s = 2 * wmat * tokens / hardware.flops * p.compute_factor
        n_params = len(r) * block_params
        if first:
            n_params += embedding_params(config)
        if last:  # final norm; the head is untied across stages (and in models that never tie it)
            n_params += final_norm_params(config) + (h * V if n > 1 or not getattr(config, "tie_embeddings", True) else 0)
        u_s = n_params * p.update_bytes_per_param / hardware.hbm_bytes_per_s
        stages.append(StageCosts(f_s, b_s, b_s - w_s, w_s, u_s))
        params.append(n_params)
        act = len(r) * block_mb + (sbh if first else 0)  # + the embedding's dropout mask (Korthikanti §4.3)
        act_w = len(r) * block_mw
        if last:
            act += sc * 4 * sbh + 4 * tokens * V  # the logits are FP32 in every mode
            act_w += sc * 2 * sbh + 2 * tokens * V
        act += wmat * p.weight_copy_bytes  # autocast's BF16 weight copies, held like activations
        mem["w"].append(n_params * p.weight_bytes)
        mem["g"].append(n_params * p.grad_bytes)
        mem["o"].append(n_params * p.optimizer_bytes)
        mem["a"].append(float(act))
        mem["aw"].append(float(min(act_w, act)))

    msg = tokens * h * p.activation_bytes
    lat, bw = [], []
    from unbubble.schedules.registry import stage_rank

    for j in range(n - 1):
        la, bwj = hardware.link(stage_rank(j, n_stages, placement), stage_rank(j + 1, n_stages, placement))
        lat.append(la)
        bw.append(bwj)
    costs = PipelineCosts(tuple(stages), message_bytes=float(msg) if n > 1 else 0.0,
                          bandwidth_bytes_per_s=tuple(bw) if n > 1 else math.inf,
                          latency_s=tuple(lat) if n > 1 else 0.0, jitter=jitter, seed=seed,
                          stragglers=tuple(stragglers))
    # weight prediction: two buffers like the weights; error feedback: two fp32 buffers per parameter
    extra = tuple(2.0 * w * predict_weights + 8.0 * n_p * error_feedback for w, n_p in zip(mem["w"], params))
    memory = MemorySpec(tuple(mem["w"]), tuple(mem["g"]), tuple(mem["o"]), tuple(mem["a"]), tuple(mem["aw"]),
                        extra_bytes=extra if predict_weights or error_feedback else (),
                        capacity_bytes=hardware.memory_bytes)
    if recompute:
        inputs = tuple(float(tokens * 8 if j == 0 else sbh * p.activation_bytes) for j in range(n))
        memory = memory.with_recompute(tuple(min(x, a) for x, a in zip(inputs, memory.act_bytes)))
        costs = costs.with_recompute()
    model_flops = 3 * tokens * (emb_f + sum(block_f) + head_f)
    return AnalyticModel(costs, memory, tuple(ranges), tuple(params), tokens, b, model_flops, hardware, n_stages)
