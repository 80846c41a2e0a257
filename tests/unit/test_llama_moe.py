"""Llama-style and mixture-of-experts decoders: each block against explicit math, routing and its loss,
composition into stages, costs and partitions, and training through the pipeline (emulator)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from unbubble.errors import ConfigError
from unbubble.models import (
    LlamaConfig,
    LlamaStage,
    MoEConfig,
    MoEStage,
    block_shape,
    build_stages,
    component_costs,
    count_params,
    make_config,
    partition_layers,
    router_stats,
)
from unbubble.models.llama import Attention, apply_rope, rope_tables
from unbubble.models.moe import MoEFeedForward, capacity, load_balancing_loss
from unbubble.runtime.checkpoint import Checkpointing
from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule
from unbubble.testing import random_tokens, train_without_pipeline
from helpers import tiny_gpt_job

torch.set_num_threads(1)

LLAMA = LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, hidden=48, block_size=16, vocab_size=64)
MOE = MoEConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, hidden=24, block_size=16, vocab_size=64,
                n_expert=4, top_k=2)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- blocks against explicit math ------------------------------------------------------------------
def test_rmsnorm_is_x_over_root_mean_square_times_weight():
    stage = LlamaStage(LLAMA, range(0, 1), first=True, last=False, seed=0)
    norm = stage.h["0"].attn_norm
    with torch.no_grad():
        norm.weight.copy_(_randn(32, seed=1))
    x = _randn(2, 5, 32, seed=2)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + LLAMA.norm_eps) * norm.weight
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-6)


def test_rope_rotates_each_pair_by_position_times_frequency():
    cfg = dataclasses.replace(LLAMA, rope_theta=100.0)
    cos, sin = rope_tables(cfg)
    x = _randn(1, 2, 6, 8, seed=3).double()  # (B, nh, T, hs)
    got = apply_rope(x, cos, sin)
    ref = torch.empty_like(x)
    hs, half = 8, 4
    for t in range(6):
        for i in range(half):
            angle = t * 100.0 ** (-2 * i / hs)
            a, b = x[..., t, i], x[..., t, i + half]
            ref[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            ref[..., t, i + half] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # relative positions: <R_m q, R_n k> depends on m − n only
    q, k = _randn(8, seed=4), _randn(8, seed=5)
    rot = apply_rope(torch.stack([q] * 6)[None, None], cos, sin)[0, 0]
    rok = apply_rope(torch.stack([k] * 6)[None, None], cos, sin)[0, 0]
    assert float(rot[3] @ rok[1]) == pytest.approx(float(rot[5] @ rok[3]), rel=1e-5)


def _explicit_attention(attn: Attention, x: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Full multi-head attention with each key/value head repeated for its n_head/n_kv_head query heads."""
    B, T, C = x.shape
    hs, group = cfg.head_size, cfg.n_head // cfg.n_kv_head
    cos, sin = rope_tables(cfg)
    q = (x @ attn.wq.weight.T).view(B, T, cfg.n_head, hs).transpose(1, 2)
    k = (x @ attn.wk.weight.T).view(B, T, cfg.n_kv_head, hs).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(B, T, cfg.n_kv_head, hs).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = torch.stack([k[:, h // group] for h in range(cfg.n_head)], dim=1)  # repeated K/V heads
    v = torch.stack([v[:, h // group] for h in range(cfg.n_head)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)
    future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
    weights = torch.exp(scores.masked_fill(future, -math.inf) - scores.amax(-1, keepdim=True))
    y = (weights / weights.sum(-1, keepdim=True)) @ v  # (B, nh, T, hs)
    return y.transpose(1, 2).reshape(B, T, C) @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_attention_equals_full_attention_with_repeated_kv_heads(n_kv_head):
    cfg = dataclasses.replace(LLAMA, n_kv_head=n_kv_head)
    stage = LlamaStage(cfg, range(0, 1), first=True, last=False, seed=1)
    attn = stage.h["0"].attn
    assert attn.wk.weight.shape == (n_kv_head * 8, 32)
    x = _randn(2, 7, 32, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, stage.rope_cos, stage.rope_sin), _explicit_attention(attn, x, cfg),
                                   rtol=1e-5, atol=1e-6)


def test_swiglu_is_w2_of_silu_gate_times_up():
    stage = LlamaStage(LLAMA, range(0, 1), first=True, last=False, seed=2)
    ffn = stage.h["0"].ffn
    x = _randn(3, 4, 32, seed=7)
    a, b = x @ ffn.w1.weight.T, x @ ffn.w3.weight.T
    ref = (a / (1 + torch.exp(-a)) * b) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), ref, rtol=1e-5, atol=1e-6)


# --- mixture of experts ----------------------------------------------------------------------------
def _explicit_moe(ffn: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Token-by-token reference: top-k by probability, slot-major queues, capacity, gate-weighted sum."""
    cfg = ffn.config
    xf = x.reshape(-1, cfg.n_embd).double().detach()
    N, E, k = xf.shape[0], cfg.n_expert, cfg.top_k
    probs = torch.softmax(xf @ ffn.router.weight.double().detach().T, dim=-1)
    choice = [sorted(range(E), key=lambda e: (-float(probs[t, e]), e))[:k] for t in range(N)]
    cap = min(N, math.ceil(cfg.capacity_factor * k * N / E)) if cfg.capacity_factor else N
    taken, dropped = [0] * E, [0] * E
    y = torch.zeros_like(xf)
    for slot in range(k):
        for t in range(N):
            e = choice[t][slot]
            if taken[e] == cap:
                dropped[e] += 1
                continue
            taken[e] += 1
            gate = probs[t, e] / sum(probs[t, c] for c in choice[t]) if k > 1 else probs[t, e]
            a, b = ffn.w1[e].detach().double() @ xf[t], ffn.w3[e].detach().double() @ xf[t]
            y[t] += gate * (ffn.w2[e].detach().double() @ (a * torch.sigmoid(a) * b))
    return y.view(x.shape).float(), dropped


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (2, 0.5), (1, 0.75)])
def test_moe_layer_equals_token_by_token_reference_with_capacity(top_k, capacity_factor):
    cfg = dataclasses.replace(MOE, top_k=top_k, capacity_factor=capacity_factor)
    stage = MoEStage(cfg, range(0, 1), first=True, last=False, seed=3)
    ffn = stage.h["0"].ffn
    with torch.no_grad():
        ffn.router.weight.mul_(40)  # peaked routing, so small capacities drop assignments
    x = _randn(2, 12, 32, seed=8)
    ref, dropped = _explicit_moe(ffn, x)
    out = ffn(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert ffn.dropped.tolist() == dropped
    assert int(ffn.routed.sum()) == 24 * top_k
    assert (sum(dropped) > 0) == (capacity_factor is not None and capacity_factor < 1)
    assert torch.equal(ffn(x), out)  # deterministic routing
    assert int(ffn.routed.sum()) == 48 * top_k  # counters accumulate in training mode only ...
    with torch.no_grad():
        ffn(x)
    ffn.eval()
    ffn(x)
    assert int(ffn.routed.sum()) == 48 * top_k  # ... and with gradients on


def test_one_expert_top1_equals_the_dense_swiglu_block():
    dense_cfg = dataclasses.replace(LLAMA, hidden=24)
    moe_cfg = MoEConfig(**{f.name: getattr(dense_cfg, f.name) for f in dataclasses.fields(dense_cfg)},
                        n_expert=1, top_k=1, aux_loss_coef=0.0)
    dense = LlamaStage(dense_cfg, range(0, 4), first=True, last=True, seed=4)
    moe = MoEStage(moe_cfg, range(0, 4), first=True, last=True, seed=4)
    state = moe.state_dict()
    for j in range(4):  # the dense weights, as one expert
        for w in ("w1", "w2", "w3"):
            state[f"h.{j}.ffn.{w}"] = dense.state_dict()[f"h.{j}.ffn.{w}.weight"][None]
    for name, value in dense.state_dict().items():
        if ".ffn." not in name:
            state[name] = value
    moe.load_state_dict(state)
    idx = random_tokens(64, 2, 16, 0, 0)[0]
    torch.testing.assert_close(moe(idx), dense(idx), rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_on_a_hand_made_router_output():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])  # P = (0.4, 0.4, 0.2)
    top1 = torch.tensor([[0], [1]])  # f = (1/2, 1/2, 0): 3 · (0.2 + 0.2) = 1.2
    assert float(load_balancing_loss(probs, top1, 3)) == pytest.approx(1.2, rel=1e-6)
    top2 = torch.tensor([[0, 1], [1, 2]])  # f = (1/4, 1/2, 1/4): 3 · (0.1 + 0.2 + 0.05) = 1.05
    assert float(load_balancing_loss(probs, top2, 3)) == pytest.approx(1.05, rel=1e-6)
    uniform = torch.full((4, 4), 0.25)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [3]]), 4)) == pytest.approx(1.0)
    assert capacity(dataclasses.replace(MOE, capacity_factor=1.25), 24) == 15  # ceil(1.25 · 2 · 24 / 4)
    assert capacity(dataclasses.replace(MOE, capacity_factor=None), 24) == 24


def test_aux_loss_enters_every_stage_gradient_scaled_like_the_loss():
    """Gradients of the injected aux loss equal autograd of scale · (CE + coef · Σ aux) written out."""
    scale = 0.25
    idx, tgt = random_tokens(64, 2, 16, 0, 1)
    injected = build_stages(MOE, 2, seed=5, loss_scale=scale)
    plain = build_stages(dataclasses.replace(MOE, aux_loss_coef=0.0), 2, seed=5)
    x = idx
    for s in injected:
        x = s(x)
    (F.cross_entropy(x.reshape(-1, 64), tgt.reshape(-1)) * scale).backward()
    inputs = []
    hooks = [s.h[str(j)].ffn.register_forward_hook(lambda m, a, out: inputs.append((m, a[0])))
             for s in plain for j in s.layers]
    x = idx
    for s in plain:
        x = s(x)
    aux = 0.0
    for m, xn in inputs:
        probs = torch.softmax(xn.reshape(-1, 32) @ m.router.weight.T, dim=-1)
        aux = aux + load_balancing_loss(probs, probs.topk(2, dim=-1).indices, 4)
    (scale * (F.cross_entropy(x.reshape(-1, 64), tgt.reshape(-1)) + MOE.aux_loss_coef * aux)).backward()
    for h in hooks:
        h.remove()
    for a, b in zip(injected, plain):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
    router = injected[0].h["0"].ffn.router.weight.grad
    assert router.abs().max() > 0


def test_router_stats_from_counters():
    state = {"h.0.ffn.routed": torch.tensor([6, 2, 0, 0]), "h.0.ffn.dropped": torch.tensor([1, 0, 0, 0]),
             "h.3.ffn.routed": torch.tensor([2, 2, 2, 2]), "h.3.ffn.dropped": torch.tensor([0, 0, 0, 0]),
             "wte.weight": torch.zeros(2)}
    stats = router_stats(state)
    assert stats["load"] == {0: [0.75, 0.25, 0.0, 0.0], 3: [0.25] * 4}
    assert stats["dropped_frac"] == {0: 0.125, 3: 0.0}
    assert stats["max_load"] == 3.0 and stats["mean_dropped_frac"] == 0.0625 and stats["assignments"] == 16
    since = {"h.0.ffn.routed": torch.tensor([2, 2, 0, 0]), "h.0.ffn.dropped": torch.tensor([1, 0, 0, 0])}
    assert router_stats(state, since)["load"][0] == [1.0, 0.0, 0.0, 0.0]
    assert router_stats({"wte.weight": torch.zeros(2)}) is None


# --- stages, presets, costs ------------------------------------------------------------------------
@pytest.mark.parametrize("config", [LLAMA, MOE, dataclasses.replace(LLAMA, tie_embeddings=False)],
                         ids=["llama", "moe", "llama-untied"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_n_stages_compute_the_single_stage_logits_with_identical_weights(config, n_stages):
    (whole,) = build_stages(config, 1, seed=7)
    stages = build_stages(config, n_stages, seed=7)
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    for name, value in whole.state_dict().items():
        assert torch.equal(merged[name], value), name
    idx = random_tokens(64, 2, 16, 0, 2)[0]
    with torch.no_grad():
        x = idx
        for s in stages:
            x = s(x)
        torch.testing.assert_close(x, whole(idx), rtol=1e-5, atol=1e-6)
    tied = whole.lm_head.weight is getattr(whole, "wte").weight
    assert tied == config.tie_embeddings
    assert torch.equal(stages[-1].lm_head.weight, stages[0].wte.weight) == config.tie_embeddings


def test_presets_match_published_shapes_and_dense_parameter_counts():
    b1 = make_config("llama-1b")  # Llama 3.2 1B: 1.24B parameters with the tied 128256-token head
    assert sum(block_shape(b1).params for _ in range(16)) + 128_256 * 2048 + 2048 == pytest.approx(1.236e9, rel=1e-3)
    mixtral = make_config("mixtral-8x7b")  # 46.7B parameters, 12.9B active (arXiv 2401.04088)
    shape = block_shape(mixtral)
    total = 32 * shape.params + 2 * 32_000 * 4096 + 4096
    active = 32 * shape.active_matrix_params + 2 * 32_000 * 4096
    assert total == pytest.approx(46.7e9, rel=2e-3) and active == pytest.approx(12.9e9, rel=1e-2)
    # the CPU presets hold tiny's block parameters (biases and norms aside)
    tiny, llama, moe = (block_shape(make_config(n, 257)) for n in ("tiny", "llama-tiny", "moe-tiny"))
    assert tiny.matrix_params == llama.matrix_params == moe.matrix_params - 128 * 4
    assert moe.active_matrix_params == 3 * 128**2 + 128 * 4 + 2 * 3 * 128 * 96
    assert abs(count_params(build_stages(make_config("llama-tiny", 257), 1, 0)[0]) -
               count_params(build_stages(make_config("tiny", 257), 1, 0)[0])) < 0.03 * 842_624


def test_component_costs_of_llama_and_moe_blocks():
    T = 16
    emb, blocks, head = component_costs(LLAMA, T)
    C, kv, H = 32, 16, 48
    assert blocks == [2 * (2 * C * C + 2 * C * kv + 3 * C * H) + 4 * T * C] * 4
    assert (emb, head) == (4 * C, 2 * C * 64)
    _, moe_blocks, _ = component_costs(MOE, T)
    assert moe_blocks[0] == 2 * (2 * C * C + 2 * C * kv + C * 4 + 2 * 3 * C * 24) + 4 * T * C  # k = 2 of 4 experts


def test_partitions_of_the_deep_cpu_presets():
    for name in ("llama-deep-cpu", "moe-deep-cpu"):
        config = make_config(name, 257)
        assert partition_layers(config, 8) == [range(j, j + 1) for j in range(8)]
        assert partition_layers(config, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    big = make_config("llama-1b")  # the 128256 × 2048 head costs ≈ 2.3 blocks at T = 2048
    ranges = partition_layers(big, 8)
    assert len(ranges[-1]) < len(ranges[0])


@pytest.mark.parametrize("kwargs,msg", [
    (dict(n_kv_head=3), "n_kv_head=3 is invalid: must divide n_head=4 (each key/value head serves n_head / "
                        "n_kv_head query heads)"),
    (dict(n_embd=36), "n_embd=36 is invalid: must be n_head=4 times an even head size (RoPE rotates pairs of "
                      "coordinates)"),
    (dict(top_k=5), "top_k=5 is invalid: must be an integer in 1..n_expert=4"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 is invalid: must be > 0, or None for no capacity limit"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0 is invalid: must be >= 0 (0 disables it)"),
])
def test_config_errors_name_the_value_and_what_is_valid(kwargs, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        dataclasses.replace(MOE, **kwargs)


# --- training through the pipeline -----------------------------------------------------------------
@pytest.mark.parametrize("config", [LLAMA, MOE], ids=["llama", "moe"])
def test_1f1b_flush_emulator_equals_non_pipelined_reference(config):
    job = tiny_gpt_job(get_schedule("1f1b-flush", 4, steps=3, m=4), config=config)
    result = run_emulator(job)
    ref_states, ref_losses = train_without_pipeline(job)
    for got, want in zip(result.final_states, ref_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)


SCHEDULES = [("paci", 4, dict(a=2)), ("async-1f1b", 4, {}), ("gpipe", 2, dict(m=2)),
             ("interleaved-1f1b", 2, dict(m=4, v=2)), ("zb-h1", 4, dict(m=4)), ("zb-h2", 4, dict(m=4)),
             ("pipedream", 4, {}), ("pipedream-2bw", 4, dict(m=4)), ("pipemare", 4, {})]


@pytest.mark.parametrize("name,n,kw", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_every_schedule_trains_the_moe_model_within_its_drift_bound(name, n, kw):
    sched = get_schedule(name, n, steps=4, **kw)
    result = run_emulator(tiny_gpt_job(sched, config=MOE))
    assert len(result.step_losses) == 4 and all(math.isfinite(x) for x in result.step_losses)
    assert all(d <= sched.drift_bound(s) for s, d in enumerate(result.max_drift()))
    routed = sum(int(v.sum()) for st in result.final_states for k, v in st.items() if k.endswith(".routed"))
    assert routed == 4 * sched.total_mb * 2 * 16 * 2  # blocks × micro-batches × tokens × k


def test_moe_checkpoint_resume_is_bit_identical_including_router_counters(tmp_path):
    job = dataclasses.replace(tiny_gpt_job(get_schedule("paci", 4, 8, a=2), config=MOE),
                              checkpoint=Checkpointing(str(tmp_path), every=4, keep=3))
    full = run_emulator(job)
    resumed = run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=4)))
    for a, b in zip(full.final_states, resumed.final_states):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith(".routed") for k in full.final_states[0])


@pytest.mark.parametrize("model", ["llama-tiny", "moe-tiny"])
def test_short_real_text_paci_run_lowers_validation_loss(model, tmp_path):
    import json

    from unbubble.config import TrainConfig
    from unbubble.train import train

    cfg = TrainConfig(engine="emulator", model=model, steps=20, seq_len=32, eval_interval=10, eval_batches=2,
                      run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), checkpoints=False)
    result, run_dir = train(cfg)
    (v0, first), _, (v_end, last) = result.val_losses
    assert (v0, v_end) == (0, 20) and last < first - 1.5  # ≈ ln 257 → below the unigram entropy of bytes
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    router = [r for r in lines if "router" in r]
    if model == "llama-tiny":
        assert summary["router"] is None and not router
        return
    # the counters of every block: 20 steps × a=4 micro-batches × 8 × 32 tokens × top-2
    assert summary["router"]["assignments"] == 4 * 20 * 4 * 8 * 32 * 2
    assert [r["step"] for r in router] == [10, 20]  # one line per evaluation after the first
    assert sum(r["router"]["assignments"] for r in router) == summary["router"]["assignments"]
    assert 1.0 <= summary["router"]["max_load"] <= 4.0 and 0.0 <= summary["router"]["mean_dropped_frac"] < 1.0


def test_moe_delay_sweep_builds_every_configuration():
    from unbubble.experiments.moe import _verdict, moe_delay_spec
    from unbubble.experiments.sweep import SweepSpec

    spec = SweepSpec.from_dict(moe_delay_spec("default"))  # builds every run's TrainConfig
    assert len(spec.tuning_runs()) == 2 * 5 * 2  # 2 models × (2 optimizers × 2 depths + PipeDream-LR at N=8) × 2 lrs
    assert {spec.config(r, Path("x")).model for r in spec.tuning_runs()} == \
        {"moe-deep-cpu", "llama-deep-cpu"}
    assert _verdict({("moe", "basis-rotation"): 0.01, ("moe", "adamw"): 0.2}, 8) == \
        "Ours (delay penalty, N = 1 → 8): moe-deep-cpu: Basis Rotation +0.0100 against AdamW +0.2000."
