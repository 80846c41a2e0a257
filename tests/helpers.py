"""Fixtures of unbubble's own tests: tiny deterministic jobs, models and batches, and their plain references.

Not part of unbubble's API (``src/unbubble/testing.py`` keeps what users check their own runs with). Imported
as ``helpers`` (pytest puts ``tests/`` on ``sys.path``: ``pythonpath`` in pyproject.toml); the jobs built here
are picklable, and the processes the multi-process tests spawn import this module by the same name (``spawn``
hands them the parent's ``sys.path``; a ``torchrun`` script inserts ``tests/`` itself).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import itertools
import queue
import socket
import sys
import time
from pathlib import Path

import torch
from torch import nn

from unbubble.models import GPTConfig, ModelConfig, build_stages, gpt_loss
from unbubble.pipeline import merge_state_dicts
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from unbubble.schedules.registry import Schedule
from unbubble.testing import random_tokens


def _stage(config: ModelConfig, n_stages: int, seed: int, loss_scale: float, stage: int) -> nn.Module:
    return build_stages(config, n_stages, seed, only=stage, loss_scale=loss_scale)[stage]


def _sgd(lr: float, params: list, stage: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def _adamw(lr: float, params: list, stage: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def tiny_gpt_config(n_layer: int = 4, vocab_size: int = 64, block_size: int = 16) -> GPTConfig:
    """A GPT-2 shaped model small enough for unit tests (≈ 60k parameters)."""
    return GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size)


def tiny_gpt_job(schedule: Schedule, optimizer: str = "adamw", lr: float = 1e-2, seed: int = 0,
                 micro_batch_size: int = 2, config: ModelConfig | None = None) -> PipelineJob:
    """A picklable pipeline job on random tokens (used by the tests of every engine); GPT-2 unless
    ``config`` is another architecture's."""
    config = config or tiny_gpt_config()
    opt = {"adamw": _adamw, "sgd": _sgd}[optimizer]
    return PipelineJob(
        stage_fn=functools.partial(_stage, config, schedule.n_stages, seed, schedule.loss_scale),
        loss_fn=gpt_loss,
        batch_fn=functools.partial(random_tokens, config.vocab_size, micro_batch_size, config.block_size, seed),
        optimizer_fn=functools.partial(opt, lr),
        schedule=schedule,
    )


def job_batches(job: PipelineJob, m: int, start: int = 0):
    """Endless ``(inputs, targets)`` batches of m of the job's micro-batches (batch b: ids b·m … b·m + m − 1,
    concatenated along dim 0), from batch ``start``: what a loop over torch's schedules reads."""
    for b in itertools.count(start):
        mbs = [job.batch_fn(b * m + j) for j in range(m)]
        yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_pipelining_paci.py"
#: The published results and the raw tables they were built from (``unbubble experiment NAME --analyze``).
RESULTS, PUBLISHED_DATA = EXAMPLE.parents[1] / "docs" / "results.md", EXAMPLE.parents[1] / "docs" / "data"


def unpublished_rows(markdown: str) -> list[str]:
    """The table rows of an experiment's section (above its "Command:" line) that docs/results.md does not
    hold verbatim; asserts the section has tables at all."""
    rows = [line for line in markdown.split("Command:")[0].splitlines() if line.startswith("| ")]
    assert len(rows) >= 4, markdown[:500]
    published = set(RESULTS.read_text().splitlines())
    return [row for row in rows if row not in published]


