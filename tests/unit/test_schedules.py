"""Schedule properties over a grid of (N, a, m): counts, caps, drift bound attained, bubbles."""

import subprocess
import sys
from collections import Counter

import pytest

from unbubble.errors import ConfigError, ScheduleError
from unbubble.schedules import Action, ActionKind, ListPolicy, get_schedule
from unbubble.schedules.policy import CutPolicy, Cuts
from unbubble.sim import UniformCosts, run_policies


def test_action_strings_round_trip():
    for text in ["0F0", "2F17", "3B4", "1I9", "1W9", "3U"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("2F17") == Action(2, ActionKind.F, 17)


@pytest.mark.parametrize("bad", ["F0", "2X1", "2U3", "2F", "", "a1F2"])
def test_action_parse_rejects(bad):
    with pytest.raises(ScheduleError, match="is invalid"):
        Action.parse(bad)


def _max_in_flight(trace, n):
    q, peak = [0] * n, [0] * n
    for r in trace.records:
        s = r.action.stage
        if r.action.kind is ActionKind.F:
            q[s] += 1
            peak[s] = max(peak[s], q[s])
        elif r.action.kind is ActionKind.B:
            q[s] -= 1
    return peak


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("a", [1, 2, 3, 4, 8, 16])
def test_paci_grid(n, a):
    sched = get_schedule("paci", n, steps=max(6, 4 * n // a + 4), a=a)
    trace = run_policies(sched, UniformCosts(f=1.0, b=2.0))
    counts = Counter((r.action.stage, r.action.kind) for r in trace.records)
    for s in range(n):
        assert counts[(s, ActionKind.F)] == counts[(s, ActionKind.B)] == sched.total_mb
        assert counts[(s, ActionKind.U)] == sched.steps
    bound = [-(-(n - 1 - s) // a) for s in range(n)]  # ⌈(N−i)/a⌉, i = s+1
    assert [sched.drift_bound(s) for s in range(n)] == bound
    assert trace.max_drift() == bound  # never exceeded, and attained
    assert _max_in_flight(trace, n) == [n - s for s in range(n)]  # q_i < N+1−i, cap reached
    # causality: each F after its upstream F, each B after its downstream B
    end = {(r.action.stage, r.action.kind, r.action.mb): r.end for r in trace.records}
    for r in trace.records:
        a_ = r.action
        if a_.kind is ActionKind.F and a_.stage > 0:
            assert r.start >= end[(a_.stage - 1, ActionKind.F, a_.mb)]
        if a_.kind is ActionKind.B and a_.stage < n - 1:
            assert r.start >= end[(a_.stage + 1, ActionKind.B, a_.mb)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("fb", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)])
def test_flush_bubble_matches_analytic(n, m, fb):
    sched = get_schedule("1f1b-flush", n, steps=3, m=m)
    trace = run_policies(sched, UniformCosts(f=fb[0], b=fb[1]))
    for u in trace.utilization():
        assert u == pytest.approx(m / (m + n - 1), rel=1e-12)
    assert trace.max_drift() == [0] * n
    assert _max_in_flight(trace, n) == [min(n - s, m) for s in range(n)]


def test_paci_steady_state_utilization_beats_flush():
    n, a = 8, 8
    trace = run_policies(get_schedule("paci", n, steps=250, a=a), UniformCosts())
    assert min(trace.utilization()) >= 0.99  # 2000 micro-batches: only the first fill is idle
    flush = run_policies(get_schedule("1f1b-flush", n, steps=250, m=a), UniformCosts())
    assert max(flush.utilization()) == pytest.approx(a / (a + n - 1))


def test_golden_flush_order_n2_m3():
    order = get_schedule("1f1b-flush", 2, steps=2, m=3).static_order()
    assert " ".join(map(str, order[0])) == "0F0 0F1 0B0 0F2 0B1 0B2 0U 0F3 0F4 0B3 0F5 0B4 0B5 0U"
    assert " ".join(map(str, order[1])) == "1F0 1B0 1F1 1B1 1F2 1B2 1U 1F3 1B3 1F4 1B4 1F5 1B5 1U"


def test_golden_paci_order_n3_a2():
    trace = run_policies(get_schedule("paci", 3, steps=2, a=2), UniformCosts(f=1, b=1))
    order = [" ".join(map(str, o)) for o in trace.order()]
    assert order == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0U 0B2 0B3 0U",
        "1F0 1F1 1B0 1F2 1B1 1U 1F3 1B2 1B3 1U",
        "2F0 2B0 2F1 2B1 2U 2F2 2B2 2F3 2B3 2U",
    ]


ASYNC_SHAPES = [("paci", n, a) for n in (2, 3, 4, 8) for a in (1, 2, 3, 8)] + \
    [(name, 4, 1) for name in ("async-1f1b", "pipedream", "pipemare")] + [("pipedream-2bw", 4, 4)]


def _async(name, n, a, steps):
    return get_schedule(name, n, steps, a=a, m=a) if name in ("paci", "pipedream-2bw") else get_schedule(name, n, steps)


@pytest.mark.parametrize("name,n,a", ASYNC_SHAPES)
@pytest.mark.parametrize("every", [0, 2])
def test_deterministic_order_is_the_unit_cost_order(name, n, a, every):
    """[Note: deterministic order]: on the emulator's default costs (F=1, B=2) the arrival-driven
    rule picks exactly the fixed order, with and without checkpoint drains."""
    sched = _async(name, n, a, steps=7)
    orders = {}
    for order in ("dynamic", "deterministic"):
        cuts = Cuts(sched.mb_per_step, every=every)
        orders[order] = run_policies(sched, UniformCosts(), policies=[CutPolicy(sched.policy(r, order), cuts)
                                                                      for r in range(n)]).order()
    assert orders["deterministic"] == orders["dynamic"]


def test_deterministic_order_does_not_depend_on_timing_and_keeps_the_bounds():
    """Stage speeds and link latencies change the arrival-driven order but not the fixed one,
    which keeps q_i ≤ N+1−i and Δ_i ≤ ⌈(N−i)/a⌉ and never deadlocks (drains included)."""
    import random

    rng = random.Random(0)
    n, a, steps = 4, 2, 9
    sched = get_schedule("paci", n, steps, a=a)
    bound = [sched.drift_bound(s) for s in range(n)]
    reference = {every: run_policies(sched, UniformCosts(), policies=[
        CutPolicy(sched.policy(r, "deterministic"), Cuts(sched.mb_per_step, every=every)) for r in range(n)]).order()
        for every in range(3)}
    dynamic_orders = set()
    for trial in range(30):
        costs = UniformCosts(f=rng.uniform(0.2, 2), b=rng.uniform(0.2, 4), u=rng.uniform(0, 1),
                             latency=rng.uniform(0, 3), stage_scale=tuple(rng.uniform(0.3, 3) for _ in range(n)))
        for order in ("dynamic", "deterministic"):
            cuts = Cuts(sched.mb_per_step, every=trial % 3)
            trace = run_policies(sched, costs, policies=[CutPolicy(sched.policy(r, order), cuts) for r in range(n)])
            assert all(d <= b for d, b in zip(trace.max_drift(), bound)), (order, trial)
            assert all(q <= n - s for s, q in enumerate(_max_in_flight(trace, n))), (order, trial)
            if order == "dynamic":
                dynamic_orders.add(str(trace.order()))
            else:
                assert trace.order() == reference[cuts.every], trial
    assert len(dynamic_orders) > 1  # the arrival-driven order does follow the timing


def test_unknown_order_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"^order='fixed' is invalid: must be one of deterministic, dynamic "
                                          r"\(set --order\)$"):
        get_schedule("paci", 2, 1, a=1).policy(0, "fixed")


def test_a_job_with_an_unknown_order_is_refused_before_it_runs():
    import dataclasses

    from helpers import tiny_gpt_job

    job = tiny_gpt_job(get_schedule("paci", 2, 1, a=1))
    with pytest.raises(ConfigError, match=r"^order='dynamik' is invalid \(did you mean 'dynamic'\?\): must be one of "
                                          r"deterministic, dynamic \(set --order\)$"):
        dataclasses.replace(job, order="dynamik")


def test_deadlock_is_reported():
    bad = [[Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0)], [Action(1, ActionKind.B, 0), Action(1, ActionKind.F, 0)]]
    sched = get_schedule("1f1b-flush", 2, steps=1, m=1)
    with pytest.raises(ScheduleError, match=r"deadlocked: stages \[0, 1\]"):
        run_policies(sched, UniformCosts(), policies=[ListPolicy(o) for o in bad])


@pytest.mark.parametrize("kwargs,msg", [
    (dict(name="nope", n_stages=2, steps=1), "schedule='nope' is unknown: valid schedules are gpipe, 1f1b-flush"),
    (dict(name="paci", n_stages=0, steps=1, a=1), "stages=0 is invalid"),
    (dict(name="paci", n_stages=2, steps=1, a=0), "a=0 is invalid"),
    (dict(name="1f1b-flush", n_stages=2, steps=1, m=0), "m=0 is invalid"),
    (dict(name="paci", n_stages=2, steps=0, a=1), "steps=0 is invalid"),
])
def test_get_schedule_errors(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        get_schedule(**kwargs)


def test_schedules_and_sim_import_without_torch():
    code = "import sys, unbubble.schedules, unbubble.sim; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
