"""The simulator under recomputation and precision: memory counted from the trace equals what the
executor measured, costs gain one forward per backward, the CLI predicts both."""

import dataclasses
import types

import pytest
import torch

from unbubble.errors import ConfigError
from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule
from unbubble.sim import PipelineCosts, StageCosts
from unbubble.sim.analytic import analytic_model, get_precision, make_model
from unbubble.sim.hardware import get_hardware
from unbubble.sim.measured import measured_memory
from unbubble.sim.memory import MemorySpec, peak_memory
from unbubble.sim.result import simulate
from helpers import tiny_gpt_job

torch.set_num_threads(1)


def test_recompute_memory_hand_computed_1f1b_flush():
    """N=2, m=4, 10 bytes of activations per micro-batch of which the input is 1: stage 0 holds ≤ 2
    micro-batches, stage 1 one. Keeping activations: 20 and 10; recomputing: 2·1 inputs + the 9
    bytes re-created for the one backward = 11, and 1 + 9 = 10."""
    sched = get_schedule("1f1b-flush", 2, steps=2, m=4)
    costs = PipelineCosts((StageCosts.from_fb(1.0, 2.0),) * 2)
    spec = MemorySpec.uniform(2, weights=5.0, act=10.0)
    kept = simulate(sched, costs, spec).memory
    rec = simulate(sched, costs, spec.with_recompute((1.0, 1.0))).memory
    assert [m.activations for m in kept] == [20.0, 10.0]
    assert [m.activations for m in rec] == [11.0, 10.0]
    assert [m.peak for m in rec] == [16.0, 15.0]  # + the 5 bytes of weights
    # split backward (ZB-H1): the recomputed bytes live from I to W, with the input. Stage 0 runs
    # F0 F1 I0 W0 …: 2·1 + 9; stage 1 runs F0 I0 F1 I1 W0 …: two recomputed micro-batches, 2·(1 + 9)
    zb = simulate(get_schedule("zb-h1", 2, steps=1, m=4), costs, spec.with_recompute((1.0, 1.0))).memory
    assert [m.activations for m in zb] == [11.0, 20.0]


def test_recompute_costs_add_one_forward_per_backward():
    """1F1B-flush makespan (m + N − 1)(F + B) with F=1, B=2 becomes (m + N − 1)(F + B + F): 4/3."""
    sched = get_schedule("1f1b-flush", 4, steps=1, m=8)
    costs = PipelineCosts((StageCosts(1.0, 2.0, 1.2, 0.8),) * 4)
    rc = costs.with_recompute()
    assert rc.stages[0].as_list() == [1.0, 3.0, 2.2, 0.8, 0.0]
    assert simulate(sched, costs).makespan_s == pytest.approx(11 * 3)
    assert simulate(sched, rc).makespan_s == pytest.approx(11 * 4)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["paci", "1f1b-flush"])
def test_sim_memory_from_a_run_equals_the_executor_measurement(name, precision):
    """Sizes measured by a run that keeps its activations, counted over the run's own trace by
    ``peak_memory``, give the executor's measured peaks, for that run and (with_recompute) for a run
    that recomputes: activations (+ autocast's weight copies) and weights (parameters)."""
    sched = get_schedule(name, 4, steps=2, a=4, m=4)
    runs = {r: run_emulator(dataclasses.replace(tiny_gpt_job(sched), precision=precision, recompute=r))
            for r in ("none", "full")}
    calib = types.SimpleNamespace(summary={"memory": runs["none"].memory, "recompute": "none"}, schedule=sched)
    for r, res in runs.items():
        spec = measured_memory(calib, recompute=r == "full")
        predicted = peak_memory(res.sim_trace, spec)
        for s, (p, m) in enumerate(zip(predicted, res.memory)):
            assert p.activations == m["activation_bytes"] + m["weight_copy_bytes"], (r, s)
            assert p.weights == m["param_bytes"]
    assert sum(m["activation_bytes"] for m in runs["full"].memory) < sum(
        m["activation_bytes"] for m in runs["none"].memory)


