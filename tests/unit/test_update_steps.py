"""The update's steps (runtime/update.py, runtime/guard.py), each on real values against a hand
computation or torch's own function, and the order StageExecutor runs them in."""

import math

import pytest
import torch
from torch import nn

from unbubble.optim.error_feedback import ErrorFeedback
from unbubble.runtime import update as upd
from unbubble.runtime.clipping import RankClipper, stage_sizes
from unbubble.runtime.executor import StageExecutor
from unbubble.runtime.guard import NonFiniteGuard
from unbubble.runtime.precision import to_bf16

torch.set_num_threads(1)


def _ctx(params, grads=None, **kw) -> upd.UpdateContext:
    if grads is not None:
        for p, g in zip(params, grads):
            p.grad = None if g is None else torch.as_tensor(g, dtype=p.dtype).clone()
    return upd.UpdateContext(0, params, params, **kw)


def _param(values, dtype=torch.float64) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=dtype))


# -- clip -------------------------------------------------------------------------------------------
def test_clip_step_scales_by_max_norm_over_the_total_norm_as_torch_does():
    a, b = _param([0.0, 0.0]), _param([0.0])
    ctx = _ctx([a, b], [[3.0, 4.0], [12.0]])  # total norm 13
    upd.GradClip(6.5).apply(ctx)
    coef = 6.5 / (13.0 + 1e-6)  # torch's clip_grad_norm_: max_norm / (norm + 1e-6)
    assert a.grad.tolist() == pytest.approx([3 * coef, 4 * coef], abs=1e-15)
    assert b.grad.tolist() == pytest.approx([12 * coef], abs=1e-15)
    ref = [torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([12.0], dtype=torch.float64)]
    ref_params = [nn.Parameter(torch.zeros_like(t)) for t in ref]
    for p, g in zip(ref_params, ref):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(ref_params, 6.5)
    assert torch.equal(a.grad, ref_params[0].grad) and torch.equal(b.grad, ref_params[1].grad)
    small = _ctx([a], [[0.3, 0.4]])  # norm 0.5 < 6.5: unchanged
    upd.GradClip(6.5).apply(small)
    assert a.grad.tolist() == [0.3, 0.4] and small.apply
    off = _ctx([a], [[30.0, 40.0]])
    upd.GradClip(None).apply(off)
    assert a.grad.tolist() == [30.0, 40.0]


def test_clip_step_defers_to_the_rank_clipper_whose_false_skips_the_update():
    class Refuses:
        def clip(self, ex):
            self.seen = ex
            return False

    clipper, p = Refuses(), _param([1.0])
    ctx = _ctx([p], [[5.0]], clipper=clipper, executor="the executor")
    upd.GradClip(0.1).apply(ctx)  # the rank clipper, not the plain clip
    assert clipper.seen == "the executor" and not ctx.apply and p.grad.tolist() == [5.0]
    opt = torch.optim.SGD([p], lr=1.0)
    upd.OptimizerStep(opt).apply(ctx)
    assert p.tolist() == [1.0]
    ctx.apply = True
    upd.OptimizerStep(opt).apply(ctx)
    assert p.tolist() == [-4.0]


# -- the non-finite guard's update-time check ------------------------------------------------------
def _guard(policy="skip", p=None):
    p = p if p is not None else _param([1.0, 2.0])
    opt = torch.optim.SGD([p], lr=0.5)
    return NonFiniteGuard(3, policy, 0.5, opt), opt, p


