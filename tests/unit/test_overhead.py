"""Asynchrony that pays: weight prediction, Muon's momentum, NAdam's settings, token budgets in
sweeps and the overhead study in its tiny size."""

import csv
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from unbubble.config import TrainConfig
from unbubble.errors import ConfigError
from unbubble.experiments import get_experiment
from unbubble.experiments import sweep as sweep_mod
from unbubble.experiments.stats import budget_overhead
from unbubble.experiments.sweep import SweepSpec, next_budget, run_sweep
from unbubble.optim import build_optimizer
from unbubble.runtime.executor import StageExecutor

from helpers import PUBLISHED_DATA, unpublished_rows


# -- weight prediction ([Note: weight prediction]) ---------------------------------------------------

def _executor(module, predict="bound", bound=2, lr=0.1, stage=0, n_stages=2):
    torch.manual_seed(0)
    xs = {k: torch.randn(3, 4) for k in range(8)}
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    return StageExecutor(stage, n_stages, module, None, lambda k: (xs[k], None), opt, 1.0, predict_weights=predict,
                         predict_bound=bound), xs


def _step(ex, k, grad):
    ex.forward(k)
    ex.backward(k, grad)
    ex.update()


def test_a_predicted_forward_equals_the_module_at_the_extrapolated_weights_exactly():
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    ex, xs = _executor(module, bound=2)
    g = torch.randn(3, 3)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    _step(ex, 0, g)
    after = {n: p.detach().clone() for n, p in module.named_parameters()}
    out = ex.forward(1)
    # independent reference: Ŵ = W + s (W − W_prev), s = 2, evaluated functionally
    w_hat = {n: torch.add(after[n], after[n] - before[n], alpha=2.0) for n in after}
    assert torch.equal(out, functional_call(module, w_hat, (xs[1],)).detach())
    assert not torch.equal(out, module(xs[1]).detach())  # the live weights give another output
    for n, p in module.named_parameters():  # and are restored exactly
        assert torch.equal(p.detach(), after[n])


def test_the_backward_of_a_predicted_forward_uses_the_current_weights():
    """A linear stage: y = x Ŵᵀ; after an update to W2 the input gradient is g W2 (current weights)
    and the weight gradient gᵀ x (forward-time activations), as in PACI without prediction."""
    torch.manual_seed(2)
    lin = nn.Linear(4, 3, bias=False)
    ex, _ = _executor(lin, bound=1, stage=1, n_stages=3)  # a middle stage: it receives its input
    ex.forward(0, torch.randn(3, 4))
    ex.backward(0, torch.randn(3, 3))
    ex.update()
    x1 = torch.randn(3, 4)
    ex.forward(1, x1)
    g = torch.randn(3, 3)
    ex.forward(2, torch.randn(3, 4))
    ex.backward(2, torch.randn(3, 3))
    ex.update()  # W changes while micro-batch 1 is in flight
    w2 = lin.weight.detach().clone()
    grad_in = ex.backward(1, g)
    assert torch.equal(grad_in, g @ w2)
    assert torch.allclose(lin.weight.grad, g.t() @ x1, rtol=0, atol=1e-6)


def test_prediction_with_zero_steps_is_paci_bit_for_bit():
    def run(predict):
        torch.manual_seed(3)
        module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        ex, _ = _executor(module, predict=predict, bound=0)
        outs = []
        for k in range(5):
            outs.append(ex.forward(k))
            ex.backward(k, torch.ones(3, 2))
            ex.update()
        return outs, [p.detach() for p in module.parameters()]

    (o1, w1), (o2, w2) = run("none"), run("bound")
    assert all(torch.equal(a, b) for a, b in zip(o1 + w1, o2 + w2))


def test_measured_prediction_uses_the_mean_drift_so_far():
    module = nn.Linear(4, 2)
    ex, _ = _executor(module, predict="measured")
    assert ex.predict_steps == 0.0  # no backward yet
    ex.forward(0)
    ex.forward(1)
    ex.backward(0, torch.ones(3, 2))  # Δ = 0
    ex.update()
    ex.backward(1, torch.ones(3, 2))  # Δ = 1 (one update since its forward)
    assert ex.predict_steps == 0.5
    assert ex.memory_bytes()["prediction_bytes"] == 2 * sum(p.numel() * 4 for p in module.parameters())


