"""Stage boundaries that carry pytrees ([Note: stage boundaries carry pytrees] in docs/architecture.md,
[Note: trees in a frame] in docs/architecture.md), checked in-process; the process engine's run is
in tests/multiproc/test_models_multiproc.py."""

import collections
import dataclasses

import pytest
import torch

from unbubble.errors import ConfigError
from unbubble.runtime import pytree
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.transport import TreeFrame, frame_bytes, frame_header, read_trailer, unpack_tree
from unbubble.testing import train_without_pipeline
from helpers import tree_batch, tree_job, tree_loss, tree_stage

Pair = collections.namedtuple("Pair", "left right")


def test_flatten_and_unflatten_round_trip_nested_trees_with_constants():
    a, b, c = torch.randn(2, 3, requires_grad=True), torch.arange(4), torch.randn(1)
    tree = {"h": (a, [b, None]), "n": 3, "s": "tag", "p": Pair(c, {"z": a})}
    leaves, layout = pytree.flatten(tree, grads=True)
    assert [id(t) for t in leaves] == [id(a), id(b), id(c), id(a)]
    assert pytree.grad_mask(layout) == [True, False, False, True]  # integer and not-requiring-grad: no gradient
    back = pytree.unflatten(leaves, layout)
    assert back["n"] == 3 and back["s"] == "tag" and back["h"][1][1] is None and isinstance(back["p"], Pair)
    assert back["h"][0] is a and isinstance(back["h"][1], list) and back["p"].right["z"] is a
    assert pytree.flatten(tree)[1] == pytree.flatten(pytree.unflatten(leaves, layout))[1]
    assert pytree.flatten({"h": (a, [b, None]), "n": 4})[1] != pytree.flatten({"h": (a, [b, None]), "n": 3})[1]


def test_a_tree_frame_carries_its_layout_only_when_it_changes():
    h, ids = torch.randn(2, 3, 4).requires_grad_(), torch.arange(6).view(2, 3)
    tree = {"hidden": h, "ids": ids, "mask": torch.tensor([True, False]), "pos": None, "n": 7}
    layouts: dict = {}
    first = TreeFrame(tree, 2, 5, True, None)
    frame = first.pack(2, 5, frame_bytes(first.nbytes), torch.device("cpu"))
    words = read_trailer(frame)
    assert frame_header(frame) == (2, 5) and words[1] == -2 and words[2] == 3 and words[3] > 0
    got = unpack_tree(frame, words, layouts, 2)
    assert torch.equal(got["hidden"], h) and got["hidden"].requires_grad  # a gradient-carrying leaf stays marked
    assert torch.equal(got["ids"], ids) and not got["ids"].requires_grad and got["ids"].dtype == torch.int64
    assert got["mask"].tolist() == [True, False] and got["pos"] is None and got["n"] == 7
    # the same layout, other shapes: no layout bytes; the receiver reuses the one it has
    tree2 = dict(tree, hidden=torch.randn(1, 5, 4).requires_grad_(), ids=torch.arange(5).view(1, 5))
    second = TreeFrame(tree2, 2, 6, True, first.layout)
    assert second.blob == b"" and second.nbytes < first.nbytes
    frame2 = second.pack(2, 6, frame_bytes(first.nbytes), torch.device("cpu"))  # padded to the capacity
    got2 = unpack_tree(frame2, read_trailer(frame2), layouts, 2)
    assert torch.equal(got2["hidden"], tree2["hidden"]) and got2["ids"].shape == (1, 5) and got2["n"] == 7
    # a changed constant changes the layout: sent again
    third = TreeFrame(dict(tree2, n=8), 2, 7, True, second.layout)
    assert third.blob != b""
    frame3 = third.pack(2, 7, frame_bytes(third.nbytes), torch.device("cpu"))
    assert unpack_tree(frame3, read_trailer(frame3), layouts, 2)["n"] == 8
    # every dtype a frame carries, at aligned offsets
    odd = {str(d): torch.ones(3, dtype=d) for d in (torch.uint8, torch.complex128, torch.bool, torch.float64)}
    tf = TreeFrame(odd, 0, 1, True, None)
    f = tf.pack(0, 1, frame_bytes(tf.nbytes), torch.device("cpu"))
    assert all(torch.equal(v, odd[k]) for k, v in unpack_tree(f, read_trailer(f), {}, 0).items())
    # a gradient message: a tuple with a None
    grads = TreeFrame((torch.ones(2), None), 1, 7, False, None)
    gframe = grads.pack(1, 7, frame_bytes(grads.nbytes), torch.device("cpu"))
    g = unpack_tree(gframe, read_trailer(gframe), {}, 1)
    assert isinstance(g, tuple) and g[1] is None and g[0].tolist() == [1.0, 1.0]


