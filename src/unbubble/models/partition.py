"""Split a decoder (GPT-2, Llama-style or mixture-of-experts) into N contiguous pipeline stages of balanced
cost, and build them.

The pipeline runs at the pace of its slowest stage, so the split minimises the largest stage cost.
Stage 0 also pays for the embeddings and the last stage for the final LayerNorm and the head, whose
cost 2 * C * V is large for real vocabularies (4.5 blocks of gpt2 at V = 50257, T = 1024): the head
stage then gets fewer blocks.

Costs are estimated forward FLOPs per token (backward is about 2x forward for every component, so the
same split balances forward + backward). Measured per-block costs can be passed to
``partition_by_cost`` instead. A block's matmul FLOPs are 2 per weight-matrix parameter a token passes
through (``block_shape``): for a mixture of experts only the k active experts of E count.

Sources: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", arXiv 2001.08361, Table 1
(per-component forward FLOPs); Chowdhery et al. 2022, "PaLM", arXiv 2204.02311, Appendix B (counts both
attention matmuls, QK^T and AV, giving 4 * T * C rather than Kaplan's 2 * T * C).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from dataclasses import dataclass

from torch import nn

from unbubble.errors import ConfigError, check_int
from unbubble.models.gpt2 import GPTConfig, count_params
from unbubble.models.moe import MoEConfig
from unbubble.models.registry import ModelConfig, stage_class

logger = logging.getLogger(__name__)

_TIE_RTOL = 1e-12  # sums of squares closer than this (relative) count as a tie


@dataclass(frozen=True)
class BlockShape:
    """Parameter counts of one block.

    Attributes:
        params: every parameter (matrices, biases, norm weights).
        matrix_params: weight-matrix parameters (all E experts of a routed layer).
        active_matrix_params: the matrix parameters one token passes through (k of E experts and the router);
            forward FLOPs per token are twice this, plus attention's 4·T·C.
    """

    params: int
    matrix_params: int
    active_matrix_params: int


def block_shape(config: ModelConfig) -> BlockShape:
    """Parameter counts of one block of ``config``'s architecture.

    With C = ``n_embd``, H = ``hidden``, C_kv = ``n_kv_head`` · head size, E experts, k active:

    - GPT-2: matrices 12C² (QKV 3C², output C², MLP 8C²); + 13C biases and LayerNorms with ``bias``, else 2C.
    - Llama: attention 2C² + 2·C·C_kv (GQA), SwiGLU 3CH, two RMSNorm weights 2C.
    - MoE: attention as Llama, router CE, experts E·3CH of which k·3CH are active.
    """
    C = config.n_embd
    if isinstance(config, GPTConfig):
        matrix = 12 * C * C
        return BlockShape(matrix + (13 * C if config.bias else 2 * C), matrix, matrix)
    attention = 2 * C * C + 2 * C * config.kv_width
    ffn = 3 * C * config.hidden
    if isinstance(config, MoEConfig):
        router = C * config.n_expert
        total = attention + router + config.n_expert * ffn
        return BlockShape(total + 2 * C, total, attention + router + config.top_k * ffn)
    return BlockShape(attention + ffn + 2 * C, attention + ffn, attention + ffn)


def embedding_params(config: ModelConfig) -> int:
    """Parameters of the first stage's embeddings: (V + T)·C with GPT-2's learned positions, V·C with RoPE."""
    positions = config.block_size if isinstance(config, GPTConfig) else 0
    return (config.vocab_size + positions) * config.n_embd


def final_norm_params(config: ModelConfig) -> int:
    """Parameters of the final norm: 2C for GPT-2's LayerNorm with bias, C otherwise."""
    return 2 * config.n_embd if isinstance(config, GPTConfig) and config.bias else config.n_embd


