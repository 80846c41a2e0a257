"""Delay remedies as optimizer choices: Muon (+ AdamW), staleness-scaled lr, and the warm-up floor."""

import dataclasses
import io
import functools

import pytest
import torch

from unbubble.config import TrainConfig
from unbubble.errors import ConfigError
from unbubble.lr import warmup_cosine
from unbubble.optim import MuonAdamW, StalenessLR, build_optimizer
from unbubble.schedules.registry import get_schedule
from helpers import tiny_gpt_job


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    named = [("h.0.attn.c_attn.weight", torch.randn(12, 8, generator=g)),
             ("h.0.ln_1.weight", torch.randn(8, generator=g)),
             ("wte.weight", torch.randn(10, 8, generator=g))]
    return [(n, torch.nn.Parameter(t.clone())) for n, t in named]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _assert_equal_after_steps(ours, opt, ref, ref_opts, steps=3):
    """Three steps of ``opt`` on ``ours`` and of ``ref_opts`` on ``ref`` with the same gradients
    leave bit-equal parameters."""
    for step in range(steps):
        for ps in (ours, ref):
            _grads(ps, step)
        opt.step()
        for o in ref_opts:
            o.step()
    for (name, p), (_, q) in zip(ours, ref):
        assert torch.equal(p, q), name


def test_muon_adamw_equals_torch_muon_and_adamw_run_apart():
    ours = _params()
    opt = build_optimizer("muon", ours, stage=0, n_stages=1, delay=0, lr=0.02, betas=(0.9, 0.95),
                          weight_decay=0.1)
    opt.ns_dtype = torch.bfloat16  # torch.optim.Muon's Newton–Schulz dtype (the CPU default is float32)
    ref = _params()
    muon = torch.optim.Muon([ref[0][1]], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [ref[2][1]], "weight_decay": 0.1},
                               {"params": [ref[1][1]], "weight_decay": 0.0}], lr=0.02, betas=(0.9, 0.95))
    _assert_equal_after_steps(ours, opt, ref, (muon, adamw))
    assert not torch.equal(ours[0][1], _params()[0][1])  # the matrix did move


def test_muon_newton_schulz_runs_in_float32_on_the_cpu_and_stays_near_torch_bfloat16():
    """Regression: torch.optim.Muon's bfloat16 Newton–Schulz is emulated on this CPU (10–27× slower than
    float32), so MuonAdamW iterates in float32 on the CPU. Against torch.optim.Muon (bfloat16) over 3
    steps: the weights are not bit-equal (the dtype differs) but within bfloat16's rounding of the
    update; each float32 step points along the polar factor UVᵀ of its Nesterov momentum (SVD)."""
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(48, 16, generator=g)
    grads = [torch.randn(48, 16, generator=g) for _ in range(3)]
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([{"params": [ours], "muon": True}], lr=0.02, weight_decay=0.1)
    assert opt.ns_dtype is None  # float32 on the CPU, bfloat16 elsewhere
    muon = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    mu, buf = 0.95, torch.zeros(48, 16)
    for grad in grads:
        before = ours.detach().clone()
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        muon.step()
        buf = mu * buf + (1 - mu) * grad
        u, _, vh = torch.linalg.svd((1 - mu) * grad + mu * buf, full_matrices=False)
        step = before * (1 - 0.02 * 0.1) - ours.detach()
        cos = float((step * (u @ vh)).sum() / (step.norm() * (u @ vh).norm()))
        assert cos > 0.95
    moved = (w0 - ref.detach()).norm()
    gap = float((ours.detach() - ref.detach()).norm() / moved)
    assert 0 < gap < 0.02, gap  # bfloat16 keeps 8 bits of mantissa: ~0.4 % per element


def test_orthogonalize_in_float32_against_float64():
    """The iteration in float32 equals the same iteration in float64 to float32's precision (a
    reference that only the dtype separates), for a wide and a tall matrix."""
    from unbubble.optim.muon import orthogonalize

    g = torch.Generator().manual_seed(1)
    for shape in ((16, 40), (40, 16)):
        x = torch.randn(*shape, generator=g)
        got = orthogonalize(x, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
        want = orthogonalize(x.double(), (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float64)
        assert got.dtype == torch.float32 and got.shape == shape
        assert torch.allclose(got.double(), want, atol=1e-5)
    with pytest.raises(ValueError, match=r"ns_dtype=torch.int32 is invalid"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3, 2))], "muon": True}], lr=0.1, ns_dtype=torch.int32)