def test_a_tree_leaf_the_frame_cannot_describe_is_refused_naming_stage_and_micro_batch():
    with pytest.raises(ValueError, match="micro-batch 4's tensor for stage 1 has shape"):
        TreeFrame({"x": torch.zeros([1] * 7)}, 1, 4, True, None)


def _assert_states_equal(got, want, **tol):
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for name in w:
            if tol:
                torch.testing.assert_close(g[name], w[name], msg=name, **tol)
            else:
                assert torch.equal(g[name], w[name]), name


@pytest.mark.parametrize("name,options", [("1f1b-flush", {}), ("gpipe", {}), ("zb-h1", {}),
                                          ("1f1b-flush", {"recompute": "full"})])
def test_a_dict_in_tuple_out_pipeline_equals_the_model_trained_whole(name, options):
    job = dataclasses.replace(tree_job(name), **options)
    result = run_emulator(job)
    ref_states, ref_losses = train_without_pipeline(job)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    _assert_states_equal(result.final_states, ref_states, rtol=1e-6, atol=1e-7)
    start = tree_stage(0).state_dict()
    for layer in ("a.weight", "b.weight"):  # gradients came back through both floating outputs
        assert not torch.allclose(result.final_states[0][layer], start[layer])


def test_gradients_reach_both_floating_outputs_and_none_reaches_the_others():
    job = tree_job()
    ex = [job.build_executor(s) for s in range(3)]
    a1 = ex[0].forward(0)
    h1, h2, ids, frozen, tag = a1
    assert h1.requires_grad and h2.requires_grad and not ids.requires_grad and not frozen.requires_grad
    assert tag == "const"
    a2 = ex[1].forward(0, a1)
    ex[2].forward(0, a2)
    g2 = ex[2].backward(0)
    assert isinstance(g2, tuple) and len(g2) == 2  # h and skip carry gradients, ids does not
    g1 = ex[1].backward(0, g2)
    assert len(g1) == 2 and all(g is not None and g.shape == h1.shape for g in g1)
    # the same gradients by autograd through the composed model
    stages = [tree_stage(s) for s in range(3)]
    x, y = tree_batch(0)
    out0 = stages[0](x)
    out0[0].retain_grad()
    out0[1].retain_grad()
    (tree_loss(stages[2](stages[1](out0)), y) * job.schedule.loss_scale).backward()
    assert torch.equal(g1[0], out0[0].grad) and torch.equal(g1[1], out0[1].grad)
    assert ex[0].backward(0, g1) is None
    for p, q in zip(ex[0].module.parameters(), stages[0].parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name,options", [
    ("paci", {"kw": {"a": 2}}), ("paci", {"kw": {"a": 1}, "recompute": "full"}), ("pipedream", {}),
    ("paci", {"kw": {"a": 2}, "predict_weights": "bound"}), ("paci", {"kw": {"a": 2}, "precision": "bf16"}),
    ("paci", {"kw": {"a": 2}, "precision": "bf16-autocast"})])
