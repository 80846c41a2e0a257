"""``unbubble.pipelining`` in one process: validation messages, the torchtitan-layout split and factory, a
one-stage PACI run against the emulator, and the private torch seams the module relies on (these fail
loudly when a torch upgrade changes them). The multi-process runs are in
``tests/multiproc/test_pipelining_multiproc.py``."""

from __future__ import annotations

import inspect
import itertools
import re
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from unbubble.errors import ConfigError
from unbubble.pipelining import SchedulePACI, _SavedByReference, _torch_private, clip_grad_norm_pp, pipeline_paci, \
    split_torchtitan_model
from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule
from unbubble.testing import tiny_gpt_job


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo group (the stage checks need a process group); torn down after the module."""
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _loss(out, y):
    return (out - y).pow(2).mean()


def _stage(num_stages: int = 1) -> PipelineStage:
    return PipelineStage(nn.Linear(4, 4), 0, num_stages, torch.device("cpu"))


@pytest.mark.parametrize("kw,message", [
    ({"n_microbatches": 0}, "n_microbatches=0 is invalid: must be an integer ≥ 1 (micro-batches per batch of the data iterator)"),
    ({"n_microbatches": 2.0}, "n_microbatches=2.0 is invalid: must be an integer ≥ 1 (micro-batches per batch of the data iterator)"),
    ({"a": 0}, "a=0 is invalid: must be an integer ≥ 1 (backward passes per step() and local update)"),
    ({"a": True}, "a=True is invalid: must be an integer ≥ 1 (backward passes per step() and local update)"),
    ({"loss_fn": None}, "loss_fn=None is invalid: SchedulePACI trains, give loss_fn(output, target) -> scalar"),
])
def test_bad_arguments_are_one_line_config_errors(world_of_one, kw, message):
    args = {"n_microbatches": 2, "loss_fn": _loss, **kw}
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        SchedulePACI(_stage(), **args)


def test_stage_type_and_count_are_checked(world_of_one):
    with pytest.raises(ConfigError, match=r"^stage=Linear is invalid: SchedulePACI runs one "
                                          r"torch\.distributed\.pipelining\.PipelineStage per rank$"):
        SchedulePACI(nn.Linear(2, 2), 2, _loss)
    with pytest.raises(ConfigError, match=r"^num_stages=2 is invalid with 1 ranks: SchedulePACI runs one stage per rank "
                                          r"\(build the PipelineStage with num_stages=1\)$"):
        SchedulePACI(_stage(num_stages=2), 2, _loss)


def _data(m: int, rows: int = 2):
    for b in itertools.count():
        g = torch.Generator().manual_seed(b)
        yield torch.randn(m * rows, 4, generator=g), torch.randn(m * rows, 4, generator=g)


def test_step_arguments_are_checked(world_of_one):
    sched = SchedulePACI(_stage(), 2, _loss)
    with pytest.raises(ConfigError, match=r"^data=Tensor is invalid: SchedulePACI\.step takes an iterator of "):
        sched.step(torch.zeros(4, 4))
    with pytest.raises(ConfigError, match=r"^data=None is invalid on stage 0: the first stage reads"):
        sched.step()
    with pytest.raises(ConfigError, match=r"^target= is invalid for SchedulePACI\.step: it takes the data iterator"):
        sched.step(_data(2), target=torch.zeros(4, 4))
    with pytest.raises(ConfigError, match=r"^input_batch= is invalid for SchedulePACI\.step: it takes the data iterator "
                                          r"and losses= only \(targets, and the first stage's keyword arguments as a "
                                          r"dict of inputs, come with the iterator's batches\)$"):
        sched.step(_data(2), input_batch=torch.zeros(4, 4))  # torchtitan's argument (docs/pipelining.md)
    with pytest.raises(ConfigError, match=r"^inputs of shape \(1, 4\) is invalid for n_microbatches=2: every tensor "
                                          r"of a batch splits along dim 0 into 2 equal micro-batches \(dim 0 is 1, "
                                          r"not a multiple of 2\)$"):
        sched.step(iter([(torch.zeros(1, 4), torch.zeros(1, 4))]))
    with pytest.raises(RuntimeError, match=r"needs gradients: it was called under torch\.no_grad\(\)"), torch.no_grad():
        SchedulePACI(_stage(), 2, _loss).step(_data(2))


def test_one_stage_paci_equals_the_emulator_and_runs_out_of_data_loudly(world_of_one):
    """N = 1 (first and last stage in one process), a = 2, batches of m = 3 micro-batches: the losses and
    weights of the emulator's PACI on the same module and micro-batches, bit for bit."""
    torch.set_num_threads(1)
    a, m, steps = 2, 3, 6
    job = tiny_gpt_job(get_schedule("paci", 1, steps, a=a))
    emu = run_emulator(job)
    module = job.stage_fn(0)
    opt = job.optimizer_fn(list(module.named_parameters()), 0)
    sched = SchedulePACI(PipelineStage(module, 0, 1, torch.device("cpu")), m, job.loss_fn, a=a)

    def batches():
        for b in itertools.count():
            mbs = [job.batch_fn(b * m + j) for j in range(m)]
            yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])

    data, means = batches(), []
    for _ in range(steps):
        opt.zero_grad()
        losses: list = []
        sched.step(data, losses=losses)
        opt.step()
        assert len(losses) == a
        means.append(sum(torch.stack(losses).tolist()) / a)
    assert means == emu.step_losses
    assert all(torch.equal(module.state_dict()[k], v) for k, v in emu.final_states[0].items())
    assert sched.steps == steps and sched.in_flight == 0 and dict(sched.drift) == {0: steps * a}
    assert sched.state_dict() == {"steps": steps, "next_micro_batch": steps * a, "drift": {0: steps * a}}
    with pytest.raises(RuntimeError, match=r"^the data iterator ran out at batch 1 \(micro-batch 3\) on stage 0: "):
        short = SchedulePACI(PipelineStage(job.stage_fn(0), 0, 1, torch.device("cpu")), m, job.loss_fn, a=4)
        short.step(iter(list(itertools.islice(batches(), 1))))