def _pipeline_job(predict):
    import functools

    from unbubble.pipeline import torch_optimizer
    from unbubble.runtime.job import PipelineJob
    from unbubble.schedules import get_schedule

    return PipelineJob(functools.partial(_stage), _mse, _batch, torch_optimizer(torch.optim.AdamW, lr=1e-2),
                       get_schedule("paci", n_stages=4, steps=6, a=2), predict_weights=predict)


def _stage(i):
    torch.manual_seed(i)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh())


def _batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def test_prediction_keeps_the_schedule_and_its_drift_but_changes_the_losses():
    from unbubble.runtime.emulator import run_emulator

    plain, predicted = run_emulator(_pipeline_job("none")), run_emulator(_pipeline_job("bound"))
    assert predicted.max_drift() == plain.max_drift() == [2, 1, 1, 0]  # ⌈(N−i)/a⌉, attained
    rows = lambda r: [(s, k, mb, v, wv) for s, k, mb, _, _, v, wv in r.trace.rows()]  # noqa: E731
    assert rows(predicted) == rows(plain)  # same actions and weight versions, so the same Δ
    assert predicted.step_losses[0] == plain.step_losses[0]  # nothing to extrapolate before the first updates
    assert predicted.step_losses[-1] != plain.step_losses[-1]


@pytest.mark.parametrize("fields,message", [
    ({"schedule": "1f1b-flush", "predict_weights": "bound"}, "predict_weights='bound' is for the never-flushed "
     "schedules whose backward runs on the current weights (paci, async-1f1b): schedule='1f1b-flush' is synchronous: no delay to predict across (set --predict-weights none)"),
    ({"schedule": "pipedream", "predict_weights": "measured"}, "predict_weights='measured' is for the never-flushed "
     "schedules whose backward runs on the current weights (paci, async-1f1b): schedule='pipedream' has no drift to predict across: its backward runs on the weights of its forward"),
    ({"schedule": "pipemare", "predict_weights": "bound"}, "predict_weights='bound' is for the never-flushed "
     "schedules whose backward runs on the current weights (paci, async-1f1b): schedule='pipemare' corrects the delay with its own velocity estimate (PipeMare's T2)"),
    ({"predict_weights": "bound", "recompute": "full"}, "predict_weights='bound' is invalid with recompute='full'"),
    ({"predict_weights": "ahead"}, "predict_weights='ahead' is invalid: must be one of none, bound, measured"),
    ({"muon_momentum": 1.0}, "muon_momentum=1.0 is invalid: must be in [0, 1)"),
])
def test_bad_prediction_and_momentum_settings_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**fields)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_predicted_memory_in_the_simulator():
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.hardware import get_hardware

    cfg, hw = make_model("gpt2-medium"), get_hardware("h200")
    plain, pred = analytic_model(cfg, 8, hw, 4), analytic_model(cfg, 8, hw, 4, predict_weights=True)
    assert pred.memory.extra_bytes == tuple(2 * w for w in plain.memory.weights_bytes)


# -- momentum remedies ----------------------------------------------------------------------------

def test_muon_momentum_update_rule_against_a_hand_computation():
    """torch.optim.Muon with μ: buffer B ← μB + (1−μ)g; Nesterov update (1−μ)g + μB, orthogonalised.
    Two steps with weight decay 0: B₂ = μ(1−μ)g₁ + (1−μ)g₂, and the step points along the polar
    factor UVᵀ of (1−μ)g₂ + μB₂ (Newton–Schulz approximates it: cosine > 0.95)."""
    torch.manual_seed(4)
    w = nn.Parameter(torch.randn(6, 4))
    mu, lr = 0.98, 0.01
    opt = build_optimizer("muon", [("h.weight", w)], 0, 1, 0, lr, (0.9, 0.95), 0.0, muon_momentum=mu)
    g1, g2 = torch.randn(6, 4), torch.randn(6, 4)
    for g in (g1, g2):
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
    buf = opt.state[w]["momentum_buffer"]
    assert torch.allclose(buf, mu * (1 - mu) * g1 + (1 - mu) * g2, rtol=1e-5, atol=1e-7)
    u, _, vh = torch.linalg.svd((1 - mu) * g2 + mu * buf, full_matrices=False)
    step = before - w.detach()
    cos = float((step * (u @ vh)).sum() / (step.norm() * (u @ vh).norm()))
    assert cos > 0.95
    assert math.isclose(float(step.norm()), lr * 0.2 * math.sqrt(6) * float((u @ vh).norm()), rel_tol=0.25)
    with pytest.raises(ConfigError, match=r"muon_momentum=1.5 is invalid: must be in \[0, 1\)"):
        build_optimizer("muon", [("h.weight", w)], 0, 1, 0, lr, (0.9, 0.95), 0.0, muon_momentum=1.5)


