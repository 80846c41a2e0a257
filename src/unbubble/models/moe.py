"""A mixture-of-experts decoder: the Llama-style decoder of ``llama.py`` with a routed SwiGLU layer.

Every block's feed-forward network is E SwiGLU experts and a linear router (Mixtral's layout); each
projection of all experts is one 3-D parameter ``(E, out, in)``, so the experts run as batched matmuls and
an optimizer sees a batch of E matrices. Routing and its auxiliary loss through the pipeline:
[Note: auxiliary loss through the pipeline], [Note: router statistics] in docs/architecture.md#modelsmoepy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from unbubble.errors import ConfigError, check_int
from unbubble.models.gpt2 import INIT_STD
from unbubble.models.llama import Block, LlamaConfig, LlamaStage

AUX_LOSS_COEF = 0.01  # Switch Transformer §2.2


@dataclass
class MoEConfig(LlamaConfig):
    """Shape of a mixture-of-experts decoder: ``LlamaConfig`` plus the routed layer.

    Attributes (besides ``LlamaConfig``'s; ``hidden`` is each expert's SwiGLU width H):
        n_expert: experts per block E (>= 1).
        top_k: experts per token k, 1..E (1 or 2 in the presets).
        capacity_factor: assignments an expert may take, as a multiple of the even share k·N/E (> 0), or
            None for no limit (no token is ever dropped). See [Note: expert capacity].
        aux_loss_coef: weight of the load-balancing loss in the training objective (>= 0; 0 disables it).

    Raises:
        ConfigError: as ``LlamaConfig``, or E < 1, k outside 1..E, capacity_factor <= 0, coef < 0.
    """

    n_expert: int = 4
    top_k: int = 2
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = AUX_LOSS_COEF

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_expert", self.n_expert)
        check_int("top_k", self.top_k, 1, hi=self.n_expert, valid=f"must be an integer in 1..n_expert={self.n_expert}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor!r} is invalid: must be > 0, or None for "
                              "no capacity limit")
        if not self.aux_loss_coef >= 0:
            raise ConfigError(f"aux_loss_coef={self.aux_loss_coef!r} is invalid: must be >= 0 (0 disables it)")


# CPU presets at the dense presets' parameter count: E experts of width 3C/E hold SwiGLU's 9C² weights.
PRESETS: dict[str, dict] = {
    "moe-tiny": dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, hidden=96, block_size=128, n_expert=4, top_k=2),
    "moe-deep-cpu": dict(n_layer=8, n_head=4, n_kv_head=2, n_embd=64, hidden=48, block_size=64, n_expert=4,
                         top_k=2),
    # Mixtral 8x7B (arXiv 2401.04088 Table 1; 46.7B parameters, 12.9B active with V = 32000, untied head)
    "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, hidden=14336, block_size=4096,
                         rope_theta=1_000_000.0, tie_embeddings=False, n_expert=8, top_k=2),
}


class AuxLossGrad(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux`` the gradient ``scale``.

    See [Note: auxiliary loss through the pipeline]. Source: Megatron-LM ``MoEAuxLossAutoScaler``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def capacity(config: MoEConfig, n_tokens: int) -> int:
    """Assignments one expert processes per forward of ``n_tokens`` tokens ([Note: expert capacity])."""
    if config.capacity_factor is None:
        return n_tokens
    return min(n_tokens, math.ceil(config.capacity_factor * config.top_k * n_tokens / config.n_expert))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_expert: int) -> torch.Tensor:
    """``E · Σ_e f_e · P_e`` ([Note: load-balancing loss]).

    Args:
        probs: ``(N, E)`` router probabilities (rows sum to 1).
        experts: ``(N, k)`` int64 chosen experts.
        n_expert: E.

    Returns:
        0-dim tensor; 1 for perfectly uniform routing, up to E when every token picks one expert.
    """
    f = torch.bincount(experts.reshape(-1), minlength=n_expert).to(probs.dtype) / experts.numel()  # (E,)
    return n_expert * (f * probs.mean(0)).sum()


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with capacity; returns ``(B, T, C)`` like ``llama.SwiGLU``.

    Parameters: ``router.weight`` ``(E, C)``, ``w1``/``w3`` ``(E, H, C)`` (gate, up), ``w2`` ``(E, C, H)``
    (down, residual projection). Buffers ``routed``/``dropped`` ``(E,)`` int64 ([Note: router statistics]).
    Attribute ``aux_loss_scale`` ([Note: auxiliary loss through the pipeline]), default 1.

    Cost: router 2CE FLOPs per token; experts 6CH per processed assignment, so ≈ k·6CH per token (the
    capacity padding, up to ``capacity_factor``× that, is computed on zeros).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        E, C, H = config.n_expert, config.n_embd, config.hidden
        self.router = nn.Linear(C, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, H, C))  # gate
        self.w3 = nn.Parameter(torch.empty(E, H, C))  # up
        self.w2 = nn.Parameter(torch.empty(E, C, H))  # down
        self.register_buffer("routed", torch.zeros(E, dtype=torch.long))
        self.register_buffer("dropped", torch.zeros(E, dtype=torch.long))
        self.aux_loss_scale = 1.0
        self.last_aux: torch.Tensor | None = None  # the latest forward's aux loss (detached), for tests

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, T, C)`` (normed). Returns ``(B, T, C)``, before the residual add."""
        B, T, C = x.size()
        E, k = self.config.n_expert, self.config.top_k
        xf = x.reshape(-1, C)  # (N, C) tokens
        N = xf.size(0)
        probs = self.router(xf).float().softmax(dim=-1)  # (N, E)
        gates, experts = probs.topk(k, dim=-1)  # (N, k) each, best first
        if k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)  # Mixtral: renormalised over the chosen k
        cap = capacity(self.config, N)
        # [Note: expert capacity]: assignment a = slot·N + token queues at position pos[a] of its expert
        expert_of = experts.t().reshape(-1)  # (kN,)
        onehot = F.one_hot(expert_of, E)  # (kN, E)
        pos = (onehot.cumsum(0) * onehot).sum(-1) - 1  # (kN,) place in its expert's queue
        keep = pos < cap
        token_of = torch.arange(N, device=x.device).repeat(k)  # (kN,)
        row = torch.where(keep, expert_of * cap + pos, E * cap)  # (kN,) row of the expert buffer; E·cap = dropped
        buf = xf.new_zeros(E * cap + 1, C).index_copy_(0, row[keep], xf[token_of[keep]])[:-1].view(E, cap, C)
        h = F.silu(torch.bmm(buf, self.w1.mT)) * torch.bmm(buf, self.w3.mT)  # (E, cap, H)
        out = torch.bmm(h, self.w2.mT).reshape(E * cap, C)  # (E·cap, C)
        out = torch.cat((out, out.new_zeros(1, C)))  # a zero row for dropped assignments
        y = out[row] * gates.t().reshape(-1, 1).to(out.dtype)  # (kN, C), gate-weighted
        y = y.view(k, N, C).sum(0).view(B, T, C)  # each token's k experts, summed in slot order
        if not (self.training and torch.is_grad_enabled()):  # evaluation or a no-grad shape probe
            return y
        with torch.no_grad():  # [Note: router statistics]
            self.routed += torch.bincount(expert_of, minlength=E)
            self.dropped += torch.bincount(expert_of[~keep], minlength=E)
        if self.config.aux_loss_coef > 0:
            aux = load_balancing_loss(probs, experts, E)
            self.last_aux = aux.detach()
            y = AuxLossGrad.apply(y, aux, self.config.aux_loss_coef * self.aux_loss_scale)
        return y


