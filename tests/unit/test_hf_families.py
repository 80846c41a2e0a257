"""Every Hugging Face decoder family split_model supports, each with the feature its own forward adds
(sliding windows, Gemma2's soft-cap, padding, packed rows), trained split on the emulator against the
*unsplit* model's own training loop (``model(**batch).logits``, one AdamW, written here: nothing of
the split is shared with the reference). Tiny random-init configs, eager attention, dropout 0."""

import functools
import math
import warnings

import pytest
import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.models.split import causal_lm_loss, split_model
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from helpers import plain_hf_loop

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it

V, T, STEPS, M = 64, 12, 3, 4
WINDOW = 4  # shorter than T: a forgotten window changes every row's late positions

#: family -> (its tiny config's extra fields, the feature switched on). Every config is untied.
FAMILIES = {
    "gpt2": ({}, "padding"),
    "llama": ({}, "padding"),
    "mistral": ({"sliding_window": WINDOW}, "window"),
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, "window, 3 of 4 layers"),
    "qwen3": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2, "head_dim": 8},
              "window, 2 of 4 layers"),
    "phi3": ({"sliding_window": WINDOW}, "window"),
    "gemma": ({"head_dim": 8}, "embedding scale"),
    "gemma2": ({"sliding_window": WINDOW, "final_logit_softcapping": 1.0, "head_dim": 8},
               "alternating window, soft-cap 1.0"),
    "mixtral": ({"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}, "window, MoE"),
    "qwen2_moe": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
                  "window, MoE"),
}


def tiny(family: str, **extra) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_head=2, n_embd=32, n_positions=32, vocab_size=V, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="eager")
    else:
        cfg = transformers.AutoConfig.for_model(
            family, vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            tie_word_embeddings=False, attn_implementation="eager", **{**FAMILIES[family][0], **extra})
    return transformers.AutoModelForCausalLM.from_config(cfg)


def batch(kind: str, k: int):
    """Micro-batch k: ``padding``: row 0 left-padded by 2 + k mod 3 (mask 0, label -100); ``packed``:
    no mask, row 0 two documents (position ids restart at 5)."""
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, V, (2, T + 1), generator=g)
    x, y = {"input_ids": ids[:, :-1]}, ids[:, 1:].clone()
    if kind == "padding":
        mask = torch.ones(2, T, dtype=torch.long)
        mask[0, :2 + k % 3] = 0
        x["attention_mask"] = mask
        y[mask == 0] = -100
    else:
        pos = torch.arange(T).repeat(2, 1)
        pos[0, 5:] = torch.arange(T - 5)
        x["position_ids"] = pos
    return x, y


def adamw(params, stage=0):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def unsplit_loop(model: nn.Module, kind: str):
    """The reference: the unsplit model trained the ordinary way on one thread (the emulator's)."""
    return plain_hf_loop(model, steps=STEPS, m=M, batch=functools.partial(batch, kind))


def job(model, schedule: str, n: int, kind: str, steps: int = STEPS, **kw) -> PipelineJob:
    return PipelineJob(stage_fn=split_model(model, n), loss_fn=causal_lm_loss, batch_fn=lambda k: batch(kind, k),
                       optimizer_fn=adamw, schedule=get_schedule(schedule, n, steps=steps, **kw))