def test_nadam_with_the_asyncpp_settings_against_a_hand_computation():
    """NAdam β = (0.99, 0.999), ψ = 0.004, decoupled weight decay λ (PluralisResearch/AsyncPP:
    torch.optim.NAdam, decoupled_weight_decay=True): two steps written out."""
    torch.manual_seed(5)
    w = nn.Parameter(torch.randn(3, 2))
    lr, wd, (b1, b2), psi, eps = 1e-3, 0.1, (0.99, 0.999), 0.004, 1e-8
    opt = build_optimizer("nadam", [w], 0, 1, 0, lr, (b1, b2), wd)
    theta, m, v, prod = w.detach().clone().double(), 0.0, 0.0, 1.0
    for t in (1, 2):
        g = torch.randn(3, 2)
        w.grad = g.clone()
        opt.step()
        gd = g.double()
        theta = theta * (1 - lr * wd)
        mu_t, mu_next = b1 * (1 - 0.5 * 0.96 ** (t * psi)), b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        prod *= mu_t
        m = b1 * m + (1 - b1) * gd
        v = b2 * v + (1 - b2) * gd * gd
        denom = (v / (1 - b2 ** t)).sqrt() + eps
        theta = theta - lr * (1 - mu_t) / (1 - prod) * gd / denom - lr * mu_next / (1 - prod * mu_next) * m / denom
    assert torch.allclose(w.detach().double(), theta, rtol=1e-6, atol=1e-9)


# -- token budgets --------------------------------------------------------------------------------

def test_budget_overhead_interpolates_in_log_tokens():
    # final loss 2.0 at 1×, 1.6 at 2×: the target 1.8 lies halfway in log tokens, at √2 ×
    assert budget_overhead({1.0: 2.0, 2.0: 1.6}, 1.8) == (pytest.approx(math.sqrt(2)), "=")
    assert budget_overhead({0.5: 1.9, 1.0: 1.5}, 1.7) == (pytest.approx(math.sqrt(0.5)), "=")
    assert budget_overhead({1.0: 2.0, 1.5: 1.95}, 1.0) == (1.5, ">")
    assert budget_overhead({0.5: 1.0, 1.0: 0.9}, 1.2) == (0.5, "≤")
    assert budget_overhead({1.0: math.inf, 2.0: 1.0}, 1.5) == (2.0, "≤")


def test_next_budget_climbs_until_reached_and_skips_what_cannot_be_reached():
    budgets = (0.5, 1.5, 2, 3)
    assert next_budget(budgets, {1.0: 2.0}, 1.5) == 1.5
    assert next_budget(budgets, {1.0: 2.0, 1.5: 1.4}, 1.5) is None  # reached
    # 1 → 1.5 improved 0.1 nats: the line reaches 1.5 nats at 1.5 × (1.5)^4 ≈ 7.6 > 2: skipped
    assert next_budget(budgets, {1.0: 2.0, 1.5: 1.9}, 1.5) is None
    assert next_budget(budgets, {1.0: 2.0, 1.5: 1.6}, 1.5) == 2  # ≈ 1.74 ≤ 2: worth training
    # ≈ 2.25 > 2: the smallest budget the line says suffices, so the overhead is bracketed (was: None)
    assert next_budget(budgets, {1.0: 2.0, 1.5: 1.75}, 1.5) == 3
    assert next_budget((1.5, 2, 2.5, 3), {1.0: 2.0, 1.5: 1.75}, 1.5) == 2.5
    assert next_budget(budgets, {1.0: 2.0, 1.5: 2.1}, 1.5) is None  # no gain with more tokens
    assert next_budget(budgets, {1.0: 1.4}, 1.5) == 0.5  # ahead at 1×: bracket from below
    assert next_budget(budgets, {1.0: 1.4, 0.5: 1.6}, 1.5) is None


