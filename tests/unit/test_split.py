"""split_model (models/split.py): Hugging Face GPT-2 and Llama, a torchtitan-layout model and named
stages, trained on the emulator against a plain single-process loop of the unsplit model."""

import copy
import dataclasses
import itertools
import logging
import warnings

import pytest
import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.models.split import causal_lm_loss, split_model
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from helpers import HF_VOCAB as V, hf_adamw as adamw, hf_job, lm_batch, max_difference, plain_hf_loop as plain_loop, \
    tiny_hf_gpt2 as hf_gpt2, tiny_hf_llama as hf_llama

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it

@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("n", [2, 4])
def test_flush_on_split_hf_models_equals_the_plain_training_loop(family, n):
    model = {"gpt2": hf_gpt2, "llama": hf_llama}[family]()
    result = run_emulator(hf_job(model, "1f1b-flush", n))
    ref, losses = plain_loop(model, False)
    diff = max_difference(result.final_states, result.step_losses, ref, losses)
    print(f"emulator, {family}, N={n}: max difference {diff:.3g}")  # pytest -s: the figure in the note
    assert diff <= 1e-6


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eager_attention_with_a_padding_mask_travels_to_every_stage(family):
    make = {"gpt2": hf_gpt2, "llama": hf_llama}[family]
    model = make(attn="eager")
    x, _ = lm_batch(True, 0)
    with torch.no_grad():  # the mask changes the result: were it dropped, the run would differ
        assert (model(**x).logits - model(input_ids=x["input_ids"]).logits)[1:].abs().max() == 0
        assert (model(**x).logits - model(input_ids=x["input_ids"]).logits)[0].abs().max() > 1e-3
    result = run_emulator(hf_job(model, "1f1b-flush", 4, padded=True))
    ref, losses = plain_loop(model, True)
    diff = max_difference(result.final_states, result.step_losses, ref, losses)
    print(f"emulator, {family}, eager + padding, N=4: max difference {diff:.3g}")
    assert diff <= 1e-6


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", [{"compile_backend": "aot_eager"}, {"recompute": "full"}])
def test_compiled_and_recomputed_hf_stages_equal_the_plain_loop(family, mode):
    model = {"gpt2": hf_gpt2, "llama": hf_llama}[family](attn="eager")
    result = run_emulator(dataclasses.replace(hf_job(model, "1f1b-flush", 2, padded=True), **mode))
    ref, losses = plain_loop(model, True)
    assert max_difference(result.final_states, result.step_losses, ref, losses) <= 1e-6


def test_paci_on_a_split_llama_attains_its_drift_bound():
    job = hf_job(hf_llama(), "paci", 4, steps=4, m=2)
    result = run_emulator(job)
    assert result.max_drift() == [job.schedule.delay_bound(s) for s in range(4)] == [2, 1, 1, 0]


def test_stage_modules_keep_the_original_names_and_layers_split_by_parameter_count():
    model = hf_llama(n_layer=6)
    split = split_model(model, 3)
    assert split.plan.layers == ((0, 1), (2, 3), (4, 5))
    keys = [set(s.state_dict()) for s in split.stages()]
    assert "model.embed_tokens.weight" in keys[0] and "lm_head.weight" in keys[2] and "model.norm.weight" in keys[2]
    assert "model.layers.3.self_attn.q_proj.weight" in keys[1]
    assert set().union(*keys) == set(model.state_dict()) and sum(map(len, keys)) == len(model.state_dict())
    assert split_model(model, cuts=[1, 5]).plan.layers == ((0,), (1, 2, 3, 4), (5,))
    with pytest.raises(ConfigError, match=r"cuts=\[3, 2\] are invalid"):
        split_model(model, cuts=[3, 2])
    with pytest.raises(ConfigError, match="n_stages=7 is invalid: must be 1…6"):
        split_model(model, 7)


