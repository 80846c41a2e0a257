"""This batch's features on a CUDA device (skipped without one): global clipping's sync and stale
scopes on device tensors, and a split Hugging Face model with a sliding window trained on the GPU
against the unsplit model's own loop on the same GPU."""

import copy
import dataclasses

import pytest
import torch

from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on(device, fn):
    def build(*args):
        out = fn(*args)
        return out.to(device) if isinstance(out, torch.nn.Module) else tuple(
            {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device) for x in out)
    return build


@pytest.mark.parametrize("schedule, scope", [("1f1b-flush", "sync"), ("paci", "sync"), ("paci", "stale")])
def test_clip_scopes_on_the_gpu_equal_the_cpu_run(schedule, scope):
    from unbubble.models.gpt2 import GPTConfig, gpt_loss
    from unbubble.models.partition import build_stages

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    sched = get_schedule(schedule, 4, steps=4, **({"a": 2} if schedule == "paci" else {"m": 2}))

    def stage(s):
        return build_stages(cfg, 4, 0, only=s, loss_scale=sched.loss_scale)[s]

    def batch(k):
        g = torch.Generator().manual_seed(k)
        x = torch.randint(0, 64, (2, 17), generator=g)
        return x[:, :-1], x[:, 1:]

    def opt(params, s):
        return torch.optim.AdamW(params, lr=3e-2)

    from unbubble.runtime.job import PipelineJob

    job = PipelineJob(stage, gpt_loss, batch, opt, sched, clip_grad_norm=0.05, clip_scope=scope)
    cpu = run_emulator(job)
    gpu = run_emulator(dataclasses.replace(job, stage_fn=_on("cuda", stage), batch_fn=_on("cuda", batch)))
    assert cpu.clip == gpu.clip and sum(cpu.clip["clipped"]) > 0  # the clip acted, on the same updates
    for a, b in zip(cpu.final_states, gpu.final_states):  # CUDA kernels round otherwise: measured ≤ 4.3e-4
        for k in a:
            torch.testing.assert_close(b[k].cpu(), a[k], rtol=1e-3, atol=1e-3)


def test_a_split_windowed_model_trains_on_the_gpu_as_the_unsplit_model_does():
    transformers = pytest.importorskip("transformers")
    from unbubble.models.split import causal_lm_loss, split_model
    from unbubble.runtime.job import PipelineJob

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     sliding_window=4, attn_implementation="eager", tie_word_embeddings=False)
    model = transformers.MistralForCausalLM(cfg)

    def batch(k):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 64, (2, 13), generator=g)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, :2] = 0
        y = ids[:, 1:].clone()
        y[mask == 0] = -100
        return {"input_ids": ids[:, :-1], "attention_mask": mask}, y

    def opt(params, s=0):
        return torch.optim.AdamW(params, lr=1e-2)

    split = split_model(model, 2)
    job = PipelineJob(_on("cuda", split), causal_lm_loss, _on("cuda", batch), opt,
                      get_schedule("1f1b-flush", 2, steps=3, m=2))
    result = run_emulator(job)
    ref = copy.deepcopy(model).cuda()
    o = opt(ref.parameters())
    for t in range(3):
        for k in range(2 * t, 2 * t + 2):
            x, y = _on("cuda", batch)(k)
            (causal_lm_loss(ref(**x).logits, y) / 2).backward()
        o.step()
        o.zero_grad()
    merged = {k: v for s in result.final_states for k, v in s.items()}
    diff = max(float((merged[k].cpu() - v.cpu()).abs().max()) for k, v in ref.state_dict().items())
    print(f"split Mistral (window 4) on CUDA against the unsplit model: max difference {diff:.3g}")
    assert diff <= 1e-5
