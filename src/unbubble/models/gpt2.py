"""GPT-2 split into pipeline stages, in one file, read top to bottom.

The model is the GPT-2 decoder: pre-LN blocks (LayerNorm -> causal self-attention -> residual,
LayerNorm -> 4x MLP with tanh-GELU -> residual), learned positional embeddings, a final LayerNorm and a
linear language-model head. A ``GPTStage`` holds a contiguous range of blocks; the first stage also owns
the embeddings and the last stage the final LayerNorm and the head, so composing the stages of any
partition gives the whole model.

Notes: [Note: partition-invariant init], [Note: untied head] in docs/architecture.md#modelsgpt2py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from unbubble.errors import ConfigError, check_int, did_you_mean

logger = logging.getLogger(__name__)

INIT_STD = 0.02  # GPT-2 / nanoGPT: N(0, 0.02) for every Linear and Embedding weight
_SEED_STRIDE = 100_003  # prime > any n_layer, so (seed, component) -> seed is injective
_MAX_SEED = 2**40  # keeps seed * _SEED_STRIDE + component far below 2**63


# ----------------------------------------------------------------------------------------------
# Blocks


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (GPT-2 ``attn``), fused QKV projection.

    Args:
        config: model shape; uses ``n_embd`` (C), ``n_head`` (nh), ``bias`` and ``dropout``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # residual projection
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend causally over the sequence.

        Args:
            x: ``(B, T, C)`` float hidden states (already layer-normed).
            mask: ``None`` (causal over the whole row), or a ``(B, 1, T, T)`` bool mask, True where a
                query may attend a key (:func:`document_mask`: causal within each packed document).

        Returns:
            ``(B, T, C)`` attention output, before the residual add.
        """
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C), heads concatenated
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU (tanh approximation, as GPT-2) -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 uses the tanh form of GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)  # residual proj.
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``, before the residual add."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, 4C) inside


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))`` (GPT-2 §2.3)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Args: x ``(B, T, C)``; mask as :meth:`CausalSelfAttention.forward`. Returns ``(B, T, C)``."""
        x = x + self.attn(self.ln_1(x), mask)
        x = x + self.mlp(self.ln_2(x))
        return x


# ----------------------------------------------------------------------------------------------
# Config and presets


@dataclass
class GPTConfig:
    """Shape of a GPT-2 style model.

    Attributes:
        n_layer: number of transformer blocks L (>= 1).
        n_head: attention heads per block (>= 1); must divide ``n_embd``.
        n_embd: model width C (>= 1).
        block_size: maximum sequence length T, i.e. rows of the positional embedding (>= 1).
        vocab_size: vocabulary size V, taken from the tokenizer (>= 1).
        bias: whether Linear and LayerNorm layers have biases (GPT-2: True).
        dropout: dropout probability in [0, 1) for attention weights and residual branches. 0 for
            pre-training small models; >0 costs speed and makes runs depend on the global RNG.

    Raises:
        ConfigError: on a non-positive size, ``n_embd % n_head != 0`` or dropout outside [0, 1).
    """

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    bias: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            check_int(name, value)
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"n_embd={self.n_embd} is invalid: must be divisible by n_head={self.n_head} "
                f"(remainder {self.n_embd % self.n_head}; pick another width or head count)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout!r} is invalid: must be in [0, 1) (set --dropout)")


# Shapes without vocab_size (filled from the tokenizer). GPT-2 sizes from OpenAI's released hparams.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),  # CPU default: 0.8M params + 128 * V
    "small-cpu": dict(n_layer=6, n_head=8, n_embd=256, block_size=256),
    "deep-cpu": dict(n_layer=8, n_head=4, n_embd=64, block_size=64),  # 8 stages of one block: N=8 experiments on a CPU
    "deep32-cpu": dict(n_layer=32, n_head=2, n_embd=32, block_size=32),  # up to 32 stages: delay-scaling experiments
    "wide-cpu": dict(n_layer=8, n_head=4, n_embd=128, block_size=64),  # deep-cpu at twice the width: does the delay gap shrink?
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M with V=50257
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
}


def make_config(preset: str, vocab_size: int, block_size: int | None = None) -> GPTConfig:
    """Build a ``GPTConfig`` from a named preset.

    Args:
        preset: one of ``PRESETS`` ("tiny", "small-cpu", "gpt2", "gpt2-medium", ...).
        vocab_size: V, the tokenizer's vocabulary size (50257 for GPT-2 BPE, 256 for bytes).
        block_size: overrides the preset's maximum sequence length T when given.

    Returns:
        The validated config.

    Raises:
        ConfigError: unknown preset (the message lists the valid names) or invalid sizes.
    """
    if preset not in PRESETS:
        raise ConfigError(
            f"model={preset!r} is invalid{did_you_mean(preset, PRESETS)}: must be one of {', '.join(PRESETS)} (set --model)"
        )
    kwargs = dict(PRESETS[preset])
    if block_size is not None:
        kwargs["block_size"] = block_size
    return GPTConfig(**kwargs, vocab_size=vocab_size)


# ----------------------------------------------------------------------------------------------
# Deterministic, partition-invariant initialisation. See [Note: partition-invariant init].

EMBEDDING_COMPONENT = 0  # component id of wte/wpe (and of the untied head, see [Note: untied head])


def component_seed(seed: int, component: int) -> int:
    """Seed of the generator for one component: ``seed * 100_003 + component``.

    Args:
        seed: run seed, 0 <= seed < 2**40.
        component: ``EMBEDDING_COMPONENT`` (0) for the embeddings and head, ``j + 1`` for block j.
    """
    return seed * _SEED_STRIDE + component


def generator(seed: int, component: int) -> torch.Generator:
    """A CPU generator seeded with ``component_seed(seed, component)`` (shared by every model family)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(component_seed(seed, component))
    return g


