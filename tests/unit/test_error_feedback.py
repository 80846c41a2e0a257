"""Error feedback ([Note: error feedback] in docs/architecture.md): the rule against a hand computation,
its reduction to PACI at c = 0, composition with weight prediction and bf16, its memory, bad values, resume."""

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

from unbubble.config import ERROR_FEEDBACK_SCHEDULES, TrainConfig
from unbubble.errors import ConfigError
from unbubble.optim import build_optimizer
from unbubble.optim.factory import OPTIMIZERS
from unbubble.runtime.checkpoint import Checkpointing
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.executor import StageExecutor
from unbubble.runtime.precision import to_bf16
from unbubble.schedules import get_schedule
from unbubble.testing import assert_resume_is_bit_identical
from helpers import tiny_gpt_job

torch.set_num_threads(1)

X0, LR, GRADS = 1.0, 0.1, (1.0, -2.0, 0.5)


class _Scale(nn.Module):
    """out = w·x: with x = 1 and upstream gradient g, the weight gradient is exactly g."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([X0], dtype=dtype))

    def forward(self, x):
        return self.w * x


def _run(module, opt_fn, c, grads=GRADS, precision="fp32"):
    masters = to_bf16(module) if precision == "bf16" else None
    dtype = module.w.dtype
    opt = opt_fn(masters if masters is not None else list(module.parameters()))
    ex = StageExecutor(0, 2, module, None, lambda k: (torch.ones(1, dtype=dtype), None), opt, 1.0,
                       precision=precision, masters=masters, error_feedback=c)
    for k, g in enumerate(grads):
        ex.forward(k)
        ex.backward(k, torch.tensor([g], dtype=dtype))
        ex.update()
    return ex


def _hand(c, u):
    """x_1 = x_0 − u_1; x_{t+1} = x_t − u_t − c·(u_t − u_{t−1})."""
    x = [X0 - u[0]]
    for t in range(1, len(u)):
        x.append(x[-1] - u[t] - c * (u[t] - u[t - 1]))
    return x


@pytest.mark.parametrize("c,want", [(1.0, [0.9, 1.4, 1.1]), (0.5, [0.9, 1.25, 1.075])])
def test_sgd_rule_against_a_hand_computation(c, want):
    """SGD, lr η, no momentum: u_t = η g_t = 0.1, −0.2, 0.05; c = 1: x = 0.9, 1.4, 1.1."""
    assert _hand(c, [LR * g for g in GRADS]) == pytest.approx(want, abs=1e-15)
    for steps in (1, 2, 3):
        ex = _run(_Scale(), lambda p: torch.optim.SGD(p, lr=LR), c, GRADS[:steps])
        assert ex.module.w.item() == pytest.approx(want[steps - 1], abs=1e-12)


def test_adamw_rule_against_a_hand_computation():
    """u_t read off a plain AdamW (weight decay on) stepped from the corrected x_t on the same gradients."""
    c, wd = 1.0, 0.1
    ref = nn.Parameter(torch.tensor([X0], dtype=torch.float64))
    opt = torch.optim.AdamW([ref], lr=LR, weight_decay=wd)
    x, u_prev = X0, None
    for t, g in enumerate(GRADS):
        with torch.no_grad():
            ref.fill_(x)
        ref.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        u = x - ref.item()
        x = x - u - (c * (u - u_prev) if t else 0.0)
        u_prev = u
    ex = _run(_Scale(), lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=wd), c)
    assert ex.module.w.item() == pytest.approx(x, abs=1e-12)
    assert x != pytest.approx(_run(_Scale(), lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=wd), 0.0).module.w.item())


def test_a_parameter_without_a_gradient_is_left_unchanged_and_its_history_zeroed():
    """Regression (issue 33): b gets no gradient at step 2. SGD, lr 0.1, c = 1, both from 1.0:
    step 1, g = (1, 1): u = 0.1 each, a = b = 0.9, history 0.1 each;
    step 2, g = (−2, none): a: u = −0.2, a = 0.9 + 0.2 − (−0.2 − 0.1) = 1.4; b stays 0.9 (it used to move
    by c·u_1 to 1.0), its history becomes 0 (RamTorch's _skip_parameter);
    step 3, g = (0.5, 0.5): u = 0.05 each, a = 1.4 − 0.05 − (0.05 + 0.2) = 1.1,
    b = 0.9 − 0.05 − (0.05 − 0) = 0.8 (corrected against the zeroed history, as RamTorch)."""
    from unbubble.optim.error_feedback import ErrorFeedback

    a, b = (nn.Parameter(torch.tensor([X0], dtype=torch.float64)) for _ in range(2))
    opt = torch.optim.SGD([a, b], lr=LR)
    ef = ErrorFeedback([a, b], 1.0)
    want = [(0.9, 0.9), (1.4, 0.9), (1.1, 0.8)]
    for (ga, gb), (wa, wb) in zip([(1.0, 1.0), (-2.0, None), (0.5, 0.5)], want):
        a.grad = torch.tensor([ga], dtype=torch.float64)
        b.grad = None if gb is None else torch.tensor([gb], dtype=torch.float64)
        ef.snapshot()
        opt.step()
        ef.correct()
        opt.zero_grad(set_to_none=True)
        assert (a.item(), b.item()) == (pytest.approx(wa, abs=1e-12), pytest.approx(wb, abs=1e-12))
        if gb is None:
            assert ef.history[1].item() == 0.0 and ef.history[0].item() == pytest.approx(-0.2, abs=1e-12)


def test_bf16_applies_the_rule_to_the_fp32_masters_and_refreshes_the_parameters():
    ex = _run(_Scale(torch.float32), lambda p: torch.optim.SGD(p, lr=LR), 1.0, precision="bf16")
    assert ex.masters[0].dtype == torch.float32 and ex.module.w.dtype == torch.bfloat16
    assert ex.masters[0].item() == pytest.approx(1.1, abs=1e-6)
    assert torch.equal(ex.module.w, ex.masters[0].detach().to(torch.bfloat16))
    assert ex.memory_bytes()["error_feedback_bytes"] == 2 * 4  # history + snapshot, fp32 like the masters


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_equals_the_rule_applied_by_hand(name):
    """The executor's weights equal: step the optimizer, then x ← x − c·(u_t − u_{t−1}) by hand."""
    c, lr = 1.0, 1e-2
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    gs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(10 + k)) for k in range(4)]
    mod = _small()
    opt = build_optimizer(name, list(mod.named_parameters()), 0, 2, 1, lr, (0.9, 0.95), 0.1)
    ex = StageExecutor(0, 2, mod, None, lambda k: (xs[k], None), opt, 1.0, error_feedback=c)
    ref = _small()
    ref_opt = build_optimizer(name, list(ref.named_parameters()), 0, 2, 1, lr, (0.9, 0.95), 0.1)
    u_prev = None
    for k in range(4):
        ex.forward(k)
        ex.backward(k, gs[k])
        ex.update()
        ref(xs[k]).backward(gs[k])
        before = [p.detach().clone() for p in ref.parameters()]
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            u = [b - p for b, p in zip(before, ref.parameters())]
            if u_prev is not None:
                for p, ut, up in zip(ref.parameters(), u, u_prev):
                    p.sub_(c * (ut - up))
        u_prev = u
    for got, want in zip(mod.parameters(), ref.parameters()):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _job(c=0.0, predict="none", steps=6, name="paci", **kw):
    job = tiny_gpt_job(get_schedule(name, 4, steps, **({"a": 2} if name == "paci" else {})))
    return dataclasses.replace(job, error_feedback=c, predict_weights=predict, **kw)