def component_costs(config: ModelConfig, seq_len: int | None = None) -> tuple[float, list[float], float]:
    """Estimated forward FLOPs per token of the embedding, each block and the head.

    With C = ``n_embd``, T = ``seq_len`` and V = ``vocab_size`` (a multiply-add counts as 2 FLOPs):

    - block: ``2 * active_matrix_params + 4 * T * C`` (``block_shape``). For GPT-2 this is
      ``24 * C**2 + 4 * T * C``: QKV projection 6C², attention output projection 2C², MLP
      2 * (2 * C * 4C) = 16C² (Kaplan Table 1), plus 2TC for the scores QK^T and 2TC for the weighted
      sum AV (PaLM App. B; causal masking is not discounted, as in both sources; GQA shares K/V heads but
      every query head still attends, so the term is unchanged). Norms, activations, softmax, RoPE and
      the routing bookkeeping are neglected.
    - embedding: ``4 * C`` (Kaplan Table 1): a gather and an add, memory-bound and tiny.
    - head: ``2 * C * V`` (the de-embedding matmul; the final norm is neglected).

    Args:
        config: model shape (GPT-2, Llama or MoE).
        seq_len: sequence length T in tokens, 1..``block_size``; defaults to ``block_size``.

    Returns:
        ``(embedding, [block_0, ..., block_{L-1}], head)`` in FLOPs per token.

    Raises:
        ConfigError: ``seq_len`` outside 1..``block_size``.
    """
    T = _resolve_seq_len(config, seq_len)
    C, V = config.n_embd, config.vocab_size
    block = float(2 * block_shape(config).active_matrix_params + 4 * T * C)
    return float(4 * C), [block] * config.n_layer, float(2 * C * V)


def partition_layers(config: ModelConfig, n_stages: int, seq_len: int | None = None) -> list[range]:
    """Contiguous, cost-balanced split of the ``n_layer`` blocks into ``n_stages`` stages.

    Uses ``component_costs`` and ``partition_by_cost``: minimises the largest stage cost, where stage
    0 adds the embedding cost and the last stage the head cost.

    Args:
        config: model shape.
        n_stages: number of pipeline stages N, 1..``n_layer``.
        seq_len: sequence length T used for the attention term; defaults to ``block_size``.

    Returns:
        N non-empty ``range`` objects of global block indices, in order, covering ``0..n_layer``.

    Raises:
        ConfigError: ``n_stages`` outside 1..``n_layer`` or ``seq_len`` outside 1..``block_size``.
    """
    _check_n_stages(n_stages, config.n_layer)
    embedding, blocks, head = component_costs(config, seq_len)
    return partition_by_cost(blocks, n_stages, first_extra=embedding, last_extra=head)


def partition_for_devices(config: ModelConfig, stage_ranks: Sequence[int], seq_len: int | None = None) -> list[range]:
    """Contiguous split of the blocks into chunks, chunk j placed on device ``stage_ranks[j]``, that
    balances the *devices* (the sum of each device's chunks), for schedules with several chunks per
    device (interleaved, looped, V-shaped): balancing each chunk alone would put the head's chunk
    and its device's other chunk together and leave that device 1.6–1.9× the mean (gpt2-medium,
    N = 8, 16 chunks).

    The first chunk may hold only the embedding and the last only the final norm and head (as the
    Zero Bubble paper's setups do); every other chunk holds at least one block. Blocks go, one at a
    time, to the device whose cost (``component_costs``) is then smallest, and within a device to
    its cheapest chunk; ties go to the lower device and the earlier chunk.

    Args:
        config: model shape (every block has the same cost).
        stage_ranks: the device of each chunk, in pipeline order (``Schedule.ranks``).
        seq_len: sequence length T for the attention term; defaults to ``block_size``.

    Returns:
        ``len(stage_ranks)`` contiguous ``range`` objects covering ``0..n_layer`` (the first and last
        may be empty).

    Raises:
        ConfigError: fewer blocks than the chunks that need one.
    """
    embedding, blocks, head = component_costs(config, seq_len)
    n, L = len(stage_ranks), config.n_layer
    if n == 1:
        return [range(0, L)]
    need = max(n - 2, 0)
    if L < need:
        raise ConfigError(f"stages={len(set(stage_ranks))} with {n} chunks is invalid: the model has {L} layers, "
                          f"fewer than the {need} chunks between the first and the last (set --stages lower or pick a "
                          "deeper --model)")
    blk = blocks[0]
    extra = [0.0] * n
    extra[0] += embedding
    extra[-1] += head
    count = [0 if j in (0, n - 1) else 1 for j in range(n)]
    ranks = sorted(set(stage_ranks))

    def device_cost(r: int) -> float:
        return sum(count[j] * blk + extra[j] for j in range(n) if stage_ranks[j] == r)

    for _ in range(L - sum(count)):
        r = min(ranks, key=lambda x: (device_cost(x) + blk, x))
        j = min((j for j in range(n) if stage_ranks[j] == r), key=lambda j: (count[j] * blk + extra[j], j))
        count[j] += 1
    out, start = [], 0
    for c in count:
        out.append(range(start, start + c))
        start += c
    return out