def example_module():
    """``examples/torch_pipelining_paci.py`` as a module (registered first: its dataclass looks itself up)."""
    if "torch_pipelining_paci" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torch_pipelining_paci", EXAMPLE)
        mod = sys.modules["torch_pipelining_paci"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["torch_pipelining_paci"]


# -- a dict-in / tuple-out model: three stages, every kind of leaf ([Note: stage boundaries carry pytrees]) --

TREE_VOCAB, TREE_DIM = 16, 8


class TreeFirst(nn.Module):
    """Takes a dict batch; returns a tuple with two floating outputs of two separate layers, the
    integer ids, a detached float (no gradient) and a constant."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TREE_VOCAB, TREE_DIM)
        self.a, self.b = nn.Linear(TREE_DIM, TREE_DIM), nn.Linear(TREE_DIM, TREE_DIM)

    def forward(self, batch):
        e = self.emb(batch["input_ids"]) * batch["scale"]
        return self.a(e), torch.tanh(self.b(e)), batch["input_ids"], e.detach() * 0.5, "const"


class TreeMiddle(nn.Module):
    """Tuple in, dict out: mixes both floating inputs; passes the ids through."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(2 * TREE_DIM, TREE_DIM)

    def forward(self, x):
        h1, h2, ids, frozen, tag = x
        assert tag == "const" and ids.dtype == torch.int64
        return {"h": self.mix(torch.cat([h1, h2], -1)) + frozen, "skip": h2 * 2.0, "ids": ids}


class TreeLast(nn.Module):
    """Dict in, ``(logits, auxiliary scalar)`` out."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(TREE_DIM, TREE_VOCAB)

    def forward(self, x):
        return self.head(x["h"] + x["skip"]), x["skip"].pow(2).mean()


def tree_stage(stage: int) -> nn.Module:
    """Stage ``stage`` (0-2) of the pytree test model, the same weights every call."""
    torch.manual_seed(100 + stage)
    return [TreeFirst, TreeMiddle, TreeLast][stage]()


def tree_batch(k: int):
    """Micro-batch k: a dict of ids ``(2, T)`` with T = 5 + k mod 3 and a float scale; targets a dict of labels."""
    g = torch.Generator().manual_seed(k)
    t = 5 + k % 3  # shapes vary per micro-batch
    ids = torch.randint(0, TREE_VOCAB, (2, t + 1), generator=g)
    return {"input_ids": ids[:, :-1], "scale": torch.full((1,), 1.0 + 0.1 * (k % 2))}, {"labels": ids[:, 1:]}


def tree_loss(out, targets):
    """Cross-entropy of the logits plus 0.1 × the auxiliary output (a second floating output of the last stage)."""
    logits, aux = out
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets["labels"].flatten()) + 0.1 * aux


def _adam(params, stage):
    return torch.optim.Adam(params, lr=1e-2)


def tree_job(name: str = "1f1b-flush", **kw) -> PipelineJob:
    """A picklable 3-stage job whose boundaries carry a tuple and a dict (``kw``: schedule options)."""
    sched = get_schedule(name, 3, steps=3, m=4, **kw)
    return PipelineJob(stage_fn=tree_stage, loss_fn=tree_loss, batch_fn=tree_batch, optimizer_fn=_adam, schedule=sched)


# -- tiny Hugging Face models (the [hf] extra), split by unbubble.models.split, and their plain loop --------

HF_VOCAB, HF_SEQ = 64, 12


def tiny_hf_gpt2(tie: bool = False, attn: str = "sdpa", n_layer: int = 4):
    """A random-init HF ``GPT2LMHeadModel`` (d=32, 2 heads, dropout 0; ``tie``: head tied to ``wte``)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=2, n_embd=32, n_positions=HF_SEQ, vocab_size=HF_VOCAB,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie,
                                  bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(cfg)


def tiny_hf_llama(attn: str = "sdpa", n_layer: int = 4):
    """A random-init HF ``LlamaForCausalLM`` (d=32, 4 heads, 2 KV heads, rotary positions)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=32, intermediate_size=48, vocab_size=HF_VOCAB,
                                   max_position_embeddings=HF_SEQ, attn_implementation=attn, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def lm_batch(padded: bool, k: int):
    """Micro-batch k for the tiny HF models: ``({"input_ids" (2, T)[, "attention_mask"]}, labels (2, T))``,
    labels shifted by one; ``padded``: the first row left-padded by 3 + k mod 3 tokens (mask 0, label -100)."""
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, HF_VOCAB, (2, HF_SEQ + 1), generator=g)
    x, y = {"input_ids": ids[:, :-1]}, ids[:, 1:].clone()
    if padded:
        mask = torch.ones(2, HF_SEQ, dtype=torch.long)
        mask[0, :3 + k % 3] = 0
        x["attention_mask"] = mask
        y[mask == 0] = -100
    return x, y


def hf_adamw(params, stage: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def hf_job(model, name: str, n: int, padded: bool = False, steps: int = 3, m: int = 4, **split) -> PipelineJob:
    """A picklable job training ``model`` split into ``n`` stages (``split``: ``split_model``'s options) on
    :func:`lm_batch`; ``m`` is PACI's a for ``name="paci"``."""
    from unbubble.models.split import causal_lm_loss, split_model

    return PipelineJob(stage_fn=split_model(model, n, **split), loss_fn=causal_lm_loss,
                       batch_fn=functools.partial(lm_batch, padded), optimizer_fn=hf_adamw,
                       schedule=get_schedule(name, n, steps=steps, **({"a": m} if name == "paci" else {"m": m})))


def plain_hf_loop(model, padded: bool = False, steps: int = 3, m: int = 4, batch=None):
    """Independent reference: a copy of the unsplit HF model trained the ordinary way
    (:func:`unbubble.models.hf_zoo.train_unsplit`: ``model(**x).logits``, torch's own cross-entropy, one
    AdamW as :func:`hf_adamw`, the mean loss over m micro-batches per step, one torch thread as the
    emulator runs). ``batch(k) -> (inputs dict, labels)`` gives micro-batch k (default :func:`lm_batch`
    with ``padded``).

    Returns:
        ``(trained copy, mean training loss per step)``.
    """
    from unbubble.models.hf_zoo import train_unsplit

    return train_unsplit(model, steps, m, functools.partial(lm_batch, padded) if batch is None else batch)


def max_difference(final_states: list[dict], step_losses: list[float], model, ref_losses: list[float]) -> float:
    """Largest |difference| between a run (stage states merged by name, step losses) and a reference
    model and losses; asserts the merged names are exactly the model's."""
    merged = merge_state_dicts(final_states)
    want = model.state_dict()
    assert set(merged) == set(want), sorted(set(merged) ^ set(want))
    diffs = [abs(a - b) for a, b in zip(step_losses, ref_losses, strict=True)]
    diffs += [float((merged[k] - want[k]).abs().max()) for k in want]
    return max(diffs)


# -- torch.distributed in the tests: a one-rank gloo group, and gloo processes running a list of jobs --------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_world():
    """A one-rank gloo group in this process for the block (none is made if one exists), torn down after it."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def launch_gloo(worker, n: int, jobs: list, timeout_s: float) -> list[list]:
    """Runs ``worker(rank, n, port, jobs, queue)`` in ``n`` spawned processes (a module-level function, which puts
    ``(rank, bytes of torch.save(results))`` or ``(rank, error text)`` on the queue); returns ``[rank][job]``.

    Raises:
        AssertionError: a process failed (its message), died, or the processes hung past ``timeout_s``.
    """
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, n, port, jobs, q)) for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n:
            try:
                rank, payload = q.get(timeout=1.0)
            except queue.Empty:
                assert time.monotonic() < deadline, "the gloo processes hung"
                assert all(p.exitcode in (None, 0) for p in procs), f"exit codes {[p.exitcode for p in procs]}"
                continue
            assert not isinstance(payload, str), f"rank {rank} failed: {payload}"
            out[rank] = torch.load(io.BytesIO(payload))
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(n)]
