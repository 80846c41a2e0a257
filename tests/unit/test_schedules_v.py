"""The V-shaped schedules zbv and dualpipev (issue 27): placement (rank r holds stages r and
2N − 1 − r), torch 2.13's runtime order, bubble and activation memory on unit costs against the
published figures, compound actions, the transport's channels, resume and the option checks.

Private torch APIs used (as tests/unit/test_schedules_torch.py): the schedule classes' constructors,
``_step_microbatches`` and ``_initialize_stages`` (replaced on the instance).
"""

import dataclasses

import pytest

from unbubble.errors import ConfigError
from unbubble.schedules import ActionKind, dump_csv, get_schedule
from unbubble.schedules.actions import Overlap, flatten
from unbubble.sim.validate import validate
from unbubble.sim import UniformCosts, run_policies

from test_schedules_torch import _FakeStage, _compute

V = [("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")]


def _torch_v_order(cls_name: str, n: int, m: int) -> list[list[str]]:
    """What each rank's torch runtime computes for its two V stages (r, 2N − 1 − r), in order."""
    import torch.distributed.pipelining.schedules as tps

    ran = []
    for r in range(n):
        log: list[str] = []
        sched = getattr(tps, cls_name)([_FakeStage(s, n, 2, r, log) for s in (r, 2 * n - 1 - r)], m)
        sched._initialize_stages = lambda *a, **k: None
        sched._step_microbatches()  # OVERLAP_F_B runs its two sub-actions in order
        ran.append([x for x in log if "REDUCE_GRAD" not in x])
    return ran


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (4, 8), (4, 16), (3, 6), (3, 7), (8, 16), (2, 5)])
@pytest.mark.parametrize("name,cls_name", V)
def test_order_equals_torch_runtime(name, cls_name, n, m):
    ran = _torch_v_order(cls_name, n, m)
    assert sum(map(len, ran)) >= 2 * n * m * 2  # F and B (or I and W) of both chunks, every micro-batch
    assert _compute(get_schedule(name, n, steps=1, m=m).static_order()) == ran


@pytest.mark.parametrize("n,m", [(2, 1), (2, 3), (4, 2), (4, 7)])
def test_zbv_with_fewer_micro_batches_than_its_warm_up_equals_torch(n, m):
    # torch pads to max(m, 2N − 1) micro-batch slots and drops the padded ones: so does zbv
    assert _compute(get_schedule("zbv", n, steps=1, m=m).static_order()) == _torch_v_order("ScheduleZBVZeroBubble", n, m)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_v_placement_and_validation(name, n):
    m = 2 * n
    sched = get_schedule(name, n, steps=2, m=m)
    assert (sched.n_stages, sched.n_ranks, sched.virtual, sched.placement) == (2 * n, n, 2, "v")
    assert [sched.stages_of(r) for r in range(n)] == [[r, 2 * n - 1 - r] for r in range(n)]
    assert [sched.rank_of(s) for s in range(2 * n)] == list(range(n)) + list(reversed(range(n)))
    trace = validate(sched)  # counts, causality, no deadlock, Δ = 0
    assert trace.max_drift() == [0] * (2 * n)
    assert trace.order() == sched.static_order()  # the trace's ranks follow the placement
    assert [sched.rank_of(a.stage) for r, acts in enumerate(sched.static_order()) for a in acts] == \
        [r for r, acts in enumerate(sched.static_order()) for _ in acts]


def test_dualpipev_compound_actions_round_trip_and_flatten():
    sched = get_schedule("dualpipev", 2, steps=1, m=4)
    raw = sched.compound_order()
    pairs = [a for acts in raw for a in acts if isinstance(a, Overlap)]
    assert pairs and all(a.first.kind is ActionKind.F and a.second.kind is ActionKind.B for a in pairs)
    assert all(a.first.stage != a.second.stage for a in pairs)  # one chunk's F with the other's B
    flat, firsts = flatten(raw[1])
    assert flat == sched.static_order()[1]
    assert len(firsts) == sum(isinstance(a, Overlap) for a in raw[1]) > 0
    for i in firsts:
        assert (flat[i].kind, flat[i + 1].kind) == (ActionKind.F, ActionKind.B)
    assert str(pairs[0]) == f"({pairs[0].first};{pairs[0].second})OVERLAP_F_B"  # torch's cell form
    assert "OVERLAP_F_B" in dump_csv(raw)


