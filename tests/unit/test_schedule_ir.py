"""Schedule IR: CSV round trips, torch CSV import, golden CSVs, the validator, bubbles and delays."""

import os
import re
from pathlib import Path

import pytest

from unbubble.errors import ScheduleError
from unbubble.schedules import Action, ActionKind, get_schedule
from unbubble.schedules.actions import F, dump_csv, export_torch_csv, load_csv, parse_cell, with_updates
from unbubble.sim.validate import validate
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


# --- torch.distributed.pipelining interop (torch 2.13). Private APIs used: _Action.from_str, _ComputationType,
# _add_send_recv, _validate_schedule, _PipelineScheduleRuntime._load_csv/_dump_csv, PipelineScheduleMulti._dump_csv
# and the schedule classes' pipeline_order / pipeline_order_with_comms.

def _tps():
    import torch.distributed.pipelining.schedules as tps  # imported here: the rest of the file needs no torch
    return tps


def _fake_stages(n_ranks: int, v: int):
    """What torch's schedule constructors read from their stages (no process group, no module)."""
    from types import SimpleNamespace
    return [SimpleNamespace(submod=None, num_stages=n_ranks * v, group_size=n_ranks, group_rank=0) for _ in range(v)]


def _torch_schedule(cls_name: str, n: int, m: int, v: int = 1):
    cls = getattr(_tps(), cls_name)
    if cls_name in ("ScheduleGPipe", "Schedule1F1B"):  # single-stage classes take one stage
        return cls(_fake_stages(n, 1)[0], m)
    return cls(_fake_stages(n, v), m)


def _torch_csv(sched, tmp_path, comms: bool) -> str:
    """The schedule's CSV as torch's own _dump_csv writes it (compute-only, or with comms)."""
    tps, path = _tps(), tmp_path / "torch.csv"
    if not comms:
        tps.PipelineScheduleMulti._dump_csv(sched, path)  # single-stage classes have no _dump_csv: same writer
    elif hasattr(sched, "pipeline_order_with_comms"):
        sched._dump_csv(path, format="compute_comms")
    else:  # single-stage classes: torch's own lowering adds the sends/recvs
        with_comms = tps._add_send_recv({r: list(a) for r, a in sched.pipeline_order.items()},
                                        stage_to_rank=lambda s: s, num_stages=len(sched.pipeline_order))
        tps.PipelineScheduleMulti._dump_csv(type("S", (), {"pipeline_order": with_comms})(), path)
    return path.read_text()


def _compute(order):
    return [[a for a in acts if a.kind is not ActionKind.U] for acts in order]


TORCH_SAME = [("ScheduleGPipe", "gpipe", 1), ("Schedule1F1B", "1f1b-flush", 1),
              ("ScheduleInterleaved1F1B", "interleaved-1f1b", 2), ("ScheduleInterleaved1F1B", "interleaved-1f1b", 3),
              ("ScheduleInterleavedZeroBubble", "zb-h1", 1)]


@pytest.mark.parametrize("comms", [False, True], ids=["compute", "comms"])
@pytest.mark.parametrize("n,m", [(2, 4), (3, 6), (4, 8), (4, 12)])
@pytest.mark.parametrize("cls_name,name,v", TORCH_SAME, ids=[f"{c}-v{v}" for c, _, v in TORCH_SAME])
def test_torch_csvs_load_with_unbubbles_compute_order(cls_name, name, v, n, m, comms, tmp_path):
    ours = get_schedule(name, n, steps=1, m=m, v=v if name == "interleaved-1f1b" else None)
    if cls_name == "Schedule1F1B" and comms:
        # torch's own lowering cannot add comms to Schedule1F1B's pipeline_order: its last rank waits for
        # F{m} from the rank before (the numbering below)
        with pytest.raises(AssertionError, match="Malformed compute schedule"):
            _torch_csv(_torch_schedule(cls_name, n, m, v), tmp_path, comms)
        return
    loaded = load_csv(_torch_csv(_torch_schedule(cls_name, n, m, v), tmp_path, comms))
    want = _compute(ours.static_order())
    if cls_name == "Schedule1F1B":
        # torch's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1…m (its runtime runs
        # 0…m−1, as ours): every other rank, and every position, agrees
        last = n - 1
        assert _compute(loaded)[:last] == want[:last]
        assert _compute(loaded)[last] == [Action(a.stage, a.kind, a.mb + (a.kind is ActionKind.F)) for a in want[last]]
        with pytest.raises(ScheduleError, match=rf"^{last}F{m} \(rank {last}\) is outside the step: with m={m}"):
            with_updates(loaded, m, steps=2)
        return
    assert _compute(loaded) == want
    # one U per stage: torch's REDUCE_GRAD where torch has it (GPipe, 1F1B, comms files), else appended
    order = with_updates(loaded, m, steps=2)
    validate(get_schedule(ours.name, n, steps=2, m=m, v=ours.virtual if name == "interleaved-1f1b" else None), order)