def _budget_spec(**kw):
    d = {"name": "b", "micro_batches": 4, "stages": [2], "lrs": [1e-3], "seeds": [0, 1], "budgets": [1.5, 2],
         "base": {"model": "tiny", "seq_len": 16, "micro_batch_size": 2, "eval_batches": 1, "warmup_min": 0},
         "methods": [{"label": "flush", "schedule": "1f1b-flush", "m": 2},
                     {"label": "paci", "schedule": "paci", "a": 2, "baseline": "flush"}]}
    d.update(kw)
    return d


def test_a_sweep_trains_budgets_per_seed_until_the_baseline_is_reached(tmp_path, monkeypatch):
    """A fake trainer: flush ends at 1.0; PACI's final loss falls with its tokens, seed 1 faster."""
    def fake_execute(run, spec, out):
        mb = spec.micro_batches_of(run)
        loss = 1.0 if run.method == "flush" else 1.3 - (1.2 if run.seed else 0.4) * (mb / 4 - 1)
        return {"run_id": run.run_id, "method": run.method, "stages": run.stages, "lr": run.lr, "seed": run.seed,
                "phase": run.phase, "budget": run.budget, "final_val_loss": loss, "wall_s": 0.0, "micro_batches": mb}

    monkeypatch.setattr(sweep_mod, "execute", fake_execute)
    monkeypatch.setattr(sweep_mod, "write_tables", lambda records, out: None)
    spec = SweepSpec.from_dict(_budget_spec())
    assert [spec.micro_batches_of(r) for r in spec.budget_runs([])] == []
    records = run_sweep(spec, tmp_path, workers=1)
    budget = [(r["seed"], r["budget"], r["micro_batches"]) for r in records if r["phase"] == "budget"]
    # seed 1 reaches 1.0 at 1.5× (0.7); seed 0 (1.3, 1.1: the line meets 1.0 at 1.8× ≤ 2×) trains 2× (0.9)
    assert budget == [(0, 1.5, 6), (1, 1.5, 6), (0, 2.0, 8)]


def test_budgets_target_each_seeds_own_twin(tmp_path, monkeypatch):
    """Paired: flush seed 0 ends at 1.0 and seed 1 at 1.2; PACI ends at 1.1 on both seeds. Against the
    twins' mean (1.1) neither seed needs a budget; paired, seed 0 (above its twin) trains 1.5× and seed 1
    (below its twin, no budget under 1) none."""
    def fake_execute(run, spec, out):
        loss = (1.0, 1.2)[run.seed] if run.method == "flush" else 1.1 - 0.2 * (run.budget - 1)
        return {"run_id": run.run_id, "method": run.method, "stages": run.stages, "lr": run.lr, "seed": run.seed,
                "phase": run.phase, "budget": run.budget, "final_val_loss": loss, "wall_s": 0.0,
                "micro_batches": spec.micro_batches_of(run)}

    monkeypatch.setattr(sweep_mod, "execute", fake_execute)
    monkeypatch.setattr(sweep_mod, "write_tables", lambda records, out: None)
    records = run_sweep(SweepSpec.from_dict(_budget_spec()), tmp_path, workers=1)
    assert [(r["seed"], r["budget"]) for r in records if r["phase"] == "budget"] == [(0, 1.5)]


@pytest.mark.parametrize("method,message", [
    ({"label": "paci", "schedule": "paci", "a": 2, "baseline": "nope"}, "method 'paci': baseline='nope' must name"),
    ({"label": "paci", "schedule": "paci", "a": 2, "baseline": "flush", "budgets": [1]}, "method 'paci': budget 1.0"),
    ({"label": "paci", "schedule": "paci", "a": 2, "horizon": 0}, "method 'paci': horizon=0.0 is invalid"),
])
def test_bad_budget_keys_name_the_method(method, message):
    with pytest.raises(ConfigError) as info:
        SweepSpec.from_dict(_budget_spec(methods=[{"label": "flush", "schedule": "1f1b-flush", "m": 2}, method]))
    assert str(info.value).startswith(message)