# --- bubbles and memory on unit costs ------------------------------------------------------------------
# Chunk-sized actions F = I = W = 1 (B = 2). Each rank works 6m per step (2 chunks × m × 3).
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_bubble_and_memory_on_unit_costs(n, m):
    from unbubble.sim.memory import MemorySpec
    from unbubble.sim.result import simulate

    costs = UniformCosts(f=1.0, b=2.0, i=1.0, w=1.0)
    one = run_policies(get_schedule("zbv", n, steps=1, m=m), costs)
    # one flushed step: only the fill and drain, N − 1 chunk actions per rank: half ZB-H1's (N − 1 stage-sized
    # actions), a third of 1F1B-flush's bubble over 2 chunks, whatever m
    assert [one.makespan - b for b in one.busy_per_rank()] == [n - 1] * n
    # back to back, a rank starts its next step while the others finish theirs: (N − 1)/3 per step; the
    # source's zero bubble (arXiv 2401.10241 §6, at T_F = T_B = T_W) needs its optimizer post-validation (no flush)
    three = run_policies(get_schedule("zbv", n, steps=3, m=m), costs)
    assert three.makespan == pytest.approx(3 * 6 * m + (n - 1))
    # 1F1B's activation memory: 2N chunk-sized = N stage-sized micro-batches on every device (1F1B's first
    # stage holds N), whether a split backward frees its share at I or at W
    for act_w in (0.0, 1.0):
        res = simulate(get_schedule("zbv", n, steps=2, m=m), costs, MemorySpec.uniform(2 * n, act=1.0, act_w=act_w))
        assert [r.activations for r in res.memory] == [2 * n] * n


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_dualpipev_bubble_and_memory_are_deepseeks_table(n, m):
    from unbubble.sim.memory import MemorySpec
    from unbubble.sim.result import simulate

    # DeepSeek-V3 Table 2 / DualPipe's README: bubble (PP/2 − 1)(F&B + B − 3W) with PP = 2N chunks, B the full
    # backward, F&B an overlapped pair's duration; with the overlap φ = 1 the pair takes max(F, B) = 2
    f, b, w = 1.0, 2.0, 1.0
    costs = UniformCosts(f=f, b=b, i=b - w, w=w, overlap=1.0)
    trace = run_policies(get_schedule("dualpipev", n, steps=1, m=m), costs)
    assert max(trace.makespan - x for x in trace.busy_per_rank()) == pytest.approx((n - 1) * (max(f, b) + b - 3 * w))
    # φ = 0 (the parts one after the other, as on a CPU): every rank works 6m and waits N − 1
    seq = run_policies(get_schedule("dualpipev", n, steps=1, m=m), dataclasses.replace(costs, overlap=0.0))
    assert [seq.makespan - x for x in seq.busy_per_rank()] == [n - 1] * n
    assert seq.busy_per_rank() == [6 * m] * n
    # PP + 1 = 2N + 1 chunk activations per device (and 2 chunks' parameters: the two stages it holds)
    res = simulate(get_schedule("dualpipev", n, steps=2, m=m), costs, MemorySpec.uniform(2 * n, act=1.0, act_w=1.0))
    assert [r.activations for r in res.memory] == [2 * n + 1] * n


def test_the_overlap_factor_shortens_exactly_the_compound_pairs():
    costs = UniformCosts(f=1.0, b=2.0, i=1.0, w=1.0)
    sched = get_schedule("dualpipev", 4, steps=1, m=8)
    pairs = [sum(isinstance(a, Overlap) for a in acts) for acts in sched.compound_order()]
    for phi in (0.25, 0.5, 1.0):
        busy = run_policies(sched, dataclasses.replace(costs, overlap=phi)).busy_per_rank()
        # each pair F(1) + B(2) takes 3 − φ·1
        assert busy == pytest.approx([6 * 8 - phi * p for p in pairs])
    with pytest.raises(ConfigError, match=r"overlap=1.5 is invalid.*\[0, 1\]"):
        UniformCosts(overlap=1.5)