@pytest.mark.parametrize("comms", [False, True], ids=["compute", "comms"])
@pytest.mark.parametrize("cls_name,v", [("ScheduleLoopedBFS", 2), ("ScheduleInterleavedZeroBubble", 2),
                                        ("ScheduleInterleaved1F1B", 4)])
def test_torch_multi_stage_csvs_load_and_validate(cls_name, v, comms, tmp_path):
    # no unbubble generator for these: the loaded order must still be a valid flushed schedule
    n, m = 4, 8
    loaded = load_csv(_torch_csv(_torch_schedule(cls_name, n, m, v), tmp_path, comms))
    assert {a.stage for acts in loaded for a in acts} == set(range(n * v))
    assert sum(a.kind is ActionKind.F for acts in loaded for a in acts) == n * v * m
    validate(get_schedule("interleaved-1f1b", n, steps=2, m=m, v=v), with_updates(loaded, m, steps=2))


def test_torch_reduce_grad_is_the_update_where_torch_puts_it(tmp_path):
    # GPipe's compute-only file carries REDUCE_GRAD after each stage's m-th backward: that is our flushed U
    text = _torch_csv(_torch_schedule("ScheduleGPipe", 3, 4), tmp_path, comms=False)
    assert "0REDUCE_GRAD" in text
    assert load_csv(text) == get_schedule("gpipe", 3, steps=1, m=4).static_order()
    # interleaved, with comms: stage 2 (chunk 1) finishes its backwards before stage 0 and updates there
    text = _torch_csv(_torch_schedule("ScheduleInterleaved1F1B", 2, 4, 2), tmp_path, comms=True)
    row0 = load_csv(text)[0]
    assert row0.index(Action(2, ActionKind.U)) == row0.index(Action(2, ActionKind.B, 3)) + 1
    assert row0[-2:] == [Action(0, ActionKind.B, 3), Action(0, ActionKind.U)]


@pytest.mark.parametrize("comms", [False, True], ids=["compute", "comms"])
@pytest.mark.parametrize("cls_name,name", [("ScheduleZBVZeroBubble", "zbv"), ("ScheduleDualPipeV", "dualpipev")])
@pytest.mark.parametrize("n", [2, 4])
def test_torch_v_shaped_csvs_load_as_our_v_schedules(cls_name, name, n, comms, tmp_path):
    # rank r holds stages r and 2N − 1 − r: the V placement is read from the rows
    m = 2 * n
    loaded = load_csv(_torch_csv(_torch_schedule(cls_name, n, m, 2), tmp_path, comms))
    assert _compute(loaded) == _compute(get_schedule(name, n, steps=1, m=m).static_order())
    validate(get_schedule(name, n, steps=2, m=m), with_updates(loaded, m, steps=2))


def test_a_placement_that_is_neither_loop_nor_v_names_the_rank_and_stage():
    assert load_csv("0F0,3F0\n1F0,2F0\n") == [[F(0, 0), F(3, 0)], [F(1, 0), F(2, 0)]]  # a V
    assert load_csv("0F0,2F0\n1F0,3F0\n") == [[F(0, 0), F(2, 0)], [F(1, 0), F(3, 0)]]  # a loop
    with pytest.raises(ScheduleError, match=r"^row 0, column 1: rank 0 runs stage 1, but the file places its stages "
                                            r"on rank s mod N, which puts stage 1 on rank 1 for N=2 ranks"):
        load_csv("0F0,1F0\n2F0,3F0\n")


