"""GPT-2 stages and the balanced partition: composition, partition-invariant init, costs, errors."""

from __future__ import annotations

import math
import re

import pytest
import torch

from unbubble.errors import ConfigError
from unbubble.models import (
    PRESETS,
    GPTConfig,
    GPTStage,
    build_gpt_stages,
    component_costs,
    count_params,
    gpt_loss,
    make_config,
    partition_by_cost,
    partition_layers,
    stage_costs,
)

VOCAB = 257  # bytes + EOS


def _tiny(block_size: int = 32) -> GPTConfig:
    return make_config("tiny", VOCAB, block_size=block_size)


def _run(stages, idx):
    x = idx
    for stage in stages:
        x = stage(x)
    return x


def _tokens(config: GPTConfig, B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, T + 1), generator=g)


# ---------------------------------------------------------------------------------------------
# Composition and partition-invariant init


@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_stages_compose_to_single_stage_logits(n_stages):
    config = _tiny()
    (whole,) = build_gpt_stages(config, 1, seed=7)
    stages = build_gpt_stages(config, n_stages, seed=7)
    idx = _tokens(config)[:, :-1]
    with torch.no_grad():
        ref = whole(idx)
        out = _run(stages, idx)
    assert ref.shape == (2, 16, VOCAB)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # the intermediate hidden state after stage 0 matches the whole model's after the same blocks
    with torch.no_grad():
        h = stages[0](idx)
        x = whole.drop(whole.wte(idx) + whole.wpe(torch.arange(16)))
        for j in stages[0].layers:
            x = whole.h[str(j)](x)
    assert h.shape == (2, 16, config.n_embd) and h.dtype == torch.float32
    torch.testing.assert_close(h, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_stages", [2, 3])
def test_stage_parameters_bit_identical_to_single_stage(n_stages):
    config = _tiny()
    whole_params = dict(build_gpt_stages(config, 1, seed=3)[0].named_parameters())
    seen = set()
    for stage in build_gpt_stages(config, n_stages, seed=3):
        for name, p in stage.named_parameters():
            ref = whole_params["wte.weight" if name == "lm_head.weight" else name]
            assert torch.equal(p, ref), name
            seen.add(name)
    # every parameter of the whole model appears somewhere, plus the untied head
    assert seen == set(whole_params) | {"lm_head.weight"}


def test_single_stage_ties_head_and_multi_stage_unties_it():
    config = _tiny()
    (whole,) = build_gpt_stages(config, 1, seed=0)
    assert whole.lm_head.weight is whole.wte.weight
    first, last = build_gpt_stages(config, 2, seed=0)
    assert not hasattr(first, "lm_head") and not hasattr(last, "wte")
    assert last.lm_head.weight.data_ptr() != first.wte.weight.data_ptr()
    assert torch.equal(last.lm_head.weight, first.wte.weight)  # starts equal (untied head note)
    # tied head counted once: whole = stage params summed minus the duplicated V x C head
    n_head = config.vocab_size * config.n_embd
    assert count_params(first) + count_params(last) - n_head == count_params(whole)


def test_different_seeds_differ_and_global_rng_untouched():
    config = _tiny()
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_gpt_stages(config, 2, seed=0)[1]
    after = torch.rand(3)  # building consumed nothing from the global RNG
    b = build_gpt_stages(config, 2, seed=1)[1]
    assert torch.equal(before, after)
    assert not torch.equal(a.h["3"].attn.c_attn.weight, b.h["3"].attn.c_attn.weight)
    # blocks are drawn from different streams
    assert not torch.equal(a.h["2"].mlp.c_fc.weight, a.h["3"].mlp.c_fc.weight)


def test_build_only_one_stage():
    config = _tiny()
    stages = build_gpt_stages(config, 3, seed=5, only=1)
    assert stages[0] is None and stages[2] is None
    full = build_gpt_stages(config, 3, seed=5)
    assert stages[1].layers == full[1].layers
    for (n1, p1), (n2, p2) in zip(stages[1].named_parameters(), full[1].named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    msg = "only=3 is invalid: with stages=3 the stage index must be in 0..2"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        build_gpt_stages(config, 3, seed=5, only=3)


def test_init_statistics():
    config = make_config("gpt2", 50257)  # one real-size block: c_proj is 768 x 3072
    stage = GPTStage(config, range(5, 6), first=False, last=False, seed=0)
    block = stage.h["5"]
    resid_std = 0.02 / math.sqrt(2 * 12)  # 0.00408
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(resid_std, rel=0.1)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(resid_std, rel=0.1)
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert block.attn.c_attn.weight.mean().abs().item() < 1e-4
    assert torch.count_nonzero(block.mlp.c_fc.bias) == 0
    assert torch.equal(block.ln_1.weight, torch.ones(768)) and torch.count_nonzero(block.ln_1.bias) == 0


def test_param_count_gpt2_matches_known_size():
    # GPT-2 small with tied head: 124,439,808 parameters (nanoGPT counts 124.44M incl. wpe)
    config = make_config("gpt2", 50257)
    C, L, V, T = 768, 12, 50257, 1024
    per_block = 12 * C * C + 13 * C  # weights + biases + 2 LayerNorms
    assert V * C + T * C + L * per_block + 2 * C == 124_439_808
    stage = GPTStage(config, range(0, 1), first=True, last=False, seed=0)
    assert count_params(stage) == V * C + T * C + per_block


def test_loss_at_init_and_training_reduces_loss():
    torch.manual_seed(0)
    config = _tiny()
    stages = build_gpt_stages(config, 2, seed=0)
    data = _tokens(config, B=4, T=32, seed=2)
    idx, targets = data[:, :-1], data[:, 1:]
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(12):
        loss = gpt_loss(_run(stages, idx), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # near-uniform at init: ln 257 = 5.549, plus ~0.05 because logits have std 0.02 * sqrt(C) = 0.23
    # and the head (equal to wte) favours the input token itself
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)
    assert losses[-1] < losses[0] - 1.0, losses  # memorising a fixed batch


def test_gpt_loss_matches_manual_cross_entropy():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # (1, 2, 3)
    targets = torch.tensor([[0, 2]])
    expected = (-math.log(math.e**2 / (math.e**2 + 2)) + math.log(3)) / 2
    assert gpt_loss(logits, targets).item() == pytest.approx(expected, rel=1e-6)


def test_sequence_longer_than_block_size_raises():
    config = _tiny(block_size=8)
    (whole,) = build_gpt_stages(config, 1, seed=0)
    with pytest.raises(ValueError, match=re.escape("sequence length T=9 exceeds block_size=8")):
        whole(torch.zeros(1, 9, dtype=torch.long))


def test_dropout_path_runs_in_train_mode():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11, dropout=0.1)
    (whole,) = build_gpt_stages(config, 1, seed=0)
    whole.train()
    out = whole(torch.zeros(2, 8, dtype=torch.long))
    assert out.shape == (2, 8, 11) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# Costs and partition


def test_component_costs_formula():
    config = GPTConfig(n_layer=3, n_head=2, n_embd=8, block_size=16, vocab_size=10)
    emb, blocks, head = component_costs(config, seq_len=4)
    assert emb == 4 * 8
    assert blocks == [24 * 64 + 4 * 4 * 8] * 3  # 1664
    assert head == 2 * 8 * 10
    assert component_costs(config)[1][0] == 24 * 64 + 4 * 16 * 8  # default T = block_size


def test_partition_hand_computed_case():
    # C=64, T=64: block b = 24*64^2 + 4*64*64 = 114688; V=1344 makes the head 2*64*1344 = 1.5 b.
    config = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=1344)
    _, blocks, head = component_costs(config)
    assert blocks[0] == 114688 and head == 1.5 * 114688
    # 2 stages: (3,1) costs max(3b + 256, 2.5b) = 3b + 256 < (2,2) at 3.5b
    assert partition_layers(config, 2) == [range(0, 3), range(3, 4)]
    # without the head the even split wins
    assert partition_by_cost(blocks, 2) == [range(0, 2), range(2, 4)]