@pytest.mark.parametrize("tie", [False, True])
def test_a_large_vocabularys_head_counts_on_the_last_stage_and_the_embedding_lookup_does_not(tie):
    # the head's V·C = 19,200 weights cost 2.5 layers (7,680 matrix weights each: attention 2C² + 2C·16,
    # SwiGLU 3·C·48, C = 32): by layer count alone the last stage held 2 layers + head, 1.55× the others
    L, N, C, V = 8, 4, 32, 600
    cfg = transformers.LlamaConfig(num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, hidden_size=C,
                                   intermediate_size=48, vocab_size=V, max_position_embeddings=16, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0, tie_word_embeddings=tie)
    torch.manual_seed(0)
    plan = split_model(transformers.LlamaForCausalLM(cfg), N, untie=tie).plan
    layer, head = 2 * C * C + 2 * C * 16 + 3 * C * 48, V * C  # forward FLOPs per token ÷ 2 (Kaplan et al. Table 1)

    def largest(counts):
        return max(k * layer + (head if s == N - 1 else 0) for s, k in enumerate(counts))

    every = [c for c in itertools.product(range(1, L + 1), repeat=N) if sum(c) == L]
    counts = [len(group) for group in plan.layers]
    assert largest(counts) == min(map(largest, every)) == layer + head < largest([2, 2, 2, 2])
    assert counts == [2, 2, 3, 1]  # the ties among the best go to the fewest layers on the earliest stages


def test_a_head_whose_module_and_its_children_all_hold_weights_counts_each_weight_once():
    # BertLMHeadModel's last stage owns cls.predictions (its own bias) and the children that hold the
    # transform and the decoder: summed module by module the head's V·C counted twice (2 × 2.1 layers)
    # and 6 layers on 2 stages split 5/1 (largest stage 5 layers) instead of 4/2 (4.1: 2 layers and the head)
    L, N = 6, 2
    cfg = transformers.BertConfig(num_hidden_layers=L, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=512, max_position_embeddings=64, is_decoder=True)
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(cfg)
    split = split_model(model, N, untie=True)
    # torch's own parameters() counts a tensor once; the embeddings' LayerNorm runs on stage 0
    layer = sum(p.numel() for p in model.bert.encoder.layer[0].parameters())
    head, first = (sum(p.numel() for p in m.parameters()) for m in (model.cls, model.bert.embeddings.LayerNorm))
    assert head == 32 * 32 + 32 + 2 * 32 + 512 * 32 + 512  # transform dense, its LayerNorm, decoder and bias

    def largest(counts):
        return max(k * layer + (first if s == 0 else 0) + (head if s == N - 1 else 0) for s, k in enumerate(counts))

    every = [c for c in itertools.product(range(1, L + 1), repeat=N) if sum(c) == L]
    counts = [len(group) for group in split.plan.layers]
    assert largest(counts) == min(map(largest, every)) == 2 * layer + head < largest([5, 1])
    assert counts == [4, 2]


def test_tied_weights_across_stages_are_refused_and_untie_trains_two_copies(caplog):
    model = hf_gpt2(tie=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ConfigError) as err:
        split_model(model, 2)
    assert str(err.value).startswith("transformer.wte.weight (stage 0) and lm_head.weight (stage 1) are one tied "
                                     "tensor on two stages") and "untie=True" in str(err.value)
    assert split_model(model, 1).n_stages == 1  # one stage: the tie is kept
    with caplog.at_level(logging.WARNING, "unbubble.models.split"):
        job = hf_job(model, "1f1b-flush", 2, untie=True)
    # warnings only: an earlier test may leave the logger at INFO, where the probe's cost line shows too
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "untie=True: transformer.wte.weight (stage 0) and lm_head.weight (stage 1) were one tied tensor; each stage "
        "now trains its own copy, so they drift apart"]
    result = run_emulator(job)
    untied = copy.deepcopy(model)  # the reference: the same weights, the head its own copy
    untied.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    ref, losses = plain_loop(untied, False)
    merged = {k: v for s in result.final_states for k, v in s.items()}
    assert not torch.equal(merged["lm_head.weight"], merged["transformer.wte.weight"])  # two copies, trained apart
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6, msg=k)


