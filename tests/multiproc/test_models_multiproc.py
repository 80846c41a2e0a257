"""Llama-style and mixture-of-experts stages, pytree boundaries and split Hugging Face models across
real gloo processes and under torchrun (grouped tests: each run spawns N processes, ≈ 7 s on a 2-core
machine)."""

import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbubble.models import LlamaConfig, MoEConfig
from unbubble.export import export
from unbubble.runtime.checkpoint import Checkpointing
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.launch import run_processes
from unbubble.schedules import get_schedule
from unbubble.testing import train_without_pipeline
from helpers import hf_job, lm_batch, max_difference, plain_hf_loop, tiny_gpt_job, tiny_hf_gpt2, tiny_hf_llama, \
    tree_job

pytestmark = pytest.mark.multiproc
torch.set_num_threads(1)


def test_flush_processes_equal_non_pipelined_reference_for_llama_and_moe():
    llama = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, hidden=48, block_size=16, vocab_size=64)
    moe = MoEConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, hidden=24, block_size=16, vocab_size=64,
                    n_expert=4, top_k=2)
    for config in (llama, moe):
        job = tiny_gpt_job(get_schedule("1f1b-flush", 2, steps=2, m=4), config=config)
        result = run_processes(job)
        ref_states, ref_losses = train_without_pipeline(job)
        for got, want in zip(result.final_states, ref_states):
            for name in want:  # MoE: the router counters are in the state too
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
        assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)


def test_pytree_boundaries_and_split_hf_models_across_processes(tmp_path):
    # [Note: trees in a frame]: a tuple and a dict cross the boundaries, shapes vary per micro-batch,
    # an integer leaf and a detached float travel without gradients
    job = tree_job("paci", a=2)
    emu = run_emulator(job)
    proc = run_processes(job)  # the deterministic order: equal to the emulator's
    assert proc.step_losses == emu.step_losses and len(emu.step_losses) == 3
    for e, p in zip(emu.final_states, proc.final_states):
        assert all(torch.equal(e[k], p[k]) for k in e)
    assert proc.max_drift() == emu.max_drift() == [1, 1, 0]
    # two data-parallel replicas average their gradients over tree boundaries
    dp = run_processes(dataclasses.replace(tree_job("1f1b-flush"), dp=2))
    assert len(dp.step_losses) == 3 and all(math.isfinite(x) for x in dp.step_losses)
    assert dp.step_losses != emu.step_losses
    # split HF models (the [hf] extra): 1F1B-flush equals the plain loop of the unsplit model; at N=4 with
    # eager attention and a padding mask that changes the result (it must travel to every stage)
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install 'unbubble[hf]')")
    for make, n, attn, padded in [(tiny_hf_gpt2, 2, "sdpa", False), (tiny_hf_gpt2, 4, "eager", True),
                                  (tiny_hf_llama, 2, "sdpa", False), (tiny_hf_llama, 4, "eager", True)]:
        model = make(attn=attn)
        run_dir = tmp_path / f"{make.__name__}-{n}"
        job = dataclasses.replace(hf_job(model, "1f1b-flush", n, padded=padded),
                                  checkpoint=Checkpointing(str(run_dir / "checkpoints")))
        result = run_processes(job)
        ref, losses = plain_hf_loop(model, padded)
        diff = max_difference(result.final_states, result.step_losses, ref, losses)
        print(f"processes, {make.__name__}, N={n}, {attn}{' + padding' if padded else ''}: max difference {diff:.3g}")
        assert diff <= 1e-6
        # the export round trip: the checkpoints the stage processes wrote, as a from_pretrained folder
        # (from_pretrained picks its default attention: name the run's, or padded positions' logits differ)
        loaded = type(model).from_pretrained(export(run_dir, tmp_path / f"hf-{make.__name__}-{n}"),
                                             attn_implementation=attn)
        x, _ = lm_batch(True, 99)
        with torch.no_grad():  # the run's final logits: its stages with the weights the processes reported
            h = x
            for stage, state in zip(job.stage_fn.stages(), result.final_states):
                stage.load_state_dict(state)
                h = stage(h)
            diff = float((loaded(**x).logits - h).abs().max())
        print(f"processes, {make.__name__}, N={n}: export round trip, max logit difference {diff:.3g}")
        assert diff == 0


_TORCHRUN_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])  # tests/: the fixtures' module
from unbubble.runtime.launch import run_torchrun
from helpers import tree_job
torch.set_num_threads(1)
result = run_torchrun(tree_job("paci", a=2))
if result is not None:
    torch.save({"losses": result.step_losses, "states": result.final_states}, sys.argv[1])
"""


def test_pytree_boundaries_under_torchrun_equal_the_emulator_bit_for_bit(tmp_path):
    script, out = tmp_path / "run.py", tmp_path / "result.pt"
    script.write_text(_TORCHRUN_SCRIPT)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                    str(script), str(out), str(Path(__file__).resolve().parents[1])], check=True, timeout=240,
                   capture_output=True)
    got = torch.load(out, weights_only=True)
    emu = run_emulator(tree_job("paci", a=2))
    assert got["losses"] == emu.step_losses
    for e, p in zip(emu.final_states, got["states"]):
        assert all(torch.equal(e[k], p[k]) for k in e)
