"""A Llama-style decoder split into pipeline stages, in one file, read top to bottom.

Differences from GPT-2 (``gpt2.py``): RMSNorm instead of LayerNorm, rotary position embeddings (RoPE)
applied to queries and keys instead of a learned position table, grouped-query attention (GQA: n_kv_head
key/value heads shared by n_head query heads), a SwiGLU feed-forward network with three matrices, and no
biases anywhere. The head may be tied to the token embedding (Llama 3.2 1B/3B) or not (Llama 2, Llama 3 8B).
Stages follow ``gpt2.GPTStage``: a ``LlamaStage`` holds a contiguous range of blocks, the first stage the
token embedding, the last the final RMSNorm and the head.

Notes: docs/architecture.md#modelsllamapy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from unbubble.errors import ConfigError, check_int
from unbubble.models.gpt2 import EMBEDDING_COMPONENT, INIT_STD, allocate_on_cpu, check_stage_args, generator, \
    meta_embedding, refuse_untied_state

# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class LlamaConfig:
    """Shape of a Llama-style decoder.

    Attributes:
        n_layer: number of blocks L (>= 1).
        n_head: query heads per block (>= 1); must divide ``n_embd``.
        n_kv_head: key/value heads (GQA), 1..``n_head``, must divide ``n_head``; ``n_head`` is multi-head
            attention, 1 is multi-query attention.
        n_embd: model width C (>= 1); the head size hs = C / n_head must be even (RoPE rotates pairs).
        hidden: SwiGLU hidden width H (>= 1); 8C/3 keeps the parameters of a 4C GELU MLP.
        block_size: maximum sequence length T (>= 1).
        vocab_size: vocabulary size V, taken from the tokenizer (>= 1).
        rope_theta: RoPE base θ (> 0): pair i of a head rotates by angle t · θ^(-2i/hs) at position t.
            10000 in Llama 2, 500000 in Llama 3.
        norm_eps: RMSNorm ε (> 0).
        tie_embeddings: the head reuses the token embedding on a single stage (untied across stages).

    Raises:
        ConfigError: a non-positive size, a head count that does not divide, an odd head size, or a
            non-positive θ or ε.
    """

    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    hidden: int
    block_size: int
    vocab_size: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "hidden", "block_size", "vocab_size"):
            value = getattr(self, name)
            check_int(name, value)
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise ConfigError(
                f"n_embd={self.n_embd} is invalid: must be n_head={self.n_head} times an even head size "
                f"(RoPE rotates pairs of coordinates)"
            )
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head != 0:
            raise ConfigError(
                f"n_kv_head={self.n_kv_head} is invalid: must divide n_head={self.n_head} "
                f"(each key/value head serves n_head / n_kv_head query heads)"
            )
        for name in ("rope_theta", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be > 0")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection: n_kv_head · hs."""
        return self.n_kv_head * self.head_size


# Shapes without vocab_size (filled from the tokenizer). The CPU presets match GPT-2's at equal parameters:
# attention with n_kv_head = n_head / 2 has 3C² weights and SwiGLU with H = 3C has 9C², GPT-2's 4C² + 8C².
PRESETS: dict[str, dict] = {
    "llama-tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, hidden=384, block_size=128),
    "llama-deep-cpu": dict(n_layer=8, n_head=4, n_kv_head=2, n_embd=64, hidden=192, block_size=64),
    # Llama 3.2 1B (Meta params.json; 1.24B with V = 128256, tied head; trained context 131072)
    "llama-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, hidden=8192, block_size=2048,
                     rope_theta=500_000.0),
    # Llama 3 8B (untied head)
    "llama-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, hidden=14336, block_size=8192,
                     rope_theta=500_000.0, tie_embeddings=False),
}
#: Vocabulary of the published presets when no tokenizer gives one (the simulator): Llama 3's.
PUBLISHED_VOCAB = 128_256


# ----------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_tables(config: LlamaConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, float32.

    Args:
        config: uses ``block_size`` (T), ``head_size`` (hs) and ``rope_theta`` (θ).
        device: where the tables live.

    Returns:
        ``(cos, sin)``, each ``(T, hs/2)``: angle ``t · θ^(-2i/hs)`` for position t and pair i (RoFormer eq. 34).
    """
    hs = config.head_size
    inv_freq = config.rope_theta ** (-torch.arange(0, hs, 2, dtype=torch.float64, device=device) / hs)  # (hs/2,)
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()  # (T, hs/2) each; angles in float64, exact table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+hs/2}) of every head by its position's angle.

    Args:
        x: ``(B, nh, T, hs)`` queries or keys.
        cos, sin: ``(T, hs/2)`` from ``rope_tables`` (at least T rows; the first T are used).

    Returns:
        ``(B, nh, T, hs)``: ``(x1 cos − x2 sin, x1 sin + x2 cos)`` with x1, x2 the two halves of the head.
    """
    T, half = x.size(-2), x.size(-1) // 2
    cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)  # (T, hs/2), broadcast over (B, nh)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