# -- torchtitan's layout: layers in a ModuleDict, a forward that skips what is None ----------------------

class TitanBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h):
        n = self.norm(h)
        mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1)
        h = h + self.attn(n, n, n, attn_mask=mask, need_weights=False)[0]
        return h + self.ff(h)


class TitanLM(nn.Module):
    """A torchtitan-layout decoder (``tok_embeddings``, ``layers`` as a ``ModuleDict``, ``norm``,
    ``output``; each optional, as after torchtitan's per-stage pruning)."""

    def __init__(self, n_layers: int = 4, d: int = 32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, d)
        self.layers = nn.ModuleDict({str(i): TitanBlock(d) for i in range(n_layers)})
        self.norm, self.output = nn.LayerNorm(d), nn.Linear(d, V, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def ids_batch(k: int):
    x, y = lm_batch(False, k)
    return x["input_ids"], y


@pytest.mark.parametrize("how", ["n_stages", "names"])
def test_a_torchtitan_layout_model_split_by_count_or_by_names_equals_its_plain_loop(how):
    torch.manual_seed(0)
    model = TitanLM()
    if how == "n_stages":
        split = split_model(model, 2)
        assert split.plan.names == (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "output"))
    else:
        split = split_model(model, module_names_per_stage=[["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
                                                            ["layers.3", "norm", "output"]])
    n = split.n_stages
    torch.set_num_threads(1)  # as the emulator (restored by the next test's own setting)
    job = PipelineJob(stage_fn=split, loss_fn=causal_lm_loss, batch_fn=ids_batch, optimizer_fn=adamw,
                      schedule=get_schedule("1f1b-flush", n, steps=3, m=4))
    result = run_emulator(job)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for t in range(3):
        total = 0.0
        for k in range(4 * t, 4 * t + 4):
            x, y = ids_batch(k)
            loss = causal_lm_loss(ref(x), y)
            (loss / 4).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / 4)
    assert max_difference(result.final_states, result.step_losses, ref, losses) <= 1e-6


