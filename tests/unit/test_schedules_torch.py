"""looped-bfs and interleaved-zb (issue 27): torch 2.13's runtime order, bubbles and memory on unit
costs against the published formulas, validation, option checks and the --compile refusal.

Private torch APIs used: the schedule classes' constructors and ``_step_microbatches``,
``_initialize_stages`` (replaced on the instance), ``pipeline_order``.
"""

import re

import pytest

from unbubble.errors import ConfigError
from unbubble.schedules import ActionKind, get_schedule
from unbubble.sim.validate import activation_bound, validate
from unbubble.sim import UniformCosts, run_policies

OURS_TORCH = [("looped-bfs", "ScheduleLoopedBFS"), ("interleaved-zb", "ScheduleInterleavedZeroBubble")]


class _FakeStage:
    """What torch's multi-stage runtime (``_PipelineScheduleRuntime._step_microbatches``) calls on a
    stage: sends and receives are empty, compute calls are logged in the rank's order; no process
    group, no module."""

    def __init__(self, index: int, n_ranks: int, v: int, rank: int, log: list[str]):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_ranks * v, n_ranks, rank
        self.is_first, self.is_last = index == 0, index == n_ranks * v - 1
        self.submod, self.log = None, log

    def get_fwd_send_ops(self, mb):
        return []

    get_bwd_send_ops = get_fwd_recv_ops = get_bwd_recv_ops = get_fwd_send_ops

    def forward_one_chunk(self, mb, args, kwargs, save_forward_output=True):
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        self.log.append(f"{self.stage_index}{'B' if full_backward else 'I'}{mb}")

    def backward_weight_one_chunk(self, mb, last_backward=False):
        self.log.append(f"{self.stage_index}W{mb}")

    def set_local_fwd_input(self, output, mb):
        pass

    def set_local_bwd_input(self, grad, mb):
        pass

    def get_local_bwd_output(self, mb):
        return None

    def perform_reduce_grad(self, scale):
        self.log.append(f"{self.stage_index}REDUCE_GRAD")


def _torch_runtime_order(cls_name: str, n: int, m: int, v: int) -> tuple[list[list[str]], list[list[str]]]:
    """(what each rank's torch runtime computes, in order; its ``pipeline_order`` without idle slots).

    Each rank builds torch's schedule from its own v fake stages (r, r + N, …) and runs one
    ``_step_microbatches``: the runtime walks ``pipeline_order_with_comms`` (the compute-only
    ``pipeline_order`` lowered with sends/receives and REDUCE_GRAD) action by action."""
    import torch.distributed.pipelining.schedules as tps  # imported here: the schedules need no torch

    ran, planned = [], []
    for r in range(n):
        log: list[str] = []
        sched = getattr(tps, cls_name)([_FakeStage(c * n + r, n, v, r, log) for c in range(v)], m)
        sched._initialize_stages = lambda *a, **k: None  # shape inference needs real stages
        sched._step_microbatches()
        ran.append([x for x in log if "REDUCE_GRAD" not in x])
        planned.append([str(a) for a in sched.pipeline_order[r] if a is not None])
    return ran, planned


def _compute(order) -> list[list[str]]:
    return [[str(a) for a in acts if a.kind is not ActionKind.U] for acts in order]


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 5), (4, 6), (4, 10), (4, 2)])
@pytest.mark.parametrize("name,cls_name", OURS_TORCH)
def test_order_equals_torch_runtime(name, cls_name, n, m, v):
    ran, planned = _torch_runtime_order(cls_name, n, m, v)
    # for these two classes the runtime runs pipeline_order's compute actions as listed (the lowering
    # only adds communication and REDUCE_GRAD), so comparing with pipeline_order would do as well
    assert ran == planned
    assert sum(map(len, ran)) == n * v * m * (2 if name == "looped-bfs" else 3)
    assert _compute(get_schedule(name, n, steps=1, m=m, v=v).static_order()) == ran


@pytest.mark.parametrize("name", ["looped-bfs", "interleaved-zb"])
def test_later_steps_repeat_the_first_with_global_ids_and_update_after_it(name):
    n, m, v = 2, 4, 2
    one = get_schedule(name, n, steps=1, m=m, v=v).static_order()
    three = get_schedule(name, n, steps=3, m=m, v=v).static_order()
    for r in range(n):
        per_step = len(one[r])
        assert one[r][-v:] == [a for a in one[r] if a.kind is ActionKind.U] and len(one[r][-v:]) == v
        for t in range(3):
            step = three[r][t * per_step:(t + 1) * per_step]
            assert [(a.stage, a.kind) for a in step] == [(a.stage, a.kind) for a in one[r]]
            assert {a.mb for a in step if a.mb is not None} == set(range(t * m, (t + 1) * m))