# ----------------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, no biases.

    Args:
        config: uses ``n_embd`` (C), ``n_head`` (nh), ``n_kv_head`` (nkv).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.n_kv_head, config.head_size
        self.wq = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wk = nn.Linear(config.n_embd, config.kv_width, bias=False)
        self.wv = nn.Linear(config.n_embd, config.kv_width, bias=False)
        self.wo = nn.Linear(config.n_embd, config.n_embd, bias=False)  # residual projection

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)`` (normed), cos/sin ``(T, hs/2)``. Returns ``(B, T, C)`` before the residual."""
        B, T, C = x.size()
        q = self.wq(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # query head h reads key/value head h // (nh / nkv) (GQA, arXiv 2305.13245 §2.2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, nh, T, hs) -> (B, T, C)


class SwiGLU(nn.Module):
    """Feed-forward network ``w2(silu(w1 x) * w3 x)``: C -> H (gate and up) -> C (arXiv 2002.05202 eq. 6)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.n_embd, config.hidden, bias=False)  # up
        self.w2 = nn.Linear(config.hidden, config.n_embd, bias=False)  # down, residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``. Returns ``(B, T, C)``, before the residual add."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, H) inside


class Block(nn.Module):
    """``x + attn(norm(x))`` then ``x + ffn(norm(x))``; ``ffn`` is SwiGLU, or a mixture of experts (``moe.py``)."""

    def __init__(self, config: LlamaConfig, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.ffn = SwiGLU(config) if ffn is None else ffn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)``, cos/sin ``(T, hs/2)``. Returns ``(B, T, C)``."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


# ----------------------------------------------------------------------------------------------
# Stage


class LlamaStage(nn.Module):
    """A contiguous slice of the decoder: optional token embedding, blocks ``layers``, optional norm + head.

    Parameter names are global (``wte.weight``, ``h.<j>.attn.wq.weight``, ``norm.weight``, ``lm_head.weight``),
    so the state dicts of all stages of a partition merge into the single-stage one. Built on the CPU in
    float32 without touching the global RNG; see ``gpt2.GPTStage`` for the arguments.

    Args:
        config: model shape.
        layers: global block indices, a non-empty ``range`` with step 1 inside ``0..n_layer``.
        first: owns ``wte``; must equal ``layers.start == 0``.
        last: owns ``norm`` and ``lm_head``; must equal ``layers.stop == n_layer``.
        seed: run seed, 0 <= seed < 2**40.

    Raises:
        ConfigError: as ``gpt2.GPTStage``.
    """

    def __init__(self, config: LlamaConfig, layers: range, first: bool, last: bool, seed: int) -> None:
        super().__init__()
        check_stage_args(config.n_layer, layers, first, last, seed)
        self.config, self.layers, self.first, self.last, self.seed = config, layers, first, last, seed
        with torch.device("meta"):  # allocate nothing and skip PyTorch's default (global-RNG) init
            if first:
                self.wte = meta_embedding(config.vocab_size, config.n_embd)  # (V, C)
            self.h = nn.ModuleDict({str(j): self.make_block(config) for j in layers})
            if last:
                self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # (V, C) weight
        allocate_on_cpu(self)
        self.tied = bool(first and last and config.tie_embeddings)
        if self.tied:
            self.lm_head.weight = self.wte.weight
            self.register_load_state_dict_pre_hook(refuse_untied_state)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T, hs/2), shared by the stage's blocks
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def make_block(self, config: LlamaConfig) -> nn.Module:
        """One block (overridden by ``moe.MoEStage``)."""
        return Block(config)

    @torch.no_grad()
    def init_block(self, block: nn.Module, g: torch.Generator) -> None:
        """Draw one block's weights in a fixed order: wq, wk, wv, wo, then the feed-forward network."""
        resid_std = INIT_STD / math.sqrt(2 * self.config.n_layer)  # GPT-2 §2.3: two residual adds per block
        for linear, std in ((block.attn.wq, INIT_STD), (block.attn.wk, INIT_STD), (block.attn.wv, INIT_STD),
                            (block.attn.wo, resid_std), (block.ffn.w1, INIT_STD), (block.ffn.w3, INIT_STD),
                            (block.ffn.w2, resid_std)):
            linear.weight.normal_(0.0, std, generator=g)
        block.attn_norm.weight.fill_(1.0)
        block.ffn_norm.weight.fill_(1.0)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """See [Note: partition-invariant init] and [Note: untied head] in docs/architecture.md."""
        if self.first:
            self.wte.weight.normal_(0.0, INIT_STD, generator=generator(self.seed, EMBEDDING_COMPONENT))
        for j in self.layers:
            self.init_block(self.h[str(j)], generator(self.seed, j + 1))
        if self.last:
            self.norm.weight.fill_(1.0)
            if not (self.first and self.config.tie_embeddings):
                component = EMBEDDING_COMPONENT if self.config.tie_embeddings else self.config.n_layer + 1
                self.lm_head.weight.normal_(0.0, INIT_STD, generator=generator(self.seed, component))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage.

        Args:
            x: first stage: token ids ``(B, T)`` int64 in ``[0, V)``; other stages: ``(B, T, C)`` hidden states.

        Returns:
            Last stage: logits ``(B, T, V)``; other stages: hidden states ``(B, T, C)``.

        Raises:
            ValueError: T > ``block_size``.
        """
        T = x.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.config.block_size} "
                             f"(set --seq-len ≤ {self.config.block_size}, or pick a --model with more positions)")
        if self.first:
            x = self.wte(x)  # (B, T, C); positions enter through RoPE only
        for block in self.h.values():
            x = block(x, self.rope_cos, self.rope_sin)  # (B, T, C)
        if self.last:
            x = self.lm_head(self.norm(x))  # (B, T, V)
        return x

    def extra_repr(self) -> str:
        return f"layers=[{self.layers.start}, {self.layers.stop}), first={self.first}, last={self.last}"