@pytest.mark.parametrize("comms", [False, True], ids=["compute", "comms"])
def test_every_torch_dualpipev_cell_parses_as_torchs_own_parser_reads_it(comms, tmp_path):
    tps = _tps()
    ours = {"F": ActionKind.F, "B": ActionKind.B, "I": ActionKind.I, "W": ActionKind.W}
    text = _torch_csv(_torch_schedule("ScheduleDualPipeV", 4, 8, 2), tmp_path, comms)
    cells = [c for line in text.splitlines() for c in line.split(",") if c]
    assert any("OVERLAP_F_B" in c for c in cells) and (not comms or any("SEND_F" in c for c in cells))
    for cell in cells:
        t = tps._Action.from_str(cell)
        leaves = t.sub_actions if t.sub_actions is not None else (t,)
        want = [Action(x.stage_index, ActionKind.U) if x.computation_type is tps._ComputationType.REDUCE_GRAD
                else Action(x.stage_index, ours[x.computation_type.value], x.microbatch_index)
                for x in leaves if x.computation_type.value in ours or x.computation_type.value == "REDUCE_GRAD"]
        assert parse_cell(cell) == want, cell


@pytest.mark.parametrize("cell,message", [
    ("0X1", "cell '0X1' is not an action: expected"),
    ("0REDUCE_GRAD3", "REDUCE_GRAD takes no micro-batch id"),
    ("1SEND_F", "SEND_F needs micro-batch id"),
    ("0F", "F needs micro-batch id"),
    ("(0U;1B0)OVERLAP_F_B", "OVERLAP_F_B holds compute actions"),
])
def test_bad_cells_name_the_cell_and_the_valid_forms(cell, message):
    with pytest.raises(ScheduleError, match=rf"^row 0, column 1: .*{re.escape(message)}"):
        load_csv(f"0F0,{cell}\n")


_EXPORTED = [("gpipe", None), ("1f1b-flush", None), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", None),
             ("zb-h2", None)]


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("name,v", _EXPORTED, ids=[f"{a}-v{b}" if b else a for a, b in _EXPORTED])
def test_exported_csv_loads_in_torch_and_passes_its_validator(name, v, n, m, tmp_path):
    tps = _tps()
    sched = get_schedule(name, n, steps=3, m=m, v=v)
    path = tmp_path / "ours.csv"
    path.write_text(export_torch_csv(sched.static_order()))
    runtime = tps._PipelineScheduleRuntime(_fake_stages(n, v or 1), m)
    runtime._load_csv(str(path))  # validates, then lowers with torch's sends/recvs, REDUCE_GRAD, FSDP cells
    step0 = _compute(get_schedule(name, n, steps=1, m=m, v=v).static_order())
    assert runtime.pipeline_order == {r: [tps._Action.from_str(str(a)) for a in acts] for r, acts in enumerate(step0)}
    stage_to_rank = tps._validate_schedule(runtime.pipeline_order, n, sched.n_stages, m)
    assert stage_to_rank == {s: s % n for s in range(sched.n_stages)}
    # and back: torch's lowered file reads as our step with U where torch reduces the gradients
    runtime._dump_csv(str(tmp_path / "lowered.csv"), format="compute_comms")
    back = load_csv((tmp_path / "lowered.csv").read_text())
    assert _compute(back) == step0
    validate(get_schedule(name, n, steps=1, m=m, v=v), back)


def test_torch_rejects_the_full_format_export_exists_for(tmp_path):
    tps = _tps()
    path = tmp_path / "full.csv"
    path.write_text(dump_csv(get_schedule("gpipe", 2, steps=1, m=2).static_order()))
    with pytest.raises(RuntimeError, match="Invalid action string: 0U"):
        tps._PipelineScheduleRuntime(_fake_stages(2, 1), 2)._load_csv(str(path))


def test_export_writes_the_first_step_without_updates():
    order = get_schedule("1f1b-flush", 2, steps=2, m=3).static_order()
    assert export_torch_csv(order) == "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n"
    no_u = _compute(get_schedule("1f1b-flush", 2, steps=1, m=3).static_order())
    assert export_torch_csv(no_u) == export_torch_csv(order)


