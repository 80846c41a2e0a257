"""benchmarks/gpu_check.py: says so and exits 0 without CUDA; its measurement and prediction agree
on the CPU for the tiny preset (weights exactly, activations within the analytic model's error)."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "x.json")]) == 0
    assert capsys.readouterr().out.startswith("gpu_check: no CUDA device on this machine")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_measurement_beside_the_prediction_on_cpu(recompute):
    """tiny, PACI a=2 on 2 stages, fp32: parameters 4 bytes each, exactly as the analytic model counts
    them; the measured activations are within 10 % of the prediction (Korthikanti's formula, an
    estimate) on every stage (measured 3–7 %)."""
    torch.set_num_threads(1)
    r = gpu_check.measure("tiny", "paci", 2, 2, 2, 1, 1, 1, "fp32", recompute, "cpu", "h200")
    assert r["weight_bytes"] == r["predicted_weight_bytes"]
    for got, want in zip(r["activation_bytes"], r["predicted_activation_bytes"]):
        assert abs(got - want) <= 0.10 * want
    assert r["tokens_per_s"] > 0


def test_compiled_comparison_on_cpu(capsys, tmp_path):
    """Step 4 on the CPU with aot_eager (tiny, 2 stages, 1 step after 1 warm-up): both schedules are
    timed eager and compiled, the ratio and the compile time are reported."""
    import argparse

    torch.set_num_threads(1)
    o = argparse.Namespace(model="tiny", schedule="paci", stages=2, a=2, m=2, micro_batch_size=1, steps=1, warmup=1,
                           device="cpu", hardware="h200", compile_precision="fp32", compile_backend="aot_eager",
                           out=str(tmp_path / "g.json"))
    pairs = gpu_check.compare_compiled(o, [], {})
    assert [p["schedule"] for p in pairs] == ["1f1b-flush", "paci"]
    for p in pairs:
        assert p["errors"] == [] and p["compiled_over_eager"] > 0 and p["compile_s"] is not None
    assert "torch.compile (aot_eager) against eager" in capsys.readouterr().out
