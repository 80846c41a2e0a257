"""The timed simulator: engine equivalence, analytic bubbles, PACI drift, jitter determinism, memory, reports."""

import itertools
import re

import pytest

from unbubble.schedules import SCHEDULES, ActionKind, get_schedule
from unbubble.schedules.registry import V_SHAPED, VIRTUAL
from unbubble.sim import PipelineCosts, StageCosts, Straggler, UniformCosts, kernel, run_policies

K = ActionKind


def _rows(trace):
    return [(str(r.action), r.start, r.end, r.version, r.weights_version) for r in trace.records]


def _sched(name, n, steps, x):
    kw = {"paci": dict(a=x), "async-1f1b": {}, "pipedream": {}, "pipemare": {}}.get(name, dict(m=x))
    return get_schedule(name, n, steps=steps, **kw)


# ---------------------------------------------------------------------------------------------
# Engine


_COSTS = [
    UniformCosts(f=1, b=2),
    UniformCosts(f=1, b=2, u=0.0, latency=0.0, i=1.0, w=1.0),  # ties everywhere, zero-length U
    UniformCosts(f=0.3, b=0.7, u=0.05, latency=0.1),
    PipelineCosts(tuple(StageCosts(0.5 + 0.1 * s, 1.1, 0.6, 0.5, 0.2) for s in range(4)), message_bytes=1e6,
                  bandwidth_bytes_per_s=1e7, latency_s=0.01, jitter=0.3, seed=7,
                  stragglers=(Straggler(1, 3.0, 2.0, 6.0),)),
]


@pytest.mark.parametrize("name", [s for s in SCHEDULES if s not in VIRTUAL + V_SHAPED])  # 4-stage PipelineCosts: one stage a rank
def test_kernel_equals_reference(name, monkeypatch):
    """[Note: engine fast paths]: the kernel's ListPolicy/PaciPolicy rules give the reference's trace (the
    kernel compiled with numba, or run as plain Python without it)."""
    monkeypatch.delenv("UNBUBBLE_SIM_NUMBA", raising=False)
    if kernel.compiled() is None:
        monkeypatch.setattr(kernel, "compiled", lambda: kernel._kernel)
    for n, x, costs in itertools.product([1, 2, 4], [1, 3, 4], _COSTS):
        if isinstance(costs, PipelineCosts) and n != 4:
            continue
        try:
            sched = _sched(name, n, 3, x)
        except Exception:  # e.g. pipedream-2bw needs m ≥ N−1
            continue
        fast, ref = run_policies(sched, costs), run_policies(sched, costs, fast=False)
        assert fast.columns() is not None and ref.columns() is None  # the kernel's trace, the reference's
        assert _rows(fast) == _rows(ref), (name, n, x, costs)
        assert fast.max_delay() == ref.max_delay() and fast.utilization() == ref.utilization()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("fb", [(1.0, 1.0), (1.0, 2.0), (0.7, 1.9), (2.5, 0.4)])
def test_flush_utilization_is_m_over_m_plus_n_minus_1(n, m, fb):
    trace = run_policies(get_schedule("1f1b-flush", n, steps=3, m=m), UniformCosts(f=fb[0], b=fb[1]))
    assert trace.utilization() == pytest.approx([m / (m + n - 1)] * n, rel=1e-12, abs=0)


def test_paci_steady_state_utilization():
    trace = run_policies(get_schedule("paci", 8, steps=250, a=8), UniformCosts(f=1, b=2))  # 2000 micro-batches
    assert min(trace.utilization()) >= 0.99