def test_guard_step_turns_a_non_finite_sum_into_zeros_or_into_nan_when_clipped():
    guard, _, p = _guard()
    ctx = _ctx([p], [[math.nan, 1.0]])
    ctx.version = 4
    guard.kept_since_update = 2
    guard.apply(ctx)
    assert p.grad.tolist() == [0.0, 0.0]
    assert [(e["stage"], e["mb"], e["version"]) for e in guard.events] == [(3, None, 4)]
    guard.apply(_ctx([p], [[math.inf, 1.0]], clipper=object()))  # clipped: NaN makes the clip skip
    assert all(math.isnan(v) for v in p.grad.tolist())
    off, _, q = _guard("off")
    off.apply(_ctx([q], [[math.nan, 1.0]]))
    assert math.isnan(q.grad[0]) and q.grad[1] == 1.0 and off.events == []
    lower, opt, r = _guard("lower-lr")
    lower.apply(_ctx([r], [[math.nan, 1.0]]))
    assert opt.param_groups[0]["lr"] == 0.25 and lower.lr_factor == 0.5


def test_a_nan_gradient_under_clipping_leaves_weights_and_moments_bit_identical():
    """Guard then clip on a real executor: the update is skipped, nothing the optimizer holds moves."""
    torch.manual_seed(0)
    lin = nn.Linear(2, 2).double()
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, weight_decay=0.1)
    ex = StageExecutor(0, 1, lin, lambda out, y: ((out - y) ** 2).mean(),
                       lambda k: (torch.full((1, 2), float(k + 1), dtype=torch.float64),
                                  torch.zeros(1, 2, dtype=torch.float64)), opt, 1.0, error_feedback=0.5)
    RankClipper(10.0, "stage", 0, 0, {0: ex}, None, {0: stage_sizes(ex)})
    ex.forward(0)
    ex.backward(0)
    ex.update()  # a normal update first: the moments and the error-feedback history are non-zero
    weights = [p.detach().clone() for p in lin.parameters()]
    moments = {k: v.clone() for k, v in opt.state[lin.weight].items()}
    history = [h.clone() for h in ex.error_feedback.history]
    ex.forward(1)
    ex.backward(1)
    lin.weight.grad[0, 0] = math.nan
    ex.update()
    assert all(torch.equal(w, p) for w, p in zip(weights, lin.parameters()))
    assert all(torch.equal(v, opt.state[lin.weight][k]) for k, v in moments.items())
    assert all(torch.equal(h, g) for h, g in zip(history, ex.error_feedback.history))
    assert ex.version == 2 and ex.clip_stats["skipped"] == 1 and lin.weight.grad is None
    assert [e["what"].split(" (")[0] for e in ex.events] == ["accumulated weight gradient", "its own gradient norm"]


# -- error feedback ----------------------------------------------------------------------------------
def test_error_feedback_steps_against_a_hand_computed_update_on_a_2x2_tensor():
    x0 = [[1.0, 2.0], [3.0, 4.0]]
    g1, g2 = [[1.0, -1.0], [0.5, 2.0]], [[2.0, 0.0], [-1.0, 1.0]]
    lr, c = 0.1, 0.5
    w = _param(x0)
    opt = torch.optim.SGD([w], lr=lr)
    steps = upd.ErrorFeedbackSteps(ErrorFeedback([w], c))
    for g in (g1, g2):
        ctx = _ctx([w], [g])
        steps.snapshot(ctx)
        upd.OptimizerStep(opt).apply(ctx)
        steps.correct(ctx)
    # x1 = x0 − u1 (the first step is plain); x2 = x1 − u2 − c·(u2 − u1), u = lr·g
    for i in range(2):
        for j in range(2):
            u1, u2 = lr * g1[i][j], lr * g2[i][j]
            x1 = x0[i][j] - u1
            assert w[i, j].item() == pytest.approx(x1 - u2 - c * (u2 - u1), abs=1e-15)
    before = w.detach().clone()
    skipped = _ctx([w], [g1])
    skipped.apply = False
    steps.snapshot(skipped)
    upd.OptimizerStep(opt).apply(skipped)
    steps.correct(skipped)
    assert torch.equal(w, before) and steps.feedback.steps == 2


