"""Schedule IR: CSV round trips, torch CSV import, golden CSVs, the validator, bubbles and delays."""

import os
from pathlib import Path

import pytest

from unbubble.errors import ScheduleError
from unbubble.schedules import Action, ActionKind, get_schedule
from unbubble.schedules.actions import dump_csv, load_csv, with_updates
from unbubble.schedules.validate import validate
from unbubble.sim import UniformCosts, run_policies

GOLDEN = Path(__file__).parent.parent / "golden"
SYNC = ["gpipe", "1f1b-flush", "interleaved-1f1b", "zb-h1", "zb-h2"]
ALL = SYNC + ["paci", "async-1f1b", "pipedream", "pipedream-2bw", "pipemare"]


def _grid():
    for n in range(2, 9):
        for x in range(1, 17):
            for name in ALL:
                if name == "pipedream-2bw" and x < n - 1 or name == "interleaved-1f1b" and x % n:
                    continue
                yield name, n, x


@pytest.mark.parametrize("name,n,x", list(_grid()))
def test_every_generated_schedule_validates(name, n, x):
    sched = get_schedule(name, n, steps=2, a=x, m=x)
    trace = validate(sched)
    assert len([r for r in trace.records if r.action.kind is ActionKind.U]) == 2 * sched.n_stages


@pytest.mark.parametrize("name", SYNC)
def test_golden_csv_n4_m8(name):
    order = get_schedule(name, 4, steps=1, m=8).static_order()
    path = GOLDEN / f"{name}_N4_m8.csv"
    if os.environ.get("UNBUBBLE_REGEN_GOLDEN"):
        path.write_text(dump_csv(order))
    assert dump_csv(order) == path.read_text()
    assert load_csv(path.read_text()) == order


def test_torch_compute_only_csv_imports_as_1f1b_flush():
    # torch.distributed.pipelining's _dump_csv of Schedule1F1B (2 ranks, 3 micro-batches), compute only
    torch_csv = "0F0,0F1,,0B0,0F2,0B1,,0B2\n,1F0,1B0,1F1,1B1,1F2,1B2\n"
    order = with_updates(load_csv(torch_csv), m=3, steps=2)
    sched = get_schedule("1f1b-flush", 2, steps=2, m=3)
    assert order == sched.static_order()
    validate(sched, order)


def _flush(n=3, m=4):
    return get_schedule("1f1b-flush", n, steps=1, m=m)


def _broken(mutate):
    order = [list(acts) for acts in _flush().static_order()]
    mutate(order)
    return order


@pytest.mark.parametrize("mutate,message", [
    (lambda o: o[1].remove(Action(1, ActionKind.U)), "stage 1 applies U 0 times, expected steps=1"),
    (lambda o: o[0].insert(0, o[0].pop(o[0].index(Action(0, ActionKind.B, 2)))), "0B2 (rank 0, position 0): runs before its forward 0F2"),
    (lambda o: o[2].append(Action(2, ActionKind.F, 3)), "runs twice"),
    (lambda o: o[2].append(Action(1, ActionKind.F, 3)), "stage 1 does not live on rank 2"),
    (lambda o: o[1].remove(Action(1, ActionKind.B, 3)), "stage 1 never completes micro-batch 3"),
    (lambda o: o[0].insert(o[0].index(Action(0, ActionKind.B, 3)), o[0].pop(o[0].index(Action(0, ActionKind.U)))),
     "drift Δ=1 exceeds the bound 0 of stage 0 for 1f1b-flush"),
    (lambda o: o.__setitem__(0, [a for a in o[0] if a.kind is ActionKind.F] + [a for a in o[0] if a.kind is not ActionKind.F]),
     "stage 0 would hold 4 activations, more than the bound 3"),
    (lambda o: o.__setitem__(1, [Action(1, ActionKind.B, 0)] + [a for a in o[1] if a != Action(1, ActionKind.B, 0)]),
     "runs before its forward"),
])
def test_broken_schedules_are_rejected_with_the_offending_action(mutate, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(_flush(), _broken(mutate))


def test_deadlock_is_found_by_the_dry_run():
    # rank 0 waits for 0B0 before sending 0F1, which rank 1 needs before its 1B0: a cycle
    order = _broken(lambda o: o[0].insert(1, o[0].pop(o[0].index(Action(0, ActionKind.B, 0)))))
    with pytest.raises(ScheduleError, match="deadlocked"):
        validate(_flush(), order)


@pytest.mark.parametrize("n,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (8, 2, 16)])
def test_interleaved_bubble_matches_megatron_formula(n, v, m):
    trace = run_policies(get_schedule("interleaved-1f1b", n, steps=2, m=m, v=v), UniformCosts(f=1, b=1))
    for u in trace.utilization():
        assert 1 - u == pytest.approx((n - 1) / (v * m + n - 1), rel=1e-12)


@pytest.mark.parametrize("n,m", [(4, 8), (8, 16)])
def test_zero_bubble_schedules_shrink_the_1f1b_bubble(n, m):
    def bubble(name):
        return run_policies(get_schedule(name, n, steps=2, m=m), UniformCosts(f=1, b=2)).makespan - 2 * 3 * m

    base, h1, h2 = bubble("1f1b-flush"), bubble("zb-h1"), bubble("zb-h2")
    assert base == 2 * 3 * (n - 1)  # (N−1)(F+B) per step
    assert h1 / base == pytest.approx(1 / 3)  # the paper's (N−1)(F+I−W) vs (N−1)(F+B)
    assert h2 / base == pytest.approx(1 / 6)


@pytest.mark.parametrize("name,tau", [("pipedream", lambda n, s: n - 1 - s), ("pipedream-2bw", lambda n, s: min(1, n - 1 - s))])
def test_stashing_schedules_have_no_drift_and_their_delay(name, tau):
    n = 6
    sched = get_schedule(name, n, steps=12, m=n)
    trace = run_policies(sched, UniformCosts())
    assert trace.max_drift() == [0] * n
    assert trace.max_delay() == [tau(n, s) for s in range(n)]