@pytest.mark.parametrize("a", [1, 2, 4, 8, 16])
def test_paci_drift_per_stage_is_ceil_n_minus_i_over_a(a):
    n = 8
    trace = run_policies(get_schedule("paci", n, steps=max(8, 64 // a), a=a), UniformCosts(f=1, b=2))
    assert trace.max_drift() == [-(-(n - 1 - s) // a) for s in range(n)]  # ⌈(N−i)/a⌉, i = s + 1
    hist = trace.drift_histogram()
    assert all(sum(h.values()) == trace_total for h in hist for trace_total in [max(8, 64 // a) * a])
    assert max(hist[0]) == -(-(n - 1) // a) and set(hist[n - 1]) == {0}


@pytest.mark.parametrize("n,m", [(2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zb_h1_bubble_is_one_third_of_1f1b(n, m):
    """At F = I = W the bubble is (N−1)(T_F+T_B−T_W) = N−1 vs 1F1B's 3(N−1) (ZB paper Table 2)."""
    costs = UniformCosts(f=1, b=2, i=1, w=1)
    flush = get_schedule("1f1b-flush", n, steps=1, m=m)
    bubble_1f1b = run_policies(flush, costs).makespan - 3 * m
    zb = run_policies(get_schedule("zb-h1", n, steps=1, m=m), costs)
    assert bubble_1f1b == 3 * (n - 1)
    assert (zb.makespan - 3 * m) / bubble_1f1b == pytest.approx(1 / 3)


def test_jitter_is_deterministic_and_common_across_schedules():
    def costs(seed):
        return PipelineCosts(tuple(StageCosts.from_fb(1.0, 2.0, 0.1) for _ in range(4)), jitter=0.2, seed=seed)

    sched = get_schedule("paci", 4, steps=20, a=4)
    t1, t2, t3 = run_policies(sched, costs(1)), run_policies(sched, costs(1)), run_policies(sched, costs(2))
    assert _rows(t1) == _rows(t2)
    assert _rows(t1) != _rows(t3)
    durations = [r.end - r.start for r in t1.records if r.action.kind is K.F]
    assert len(set(durations)) > 10 and sum(durations) / len(durations) == pytest.approx(1.0, rel=0.1)
    # [Note: common random numbers]: the k-th forward of stage 2 lasts as long under another schedule
    flush = run_policies(get_schedule("1f1b-flush", 4, steps=20, m=4), costs(1))

    def fwd(trace):
        return [r.end - r.start for r in trace.records if r.action.kind is K.F and r.action.stage == 2]

    assert fwd(flush) == pytest.approx(fwd(t1), rel=1e-12)


def test_straggler_window_and_message_time():
    base = PipelineCosts(tuple(StageCosts(1.0, 3.0, 1.5, 1.5) for _ in range(2)), message_bytes=2e6,
                         bandwidth_bytes_per_s=1e6, latency_s=0.5)
    assert base.send_latency(0, 1) == base.send_latency(1, 0) == 2.5
    trace = run_policies(get_schedule("1f1b-flush", 2, steps=1, m=1), base)
    assert [(str(r.action), r.start) for r in trace.records][:3] == [("0F0", 0.0), ("1F0", 3.5), ("1B0", 4.5)]
    slow = PipelineCosts(base.stages, stragglers=(Straggler(1, 2.0, 0.0, 2.0),))
    t = run_policies(get_schedule("1f1b-flush", 2, steps=2, m=1), slow)
    d = {str(r.action): r.end - r.start for r in t.records}
    assert (d["1F0"], d["1B0"], d["1F1"]) == (2.0, 3.0, 1.0)  # slowed only while starting in [0, 2)


def test_cost_model_errors():
    from unbubble.errors import ConfigError

    with pytest.raises(ConfigError, match=r"jitter=-1 is invalid"):
        PipelineCosts((StageCosts(1, 2, 1, 1),), jitter=-1)
    with pytest.raises(ConfigError, match="describes 1 stages but the schedule has 2"):
        run_policies(get_schedule("paci", 2, steps=1, a=1), PipelineCosts((StageCosts(1, 2, 1, 1),)))
    with pytest.raises(ConfigError, match=r"straggler='x' is invalid: expected STAGE:SLOWDOWN"):
        Straggler.parse("x")
    assert Straggler.parse("3:2.5:1:4") == Straggler(3, 2.5, 1.0, 4.0)


# ---------------------------------------------------------------------------------------------
# Memory


def test_memory_hand_computed_1f1b_and_zb_h1():
    from unbubble.sim.memory import MemorySpec, peak_memory

    sched = get_schedule("1f1b-flush", 2, steps=2, m=3)
    spec = MemorySpec((100.0,) * 2, (50.0,) * 2, (300.0,) * 2, (10.0,) * 2)
    mem = peak_memory(run_policies(sched, UniformCosts(f=1, b=2)), spec)
    # stage 0 holds 2 micro-batches (warm-up F0, then F1 before B0), stage 1 one: 450 static + 10 per micro-batch
    assert [(m.peak_in_flight, m.activations, m.peak) for m in mem] == [(2, 20.0, 470.0), (1, 10.0, 460.0)]
    # ZB-H1 by hand (N=2, m=2, M_B=10, M_W=4). Stage 0: F0 F1 I0 W0 I1 W1 -> 10, 20, 14, 10, 4, 0.
    # Stage 1: F0 I0 F1 I1 W0 W1 -> 10, 4, 14, 8, 4, 0: the peak (14) holds F1 plus W0's 4 bytes.
    zb = run_policies(get_schedule("zb-h1", 2, steps=1, m=2), UniformCosts(f=1, b=2, i=1, w=1))
    mem = peak_memory(zb, MemorySpec.uniform(2, act=10.0, act_w=4.0))
    assert [(m.activations, m.peak_in_flight, m.stash) for m in mem] == [(20.0, 2, 0.0), (14.0, 2, 0.0)]


def test_memory_counts_stashed_versions_from_the_trace():
    from unbubble.sim.memory import MemorySpec, peak_memory

    n = 4
    spec = MemorySpec.uniform(n, weights=100.0, act=1.0)
    pd = get_schedule("pipedream", n, steps=24)
    mem = peak_memory(run_policies(pd, UniformCosts(f=1, b=2)), spec, stashed=True)
    assert [m.peak_versions for m in mem] == [n - s for s in range(n)]  # N + 1 − i versions, i = s + 1
    assert [m.stash for m in mem] == [100.0 * (n - 1 - s) for s in range(n)]
    paci = peak_memory(run_policies(get_schedule("paci", n, steps=24, a=1), UniformCosts()), spec)
    assert [m.stash for m in paci] == [0.0] * n  # backward on current weights: nothing stashed
    twobw = peak_memory(run_policies(get_schedule("pipedream-2bw", n, steps=6, m=4), UniformCosts()), spec, stashed=True)
    assert max(m.peak_versions for m in twobw) == 2


def test_memory_sums_virtual_stages_per_device():
    from unbubble.sim.memory import MemorySpec, peak_memory

    sched = get_schedule("interleaved-1f1b", 2, steps=1, m=4, v=2)
    spec = MemorySpec(tuple(float(10 ** s) for s in range(4)), (0.0,) * 4, (0.0,) * 4, (0.0,) * 4)
    mem = peak_memory(run_policies(sched, UniformCosts()), spec)
    assert [m.weights for m in mem] == [1.0 + 100.0, 10.0 + 1000.0]  # stage s lives on device s mod 2


# ---------------------------------------------------------------------------------------------
# Cost models


def test_analytic_costs_follow_component_costs_and_zero_bubble_table_1():
    from unbubble.models.partition import component_costs
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.hardware import get_hardware

    cfg = make_model("zb-1.5b")
    hw = get_hardware("a100-80g")
    am = analytic_model(cfg, 8, hw, 6, layers_per_stage=[2, 3, 3, 3, 3, 3, 3, 2])
    h, s, b, a = 2304, 1024, 6, 24
    mid = am.costs.stages[1]
    emb, blocks, head = component_costs(cfg, 1024)
    assert mid.f_s == pytest.approx(3 * blocks[0] * s * b / hw.flops)
    # per block: F = sbh(24h + 4s), I = sbh(24h + 8s), W = sbh·24h (arXiv 2401.10241, Table 1)
    assert (mid.f_s, mid.i_s, mid.w_s) == pytest.approx(
        tuple(3 * s * b * h * x / hw.flops for x in (24 * h + 4 * s, 24 * h + 8 * s, 24 * h)))
    assert mid.b_s == pytest.approx(mid.i_s + mid.w_s) == pytest.approx(2 * mid.f_s)
    assert am.memory.act_bytes[1] == 3 * s * b * (34 * h + 5 * a * s)  # Korthikanti et al. §4.1
    assert am.memory.act_w_bytes[1] == 3 * 32 * s * b * h
    assert am.params[1] == 3 * (12 * h * h + 13 * h)
    assert sum(am.params) == 22 * (12 * h * h + 13 * h) + (50304 + 1024) * h + 50304 * h + 2 * h
    assert am.costs.send_latency(0, 1) == pytest.approx(hw.intra_latency_s + s * b * h * 2 / hw.intra_node_bytes_per_s)


def test_hardware_presets_and_errors():
    from unbubble.errors import ConfigError
    from unbubble.sim.hardware import HARDWARE, get_hardware

    assert {h: round(p.peak_flops / 1e12, 1) for h, p in HARDWARE.items()} == {"a100-80g": 312.0, "h100": 989.5,
                                                                                 "h200": 989.5}
    assert get_hardware("H200", achievable=0.5).flops == pytest.approx(0.5 * 989.5e12)
    assert all(p.source for p in HARDWARE.values())
    with pytest.raises(ConfigError, match="hardware='tpu' is unknown: valid presets are a100-80g, h100, h200"):
        get_hardware("tpu")
    with pytest.raises(ConfigError, match=r"achievable=1.5 is invalid"):
        get_hardware("h100", achievable=1.5)


def _write_run(path, sched, costs, micro_batch_size=2, seq_len=8):
    """A run folder as `unbubble train` writes it, from a simulated trace."""
    import json

    trace = run_policies(sched, costs)
    path.mkdir()
    cfg = {"schedule": sched.name, "stages": sched.n_stages, "steps": sched.steps, "a": sched.mb_per_step,
           "m": sched.mb_per_step, "micro_batch_size": micro_batch_size, "seq_len": seq_len}
    (path / "config.json").write_text(json.dumps(cfg))
    lines = [json.dumps({"stage": r.action.stage, "action": str(r.action), "kind": r.action.kind.value,
                         "mb": r.action.mb, "start_s": r.start + 5.0, "end_s": r.end + 5.0, "version": r.version})
             for r in trace.records]
    (path / "actions.jsonl").write_text("\n".join(lines) + "\n")
    return trace


def test_measured_costs_recover_the_costs_of_a_trace(tmp_path):
    from unbubble.sim.measured import load_run, measured_costs

    truth = PipelineCosts(tuple(StageCosts(0.1 * (s + 1), 0.3, 0.15, 0.15, 0.02) for s in range(3)), latency_s=0.01)
    trace = _write_run(tmp_path / "run", get_schedule("paci", 3, steps=6, a=2), truth)
    run = load_run(tmp_path / "run")
    assert run.trace.makespan == pytest.approx(trace.makespan)  # shifted back to start at 0
    got = measured_costs(run.trace)
    assert [x for s in got.stages for x in s.as_list()] == pytest.approx([x for s in truth.stages for x in s.as_list()])
    assert got.latency_s == pytest.approx((0.01, 0.01))


# ---------------------------------------------------------------------------------------------
# Results, reports, pictures, commands


def test_throughput_and_report_formats():
    from unbubble.sim import report
    from unbubble.sim.memory import MemorySpec
    from unbubble.sim.result import simulate

    n, m = 4, 8
    costs = UniformCosts(f=1, b=2)
    flush = simulate(get_schedule("1f1b-flush", n, steps=8, m=m), costs, MemorySpec.uniform(n, act=1e9),
                     samples_per_mb=4, tokens_per_mb=4096)
    assert flush.steady_samples_per_s == pytest.approx(m * 4 / ((m + n - 1) * 3))  # one step every (m+N−1)(F+B)
    assert flush.tokens_per_s == pytest.approx(flush.samples_per_s * 1024)
    paci = simulate(get_schedule("paci", n, steps=32, a=m), costs, samples_per_mb=4)
    assert paci.steady_samples_per_s == pytest.approx(4 / 3)  # one micro-batch every F + B
    rows = report.summary_rows([flush, paci])
    assert rows[1]["speedup"] == pytest.approx((m + n - 1) / m)
    md = report.to_markdown(rows, report.SUMMARY_COLUMNS)
    assert md.splitlines()[0].startswith("| schedule | devices |") and "| paci (a=8) |" in md
    assert "peak GB" in md and "| 4.00 |" in md  # flush: 4 micro-batches of 1 GB on stage 0
    csv_lines = report.to_csv(rows, report.SUMMARY_COLUMNS).splitlines()
    header = csv_lines[0].split(",")
    assert header[:3] == ["schedule", "ranks", "micro_batches"] and "steady_tokens_per_s" in header
    assert float(csv_lines[2].split(",")[header.index("speedup")]) == pytest.approx((m + n - 1) / m)
    stages = report.stage_rows(flush)
    assert [r["peak_in_flight"] for r in stages] == [4, 3, 2, 1]
    drift = report.drift_rows([paci])
    assert {(r["stage"], r["drift"]) for r in drift} >= {(0, 1), (3, 0)}


def test_timeline_png_and_chrome_trace(tmp_path):
    import json

    from unbubble.sim.render import chrome_trace, timeline_png, window_end

    trace = run_policies(get_schedule("interleaved-1f1b", 2, steps=2, m=4, v=2), UniformCosts(u=0.5))
    png = timeline_png(trace, tmp_path / "t.png", title="x", t_end=window_end(trace, 4, 1))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    data = json.loads(chrome_trace(trace, tmp_path / "t.json").read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(trace)
    first = xs[0]
    assert (first["name"], first["tid"], first["ts"], first["dur"]) == ("0F0", 0, 0.0, 1e6)
    assert {e["tid"] for e in xs} == {0, 1} and all(e["args"]["stage"] % 2 == e["tid"] for e in xs)


def test_speedups_equal_the_analytic_ratio_under_uniform_costs():
    from unbubble.sim.extrapolate import speedups
    from unbubble.sim.hardware import get_hardware

    got = speedups("tiny", get_hardware("h200"), n_stages=4, ms=(4, 8), micro_batch_size=1, uniform=True)
    assert [(s.m, s.predicted) for s in got] == [(4, pytest.approx(7 / 4)), (8, pytest.approx(11 / 8))]


def test_cli_simulate_writes_pictures_and_tables(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    out = tmp_path / "sim"
    res = CliRunner().invoke(cli, ["simulate", "--schedule", "paci", "--a", "2", "--stages", "4", "--uniform", "1:2",
                                   "--compare", "1f1b-flush,zb-h1", "--m", "4", "--micro-batches", "16",
                                   "--jitter", "0.1", "--out", str(out), "--format", "csv"])
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in out.iterdir())
    assert {"summary.csv", "summary.md", "stages.csv", "drift.csv", "timeline-paci-a2.png",
            "trace-zb-h1-m4.json"} <= set(names)
    lines = res.stdout.splitlines()
    assert lines[0].startswith("schedule,ranks,micro_batches") and lines[1].startswith("paci (a=2),4,16,")
    res2 = CliRunner().invoke(cli, ["simulate", "--uniform", "1:2", "--stages", "4", "--out", str(tmp_path / "b"),
                                    "--jitter", "0.1", "--format", "csv"])
    res3 = CliRunner().invoke(cli, ["simulate", "--uniform", "1:2", "--stages", "4", "--out", str(tmp_path / "c"),
                                    "--jitter", "0.1", "--format", "csv"])
    assert res2.stdout == res3.stdout  # deterministic for a fixed seed, jitter included


def test_cli_simulate_analytic_model(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    res = CliRunner().invoke(cli, ["simulate", "--model", "gpt2", "--hardware", "h100", "--stages", "4",
                                   "--micro-batch-size", "2", "--compare", "interleaved-1f1b,pipedream",
                                   "--m", "4", "--out", str(tmp_path / "a"), "--format", "markdown"])
    assert res.exit_code == 0, res.output
    assert "| interleaved-1f1b (m=4) | 4 |" in res.output and "stash GB" in res.output


def test_cli_simulate_tables_fit_the_terminal_and_wide_shows_every_column(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from unbubble.cli import cli
    from unbubble.sim.report import STAGE_COLUMNS, SUMMARY_COLUMNS

    monkeypatch.chdir(tmp_path)
    args = ["-q", "simulate", "--compare", "1f1b-flush", "--micro-batches", "64", "--out", "s"]
    narrow = CliRunner().invoke(cli, args, env={"COLUMNS": "80"})
    assert narrow.exit_code == 0, narrow.output
    assert max(map(len, narrow.stdout.splitlines())) <= 80
    assert "hidden to fit 80 columns: devices, micro-batches" in " ".join(narrow.stdout.split())
    assert "1,167,683" in narrow.stdout  # numbers are never cut
    wide = CliRunner().invoke(cli, args + ["--wide"], env={"COLUMNS": "80"})
    assert wide.exit_code == 0, wide.output
    header_lines = [line for line in wide.stdout.splitlines() if line.startswith("┃")]
    assert len(header_lines) == 3  # one table of schedules, one per schedule of devices, headers unwrapped
    headers = [[cell.strip() for cell in line.strip("┃").split("┃")] for line in header_lines]
    barrier = ("clip_scope", "vs_no_barrier")  # only with --clip-scope (tests/unit/test_sim_barrier.py)
    assert headers == ([[c.header for c in SUMMARY_COLUMNS if c.key not in barrier]]
                       + 2 * [[c.header for c in STAGE_COLUMNS]])
    assert "hidden" not in wide.stdout and max(map(len, wide.stdout.splitlines())) > 150
    csv = CliRunner().invoke(cli, ["-q", "simulate", "--micro-batches", "64", "--out", "c", "--format", "csv"],
                             env={"COLUMNS": "80"})
    assert csv.stdout.splitlines()[0].startswith("schedule,ranks,micro_batches,makespan_s")
    assert "bottleneck" not in csv.stdout  # stdout holds the two tables only (header + rows, a blank line each)
    assert [len(block.splitlines()) for block in csv.stdout.strip().split("\n\n")] == [2, 9]


@pytest.mark.parametrize("layers, holds", [
    (None, "block 23 + LM head"),  # the cost-balanced split: the head costs ≈ 3.5 blocks of gpt2-medium
    ("6,3,3,3,3,3,3,0", "embedding + blocks 0–5"),
])
def test_cli_simulate_names_the_bottleneck_stage(tmp_path, monkeypatch, layers, holds):
    """The bottleneck is the stage with the largest F + B of the analytic model, computed here from its costs."""
    from click.testing import CliRunner

    from unbubble.cli import cli
    from unbubble.sim.analytic import analytic_model, make_model
    from unbubble.sim.hardware import get_hardware

    counts = None if layers is None else [int(x) for x in layers.split(",")]
    am = analytic_model(make_model("gpt2-medium"), 8, get_hardware("h200"), 16, layers_per_stage=counts)
    work = [c.f_s + c.b_s for c in am.costs.stages]
    worst = max(range(8), key=work.__getitem__)
    assert worst == (7 if layers is None else 0)
    monkeypatch.chdir(tmp_path)
    args = ["-q", "simulate", "--micro-batches", "64", "--out", "s"]
    res = CliRunner().invoke(cli, args + (["--layers-per-stage", layers] if layers else []), env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    share = work[worst] / sum(work)
    assert f"stage {worst} is the bottleneck: {holds} (blocks per stage " in text
    assert f"{work[worst] / (sum(work) / 8):.2f}× the mean stage" in text
    assert abs(float(text.split(" of the work")[0].rsplit(" ", 1)[1].rstrip("%")) / 100 - share) < 0.01
    assert max(map(len, res.stdout.splitlines())) <= 80
    assert "stage 7 is the bottleneck" in (tmp_path / "s" / "summary.md").read_text() or layers


@pytest.mark.parametrize("schedule,extra,layers", [
    ("zbv", [], "0,12,12,0"),  # 2 chunks per device: 2N counts
    ("interleaved-1f1b", ["--v", "2"], "6,6,6,6"),
])
def test_cli_simulate_layers_per_stage_reach_schedules_with_several_chunks_per_device(tmp_path, schedule, extra, layers):
    """--layers-per-stage was dropped whenever a device held more than one chunk: now its N·v counts are the split
    the bottleneck line reports, and they change the result (against the cost-balanced default)."""
    from click.testing import CliRunner

    from unbubble.cli import cli

    def run(*more):
        res = CliRunner().invoke(cli, ["-q", "simulate", "--schedule", schedule, "--stages", "2", "--m", "4",
                                       "--micro-batches", "8", "--format", "csv", "--out", str(tmp_path / "o"),
                                       *extra, *more])
        assert res.exit_code == 0, res.output
        return (tmp_path / "o" / "summary.md").read_text()

    given, default = run("--layers-per-stage", layers), run()
    assert f"(blocks per stage {layers})" in given and f"(blocks per stage {layers})" not in default


def test_cli_simulate_balanced_stages_blame_the_schedule(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    res = CliRunner().invoke(cli, ["-q", "simulate", "--uniform", "1:2", "--stages", "4", "--schedule", "1f1b-flush",
                                   "--m", "4", "--compare", "paci", "--a", "4", "--out", str(tmp_path / "u")],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "1f1b-flush (m=4): 42.9% mean bubble, every device does the same work" in text
    assert "paci (a=4): " + "4.5% mean bubble" not in text and "bottleneck" not in text  # PACI's bubble is ≤ 10 %


@pytest.mark.parametrize("args,msg", [
    (["--schedule", "nope"], "error: schedule='nope' is unknown: valid schedules are"),
    (["--hardware", "tpu"], "error: hardware='tpu' is unknown: valid presets are a100-80g, h100, h200"),
    (["--model", "gpt5"], "error: model='gpt5' is unknown (did you mean 'gpt2'?): valid models are tiny"),
    (["--uniform", "1"], "error: uniform='1' is invalid: expected seconds as F:B[:U] with F, B > 0 and U ≥ 0"),
    (["--uniform", "0:0"], "error: uniform='0:0' is invalid: expected seconds"),  # was a numpy traceback
    (["--uniform", "-1:2"], "error: uniform='-1:2' is invalid: expected seconds"),
    (["--straggler", "9:2", "--uniform", "1:2", "--jitter", "0.1"], "error: straggler stage=9 is invalid"),
    (["--uniform", "1:2", "--costs-from", "x"], "error: --uniform and --costs-from are exclusive"),
])
def test_cli_simulate_errors(tmp_path, args, msg):
    from click.testing import CliRunner

    from unbubble.cli import cli

    res = CliRunner().invoke(cli, ["simulate", "--stages", "4", "--out", str(tmp_path / "o")] + args)
    assert res.exit_code == 2 and msg in res.output, res.output


def test_cli_predict_matches_a_run_made_of_simulated_actions(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    costs = PipelineCosts(tuple(StageCosts(0.02, 0.04, 0.02, 0.02, 0.001) for _ in range(3)), latency_s=0.002)
    _write_run(tmp_path / "run", get_schedule("1f1b-flush", 3, steps=4, m=4), costs)
    res = CliRunner().invoke(cli, ["predict", str(tmp_path / "run"), "--format", "csv", "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert re.search(r"predicted 1\.508 s \([+-]0\.0%\)", (tmp_path / "p" / "prediction.md").read_text())
    rows = res.stdout.splitlines()
    header = rows[0].split(",")
    for line in rows[1:4]:
        vals = dict(zip(header, line.split(",")))
        assert float(vals["measured_utilization"]) == pytest.approx(float(vals["predicted_utilization"]))
    bad = CliRunner().invoke(cli, ["predict", str(tmp_path / "nothing")])
    assert bad.exit_code == 2 and "is not a folder" in bad.output
    # the calibrated costs drive `simulate` for other schedules
    sim = CliRunner().invoke(cli, ["simulate", "--costs-from", str(tmp_path / "run"), "--stages", "3", "--schedule",
                                   "1f1b-flush", "--m", "4", "--micro-batches", "16", "--compare", "paci",
                                   "--a", "4", "--out", str(tmp_path / "s"), "--format", "csv"])
    assert sim.exit_code == 0, sim.output
    flush_row = sim.stdout.splitlines()[1].split(",")
    assert flush_row[0] == "1f1b-flush (m=4)" and float(flush_row[3]) == pytest.approx(1.508, abs=1e-3)


def test_cli_extrapolate_small(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    page = tmp_path / "x.md"
    res = CliRunner().invoke(cli, ["extrapolate", "--models", "zb-1.5b", "--schedules", "1f1b-flush,paci",
                                   "--speedup-model", "gpt2", "--write", str(page)])
    assert res.exit_code == 0, res.output
    text = page.read_text()
    assert "| 1.5B | 8 | 24 | " in text and "(11.8)" in text and "| 8 | 1.875 |" in text


def test_simulator_modules_import_without_torch():
    import subprocess
    import sys

    names = [f"unbubble.sim.{m}" for m in ("result", "report", "render", "memory", "hardware", "measured",
                                            "extrapolate", "analytic")]
    code = f"import sys; import {', '.join(names)}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_simulate_gives_v_to_every_schedule_with_chunks_per_rank():
    # regression: --v reached interleaved-1f1b only, so looped-bfs --v 3 simulated v = 2
    from unbubble.cli.simulate import _schedule

    for name in VIRTUAL:
        sched = _schedule(name, 2, 8, a=4, m=4, v=3)
        assert (sched.n_ranks, sched.n_stages, sched.virtual) == (2, 6, 3), name
