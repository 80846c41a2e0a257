"""What crosses a stage boundary: a tensor, or a pytree of tensors.

A stage's input and output may be a tuple, list or dict of tensors and constants, so models whose layers
take a mask and positions split as they are; gradients flow to every floating leaf that requires grad.
What a stage receives, and how a tree is sent in one frame:
[Note: stage boundaries carry pytrees] in docs/architecture.md#runtimepytreepy.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple, Sequence

import torch

from unbubble.errors import ConfigError

_TENSOR = "t"  # a tensor leaf without gradient
_GRAD = "g"  # a floating tensor leaf that carries a gradient


class Layout(NamedTuple):
    """The structure of a flattened tree: comparable with ``==`` and picklable.

    ``node`` is ``("t",)`` / ``("g",)`` for a tensor leaf (``g``: carries a gradient),
    ``("c", value)`` for a constant, ``("tuple" | "list", children)``, ``("dict", keys, children)``
    or ``("named", cls, children)`` (a tuple or list subclass).
    """

    node: tuple


#: constants that cannot hold a tensor (no scan needed)
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(...))


class _TensorFound(Exception):
    pass


class _Discard:
    """A file that keeps nothing: the scan only looks for tensors."""

    def write(self, data) -> int:
        return len(data)


class _Scanner(pickle.Pickler):
    """Pickles into nothing, stopping at the first tensor it meets (one reachable from the object)."""

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            raise _TensorFound
        return None


def _holds_tensor(x: Any) -> bool:
    """Whether a tensor is reachable from ``x`` by pickling (what the process engine would send).
    An object that cannot be pickled at all is not refused here."""
    if isinstance(x, _ATOMS):
        return False
    try:
        _Scanner(_Discard()).dump(x)
    except _TensorFound:
        return True
    except Exception:  # noqa: BLE001 - unpicklable for another reason: not ours to judge here
        return False
    return False


def _rebuild(cls: type, children: list) -> Any:
    """A tuple or list subclass from its items: ``cls._make`` for named tuples, ``cls(items)`` else
    (``torch.return_types`` structseqs, plain subclasses)."""
    return cls._make(children) if hasattr(cls, "_make") else cls(children)


def is_tree(x: Any) -> bool:
    """True unless ``x`` is a single tensor (or ``None``): the boundaries that need this module."""
    return not (x is None or isinstance(x, torch.Tensor))


def flatten(tree: Any, grads: bool = False, all_floating: bool = False) -> tuple[list[torch.Tensor], Layout]:
    """``(tensor leaves in order, layout)``.

    Args:
        tree: a tensor, tuple, list, dict or nesting of them; other values are constants.
        grads: mark leaves that require grad as gradient-carrying (``"g"``) in the layout (a
            forward's output); otherwise every tensor leaf is ``"t"``.
        all_floating: with ``grads``, mark every floating or complex leaf (an output computed
            without autograd, under recomputation, cannot tell which would require grad).

    Raises:
        ConfigError: a constant (a value other than a tensor, tuple, list or dict) holds a tensor,
            naming where in the tree and its type.
    """
    leaves: list[torch.Tensor] = []

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            carries = x.requires_grad or (all_floating and (x.is_floating_point() or x.is_complex()))
            return (_GRAD,) if grads and carries else (_TENSOR,)
        if isinstance(x, dict):
            keys = tuple(x)
            return ("dict", keys, tuple(walk(x[k], (path, k)) for k in keys))
        if isinstance(x, (tuple, list)):
            children = tuple(walk(v, (path, i)) for i, v in enumerate(x))
            return (type(x).__name__, children) if type(x) in (tuple, list) else ("named", type(x), children)
        if _holds_tensor(x):
            keys = []
            while path:
                path, key = path
                keys.append(f"[{key!r}]")
            raise ConfigError(f"a {type(x).__qualname__} at tree{''.join(reversed(keys))} holds a tensor: a stage "
                              "boundary carries tensors only as leaves of tuples, lists and dicts (anything else "
                              "passes as a constant, its gradient lost): put the tensor in a tuple, list or dict")
        return ("c", x)

    return leaves, Layout(walk(tree, ()))


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
            return _rebuild(node[1], [build(c) for c in node[2]])
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
    """``tree`` with ``fn`` applied to every tensor leaf (a tensor: ``fn(tree)``).

    Raises:
        ConfigError: as :func:`flatten`.
    """
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

    Raises:
        ConfigError: as :func:`flatten`.
    """
    if isinstance(out, torch.Tensor):
        return out.detach()
    leaves, layout = flatten(out, grads=True, all_floating=all_floating)
    return unflatten([t.detach().requires_grad_(g) for t, g in zip(leaves, grad_mask(layout))], layout)


class GradLeaves(NamedTuple):
    """A stage input's leaves that carry a gradient upstream, and the form the gradient goes back in: the one
    representation the executor keeps for a tensor input and a tree input alike.

    Attributes:
        leaves: the gradient-carrying leaves (a single-tensor input: that tensor).
        tree: the input is a tree: its gradient is a tuple of ``Tensor | None``, one per leaf; else the one
            tensor's gradient ([Note: stage boundaries carry pytrees]).
    """

    leaves: list[torch.Tensor]
    tree: bool

    def pack(self, grads: Sequence[torch.Tensor | None]) -> Any:
        """``grads`` (one per leaf, in order) in the form the previous stage receives."""
        return tuple(grads) if self.tree else grads[0]

    def grads(self) -> Any:
        """The leaves' accumulated ``.grad`` as the previous stage receives them."""
        return self.pack([t.grad for t in self.leaves])


def input_leaves(activation: Any) -> tuple[Any, GradLeaves]:
    """A received activation as the stage's input: ``(input tree, its gradient-carrying leaves)``.

    A single tensor becomes one leaf requiring grad (as always); in a tree, the leaves marked by
    :func:`detach_output` (or by the transport's layout) do, the rest are constants.

    Raises:
        ConfigError: as :func:`flatten`.
    """
    if isinstance(activation, torch.Tensor):
        x = activation.detach().requires_grad_(True)
        return x, GradLeaves([x], False)
    leaves, layout = flatten(activation, grads=True)
    new = [t.detach().requires_grad_(g) for t, g in zip(leaves, grad_mask(layout))]
    return unflatten(new, layout), GradLeaves([t for t in new if t.requires_grad], True)


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