def test_v_schedules_compute_flushed_updates_on_the_emulator_and_resume_bit_for_bit(tmp_path):
    from unbubble.runtime.checkpoint import Checkpointing
    from unbubble.runtime.emulator import run_emulator
    from unbubble.testing import assert_resume_is_bit_identical
    from helpers import tiny_gpt_job

    for name in ("zbv", "dualpipev"):
        job = dataclasses.replace(tiny_gpt_job(get_schedule(name, 2, steps=6, m=4)),
                                  checkpoint=Checkpointing(str(tmp_path / name), every=3, keep=3))
        assert_resume_is_bit_identical(job, 3)
        result = run_emulator(job)
        assert result.max_drift() == [0] * 4
        # the trace's device view: rank 0 ran stages 0 and 3, rank 1 stages 1 and 2
        assert [sorted({a.stage for a in acts}) for acts in result.trace.order()] == [[0, 3], [1, 2]]


def test_transport_channels_follow_the_placement():
    from unbubble.runtime.transport import pipeline_channels

    v = get_schedule("zbv", 3, steps=1, m=6).ranks  # (0, 1, 2, 2, 1, 0)
    # activations 0→1, 1→2 down, (2→2 local), 2→1, 1→0 up; gradients the reverse; one boundary each
    assert sorted(pipeline_channels(v)) == sorted([(True, 0, 1, 1), (True, 1, 2, 1), (True, 2, 1, 1), (True, 1, 0, 1),
                                                   (False, 1, 0, 1), (False, 2, 1, 1), (False, 1, 2, 1),
                                                   (False, 0, 1, 1)])
    loop = get_schedule("interleaved-1f1b", 2, steps=1, m=4, v=2).ranks  # (0, 1, 0, 1)
    assert sorted(pipeline_channels(loop)) == [(False, 0, 1, 1), (False, 1, 0, 2), (True, 0, 1, 2), (True, 1, 0, 1)]
    assert pipeline_channels((0, 0, 0)) == []  # one rank: every hand-over is local


def test_option_checks():
    with pytest.raises(ConfigError, match=r"m=6 is invalid for dualpipev with stages=4: it needs m ≥ 2N = 8"):
        get_schedule("dualpipev", 4, steps=1, m=6)
    from unbubble.runtime.compiled import check_compile

    for name in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=f"compile=True is invalid with schedule='{name}': its backward is split"):
            check_compile("inductor", name)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_exported_v_csv_loads_in_torch_with_the_v_placement(name, tmp_path):
    """``unbubble schedules --export``: torch's ``_load_csv`` reads the file back and its validator accepts it;
    DualPipeV's overlapped F+B are single ``OVERLAP_F_B`` cells, which torch reads as one compound action."""
    from click.testing import CliRunner
    from test_schedule_ir import _fake_stages, _tps

    from unbubble.cli import cli

    tps, n, m = _tps(), 4, 8
    path = tmp_path / "v.csv"
    res = CliRunner().invoke(cli, ["schedules", "--export", name, "--stages", str(n), "--m", str(m), str(path)])
    assert res.exit_code == 0, res.output
    runtime = tps._PipelineScheduleRuntime(_fake_stages(n, 2), m)
    runtime._load_csv(str(path))  # torch's validator infers the placement from the rows
    assert tps._validate_schedule(runtime.pipeline_order, n, 2 * n, m) == {s: min(s, 2 * n - 1 - s) for s in range(2 * n)}
    compound = [a for acts in runtime.pipeline_order.values() for a in acts if a.sub_actions is not None]
    overlaps = [a for acts in get_schedule(name, n, steps=1, m=m).compound_order() for a in acts if isinstance(a, Overlap)]
    assert len(compound) == len(overlaps) and (name == "zbv") == (not overlaps)
    assert all(a.computation_type == tps.OVERLAP_F_B and [str(x) for x in a.sub_actions] == [str(p) for p in o.parts]
               for a, o in zip(compound, overlaps))


