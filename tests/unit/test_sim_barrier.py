"""The simulator and the planner count barriers (issue 34, item 3): a per-update global operation
(the gradient-norm all-reduce of global clipping, [Note: the barrier] in docs/architecture.md) against
hand computations and analytic bubble formulas on unit costs.

Unit costs here are F = B = 1 (a split backward's I and W take half of B each, as the schedules
split it), U = 0 and no send latency, unless a test says otherwise. "Per-update time" is the
steady-state period: micro-batches per update ÷ the simulator's steady throughput.
"""

import math

import pytest
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.errors import ConfigError
from unbubble.schedules.registry import get_schedule
from unbubble.schedules.clip import stale_lag
from unbubble.sim.barrier import GlobalOp, allreduce_latency
from unbubble.sim.costs import UniformCosts
from unbubble.sim.extrapolate import SYNCHRONOUS, async_over_sync, chunk_costs
from unbubble.sim.result import simulate

UNIT = UniformCosts(f=1.0, b=1.0)


def _period(sched, costs=UNIT, op=None) -> float:
    """Seconds per update in steady state."""
    return sched.mb_per_step / simulate(sched, costs, global_op=op).steady_samples_per_s


@pytest.mark.parametrize("n,m", [(4, 8), (4, 12), (8, 16), (8, 24)])
def test_zb_h2_with_a_barrier_pays_its_flushed_step_every_update(n, m):
    """ZB-H2, m ≥ 2N: by hand, one isolated step takes (N − 1)·F + m·(F + B) = N − 1 + 2m: the last
    stage starts after N − 1 forwards and then never idles (F, I pairs, then its deferred W's), and
    it finishes last because its m W's outlast stage 0's wait for the last I, (N − 1)·I + W ≤ m·W.
    With a barrier no stage starts update t + 1 before every stage has finished update t, so every
    update takes exactly that (+ λ); without one ZB-H2 overlaps consecutive updates and is faster."""
    sched = get_schedule("zb-h2", n, 6, m=m)
    flushed = n - 1 + 2 * m
    assert _period(sched, op=GlobalOp("sync")) == pytest.approx(flushed, rel=1e-12)
    assert simulate(get_schedule("zb-h2", n, 1, m=m), UNIT).makespan_s == pytest.approx(flushed, rel=1e-12)
    assert _period(sched, op=GlobalOp("sync", latency_s=0.25)) == pytest.approx(flushed + 0.25, rel=1e-12)
    assert _period(sched) < flushed - 0.5  # the across-update overlap the barrier takes away
    assert _period(sched, op=GlobalOp("stale")) == pytest.approx(_period(sched), rel=1e-12)  # nobody waits


@pytest.mark.parametrize("n,m", [(4, 4), (4, 8), (8, 8), (8, 16)])
def test_1f1b_flush_with_a_barrier_is_unchanged_but_for_the_latency(n, m):
    """1F1B-flush's step is (m + N − 1)·(F + B) (docs/architecture.md#schedules-and-their-semantics) with or without a barrier: stage 0's
    last backward ends the step and its next forward waits for it anyway; the barrier adds λ."""
    sched = get_schedule("1f1b-flush", n, 4, m=m)
    step = 2 * (m + n - 1)
    assert _period(sched) == pytest.approx(step, rel=1e-12)
    assert _period(sched, op=GlobalOp("sync")) == pytest.approx(step, rel=1e-12)
    assert _period(sched, op=GlobalOp("sync", latency_s=0.5)) == pytest.approx(step + 0.5, rel=1e-12)
    for name in ("zb-h1", "interleaved-1f1b"):  # flushed too: nothing to lose
        s = get_schedule(name, n, 4, m=m)
        c = chunk_costs(UNIT, n, s.virtual, s.placement)
        assert _period(s, c, GlobalOp("sync")) == pytest.approx(_period(s, c), rel=1e-12), name


@pytest.mark.parametrize("n,m", [(4, 8), (4, 16), (8, 16)])
def test_zbv_with_a_barrier_pays_its_flushed_step_every_update(n, m):
    """ZBV (2 chunks per device in a V, each half a stage): with a barrier each update takes exactly
    one isolated step's makespan; without one its updates overlap (from m ≥ 2N − 1 its bubble
    vanishes across updates at F = I = W; here F = 2I = 2W)."""
    sched = get_schedule("zbv", n, 6, m=m)
    costs = chunk_costs(UNIT, n, 2, "v")
    one = simulate(get_schedule("zbv", n, 1, m=m), costs).makespan_s
    assert _period(sched, costs, GlobalOp("sync")) == pytest.approx(one, rel=1e-12)
    assert _period(sched, costs) < one - 0.25


