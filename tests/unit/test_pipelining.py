"""``unbubble.pipelining`` in one process: validation messages, the torch version check, the refusal of stage
modules the schedule cannot sync, the torchtitan-layout split, factory and schedule builder, one-stage PACI runs
against the emulator (``scale_grads``, tree outputs through ``TreeStage``, ``eval``), and the private torch seams
the module relies on (these fail loudly when a torch upgrade changes them). The multi-process runs (DDP and FSDP2
inside stages, HF stages in ``TreeStage``) are in ``tests/multiproc/test_pipelining_multiproc.py``."""

from __future__ import annotations

import inspect
import copy
import itertools
import re

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from unbubble.errors import ConfigError
from unbubble.pipelining import SchedulePACI, TreeStage, _check_data_parallel, _check_torch_version, \
    _torch_private, build_pipeline_schedule, clip_grad_norm_pp, get_schedule_class, pipeline_paci, \
    split_torchtitan_model
from unbubble.runtime.emulator import run_emulator
from unbubble.schedules import get_schedule
from helpers import job_batches, one_rank_world, tiny_gpt_job


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo group (the stage checks need a process group); torn down after the module."""
    with one_rank_world():
        yield


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
    with pytest.raises(ConfigError, match=r"^input_batch= is invalid for SchedulePACI\.step: it takes the data iterator, "
                                          r"or torch's pre-split arg_mbs=, kwarg_mbs=, target_mbs=, loss_kwargs=, and "
                                          r"losses=$"):
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

    data, means = job_batches(job, m), []
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
        short.step(iter(list(itertools.islice(job_batches(job, m), 1))))


class _ByBatch(nn.Module):
    """``module(batch)``: a first stage of dict batches (torchtitan's ``input_dict``), called with one argument."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, batch):
        assert batch["note"] == "tokens"  # a non-tensor leaf reaches the module unchanged
        return self.inner(batch["input"])


def test_dict_batches_reach_the_first_stage_as_one_argument_and_equal_the_tensor_run_bit_for_bit(world_of_one):
    """The iterator yields torchtitan's ``(input_dict, labels)`` shape, ``({"input": x, "note": str}, {"labels":
    y, "scale": 1.0})``: each tensor leaf splits along dim 0, the dict reaches the first stage's module as one
    argument, ``module(batch)``, as unbubble's executor calls it (through TreeStage: torch passes tensors only), the
    target keeps its structure; the losses and weights equal the same run on plain tensor batches bit for bit.
    A dict for a module outside TreeStage, uneven or 0-dim leaves are refused in one line."""
    torch.set_num_threads(1)
    a, m, steps = 2, 3, 4
    job = tiny_gpt_job(get_schedule("paci", 1, steps, a=a))

    def run(module, data, loss_fn, wrap=lambda mod: mod):
        sched = SchedulePACI(PipelineStage(wrap(module), 0, 1, torch.device("cpu")), m, loss_fn, a=a)
        return _train(sched, job.optimizer_fn(list(module.named_parameters()), 0), data, steps)

    plain = job.stage_fn(0)
    want = run(plain, job_batches(job, m), job.loss_fn)
    keyed = _ByBatch(job.stage_fn(0))
    dicts = (({"input": x, "note": "tokens"}, {"labels": y, "scale": 1.0}) for x, y in job_batches(job, m))
    got = run(keyed, dicts, lambda out, t: job.loss_fn(out, t["labels"]) * t["scale"], wrap=TreeStage)
    assert len(got) == steps * a and all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(keyed.inner.state_dict()[k], v) for k, v in plain.state_dict().items())

    bare = SchedulePACI(PipelineStage(_ByBatch(nn.Linear(4, 4)), 0, 1, torch.device("cpu")), 2, _loss)
    with pytest.raises(ConfigError, match=r"^inputs of type dict are invalid on stage 0 without TreeStage: a first stage's "
                                          r"module gets the batch's inputs as one argument, module\(inputs\) \(docs/"
                                          r"pipelining\.md\), and torch's PipelineStage passes it tensors only; wrap the "
                                          r"stage module in TreeStage, or give the inputs as one tensor$"):
        bare.step(iter([({"input": torch.zeros(4, 4), "note": "tokens"}, torch.zeros(4, 4))]))
    sched = SchedulePACI(PipelineStage(TreeStage(_ByBatch(nn.Linear(4, 4))), 0, 1, torch.device("cpu")), 2, _loss)
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