def allocate_on_cpu(module: nn.Module) -> nn.Module:
    """Gives every meta-device parameter and buffer of ``module`` uninitialised CPU storage of its
    shape and dtype (what ``module.to_empty(device="cpu")`` does), in place; returns ``module``.

    ``to_empty`` goes through ``torch.empty_like`` of meta tensors, whose Python reference
    implementation imports sympy (~37 MiB per stage process, [Note: eager stage processes without
    Dynamo] in ``runtime/lazy_dynamo.py``); ``torch.empty`` of the shape needs nothing.
    """
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu") if t.is_meta else t)


def meta_embedding(num: int, dim: int) -> nn.Embedding:
    """An ``(num, dim)`` ``nn.Embedding`` without PyTorch's default init, for use under
    ``torch.device("meta")``: ``normal_`` of a meta tensor imports torch._dynamo and sympy (0.8 s of
    CPU, ~70 MiB) in every process that builds a first stage; the weights are filled later anyway."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


@torch.no_grad()
def _init_block(block: Block, config: GPTConfig, g: torch.Generator) -> None:
    """Initialise one block from its generator, in a fixed draw order (c_attn, attn.c_proj, c_fc,
    mlp.c_proj). Weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2 * n_layer)) (GPT-2 §2.3,
    nanoGPT: two residual adds per block), biases 0, LayerNorm weight 1 and bias 0."""
    resid_std = INIT_STD / math.sqrt(2 * config.n_layer)
    for linear, std in (
        (block.attn.c_attn, INIT_STD),
        (block.attn.c_proj, resid_std),
        (block.mlp.c_fc, INIT_STD),
        (block.mlp.c_proj, resid_std),
    ):
        linear.weight.normal_(0.0, std, generator=g)
        if linear.bias is not None:
            linear.bias.zero_()
    for ln in (block.ln_1, block.ln_2):
        _init_layernorm(ln)


@torch.no_grad()
def _init_layernorm(ln: nn.LayerNorm) -> None:
    ln.weight.fill_(1.0)
    if ln.bias is not None:
        ln.bias.zero_()


# ----------------------------------------------------------------------------------------------
# Stage


class GPTStage(nn.Module):
    """A contiguous slice of GPT-2: optional embeddings, blocks ``layers``, optional final norm + head.

    Parameter names are global, so the state dicts of all stages of a partition merge into the
    single-stage one: ``wte.weight``, ``wpe.weight``, ``h.<j>.attn.c_attn.weight`` (j is the global
    block index), ``ln_f.weight``, ``lm_head.weight``.

    The stage is built on the CPU in float32; move it with ``.to(device)`` afterwards. Building does
    not consume the global RNG (modules are created on the meta device, then filled from per-component
    generators; see [Note: partition-invariant init]).

    Args:
        config: model shape.
        layers: global indices of the blocks this stage owns, a non-empty ``range`` with step 1 inside
            ``0..n_layer``.
        first: owns ``wte``/``wpe`` and takes token ids; must equal ``layers.start == 0``.
        last: owns ``ln_f``/``lm_head`` and returns logits; must equal ``layers.stop == n_layer``.
        seed: run seed, 0 <= seed < 2**40; the same seed gives the same weights for any partition.
        tie: a single stage (``first and last``) ties ``lm_head.weight`` to ``wte.weight`` as GPT-2
            does; ``tie=False`` keeps them two tensors, the whole model of a multi-stage run (whose
            head trained apart from the embedding: [Note: untied head]; ``unbubble.export.load``).

    Raises:
        ConfigError: ``layers`` empty, out of bounds or with step != 1, ``first``/``last`` inconsistent
            with ``layers``, or a bad seed. ``load_state_dict`` of a tied stage raises ConfigError
            for a state dict whose ``wte.weight`` and ``lm_head.weight`` differ (trained untied:
            :func:`refuse_untied_state`).

    Memory: ``count_params(stage) * 4`` bytes of float32 weights; a single stage (``first and last``)
    ties ``lm_head.weight`` to ``wte.weight`` as GPT-2 does (unless ``tie=False``), otherwise the head
    is a separate V x C matrix (see [Note: untied head]).
    """

    def __init__(self, config: GPTConfig, layers: range, first: bool, last: bool, seed: int,
                 tie: bool = True) -> None:
        super().__init__()
        check_stage_args(config.n_layer, layers, first, last, seed)
        self.config = config
        self.layers = layers
        self.first = first
        self.last = last
        self.seed = seed

        with torch.device("meta"):  # allocate nothing and skip PyTorch's default (global-RNG) init
            if first:
                self.wte = meta_embedding(config.vocab_size, config.n_embd)  # token embedding (V, C)
                self.wpe = meta_embedding(config.block_size, config.n_embd)  # position embedding (T, C)
                self.drop = nn.Dropout(config.dropout)
            # keyed by the global block index so names match across partitions
            self.h = nn.ModuleDict({str(j): Block(config) for j in layers})
            if last:
                self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # (V, C) weight
        allocate_on_cpu(self)
        self.tied = bool(first and last and tie)
        if self.tied:
            self.lm_head.weight = self.wte.weight  # GPT-2 weight tying, only possible on one stage
            self.register_load_state_dict_pre_hook(refuse_untied_state)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Fill every parameter from its component's generator. See [Note: partition-invariant init]."""
        if self.first:
            g = generator(self.seed, EMBEDDING_COMPONENT)
            self.wte.weight.normal_(0.0, INIT_STD, generator=g)  # drawn first: the head replays this
            self.wpe.weight.normal_(0.0, INIT_STD, generator=g)
        for j in self.layers:
            _init_block(self.h[str(j)], self.config, generator(self.seed, j + 1))
        if self.last:
            _init_layernorm(self.ln_f)
            if not self.tied:  # untied head = replay of the wte draw. See [Note: untied head].
                g = generator(self.seed, EMBEDDING_COMPONENT)
                self.lm_head.weight.normal_(0.0, INIT_STD, generator=g)

    def forward(self, x: torch.Tensor | dict) -> torch.Tensor | dict:
        """Run this stage.

        Args:
            x: first stage: token ids ``(B, T)`` int64 in ``[0, V)``; other stages: hidden states
                ``(B, T, C)`` float32 from the previous stage. T <= ``block_size``. Packed documents
                (``--document-mask``): the first stage takes ``{"input_ids", "position_ids"}`` (positions
                restarting at 0 where a document starts), the others ``{"hidden_states", "position_ids"}``;
                each document then attends only within itself and reads its own positions.

        Returns:
            Last stage: logits ``(B, T, V)``; other stages: hidden states ``(B, T, C)``, or
            ``{"hidden_states", "position_ids"}`` for packed documents.

        Raises:
            ValueError: T > ``block_size``.
        """
        packed = isinstance(x, dict)
        pos = x["position_ids"] if packed else None
        if packed:
            x = x["input_ids"] if self.first else x["hidden_states"]
        T = x.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length T={T} exceeds block_size={self.config.block_size} "
                f"(set --seq-len ≤ {self.config.block_size}, or pick a --model with more positions)"
            )
        if self.first:
            at = pos if packed else torch.arange(T, dtype=torch.long, device=x.device)  # (B, T) or (T,)
            x = self.drop(self.wte(x) + self.wpe(at))  # (B, T, C) + (B or 1, T, C) -> (B, T, C)
        mask = document_mask(pos) if packed else None
        for block in self.h.values():
            x = block(x, mask)  # (B, T, C)
        if self.last:
            return self.lm_head(self.ln_f(x))  # (B, T, V)
        return {"hidden_states": x, "position_ids": pos} if packed else x

    def extra_repr(self) -> str:
        return f"layers=[{self.layers.start}, {self.layers.stop}), first={self.first}, last={self.last}"


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed documents: a query attends to the keys at or before it in its own
    document, a document starting wherever the position ids restart at 0 (and at the row's start), as
    Hugging Face reads packed rows from ``position_ids`` (``masking_utils.find_packed_sequence_indices``).

    Args:
        position_ids: ``(B, T)`` int64, 0 at each document's first token.

    Returns:
        ``(B, 1, T, T)`` bool, True where attention is allowed.
    """
    doc = (position_ids == 0).cumsum(dim=1)  # (B, T): which document each token belongs to
    T = position_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def refuse_untied_state(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A ``load_state_dict`` pre-hook of a stage that ties ``lm_head.weight`` to ``wte.weight``:
    a state dict in which the two differ was trained untied (any multi-stage run: [Note: untied
    head]), and loading it would silently keep only one of them.

    Raises:
        ConfigError: both names are in ``state_dict`` with different values.
    """
    emb, head = state_dict.get(prefix + "wte.weight"), state_dict.get(prefix + "lm_head.weight")
    if emb is None or head is None or emb is head or emb.shape != head.shape or emb.is_meta or head.is_meta:
        return
    if not torch.equal(emb.detach().cpu(), head.detach().cpu().to(emb.dtype)):
        raise ConfigError(f"this state dict holds {prefix}wte.weight and {prefix}lm_head.weight as two different "
                          f"tensors (trained untied), but this {type(module).__name__} ties them: loading would keep "
                          "only one; build the model untied (unbubble.export.load builds it for you)")


def check_stage_args(n_layer: int, layers: range, first: bool, last: bool, seed: int) -> None:
    """Validates the arguments of a stage of a model with ``n_layer`` blocks (every model family).

    Raises:
        ConfigError: ``layers`` empty, out of bounds or with step != 1, ``first``/``last`` inconsistent
            with ``layers``, too many layers for the seed scheme, or a bad seed.
    """
    if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
        raise ConfigError(f"layers={layers!r} is invalid: must be a non-empty range with step 1")
    if layers.start < 0 or layers.stop > n_layer:
        raise ConfigError(
            f"layers=range({layers.start}, {layers.stop}) is invalid: the model has "
            f"{n_layer} layers, so layers must lie inside range(0, {n_layer})"
        )
    if n_layer >= _SEED_STRIDE - 1:
        raise ConfigError(f"n_layer={n_layer} is invalid: must be < {_SEED_STRIDE - 1}")
    if bool(first) != (layers.start == 0):
        raise ConfigError(
            f"first={first} is invalid for layers starting at {layers.start}: the stage holding "
            f"block 0 and only that stage owns the embeddings"
        )
    if bool(last) != (layers.stop == n_layer):
        raise ConfigError(
            f"last={last} is invalid for layers ending at {layers.stop}: the stage holding block "
            f"{n_layer - 1} and only that stage owns the head"
        )
    check_int("seed", seed, 0, "set --seed", _MAX_SEED - 1, valid="must be an integer in 0..2**40-1")


# ----------------------------------------------------------------------------------------------
# Loss and helpers


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B * T positions, in nats.

    Args:
        logits: ``(B, T, V)`` float, the last stage's output.
        targets: ``(B, T)`` int64 token ids in ``[0, V)`` (inputs shifted left by one); ``-100``
            marks a position not counted (a packed document's EOS, ``--document-mask``).

    Returns:
        Scalar tensor. At init it is close to ``ln(V)`` (logits are near zero).
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


def count_params(module: nn.Module) -> int:
    """Number of distinct parameters (elements) of ``module``; a tied weight counts once."""
    return sum(p.numel() for p in module.parameters())