def test_c_zero_is_paci_bit_for_bit():
    plain, off = run_emulator(tiny_gpt_job(get_schedule("paci", 4, 6, a=2))), run_emulator(_job(0.0))
    assert plain.step_losses == off.step_losses
    assert all(torch.equal(a[k], b[k]) for a, b in zip(plain.final_states, off.final_states) for k in a)
    assert all(m["error_feedback_bytes"] == 0 for m in off.memory)
    on = run_emulator(_job(1.0))
    assert on.step_losses[0] == plain.step_losses[0] and on.step_losses[-1] != plain.step_losses[-1]


def test_composes_with_weight_prediction_and_is_counted_in_memory():
    result = run_emulator(_job(1.0, "bound"))
    assert all(math.isfinite(x) for x in result.step_losses)
    assert result.step_losses[-1] != run_emulator(_job(1.0)).step_losses[-1]
    job = _job(1.0, "bound")
    for s, m in enumerate(result.memory):
        params = [p for p in job.stage_fn(s).parameters() if p.requires_grad]
        fp32 = sum(p.numel() * 4 for p in params)
        assert m["error_feedback_bytes"] == 2 * fp32 == m["prediction_bytes"]


def test_prediction_extrapolates_the_corrected_update():
    """The last applied update that prediction extrapolates is the step the weights took, correction included."""
    mod = _Scale()
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    ex = StageExecutor(0, 2, mod, None, lambda k: (torch.ones(1, dtype=torch.float64), None), opt, 1.0,
                       predict_weights="bound", predict_bound=1, error_feedback=1.0)
    for k, g in enumerate(GRADS[:2]):
        ex.forward(k)
        ex.backward(k, torch.tensor([g], dtype=torch.float64))
        ex.update()
    assert ex.last_update[0].item() == pytest.approx(1.4 - 0.9, abs=1e-12)  # x_2 − x_1, not −u_2 = 0.2