def _shapes():
    for name in ("looped-bfs", "interleaved-zb"):
        for n in (1, 2, 3, 4):
            for v in (1, 2, 3):
                for m in (1, 2, 3, 4, 5, 6, 8):
                    if name == "interleaved-zb" and m % max(1, m // n):
                        continue  # refused, as torch does (test below)
                    yield name, n, v, m


@pytest.mark.parametrize("name,n,v,m", list(_shapes()))
def test_validates_flushed_with_zero_drift(name, n, v, m):
    sched = get_schedule(name, n, steps=2, m=m, v=v)
    assert sched.n_stages == n * v and sched.n_ranks == n and not sched.asynchronous
    assert [sched.rank_of(s) for s in range(n * v)] == [s % n for s in range(n * v)]
    trace = validate(sched)  # counts, causality, no deadlock, activation bound, Δ ≤ 0
    assert trace.max_drift() == [0] * (n * v)
    assert sum(r.action.kind is ActionKind.U for r in trace.records) == 2 * n * v


# --- bubbles on unit costs --------------------------------------------------------------------------------
# looped-bfs: Lamy-Poirier (arXiv 2211.05953, §3-4): looping the pipeline v times divides GPipe's
# bubble by v, breadth-first as depth-first, when m ≥ N: bubble (N−1)/(v·m + N − 1) of the step
# with chunk-sized F and B (Megatron's interleaved formula, arXiv 2104.04473 §2.2). For m < N
# each chunk waits for its input from the rank before: a step is (F+B)(v·N + m − 1).
@pytest.mark.parametrize("fb", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)])
@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 16, 3), (3, 5, 2), (8, 8, 2),
                                   (4, 2, 2), (8, 3, 3)])
def test_looped_bfs_bubble_is_the_published_formula(n, m, v, fb):
    f, b = fb
    trace = run_policies(get_schedule("looped-bfs", n, steps=3, m=m, v=v), UniformCosts(f=f, b=b))
    per_step = (f + b) * (v * m + n - 1) if m >= n else (f + b) * (v * n + m - 1)
    assert trace.makespan == pytest.approx(3 * per_step, rel=1e-12)
    for u in trace.utilization():
        assert u == pytest.approx(v * m * (f + b) / per_step, rel=1e-12)
        if m >= n:
            assert 1 - u == pytest.approx((n - 1) / (v * m + n - 1), rel=1e-12)


# interleaved-zb: the Zero Bubble paper's ZB-H1/ZB1P bubble (p−1)(T_F + T_B − T_W) (arXiv 2401.10241
# §2.1, B = input gradient; rate (p−1)/3m at T_F = T_B = T_W) with chunk-sized actions: (N−1) action
# times per step of 3·v·m, bubble fraction (N−1)/(3·v·m + N − 1). Stated for N | m (Megatron's
# rounds of N micro-batches); torch's order also attains it for N < m with rounds of m/⌊m/N⌋.
@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2), (2, 4, 1),
                                   (4, 8, 1), (3, 5, 2), (4, 6, 2)])
def test_interleaved_zb_bubble_is_zb1p_formula_with_chunk_actions(n, m, v):
    trace = run_policies(get_schedule("interleaved-zb", n, steps=3, m=m, v=v), UniformCosts(f=1.0, b=2.0, i=1.0, w=1.0))
    assert trace.makespan == pytest.approx(3 * (3 * v * m + n - 1), rel=1e-12)
    for u in trace.utilization():
        assert 1 - u == pytest.approx((n - 1) / (3 * v * m + n - 1), rel=1e-12)
    # and (N−1)(T_F + T_B − T_W) in time per step, T the chunk's action times
    assert trace.makespan / 3 - 3 * v * m == pytest.approx((n - 1) * (1 + 1 - 1))


def test_interleaved_zb_bubble_is_below_interleaved_1f1b_by_its_share():
    n, m, v = 4, 8, 2
    costs = UniformCosts(f=1.0, b=2.0, i=1.0, w=1.0)
    zb = run_policies(get_schedule("interleaved-zb", n, steps=1, m=m, v=v), costs).makespan - 3 * v * m
    i1 = run_policies(get_schedule("interleaved-1f1b", n, steps=1, m=m, v=v), costs).makespan - 3 * v * m
    assert (zb, i1) == (n - 1, 3 * (n - 1))  # 1/3 of the interleaved 1F1B bubble, as ZB-H1 of 1F1B's


