"""What crosses a stage boundary: a tensor, or a pytree of tensors (DESIGN §10).

[Note: stage boundaries carry pytrees]
A stage's input and output may be one tensor (the fast path, unchanged), or a tuple, list or
dict nesting tensors and other values ("pytree"); non-tensor leaves (``None``, ints, strings,
anything picklable) pass through unchanged. The first stage's module is called with the batch's
inputs as given (a dict batch is one argument: ``module(batch)``), every other stage with the
previous stage's output, and the last stage's ``loss_fn(output, targets)`` with both as given.

Gradients: each *floating* tensor leaf of a stage's output that requires grad (it depends on the
stage's parameters or input) becomes a leaf of the next stage's input that requires grad; every
other leaf (integer ids, masks, a tensor the stage ``detach()``-ed) arrives as a constant. The
backward sends one gradient per grad-carrying leaf, in flatten order, ``None`` where the next
stage did not use it. A tree boundary's gradient is therefore a tuple of ``Tensor | None``; a
single-tensor boundary's, as before, one tensor.

The layout (:class:`Layout`: the nesting, dict keys, constants and which leaves carry gradients)
is what the process engine sends with a message only when it changes ([Note: trees in a frame]
in ``transport.py``). This module is the one place that flattens and rebuilds trees: tuples (and
named tuples), lists and dicts are containers, ``torch.Tensor`` is a leaf, anything else a
constant of the layout. It does not use ``torch.utils._pytree`` (private).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

_TENSOR = "t"  # a tensor leaf without gradient
_GRAD = "g"  # a floating tensor leaf that carries a gradient


class Layout(NamedTuple):
    """The structure of a flattened tree: comparable with ``==`` and picklable.

    ``node`` is ``("t",)`` / ``("g",)`` for a tensor leaf (``g``: carries a gradient),
    ``("c", value)`` for a constant, ``("tuple" | "list", children)``, ``("dict", keys, children)``
    or ``("named", cls, children)``.
    """

    node: tuple


def is_tree(x: Any) -> bool:
    """True unless ``x`` is a single tensor (or ``None``): the boundaries that need this module."""
    return not (x is None or isinstance(x, torch.Tensor))


def flatten(tree: Any, grads: bool = False, all_floating: bool = False) -> tuple[list[torch.Tensor], Layout]:
    """``(tensor leaves in order, layout)``.

    Args:
        tree: a tensor, tuple, list, dict or nesting of them; other values are constants.
        grads: mark floating leaves that require grad as gradient-carrying (``"g"``) in the layout
            (a forward's output); otherwise every tensor leaf is ``"t"``.
        all_floating: with ``grads``, mark every floating leaf (an output computed without
            autograd, under recomputation, cannot tell which would require grad).
    """
    leaves: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            carries = x.is_floating_point() and (x.requires_grad or all_floating)
            return (_GRAD,) if grads and carries else (_TENSOR,)
        if isinstance(x, dict):
            keys = tuple(x)
            return ("dict", keys, tuple(walk(x[k]) for k in keys))
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return ("named", type(x), tuple(walk(v) for v in x))
        if isinstance(x, (tuple, list)):
            return (type(x).__name__, tuple(walk(v) for v in x))
        return ("c", x)

    return leaves, Layout(walk(tree))


def unflatten(leaves: list[torch.Tensor], layout: Layout) -> Any:
    """The tree :func:`flatten` read ``leaves`` and ``layout`` from."""
    it = iter(leaves)

    def build(node):
        kind = node[0]
        if kind in (_TENSOR, _GRAD):
            return next(it)
        if kind == "c":
            return node[1]
        if kind == "dict":
            return {k: build(c) for k, c in zip(node[1], node[2])}
        if kind == "named":
            return node[1](*(build(c) for c in node[2]))
        children = [build(c) for c in node[1]]
        return tuple(children) if kind == "tuple" else children

    return build(layout.node)


def grad_mask(layout: Layout) -> list[bool]:
    """Per tensor leaf of ``layout`` in flatten order: does it carry a gradient."""
    out: list[bool] = []

    def walk(node):
        kind = node[0]
        if kind in (_TENSOR, _GRAD):
            out.append(kind == _GRAD)
        elif kind == "dict":
            for c in node[2]:
                walk(c)
        elif kind in ("tuple", "list", "named"):
            for c in node[-1]:
                walk(c)

    walk(layout.node)
    return out


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf (a tensor: ``fn(tree)``)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if tree is None:
        return None
    leaves, layout = flatten(tree)
    return unflatten([fn(t) for t in leaves], layout)


def detach_output(out: Any, all_floating: bool = False) -> Any:
    """What a forward sends: ``out`` detached; in a tree, each gradient-carrying leaf stays marked
    (``requires_grad`` on the detached copy) so the next stage knows which leaves to differentiate.

    Args:
        all_floating: the forward ran without autograd (recomputation): mark every floating leaf;
            :func:`grad_outputs` then drops the gradients of leaves the recomputed forward finds
            not requiring grad (the same numbers, a few more bytes sent).
    """
    if isinstance(out, torch.Tensor):
        return out.detach()
    leaves, layout = flatten(out, grads=True, all_floating=all_floating)
    return unflatten([t.detach().requires_grad_(g) for t, g in zip(leaves, grad_mask(layout))], layout)


def input_leaves(activation: Any) -> tuple[Any, list[torch.Tensor]]:
    """A received activation as the stage's input: ``(input tree, leaves that carry a gradient)``.

    A single tensor becomes one leaf requiring grad (as always); in a tree, the leaves marked by
    :func:`detach_output` (or by the transport's layout) do, the rest are constants.
    """
    if isinstance(activation, torch.Tensor):
        x = activation.detach().requires_grad_(True)
        return x, [x]
    leaves, layout = flatten(activation, grads=True)
    new = [t.detach().requires_grad_(g) for t, g in zip(leaves, grad_mask(layout))]
    return unflatten(new, layout), [t for t in new if t.requires_grad]


def grad_outputs(out: Any, grad: Any, all_floating: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``(outputs, gradients)`` a non-last stage's backward differentiates: a tensor output
    with its gradient, or a tree's gradient-carrying leaves paired with the received tuple
    (leaves whose gradient is ``None``, or that do not require grad, are left out).

    Args:
        all_floating: the forward marked every floating leaf (:func:`detach_output`).
    """
    if isinstance(out, torch.Tensor):
        return [out], [grad]
    leaves, layout = flatten(out, grads=True, all_floating=all_floating)
    outs = [t for t, g in zip(leaves, grad_mask(layout)) if g]
    if len(outs) != len(grad):
        raise ValueError(f"a stage output with {len(outs)} gradient-carrying tensors received {len(grad)} gradients")
    pairs = [(o, g) for o, g in zip(outs, grad) if g is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` (``[]`` for ``None``)."""
    if tree is None:
        return []
    if isinstance(tree, torch.Tensor):
        return [tree]
    return flatten(tree)[0]


def storage_bytes(tree: Any) -> int:
    """Bytes of the distinct storages ``tree``'s tensors view (what keeping it holds)."""
    seen, total = set(), 0
    for t in tensors(tree):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def signature(tree: Any) -> tuple:
    """Shapes, dtypes and gradient flags of ``tree``'s tensors (hashable): what the sizes a
    forward saves depend on."""
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype)
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors(tree))
