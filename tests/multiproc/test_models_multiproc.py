"""Llama-style and mixture-of-experts stages across real gloo processes (one grouped test: each run
spawns N processes, ≈ 7 s on a 2-core machine)."""

import pytest
import torch

from unbubble.models import LlamaConfig, MoEConfig
from unbubble.runtime.launch import run_processes
from unbubble.schedules import get_schedule
from unbubble.testing import tiny_gpt_job, train_without_pipeline

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