def test_overhead_study_tiny_values_and_analysis_from_the_csvs(tmp_path):
    run = get_experiment("overhead-study")
    run(tmp_path / "o", size="tiny", workers=1)
    rows = {r["method"]: r for r in csv.DictReader(open(tmp_path / "o" / "overhead_study_main.csv"))}
    runs = list(csv.DictReader(open(tmp_path / "o" / "runs.csv")))
    for label, row in rows.items():
        twin = float(row["flush twin"].split(" ± ")[0])
        mine = [r for r in runs if r["method"] == label and r["lr"] == rows[label]["tuned lr"].split()[0]]
        points = {}
        for r in mine:
            points.setdefault(int(r["seed"]), {})[float(r["budget"])] = float(r["final_val_loss"])
        assert len(points) == 2 and all(len(p) >= 2 for p in points.values())  # a budget beyond 1× per seed
        flush_runs = [float(r["final_val_loss"]) for r in runs if r["method"] == "1f1b-flush m=2"]
        assert twin == pytest.approx(sum(flush_runs) / len(flush_runs), abs=1e-3)
        assert row["token overhead ÷ flush"][0].isdigit() or row["token overhead ÷ flush"][0] in "≤>"
    horizon = list(csv.DictReader(open(tmp_path / "o" / "overhead_study_horizon.csv")))
    assert horizon and all(h["horizon"] == "2×" for h in horizon)
    # the tables come from runs.csv and curves.csv alone: the published ones rebuild to docs/results.md's figures
    published = run(tmp_path / "a", analyze=PUBLISHED_DATA / "overhead-study")
    assert "| paci a=4 | adamw β=(0.9, 0.95) | 0.001 | 2 | 2.243 ± 0.008 | 1.570 ± 0.034 (lr 0.01) | 0.673 | 1.5 | " \
           "> 1.50, > 1.50 |" in published.markdown
    assert unpublished_rows(published.markdown) == []


def test_train_prints_the_break_even_of_an_asynchronous_run():
    """On unit costs (F = 1, B = 2) at N = 4, m = a = 4 PACI is 1.125× as fast as interleaved-zb with
    v = 2, the fastest synchronous schedule there (the break-even table of docs/faq.md; 1.25× against
    ZB-H1 and ZBV); at m = 16 ZBV, within 1F1B-flush's activation memory, is as fast as PACI (its
    bubble vanishes across steps at F = I = W); a flushed run prints nothing."""
    from types import SimpleNamespace

    from unbubble.progress import break_even_line as _break_even_line
    from unbubble.schedules.registry import get_schedule
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.engine import run_policies
    from unbubble.sim.extrapolate import async_over_sync

    trace = run_policies(get_schedule("paci", 4, 8, a=4), UniformCosts(f=1.0, b=2.0))
    line = _break_even_line(TrainConfig(stages=4, a=4), SimpleNamespace(trace=trace))
    assert async_over_sync(UniformCosts(f=1.0, b=2.0), 4, 4)[0] == pytest.approx(1.125, abs=0.01)
    assert async_over_sync(UniformCosts(f=1.0, b=2.0), 4, 4, schedules=("zb-h1",))[0] == pytest.approx(1.25, abs=0.01)
    assert "is 1.12× as fast as the fastest synchronous one at m = 4 (interleaved-zb v=2);" in line
    assert "1F1B-flush's activation memory" not in line  # at m ≤ N every schedule fits: one figure

    trace16 = run_policies(get_schedule("paci", 4, 8, a=16), UniformCosts(f=1.0, b=2.0))
    line16 = _break_even_line(TrainConfig(stages=4, a=16), SimpleNamespace(trace=trace16))
    assert async_over_sync(UniformCosts(f=1.0, b=2.0), 4, 16, schedules=("zbv",))[0] == pytest.approx(1.0, abs=1e-9)
    assert "at m = 16 (zb-h2) (1.00× against zbv, the fastest within 1F1B-flush's" in line16
    assert _break_even_line(TrainConfig(schedule="1f1b-flush"), SimpleNamespace(trace=trace)) is None
    # a 4-layer model on 4 stages cannot run interleaved-zb's 8 chunks (train refuses it): the line names the
    # fastest schedule it can run, ZB-H1 at 1.25× (was: 1.12× against interleaved-zb, found by a user's trial)
    line4 = _break_even_line(TrainConfig(stages=4, a=4), SimpleNamespace(trace=trace), n_layer=4)
    assert "is 1.25× as fast as the fastest synchronous one at m = 4 (zb-h1);" in line4
    assert _break_even_line(TrainConfig(stages=4, a=4), SimpleNamespace(trace=trace), n_layer=8) == line


