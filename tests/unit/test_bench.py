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