def test_split_keeps_names_composes_to_the_whole_model_and_cuts_as_split_model():
    """The in-place pruning takes split_model's plan: the stages train_model builds from the same model hold the same
    layers and names (one splitter, [Note: stages keep the model's names])."""
    from unbubble.models.split import split_model

    torch.manual_seed(0)
    whole = _Titan(n_layers=5)
    keys = set(whole.state_dict())
    parts = []
    for s in range(3):
        part = _Titan(n_layers=5)
        part.load_state_dict(whole.state_dict())
        parts.append(split_torchtitan_model(part, s, 3))
    # a layer costs its 72 weights, the last stage's norm and head 16 + 99 more (1.6 layers): 2, 2, then 1 + head
    assert [list(p.layers) for p in parts] == [["0", "1"], ["2", "3"], ["4"]]
    split = split_model(whole, 3)
    assert [set(p.state_dict()) for p in parts] == [set(split(s).state_dict()) for s in range(3)]
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
     "tok_embeddings, layers (nn.ModuleDict), norm and lm_head (output before torchtitan 0.3.0); it lacks "
     "tok_embeddings"),
    (lambda: split_torchtitan_model(_Titan(2), 0, 3), "n_stages=3 is invalid: the model has 2 layers, at most one stage "
     "per layer"),
    (lambda: split_torchtitan_model(_Titan(2), 2, 2), "stage=2 is invalid: must be in 0 … 1 (n_stages=2)"),
    (lambda: split_torchtitan_model(_Titan(4), 0, 2, layers_per_stage=[3, 2]), "layers_per_stage=[3, 2] is invalid: "
     "2 counts ≥ 1 that sum to the model's 4 layers"),
    (lambda: split_torchtitan_model(_Titan(4), 0, 2, layers_per_stage=[4, 0]), "layers_per_stage=[4, 0] is invalid: "
     "2 counts ≥ 1 that sum to the model's 4 layers"),
])
def test_split_errors_name_the_value_and_what_is_valid(call, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        call()


def test_split_refuses_a_weight_tied_across_two_stages():
    model = _Titan(2)
    model.output.weight = model.tok_embeddings.weight  # (11, 8) both: one tensor, as a tied head
    with pytest.raises(ConfigError, match=r"^tok_embeddings\.weight \(stage 0\) and output\.weight \(stage 1\) are one "
                                          r"tied tensor on two stages, which asynchronous stages cannot share: untie "
                                          r"them in the model$"):
        split_torchtitan_model(model, 0, 2)
    assert list(split_torchtitan_model(model, 0, 1).layers) == ["0", "1"]  # one stage holds both names


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
    signatures = {  # the per-micro-batch actions and the inference's metadata messages, as _torch_private calls them
        "forward_one_chunk": ["self", "fwd_chunk_id", "args", "kwargs", "save_forward_output"],
        "backward_one_chunk": ["self", "bwd_chunk_id", "loss", "full_backward", "last_backward"],
        "perform_reduce_grad": ["self", "grad_scale_factor"],
        "_send_meta": ["self", "meta", "dst_stage"], "_recv_meta": ["self", "src_stage"],
        "get_fwd_recv_ops": ["self", "fwd_chunk_id"], "get_bwd_recv_ops": ["self", "bwd_chunk_id"],
        "get_fwd_send_ops": ["self", "fwd_chunk_id"], "get_bwd_send_ops": ["self", "bwd_chunk_id"]}
    for name, want in signatures.items():
        assert list(inspect.signature(getattr(PipelineStage, name)).parameters) == want, name
    # slot reuse: stage_backward reads a receive buffer's .grad and resets it, so the buffer reused by micro-batch
    # k + N starts from no gradient (else the second backward would send the sum of both)
    from torch.distributed.pipelining._backward import stage_backward

    buffer = torch.randn(3, requires_grad=True)
    for scale in (2.0, 3.0):
        out = buffer * scale
        (grad,) = stage_backward((out,), (torch.ones(3),), [buffer])
        assert torch.equal(grad, torch.full((3,), scale)) and buffer.grad is None
    # the layouts ride on the inference's forward metadata (wrapped on the stage object only)
    from torch.distributed.pipelining.stage import _StageForwardMeta

    sent, stage, tree = [], _stage(), TreeStage(nn.Identity())
    stage._send_meta, stage._recv_meta = (lambda meta, dst: sent.append(meta)), (lambda src: sent[-1])
    _torch_private.carry_layouts(stage, tree)
    tree.out_layout = ("a layout",)
    meta = _StageForwardMeta(forward_metas=())
    stage._send_meta(meta, 1)
    assert stage._recv_meta(0) is meta and tree.in_layout == ("a layout",)
    stage._send_meta("backward metadata", 0)
    assert sent[-1] == "backward metadata" and stage._recv_meta(1) == "backward metadata"
    assert _torch_private.composable_ddp() and all(isinstance(c, type) for c in _torch_private.composable_ddp())
    stage = _stage()
    sched = SchedulePACI(stage, 2, _loss)
    assert sched._loss_fn is _loss and sched._stage is stage  # swapped around / read in _initialize_stage
    stage = _stage()
    assert isinstance(stage.fwd_cache, dict)
    _torch_private.drop_forward(stage, 0)  # absent slot: no error
    # changing shapes: per-slot receive infos, re-made with buffers of another shape; the peer's global rank
    from torch.distributed.pipelining._utils import _TensorMeta
    from torch.distributed.pipelining.stage import _RecvInfo

    assert isinstance(stage.args_recv_info, dict) and isinstance(stage.grad_recv_info, dict)
    assert list(inspect.signature(PipelineStage._resolve_peer_global_rank).parameters) == ["self", "stage_idx"]
    info = _RecvInfo("recv", 0, torch.zeros(2, 3), _TensorMeta.from_tensor(torch.zeros(2, 3)))
    (fit,) = _torch_private.fit_buffers((info,), ((4, 5),))
    assert fit.buffer.shape == (4, 5) and tuple(fit.tensor_meta.shape) == (4, 5) and fit.source == 0
    assert _torch_private.fit_buffers((info,), ((2, 3),))[0] is info  # same shape: kept
    from unbubble.pipelining import _decode_shapes, _encode_shapes

    shapes = ((2, 8, 16), None, (3,))
    assert _decode_shapes(_encode_shapes(shapes)) == shapes
    with pytest.raises(ConfigError, match=r"^a stage boundary of 20 tensors \(81 shape words\) is invalid"):
        _encode_shapes(((1, 2, 3),) * 20)


@pytest.mark.parametrize("version,ok", [("2.13.0+cpu", True), ("2.13.1", True), ("2.12.1", False), ("2.14.0", False),
                                        ("3.0.0", False), ("nightly", False)])
def test_torch_versions_outside_the_tested_range_are_refused_in_one_line(version, ok):
    if ok:
        _check_torch_version(version)
        return
    with pytest.raises(ConfigError, match=f"^torch {re.escape(version)} is not supported by unbubble.pipelining: it "
                                          r"drives torch\.distributed\.pipelining internals tested with torch 2\.13 only "
                                          r"\(>= 2\.13, < 2\.14\); install torch 2\.13\.x, or train with unbubble's own "
                                          r"runtime$"):
        _check_torch_version(version)


def test_the_schedule_checks_the_installed_torch_at_construction(world_of_one, monkeypatch):
    _check_torch_version()  # the installed torch is the tested one
    monkeypatch.setattr(torch, "__version__", "2.12.0")
    with pytest.raises(ConfigError, match=r"^torch 2\.12\.0 is not supported by unbubble\.pipelining"):
        SchedulePACI(_stage(), 2, _loss)


class _FakeFSDP1(torch.distributed.fsdp.FullyShardedDataParallel):
    """An FSDP1 instance without FSDP1's set-up (which needs an accelerator): only its type matters here."""

    def __init__(self, inner: nn.Module):
        nn.Module.__init__(self)
        self.inner = inner


def test_stage_modules_the_schedule_cannot_sync_once_per_update_are_refused_in_one_line(world_of_one):
    """[Note: data parallelism inside a stage]: DDP at the root and fully_shard at the root (blocks sharded too)
    are accepted; FSDP1, composable replicate, and DDP or fully_shard below an unwrapped root are refused."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    supported = ("; supported: DistributedDataParallel(stage module), or fully_shard (FSDP2) applied to the stage "
                 "module itself (its submodules may be sharded too)")
    mesh = init_device_mesh("cpu", (1,))
    two = lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # noqa: E731
    cases = [
        (_FakeFSDP1(nn.Linear(4, 4)), "stage module _FakeFSDP1 is a FullyShardedDataParallel (FSDP1), which "
                                      "SchedulePACI cannot sync once per update"),
        (nn.Sequential(_FakeFSDP1(nn.Linear(4, 4))), "stage module Sequential at '0' is a FullyShardedDataParallel "
                                                     "(FSDP1), which SchedulePACI cannot sync once per update"),
        (replicate(nn.Linear(4, 4)), "stage module DDPLinear is replicated by torch.distributed._composable.replicate, "
                                     "which all-reduces on every backward"),
        (nn.Sequential(DistributedDataParallel(nn.Linear(4, 4))), "stage module Sequential at '0' is a "
         "DistributedDataParallel inside the stage module, which torch's stage cannot hold in no_sync()"),
    ]
    sub = two()
    fully_shard(sub[1], mesh=mesh)
    cases.append((sub, "stage module Sequential at '1' is sharded by fully_shard but the stage module Sequential is "
                       "not, so its gradients would be reduced on every backward"))
    for module, message in cases:
        with pytest.raises(ConfigError, match=f"^{re.escape(message + supported)}$"):
            _check_data_parallel(module)
    with pytest.raises(ConfigError, match=r"^stage module Sequential at '0' is a DistributedDataParallel inside"):
        SchedulePACI(PipelineStage(nn.Sequential(DistributedDataParallel(nn.Linear(4, 4))), 0, 1,
                                   torch.device("cpu")), 2, _loss)
    ddp = DistributedDataParallel(nn.Linear(4, 4))
    sharded = two()
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    assert isinstance(sharded, FSDPModule)
    for module in (ddp, sharded, nn.Linear(4, 4)):
        SchedulePACI(PipelineStage(module, 0, 1, torch.device("cpu")), 2, _loss)


def _train(sched: SchedulePACI, opt, data, steps: int) -> list[torch.Tensor]:
    got = []
    for _ in range(steps):
        opt.zero_grad()
        losses: list = []
        sched.step(data, losses=losses)
        opt.step()
        got += losses
    return got


def test_scale_grads_false_backpropagates_the_loss_as_given(world_of_one):
    """``scale_grads=False`` with a loss already divided by a equals the emulator's PACI (which scales by 1/a)
    bit for bit for a = 2 (a power of two: x/2 and x·(1/2) are one number); ``losses`` holds loss_fn's values."""
    torch.set_num_threads(1)
    a, steps = 2, 4
    job = tiny_gpt_job(get_schedule("paci", 1, steps, a=a))
    emu = run_emulator(job)
    module = job.stage_fn(0)
    sched = SchedulePACI(PipelineStage(module, 0, 1, torch.device("cpu")), a, lambda out, y: job.loss_fn(out, y) / a,
                         scale_grads=False)
    assert sched.scale_grads is False
    got = _train(sched, job.optimizer_fn(list(module.named_parameters()), 0), job_batches(job, a), steps)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in emu.final_states[0].items())
    means = [sum(x * a for x in torch.stack(got[t * a:(t + 1) * a]).tolist()) / a for t in range(steps)]
    assert means == emu.step_losses
    with pytest.raises(ConfigError, match=r"^scale_grads=1 is invalid: True \(each loss × 1/a: the update's mean "
                                          r"gradient\) or False \(the loss as given: the update's summed gradient\)$"):
        SchedulePACI(_stage(), 2, _loss, scale_grads=1)