def test_an_emulated_run_reports_the_utilization_of_its_measured_costs_not_of_unit_costs():
    """Was: "simulated utilization" of the emulator's unit-cost (F = 1, B = 2) ordering, which describes no
    machine. 1F1B-flush, N = 2, m = 2, stage 1 twice as slow (F = 2, B = 4 s against 1, 2 s): stage 1 runs
    F0 1–3, B0 3–7, F1 7–9, B1 9–13; stage 0 F0, F1 by 2, B0 7–9, B1 13–15: a 15 s step, busy 6 s and 12 s,
    0.4 and 0.8 (by hand); on unit costs both stages would read 6/9 = 0.67."""
    from unbubble.schedules.registry import get_schedule
    from unbubble.sim.costs import PipelineCosts, StageCosts, UniformCosts
    from unbubble.sim.engine import run_policies
    from unbubble.sim.measured import simulated_on_measured

    costs = PipelineCosts((StageCosts.from_fb(1.0, 2.0, 0.0), StageCosts.from_fb(2.0, 4.0, 0.0)))
    flush = get_schedule("1f1b-flush", 2, 3, m=2)
    measured = run_policies(flush, costs)  # stands for the emulator's timings
    assert simulated_on_measured(flush, measured).utilization() == pytest.approx([0.4, 0.8], abs=1e-9)
    unit = run_policies(flush, UniformCosts(f=1.0, b=2.0)).utilization()
    assert unit == pytest.approx([6 / 9, 6 / 9], abs=1e-9)


def test_the_break_even_line_of_a_clipped_run_counts_the_barrier():
    """A run trained with --clip-scope sync is simulated with the all-reduce on every schedule, one with
    stale against the synchronous schedules on sync (docs/results.md's barrier table on unit costs,
    F = 1, B = 2, N = 4: 0.75 and 1.12 at m = 4; 0.92 and 1.03 at m = 16, where the line without a
    barrier says 1.00 against zb-h2); stage, or no clip, has no barrier: the plain line."""
    from types import SimpleNamespace

    from unbubble.progress import break_even_line as _break_even_line
    from unbubble.schedules.registry import get_schedule
    from unbubble.sim.barrier import GlobalOp
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.engine import run_policies
    from unbubble.sim.extrapolate import async_over_sync

    unit = UniformCosts(f=1.0, b=2.0)
    lines = {}
    for a in (4, 16):
        run = SimpleNamespace(trace=run_policies(get_schedule("paci", 4, 8, a=a), unit))
        for scope in (None, "sync", "stale", "stage"):
            clip = {} if scope is None else {"clip_grad_norm": 1.0, "clip_scope": scope}
            lines[a, scope] = _break_even_line(TrainConfig(stages=4, a=a, **clip), run)
    sync, stale = (GlobalOp("sync"), GlobalOp("sync")), (GlobalOp("stale"), GlobalOp("sync"))
    assert async_over_sync(unit, 4, 4, paci_op=sync[0], sync_op=sync[1]) == (pytest.approx(0.75), "interleaved-zb v=2")
    assert async_over_sync(unit, 4, 4, paci_op=stale[0], sync_op=stale[1])[0] == pytest.approx(1.125)
    assert async_over_sync(unit, 4, 16, paci_op=sync[0], sync_op=sync[1])[0] == pytest.approx(0.9167, abs=1e-4)
    assert async_over_sync(unit, 4, 16, paci_op=stale[0], sync_op=stale[1])[0] == pytest.approx(1.0312, abs=1e-4)

    assert lines[4, "sync"] == ("break-even: on these stages' measured costs with --clip-scope sync's per-update "
                                "all-reduce on every schedule (a barrier), this schedule is 0.75× as fast as the "
                                "fastest synchronous one at m = 4 (interleaved-zb v=2); it needs at least their tokens, so "
                                "asynchrony does not pay here (docs/faq.md#when-does-asynchrony-pay)")
    assert lines[4, "stale"].startswith("break-even: on these stages' measured costs with --clip-scope stale's "
                                        "all-reduce here (no wait) and sync's on the synchronous schedules (a "
                                        "barrier), this schedule is 1.12× as fast as the fastest synchronous one "
                                        "at m = 4 (interleaved-zb v=2);")
    assert "is 0.92× as fast as the fastest synchronous one at m = 16 (interleaved-zb v=2)" in lines[16, "sync"]
    assert "is 1.03× as fast as the fastest synchronous one at m = 16 (interleaved-zb v=2)" in lines[16, "stale"]
    assert "is 1.00× as fast as the fastest synchronous one at m = 16 (zb-h2)" in lines[16, None]
    for a in (4, 16):  # a stage-local clip needs no all-reduce: the line without a barrier
        assert lines[a, "stage"] == lines[a, None] and "clip-scope" not in lines[a, None]