def partition_by_cost(
    block_costs: Sequence[float],
    n_stages: int,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[range]:
    """Exact minimax contiguous partition of blocks with given costs.

    Stage s costs ``sum(block_costs[stage s]) + first_extra * (s == 0) + last_extra * (s == N-1)``.
    Among splits that reach the smallest possible maximum, the one with the smallest sum of squared
    stage costs is taken (the most even one), and remaining ties go to the split with the fewest
    blocks on the earliest stages (lexicographically smallest block counts): early stages hold the
    most in-flight activations and weight versions in 1F1B-style and asynchronous schedules.

    Cost: two dynamic programmes over (stage, first block), O(N * L²) time plus O(L³) for the segment
    sums; well under a millisecond for L = 48.

    Args:
        block_costs: cost of each block, >= 0 and finite (any unit, e.g. FLOPs/token or seconds).
        n_stages: number of stages N, 1..``len(block_costs)``.
        first_extra: extra cost of stage 0 (embedding), >= 0.
        last_extra: extra cost of stage N-1 (final norm + head), >= 0.

    Returns:
        N non-empty, contiguous ``range`` objects covering ``0..len(block_costs)``.

    Raises:
        ConfigError: ``n_stages`` outside 1..L, or a negative or non-finite cost.
    """
    L = len(block_costs)
    _check_n_stages(n_stages, L)
    for name, value in [("first_extra", first_extra), ("last_extra", last_extra)] + [
        (f"block_costs[{j}]", c) for j, c in enumerate(block_costs)
    ]:
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name}={value!r} is invalid: costs must be finite and >= 0")
    N = n_stages

    # seg[i][j] = cost of blocks i..j-1; fsum is correctly rounded, so equal multisets give equal sums
    seg = [[math.fsum(block_costs[i:j]) if j > i else 0.0 for j in range(L + 1)] for i in range(L + 1)]

    def stage_cost(s: int, i: int, j: int) -> float:
        return seg[i][j] + (first_extra if s == 0 else 0.0) + (last_extra if s == N - 1 else 0.0)

    def ends(s: int, i: int) -> range:
        # stage s takes blocks i..j-1 and leaves at least one block for each of the N-1-s later stages
        return range(i + 1, L - (N - 1 - s) + 1)

    def starts(s: int) -> range:
        return range(s, L - (N - s) + 1)  # stages before s hold at least one block each

    # Phase 1: bottleneck[s][i] = smallest max stage cost of stages s..N-1 covering blocks i..L-1.
    inf = math.inf
    bottleneck = [[inf] * (L + 1) for _ in range(N + 1)]
    bottleneck[N][L] = -inf
    for s in range(N - 1, -1, -1):
        for i in starts(s):
            bottleneck[s][i] = min(max(stage_cost(s, i, j), bottleneck[s + 1][j]) for j in ends(s, i))
    limit = bottleneck[0][0]

    # Phase 2: among splits whose every stage costs <= limit, the smallest sum of squared costs;
    # scanning j upward and replacing only on a strict improvement keeps the earliest (fewest) end.
    sumsq = [[inf] * (L + 1) for _ in range(N + 1)]
    sumsq[N][L] = 0.0
    choice = [[-1] * (L + 1) for _ in range(N)]
    for s in range(N - 1, -1, -1):
        for i in starts(s):
            for j in ends(s, i):
                c = stage_cost(s, i, j)
                if c > limit or sumsq[s + 1][j] == inf:
                    continue
                total = c * c + sumsq[s + 1][j]
                best = sumsq[s][i]
                if best == inf or total < best - _TIE_RTOL * abs(best):
                    sumsq[s][i], choice[s][i] = total, j

    ranges, i = [], 0
    for s in range(N):
        j = choice[s][i]
        ranges.append(range(i, j))
        i = j
    return ranges