def test_chunks_balance_the_devices_not_the_chunks():
    """Regression (a user trial): balancing each of zbv's 16 chunks alone left device 0 (chunks 0 and
    15: the embedding and the LM head) at 1.6× the mean device; partition_for_devices balances the
    devices, letting the first chunk hold only the embedding and the last only the head."""
    from unbubble.models.partition import component_costs, partition_for_devices
    from unbubble.sim.analytic import make_model

    cfg = make_model("gpt2-medium")
    emb, blocks, head = component_costs(cfg)
    for name, kw in (("zbv", {}), ("interleaved-zb", {"v": 2})):
        ranks = get_schedule(name, 8, steps=1, m=16, **kw).ranks
        parts = partition_for_devices(cfg, ranks)
        assert all(len(r) >= 1 for r in parts[1:-1]) and parts[0].start == 0 and parts[-1].stop == 24
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))  # contiguous
        cost = [len(r) * blocks[0] + (emb if j == 0 else 0) + (head if j == len(parts) - 1 else 0)
                for j, r in enumerate(parts)]
        device = [sum(c for c, rk in zip(cost, ranks) if rk == r) for r in range(8)]
        # no split does better than the mean device, nor than the head's device with one block per
        # middle chunk it holds; blocks come whole, so within one block of the larger bound
        head_device = [j for j, rk in enumerate(ranks) if rk == ranks[-1]]
        bound = max(sum(device) / 8, head + blocks[0] * sum(0 < j < len(ranks) - 1 for j in head_device))
        assert max(device) <= bound + blocks[0], (name, [len(r) for r in parts])
    with pytest.raises(ConfigError, match="stages=16 with 32 chunks is invalid: the model has 24 layers"):
        partition_for_devices(cfg, get_schedule("zbv", 16, steps=1, m=32).ranks)


def test_zbv_holds_2n_chunk_activations_and_its_gb_follow_the_blocks_each_device_holds():
    """Issue 37: the docs said zbv holds 1F1B's activations per device, while `unbubble simulate`
    showed 62 GB for zbv against 48 GB for 1f1b-flush (gpt2-medium, N = 8, m = 16). Hand count from
    the action lists: every zbv device r peaks at 2N = 16 chunk activations, 2N − 1 − r micro-batches
    of its first chunk (r) and r + 1 of its second (2N − 1 − r); 1F1B-flush's device 0 at N = 8
    stage activations. So in micro-batches × blocks the two are equal only where a device's two chunks hold 1/N of the
    blocks. The device-balanced split gives zbv's chunks 0,2,2,2,2,2,2,2,1,1,1,1,2,2,2,0 blocks
    (chunk 0 the embedding alone, chunk 15 the head alone): device 1 holds 14 micro-batches of
    chunk 1 (2 blocks) and 2 of chunk 14 (2 blocks), 32 block activations, against 1F1B-flush's
    device 0 with 8 of 3 blocks, 24: 4/3 the activation bytes, which is the simulator's figure."""
    from collections import Counter

    from unbubble.models.partition import partition_for_devices, partition_layers
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.hardware import HARDWARE
    from unbubble.sim.result import simulate

    n, m = 8, 16

    def peak_in_flight(sched):  # per rank: the largest {stage: forwards not yet through their W (or B)}
        peaks = []
        for acts in sched.static_order():
            live, best = Counter(), Counter()
            for a in acts:
                live[a.stage] += {"F": 1, "W": -1, "B": -1}.get(a.kind.value, 0)
                if sum(live.values()) > sum(best.values()):
                    best = live.copy()
            peaks.append(+best)
        return peaks

    zbv, flush = get_schedule("zbv", n, steps=1, m=m), get_schedule("1f1b-flush", n, steps=1, m=m)
    zbv_peaks, flush_peaks = peak_in_flight(zbv), peak_in_flight(flush)
    assert [sum(p.values()) for p in zbv_peaks] == [2 * n] * n
    assert [dict(p) for p in zbv_peaks] == [{r: 2 * n - 1 - r, 2 * n - 1 - r: r + 1} for r in range(n)]
    assert [dict(p) for p in flush_peaks] == [{r: n - r} for r in range(n)]
    cfg = make_model("gpt2-medium")
    zbv_blocks = [len(r) for r in partition_for_devices(cfg, zbv.ranks)]
    flush_blocks = [len(r) for r in partition_layers(cfg, n, cfg.block_size)]
    assert zbv_blocks == [0, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 0] and flush_blocks[0] == 3
    block_acts = [sum(k * zbv_blocks[s] for s, k in p.items()) for p in zbv_peaks]
    assert block_acts[1] == 32 and n * flush_blocks[0] == 24
    hw = HARDWARE["h200"]
    acts = {}
    for name, sched in (("zbv", zbv), ("1f1b-flush", flush)):
        am = analytic_model(cfg, n, hw, 16, cfg.block_size, virtual=sched.virtual, placement=sched.placement)
        acts[name] = simulate(sched, am.costs, am.memory).memory
    assert acts["zbv"][1].activations / acts["1f1b-flush"][0].activations == pytest.approx(32 / 24, rel=0.01)