def test_a_longer_horizon_and_a_budget_scale_the_micro_batches():
    from pathlib import Path

    from unbubble.experiments.sweep import RunSpec

    spec = SweepSpec.from_dict(_budget_spec(methods=[
        {"label": "flush", "schedule": "1f1b-flush", "m": 2},
        {"label": "flush @4×", "schedule": "1f1b-flush", "m": 2, "horizon": 4, "lr_from": "flush"}]))
    one, four = (spec.config(RunSpec(label, {"schedule": "1f1b-flush", "m": 2}, 2, 1e-3, 0, "tune"), Path("x"))
                 for label in ("flush", "flush @4×"))
    assert (one.steps, four.steps) == (2, 8)
    budget = spec.config(RunSpec("flush", {"schedule": "1f1b-flush", "m": 2}, 2, 1e-3, 0, "budget", 1.5), Path("x"))
    assert budget.steps == 3 and budget.run_dir.endswith("-b1.5")


@pytest.mark.parametrize("n,m", [(4, 4), (8, 4), (8, 16)])
def test_break_even_against_flush_is_the_analytic_bubble_ratio(n, m):
    """With unit costs PACI over 1F1B-flush is (m + N − 1)/m (docs/architecture.md#schedules-and-their-semantics); the fastest synchronous
    schedule is never slower than flush."""
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.extrapolate import async_over_sync

    costs = UniformCosts(f=1.0, b=2.0)
    ratio, name = async_over_sync(costs, n, m, schedules=("1f1b-flush",))
    assert name == "1f1b-flush" and ratio == pytest.approx((m + n - 1) / m, rel=1e-6)
    assert async_over_sync(costs, n, m)[0] <= ratio + 1e-9


@pytest.mark.parametrize("n,m", [(8, 8), (4, 8), (16, 16)])
def test_the_fastest_synchronous_schedule_includes_interleaved_zero_bubble(n, m):
    """Unit costs, N | m: interleaved-zb (v = 2 chunks, each half a stage) takes 3·v·m + N − 1 chunk
    actions of half a unit per step against PACI's 3m units, and beats ZB-H1's 3m + N − 1; at
    1F1B-flush's memory it is the fastest of the one-chunk and looped schedules (zb-h2, when m ≥ 2N − 1
    zero-bubble across steps, holds 2N); ZBV, at that memory too, has zero bubble across steps once
    m ≥ 2N − 1 (its source's condition, arXiv 2401.10241 §6) and is then as fast as PACI."""
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.extrapolate import SYNCHRONOUS, async_over_sync

    assert {"looped-bfs", "interleaved-zb", "zbv", "dualpipev"} <= set(SYNCHRONOUS)
    loops = [s for s in SYNCHRONOUS if s not in ("zbv", "dualpipev")]
    costs, v = UniformCosts(f=1.0, b=2.0), 2
    ratio, name = async_over_sync(costs, n, m, memory="1f1b", schedules=loops)
    assert name == "interleaved-zb v=2" and ratio == pytest.approx((3 * v * m + n - 1) / (3 * v * m), rel=1e-9)
    with_v = async_over_sync(costs, n, m, memory="1f1b")
    assert with_v == ((pytest.approx(1.0), "zbv") if m >= 2 * n - 1 else (ratio, name))
    assert async_over_sync(costs, n, m, schedules=("zb-h1",))[0] == pytest.approx((3 * m + n - 1) / (3 * m))
    unconstrained = async_over_sync(costs, n, m)
    assert unconstrained[0] <= ratio + 1e-9
    if m >= 2 * n - 1:
        assert unconstrained == (pytest.approx(1.0), "zb-h2")