def test_asynchronous_schedules_and_modes_carry_trees_within_their_drift_bound(name, options):
    options = dict(options)
    job = dataclasses.replace(tree_job(name, **options.pop("kw", {})), **options)
    result = run_emulator(job)
    assert len(result.step_losses) == 3 and all(torch.isfinite(torch.tensor(result.step_losses)))
    if name == "paci":  # PACI's bound ⌈(N−i)/a⌉ per stage, attained
        assert result.max_drift() == [job.schedule.delay_bound(s) for s in range(3)]


def test_a_compiled_tree_stage_equals_the_eager_one():
    eager = run_emulator(tree_job())
    compiled = run_emulator(dataclasses.replace(tree_job(), compile_backend="aot_eager"))
    assert compiled.step_losses == pytest.approx(eager.step_losses, rel=1e-6)
    _assert_states_equal(compiled.final_states, eager.final_states, rtol=1e-6, atol=1e-7)


class _Frozen(torch.nn.Module):
    """Sends only leaves without gradients: integer ids and a detached embedding."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, ids):
        return {"ids": ids, "h": self.emb(ids).detach()}


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.head(x["h"]) + 0.0 * x["ids"].unsqueeze(-1)


def _frozen_stage(stage):
    torch.manual_seed(stage)
    return [_Frozen, _Head][stage]()


def _ids(k):
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(k))
    return ids, ids.roll(1, dims=1)


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _sgd(params, stage):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("name", ["1f1b-flush", "zb-h1"])
def test_a_boundary_without_gradient_carrying_leaves_sends_an_empty_gradient(name):
    from unbubble.runtime.job import PipelineJob
    from unbubble.schedules import get_schedule

    job = PipelineJob(stage_fn=_frozen_stage, loss_fn=_ce, batch_fn=_ids, optimizer_fn=_sgd,
                      schedule=get_schedule(name, 2, steps=2, m=2))
    result = run_emulator(job)
    ref_states, ref_losses = train_without_pipeline(job)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-6)
    _assert_states_equal(result.final_states, ref_states, rtol=1e-6, atol=1e-7)
    assert torch.equal(result.final_states[0]["emb.weight"], _frozen_stage(0).emb.weight.detach())  # no gradient


# -- issue 33: gradient flags of complex leaves, tuple subclasses, constants that hold tensors ---------------

class _Emit(torch.nn.Module):
    """Stage 0 of a two-stage probe: ``kind`` chooses what crosses the boundary."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.kind = torch.nn.Linear(4, 3), kind

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "complex":  # a complex leaf that requires grad
            return {"z": torch.complex(h, 2.0 * h), "ids": torch.arange(3)}
        if self.kind == "max":  # a torch.return_types.max: (values requiring grad, integer indices)
            return torch.max(h, dim=-1)
        if self.kind == "pair":
            return Pair(h, 3.0 * h)
        return {"h": h, "held": {h}}  # a set holding a tensor: a constant that would carry a tensor


class _Take(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(1)
        self.w, self.kind = torch.nn.Parameter(torch.randn(3)), kind

    def forward(self, out):
        if self.kind == "complex":
            return ((out["z"] * self.w).abs() ** 2).sum()
        if self.kind == "max":
            values, indices = out  # unpacks as a tuple; attribute access below proves the class came back
            return (out.values * self.w[out.indices]).sum() + 0.0 * values.sum() + 0.0 * indices.sum()
        return (out.left * self.w).sum() + (out.right ** 2).sum()


def _two_stages(kind):
    from unbubble.runtime.executor import StageExecutor

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))
    mods = [_Emit(kind), _Take(kind)]
    ex = [StageExecutor(s, 2, m, (lambda out, y: out) if s else None, lambda k: (x, None),
                        torch.optim.SGD(m.parameters(), lr=0.1), 1.0) for s, m in enumerate(mods)]
    return ex, x


