"""Stage boundaries that carry pytrees ([Note: stage boundaries carry pytrees] in runtime/pytree.py,
[Note: trees in a frame] in runtime/transport.py), checked in-process; the process engine's run is
in tests/multiproc/test_models_multiproc.py."""

import collections
import dataclasses

import pytest
import torch

from unbubble.runtime import pytree
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.transport import TreeFrame, frame_bytes, frame_header, read_trailer, unpack_tree
from unbubble.testing import tree_batch, tree_job, tree_loss, tree_stage, train_without_pipeline

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
