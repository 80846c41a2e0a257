"""SchedulePACI in the released torchtitan 0.3.0: its own Llama3 (``model_registry("debugmodel")``, flex attention
with per-document ``BlockMask``s), its own stage split (``pipeline_llm``) on 2 gloo ranks, built through
unbubble's builder with the lines of docs/pipelining.md, executed from that page.

A separate test command (torchtitan is not in the package's extras: its declared dependencies conflict with
``transformers``), skipped when torchtitan is not installed::

    pip install --no-deps torchtitan==0.3.0 triton tyro docstring_parser typeguard spmd_types==0.2.3
    pytest -m torchtitan tests/with_torchtitan

On CPU two things are swapped, both outside unbubble: torchtitan asks for a CUDA device mesh when no
accelerator is present (its module's ``device_type`` is set to ``"cpu"``), and flex attention has no CPU
backward in torch 2.13 (torchtitan's compiled flex kernel is replaced by the same attention computed densely
from the ``BlockMask``'s ``mask_mod``, in the workers and in the reference alike).
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# (the folder is not named torchtitan: tests/ is on the path, and a folder of that name would import as it)
pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="torchtitan 0.3.0 is a separate test command (docs/pipelining.md)")
pytestmark = [pytest.mark.torchtitan, pytest.mark.multiproc]

from helpers import launch_gloo  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "pipelining.md"
M, SEQ, STEPS, PRESPLIT_STEPS, LR = 2, 32, 6, 3, 3e-3


def doc_block(name: str) -> str:
    """The python block of docs/pipelining.md after ``<!-- torchtitan-0.3.0 block: name -->``."""
    text = DOCS.read_text()
    match = re.search(rf"<!-- torchtitan-0\.3\.0 block: {name} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"docs/pipelining.md lost its torchtitan-0.3.0 block {name!r}"
    return match.group(1)


def _cpu_torchtitan() -> None:
    """The two CPU stand-ins of the module docstring."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.models.common.attention import FlexAttention

    def dense_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                   kernel_options=None):
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, AuxOutput(lse=None)

    parallel_dims.device_type = "cpu"
    FlexAttention._compiled_flex_attn = staticmethod(dense_flex)


def _whole_model():
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states(buffer_device=torch.device("cpu"))
    return model, config


def _data(start: int = 0):
    """Endless torchtitan-style samples ``({"input": (1, T), "positions": (1, T)}, labels (1, T))``: a counting
    sequence (learnable), two documents per sample cut at a position of its own."""
    k = start
    while True:
        g = torch.Generator().manual_seed(k)
        first = int(torch.randint(0, 64, (1,), generator=g))
        seq = (first + torch.arange(SEQ + 1)) % 64
        cut = int(torch.randint(4, SEQ - 4, (1,), generator=g))
        positions = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])[None]
        yield {"input": seq[None, :-1], "positions": positions}, seq[None, 1:]
        k += 1


def _prepare(model):
    """torchtitan 0.3.0's ``Trainer.post_dataloading_process`` for a flex-attention decoder."""
    def prepare(input_dict, labels):
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        extra["attention_masks"] = model.get_attention_masks(positions=extra["positions"])
        return input_dict["input"], labels, extra
    return prepare


class _Recorded:
    """The schedule as the docs' loop sees it, recording each step's losses."""

    def __init__(self, schedule):
        self.schedule, self.log = schedule, []

    def step(self, data, losses):
        self.schedule.step(data, losses=losses)
        self.log.append([x.item() for x in losses])

    def drain(self):
        self.schedule.drain()