def test_interleaved_zero_bubble_loses_where_its_extra_messages_cost():
    """Twice the messages of a one-chunk schedule: with a send latency of one unit (F = 1, B = 2) at
    N = 4, m = 4 zb-h2 beats interleaved-zb, and without it interleaved-zb wins."""
    from unbubble.sim.costs import UniformCosts
    from unbubble.sim.extrapolate import async_over_sync

    assert async_over_sync(UniformCosts(f=1.0, b=2.0), 4, 4)[1] == "interleaved-zb v=2"
    ratio, name = async_over_sync(UniformCosts(f=1.0, b=2.0, latency=1.0), 4, 4)
    assert name == "zb-h2" and ratio == pytest.approx(7 / 6)


def test_the_1f1b_memory_variant_keeps_only_schedules_within_1f1b_flushs_activations():
    """The simulator's memory model, busiest device, in stage-sized micro-batches (a chunk counts 1/v):
    at N = 8, m = 16 1F1B-flush, ZB-H1, interleaved-zb and zbv hold 8, ZB-H2 and looped-bfs 16 (2N, m),
    interleaved 1F1B 11.5, dualpipev 8.5 (2N + 1 chunks); at m = 4 ≤ N every schedule holds m
    (interleaved 1F1B and dualpipev, which needs m ≥ 2N, do not run)."""
    from unbubble.sim.extrapolate import SYNCHRONOUS, peak_activations, synchronous_options

    held = {s: peak_activations(s, 8, 16) for s in SYNCHRONOUS}
    assert held == {"1f1b-flush": 8, "zb-h1": 8, "zb-h2": 16, "interleaved-1f1b": 11.5, "looped-bfs": 16,
                    "interleaved-zb": 8, "zbv": 8, "dualpipev": 8.5}
    assert synchronous_options(8, 16, memory="1f1b") == ["1f1b-flush", "zb-h1", "interleaved-zb", "zbv"]
    assert synchronous_options(8, 16) == list(SYNCHRONOUS)
    assert synchronous_options(8, 4, memory="1f1b") == [s for s in SYNCHRONOUS
                                                        if s not in ("interleaved-1f1b", "dualpipev")]
    assert {s: peak_activations(s, 8, 4) for s in SYNCHRONOUS} == {
        "1f1b-flush": 4, "zb-h1": 4, "zb-h2": 4, "interleaved-1f1b": None, "looped-bfs": 4, "interleaved-zb": 4,
        "zbv": 4, "dualpipev": None}
    with pytest.raises(ConfigError, match="memory='half'"):
        synchronous_options(8, 4, memory="half")


def test_break_even_rows_at_1f1b_memory_use_the_shared_selection():
    from unbubble.experiments.overhead import break_even_rows

    rows = break_even_rows(ns=(8,), ms=(16,), memory="1f1b")
    unit = next(r for r in rows if r["setup"].startswith("unit"))
    assert unit["m=16"] == "1.00 (zbv)"  # zero bubble across steps at 1F1B's memory (m = 16 ≥ 2N − 1)
    assert next(r for r in break_even_rows(ns=(8,), ms=(16,)) if r["setup"].startswith("unit"))["m=16"] == \
        "1.00 (zb-h2)"