def test_analytic_precision_and_recompute():
    """gpt2-medium on 8 H200s, b=4: the fp32 state is 16 bytes per parameter (4 + 4 + 8) as is bf16's
    (2 + 4 + 12); fp32 compute takes twice as long (TF32); bf16-autocast holds a 2-byte copy of every
    weight matrix per micro-batch in flight; recomputation keeps s·b·h boundary elements per
    micro-batch and adds F to every B and I."""
    cfg, hw = make_model("gpt2-medium"), get_hardware("h200")
    base = analytic_model(cfg, 8, hw, 4)
    fp32 = analytic_model(cfg, 8, hw, 4, precision=get_precision("fp32"))
    auto = analytic_model(cfg, 8, hw, 4, precision=get_precision("bf16-autocast"))
    rec = analytic_model(cfg, 8, hw, 4, recompute=True)
    n3 = base.params[3]
    assert base.memory.weights_bytes[3] + base.memory.grads_bytes[3] + base.memory.optimizer_bytes[3] == 18 * n3
    assert fp32.memory.weights_bytes[3] + fp32.memory.grads_bytes[3] + fp32.memory.optimizer_bytes[3] == 16 * n3
    assert fp32.costs.stages[3].f_s == pytest.approx(2 * base.costs.stages[3].f_s)
    layers = len(base.stage_layers[3])
    matrix = layers * 12 * cfg.n_embd ** 2
    assert auto.memory.act_bytes[3] - base.memory.act_bytes[3] == pytest.approx(2 * matrix)
    sbh = 4 * cfg.block_size * cfg.n_embd
    assert rec.memory.act_bytes == (4 * cfg.block_size * 8,) + (2.0 * sbh,) * 7
    assert rec.memory.recomputed_bytes[3] == base.memory.act_bytes[3] - 2 * sbh
    st, sr = base.costs.stages[3], rec.costs.stages[3]
    assert (sr.b_s, sr.i_s, sr.w_s) == pytest.approx((st.b_s + st.f_s, st.i_s + st.f_s, st.w_s))


def test_memory_spec_recompute_errors():
    spec = MemorySpec.uniform(2, act=10.0)
    with pytest.raises(ConfigError, match=r"input_bytes\[1\]=11.0 is invalid: must be in \[0, act_bytes\[1\]=10.0\]"):
        spec.with_recompute((1.0, 11.0))
    with pytest.raises(ConfigError, match="already recomputes"):
        spec.with_recompute((1.0, 1.0)).with_recompute((1.0, 1.0))


def test_cli_simulate_recompute(tmp_path):
    """``unbubble simulate --recompute full`` (analytic gpt2, 4 H100s): peak activations drop, tokens/s
    drops by at most the extra forward's share (3/4 with B = 2F, bubbles aside)."""
    import csv

    from click.testing import CliRunner

    from unbubble.cli import cli

    rows = {}
    for r in ("none", "full"):
        out = tmp_path / r
        res = CliRunner().invoke(cli, ["-q", "simulate", "--model", "gpt2", "--hardware", "h100", "--stages", "4",
                                       "--micro-batch-size", "2", "--schedule", "1f1b-flush", "--m", "8",
                                       "--recompute", r, "--out", str(out), "--format", "csv"])
        assert res.exit_code == 0, res.output
        rows[r] = list(csv.DictReader((out / "summary.csv").open()))[0]
    none, full = rows["none"], rows["full"]
    ratio = float(full["steady_tokens_per_s"]) / float(none["steady_tokens_per_s"])
    assert 0.70 < ratio < 0.80
    assert float(full["peak_memory_bytes"]) < float(none["peak_memory_bytes"])


@pytest.mark.parametrize("args,msg", [
    (["--uniform", "1:2", "--precision", "fp32"], "--precision needs the analytic model"),
    (["--recompute", "some"], "Invalid value for '--recompute'"),
])
def test_cli_simulate_refuses_bad_modes(args, msg, tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    res = CliRunner().invoke(cli, ["-q", "simulate", "--out", str(tmp_path / "x"), *args])
    assert res.exit_code == 2
    assert msg in res.output
