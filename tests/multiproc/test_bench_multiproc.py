"""``unbubble bench``'s model part on real gloo processes, shrunk to a smoke run: every row runs, the
clipped ones included (our runtime with each --clip-scope, PipelineClip on torch's PipelineStage), and
each clipped row gets its ratio to the unclipped one."""

import pytest

from unbubble.cli.bench import load_bench_module

pytestmark = pytest.mark.multiproc


def test_bench_model_runs_every_clipped_row():
    mod = load_bench_module()
    cfg = mod.BenchConfig(steps=2, repeats=1, micro_batch_size=2, seq_len=16, compile=False)
    res = mod.bench_model(cfg)
    assert set(res["systems"]) == {f"{e} {n}" for e, n in mod.model_systems(cfg)}
    assert all(s["tokens_per_s"] > 0 for s in res["systems"].values())
    for key in ("paci + clip stale / paci", "paci + clip sync / paci", "paci + clip stage / paci",
                "1f1b-flush + clip sync / 1f1b-flush", "paci on torch PipelineStage + clip stale / PipelineStage",
                "paci on torch PipelineStage + clip sync / PipelineStage"):
        assert res["ratios"][key] > 0
    assert {"paci + clip stale >= 0.97 x paci",
            "paci on torch PipelineStage >= 0.95 x unbubble paci"} <= set(res["targets"])
    assert len(res["systems"]["paci on torch PipelineStage + clip stale"]["clip_ms_per_step"]) == 2