@pytest.mark.parametrize("kind", ["complex", "max", "pair"])
def test_the_gradient_reaches_the_first_stage_through_complex_leaves_and_tuple_subclasses(kind):
    """A leaf carries a gradient iff it requires grad (a complex one included: it used to lose it), and
    tuple subclasses keep their class (``torch.return_types.max`` used to misalign the gradient flags
    and end in a bare StopIteration). The first stage's weight gradient equals autograd's through the
    composed model."""
    ex, x = _two_stages(kind)
    act = ex[0].forward(0)
    if kind == "max":
        assert type(act) is torch.return_types.max and act.values.requires_grad and not act.indices.requires_grad
    if kind == "complex":
        assert act["z"].dtype == torch.complex64 and act["z"].requires_grad and not act["ids"].requires_grad
    ex[1].forward(0, act)
    g = ex[1].backward(0)
    assert isinstance(g, tuple) and len(g) == (2 if kind == "pair" else 1) and all(t is not None for t in g)
    ex[0].backward(0, g)
    ref = [_Emit(kind), _Take(kind)]
    ref[1](ref[0](x)).backward()
    for got, want in zip(ex[0].module.parameters(), ref[0].parameters()):
        assert got.grad is not None and got.grad.abs().sum() > 0
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_tuple_subclasses_round_trip_with_their_gradient_flags():
    h = torch.randn(3, 4, requires_grad=True) * 2.0
    top = torch.max(h, dim=1)
    leaves, layout = pytree.flatten({"m": top, "p": Pair(h, 1)}, grads=True)
    assert pytree.grad_mask(layout) == [True, False, True]  # values, indices, p.left
    back = pytree.unflatten(leaves, layout)
    assert type(back["m"]) is torch.return_types.max and back["m"].indices is top.indices
    assert type(back["p"]) is Pair and back["p"].right == 1
    sent = pytree.detach_output({"m": top})
    assert type(sent["m"]) is torch.return_types.max and torch.equal(sent["m"].values, top.values)
    assert sent["m"].values.requires_grad and not sent["m"].indices.requires_grad
    frame = TreeFrame(sent, 1, 0, True, None)  # and through the process engine's frame
    f = frame.pack(1, 0, frame_bytes(frame.nbytes), torch.device("cpu"))
    got = unpack_tree(f, read_trailer(f), {}, 1)
    assert type(got["m"]) is torch.return_types.max and got["m"].values.requires_grad
    assert torch.equal(got["m"].values, top.values) and torch.equal(got["m"].indices, top.indices)


def test_a_complex_leaf_that_requires_grad_carries_one_and_a_complex_constant_does_not():
    z = torch.randn(2, dtype=torch.complex64, requires_grad=True) * 1j
    layout = pytree.flatten((z, z.detach(), torch.arange(2)), grads=True)[1]
    assert pytree.grad_mask(layout) == [True, False, False]
    assert pytree.grad_mask(pytree.flatten((z.detach(), torch.arange(2)), grads=True, all_floating=True)[1]) \
        == [True, False]  # recomputation marks every floating or complex leaf


class _Holder:
    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize("tree,where", [({"h": torch.ones(1), "held": {torch.ones(1)}}, "a set at tree['held']"),
                                        ((1, [None, _Holder(torch.ones(2))]), "a _Holder at tree[1][1]")])
def test_a_constant_that_holds_a_tensor_is_refused_in_one_line(tree, where):
    message = (f"{where} holds a tensor: a stage boundary carries tensors only as leaves of tuples, lists and dicts "
               "(anything else passes as a constant, its gradient lost): put the tensor in a tuple, list or dict")
    with pytest.raises(ConfigError) as info:
        pytree.flatten(tree)
    assert str(info.value) == message
    assert pytree.flatten((1, "s", None, _Holder(3), torch.float32))[0] == []  # constants without tensors pass


def test_a_stage_that_sends_a_set_of_tensors_is_refused_at_its_forward():
    ex, _ = _two_stages("set")
    with pytest.raises(ConfigError, match=r"^a set at tree\['held'\] holds a tensor"):
        ex[0].forward(0)
