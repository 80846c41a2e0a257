"""``unbubble bench`` without spawning processes: the module loads, the calibrated sleep is
precise, and the report renders the targets (the timed parts run in ``unbubble bench`` only)."""

import time

import pytest

from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.cli.bench import bench, load_bench_module


def test_bench_module_loads_and_its_sleep_is_calibrated(monkeypatch):
    # what the sleep does, not how long a busy machine lets it take: it sleeps until the calibrated
    # margin before the deadline, spins to the deadline, and never returns early
    mod = load_bench_module()
    margin = mod.sleep_margin(samples=5, probe_s=0.001)
    assert margin >= 0.0005
    slept = []
    real_sleep = time.sleep
    monkeypatch.setattr(mod.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    t = time.perf_counter()
    mod.calibrated_sleep(0.01 + margin, margin)
    assert time.perf_counter() - t >= 0.01 + margin and slept == [pytest.approx(0.01)]
    slept.clear()
    mod.calibrated_sleep(margin / 2, margin)  # shorter than the margin: spins only
    assert slept == []


def test_report_names_the_targets_and_the_simulator_ratio():
    mod = load_bench_module()
    systems = {name: {"tokens_per_s": 1000.0, "utilization": [0.8, 0.8], "busy_ms_per_mb": [10.0, 10.0]}
               for name in ("unbubble 1f1b-flush", "torch Schedule1F1B")}
    res = {
        "config": {"n": 2, "m": 4, "steps": 2, "repeats": 1, "threads": 1, "sleep_n": 8, "sleep_m": 8, "sleep_steps": 1},
        "machine": {"cpus": 2, "torch": "x", "load_avg_1min_before": 0.5, "load_avg_1min_after": 0.5},
        "model": {"systems": systems, "ratios": {"flush / torch 1F1B": 1.0}, "bubble_ratio": 1.25,
                  "targets": {"flush >= 0.95 x torch 1F1B": {"value": 1.0, "target": 0.95, "met": True}}},
        "synthetic": {"f_s": 0.05, "b_s": 0.1, "schedules": {
            "paci": {"runtime_makespan_s": 1.02, "simulated_makespan_s": 1.0, "ratio": 1.02, "within_5pct": True,
                     "simulated_from_measured_durations_s": 1.01}},
            "paci_speedup_over_flush": {"runtime": 1.4, "simulated": 1.45}},
    }
    text = mod.format_report(res)
    assert "target flush >= 0.95 x torch 1F1B: 1.000 vs 0.950 -> met" in text
    assert "within 5%: yes" in text and "runtime 1.400, simulator 1.450" in text


def test_bench_command_is_registered():
    # the command itself, not through the group: the group's logging set-up would outlive the test
    assert cli.commands["bench"] is bench
    out = CliRunner().invoke(bench, ["--help"])
    assert out.exit_code == 0 and "torch.distributed.pipelining" in out.output


def test_bench_sim_baseline_loads_a_second_copy_beside_this_one():
    """``bench_sim.py --baseline``: another checkout's simulator imports beside this one (separate
    module objects, ``sys.modules`` left as it was) and gives the same trace."""
    import importlib.util
    import sys
    from pathlib import Path

    import unbubble.sim.engine as engine

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_sim", root / "benchmarks" / "bench_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    this = mod._load(None)
    before = dict(sys.modules)
    base = mod._load(str(root / "src"))
    assert sys.modules["unbubble.sim.engine"] is engine and set(sys.modules) == set(before)
    assert base.run_policies is not this.run_policies and this.run_policies is engine.run_policies
    traces = [api.run_policies(api.get_schedule("zb-h1", 3, steps=2, m=4), mod._costs(api, "jitter", 3))
              for api in (base, this)]
    assert mod._digest(traces[0]) == mod._digest(traces[1]) and len(traces[0]) == 3 * 2 * (3 * 4 + 1)


def test_bench_startup_reports_medians_and_ratios_of_alternating_runs(tmp_path, monkeypatch):
    """``bench_startup.py``: runs alternate between the checkouts, medians per checkout, this ÷ baseline."""
    import importlib.util
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_startup", root / "benchmarks" / "bench_startup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = tmp_path / "base"
    (base / "src" / "unbubble").mkdir(parents=True)
    order = []
    figures = {root: iter([(300, 4.0), (320, 4.4), (310, 4.1)]), base.resolve(): iter([(500, 5.5), (480, 5.9), (470, 5.2)])}

    def fake_run(checkout, steps, work):
        order.append(checkout)
        rss, startup = next(figures[checkout])
        return {"rss_mib": [rss + 10, rss - 10], "peak_rss_mib": [rss + 40] * 2, "mean_rss_mib": rss,
                "mean_peak_rss_mib": rss + 40, "startup_s": startup}

    monkeypatch.setattr(mod, "run_once", fake_run)
    report = mod.main(["--baseline", str(base), "--out", str(tmp_path / "out.json")])
    assert order == [root, base.resolve()] * 3
    assert report["this"]["mean_rss_mib"] == 310 and report["baseline"]["mean_rss_mib"] == 480
    assert report["this"]["max_stage_rss_mib"] == 320 and report["this"]["startup_s"] == 4.1
    assert report["baseline"]["startup_s"] == 5.5
    with pytest.raises(SystemExit, match="no src/unbubble there"):
        mod.main(["--baseline", str(tmp_path), "--out", str(tmp_path / "x.json")])


def test_model_systems_put_each_clipped_row_beside_its_unclipped_one():
    """Part 1's order (each repeat rotates it): paci, then its stale, sync and stage clips; 1f1b-flush, then
    its sync clip; torch's PipelineStage rows (clip sync, clip stale, none) just before our paci. --no-clip
    drops every clipped row, --no-torch-stage the PipelineStage rows, --no-compile the compiled ones."""
    mod = load_bench_module()
    cfg = mod.BenchConfig()
    names = [f"{engine} {name}" for engine, name in mod.model_systems(cfg)]
    assert names == ["unbubble 1f1b-flush", "unbubble 1f1b-flush + clip sync", "unbubble gpipe",
                     "unbubble paci dynamic",
                     "unbubble 1f1b-flush compiled", "unbubble paci compiled", "torch ScheduleGPipe",
                     "torch Schedule1F1B", "paci on torch PipelineStage + clip sync",
                     "paci on torch PipelineStage + clip stale", "paci on torch PipelineStage", "unbubble paci",
                     "unbubble paci + clip stale", "unbubble paci + clip sync", "unbubble paci + clip stage"]
    assert set(mod.CLIPPED) == {n for n in names if " + clip " in n}
    cfg.clip = False
    assert [f"{e} {n}" for e, n in mod.model_systems(cfg)] == [n for n in names if n not in mod.CLIPPED]
    cfg.clip, cfg.torch_stage, cfg.compile = True, False, False
    assert [f"{e} {n}" for e, n in mod.model_systems(cfg)] == [
        n for n in names if "PipelineStage" not in n and "compiled" not in n]


def test_variant_names_the_schedule_order_and_clip_scope():
    mod = load_bench_module()
    assert mod._variant("paci") == ("paci", "deterministic", None)
    assert mod._variant("paci dynamic") == ("paci", "dynamic", None)
    assert mod._variant("paci + clip stale") == ("paci", "deterministic", "stale")
    assert mod._variant("1f1b-flush + clip sync") == ("1f1b-flush", "deterministic", "sync")
    assert mod._variant("PipelineStage + clip sync")[2] == "sync" and mod._variant("PipelineStage")[2] is None
    cfg = mod.BenchConfig()
    job = mod._model_job(cfg, "paci + clip stage", 2)
    assert (job.clip_grad_norm, job.clip_scope, job.schedule.name) == (1.0, "stage", "paci")
    assert mod._model_job(cfg, "1f1b-flush", 2).clip_grad_norm is None


def _fake_model_results(mod, cfg, speed):
    """What ``_spawn(_model_worker, …)`` returns, per rank: one row per repeat and system, rank 0's wall
    = tokens ÷ speed[system] ÷ load[repeat] (a repeat-wide slowdown the per-repeat ratios cancel)."""
    tokens = cfg.steps * cfg.m * cfg.micro_batch_size * cfg.seq_len
    load = [1.0, 2.0, 0.5]
    per_rank = [[], []]
    for rep in range(-1, cfg.repeats):
        for engine, name in mod.model_systems(cfg):
            wall = tokens / speed[f"{engine} {name}"] * load[max(rep, 0)]
            for r in range(cfg.n):
                row = {"repeat": rep, "engine": engine, "schedule": name, "wall_s": wall, "busy_s": 0.5 * wall}
                if engine == "unbubble":
                    row["update_s"] = 0.01 * cfg.steps * (r + 1)
                if engine == mod.TORCH_STAGE_ENGINE and " + clip " in name:
                    row["clip_s"] = 0.002 * cfg.steps * (r + 1)
                per_rank[r].append(row)
    return per_rank


def test_bench_model_reports_the_clip_ratios_and_targets_without_processes(monkeypatch):
    """bench_model's arithmetic on fake runs: each clipped row ÷ its unclipped one and the issue-34 targets
    (PACI + stale ≥ 0.97 × PACI, PACI on torch's PipelineStage ≥ 0.95 × ours), medians of per-repeat ratios
    that a repeat-wide slowdown does not move; the report prints them with the ms inside the clips."""
    mod = load_bench_module()
    cfg = mod.BenchConfig(repeats=3, steps=2, compile=False)
    speed = {f"{e} {n}": 1000.0 for e, n in mod.model_systems(cfg)}
    speed.update({"unbubble paci": 1200.0, "unbubble paci + clip stale": 1176.0, "unbubble paci + clip sync": 900.0,
                  "unbubble paci + clip stage": 1188.0, "unbubble 1f1b-flush + clip sync": 980.0,
                  "paci on torch PipelineStage": 1080.0, "paci on torch PipelineStage + clip sync": 972.0,
                  "paci on torch PipelineStage + clip stale": 1069.2})
    monkeypatch.setattr(mod, "_spawn", lambda target, world, cfg: _fake_model_results(mod, cfg, speed))
    res = mod.bench_model(cfg)
    r = res["ratios"]
    assert r["paci + clip stale / paci"] == pytest.approx(0.98)
    assert r["paci + clip sync / paci"] == pytest.approx(0.75)
    assert r["paci + clip stage / paci"] == pytest.approx(0.99)
    assert r["1f1b-flush + clip sync / 1f1b-flush"] == pytest.approx(0.98)
    assert r["paci + clip stale / 1f1b-flush + clip sync"] == pytest.approx(1.2)
    assert r["paci on torch PipelineStage / unbubble paci"] == pytest.approx(0.9)
    assert r["paci on torch PipelineStage + clip sync / PipelineStage"] == pytest.approx(0.9)
    assert r["paci on torch PipelineStage + clip stale / PipelineStage"] == pytest.approx(0.99)
    t = res["targets"]
    assert t["paci + clip stale >= 0.97 x paci"] == {"value": pytest.approx(0.98), "target": 0.97, "met": True}
    assert t["paci on torch PipelineStage >= 0.95 x unbubble paci"]["met"] is False
    assert res["systems"]["unbubble paci + clip sync"]["update_ms_per_step"] == pytest.approx([10.0, 20.0])
    assert res["systems"]["paci on torch PipelineStage + clip stale"]["clip_ms_per_step"] == pytest.approx([2.0, 4.0])
    text = mod.format_report({"config": {**vars(cfg)}, "machine": {"cpus": 2, "torch": "x", "load_avg_1min_before": 3.0,
                                                                   "load_avg_1min_after": 4.0}, "model": res})
    assert "target paci + clip stale >= 0.97 x paci: 0.980 vs 0.970 -> met" in text
    assert "target paci on torch PipelineStage >= 0.95 x unbubble paci: 0.900 vs 0.950 -> NOT met" in text
    assert "paci on torch PipelineStage + clip stale: ms per step inside PipelineClip, per stage 2.00 4.00" in text
    assert "paci + clip sync 10.00 20.00" in text and "(other work shares the cores: expect noise)" in text

    cfg = mod.BenchConfig(repeats=1, steps=2, compile=False, clip=False)  # --no-clip: no clip rows, ratios or targets
    res = mod.bench_model(cfg)
    assert not [k for k in res["ratios"] if "clip" in k] and "paci + clip stale >= 0.97 x paci" not in res["targets"]
    assert "paci on torch PipelineStage >= 0.95 x unbubble paci" in res["targets"]


def test_bench_command_passes_no_clip(monkeypatch, tmp_path):
    mod = load_bench_module()
    seen = []
    monkeypatch.setattr(mod, "run", lambda cfg: seen.append(cfg) or {"config": {}, "machine": {}})
    monkeypatch.setattr(mod, "format_report", lambda res: "report")
    out = CliRunner().invoke(bench, ["--no-clip", "--no-compile", "--only", "model", "--out", str(tmp_path / "b.json")])
    assert out.exit_code == 0, out.output
    assert seen[0].clip is False and seen[0].compile is False and seen[0].parts == ("model",)
    out = CliRunner().invoke(bench, ["--quick", "--out", str(tmp_path / "b.json")])
    assert out.exit_code == 0 and seen[1].clip is True and seen[1].repeats == 1


def test_a_subset_of_systems_reports_only_the_ratios_it_can(monkeypatch):
    """``--systems``: a pair timed alone (more repeats for the same time on a loaded machine) gets its ratio
    and target, nothing that needs a system that did not run; an unknown name is refused before any spawn."""
    mod = load_bench_module()
    cfg = mod.BenchConfig(repeats=3, steps=2, systems=("unbubble paci + clip stale", "unbubble paci"))
    assert mod.model_systems(cfg) == [("unbubble", "paci"), ("unbubble", "paci + clip stale")]
    speed = {"unbubble paci": 1000.0, "unbubble paci + clip stale": 960.0}
    monkeypatch.setattr(mod, "_spawn", lambda target, world, cfg: _fake_model_results(mod, cfg, speed))
    res = mod.bench_model(cfg)
    assert res["ratios"] == {"paci + clip stale / paci": pytest.approx(0.96)}
    assert res["targets"] == {"paci + clip stale >= 0.97 x paci": {"value": pytest.approx(0.96), "target": 0.97,
                                                                   "met": False}}
    assert "target paci + clip stale >= 0.97 x paci: 0.960 vs 0.970 -> NOT met" in mod.format_report(
        {"config": vars(cfg), "machine": {"cpus": 2, "torch": "x", "load_avg_1min_before": 0.5,
                                          "load_avg_1min_after": 0.5}, "model": res})
    with pytest.raises(SystemExit):
        mod.main(["--systems", "unbubble paci,unbubble pacy"])