def test_error_feedback_memory_in_the_simulator():
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.hardware import get_hardware

    cfg, hw = make_model("gpt2-medium"), get_hardware("h200")
    plain = analytic_model(cfg, 8, hw, 4)
    ef = analytic_model(cfg, 8, hw, 4, error_feedback=True)
    both = analytic_model(cfg, 8, hw, 4, predict_weights=True, error_feedback=True)
    assert ef.memory.extra_bytes == tuple(8.0 * n for n in plain.params)  # two fp32 buffers per parameter
    assert both.memory.extra_bytes == tuple(2 * w + 8.0 * n for w, n in zip(plain.memory.weights_bytes, plain.params))


@pytest.mark.parametrize("fields,message", [
    ({"error_feedback": -1.0}, "error_feedback=-1.0 is invalid: must be a finite number ≥ 0 (0 = off; set --error-feedback)"),
    ({"error_feedback": math.nan}, "error_feedback=nan is invalid: must be a finite number ≥ 0"),
    ({"error_feedback": math.inf}, "error_feedback=inf is invalid: must be a finite number ≥ 0"),
    ({"error_feedback": 1.0, "schedule": "1f1b-flush"}, "error_feedback=1.0 is for asynchronous schedules (paci, "
     "async-1f1b, paci-stashed, pipedream, pipedream-2bw, pipemare): schedule='1f1b-flush' is synchronous, so "
     "u_t − u_(t−1) corrects no delay (set --error-feedback 0)"),
])
def test_bad_values_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**fields)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="error_feedback=-1 is invalid"):
        _run(_Scale(), lambda p: torch.optim.SGD(p, lr=LR), -1)


def test_the_allowed_schedules_are_the_asynchronous_ones():
    from unbubble.config import SCHEDULE_OPTIONS
    from unbubble.schedules.registry import SCHEDULES

    def kw(name):
        return {opt: 4 for opt, (names, _) in SCHEDULE_OPTIONS.items() if name in names}

    asynchronous = {n for n in SCHEDULES if get_schedule(n, 2, 2, **kw(n)).asynchronous}
    assert asynchronous == set(ERROR_FEEDBACK_SCHEDULES)
    TrainConfig(error_feedback=1.0, schedule="pipedream")  # accepted


@pytest.mark.parametrize("predict,precision", [("none", "fp32"), ("bound", "fp32"), ("none", "bf16")])
def test_resume_is_bit_identical(predict, precision, tmp_path):
    job = _job(1.0, predict, steps=8, precision=precision, checkpoint=Checkpointing(str(tmp_path), every=4, keep=3))
    assert_resume_is_bit_identical(job, 4)


def test_summary_json_counts_the_buffers(tmp_path):
    import json

    from unbubble.train import train

    cfg = TrainConfig(engine="emulator", steps=2, eval_interval=0, eval_batches=1, error_feedback=1.0,
                      run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    _, run_dir = train(cfg)
    memory = json.loads((run_dir / "summary.json").read_text())["memory"]
    assert all(m["error_feedback_bytes"] == 2 * (m["master_bytes"] or m["param_bytes"]) > 0 for m in memory)