# --- peak activation memory on unit sizes -----------------------------------------------------------------
@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2), (4, 2, 2)])
def test_looped_bfs_holds_gpipes_activations(n, m, v):
    from unbubble.sim.memory import MemorySpec
    from unbubble.sim.result import simulate

    sched = get_schedule("looped-bfs", n, steps=2, m=m, v=v)
    # chunk activations of 1/v of a stage's: m stage-sized micro-batches per device, GPipe's m·M_B
    # (Lamy-Poirier §4: breadth-first stores every micro-batch's activations, as GPipe)
    res = simulate(sched, UniformCosts(), MemorySpec.uniform(n * v, act=1.0 / v))
    assert [r.activations for r in res.memory] == pytest.approx([m] * n)
    assert [r.peak_in_flight for r in res.memory] == [v * m] * n
    assert [activation_bound(sched, s) for s in range(n * v)] == [m] * (n * v)  # attained (validate checks ≤)


@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2), (4, 2, 2)])
def test_interleaved_zb_holds_1f1b_peak_activations(n, m, v):
    from unbubble.sim.memory import MemorySpec
    from unbubble.sim.result import simulate

    sched = get_schedule("interleaved-zb", n, steps=2, m=m, v=v)
    costs = UniformCosts(f=1.0, b=2.0, i=1.0, w=1.0)
    # held until W (M_W = M_B): every device holds min(m, N) stage-sized micro-batches, 1F1B's first-stage
    # peak N·M_B: ZB1P's "1× 1F1B" activation memory (arXiv 2401.10241 §2.1, Table 3)
    res = simulate(sched, costs, MemorySpec.uniform(n * v, act=1.0 / v, act_w=1.0 / v))
    assert [r.activations for r in res.memory] == pytest.approx([min(m, n)] * n)
    # W's share freed at I (M_W = 0): device r holds v·N − r chunks when N | m, as 1F1B's N − r stage-sized ones
    # spread over v chunks
    if m % n == 0:
        res = simulate(sched, costs, MemorySpec.uniform(n * v, act=1.0))
        assert [r.activations for r in res.memory] == [v * n - r for r in range(n)]


# --- options --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
def test_interleaved_zb_refuses_exactly_the_m_torch_refuses(n):
    import torch.distributed.pipelining.schedules as tps

    v = 2
    for m in range(1, 4 * n + 2):
        try:
            tps.ScheduleInterleavedZeroBubble([_FakeStage(c * n, n, v, 0, []) for c in range(v)], m)
            torch_ok = True
        except ValueError:
            torch_ok = False
        if torch_ok:
            get_schedule("interleaved-zb", n, steps=1, m=m, v=v)
        else:
            with pytest.raises(ConfigError, match=rf"^m={m} is invalid for interleaved-zb with stages={n}: it must be "
                                                  r"a multiple of max\(1, ⌊m/N⌋\) = \d+ .*\(set --m\)$") as exc:
                get_schedule("interleaved-zb", n, steps=1, m=m, v=v)
            ok = [int(x) for x in re.findall(r"e\.g\. m=(\d+) or m=(\d+)", str(exc.value))[0]]
            for good in ok:  # the suggested values are accepted by torch and by us
                tps.ScheduleInterleavedZeroBubble([_FakeStage(c * n, n, v, 0, []) for c in range(v)], good)
                get_schedule("interleaved-zb", n, steps=1, m=good, v=v)


@pytest.mark.parametrize("name", ["looped-bfs", "interleaved-zb"])
def test_bad_v_and_m_are_one_line_errors(name):
    with pytest.raises(ConfigError, match=r"^v=0 is invalid: must be an integer ≥ 1 \(set --v\)$"):
        get_schedule(name, 2, steps=1, m=4, v=0)
    with pytest.raises(ConfigError, match=r"^m=0 is invalid: must be an integer ≥ 1 \(set --m\)$"):
        get_schedule(name, 2, steps=1, m=0, v=2)
    assert get_schedule(name, 2, steps=1, m=4).virtual == 2  # v defaults to 2 as interleaved-1f1b's


def test_schedule_options_accept_m_and_v_and_refuse_a():
    from unbubble.config import check_schedule_options

    for name in ("looped-bfs", "interleaved-zb"):
        check_schedule_options([name], {"m": 8, "v": 3})
        with pytest.raises(ConfigError, match=rf"^a=2 has no effect on schedule='{name}', whose micro-batches per step "
                                              r"are --m: only paci, paci-stashed take --a"):
            check_schedule_options([name], {"a": 2})