def test_partition_by_cost_tie_breaks():
    # last stage pays 2.5: (2,3,1) and (3,2,1) both reach max 3.5 with equal sums of squares;
    # the tie goes to fewer blocks on the earlier stage.
    assert partition_by_cost([1.0] * 6, 3, last_extra=2.5) == [range(0, 2), range(2, 5), range(5, 6)]
    # uniform, no extras: 6 blocks on 4 stages -> (1,1,2,2)
    assert partition_by_cost([1.0] * 6, 4) == [range(0, 1), range(1, 2), range(2, 4), range(4, 6)]
    # minimax is exact, not greedy: one heavy block gets its own stage
    assert partition_by_cost([1, 1, 8, 1, 1], 3) == [range(0, 2), range(2, 3), range(3, 5)]


def test_gpt2_head_stage_gets_fewer_blocks():
    config = make_config("gpt2", 50257)
    ranges = partition_layers(config, 4)
    counts = [len(r) for r in ranges]
    assert ranges == [range(0, 3), range(3, 7), range(7, 11), range(11, 12)]
    assert counts[-1] < min(counts[:-1])
    costs = stage_costs(config, ranges)
    # head stage: one block + 2*768*50257 = 17.3M + 77.2M FLOPs/token is the bottleneck
    assert max(costs) == costs[-1] == pytest.approx(24 * 768**2 + 4 * 1024 * 768 + 2 * 768 * 50257)