def stage_costs(config: ModelConfig, ranges: Sequence[range], seq_len: int | None = None) -> list[float]:
    """Estimated forward FLOPs per token of each stage of a partition (see ``component_costs``).

    Args:
        config: model shape.
        ranges: the stages' block ranges, e.g. from ``partition_layers``.
        seq_len: sequence length T; defaults to ``block_size``.

    Returns:
        One cost per stage, embedding added to stage 0 and head to the last stage.
    """
    embedding, blocks, head = component_costs(config, seq_len)
    costs = [math.fsum(blocks[j] for j in r) for r in ranges]
    costs[0] += embedding
    costs[-1] += head
    return costs


def build_stages(
    config: ModelConfig,
    n_stages: int,
    seed: int,
    seq_len: int | None = None,
    only: int | None = None,
    loss_scale: float = 1.0,
) -> list[nn.Module | None]:
    """Build the stages of the balanced partition (``partition_layers``) of any architecture.

    Weights do not depend on the partition (see [Note: partition-invariant init] in docs/architecture.md); with
    one stage a tied head shares the embedding, otherwise it is untied but starts equal to it.

    Args:
        config: model shape.
        n_stages: number of pipeline stages N, 1..``n_layer``.
        seed: run seed, 0 <= seed < 2**40.
        seq_len: sequence length T used to balance the partition; defaults to ``block_size``.
        only: build just this stage (0-based, 0..N-1) and leave the others ``None``, so a per-stage
            process allocates only its own weights.
        loss_scale: the factor the executor multiplies each micro-batch's loss by (``Schedule.loss_scale``);
            mixture-of-experts stages apply it to their load-balancing loss too ([Note: auxiliary loss through
            the pipeline] in ``moe.py``); other architectures ignore it.

    Returns:
        A list of N entries: ``GPTStage``, ``LlamaStage`` or ``MoEStage`` objects (CPU, float32), or ``None``
        for unbuilt stages.

    Raises:
        ConfigError: ``n_stages``, ``seq_len``, ``seed`` or ``only`` out of range.
    """
    ranges = partition_layers(config, n_stages, seq_len)
    if only is not None:
        check_int("only", only, 0, hi=n_stages - 1,
                  valid=f"with stages={n_stages} the stage index must be in 0..{n_stages - 1}")
    costs = stage_costs(config, ranges, seq_len)
    cls = stage_class(config)
    stages: list[nn.Module | None] = []
    for s, r in enumerate(ranges):
        if only is not None and s != only:
            stages.append(None)
            continue
        extra = {"aux_loss_scale": loss_scale} if isinstance(config, MoEConfig) else {}
        stage = cls(config, r, first=s == 0, last=s == n_stages - 1, seed=seed, **extra)
        logger.debug(
            "stage %d/%d: blocks [%d, %d), %.2fM params, %.3g GFLOP/token forward (%.0f%% of the max)",
            s, n_stages, r.start, r.stop, count_params(stage) / 1e6, costs[s] / 1e9,
            100 * costs[s] / max(costs),
        )
        stages.append(stage)
    return stages


build_gpt_stages = build_stages  # the name from before other architectures existed


def _check_n_stages(n_stages: int, n_layer: int) -> None:
    check_int("stages", n_stages, 1, "set --stages or pick a deeper --model", n_layer,
              valid=f"the model has {n_layer} layers, so stages must be in 1..{n_layer}")


def _resolve_seq_len(config: ModelConfig, seq_len: int | None) -> int:
    if seq_len is None:
        return config.block_size
    check_int("seq_len", seq_len, 1, "set --seq-len or a larger --block-size", config.block_size,
              valid=f"must be in 1..block_size={config.block_size}")
    return seq_len