class _ByKeyword(nn.Module):
    """``module(input=x, note=...)``: the first stage of a dict-of-inputs batch (torchtitan's ``input_dict``)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input, note=None):
        assert note == "tokens"  # a non-tensor leaf reaches the module unchanged
        return self.inner(input)


def test_dict_batches_split_every_tensor_leaf_and_equal_the_tensor_run_bit_for_bit(world_of_one):
    """The iterator yields torchtitan's ``(input_dict, labels)`` shape, ``({"input": x, "note": str}, {"labels":
    y, "scale": 1.0})``: each tensor leaf splits along dim 0, the dict reaches the first stage as keyword arguments
    (torch's ``forward_one_chunk(args, kwargs)``), the target keeps its structure; the losses and weights equal the
    same run on plain tensor batches bit for bit. Uneven or 0-dim leaves are refused naming the leaf."""
    torch.set_num_threads(1)
    a, m, steps = 2, 3, 4
    job = tiny_gpt_job(get_schedule("paci", 1, steps, a=a))

    def batches():
        for b in itertools.count():
            mbs = [job.batch_fn(b * m + j) for j in range(m)]
            yield torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])

    def run(module, data, loss_fn):
        opt = job.optimizer_fn(list(module.named_parameters()), 0)
        sched = SchedulePACI(PipelineStage(module, 0, 1, torch.device("cpu")), m, loss_fn, a=a)
        got = []
        for _ in range(steps):
            opt.zero_grad()
            losses: list = []
            sched.step(data, losses=losses)
            opt.step()
            got += losses
        return got

    plain = job.stage_fn(0)
    want = run(plain, batches(), job.loss_fn)
    keyed = _ByKeyword(job.stage_fn(0))
    dicts = (({"input": x, "note": "tokens"}, {"labels": y, "scale": 1.0}) for x, y in batches())
    got = run(keyed, dicts, lambda out, t: job.loss_fn(out, t["labels"]) * t["scale"])
    assert len(got) == steps * a and all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(keyed.inner.state_dict()[k], v) for k, v in plain.state_dict().items())

    sched = SchedulePACI(PipelineStage(_ByKeyword(nn.Linear(4, 4)), 0, 1, torch.device("cpu")), 2, _loss)
    with pytest.raises(ConfigError, match=r"^inputs\['input'\] of shape \(5, 4\) is invalid for n_microbatches=2: "
                                          r"every tensor of a batch splits along dim 0 into 2 equal micro-batches "
                                          r"\(dim 0 is 5, not a multiple of 2\)$"):
        sched.step(iter([({"input": torch.zeros(5, 4), "note": "tokens"}, torch.zeros(4, 4))]))
    with pytest.raises(ConfigError, match=r"^target\[1\] of shape \(\) is invalid for n_microbatches=2: every tensor "
                                          r"of a batch splits along dim 0 into 2 equal micro-batches \(a 0-dim tensor "
                                          r"has no dim 0\)$"):
        sched.step(iter([({"input": torch.zeros(4, 4), "note": "tokens"}, (torch.zeros(4, 4), torch.tensor(1.0)))]))


class _Titan(nn.Module):
    """torchtitan's layout: tok_embeddings, layers (nn.ModuleDict by index), norm, output; None parts skipped."""

    def __init__(self, n_layers: int = 4, dim: int = 8, vocab: int = 11):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def test_split_keeps_names_and_composes_to_the_whole_model():
    torch.manual_seed(0)
    whole = _Titan(n_layers=5)
    keys = set(whole.state_dict())
    parts = []
    for s in range(3):
        part = _Titan(n_layers=5)
        part.load_state_dict(whole.state_dict())
        parts.append(split_torchtitan_model(part, s, 3))
    assert [list(p.layers) for p in parts] == [["0", "1"], ["2", "3"], ["4"]]
    assert parts[1].tok_embeddings is None and parts[1].norm is None and parts[1].output is None
    assert parts[0].norm is None and parts[2].tok_embeddings is None
    merged = {k: v for p in parts for k, v in p.state_dict().items()}
    assert set(merged) == keys and sum(len(p.state_dict()) for p in parts) == len(keys)  # each name once
    x = torch.randint(0, 11, (2, 3))
    h = x
    for p in parts:
        h = p(h)
    assert torch.equal(h, whole(x))
    assert list(split_torchtitan_model(_Titan(4), 1, 2, layers_per_stage=[3, 1]).layers) == ["3"]


@pytest.mark.parametrize("call,message", [
    (lambda: split_torchtitan_model(nn.Linear(2, 2), 0, 2), "model=Linear is invalid: a torchtitan-layout model has "
     "tok_embeddings, layers (nn.ModuleDict), norm and output; it lacks tok_embeddings"),
    (lambda: split_torchtitan_model(_Titan(2), 0, 3), "n_stages=3 is invalid: the model has 2 layers, at most one stage "
     "per layer"),
    (lambda: split_torchtitan_model(_Titan(2), 2, 2), "stage=2 is invalid: must be in 0 … 1 (n_stages=2)"),
    (lambda: split_torchtitan_model(_Titan(4), 0, 2, layers_per_stage=[3, 2]), "layers_per_stage=[3, 2] is invalid: "
     "2 counts ≥ 0 that sum to the model's 4 layers"),
])
def test_split_errors_name_the_value_and_what_is_valid(call, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        call()


def test_split_refuses_layers_that_are_not_a_module_dict():
    model = _Titan(2)
    model.layers = nn.ModuleList(model.layers.values())
    with pytest.raises(ConfigError, match=r"^model\.layers=ModuleList is invalid: it must be an nn\.ModuleDict"):
        split_torchtitan_model(model, 0, 1)


def test_pipelining_fn_factory_on_a_torchtitan_layout_model(world_of_one):
    torch.manual_seed(0)
    model = _Titan(3)
    schedule, parts, first, last = pipeline_paci(model, device=torch.device("cpu"), n_microbatches=2,
                                                 loss_fn=lambda logits, y: nn.functional.cross_entropy(
                                                     logits.flatten(0, 1), y.flatten()))
    assert isinstance(schedule, SchedulePACI) and parts == [model] and (first, last) == (True, True)
    assert schedule.a == 2 and list(model.layers) == ["0", "1", "2"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    data = itertools.repeat((tokens, tokens))
    means = []
    for _ in range(4):
        opt.zero_grad()
        losses: list = []
        schedule.step(data, losses=losses)
        assert clip_grad_norm_pp(model.parameters(), 1e9) > 0  # a world of one: the local norm
        opt.step()
        means.append(float(torch.stack(losses).mean()))
    assert len(losses) == 2 and means[-1] < means[0]  # it trains: the loss falls on the repeated batch
    schedule.drain()
    assert schedule.in_flight == 0


def test_private_torch_seams_are_as_this_module_expects(world_of_one):
    """[Note: private torch APIs] in ``unbubble/pipelining.py``: if one of these fails, torch changed an
    internal the module uses; update ``_torch_private`` (one place) before anything else."""
    params = list(inspect.signature(PipelineScheduleSingle._initialize_stage).parameters)
    assert params[:4] == ["self", "args", "kwargs", "target"], params
    assert SchedulePACI(_stage(), 2, _loss)._loss_fn is _loss  # swapped around _initialize_stage for tree targets
    stage = _stage()
    assert isinstance(stage.fwd_cache, dict)
    _torch_private.drop_forward(stage, 0)  # absent slot: no error
    t = torch.zeros(2)
    v = _torch_private.version(t)
    t.add_(1)
    assert isinstance(v, int) and _torch_private.version(t) == v + 1
    # the public seam: under saved_tensors_hooks autograd does not check versions; our hooks put the check
    # back for everything but the parameters
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    y = lin(x).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    hooks = _SavedByReference(lin.parameters())
    with hooks():
        y = lin(x).sum()
        z = (x.exp() * 2).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)
    y.backward()  # the current weights: the input gradient is W_new summed over outputs
    assert torch.equal(x.grad, lin.weight.detach().sum(0).expand(2, 3))
    a = torch.randn(3, requires_grad=True)
    with hooks():
        e = a.exp()
        w = (e * e).sum()
    with torch.no_grad():
        e.add_(1.0)
    with pytest.raises(RuntimeError, match=r"^a tensor of shape \(3,\) saved by the stage's forward was modified in place"):
        w.backward()
    assert z.requires_grad