def test_muon_adamw_lr_schedule_reaches_both_halves_and_state_dict_round_trips():
    params = _params()
    opt = build_optimizer("muon", params, stage=0, n_stages=1, delay=0, lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 0.5)
    assert {g["lr"] for g in opt.muon.param_groups} == {g["lr"] for g in opt.adamw.param_groups} == {0.005}
    for step in range(2):
        _grads(params, step)
        opt.step()
        sched.step()
    # through bytes, as a checkpoint does: torch's load_state_dict aliases the tensors it is given
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    clone = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
    other = build_optimizer("muon", clone, stage=0, n_stages=1, delay=0, lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    other.load_state_dict(saved)
    for ps in (params, clone):
        _grads(ps, 7)
    opt.step()
    other.step()
    for (_, p), (_, q) in zip(params, clone):
        assert torch.equal(p, q)
    assert other.muon.state is other.state and other.adamw.param_groups[0] is other.param_groups[1]


def test_muon_group_refuses_a_tensor_that_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"shape \(3, 2, 2\): Muon updates 2-D matrices only"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3, 2, 2))], "muon": True}], lr=0.1)


def test_muon_gives_stacked_expert_weights_to_adamw():
    """Regression: ``unbubble train --model moe-tiny`` (Muon by default) stopped with "a Muon group
    holds a tensor of shape (4, 96, 128)". Stacked expert weights now get AdamW, the stage's
    matrices Muon, each exactly as torch's optimizers run apart."""
    g = torch.Generator().manual_seed(0)
    named = [("h.0.mlp.c_fc.weight", torch.randn(12, 8, generator=g)),
             ("h.0.moe.w_in", torch.randn(3, 12, 8, generator=g))]
    ours = [(n, torch.nn.Parameter(t.clone())) for n, t in named]
    ref = [(n, torch.nn.Parameter(t.clone())) for n, t in named]
    opt = build_optimizer("muon", ours, stage=0, n_stages=1, delay=0, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
    opt.ns_dtype = torch.bfloat16
    muon = torch.optim.Muon([ref[0][1]], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([ref[1][1]], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
    _assert_equal_after_steps(ours, opt, ref, (muon, adamw))


def test_staleness_lr_divides_by_one_plus_delay():
    base = functools.partial(warmup_cosine, total=100, warmup=10, min_ratio=0.1)
    for tau in (0, 1, 3):
        f = StalenessLR(tau, base)
        for step in (0, 5, 50, 99):
            assert f(step) == pytest.approx(base(step) / (1 + tau))
    with pytest.raises(ConfigError, match="delay=-1"):
        StalenessLR(-1)


def test_staleness_lr_job_scales_each_stage_by_its_paci_delay():
    n, a = 4, 2
    job = tiny_gpt_job(get_schedule("paci", n, steps=4, a=a), lr=0.01)
    job = dataclasses.replace(job, delay_lr="staleness")
    for s in range(n):
        ex = job.build_executor(s)
        tau = -(-(n - 1 - s) // a)
        assert ex.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 / (1 + tau))


def test_train_config_accepts_the_new_optimizers_and_paci_stashed():
    for name in ("muon", "staleness-lr"):
        assert TrainConfig(optimizer=name).optimizer == name
    cfg = TrainConfig(schedule="paci-stashed", a=8)
    assert cfg.mb_per_step == 8
    sched = get_schedule("paci-stashed", 8, steps=4, a=4)
    assert sched.stashing and [sched.drift_bound(s) for s in range(8)] == [0] * 8
    assert [sched.delay_bound(s) for s in range(8)] == [2, 2, 2, 1, 1, 1, 1, 0]  # ⌈(N−i)/a⌉, i 1-based


@pytest.mark.parametrize("steps,frac,floor,want", [
    (150, 0.01, 20, 20),   # the old default gave round(1.5) = 2 warm-up updates
    (50, 0.01, 20, 10),    # the floor never takes more than a fifth of a short run
    (2000, 0.01, 20, 20),
    (5000, 0.01, 20, 50),  # long runs: the fraction decides
    (150, 0.01, 0, 2),     # warmup_min 0: the fraction alone
    (600, 0.1, 20, 60),
])
def test_warmup_is_never_a_step_or_two(steps, frac, floor, want):
    assert TrainConfig(steps=steps, warmup_frac=frac, warmup_min=floor).warmup_steps == want


def test_warmup_min_is_validated():
    with pytest.raises(ConfigError, match=r"warmup_min=-1 is invalid: must be an integer ≥ 0 \(set --warmup-min\)"):
        TrainConfig(warmup_min=-1)


def test_first_update_of_a_default_short_run_uses_a_twentieth_of_the_lr(tmp_path):
    from unbubble.data import prepare_tokens
    from unbubble.train import build_job

    cfg = TrainConfig(steps=150, cache_dir=str(tmp_path), run_dir=str(tmp_path / "run"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("In the beginning God created the heaven and the earth. " * 400)
    job, _ = build_job(cfg, prepare_tokens(str(corpus), "byte", tmp_path))
    assert job.lr_lambda(0) == pytest.approx(1 / 20) and job.lr_lambda(19) == pytest.approx(1.0)