class MoEStage(LlamaStage):
    """A contiguous slice of the mixture-of-experts decoder (see ``llama.LlamaStage``).

    Parameter names as ``LlamaStage`` with ``h.<j>.ffn.router.weight``, ``h.<j>.ffn.w1`` (3-D) etc.

    Args:
        config, layers, first, last, seed: as ``LlamaStage``.
        aux_loss_scale: the executor's loss scale (1/a or 1/m); see [Note: auxiliary loss through the pipeline].
    """

    def __init__(self, config: MoEConfig, layers: range, first: bool, last: bool, seed: int,
                 aux_loss_scale: float = 1.0) -> None:
        super().__init__(config, layers, first, last, seed)
        self.set_aux_loss_scale(aux_loss_scale)

    def make_block(self, config: MoEConfig) -> nn.Module:
        return Block(config, ffn=MoEFeedForward(config))

    def set_aux_loss_scale(self, scale: float) -> None:
        """Sets every routed layer's ``aux_loss_scale``."""
        for block in self.h.values():
            block.ffn.aux_loss_scale = float(scale)

    @torch.no_grad()
    def init_block(self, block: nn.Module, g: torch.Generator) -> None:
        """Draw order: wq, wk, wv, wo, router, w1, w3, w2; router and experts N(0, 0.02), w2 residual-scaled."""
        resid_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        attn, ffn = block.attn, block.ffn
        for weight, std in ((attn.wq.weight, INIT_STD), (attn.wk.weight, INIT_STD), (attn.wv.weight, INIT_STD),
                            (attn.wo.weight, resid_std), (ffn.router.weight, INIT_STD), (ffn.w1, INIT_STD),
                            (ffn.w3, INIT_STD), (ffn.w2, resid_std)):
            weight.normal_(0.0, std, generator=g)
        block.attn_norm.weight.fill_(1.0)
        block.ffn_norm.weight.fill_(1.0)
        ffn.routed.zero_()
        ffn.dropped.zero_()


_COUNTER = re.compile(r"(?:^|\.)h\.(\d+)\.ffn\.(routed|dropped)$")


def router_stats(state: dict[str, torch.Tensor], since: dict[str, torch.Tensor] | None = None) -> dict | None:
    """Load per expert and dropped assignments from the counters in a (merged) state dict.

    Args:
        state: state dict(s) of one or more stages merged, holding ``h.<j>.ffn.routed`` / ``dropped``.
        since: an earlier such dict: the statistics cover what happened in between (None: since init).

    Returns:
        None if ``state`` has no routed layer, else ``{"load": {j: [f_0, ..., f_{E-1}]}, "dropped_frac":
        {j: d}, "max_load": m, "mean_dropped_frac": d̄, "assignments": n}`` with f_e the fraction of block
        j's assignments that went to expert e (uniform: 1/E), d the fraction dropped past capacity,
        m = max over blocks and experts of E·f_e (1 = balanced, E = every token on one expert).
    """
    counts: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        match = _COUNTER.search(name)
        if match:
            before = since.get(name) if since is not None else None
            delta = value.detach().cpu().long() - (before.detach().cpu().long() if before is not None else 0)
            counts.setdefault(int(match.group(1)), {})[match.group(2)] = delta
    if not counts:
        return None
    load, dropped = {}, {}
    for j in sorted(counts):
        routed, drop = counts[j]["routed"], counts[j]["dropped"]
        total = int(routed.sum())
        load[j] = [float(r) / total if total else 0.0 for r in routed.tolist()]
        dropped[j] = float(drop.sum()) / total if total else 0.0
    E = len(next(iter(load.values())))
    return {"load": load, "dropped_frac": dropped, "max_load": max(E * f for fs in load.values() for f in fs),
            "mean_dropped_frac": sum(dropped.values()) / len(dropped),
            "assignments": int(sum(int(c["routed"].sum()) for c in counts.values()))}