def test_unknown_layouts_and_names_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="give module_names_per_stage"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 1)
    with pytest.raises(ConfigError, match="module_names_per_stage\\[1\\] names 'layers.9'"):
        split_model(TitanLM(), module_names_per_stage=[["tok_embeddings"], ["layers.9"]])
    every = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
    for names, message in [  # a split that drops, repeats or reorders a layer trains another model
        ([every[:2], every[3:]], "module_names_per_stage leaves layers.1.norm.weight on no stage: every parameter "
                                 "must be on exactly one (the stages together are the whole model)"),
        ([every[:3], every[2:]], "module_names_per_stage puts layers.1.norm.weight on stages [0, 1]: every parameter "
                                 "must be on exactly one stage"),
        ([every[:2] + ["layers.0.ff"], every[2:]], "module_names_per_stage puts layers.0.ff.0.weight on stage 0 "
                                                   "twice: every parameter must be on exactly one stage"),
        ([["tok_embeddings", "layers.2"], ["layers.1", "layers.0", "layers.3", "norm", "output"]],
         "module_names_per_stage puts layers.1 (stage 1) after layers.2 (stage 0): layers must follow the model's "
         "order across the stages"),
    ]:
        with pytest.raises(ConfigError) as err:
            split_model(TitanLM(), module_names_per_stage=names)
        assert str(err.value) == message
    with pytest.raises(TypeError, match="cannot catch a splitting error"):
        from unbubble.testing import train_without_pipeline

        train_without_pipeline(PipelineJob(stage_fn=split_model(TitanLM(), 2), loss_fn=causal_lm_loss,
                                           batch_fn=ids_batch, optimizer_fn=adamw,
                                           schedule=get_schedule("1f1b-flush", 2, steps=1, m=2)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_round_trip_reproduces_the_runs_final_logits(family, tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli
    from unbubble.export import export, merged_state_dict
    from unbubble.runtime.checkpoint import Checkpointing

    model = hf_gpt2(tie=True) if family == "gpt2" else hf_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2: untie=True warns (tested above); the export unties the config
        job = hf_job(model, "1f1b-flush", 2, padded=True, untie=family == "gpt2")
    job = dataclasses.replace(job, checkpoint=Checkpointing(str(tmp_path / "checkpoints")))  # a run folder's layout
    result = run_emulator(job)
    x, _ = lm_batch(True, 99)  # a held-out micro-batch
    stages = job.stage_fn.stages()
    with torch.no_grad():
        h = x
        for stage, state in zip(stages, result.final_states):
            stage.load_state_dict(state)
            h = stage(h)
        run_logits = h
        out = export(tmp_path / "checkpoints", tmp_path / "hf")
        cls = type(model)
        loaded = cls.from_pretrained(out)
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        diff = float((loaded(**x).logits - run_logits).abs().max())
        print(f"export round trip, {family}: max logit difference {diff:.3g}")
        assert diff == 0
        # the CLI, and a plain state dict that model.load_state_dict accepts
        res = CliRunner().invoke(cli, ["export", str(tmp_path / "checkpoints"), str(tmp_path / "model.pt")])
        assert res.exit_code == 0, res.output
        fresh = hf_gpt2(tie=False) if family == "gpt2" else hf_llama()
        fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
        assert torch.equal(fresh(**x).logits, run_logits)
    if family == "gpt2":  # trained untied: exported untied
        assert not loaded.config.tie_word_embeddings
        assert not torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)
    assert set(merged_state_dict(tmp_path)) == set(model.state_dict())


def _linear_stage(stage):
    torch.manual_seed(stage)
    return nn.Linear(4, 4)


def _linear_batch(k):
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(k)), torch.zeros(2, 4)


def test_export_merges_our_presets_and_refuses_clashing_names_or_no_checkpoint(tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli
    from unbubble.export import merged_state_dict
    from unbubble.runtime.checkpoint import Checkpointing
    from helpers import tiny_gpt_job

    res = CliRunner().invoke(cli, ["export", str(tmp_path), str(tmp_path / "m.pt")])
    assert res.exit_code == 2 and "holds no checkpoint" in res.output
    job = dataclasses.replace(tiny_gpt_job(get_schedule("1f1b-flush", 2, steps=1, m=2)),
                              checkpoint=Checkpointing(str(tmp_path / "gpt")))
    result = run_emulator(job)  # our presets' stages use global names (h.2 on stage 1): they merge
    merged = merged_state_dict(tmp_path / "gpt")
    assert merged.keys() == result.final_states[0].keys() | result.final_states[1].keys()
    assert torch.equal(merged["h.2.ln_1.weight"], result.final_states[1]["h.2.ln_1.weight"])
    clash = PipelineJob(stage_fn=_linear_stage, loss_fn=nn.functional.mse_loss, batch_fn=_linear_batch,
                        optimizer_fn=adamw, schedule=get_schedule("1f1b-flush", 2, steps=1, m=2),
                        checkpoint=Checkpointing(str(tmp_path / "clash")))
    run_emulator(clash)
    with pytest.raises(ConfigError, match="'weight' is in the checkpoints of stages 0 and 1: the stages do not use"):
        merged_state_dict(tmp_path / "clash")
    with pytest.raises(ConfigError, match="step=7 has no complete checkpoint"):
        merged_state_dict(tmp_path / "clash", step=7)


# -- the whole run for your own model: unbubble train --model hf:PATH / module:function, train_model -----

def tiny_titan() -> nn.Module:
    """``--model test_split:tiny_titan``: a torchtitan-layout model over the byte tokenizer's 257 ids."""
    torch.manual_seed(0)
    model = TitanLM()
    model.tok_embeddings, model.output = nn.Embedding(257, 32), nn.Linear(32, 257, bias=False)
    return model


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


FAST = ["--engine", "emulator", "--steps", "4", "--stages", "2", "--a", "2", "--seq-len", "12", "--eval-interval", "0",
        "--eval-batches", "1", "--checkpoint-every", "2"]


def test_unbubble_train_takes_an_hf_config_and_a_factory_and_refuses_a_tied_head(tmp_path, cache_dir):
    import json

    from click.testing import CliRunner

    from unbubble.cli import cli

    hf_gpt2(tie=True).config.save_pretrained(tmp_path / "gpt2")  # a config only: random init
    (tmp_path / "gpt2" / "config.json").write_text(
        (tmp_path / "gpt2" / "config.json").read_text().replace('"vocab_size": 64', '"vocab_size": 257'))
    res = CliRunner().invoke(cli, ["-q", "train", *FAST, "--model", f"hf:{tmp_path / 'gpt2'}", "--run-dir",
                                   str(tmp_path / "tied"), "--cache-dir", cache_dir])
    assert res.exit_code == 2 and res.stderr.strip().startswith("error: transformer.wte.weight (stage 0) and "
                                                                 "lm_head.weight (stage 1) are one tied tensor")
    assert not (tmp_path / "tied").exists()
    run = tmp_path / "hf-run"
    res = CliRunner().invoke(cli, ["train", *FAST, "--model", f"hf:{tmp_path / 'gpt2' / 'config.json'}", "--untie",
                                   "--run-dir", str(run), "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    assert "max Δ per stage [1, 0]" in res.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 4 and summary["model"]["vocab_size"] == 257 and summary["stage_layers"] == [[0, 2],
                                                                                                             [2, 4]]
    res = CliRunner().invoke(cli, ["export", str(run), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert not loaded.config.tie_word_embeddings and loaded.config.vocab_size == 257
    res = CliRunner().invoke(cli, ["-q", "train", *FAST, "--model", "test_split:tiny_titan", "--run-dir",
                                   str(tmp_path / "titan"), "--cache-dir", cache_dir])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "titan" / "summary.json").read_text())["steps_done"] == 4
    res = CliRunner().invoke(cli, ["-q", "train", *FAST, "--model", "no_such_module:f", "--cache-dir", cache_dir])
    assert res.exit_code == 2 and "model='no_such_module:f' is invalid: ModuleNotFoundError" in res.stderr


def test_train_model_gives_a_model_object_the_run_folder_checkpoints_resume_and_report(tmp_path, cache_dir):
    import json

    from click.testing import CliRunner

    import unbubble
    from unbubble.cli import cli

    options = dict(stages=2, a=2, seq_len=16, eval_interval=0, eval_batches=1, engine="emulator",
                   checkpoint_every=2, cache_dir=cache_dir)
    whole, run = unbubble.train_model(tiny_titan(), schedule="paci", run_dir=tmp_path / "run", steps=4, **options)
    assert (run / "summary.json").is_file() and (run / "checkpoints" / "step-00000004").is_dir()
    assert json.loads((run / "config.json").read_text())["model"] == "python"
    # a run cut at step 2, resumed with the same object, ends where the whole run ends
    cut, cut_dir = unbubble.train_model(tiny_titan(), schedule="paci", run_dir=tmp_path / "cut", steps=4,
                                        **options)
    import shutil

    shutil.rmtree(cut_dir / "checkpoints" / "step-00000004")
    summary = json.loads((cut_dir / "summary.json").read_text())
    summary["steps_done"] = 2
    (cut_dir / "summary.json").write_text(json.dumps(summary))
    resumed, _ = unbubble.train_model(tiny_titan(), resume=cut_dir)
    assert resumed.step_losses == whole.step_losses[2:]
    with pytest.raises(ConfigError, match="model='python': this run's model was given in Python"):
        from unbubble.train import train

        train(resume=cut_dir)
    with pytest.raises(ConfigError, match="stagez=2 is not an option of train_model"):
        unbubble.train_model(tiny_titan(), stagez=2)
    report = CliRunner().invoke(cli, ["report", str(run), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output


def test_a_resumed_run_keeps_the_split_its_checkpoints_were_written_with(tmp_path, cache_dir, monkeypatch):
    """A run whose checkpoints were cut by layer parameters alone (as before the head's V·C counted)
    resumes with its own stages and ends where the whole run ends; it was refused as another model."""
    import json
    import shutil

    import unbubble
    from unbubble.export import merged_state_dict
    from unbubble.models import split as split_module

    def gpt2():  # the head's V·C = 65,536 weights cost 5 of its 12,704-weight layers
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_head=2, n_embd=32, vocab_size=2048,
                                                                    n_positions=64, tie_word_embeddings=False))

    by_layers = split_module.partition_by_cost
    monkeypatch.setattr(split_module, "partition_by_cost", lambda costs, n, **ends: by_layers(costs, n))
    options = dict(stages=2, a=2, seq_len=16, eval_interval=0, eval_batches=1, engine="emulator",
                   checkpoint_every=2, cache_dir=cache_dir, progress=False)
    whole, run = unbubble.train_model(gpt2(), run_dir=tmp_path / "run", steps=4, **options)
    assert json.loads((run / "summary.json").read_text())["stage_layers"] == [[0, 2], [2, 4]]
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    (cut / "summary.json").unlink()  # as a run stopped at step 2 by a crash
    monkeypatch.undo()
    assert [list(g) for g in split_module.plan_split(gpt2(), 2).layers] == [[0, 1, 2], [3]]  # today's split
    resumed, _ = unbubble.train_model(gpt2(), resume=cut, progress=False)
    assert json.loads((cut / "summary.json").read_text())["stage_layers"] == [[0, 2], [2, 4]]
    assert resumed.step_losses == whole.step_losses[2:]
    want, got = merged_state_dict(run, 4), merged_state_dict(cut, 4)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _user_lines(code: str) -> int:
    return sum(1 for line in code.splitlines() if line.strip() and not line.strip().startswith("#"))


@pytest.mark.parametrize("heading,block,limit", [("## 8. Your Hugging Face model on 4 stages with PACI", 0, 15),
                                                 ("## 8. Your Hugging Face model on 4 stages with PACI", 1, 15),
                                                 ("## 9. A torchtitan-layout model", 0, None)])
def test_the_tutorials_own_model_sections_run(heading, block, limit, tmp_path, cache_dir, monkeypatch, doc_blocks):
    """The tutorial's Python blocks (§8, §9) run as written (its shell blocks: tests/unit/test_docs.py)."""
    import json

    code = [b for b in doc_blocks("docs/tutorial.md") if b.section == heading and b.lang == "python"][block].code
    if limit is not None:
        print(f"{heading}, block {block}: {_user_lines(code)} lines of user code")
        assert _user_lines(code) <= limit
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UNBUBBLE_CACHE_DIR", cache_dir)
    scope: dict = {}
    exec(compile(code, heading, "exec"), scope)
    summary = json.loads((scope["run_dir"] / "summary.json").read_text())
    assert summary["steps_done"] == 10 and summary["max_drift"] == [1, 1, 1, 0]
    if "trained" in scope:  # the export: the run's final weights under the model's own names
        final = scope["result"].final_states
        merged = {k: v for s in final for k, v in s.items()}
        for name, t in scope["trained"].state_dict().items():
            assert torch.equal(t, merged[name]), name