# -- bf16 masters ------------------------------------------------------------------------------------
def test_master_copy_rounds_the_fp32_masters_to_nearest_even_in_the_bf16_parameters():
    p = _param([0.0, 0.0, 0.0], dtype=torch.bfloat16)
    # 1 + 2⁻⁷ is a bf16 value; 1 + 2⁻⁹ is below half an ulp (2⁻⁸): 1; 1 + 3·2⁻⁸ is a tie: to even, 1 + 2⁻⁶
    masters = [torch.tensor([1 + 2 ** -7, 1 + 2 ** -9, 1 + 3 * 2 ** -8], dtype=torch.float32)]
    ctx = upd.UpdateContext(0, [p], masters, apply=False)
    upd.MasterCopy(masters).apply(ctx)
    assert p.tolist() == [0.0, 0.0, 0.0]  # a skipped update copies nothing
    ctx.apply = True
    upd.MasterCopy(masters).apply(ctx)
    assert p.float().tolist() == [1 + 2 ** -7, 1.0, 1 + 2 ** -6]


# -- weight prediction, PipeMare's velocity, the step loss, the replicas' average ------------------
def test_prediction_steps_record_the_applied_update_and_predict_w_plus_s_times_it():
    w = _param([1.0, -2.0])
    pred = upd.WeightPrediction([w], "bound", 3)
    opt = torch.optim.SGD([w], lr=0.5)
    ctx = _ctx([w], [[1.0, 4.0]])
    pred.snapshot(ctx)
    upd.OptimizerStep(opt).apply(ctx)
    pred.record(ctx)
    assert pred.last_update[0].tolist() == [-0.5, -2.0] and w.tolist() == [0.5, -4.0]
    assert pred.steps(None) == 3.0 and upd.WeightPrediction([w], "measured", 3).steps(1.25) == 1.25
    with pred.predicted(pred.steps(None), version=1):
        assert w.tolist() == [0.5 - 1.5, -4.0 - 6.0]  # W + 3·(W − W_prev)
    assert w.tolist() == [0.5, -4.0]  # restored exactly
    with pred.predicted(3.0, version=0):  # no update yet: the live weights
        assert w.tolist() == [0.5, -4.0]


def test_velocity_steps_follow_pipemares_estimate():
    w, gamma = _param([0.0, 1.0]), 0.9
    vel = upd.PipeMareVelocity([w], gamma)
    opt = torch.optim.SGD([w], lr=1.0)
    expect = [0.0, 0.0]
    for g in ([1.0, 2.0], [-3.0, 0.5]):
        ctx = _ctx([w], [g])
        vel.snapshot(ctx)
        upd.OptimizerStep(opt).apply(ctx)
        vel.update(ctx)
        expect = [gamma * v + (1 - gamma) * -gi for v, gi in zip(expect, g)]  # δ ← γδ + (1 − γ)(W − W_prev)
        assert vel.velocity[0].tolist() == pytest.approx(expect, abs=1e-15)
    with vel.corrected([w], 2):
        assert w.tolist() == pytest.approx([2.0 - 2 * expect[0], -1.5 - 2 * expect[1]], abs=1e-15)
    assert w.tolist() == [2.0, -1.5]


def test_mean_loss_and_grad_sync_steps():
    loss = upd.MeanLoss()
    loss.pending += [torch.tensor(2.0), torch.tensor(3.5)]
    ctx = _ctx([_param([0.0])], [[4.0]])
    loss.apply(ctx)
    assert ctx.step_loss == 2.75 and loss.pending == []

    def halve(params, step_loss):  # a stand-in for the average over two replicas, one with zeros
        for p in params:
            p.grad.div_(2)
        return step_loss / 2

    upd.GradSync(halve).apply(ctx)
    assert ctx.step_loss == 1.375 and ctx.grad_params[0].grad.tolist() == [2.0]