def test_paci_sync_by_hand_on_two_and_four_stages():
    """PACI with a blocking all-reduce per update, by hand (F = B = 1, λ = 0).

    N = 2, a = 1. t = 0–1 stage 0 F0; 1–2 stage 0 F1 ∥ stage 1 F0; 2–3 stage 1 B0 (stage 0 holds
    its cap of 2); 3 stage 1 reaches update 1 and waits; 3–4 stage 0 B0; 4 stage 0 reaches it:
    R_1 = 4, both step at 4. Then 4–5 stage 0 F2 ∥ stage 1 F1, 5–6 stage 1 B1, 6–7 stage 0 B1,
    R_2 = 7: one update per 3 units (2 without the barrier), stage 1 idle 1 of them.
    In general N = 2 takes 2a + 1: after the step both stages restart together; the last stage's
    j-th backward ends at 2j, stage 0's at 2j + 1.

    N = 4, a = 1. Fill: stage s forwards at s … 3 (caps 4, 3, 2, 1); 4–5 stage 3 B0, 5–6 stage 2
    B0, 6–7 stage 1 B0, 7–8 stage 0 B0 (each waiting stage reached update 1 when its B0 ended);
    R_1 = 8. Then every stage forwards one micro-batch at 8–9 (its input arrived during the fill),
    and B1 walks back 9–10, 10–11, 11–12, 12–13: R_2 = 13, one update per 5 units: 2a + N − 1,
    a·(F + B) of work plus the (N − 1)·B the update's last gradient takes from the last stage to
    the first, while every other stage waits.
    """
    r = simulate(get_schedule("paci", 2, 4, a=1), UNIT, global_op=GlobalOp("sync"))
    ups = [(rec.action.stage, rec.start) for rec in r.trace.records if rec.action.kind.value == "U"]
    assert ups == [(0, 4.0), (1, 4.0), (0, 7.0), (1, 7.0), (0, 10.0), (1, 10.0), (0, 13.0), (1, 13.0)]
    log = r.trace.global_op_log
    assert log.completed == {1: 4.0, 2: 7.0, 3: 10.0, 4: 13.0}
    assert log.waits() == {(0, 1): 0.0, (1, 1): 1.0, (0, 2): 0.0, (1, 2): 1.0, (0, 3): 0.0, (1, 3): 1.0,
                           (0, 4): 0.0, (1, 4): 1.0}
    r4 = simulate(get_schedule("paci", 4, 4, a=1), UNIT, global_op=GlobalOp("sync"))
    assert [rec.start for rec in r4.trace.records if rec.action.kind.value == "U" and rec.action.stage == 3] == \
        [8.0, 13.0, 18.0, 23.0]
    for n in (2, 4, 8):
        for a in (1, 2, 4):
            sched = get_schedule("paci", n, max(16, 64 // a), a=a)
            assert _period(sched) == pytest.approx(2 * a, rel=1e-12)  # no barrier: no bubble
            assert _period(sched, op=GlobalOp("sync")) == pytest.approx(2 * a + n - 1, rel=1e-12), (n, a)
            assert _period(sched, op=GlobalOp("sync", latency_s=0.5)) == pytest.approx(2 * a + n - 1 + 0.5), (n, a)


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("a", [1, 2, 4, 8])
def test_paci_stale_no_stage_waits_for_the_norm_in_steady_state(n, a):
    """With ``stale`` and the runtime's s = ⌈N/a⌉ (and with ⌈(N − 1)/a⌉ + 1, never smaller), the
    all-reduce of update t − s has completed before every stage reaches update t, in the steady window
    (updates ⌊S/4⌋ … S − ⌊S/4⌋, as the steady throughput) and in fact over the whole run: on F = B = 1
    and on F = 1, B = 2 with an all-reduce latency of a quarter forward; PACI's throughput is then the
    one without the barrier."""
    steps = max(16, -(-16 * n // a))
    sched = get_schedule("paci", n, steps, a=a)
    s = stale_lag(n, a)
    assert s == math.ceil(n / a) == (n - 1) // a + 1 <= math.ceil((n - 1) / a) + 1
    for lag in sorted({s, math.ceil((n - 1) / a) + 1}):
        for costs, lam in ((UNIT, 0.0), (UniformCosts(f=1.0, b=2.0), 0.25)):
            res = simulate(sched, costs, global_op=GlobalOp("stale", lam, lag=None if lag == s else lag))
            log = res.trace.global_op_log
            assert log.lag == lag
            late = log.norm_lateness()
            lo, hi = steps // 4, steps - steps // 4
            assert {t for _, t in late} == set(range(lag + 1, steps + 1))
            assert max(v for (_, t), v in late.items() if lo <= t <= hi) <= 0.0
            assert max(log.waits().values()) == 0.0
            assert res.steady_samples_per_s == pytest.approx(simulate(sched, costs).steady_samples_per_s, rel=1e-12)


def test_stale_at_the_runtimes_lag_never_waits_under_jitter():
    """⌈N/a⌉ holds by causality (runtime/clipping.py, [Note: stale lag]): when a stage reaches update t
    every stage has reached update t − s, so with λ = 0 the norm is there at every update of the
    run, whatever the durations: jittered costs (σ = 0.5) and a slow stage."""
    from unbubble.sim.costs import PipelineCosts, StageCosts, Straggler

    for n, a in ((8, 1), (8, 3), (16, 4)):
        sched = get_schedule("paci", n, max(12, -(-8 * n // a)), a=a)
        for seed in range(3):
            costs = PipelineCosts(tuple(StageCosts.from_fb(1.0, 2.0) for _ in range(n)), jitter=0.5, seed=seed,
                                  stragglers=(Straggler(seed % n, 3.0, 5.0, 40.0),))
            log = simulate(sched, costs, global_op=GlobalOp("stale")).trace.global_op_log
            assert max(log.waits().values()) == 0.0 and max(log.norm_lateness().values()) <= 0.0, (n, a, seed)


def _smallest_lag(n, a, costs, lam=0.0):
    steps = max(16, -(-16 * n // a))
    sched = get_schedule("paci", n, steps, a=a)
    lo, hi = steps // 4, steps - steps // 4
    for lag in range(1, math.ceil((n - 1) / a) + 2):
        late = simulate(sched, costs, global_op=GlobalOp("stale", lam, lag=lag)).trace.global_op_log.norm_lateness()
        if max((v for (_, t), v in late.items() if lo <= t <= hi), default=0.0) <= 0.0:
            return lag
    return None


@pytest.mark.parametrize("n,a", [(4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (8, 8), (16, 2), (16, 8)])
def test_the_smallest_stale_lag_is_the_backward_wave_over_an_update(n, a):
    """The smallest s for which no stage waits in steady state: stage 0 reaches update t (N − 1)·B
    after the last stage (the update's last gradient crosses N − 1 stages) while the last stage
    completes an update every a·(F + B), so s = ⌈(N − 1)·B / (a·(F + B))⌉ with λ = 0 (a tie is on
    time), ⌊…⌋ + 1 with λ > 0. Never more than the runtime's ⌈N/a⌉ = ⌊(N − 1)/a⌋ + 1 (B < F + B),
    which holds by causality whatever the costs: that lag is safe, and tight only as B/(F + B) → 1."""
    for f, b in ((1.0, 1.0), (1.0, 2.0)):
        x = (n - 1) * b / (a * (f + b))
        assert _smallest_lag(n, a, UniformCosts(f=f, b=b)) == max(1, math.ceil(x)), (f, b)
        assert _smallest_lag(n, a, UniformCosts(f=f, b=b), lam=0.01) == math.floor(x) + 1, (f, b)
        assert math.floor(x) + 1 <= stale_lag(n, a) <= math.ceil((n - 1) / a) + 1


def test_every_synchronous_schedule_runs_under_a_barrier_and_never_gains():
    """Chunked schedules update their chunks together at the end of a step (one all-reduce per
    device), so none deadlocks; a barrier never makes a schedule faster on unit costs; DualPipeV's
    V too; with ``stale`` at the runtime's lag of 1 for flushed schedules nobody waits."""
    n, m = 4, 8
    for name in SYNCHRONOUS:
        sched = get_schedule(name, n, 4, m=m)
        costs = chunk_costs(UNIT, n, sched.virtual, sched.placement)
        free, sync = _period(sched, costs), _period(sched, costs, GlobalOp("sync"))
        assert sync >= free - 1e-9, name
        stale = simulate(sched, costs, global_op=GlobalOp("stale"))
        assert stale.trace.global_op_log.lag == 1 and max(stale.trace.global_op_log.waits().values()) == 0.0, name
        assert _period(sched, costs, GlobalOp("stale")) == pytest.approx(free, rel=1e-12), name


def test_local_norm_time_is_part_of_the_update():
    """``stage`` (no all-reduce) costs each stage's local norm ν on its update, nothing more; with
    ν = 0 every scope but sync leaves the trace's times as without the operation, and ``none`` is
    the fast engine's run exactly."""
    sched = get_schedule("1f1b-flush", 4, 4, m=4)
    base = simulate(sched, UNIT)
    assert [r[3:5] for r in simulate(sched, UNIT, global_op=GlobalOp("none")).trace.rows()] == \
        [r[3:5] for r in base.trace.rows()]
    local = simulate(sched, UNIT, global_op=GlobalOp("stage", norm_s=0.25))
    assert _period(sched, op=GlobalOp("stage", norm_s=0.25)) == pytest.approx(_period(sched) + 0.25)
    assert sorted(r.end - r.start for r in local.trace.records if r.action.kind.value == "U") == [0.25] * 16
    assert _period(sched, op=GlobalOp("sync", norm_s=0.25, latency_s=0.5)) == pytest.approx(_period(sched) + 0.75)


def test_break_even_with_a_barrier_against_1f1b_flush_is_the_analytic_ratio():
    """F = 1, B = 2 (the break-even table's unit costs), both with ``sync``: 1F1B-flush takes
    (m + N − 1)·3 per update, PACI a·3 + (N − 1)·2 (test_paci_sync_by_hand's wave with B = 2);
    with ``stale`` PACI keeps its a·3."""
    costs = UniformCosts(f=1.0, b=2.0)
    for n, m in ((4, 4), (8, 8), (8, 16)):
        ratio, name = async_over_sync(costs, n, m, schedules=("1f1b-flush",), paci_op=GlobalOp("sync"),
                                      sync_op=GlobalOp("sync"))
        assert name == "1f1b-flush" and ratio == pytest.approx(3 * (m + n - 1) / (3 * m + 2 * (n - 1)), rel=1e-9)
        stale, _ = async_over_sync(costs, n, m, schedules=("1f1b-flush",), paci_op=GlobalOp("stale"),
                                   sync_op=GlobalOp("sync"))
        assert stale == pytest.approx((m + n - 1) / m, rel=1e-9)


def test_allreduce_latency_is_a_ring_of_the_tables_links():
    from unbubble.sim.hardware import get_hardware

    hw = get_hardware("h200")
    assert allreduce_latency(hw, 1) == 0.0
    # 2(R − 1) hops of the slowest link's latency + 2(R − 1)/R of 4 bytes over its bandwidth
    assert allreduce_latency(hw, 8) == pytest.approx(14 * hw.intra_latency_s + 14 / 8 * 4 / hw.intra_node_bytes_per_s)
    assert allreduce_latency(hw, 16) == pytest.approx(30 * hw.inter_latency_s + 30 / 16 * 4 / hw.inter_node_bytes_per_s)


def test_bad_global_operations_get_one_line_each():
    with pytest.raises(ConfigError, match=r"^clip_scope='synch' is invalid \(did you mean 'sync'\?\): must be one of "
                                          r"none, stage, sync, stale \(set --clip-scope\)$"):
        GlobalOp("synch")
    with pytest.raises(ConfigError, match=r"^latency_s=-1 is invalid: must be a finite number ≥ 0 \(seconds\)$"):
        GlobalOp("sync", latency_s=-1)
    with pytest.raises(ConfigError, match=r"^lag=0 is invalid: the stale norm's lag must be an integer ≥ 1"):
        GlobalOp("stale", lag=0)
    with pytest.raises(ConfigError, match="norm_s has 2 entries but the schedule has 4 stages"):
        simulate(get_schedule("1f1b-flush", 4, 2, m=4), UNIT, global_op=GlobalOp("sync", norm_s=(0.0, 0.0)))


def _sim_error(args):
    res = CliRunner().invoke(cli, ["-q", "simulate", "--uniform", "1:2", "--stages", "4", *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0].removeprefix("error: ")


def test_cli_simulate_reports_each_schedule_with_and_without_the_barrier(tmp_path):
    out = tmp_path / "sim"
    res = CliRunner().invoke(cli, ["-q", "simulate", "--schedule", "paci", "--a", "4", "--stages", "4", "--uniform",
                                   "1:1", "--compare", "zb-h2", "--m", "8", "--micro-batches", "64", "--clip-scope",
                                   "sync,stale", "--out", str(out), "--format", "csv"])
    assert res.exit_code == 0, res.output
    import csv

    rows = list(csv.DictReader(res.stdout.split("\n\n")[0].splitlines()))  # the summary, before the per-device tables
    got = {(r["schedule"], r["clip_scope"]): float(r["vs_no_barrier"]) for r in rows}
    assert list(got) == [("paci (a=4)", "none"), ("paci (a=4) clip sync", "sync"),
                         ("paci (a=4) clip stale", "stale"), ("zb-h2 (m=8)", "none"),
                         ("zb-h2 (m=8) clip sync", "sync"), ("zb-h2 (m=8) clip stale", "stale")]
    assert got[("paci (a=4) clip sync", "sync")] == pytest.approx(8 / 11)  # 2a / (2a + N − 1)
    assert got[("paci (a=4) clip stale", "stale")] == pytest.approx(1.0)
    assert "timeline-paci-a4clipsync.png" in {p.name for p in out.iterdir()}
    assert _sim_error(["--clip-scope", "global"]) == (
        "clip_scope='global' is invalid: must be one of none, stage, sync, stale, or several separated by commas "
        "(set --clip-scope)")
    assert _sim_error(["--clip-scope", "sync", "--clip-lag", "2"]) == (
        "--clip-lag is the lag of --clip-scope stale: add stale to --clip-scope, or drop --clip-lag")
    assert _sim_error(["--clip-scope", "stale", "--clip-lag", "0"]).startswith("clip_lag=0 is invalid")
    assert _sim_error(["--clip-scope", "sync", "--allreduce-latency", "-1"]).startswith("allreduce_latency=-1.0 is "
                                                                                        "invalid")
    assert _sim_error(["--allreduce-latency", "1e-5"]).startswith("--allreduce-latency applies to --clip-scope sync")


def test_plan_ranks_with_the_barrier_and_reports_without():
    from unbubble.sim.analytic import make_model
    from unbubble.sim.plan import candidates, parse_gpus

    model = make_model("tiny", vocab_size=257, seq_len=32)
    kw = dict(schedules=("1f1b-flush", "zb-h2", "paci"), stages=(4,), recompute=(False,))
    rows = candidates(model, parse_gpus("4xH100"), 16 * 32, clip_scope="sync", **kw)
    plain = {(r.schedule, r.mb_per_update): r.tokens_per_s
             for r in candidates(model, parse_gpus("4xH100"), 16 * 32, **kw)}
    for r in rows:
        assert r.clip_scope == "sync"
        assert r.no_barrier_tokens_per_s == pytest.approx(plain[(r.schedule, r.mb_per_update)])
        assert r.as_dict()["vs_no_barrier"] == pytest.approx(r.tokens_per_s / r.no_barrier_tokens_per_s)
    paci = [r for r in rows if r.schedule == "paci" and r.mb_per_update >= 2]
    assert paci and all(r.vs_no_barrier < 0.95 for r in paci)  # its staggered stages stall
    with pytest.raises(ConfigError, match="clip_lag=2 is the lag of clip scope stale, not sync"):
        candidates(model, parse_gpus("4xH100"), 16 * 32, clip_scope="sync", clip_lag=2, **kw)
    res = CliRunner().invoke(cli, ["-q", "plan", "--model", "tiny", "--vocab-size", "257", "--seq-len", "32",
                                   "--schedules", "1f1b-flush,paci", "--gpus", "4xH100", "--global-batch-tokens",
                                   "512", "--clip-scope", "stale", "--format", "markdown"])
    assert res.exit_code == 0, res.output
    assert "× no barrier" in res.output and "--clip-scope stale: a non-blocking gradient-norm all-reduce" in res.output