def difference(result, ref: nn.Module, ref_losses: list[float]) -> float:
    merged = {k: v for state in result.final_states for k, v in state.items()}
    want = ref.state_dict()
    assert set(merged) == set(want), sorted(set(merged) ^ set(want))
    diffs = [abs(a - b) for a, b in zip(result.step_losses, ref_losses, strict=True)]
    return max(diffs + [float((merged[k] - want[k]).abs().max()) for k in want])


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config notes
        yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_trains_split_on_2_and_4_stages_exactly_as_the_unsplit_model(family):
    model = tiny(family)
    ref, losses = unsplit_loop(model, "padding")
    for n in (2, 4):
        diff = difference(run_emulator(job(model, "1f1b-flush", n, "padding", m=M)), ref, losses)
        print(f"{family} ({FAMILIES[family][1]}, padding), N={n}: max difference {diff:.3g}")  # the note's table
        assert diff == 0


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen2_moe"])
def test_the_feature_changes_the_result_so_the_equality_above_is_not_vacuous(family):
    on = tiny(family)
    off = {"mistral": {"sliding_window": None}, "gemma2": {"sliding_window": 64, "final_logit_softcapping": None},
           "qwen2_moe": {"use_sliding_window": False}}[family]
    plain = tiny(family, **off)
    plain.load_state_dict(on.state_dict())
    x, _ = batch("padding", 0)
    with torch.no_grad():
        assert float((on(**x).logits - plain(**x).logits).abs().max()) > 1e-3


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_packed_rows_are_treated_as_the_unsplit_model_treats_them(family, use_cache):
    """Position ids restarting mid-row without a mask. HF's own forward builds a cache under
    config.use_cache (the default) and then reads no packing (one causal row, restarting positions);
    with use_cache=False, create_causal_mask detects the packed documents and attends within each."""
    model = tiny(family, use_cache=use_cache)
    x, _ = batch("packed", 0)
    with torch.no_grad():  # the second document alone, from position 0: equal only when packing is read
        alone = model(input_ids=x["input_ids"][:1, 5:]).logits
        gap = float((model(**x).logits[:1, 5:] - alone).abs().max())
    assert (gap < 1e-5) == (not use_cache), gap
    ref, losses = unsplit_loop(model, "packed")
    diff = difference(run_emulator(job(model, "1f1b-flush", 4, "packed", m=M)), ref, losses)
    print(f"{family}, packed rows, use_cache={use_cache}, N=4: max difference {diff:.3g}")
    assert diff == 0


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "mixtral"])
def test_paci_on_each_windowed_family_attains_its_drift_bound(family):
    j = job(tiny(family), "paci", 4, "padding", steps=4, a=2)
    assert run_emulator(j).max_drift() == [j.schedule.delay_bound(s) for s in range(4)] == [2, 1, 1, 0]


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_export_of_a_windowed_soft_capped_run_reproduces_its_final_logits(family, tmp_path):
    import dataclasses

    from unbubble.export import export
    from unbubble.runtime.checkpoint import Checkpointing

    model = tiny(family)
    j = dataclasses.replace(job(model, "1f1b-flush", 2, "padding", m=M),
                            checkpoint=Checkpointing(str(tmp_path / "run" / "checkpoints")))
    result = run_emulator(j)
    x, _ = batch("padding", 99)
    with torch.no_grad():
        h = x
        for stage, state in zip(j.stage_fn.stages(), result.final_states):
            stage.load_state_dict(state)
            h = stage(h)
        loaded = type(model).from_pretrained(export(tmp_path / "run" / "checkpoints", tmp_path / "hf"),
                                             attn_implementation="eager")
        diff = float((loaded(**x).logits - h).abs().max())
    print(f"export round trip, {family}: max logit difference {diff:.3g}")
    assert diff == 0


def test_a_split_that_forgets_what_the_model_does_is_refused_naming_the_stage(monkeypatch):
    import unbubble.models.split as split

    # a stage that forgets to put the received hidden states in place of its first layer's input
    monkeypatch.setattr(split, "_receive", lambda slot, keyword, module, args, kwargs: (args, kwargs))
    with pytest.raises(ConfigError, match=r"^the split does not compute what the whole model computes: stage 1 "
                                          r"\(layers 2–3\) differs by [0-9.e-]+ on a probe batch of 2×16 tokens with a "
                                          r"padding mask; .*verify=False if you know why \(loss by [0-9.e-]+\)$"):
        split_model(tiny("mistral"), 2)
    split_model(tiny("mistral"), 2, verify=False)  # the expert's way out: no check


def test_the_probe_costs_one_forward_and_reports_what_it_measured():
    s = split_model(tiny("gemma2"), 4)
    assert s.probe.logits == 0 and s.probe.loss == 0 and s.probe.shape == (2, 16)  # window 4 + 4 < 16
    assert math.isfinite(s.probe.seconds) and s.probe.seconds > 0  # the cost is measured (docs/models.md), not bounded here
    assert split_model(tiny("gemma2"), 4, verify=False).probe is None


@pytest.mark.parametrize("family, extra, message", [
    ("mixtral", {"output_router_logits": True}, "mixtral with output_router_logits=True: its load-balancing loss "
     "multiplies expert counts summed over all layers by router probabilities summed over all layers, so no stage can "
     "add its share locally (an asynchronous pipeline cannot train it exactly): set config.output_router_logits=False"),
    ("qwen2_moe", {"output_router_logits": True}, "qwen2_moe with output_router_logits=True: its load-balancing loss"),
])
def test_a_router_aux_loss_no_stage_can_compute_locally_is_refused(family, extra, message):
    with pytest.raises(ConfigError) as err:
        split_model(tiny(family, **extra), 2)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("make", [
    lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)),
    lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48, word_embed_proj_dim=32,
        tie_word_embeddings=False)),
])
def test_families_the_old_allowlist_refused_split_and_names_per_stage_stay_refused(make):
    """No allowlist: the probe is the gate (GPT-NeoX and OPT were refused by name before)."""
    model = make()
    assert split_model(model, 2).probe.logits == 0
    with pytest.raises(ConfigError, match=r"^module_names_per_stage with a Hugging Face model \(.*\): its forward does "
                                          r"not skip the parts a stage lacks; split it by n_stages or cuts="):
        split_model(model, module_names_per_stage=[["gpt_neox.embed_in"], ["embed_out"]])