@pytest.mark.parametrize("n_layer", [1, 2, 5, 8])
@pytest.mark.parametrize("vocab_size", [2, 257, 50257])
def test_partition_covers_all_layers_with_nonempty_stages(n_layer, vocab_size):
    config = GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=vocab_size)
    for n_stages in range(1, n_layer + 1):
        ranges = partition_layers(config, n_stages)
        assert len(ranges) == n_stages
        assert all(len(r) >= 1 and r.step == 1 for r in ranges)
        assert [j for r in ranges for j in r] == list(range(n_layer))
        # optimality against brute force over all splits (small cases)
        best = min(
            max(stage_costs(config, split))
            for split in _all_splits(n_layer, n_stages)
        )
        assert max(stage_costs(config, ranges)) == best


def _all_splits(L, N):
    from itertools import combinations

    for cuts in combinations(range(1, L), N - 1):
        bounds = (0, *cuts, L)
        yield [range(bounds[k], bounds[k + 1]) for k in range(N)]


# ---------------------------------------------------------------------------------------------
# Errors (exact texts)


def test_too_many_stages_error_text():
    config = make_config("small-cpu", 256)
    msg = (
        "stages=9 is invalid: the model has 6 layers, so stages must be in 1..6 "
        "(set --stages or pick a deeper --model)"
    )
    with pytest.raises(ConfigError, match=re.escape(msg)):
        partition_layers(config, 9)
    with pytest.raises(ConfigError, match=re.escape("stages=0 is invalid")):
        build_gpt_stages(config, 0, seed=0)


def test_unknown_preset_lists_names():
    msg = (
        "model='gpt3' is invalid (did you mean 'gpt2'?): must be one of tiny, small-cpu, deep-cpu, deep32-cpu, wide-cpu, gpt2, gpt2-medium, "
        "gpt2-large, gpt2-xl, llama-tiny, llama-deep-cpu, llama-1b, llama-8b, moe-tiny, moe-deep-cpu, "
        "mixtral-8x7b (set --model)"
    )
    with pytest.raises(ConfigError, match=re.escape(msg)):
        make_config("gpt3", 50257)
    assert set(PRESETS) == {"tiny", "small-cpu", "deep-cpu", "wide-cpu", "deep32-cpu", "gpt2", "gpt2-medium", "gpt2-large",
                            "gpt2-xl", "llama-tiny", "llama-deep-cpu", "llama-1b", "llama-8b", "moe-tiny",
                            "moe-deep-cpu", "mixtral-8x7b"}
    xl = make_config("gpt2-xl", 50257)
    assert (xl.n_layer, xl.n_head, xl.n_embd, xl.block_size) == (48, 25, 1600, 1024)


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (dict(n_layer=0), "n_layer=0 is invalid: must be an integer ≥ 1"),
        (dict(vocab_size=-1), "vocab_size=-1 is invalid: must be an integer ≥ 1"),
        (
            dict(n_embd=30),
            "n_embd=30 is invalid: must be divisible by n_head=4 "
            "(remainder 2; pick another width or head count)",
        ),
        (dict(dropout=1.0), "dropout=1.0 is invalid: must be in [0, 1) (set --dropout)"),
    ],
)
def test_config_validation_texts(kwargs, msg):
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=8, vocab_size=10)
    with pytest.raises(ConfigError, match=re.escape(msg)):
        GPTConfig(**{**base, **kwargs})


def test_stage_argument_errors():
    config = _tiny()
    with pytest.raises(ConfigError, match=re.escape("layers=range(2, 5) is invalid: the model has 4 layers")):
        GPTStage(config, range(2, 5), first=False, last=True, seed=0)
    with pytest.raises(ConfigError, match=re.escape("first=False is invalid for layers starting at 0")):
        GPTStage(config, range(0, 2), first=False, last=False, seed=0)
    with pytest.raises(ConfigError, match=re.escape("seed=-1 is invalid")):
        GPTStage(config, range(0, 4), first=True, last=True, seed=-1)
    with pytest.raises(ConfigError, match=re.escape("seq_len=33 is invalid: must be in 1..block_size=32")):
        partition_layers(config, 2, seq_len=33)