def _paci_order():
    return run_policies(get_schedule("paci", 3, steps=4, a=2), UniformCosts()).order()


@pytest.mark.parametrize("order,message", [
    (_paci_order, r"stage 0 \(rank 0\) applies U number 1 while micro-batch \d+ is in flight .* asynchronous"),
    (lambda: _broken(lambda o: o[0].insert(o[0].index(Action(0, ActionKind.B, 3)),
                                           o[0].pop(o[0].index(Action(0, ActionKind.U))))),
     r"stage 0 \(rank 0\) applies U number 1 while micro-batch 3 is in flight"),
    (lambda: [acts[:-1] if r == 1 else acts for r, acts in enumerate(_flush().static_order())],
     r"stages apply U different numbers of times \(stage 0: 1, stage 1: 0, stage 2: 1\)"),
    (lambda: [acts + [Action(r, ActionKind.F, 4)] for r, acts in enumerate(_flush().static_order())],
     r"stage 0 runs 0F4 after its last U"),
    (lambda: [acts[:-6] + acts[-5:-4] + acts[-6:-5] + acts[-4:] if r == 2 else acts
              for r, acts in enumerate(get_schedule("1f1b-flush", 3, steps=2, m=4).static_order())],
     r"rank 2, action 11 \(U not counted\) is 2F6 where step 0 repeated gives 2B5"),
])
def test_export_refuses_orders_torch_cannot_express(order, message):
    with pytest.raises(ScheduleError, match=message):
        export_torch_csv(order())


def test_cli_exports_a_torch_csv_and_refuses_an_asynchronous_schedule(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    out = tmp_path / "il.csv"
    res = CliRunner().invoke(cli, ["schedules", "--export", "interleaved-1f1b", "--stages", "2", "--m", "4", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text() == export_torch_csv(get_schedule("interleaved-1f1b", 2, steps=1, m=4).static_order())
    assert "U omitted" in res.output
    res = CliRunner().invoke(cli, ["schedules", "--export", "paci", "--stages", "2", "--m", "4"])
    assert res.exit_code == 2
    assert "--export paci is invalid: it is asynchronous" in res.output and "gpipe, 1f1b-flush" in res.output


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


@pytest.mark.parametrize("n,m", [(4, 4), (4, 6), (4, 8), (8, 8), (8, 12), (8, 16)])
def test_zero_bubble_schedules_shrink_the_1f1b_bubble(n, m):
    def bubble(name, steps):
        return run_policies(get_schedule(name, n, steps=steps, m=m), UniformCosts(f=1, b=2)).makespan - steps * 3 * m

    for steps in (1, 2, 3):
        base, h1, h2 = bubble("1f1b-flush", steps), bubble("zb-h1", steps), bubble("zb-h2", steps)
        assert base == steps * 3 * (n - 1)  # (N−1)(F+B) per step
        assert h1 / base == pytest.approx(1 / 3)  # the paper's (N−1)(F+I−W) vs (N−1)(F+B)
        # zb-h2 (flushed): its first step's bubble is zb-h1's, max(N−1, 2N−1−m) units; each later one
        # costs max(0, 2N−1−m), as a device starts its next step while later ones finish. So "1/6 of
        # 1F1B's" is two steps' total at m ≥ 2N−1, not one step's
        assert h2 == max(n - 1, 2 * n - 1 - m) + (steps - 1) * max(0, 2 * n - 1 - m)
        if steps == 1:
            assert h2 == h1
    if m >= 2 * n - 1:
        assert bubble("zb-h2", 2) / bubble("1f1b-flush", 2) == pytest.approx(1 / 6)


@pytest.mark.parametrize("name,tau", [("pipedream", lambda n, s: n - 1 - s), ("pipedream-2bw", lambda n, s: min(1, n - 1 - s))])
def test_stashing_schedules_have_no_drift_and_their_delay(name, tau):
    n = 6
    sched = get_schedule(name, n, steps=12, m=n)
    trace = run_policies(sched, UniformCosts())
    assert trace.max_drift() == [0] * n
    assert trace.max_delay() == [tau(n, s) for s in range(n)]