def test_compile_is_refused_in_one_line_for_interleaved_zb_only():
    from unbubble.config import TrainConfig
    from unbubble.runtime.compiled import check_compile

    with pytest.raises(ConfigError) as exc:
        TrainConfig(compile=True, schedule="interleaved-zb")
    assert str(exc.value) == (
        "compile=True is invalid with schedule='interleaved-zb': its backward is split into I and W, but a compiled "
        "stage's backward is one autograd node that computes both (I would run the whole backward and W run it "
        "again); use --schedule interleaved-1f1b (the same v stages per device), or drop --compile")
    check_compile("inductor", "looped-bfs")  # full backward: compiles like interleaved-1f1b
    TrainConfig(compile=True, schedule="looped-bfs")


def test_torch_refuses_a_compiled_stage_for_interleaved_zb_too():
    import torch
    import torch.distributed.pipelining.schedules as tps

    stages = [_FakeStage(c * 2, 2, 2, 0, []) for c in range(2)]
    stages[0].submod = torch.compile(torch.nn.Linear(2, 2))  # wrapping only: nothing is compiled
    with pytest.raises(RuntimeError, match="ScheduleInterleavedZeroBubble schedule is not supported with stage modules "
                                           "that have used torch.compile"):
        tps.ScheduleInterleavedZeroBubble(stages, 4)
    tps.ScheduleLoopedBFS(stages, 4)  # torch does not refuse the full backward either


def test_schedules_command_lists_both():
    from click.testing import CliRunner

    from unbubble.cli import cli

    out = CliRunner().invoke(cli, ["schedules"])
    assert out.exit_code == 0, out.output
    assert "looped-bfs" in out.output and "arXiv 2211.05953" in out.output
    assert "interleaved-zb" in out.output


# --- synchronous semantics beyond the shared test (test_runtime.py::test_synchronous_schedules_...) ---------
def test_looped_bfs_with_adamw_equals_the_reference_summed_in_its_order_bit_for_bit():
    import torch
    from torch import nn

    from unbubble.runtime.emulator import run_emulator
    from helpers import tiny_gpt_job

    torch.set_num_threads(1)
    job = tiny_gpt_job(get_schedule("looped-bfs", 2, steps=3, m=4, v=2))
    sched = job.schedule
    stages = [job.stage_fn(s) for s in range(sched.n_stages)]
    opts = [job.optimizer_fn([p for p in mod.parameters() if p.requires_grad], s) for s, mod in enumerate(stages)]
    model = nn.Sequential(*stages)
    for t in range(sched.steps):  # the non-pipelined model: every forward, then the backwards last first
        batches = [job.batch_fn(k) for k in range(t * sched.mb_per_step, (t + 1) * sched.mb_per_step)]
        losses = [job.loss_fn(model(x), y) for x, y in batches]
        for loss in reversed(losses):
            (loss * sched.loss_scale).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    result = run_emulator(job)
    assert result.max_drift() == [0] * sched.n_stages
    for got, mod in zip(result.final_states, stages):
        want = mod.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("name", ["looped-bfs", "interleaved-zb"])
def test_exported_csv_is_torchs_own_schedule_for_its_runtime(name, tmp_path):
    import torch.distributed.pipelining.schedules as tps

    from unbubble.schedules.actions import export_torch_csv, load_csv

    n, m, v = 4, 8, 2
    path = tmp_path / "ours.csv"
    path.write_text(export_torch_csv(get_schedule(name, n, steps=2, m=m, v=v).static_order()))
    runtime = tps._PipelineScheduleRuntime([_FakeStage(c * n, n, v, 0, []) for c in range(v)], m)
    runtime._load_csv(str(path))  # torch validates it and lowers it with its sends/recvs
    cls = dict(OURS_TORCH)[name]
    native = getattr(tps, cls)([_FakeStage(c * n, n, v, 0, []) for c in range(v)], m)
    assert {r: [a for a in acts if a is not None] for r, acts in native.pipeline_order.items()} == runtime.pipeline_order
    runtime._dump_csv(str(tmp_path / "lowered.csv"), format="compute_comms")
    back = load_csv((tmp_path / "lowered.csv").read_text())
    assert _compute(back) == _compute(get_schedule(name, n, steps=1, m=m, v=v).static_order())
    validate(get_schedule(name, n, steps=1, m=m, v=v), back)