class _DictOut(nn.Module):
    """A one-stage model whose output is a tree: ``{"logits": ..., "note": None}``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return {"logits": self.inner(x), "note": None}


def test_tree_stage_output_reaches_the_loss_rebuilt_and_equals_the_tensor_run(world_of_one):
    """A dict output through ``TreeStage`` (flattened for torch, rebuilt for ``loss_fn``) trains bit for bit as the
    same module returning the tensor; ``eval()`` gives the rebuilt outputs' losses. A TreeStage whose layout was
    never set, or whose output layout changes, is refused in one line."""
    torch.set_num_threads(1)
    a, steps = 2, 3
    job = tiny_gpt_job(get_schedule("paci", 1, steps, a=a))
    plain = job.stage_fn(0)
    want = _train(SchedulePACI(PipelineStage(plain, 0, 1, torch.device("cpu")), a, job.loss_fn),
                  job.optimizer_fn(list(plain.named_parameters()), 0), job_batches(job, a), steps)
    keyed = _DictOut(job.stage_fn(0))
    sched = SchedulePACI(PipelineStage(TreeStage(keyed), 0, 1, torch.device("cpu")), a,
                         lambda out, y: job.loss_fn(out["logits"], y))
    got = _train(sched, job.optimizer_fn(list(keyed.inner.named_parameters()), 0), job_batches(job, a), steps)
    assert len(got) == steps * a and all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(keyed.inner.state_dict()[k], v) for k, v in plain.state_dict().items())
    x, y = next(job_batches(job, a))
    losses: list = []
    merged = sched.eval(x, target=y, losses=losses)
    with torch.no_grad():
        direct = [job.loss_fn(plain(xj), yj) for xj, yj in zip(x.chunk(a), y.chunk(a))]
    assert all(torch.equal(g, w) for g, w in zip(losses, direct)) and len(losses) == a
    assert set(merged) == {"logits", "note"} and merged["note"] is None and merged["logits"].shape[0] == x.shape[0]
    assert sched.steps == steps and sched.in_flight == 0  # eval changes nothing
    with pytest.raises(ConfigError, match=r"^TreeStage\(_DictOut\) has no input layout yet: SchedulePACI sets it at "
                                          r"its first step\(\) \(torch's own schedules cannot carry a tree boundary\)$"):
        TreeStage(_DictOut(nn.Linear(4, 4)))(torch.zeros(2, 4))
    flip = TreeStage(nn.Identity())
    flip.in_layout = None
    flip({"a": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"^the output layout of TreeStage\(Identity\) changed from .* to .*: torch's "
                                          r"PipelineStage fixes a boundary's tensors at the first step\(\), so every "
                                          r"micro-batch's output must have the same structure$"):
        flip({"a": torch.zeros(1), "b": None})


def test_eval_needs_a_started_and_drained_schedule(world_of_one):
    sched = SchedulePACI(_stage(), 2, _loss)
    with pytest.raises(RuntimeError, match=r"^SchedulePACI\.eval\(\) on stage 0 before the first step\(\): torch's "
                                           r"stage buffers are made there; until then evaluate the model parts directly$"):
        sched.eval(torch.zeros(4, 4), target=torch.zeros(4, 4))
    sched.step(_data(2))
    sched._state.in_flight += 1  # as a stage with a forward read ahead (N ≥ 2) is between step() and drain()
    with pytest.raises(RuntimeError, match=r"^SchedulePACI\.eval\(\) on stage 0 with 1 micro-batches in flight: call "
                                           r"drain\(\) on every rank first \(eval uses the same receive buffers\)$"):
        sched.eval(torch.zeros(4, 4), target=torch.zeros(4, 4))
    sched._state.in_flight -= 1
    with pytest.raises(ConfigError, match=r"^arg_mbs, target_mbs= is invalid for SchedulePACI\.eval: it takes torch "
                                          r"2\.13's eval\(\*args, target=, losses=\) with the whole batch"):
        sched.eval(arg_mbs=[(torch.zeros(2, 4),)] * 2, target_mbs=[torch.zeros(2, 4)] * 2)  # torchtitan's call
    with pytest.raises(ConfigError, match=r"^2 positional and 0 keyword inputs are invalid for SchedulePACI\.eval: give "
                                          r"the batch's inputs as one argument, as the data iterator gives them, or a "
                                          r"dict of inputs as keyword arguments$"):
        sched.eval(torch.ones(4, 4), torch.ones(4, 4), target=torch.zeros(4, 4))
    losses: list = []
    out = sched.eval(torch.ones(4, 4), target=torch.zeros(4, 4), losses=losses)
    assert out.shape == (4, 4) and len(losses) == 2 and not any(x.requires_grad for x in losses)


def test_the_torchtitan_schedule_builder_and_schedule_class_lookup(world_of_one):
    """``build_pipeline_schedule`` takes torchtitan's ``_build_pipeline_schedule`` keywords: "PACI" builds
    SchedulePACI (a = m, scale_grads=False, torchtitan's ``(loss, metrics)`` loss reduced to the loss); another
    name goes to ``fallback`` or is built as torchtitan builds torch's schedules."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B

    cfg = lambda name, csv=None: SimpleNamespace(pipeline_parallel_schedule=name,  # noqa: E731
                                                 pipeline_parallel_schedule_csv=csv)
    titan_loss = lambda out, y: (_loss(out, y), {"metric": 1})  # noqa: E731
    sched = build_pipeline_schedule(parallelism=cfg("paci"), local_batch_size=2, stages=[_stage()], loss_fn=titan_loss)
    assert isinstance(sched, SchedulePACI) and sched.a == 2 and sched.m == 2 and sched.scale_grads is False
    out, y = torch.ones(2, 4), torch.zeros(2, 4)
    assert torch.equal(sched._user_loss(out, y), _loss(out, y))
    assert build_pipeline_schedule(parallelism=cfg("PACI"), local_batch_size=4, stages=[_stage()], loss_fn=_loss, a=2,
                                   scale_grads=True).a == 2
    normalised = build_pipeline_schedule(  # torchtitan's sum loss over a fixed token count per update
        parallelism=cfg("PACI"), local_batch_size=2, stages=[_stage()], loss_fn=lambda o, y, global_valid_tokens:
        ((o - y).pow(2).sum() / global_valid_tokens, {}), loss_kwargs={"global_valid_tokens": torch.tensor(16.0)})
    assert torch.equal(normalised._user_loss(out, y), (out - y).pow(2).sum() / 16.0)
    torch_1f1b = build_pipeline_schedule(parallelism=cfg("1F1B"), local_batch_size=2, stages=[_stage()],
                                         loss_fn=titan_loss)
    assert isinstance(torch_1f1b, Schedule1F1B) and torch_1f1b.scale_grads is False
    calls = []
    build_pipeline_schedule(parallelism=cfg("GPipe", "s.csv"), local_batch_size=2, stages=["stage"], loss_fn=_loss,
                            fallback=lambda **kw: calls.append(kw))
    assert calls == [{"parallelism": cfg("GPipe", "s.csv"), "local_batch_size": 2, "stages": ["stage"],
                      "loss_fn": _loss, "backward_requires_autograd": True}]
    assert get_schedule_class("Paci") is SchedulePACI and get_schedule_class("1f1b") is Schedule1F1B
    for call, message in [
        (lambda: get_schedule_class("PACO"), "pipeline_parallel_schedule='PACO' is invalid: 'PACI' (unbubble) or one "
                                             "of torch's (Unknown schedule name 'PACO'. The valid options are "),
        (lambda: build_pipeline_schedule(parallelism=cfg("PACI", "s.csv"), local_batch_size=2, stages=[_stage()],
                                         loss_fn=_loss), "pipeline_parallel_schedule_csv='s.csv' is invalid with PACI: "
                                                         "PACI's order is decided at run time by back-pressure; leave "
                                                         "the CSV unset"),
        (lambda: build_pipeline_schedule(parallelism=cfg("PACI"), local_batch_size=2, stages=[_stage(), _stage()],
                                         loss_fn=_loss), "2 stages on this rank are invalid for PACI: SchedulePACI runs "
                                                         "one stage per rank"),
        (lambda: build_pipeline_schedule(parallelism=cfg("PACI"), local_batch_size=2, stages=[_stage()], loss_fn=_loss,
                                         backward_requires_autograd=False), "backward_requires_autograd=False is "
                                                                            "invalid for PACI"),
        (lambda: build_pipeline_schedule(parallelism=cfg("1F1B", "s.csv"), local_batch_size=2, stages=[_stage()],
                                         loss_fn=_loss), "pipeline_parallel_schedule_csv='s.csv' needs torchtitan's "
                                                         "builder: pass fallback=torchtitan's _build_pipeline_schedule"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            call()


def test_pre_split_step_checks_its_lists_and_keeps_one_form(world_of_one):
    """torch's pre-split ``step(arg_mbs=, kwarg_mbs=, target_mbs=)``: lists of n_microbatches checked as torch checks
    them, one line each; a run keeps the form of its first call; with N = 1 the pre-split run equals the iterator
    run bit for bit (nothing to read ahead), keyword inputs reaching the module."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=None):
            return self.lin(x) * scale  # needs its keyword input

    sched = SchedulePACI(PipelineStage(Scaled(), 0, 1, torch.device("cpu")), 2, _loss)
    x, y, kw = [(torch.ones(2, 4),)] * 2, [torch.zeros(2, 4)] * 2, [{"scale": torch.tensor(2.0)}] * 2
    for kwargs, message in [
        ({"arg_mbs": x[:1], "target_mbs": y}, "arg_mbs= a list of 1 is invalid: a list of n_microbatches=2 "
                                              "micro-batches"),
        ({"arg_mbs": tuple(x), "target_mbs": y}, "arg_mbs= a tuple is invalid: a list of n_microbatches=2 micro-batches"),
        ({"arg_mbs": [torch.ones(2, 4)] * 2, "target_mbs": y}, "arg_mbs= is invalid: each micro-batch's positional "
                                                               "inputs are a tuple (torchtitan: (tokens,))"),
        ({"arg_mbs": x, "kwarg_mbs": [1, 2], "target_mbs": y}, "kwarg_mbs= is invalid: each micro-batch's keyword "
                                                               "inputs are a dict"),
        ({"target_mbs": y, "kwarg_mbs": kw}, "arg_mbs=None is invalid on stage 0: the first stage's module needs each "
                                             "micro-batch's inputs"),
        ({"arg_mbs": x, "kwarg_mbs": kw}, "target_mbs=None is invalid on stage 0: the last stage's loss needs each "
                                          "micro-batch's target"),
        ({"arg_mbs": x, "target_mbs": y, "return_outputs": True}, "return_outputs=True is invalid for "
                                                                  "SchedulePACI.step: a call's backwards belong to "),
        ({"data": iter([]), "arg_mbs": x, "target_mbs": y}, "data= with arg_mbs=/kwarg_mbs=/target_mbs= is invalid"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            sched.step(**kwargs)
    four = SchedulePACI(PipelineStage(Scaled(), 0, 1, torch.device("cpu")), 2, _loss, a=4)
    with pytest.raises(ConfigError, match=r"^a=4 is invalid with one pre-split batch of 2 micro-batches per step\(\): "
                                          r"update 0 needs micro-batches up to 3, 2 were given; use a ≤ "
                                          r"n_microbatches \(2\)$"):
        four.step(arg_mbs=x, kwarg_mbs=kw, target_mbs=y)

    def run(presplit: bool) -> tuple[list, dict]:
        module = Scaled()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        sched = SchedulePACI(PipelineStage(module, 0, 1, torch.device("cpu")), 2, _loss)
        data = ((torch.randn(4, 4, generator=torch.Generator().manual_seed(b)), torch.zeros(4, 4))
                for b in itertools.count())
        from unbubble.pipelining import MicroBatches

        mbs = (MicroBatches([(x[:2],), (x[2:],)], [{"scale": torch.tensor(2.0)}] * 2, [y[:2], y[2:]])
               for x, y in data)
        out = []
        for _ in range(3):
            opt.zero_grad()
            losses: list = []
            if presplit:
                mb = next(mbs)
                sched.step(arg_mbs=mb.arg_mbs, kwarg_mbs=mb.kwarg_mbs, target_mbs=mb.target_mbs, losses=losses)
            else:
                sched.step(mbs, losses=losses)
            opt.step()
            out += losses
        with pytest.raises(ConfigError, match=r"^a (data-iterator|pre-split) step\(\) after (pre-split|data-iterator) "
                                              r"ones is invalid"):
            sched.step(mbs) if presplit else sched.step(arg_mbs=x, target_mbs=y)
        return out, module.state_dict()

    (l1, s1), (l2, s2) = run(True), run(False)
    assert l1 == l2 and len(l1) == 6 and all(torch.equal(s1[k], s2[k]) for k in s1)


class _Titan03(_Titan):
    """torchtitan 0.3.0's decoder layout: the head is ``lm_head`` (Llama3, Qwen3, DeepSeek-V3, gpt-oss)."""

    def __init__(self, n_layers: int = 4, mtp: bool = False):
        super().__init__(n_layers)
        self.lm_head = self.output
        del self.output
        self.mtp_layers = nn.ModuleList([nn.Linear(8, 8)]) if mtp else None

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h


def test_split_takes_torchtitan_030s_lm_head_and_refuses_mtp_layers():
    """torchtitan 0.3.0 names the head ``lm_head``: the split keeps it on the last stage under its own name, and
    the stages chained equal the whole model (max difference 0); multi-token prediction layers are refused."""
    torch.manual_seed(0)
    whole = _Titan03()
    parts = [split_torchtitan_model(copy.deepcopy(whole), s, 2) for s in range(2)]
    assert parts[0].lm_head is None and parts[1].tok_embeddings is None
    assert "lm_head.weight" in parts[1].state_dict() and "lm_head.weight" not in parts[0].state_dict()
    x = torch.randint(0, 11, (2, 5))
    assert torch.equal(parts[1](parts[0](x)), whole(x))
    with pytest.raises(ConfigError, match=r"^model=_Titan03 with multi-token prediction layers \(mtp_layers\) is "
                                          r"invalid: they read the first stage's embeddings and the last stage's head"):
        split_torchtitan_model(_Titan03(mtp=True), 0, 2)


def test_a_micro_batch_of_other_shapes_inside_a_batch_is_refused_before_it_is_sent(world_of_one, monkeypatch):
    """[Note: changing shapes on torch's stage]: shapes travel once per batch, so a micro-batch whose boundary shapes
    differ from its batch's first is refused in one line, and nothing of it is sent."""
    sched = SchedulePACI(_stage(), 2, _loss)
    sent = []
    monkeypatch.setattr(sched._pp_stage, "get_fwd_send_ops", lambda slot: ["an activation"])
    monkeypatch.setattr(sched, "_send", lambda kind, ops: sent.append(ops))
    monkeypatch.setattr(_torch_private, "shapes_op", lambda stage, shapes: ("shapes " + str(shapes), None))
    sched._send_forward(2, 0, torch.zeros(2, 4))  # batch 1's first micro-batch: its shapes, then the activation
    assert sent == [["shapes ((2, 4),)", "an activation"]]
    sched._send_forward(3, 1, torch.zeros(2, 4))  # same shapes: the activation alone
    assert sent[-1] == ["an activation"]
    with pytest.raises(ConfigError, match=r"^micro-batch 5 of batch 2 has boundary shapes \(\(3, 4\),\) on stage 0, "
                                          r"micro-batch 4's are \(\(2, 4\),\): the micro-batches of one batch must "
                                          r"share their shapes \(a new shape starts a new batch\)$"):
        sched._send_forward(4, 0, torch.zeros(2, 4))
        sched._send_forward(5, 1, torch.zeros(3, 4))
    assert len(sent) == 3  # the refused micro-batch sent nothing