def _worker(rank: int, n: int, port: int, jobs: list, q) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        _cpu_torchtitan()
        exec(doc_block("install"), {})  # noqa: S102 - the docs' lines, as a user writes them
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        import torchtitan.distributed.pipeline_parallel as titan_pp

        from unbubble.pipelining import SchedulePACI

        parallelism = ParallelismConfig(pipeline_parallel_degree=n, pipeline_parallel_schedule="PACI",
                                        pipeline_parallel_microbatch_size=1, data_parallel_shard_degree=1)
        training = TrainingConfig(local_batch_size=M, seq_len=SEQ)
        parallel_dims = ParallelDims.from_config(parallelism, n)
        parallel_dims.build_mesh()
        results = {}
        for form in ("paci", "presplit"):
            model, config = _whole_model()
            schedule, parts, has_first, has_last = titan_pp.pipeline_llm(
                model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                compile_config=CompileConfig(), ac_config=None, dump_folder="", device=torch.device("cpu"),
                model_config=config, parallelize_fn=lambda part, **kw: part,
                loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()))
            assert isinstance(schedule, SchedulePACI) and schedule.m == M and schedule.a == M
            optimizer = torch.optim.AdamW(parts[0].parameters(), lr=LR)
            lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0)
            prepare = _prepare(parts[0])
            if form == "paci":  # the docs' loop, as written
                rec = _Recorded(schedule)
                env = {"data_iterator": _data(), "trainer": SimpleNamespace(post_dataloading_process=prepare), "m": M,
                       "steps": STEPS, "schedule": rec, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                       "model_parts": parts}
                exec(doc_block("loop"), env)  # noqa: S102
                log = rec.log
            else:  # torchtitan 0.3.0's own call in pp_forward_backward_step, one batch per step
                data, log = _data(), []
                for _ in range(PRESPLIT_STEPS):
                    mbs = [prepare(*next(data)) for _ in range(M)]
                    optimizer.zero_grad()
                    losses = []
                    schedule.step(arg_mbs=[(x,) for x, _, _ in mbs] if has_first else None,
                                  kwarg_mbs=[kw for _, _, kw in mbs],
                                  target_mbs=[y for _, y, _ in mbs] if has_last else None, losses=losses,
                                  loss_kwargs={"global_valid_tokens": sum((y != -100).sum() for _, y, _ in mbs)},
                                  return_outputs=False)
                    optimizer.step()
                    log.append([x.item() for x in losses])
                schedule.drain()
            results[form] = {"losses": log, "state": {k: v.detach().clone() for k, v in parts[0].state_dict().items()},
                             "children": [name for name, _ in parts[0].named_children()]}
        buf = io.BytesIO()
        torch.save(results, buf)
        q.put((rank, buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        q.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _reference(steps: int):
    """Independent reference: the unsplit torchtitan model, its own forward per micro-batch with the same masks,
    torchtitan's own loss (token sum / the batch's tokens), one AdamW step per batch of M samples."""
    from torchtitan.components.loss import CrossEntropyLoss

    model, _ = _whole_model()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    prepare, data, log = _prepare(model), _data(), []
    for _ in range(steps):
        mbs = [prepare(*next(data)) for _ in range(M)]
        tokens = sum((y != -100).sum() for _, y, _ in mbs)
        optimizer.zero_grad()
        losses = []
        for x, y, kw in mbs:
            loss, _ = loss_fn(model(x, **kw), y, tokens)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        log.append(losses)
    return model, log


def test_torchtitan_030_llama3_split_by_pipeline_llm_trains_paci_on_two_ranks():
    """2 gloo ranks, torchtitan 0.3.0's Llama3 debugmodel (6 layers, dim 256, vocab 2048, flex attention with
    two documents per sample) split by its own ``pipeline_llm`` (stage 0: tok_embeddings + 3 layers, stage 1:
    3 layers + norm + lm_head), the schedule built by unbubble's builder from ``pipeline_parallel_schedule =
    "PACI"`` and trained 6 steps by the docs' loop (PACI, a = m = 2, AdamW lr 3e-3, torchtitan's own loss);
    the positions and BlockMasks reach both stages as per-micro-batch keyword inputs. Checks: the first step's
    losses equal the unsplit model's own forward on the same samples (nothing is stale before the first
    update), the loss falls, and torchtitan's own pre-split call (3 steps, one batch each: 1F1B-flush) equals the
    unsplit model trained by hand, weight for weight."""
    out = launch_gloo(_worker, 2, [None], timeout_s=420)
    results = out  # [rank] -> {"paci": …, "presplit": …}
    assert results[0]["paci"]["children"] == ["tok_embeddings", "layers"]
    assert results[1]["paci"]["children"] == ["layers", "norm", "lm_head"]
    _cpu_torchtitan()
    whole, ref_log = _reference(PRESPLIT_STEPS)
    paci = results[1]["paci"]["losses"]
    print("PACI losses per step (last stage):", paci)
    assert len(paci) == STEPS and all(len(step) == M for step in paci)
    assert paci[0] == ref_log[0]  # step 1: every stage on the initial weights
    assert sum(paci[-1]) < 0.8 * sum(paci[0])
    presplit = results[1]["presplit"]["losses"]
    assert presplit == ref_log, (presplit, ref_log)
    ref = whole.state_dict()
    diff = max((r["presplit"]["state"][k] - ref[k]).abs().max().item() for r in results for k in r["presplit"]["state"])
    print("pre-split (1F1B-flush) vs the unsplit model trained by hand: max weight difference", diff)
    assert diff == 0.0


@pytest.mark.parametrize("family,outcome", [("deepseek_v3", "split"), ("gpt_oss", "split"), ("qwen3", "tied")])
def test_torchtitan_030_moe_decoders_split_by_name_or_are_refused_in_one_line(family, outcome):
    """torchtitan 0.3.0's MoE decoders (DeepSeek-V3, gpt-oss debugmodels, on the meta device) name their head
    ``lm_head``: unbubble's torchtitan-layout splitter cuts them, stage 1 keeping norm and lm_head under their own
    names; Qwen3's debugmodel ties tok_embeddings to lm_head (``enable_weight_tying``): refused in one line."""
    import importlib

    from unbubble.errors import ConfigError
    from unbubble.pipelining import split_torchtitan_model

    module = importlib.import_module(f"torchtitan.models.{family}")
    with torch.device("meta"):
        model = module.model_registry("debugmodel").model.build()
    assert [name for name, _ in model.named_children()] == ["tok_embeddings", "layers", "norm", "lm_head"]
    if outcome == "split":
        part = split_torchtitan_model(model, 1, 2)
        assert [name for name, _ in part.named_children()] == ["layers", "norm", "lm_head"]
        assert all(k.startswith(("layers.", "norm.", "lm_head.")) for k in part.state_dict())
    else:
        with pytest.raises(ConfigError, match=r"^tok_embeddings\.weight \(stage 0\) and lm_head\.weight \(stage 1\) "
                                              r"are one tied tensor on two stages"):
            split_torchtitan_model(model, 0, 2)