# -- the order ----------------------------------------------------------------------------------------
_STEP_METHODS = [(NonFiniteGuard, "apply", "non_finite"), (upd.MeanLoss, "apply", "step_loss"),
                 (upd.GradSync, "apply", "grad_sync"), (upd.GradClip, "apply", "clip"),
                 (upd.PipeMareVelocity, "snapshot", "velocity.snapshot"),
                 (upd.WeightPrediction, "snapshot", "prediction.snapshot"),
                 (upd.ErrorFeedbackSteps, "snapshot", "error_feedback.snapshot"),
                 (upd.OptimizerStep, "apply", "optimizer"), (upd.ErrorFeedbackSteps, "correct", "error_feedback.correct"),
                 (upd.MasterCopy, "apply", "masters"), (upd.WeightPrediction, "record", "prediction.record"),
                 (upd.PipeMareVelocity, "update", "velocity.update")]


def _recording(monkeypatch) -> list[str]:
    ran: list[str] = []
    for cls, method, name in _STEP_METHODS:
        original = getattr(cls, method)

        def wrapped(self, ctx, _original=original, _name=name):
            ran.append(_name)
            return _original(self, ctx)

        monkeypatch.setattr(cls, method, wrapped)
    return ran


def _stage(**kw) -> StageExecutor:
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)
    masters = to_bf16(lin) if kw.get("precision") == "bf16" else None
    opt = torch.optim.SGD(masters if masters is not None else lin.parameters(), lr=0.1, momentum=0.9)
    return StageExecutor(0, 1, lin, lambda out, y: ((out.float() - y) ** 2).mean(),
                         lambda k: (torch.full((1, 2), float(k + 1)), torch.zeros(1, 2)), opt, 1.0,
                         masters=masters, **kw)


def test_the_executor_runs_the_declared_order(monkeypatch):
    """Every step on: the order the executor runs them in is UPDATE_ORDER, written out here so a
    reordering of the declaration shows too; the first part runs once, from prepare_update."""
    assert upd.UPDATE_ORDER == ("non_finite", "step_loss", "grad_sync", "clip", "velocity.snapshot",
                                "prediction.snapshot", "error_feedback.snapshot", "optimizer",
                                "error_feedback.correct", "masters", "prediction.record", "velocity.update")
    ran = _recording(monkeypatch)
    # prediction needs the live weights in the backward, PipeMare's velocity the corrected ones: two stages
    predicted = _stage(precision="bf16", error_feedback=1.0, predict_weights="bound", predict_bound=1,
                       clip_grad_norm=1.0, grad_sync=lambda params, loss: loss)
    corrected = _stage(backward_weights="corrected")
    for ex, expect in ((predicted, [n for n in upd.UPDATE_ORDER if not n.startswith("velocity")]),
                       (corrected, [n for n in upd.UPDATE_ORDER if n.split(".")[0] not in
                                    ("grad_sync", "prediction", "error_feedback", "masters")])):
        for t in range(2):
            ex.forward(t)
            ex.backward(t)
            ran.clear()
            ex.prepare_update()  # what a rank clipper does before exchanging norms
            assert ran == list(upd.PREPARE_STEPS if ex is predicted else ("non_finite", "step_loss"))
            ex.update()
            assert ran == expect


def test_the_recorded_prediction_is_the_update_the_bf16_weights_made_error_feedback_included():
    """The consequence of the order: ``prediction.record`` runs after error feedback's correction and
    the bf16 copy, so the predicted step is exactly what the live (bf16) weights moved by."""
    ex = _stage(precision="bf16", error_feedback=1.0, predict_weights="bound", predict_bound=1)
    for t in range(3):
        before = [p.detach().clone() for p in ex.params]
        ex.forward(t)
        ex.backward(t)
        ex.update()
        assert all(torch.equal(d, p.detach() - b) for d, p, b in zip(ex.last_update, ex.params, before))
    assert any(d.abs().sum() > 0 for d in ex.last_update)


def test_an_unknown_step_name_is_refused():
    with pytest.raises(ValueError, match=r"update steps \['warmup'\] are not in UPDATE_ORDER \(valid: non_finite, "):
        upd.ordered({"warmup": lambda ctx: None})
