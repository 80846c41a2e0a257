"""PACI on torch.distributed.pipelining's ``PipelineStage``: an asynchronous schedule class, one stage per rank.

:class:`SchedulePACI` runs unbubble's PACI(a) (docs/architecture.md#schedules-and-their-semantics) over
torch's own ``PipelineStage`` and its point-to-point sends, in the user's processes (``torchrun``, any
backend): no unbubble launcher or executor, and the user's training loop (torchtitan's ``train_step``
included) keeps its shape; the loop and the step contract are in docs/pipelining.md. Every private torch
API it needs is in one class, ``_torch_private``, checked by a test against the installed torch.

Notes: [Note: the step contract] in docs/architecture.md#pipeliningpy.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from unbubble.errors import ConfigError, check_int
from unbubble.runtime.pytree import Layout, flatten, unflatten
from unbubble.runtime.versions import SavedByReference
from unbubble.schedules.actions import ActionKind
from unbubble.schedules.policy import OrderedPaciPolicy, StageState, resume_state

#: the torch versions this module was tested with, ``[low, high)`` by (major, minor)
TESTED_TORCH = ((2, 13), (2, 14))


def _check_torch_version(version: str | None = None) -> None:
    """Raises ConfigError unless ``version`` (default: the installed torch's) is in :data:`TESTED_TORCH`."""
    version = str(torch.__version__ if version is None else version)
    parts = re.match(r"(\d+)\.(\d+)", version)
    (lo, hi) = TESTED_TORCH
    if parts is None or not lo <= (int(parts[1]), int(parts[2])) < hi:
        raise ConfigError(f"torch {version} is not supported by unbubble.pipelining: it drives torch.distributed."
                          f"pipelining internals tested with torch {lo[0]}.{lo[1]} only (>= {lo[0]}.{lo[1]}, < "
                          f"{hi[0]}.{hi[1]}); install torch {lo[0]}.{lo[1]}.x, or train with unbubble's own runtime")


try:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torch.distributed.pipelining.schedules import get_schedule_class as _torch_schedule_class
    from torch.distributed.tensor import DTensor
except ImportError:  # an older torch lacks some: the same one line as at construction
    _check_torch_version()
    raise

__all__ = ["SchedulePACI", "MicroBatches", "TreeStage", "clip_grad_norm_pp", "split_torchtitan_model", "pipeline_paci",
           "build_pipeline_schedule", "get_schedule_class", "TESTED_TORCH"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


# -- [Note: private torch APIs] ---------------------------------------------------------------------
# Every use of torch that is neither public nor documented, in one place:
#   * PipelineScheduleSingle._initialize_stage(args, kwargs, target): the stage's shape inference and
#     receive buffers, as torch's own schedules run it on their first step (no public way exists), and
#     its _loss_fn, swapped around it for a target that is a nest of tensors (torch infers with a tensor)
#     and for a last stage whose output a TreeStage flattened, and its _stage, whose DDP module it runs under
#     no_sync() (torch's inference forward would otherwise arm DDP's reducer);
#   * PipelineStage.forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output),
#     backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward) and
#     perform_reduce_grad(grad_scale_factor): the per-micro-batch actions torch's schedules call (public
#     names, undocumented); last_backward=True on an update's a-th backward lets DDP all-reduce in it,
#     perform_reduce_grad after it runs FSDP2's reduce-scatter ([Note: data parallelism inside a stage]);
#   * torch.distributed.pipelining._backward.stage_backward (through backward_one_chunk) resets the receive
#     buffers' .grad after reading it, so a receive slot reused by micro-batch k + N starts from no gradient;
#   * PipelineStage._send_meta(meta, dst_stage) / _recv_meta(src_stage): the shape inference's one object
#     per boundary, which also carries a TreeStage's output layout to the next stage ([Note: tree
#     boundaries on torch's stage]);
#   * PipelineStage.fwd_cache: drain() and eval() drop the graphs of the forwards they discard from it;
#   * PipelineStage.args_recv_info / grad_recv_info (per chunk id: a tuple of _RecvInfo with a receive buffer and
#     its _TensorMeta) and _resolve_peer_global_rank: a batch of new shapes re-makes a slot's buffers, and its
#     shapes travel to the next stage ([Note: changing shapes on torch's stage]);
#   * torch.distributed._composable.replicate's DDP class: refused inside a stage (it syncs on every backward).
# tests/unit/test_pipelining.py::test_private_torch_seams_are_as_this_module_expects checks all of them, and
# the schedule refuses any torch outside TESTED_TORCH at construction (_check_torch_version; at import when torch
# lacks one of the modules imported above).
class _torch_private:
    @staticmethod
    def initialize_stage(schedule: PipelineScheduleSingle, args: tuple, kwargs: dict, target: Any,
                         rebuild: Callable[[Any], Any]) -> None:
        """torch's shape inference and buffers; its loss sees ``rebuild(output)`` and the real ``target``."""
        # torch's backward inference takes one tensor target (PipelineStage._to_tensor): a nest of them reaches
        # the loss through schedule._loss_fn, around a placeholder tensor
        loss_fn = schedule._loss_fn
        schedule._loss_fn = lambda output, _placeholder: loss_fn(rebuild(output), target)
        # torch's inference calls the module outside no_sync(): DDP's forward would then arm its reducer, and the
        # first micro-batch's backward would all-reduce (a second reduction in the first update)
        submod = schedule._stage.submod
        no_sync = submod.no_sync() if isinstance(submod, DistributedDataParallel) else contextlib.nullcontext()
        try:
            placeholder = target if target is None or isinstance(target, torch.Tensor) else torch.zeros(())
            with no_sync:
                schedule._initialize_stage(args, kwargs, placeholder)
        finally:
            schedule._loss_fn = loss_fn

    @staticmethod
    def forward(stage: PipelineStage, slot: int, args: tuple, kwargs: dict) -> Any:
        return stage.forward_one_chunk(slot, args, kwargs, save_forward_output=False)

    @staticmethod
    def backward(stage: PipelineStage, slot: int, loss: torch.Tensor | None, last: bool) -> None:
        stage.backward_one_chunk(slot, loss=loss, full_backward=True, last_backward=last)

    @staticmethod
    def reduce_grad(stage: PipelineStage) -> None:
        stage.perform_reduce_grad(1)  # our 1/a is in each micro-batch's loss: no scaling here

    @staticmethod
    def carry_layouts(stage: PipelineStage, tree: "TreeStage | None") -> None:
        """The shape inference's forward metadata object also carries ``tree``'s output layout downstream,
        and the one received sets ``tree``'s input layout (on this stage object only)."""
        from torch.distributed.pipelining.stage import _StageForwardMeta

        send, recv = stage._send_meta, stage._recv_meta

        def send_meta(meta: Any, dst_stage: int) -> None:
            if isinstance(meta, _StageForwardMeta):
                meta = (_LAYOUT_TAG, meta, None if tree is None else tree.out_layout)
            send(meta, dst_stage)

        def recv_meta(src_stage: int) -> Any:
            meta = recv(src_stage)
            if isinstance(meta, tuple) and len(meta) == 3 and meta[0] == _LAYOUT_TAG:
                _, meta, layout = meta
                if tree is not None:
                    tree.in_layout = layout
            return meta

        stage._send_meta, stage._recv_meta = send_meta, recv_meta

    @staticmethod
    def shapes_op(stage: PipelineStage, shapes: tuple | None) -> tuple[dist.P2POp, torch.Tensor]:
        """A point-to-point op carrying a batch's boundary shapes: an isend of ``shapes`` to the next stage
        (encoded), or with ``shapes=None`` an irecv from the previous one (:func:`_decode_shapes` reads it)."""
        if shapes is None:
            buf = torch.empty(_SHAPES_LEN, dtype=torch.int64, device=stage.device)
            peer = stage._resolve_peer_global_rank(stage.stage_index - 1)
            return dist.P2POp(dist.irecv, buf, peer, stage.group), buf
        buf = _encode_shapes(shapes).to(stage.device)
        return dist.P2POp(dist.isend, buf, stage._resolve_peer_global_rank(stage.stage_index + 1), stage.group), buf

    @staticmethod
    def fit_buffers(infos: tuple, shapes: tuple) -> tuple:
        """``infos`` (torch's ``_RecvInfo`` of one slot) with receive buffers of ``shapes`` (None: unchanged)."""
        import dataclasses

        from torch.distributed.pipelining.stage import _RecvInfo

        out = []
        for info, shape in zip(infos, shapes):
            if info.buffer is None or shape is None or tuple(info.buffer.shape) == tuple(shape):
                out.append(info)
                continue
            buffer = torch.empty(shape, dtype=info.buffer.dtype, device=info.buffer.device)
            meta = info.tensor_meta
            if dataclasses.is_dataclass(meta) and hasattr(meta, "shape"):
                meta = dataclasses.replace(meta, shape=buffer.shape, stride=buffer.stride())
            out.append(_RecvInfo(info.input_name, info.source, buffer, meta, is_root_arg=info.is_root_arg))
        return tuple(out)

    @staticmethod
    def fit_act_recv(stage: PipelineStage, slot: int, shapes: tuple) -> None:
        stage.args_recv_info[slot] = _torch_private.fit_buffers(stage.args_recv_info[slot], shapes)

    @staticmethod
    def fit_grad_recv(stage: PipelineStage, slot: int, shapes: tuple) -> None:
        if slot in stage.grad_recv_info:
            stage.grad_recv_info[slot] = _torch_private.fit_buffers(stage.grad_recv_info[slot], shapes)

    @staticmethod
    def act_recv_shapes(stage: PipelineStage, slot: int) -> tuple:
        return tuple(None if i.buffer is None else tuple(i.buffer.shape) for i in stage.args_recv_info[slot])

    @staticmethod
    def drop_forward(stage: PipelineStage, slot: int) -> None:
        stage.fwd_cache.pop(slot, None)

    @staticmethod
    def composable_ddp() -> tuple[type, ...]:
        """``torch.distributed._composable.replicate``'s DDP class (its modules are instances), if present."""
        try:
            from torch.distributed._composable.replicate import DDP
        except ImportError:  # pragma: no cover - removed in a later torch
            return ()
        return (DDP,)


_LAYOUT_TAG = "unbubble.TreeStage layout"
_SHAPES_LEN = 64  # int64 words of a shapes message: [n, (ndim, dims…) per boundary tensor]


def _encode_shapes(shapes: tuple) -> torch.Tensor:
    words = [len(shapes)]
    for shape in shapes:
        words += [-1] if shape is None else [len(shape), *shape]
    if len(words) > _SHAPES_LEN:
        raise ConfigError(f"a stage boundary of {len(shapes)} tensors ({len(words)} shape words) is invalid: "
                          f"SchedulePACI announces at most {_SHAPES_LEN} words of shapes per batch")
    return torch.tensor(words + [0] * (_SHAPES_LEN - len(words)), dtype=torch.int64)


def _decode_shapes(buf: torch.Tensor) -> tuple:
    words, out, i = buf.tolist(), [], 1
    for _ in range(words[0]):
        if words[i] < 0:
            out.append(None)
            i += 1
        else:
            out.append(tuple(words[i + 1:i + 1 + words[i]]))
            i += 1 + words[i]
    return tuple(out)


# [Note: how a batch is split]
# Each batch ``(inputs, target)`` from the data iterator is cut into m micro-batches the way torch's schedules
# cut ``step(*args, target=..., **kwargs)`` by default (``split_args_kwargs_into_chunks``, TensorChunkSpec(0)):
# every tensor leaf of ``inputs`` and ``target`` (tuples, named tuples, lists and dicts nest them) is split along
# dim 0 with ``torch.tensor_split`` and every other leaf is passed unchanged to each micro-batch. Unlike torch, an
# uneven split is refused: dim 0 must be a multiple of m, so that every micro-batch's mean loss weighs the same.
# The first stage's module receives a micro-batch's inputs as one argument, ``module(inputs)``, whatever they are (a
# tensor, a dict, a tuple): unbubble's one convention, which its executor follows too ([Note: stage boundaries carry
# pytrees] in ``runtime/pytree.py``; docs/pipelining.md). torch's ``PipelineStage`` passes its first stage tensors
# only, as positional arguments, so inputs other than a tensor need :class:`TreeStage`: the schedule hands torch
# their tensor leaves and the TreeStage rebuilds the inputs from their layout (non-tensor leaves included) before
# calling its module; a plain stage module given anything but a tensor is refused in one line at the first batch.
# ``loss_fn`` receives the target micro-batch in the target's own structure.
def _chunk(tree: Any, m: int, path: str) -> list:
    """``tree`` as m micro-batches: tensor leaves split along dim 0, other leaves repeated."""
    if isinstance(tree, torch.Tensor):
        if tree.dim() == 0 or tree.shape[0] % m:
            rows = "a 0-dim tensor has no dim 0" if tree.dim() == 0 else f"dim 0 is {tree.shape[0]}, not a multiple of {m}"
            raise ConfigError(f"{path} of shape {tuple(tree.shape)} is invalid for n_microbatches={m}: every tensor of "
                              f"a batch splits along dim 0 into {m} equal micro-batches ({rows})")
        return list(torch.tensor_split(tree, m, dim=0))
    if isinstance(tree, dict):
        parts = {key: _chunk(v, m, f"{path}[{key!r}]") for key, v in tree.items()}
        return [{key: p[j] for key, p in parts.items()} for j in range(m)]
    if isinstance(tree, (tuple, list)):
        parts = [_chunk(v, m, f"{path}[{i}]") for i, v in enumerate(tree)]
        if hasattr(tree, "_fields"):  # a named tuple keeps its type
            return [type(tree)(*(p[j] for p in parts)) for j in range(m)]
        return [(list if isinstance(tree, list) else tuple)(p[j] for p in parts) for j in range(m)]
    return [tree] * m


# [Note: data parallelism inside a stage]
# A stage module may be replicated over a data-parallel group: wrapped whole in ``DistributedDataParallel``, or
# sharded with ``fully_shard`` (FSDP2) at its root (and, as torchtitan does, also at its blocks). torch's stage runs
# every backward under DDP's ``no_sync()`` / FSDP's ``set_requires_gradient_sync(False)`` unless told it is the
# last one; SchedulePACI says so on each update's a-th backward (``last_backward=True``: DDP all-reduces in that
# backward, each replica's gradient divided by the group size) and then calls ``perform_reduce_grad`` (FSDP2's
# post-backward: the reduce-scatter of the accumulated gradients, then reshard). Gradients are so reduced exactly
# once per update, over the a micro-batches of every replica, before ``step()`` returns: the loop's clipping and
# ``optimizer.step()`` see the replicas' mean gradient, as in unbubble's own ``--dp`` runs (``GradientAverager``
# at each U, ``runtime/data_parallel.py``). Forwards read ahead across an update need nothing: DDP's replicas stay
# equal by applying equal updates, and FSDP2 has resharded after the reduction, so the next forward and every
# in-flight micro-batch's backward all-gather the updated shards (the backward on the current weights, PACI's
# rule). Each replica passes its own data iterator. A wrapper the schedule cannot drive this way is refused at
# construction in one line (:func:`_check_data_parallel`), never run unsynchronised: FSDP1
# (``FullyShardedDataParallel``), ``torch.distributed._composable.replicate`` (it syncs on every backward), and
# DDP or ``fully_shard`` below a root that is not itself wrapped (torch's stage looks at the root only).
def _check_data_parallel(module: nn.Module) -> None:
    """Raises ConfigError for a stage module whose gradients SchedulePACI cannot reduce once per update."""
    supported = ("supported: DistributedDataParallel(stage module), or fully_shard (FSDP2) applied to the stage "
                 "module itself (its submodules may be sharded too)")
    composable = _torch_private.composable_ddp()
    root = type(module).__name__
    for name, sub in module.named_modules():
        where = f"stage module {root}" + (f" at {name!r}" if name else "")
        if isinstance(sub, FullyShardedDataParallel):
            raise ConfigError(f"{where} is a FullyShardedDataParallel (FSDP1), which SchedulePACI cannot sync once per "
                              f"update; {supported}")
        if composable and isinstance(sub, composable):
            raise ConfigError(f"{where} is replicated by torch.distributed._composable.replicate, which all-reduces "
                              f"on every backward; {supported}")
        if name and isinstance(sub, DistributedDataParallel):
            raise ConfigError(f"{where} is a DistributedDataParallel inside the stage module, which torch's stage "
                              f"cannot hold in no_sync(); {supported}")
        if name and isinstance(sub, FSDPModule) and not isinstance(module, FSDPModule):
            raise ConfigError(f"{where} is sharded by fully_shard but the stage module {root} is not, so its "
                              f"gradients would be reduced on every backward; {supported}")


class MicroBatches(NamedTuple):
    """One batch already split into micro-batches, as torch's newest schedules take it (``step(arg_mbs=,
    kwarg_mbs=, target_mbs=)``; torchtitan 0.3.0's ``pp_forward_backward_step`` builds exactly these lists).

    A data iterator given to :meth:`SchedulePACI.step` may yield these instead of ``(inputs, target)`` pairs
    (PACI's read-ahead then reaches into the next batch, [Note: the step contract]); ``step(arg_mbs=, …)`` wraps
    its keywords in one. Every list has n_microbatches entries; a missing list means nothing of that kind.

    Fields:
        arg_mbs: per micro-batch, the first stage module's positional inputs, a tuple (torchtitan: ``(tokens,)``,
            ``(B, T)`` int64); with :class:`TreeStage` a 1-tuple holding the inputs (a dict, tuple or tensor).
        kwarg_mbs: per micro-batch, keyword inputs passed to this rank's stage module on every stage
            (``positions``, ``attention_masks``: a mask tensor or a flex-attention ``BlockMask``).
        target_mbs: per micro-batch, the last stage's targets (a tensor or a nest of them).
        loss_kwargs: keyword arguments of every ``loss_fn`` call on this batch's micro-batches (torchtitan:
            ``{"global_valid_tokens": n}``).
    """

    arg_mbs: list | None = None
    kwarg_mbs: list | None = None
    target_mbs: list | None = None
    loss_kwargs: dict | None = None


class _Args(tuple):
    """A pre-split micro-batch's positional inputs (``arg_mbs[j]``), passed to the module as they are."""


class _Batch(NamedTuple):
    inputs: list  # per micro-batch: the first stage's one argument, or an _Args
    kwargs: list  # per micro-batch: the stage module's keyword inputs
    targets: list | None
    loss_kwargs: dict


def _merge(outputs: list) -> Any:
    """The micro-batches' outputs as one: tensor leaves concatenated along dim 0 (0-dim ones stacked)."""
    leaves, layout = zip(*(flatten(out) for out in outputs))
    merged = [torch.cat(ts) if ts[0].dim() else torch.stack(ts) for ts in zip(*leaves)]
    return unflatten(merged, layout[0])


class _Unset:
    def __repr__(self) -> str:
        return "unset"


_UNSET: Any = _Unset()


# [Note: tree boundaries on torch's stage]
# torch's ``PipelineStage`` carries tensors only: a stage's inputs after the first and every stage's outputs must be
# tensors or tuples of them ("Stage args must be … tensors, got dict"). :class:`TreeStage` wraps a stage module
# whose output is a tree (Hugging Face stages from ``unbubble.models.split.split_model`` return
# ``{"hidden_states", "attention_mask", "position_ids"}``): it returns the tree's tensor leaves as a tuple
# (``unbubble.runtime.pytree.flatten``; other leaves, an ``attention_mask`` of ``None`` say, stay in the layout),
# and the next stage's TreeStage rebuilds the tree from the received tensors and that layout before calling its
# module, which so gets what unbubble's executor gives it (the previous stage's output as one argument). The
# layout crosses the boundary once: SchedulePACI attaches it to the object torch's shape inference sends
# downstream at the first ``step()`` (``_torch_private.carry_layouts``), so it needs no message of its own. torch
# fixes a boundary's tensors at that inference (shapes, dtypes), so a layout may not change afterwards: a stage
# whose output layout differs from its first is refused in one line. Gradients follow torch's rule: each floating
# leaf that requires grad gets one, integer leaves (token ids, masks, position ids) none.
class TreeStage(nn.Module):
    """A stage module with a tree-valued output (a dict, tuple, list or nest), runnable in torch's ``PipelineStage``
    under :class:`SchedulePACI` ([Note: tree boundaries on torch's stage]).

    .. code-block:: python

        split = split_model(hf_model, n_ranks)                    # HF stages: dict boundaries
        part = split(rank)                                        # optimize and checkpoint this module
        stage = PipelineStage(TreeStage(part), rank, n_ranks, device)
        schedule = SchedulePACI(stage, n_microbatches=4, loss_fn=causal_lm_loss)
        # data: ({"input_ids": (m·B, T) int64[, "attention_mask": (m·B, T)]}, labels (m·B, T))

    Wrap it first, then in ``DistributedDataParallel`` or ``fully_shard`` ([Note: data parallelism inside a
    stage]); its own ``state_dict`` prefixes ``module.``, so checkpoint and optimize the wrapped module itself.

    Calls: the module gets one argument, as unbubble's executor calls it: on the first stage a micro-batch's inputs
    as the data iterator gives them, ``module(inputs)`` (a dict, a tuple, a tensor; SchedulePACI hands torch their
    tensor leaves and sets their layout, [Note: how a batch is split]), on later stages the previous stage's output
    rebuilt (a tensor stays a tensor). Returns a tensor output as it
    is, and a tree as the tuple of its tensor leaves (the last stage's is rebuilt for ``loss_fn``).

    Args:
        module: the stage module; its output's non-tensor leaves must not change between micro-batches.

    Raises:
        ConfigError: (at a forward) on a later stage before SchedulePACI set its input layout, or an output whose
            layout differs from the first one's.

    Source: the pytree boundary of ``unbubble.runtime.pytree`` ([Note: stage boundaries carry pytrees]).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        #: the layout of the tensors torch passes: the received one on a later stage (None: one tensor), the
        #: micro-batch's inputs' on the first (set by SchedulePACI before each forward)
        self.in_layout: Layout | None = _UNSET
        self.out_layout: Layout | None = _UNSET  #: None for a tensor output

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        if self.in_layout is _UNSET:
            raise ConfigError(f"TreeStage({type(self.module).__name__}) has no input layout yet: SchedulePACI sets it "
                              "at its first step() (torch's own schedules cannot carry a tree boundary)")
        # one argument, as in unbubble's executor: the inputs or the previous stage's output, rebuilt
        # a micro-batch's keyword inputs (an attention mask, a BlockMask) reach the module as keywords
        out = (self.module(*args, **kwargs) if self.in_layout is None
               else self.module(unflatten(list(args), self.in_layout), **kwargs))
        if isinstance(out, torch.Tensor):
            leaves, layout = out, None
        else:
            leaves, layout = flatten(out)
            leaves = tuple(leaves)
        if self.out_layout is _UNSET:
            self.out_layout = layout
        elif layout != self.out_layout:
            raise ConfigError(f"the output layout of TreeStage({type(self.module).__name__}) changed from "
                              f"{self.out_layout} to {layout}: torch's PipelineStage fixes a boundary's tensors at the "
                              "first step(), so every micro-batch's output must have the same structure")
        return leaves

    def rebuild(self, output: Any) -> Any:
        """The tree whose leaves ``output`` holds (a tensor or tuple as torch returns it); as is for a tensor output."""
        if self.out_layout is _UNSET or self.out_layout is None:
            return output
        return unflatten([output] if isinstance(output, torch.Tensor) else list(output), self.out_layout)


# [Note: one PACI order]
# SchedulePACI does not restate PACI's order: each ``step()`` asks unbubble's :class:`OrderedPaciPolicy` (the policy
# the simulator, the emulator and the process engine run, ``schedules/policy.py``) for the stage's next action on a
# :class:`StageState` of its own counts, runs the F or B it names, and returns at the U it names (the loop's
# ``optimizer.step()``). The policy waits for an input that has not arrived; torch's receives block until it has, so
# the state reports every input as here (:class:`_BlockingState`). Back-pressure, the update after the a-th backward
# and the drift bound are so the policy's; ``flush=True`` is the policy with its next forward held back (the
# ``forward=False`` a checkpoint drain uses) until the update, and ``drain()`` and ``load_state_dict()`` move the
# state to the checkpoint cut as the engines do (``resume_state``).
_ENDLESS = 2 ** 62  # micro-batches of the run: the data iterator decides when it ends


class _BlockingState(StageState):
    """A :class:`StageState` whose inputs are always here: torch's receives wait for them ([Note: one PACI order])."""

    def input_ready(self, mb: int) -> bool:
        return True

    def grad_ready(self, mb: int) -> bool:
        return True


def _tree_stage(submod: nn.Module) -> TreeStage | None:
    """The TreeStage a stage runs, under DistributedDataParallel or fully_shard (in place), or None."""
    inner = submod.module if isinstance(submod, DistributedDataParallel) else submod
    return inner if isinstance(inner, TreeStage) else None


class SchedulePACI(PipelineScheduleSingle):
    """PACI(a) over one torch ``PipelineStage`` per rank, never flushed between ``step()`` calls.

    Stage i (1-based, i = stage + 1) of N admits a forward while its in-flight count q_i < N + 1 − i,
    otherwise runs the backward of its oldest in-flight micro-batch; after every a-th backward it returns
    from ``step()`` and the caller's ``optimizer.step()`` is the local update. The drift of stage i is
    bounded by Δ_i ≤ ⌈(N − i)/a⌉, attained in steady state. Each micro-batch's loss is multiplied by
    1/a before its backward (so an update applies the mean gradient; ``scale_grads=False``: not);
    ``losses`` holds the unscaled ones. The step contract is [Note: the step contract] in this module's
    docstring. A stage module wrapped in ``DistributedDataParallel`` or sharded by ``fully_shard`` has its
    gradients reduced over its data-parallel group once per update, after the a-th backward and before
    ``step()`` returns ([Note: data parallelism inside a stage]); a tree-valued stage runs wrapped in
    :class:`TreeStage`. :meth:`eval` is a forward-only pass of one batch on a drained schedule.

    With ``flush=True`` no forward of update t + 1's micro-batches starts before update t: every
    ``step()`` ends drained, which is 1F1B-flush with m = a (torch's ``Schedule1F1B`` order).

    Args:
        stage: this rank's ``torch.distributed.pipelining.PipelineStage``; ``num_stages`` must equal the
            size of its process group (one stage per rank). Its module's input on the first stage is the
            micro-batch's inputs as one argument (a tensor, e.g. token ids ``(B, T)`` int64; a dict or tuple
            through :class:`TreeStage`, [Note: how a batch is split]), else the previous stage's output; any
            tensor-valued output (a tree's: :class:`TreeStage`). Its module may be wrapped in
            ``DistributedDataParallel`` or ``fully_shard`` (FSDP2) at its root.
        n_microbatches: m, the micro-batches each batch from the data iterator splits into (dim 0).
        loss_fn: ``loss_fn(last_stage_output, target_micro_batch) -> scalar`` mean loss.
        a: accumulation factor, backwards per ``step()`` and update (default m). Need not divide m, nor
            m divide it: micro-batches carry over between batches and calls.
        flush: drain at the end of every ``step()`` (1F1B-flush) instead of PACI's carry-over.
        scale_grads: multiply each micro-batch's loss by 1/a before its backward (default), so the update
            applies the mean of its a micro-batches' gradients, as torch's ``scale_grads=True`` with a mean
            ``loss_fn``. ``False``: backpropagate ``loss_fn``'s value as it is, so the update applies the sum of
            its a micro-batches' gradients; ``loss_fn`` must then be normalised over the whole update itself
            (torchtitan passes ``False`` with a sum loss divided by the step's token count).

    Raises:
        ConfigError: ``n_microbatches`` or ``a`` not an integer ≥ 1, no ``loss_fn``, a ``stage`` that is
            not a ``PipelineStage``, ``num_stages`` different from the number of ranks, ``scale_grads`` not a
            bool, a stage module wrapped in a way the schedule cannot sync once per update (FSDP1,
            composable ``replicate``, DDP or ``fully_shard`` below an unwrapped root), or a torch version
            outside :data:`TESTED_TORCH` (2.13).

    Memory: each stage holds at most N + 1 − i micro-batches' activations, as 1F1B-flush; no weight copy.

    Source: PACI, arXiv 2606.07881, §3 (accumulation as version control, local flow control).
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: LossFn, a: int | None = None, *,
                 flush: bool = False, scale_grads: bool = True):
        _check_torch_version()
        check_int("n_microbatches", n_microbatches, 1, "micro-batches per batch of the data iterator")
        a = n_microbatches if a is None else a
        check_int("a", a, 1, "backward passes per step() and local update")
        if loss_fn is None:
            raise ConfigError("loss_fn=None is invalid: SchedulePACI trains, give loss_fn(output, target) -> scalar")
        if not isinstance(stage, PipelineStage):
            raise ConfigError(f"stage={type(stage).__name__} is invalid: SchedulePACI runs one "
                              "torch.distributed.pipelining.PipelineStage per rank")
        if stage.num_stages != stage.group_size:
            raise ConfigError(f"num_stages={stage.num_stages} is invalid with {stage.group_size} ranks: SchedulePACI "
                              f"runs one stage per rank (build the PipelineStage with num_stages={stage.group_size})")
        if not isinstance(scale_grads, bool):
            raise ConfigError(f"scale_grads={scale_grads!r} is invalid: True (each loss × 1/a: the update's mean "
                              "gradient) or False (the loss as given: the update's summed gradient)")
        _check_data_parallel(stage.submod)
        # torch's receive buffers are per chunk id: micro-batch k uses slot k mod N; a slot is reused only
        # after its micro-batch's backward (at most N + 1 − i are in flight)
        super().__init__(stage, n_microbatches=stage.num_stages, loss_fn=loss_fn, scale_grads=False)
        # our own handles (torch's base class keeps its own private copies for _initialize_stage)
        self._pp_stage, self._slots, self._user_loss = stage, stage.num_stages, loss_fn
        self.m, self.a, self.flush, self.scale_grads = n_microbatches, a, flush, scale_grads
        # the order: unbubble's PACI policy, the one the simulator, the emulator and the process engine run
        # ([Note: one PACI order]); its state counts forwards, backwards and the version (= updates applied)
        self._policy = OrderedPaciPolicy(stage.stage_index, stage.num_stages, a)
        self._state = _BlockingState(stage.stage_index, stage.num_stages, total_mb=_ENDLESS)
        self.cap = self._policy.cap  # N + 1 − i, i = stage + 1
        self._scale = 1.0 / a if scale_grads else None
        self._tree = _tree_stage(stage.submod)
        self._rebuild: Callable[[Any], Any] = self._tree.rebuild if self._tree is not None else (lambda out: out)
        self._fwd_version: dict[int, int] = {}
        self._loss: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # k -> (scaled loss, detached loss)
        self._batches: dict[int, _Batch] = {}  # b -> its m micro-batches (as far as this stage reads them)
        self._next_batch = 0
        self._data: Iterator | None = None
        # the pre-split form (step(arg_mbs=, ...)): the batches given and not yet read; the form of the first
        # step() (None before it)
        self._queue: deque[MicroBatches] = deque()
        self._presplit: bool | None = None
        # [Note: changing shapes on torch's stage]: batch -> the shapes of this stage's outputs (sent) and of
        # the previous stage's (received)
        self._send_shapes: dict[Any, tuple] = {}
        self._recv_shapes: dict[Any, tuple] = {}
        self._sends: dict[str, list] = {"fwd": [], "bwd": []}
        self._hooks: SavedByReference | None = None
        self._initialized = False
        self._owed = False  # an activation sent by the previous stage that no forward here will receive
        self.drift: Counter[int] = Counter()  #: Δ = v_B − v_F -> backwards of this stage with that drift

    # -- public state ---------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """``step()`` calls finished (the weight version, once the loop has applied each update)."""
        return self._state.version

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded on this stage and not yet backwarded (q_i)."""
        return self._state.in_flight

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position, to checkpoint beside the model and optimizer after :meth:`drain`.

        Returns:
            ``{"steps": V, "next_micro_batch": V·a, "drift": {Δ: count}}``. The data iterator of the
            resumed run must start at batch ``next_micro_batch // n_microbatches``.

        Raises:
            RuntimeError: micro-batches are in flight (call :meth:`drain` first).
        """
        if self.in_flight or self._owed:
            raise RuntimeError(f"stage {self._pp_stage.stage_index} has {self.in_flight} micro-batches in flight: call "
                               "drain() before state_dict()")
        return {"steps": self._state.version, "next_micro_batch": self._state.n_bwd, "drift": dict(self.drift)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s position (before the first ``step()`` of the resumed run).

        Raises:
            RuntimeError: micro-batches are in flight.
        """
        if self.in_flight or self._owed:
            raise RuntimeError(f"stage {self._pp_stage.stage_index} has {self.in_flight} micro-batches in flight: "
                               "load_state_dict() needs a drained schedule")
        self._state = _BlockingState(self._state.stage, self._state.n_stages, total_mb=_ENDLESS)
        resume_state(self._state, state["steps"], self.a)  # next_micro_batch = steps · a
        self._next_batch = self._state.n_bwd // self.m
        self._batches.clear()
        self._queue.clear()
        self._send_shapes.clear()
        self._recv_shapes.clear()
        self.drift = Counter(state.get("drift", {}))

    # -- the step -------------------------------------------------------------------------------------
    def step(self, data: Iterator | None = None, *, losses: list | None = None, arg_mbs: list | None = None,
             kwarg_mbs: list | None = None, target_mbs: list | None = None, loss_kwargs: dict | None = None,
             return_outputs: bool = False, **kwargs) -> None:
        """Runs this stage's next a backwards and the forwards back-pressure admits ([Note: the step contract]).

        Two forms. ``step(data)``: the micro-batches come from an iterator, and PACI's read-ahead into the next
        batch is served from it. ``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=)``: torch's
        pre-split form (torchtitan 0.3.0's training step): one batch of n_microbatches micro-batches per call;
        a forward the policy admits beyond the micro-batches given so far waits for the next call, so with a = m
        every call ends drained (1F1B-flush's order and arithmetic) and PACI's read-ahead needs the iterator form
        (yielding :class:`MicroBatches` for per-micro-batch keyword inputs). A run keeps the form of its first call.

        Args:
            data: iterator of batches, each ``(inputs, target)`` or a :class:`MicroBatches`. ``(inputs, target)``:
                ``inputs`` a tensor, or (with :class:`TreeStage`) a dict, tuple or list, the first stage's one
                argument per micro-batch, ``target`` a tensor or a nest of them; every tensor leaf has m·B rows
                along dim 0 (B the micro-batch size), other leaves pass through ([Note: how a batch is split]).
                Needed on the first and last stage at the first call (later calls may pass it again or ``None``);
                read on a middle stage when given (the keyword inputs of :class:`MicroBatches` items).
            losses: on the last stage, cleared and filled with this call's a unscaled micro-batch losses
                (0-dim tensors, oldest first).
            arg_mbs, kwarg_mbs, target_mbs, loss_kwargs: the pre-split form, as :class:`MicroBatches`' fields;
                each list given has n_microbatches entries (arg_mbs on the first stage, target_mbs on the last).
            return_outputs: torch's flag; SchedulePACI returns nothing (``True`` is refused).

        Raises:
            ConfigError: ``data`` missing where it is read, not an iterator, a batch tensor whose dim 0 is not a
                multiple of m, inputs other than a tensor on a first stage without :class:`TreeStage`, both forms
                or a change of form, a pre-split list of the wrong type or length, micro-batches of one batch
                whose boundary shapes differ, ``return_outputs=True``, or other keyword arguments.
            RuntimeError: called under ``torch.no_grad()``, or the iterator ran out.
        """
        st = self._pp_stage
        if kwargs:
            raise ConfigError(f"{', '.join(kwargs)}= is invalid for SchedulePACI.step: it takes the data iterator, "
                              "or torch's pre-split arg_mbs=, kwarg_mbs=, target_mbs=, loss_kwargs=, and losses=")
        if return_outputs:
            raise ConfigError("return_outputs=True is invalid for SchedulePACI.step: a call's backwards belong to "
                              "micro-batches forwarded in earlier calls, so it returns no outputs; evaluate with "
                              "eval() after drain()")
        presplit = not (arg_mbs is None and kwarg_mbs is None and target_mbs is None and loss_kwargs is None)
        if presplit and data is not None:
            raise ConfigError("data= with arg_mbs=/kwarg_mbs=/target_mbs= is invalid: give the iterator or one "
                              "pre-split batch per call, not both")
        if self._presplit is not None and presplit != self._presplit:
            raise ConfigError(f"a {'pre-split' if presplit else 'data-iterator'} step() after "
                              f"{'pre-split' if self._presplit else 'data-iterator'} ones is invalid: the schedule "
                              "reads ahead from one source, so a run keeps the form of its first step()")
        if presplit:
            self._queue.append(self._check_presplit(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs))
        elif data is not None:
            if not isinstance(data, Iterator):
                raise ConfigError(f"data={type(data).__name__} is invalid: SchedulePACI.step takes an iterator of "
                                  "(inputs, target) batches, because the first stage reads up to N−1 micro-batches "
                                  "ahead of its update (pass iter(batches) or your data loader's iterator)")
            self._data = data
        if not presplit and (st.is_first or st.is_last) and self._data is None:
            raise ConfigError(f"data=None is invalid on stage {st.stage_index}: the {'first' if st.is_first else 'last'} "
                              "stage reads the micro-batches' inputs or targets; pass the data iterator on every rank")
        if not torch.is_grad_enabled():
            raise RuntimeError("SchedulePACI.step() needs gradients: it was called under torch.no_grad()")
        self._presplit = presplit
        st.has_backward = True
        state, end = self._state, (self._state.version + 1) * self.a
        # pre-split: forwards wait at the micro-batches given so far (every rank counts the same batches)
        limit = (self._next_batch + len(self._queue)) * self.m if presplit else _ENDLESS
        if self.flush:
            limit = min(limit, end)
        if limit < end:
            raise ConfigError(f"a={self.a} is invalid with one pre-split batch of {self.m} micro-batches per step(): "
                              f"update {state.version} needs micro-batches up to {end - 1}, {limit} were given; use "
                              f"a ≤ n_microbatches ({self.m})")
        if not self._initialized:
            self._initialize()
        call_losses: list[torch.Tensor] = []
        while True:  # the policy's order until its U ([Note: one PACI order])
            action = self._policy.next_action(state, forward=state.n_fwd < limit)
            if action.kind is ActionKind.U:
                break
            if action.kind is ActionKind.F:
                self._forward(action.mb)
            else:  # B; the update's a-th lets DDP all-reduce in it
                call_losses += self._backward(action.mb, last=state.bwd_since_update == self.a - 1)
            state.apply(action)
        # the update's one gradient reduction over a data-parallel group (FSDP2's reduce-scatter; DDP's
        # all-reduce ran in the a-th backward): [Note: data parallelism inside a stage]
        _torch_private.reduce_grad(st)
        state.apply(action)  # U: the loop's optimizer.step() applies it after this call
        # under PACI the previous stage ends each call with exactly one forward more than this one
        # (n_fwd = a·(t+1) + N − i on stage i − 1, one less here): drain() receives it. Not when the previous
        # stage's forwards stop at the same limit (flush, or the pre-split form's last given micro-batch).
        self._owed = not (st.is_first or state.n_fwd >= limit)
        if st.is_last and losses is not None:
            losses.clear()
            losses.extend(call_losses)

    def _check_presplit(self, arg_mbs: Any, kwarg_mbs: Any, target_mbs: Any, loss_kwargs: Any) -> MicroBatches:
        """The pre-split keywords as one :class:`MicroBatches`, checked as torch's ``_check_inputs`` checks them."""
        st = self._pp_stage
        for name, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
            if mbs is not None and (not isinstance(mbs, list) or len(mbs) != self.m):
                got = f"a list of {len(mbs)}" if isinstance(mbs, list) else f"a {type(mbs).__name__}"
                raise ConfigError(f"{name}= {got} is invalid: a list of n_microbatches={self.m} micro-batches")
        if kwarg_mbs is not None and not all(isinstance(kw, dict) for kw in kwarg_mbs):
            raise ConfigError("kwarg_mbs= is invalid: each micro-batch's keyword inputs are a dict")
        if arg_mbs is not None and not all(isinstance(args, tuple) for args in arg_mbs):
            raise ConfigError("arg_mbs= is invalid: each micro-batch's positional inputs are a tuple (torchtitan: "
                              "(tokens,))")
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise ConfigError(f"loss_kwargs={type(loss_kwargs).__name__} is invalid: a dict of loss_fn keywords")
        if st.is_first and arg_mbs is None:
            raise ConfigError("arg_mbs=None is invalid on stage 0: the first stage's module needs each micro-batch's "
                              "inputs")
        if st.is_last and target_mbs is None:
            raise ConfigError(f"target_mbs=None is invalid on stage {st.stage_index}: the last stage's loss needs each "
                              "micro-batch's target")
        return MicroBatches(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs)

    def drain(self) -> None:
        """Leaves no micro-batch in flight and no send pending ([Note: the step contract]).

        The forwards this stage ran beyond its last finished update (at most N − 1 − stage) are discarded,
        and the one activation the previous stage sent beyond them is received and dropped; the next
        ``step()`` forwards those micro-batches again on the updated weights (unbubble's checkpoint cut).
        Every rank must call it (after the same number of ``step()`` calls). Cost: the discarded forwards.
        """
        st, state = self._pp_stage, self._state
        if self._owed:  # the previous stage read one micro-batch further ahead than this one and sent it
            self._recv_forward(state.n_fwd)
            self._owed = False
        for k in range(state.n_bwd, state.n_fwd):
            _torch_private.drop_forward(st, k % self._slots)
            self._fwd_version.pop(k, None)
            self._loss.pop(k, None)
        state.n_fwd, state.in_flight = state.n_bwd, 0
        state.bwd_ready.clear()
        for kind in self._sends:
            self._wait(kind)

    def eval(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """A forward-only pass of one batch through the pipeline on a drained schedule (torch's ``eval`` signature).

        The batch splits into ``n_microbatches`` micro-batches as the training batches do ([Note: how a batch is
        split]); each runs forward on every stage in turn under ``torch.no_grad()``, on the weights of the last
        update the loop applied, and nothing stays in flight (no gradient, no update, ``steps`` unchanged). Every
        rank calls it: the first stage with the inputs, the last with ``target``, the others with nothing. Its
        shapes may differ from the training batches' ([Note: changing shapes on torch's stage]).

        Args:
            args, kwargs: on the first stage, the batch's inputs as the data iterator gives them, as one positional
                argument, or a dict of inputs as keyword arguments (torchtitan's ``eval(**input_dict)``): either way
                the module gets them as one argument ([Note: how a batch is split]); every tensor leaf has m·B rows
                along dim 0.
            target: on the last stage, the batch's targets (needed for ``losses``).
            losses: on the last stage, cleared and filled with the m micro-batch losses (``loss_fn``'s values,
                0-dim tensors, oldest first) when ``target`` is given.

        Returns:
            On the last stage the m outputs merged (each tensor leaf concatenated along dim 0, 0-dim leaves stacked;
            other leaves from the first), else ``None``.

        Raises:
            RuntimeError: before the first ``step()``, or with micro-batches in flight (call :meth:`drain` on every
                rank first: it moves the checkpoint cut, so it is the training loop's choice).
            ConfigError: a batch tensor whose dim 0 is not a multiple of m, inputs given as several positional
                arguments or as both, or pre-split micro-batches (``arg_mbs=``, ``kwarg_mbs=``, ``target_mbs=``,
                ``loss_kwargs=``: a later torch's ``eval``).
        """
        st = self._pp_stage
        presplit = [k for k in ("arg_mbs", "kwarg_mbs", "target_mbs", "loss_kwargs") if k in kwargs]
        if presplit:
            raise ConfigError(f"{', '.join(presplit)}= is invalid for SchedulePACI.eval: it takes torch 2.13's eval(*args, "
                              "target=, losses=) with the whole batch (split into n_microbatches as in training)")
        if not self._initialized:
            raise RuntimeError(f"SchedulePACI.eval() on stage {st.stage_index} before the first step(): torch's stage "
                               "buffers are made there; until then evaluate the model parts directly")
        if self.in_flight or self._owed:
            raise RuntimeError(f"SchedulePACI.eval() on stage {st.stage_index} with {self.in_flight} micro-batches in "
                               "flight: call drain() on every rank first (eval uses the same receive buffers)")
        if len(args) + bool(kwargs) > 1:
            raise ConfigError(f"{len(args)} positional and {len(kwargs)} keyword inputs are invalid for "
                              "SchedulePACI.eval: give the batch's inputs as one argument, as the data iterator gives "
                              "them, or a dict of inputs as keyword arguments")
        inputs = dict(kwargs) if kwargs else args[0] if args else None
        batch = self._split((inputs, target if st.is_last else None))
        input_mbs, target_mbs = batch.inputs, batch.targets
        outputs, values = [], []
        with torch.no_grad():
            for j in range(self.m):
                slot = j % self._slots
                if not st.is_first:
                    self._recv_forward(j, batch="eval")
                out = _torch_private.forward(st, slot, self._first_args(input_mbs[j]) if st.is_first else (), {})
                if st.is_last:
                    outputs.append(self._rebuild(out))
                    if target_mbs is not None:
                        values.append(self._user_loss(outputs[-1], target_mbs[j]).detach())
                else:
                    self._send_forward(j, slot, out, batch="eval")
                _torch_private.drop_forward(st, slot)
        self._wait("fwd")
        self._send_shapes.pop("eval", None)
        self._recv_shapes.pop("eval", None)
        if st.is_last and losses is not None and target_mbs is not None:
            losses.clear()
            losses.extend(values)
        return _merge(outputs) if st.is_last else None

    # -- actions --------------------------------------------------------------------------------------
    def _initialize(self) -> None:
        st, k = self._pp_stage, self._state.n_fwd
        args = self._first_args(self._inputs(k)) if st.is_first else ()
        target = self._target(k) if st.is_last else None
        # every stage forwards the layout of its output with torch's inference metadata (a plain stage: None)
        _torch_private.carry_layouts(st, self._tree)
        _torch_private.initialize_stage(self, args, self._kwargs(k), target, self._rebuild)
        self._hooks = SavedByReference(st.submod.parameters())
        self._initialized = True
        # torch made every slot's buffers for micro-batch k's shapes: those of its batch on both sides
        if not st.is_first:
            self._recv_shapes[k // self.m] = _torch_private.act_recv_shapes(st, 0)

    def _forward(self, k: int) -> None:
        st, slot = self._pp_stage, k % self._slots
        args = self._first_args(self._inputs(k)) if st.is_first else ()
        if not st.is_first:
            self._recv_forward(k)
        with self._hooks():
            out = _torch_private.forward(st, slot, args, self._kwargs(k))
            if st.is_last:
                loss = self._user_loss(self._rebuild(out), self._target(k), **self._batch_of(k).loss_kwargs)
                self._loss[k] = (loss if self._scale is None else loss * self._scale, loss.detach())
        if not st.is_last:
            self._send_forward(k, slot, out)
        self._fwd_version[k] = self._state.version

    def _backward(self, k: int, last: bool) -> list[torch.Tensor]:
        """Backward of micro-batch k; ``last``: the update's a-th (DDP all-reduces in it)."""
        st, slot = self._pp_stage, k % self._slots
        if not st.is_last:
            self._recv(st.get_bwd_recv_ops(slot))
        scaled, value = self._loss.pop(k) if st.is_last else (None, None)
        _torch_private.backward(st, slot, scaled, last)
        if not st.is_first:
            self._send("bwd", st.get_bwd_send_ops(slot))
        self.drift[self._state.version - self._fwd_version.pop(k)] += 1
        done = [b for b in set(self._batches) | set(self._send_shapes) | set(self._recv_shapes)
                if isinstance(b, int) and (b + 1) * self.m <= k + 1]
        for b in done:  # every micro-batch of batch b is done (a drain re-forwards only later ones)
            self._batches.pop(b, None)
            self._send_shapes.pop(b, None)
            self._recv_shapes.pop(b, None)
        return [] if value is None else [value]

    # [Note: changing shapes on torch's stage]
    # torch's PipelineStage makes its receive buffers once, from the first micro-batch's shapes, and gloo refuses a
    # message of another size ("Received data size doesn't match expected size"). SchedulePACI lets every batch have
    # its own shapes (sequence length, micro-batch size): each non-last stage sends the next one the shapes of its
    # outputs with the first micro-batch of every batch (one small object per batch and boundary, through torch's
    # metadata send, before the activation), and a stage re-makes a slot's activation receive buffers when the
    # micro-batch it receives there belongs to a batch of other shapes; the sender re-makes the slot's gradient
    # receive buffers likewise. A slot is reused only after its previous micro-batch's backward, so the
    # micro-batches in flight keep their buffers and stay exact (PACI's read-ahead crosses batches of different
    # shapes). The micro-batches of one batch must share their boundary shapes: one that differs is refused in one
    # line before it is sent. Shapes are kept per batch until its last backward, so a drain's re-forwards and
    # eval() (which announces its own batch) find them.
    def _send_forward(self, k: int, slot: int, out: Any, batch: Any = None) -> None:
        st = self._pp_stage
        b = k // self.m if batch is None else batch
        leaves = out if isinstance(out, tuple) else (out,)
        shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in leaves)
        ops = st.get_fwd_send_ops(slot)
        if k % self.m == 0:  # the announcement travels in the same batch of sends, before the activation
            ops = [_torch_private.shapes_op(st, shapes)[0], *ops]
            self._send_shapes[b] = shapes
        elif self._send_shapes.setdefault(b, shapes) != shapes:
            raise ConfigError(f"micro-batch {k} of batch {b} has boundary shapes {shapes} on stage {st.stage_index}, "
                              f"micro-batch {b * self.m if isinstance(b, int) else 0}'s are {self._send_shapes[b]}: "
                              "the micro-batches of one batch must share their shapes (a new shape starts a new batch)")
        _torch_private.fit_grad_recv(st, slot, shapes)
        self._send("fwd", ops)

    def _recv_forward(self, k: int, batch: Any = None) -> None:
        st, slot = self._pp_stage, k % self._slots
        b = k // self.m if batch is None else batch
        if k % self.m == 0:
            op, buf = _torch_private.shapes_op(st, None)
            self._recv([op])
            self._recv_shapes[b] = _decode_shapes(buf)
        if b in self._recv_shapes:
            _torch_private.fit_act_recv(st, slot, self._recv_shapes[b])
        self._recv(st.get_fwd_recv_ops(slot))

    # -- point to point -------------------------------------------------------------------------------
    @staticmethod
    def _recv(ops: list) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _send(self, kind: str, ops: list) -> None:
        """Starts ``ops`` after the previous send of the same direction has completed (one pending per
        direction; the receiver posts its receives in the same order, so this never deadlocks)."""
        self._wait(kind)
        if ops:
            self._sends[kind] = [dist.batch_isend_irecv(ops), ops]  # the ops keep the tensors alive

    def _wait(self, kind: str) -> None:
        if self._sends[kind]:
            for work in self._sends[kind][0]:
                work.wait()
            self._sends[kind] = []

    # -- data -----------------------------------------------------------------------------------------
    def _batch_of(self, k: int) -> _Batch:
        """Micro-batch k's batch, read from the iterator or the pre-split queue as far as needed."""
        b = k // self.m
        while self._next_batch <= b:
            if self._presplit:
                if not self._queue:  # pragma: no cover - step() stops forwards at the batches given
                    raise RuntimeError(f"stage {self._pp_stage.stage_index} needs micro-batch {k}, not given yet")
                item = self._queue.popleft()
            elif self._data is None:  # a middle stage without the iterator: no keyword inputs
                item = MicroBatches()
            else:
                try:
                    item = next(self._data)
                except StopIteration:
                    raise RuntimeError(f"the data iterator ran out at batch {self._next_batch} (micro-batch {k}) on "
                                       f"stage {self._pp_stage.stage_index}: PACI's first stage reads up to N−1 = "
                                       f"{self._pp_stage.num_stages - 1} micro-batches ahead of its update; give it "
                                       "more batches or an endless iterator") from None
            self._batches[self._next_batch] = self._split(item)
            self._next_batch += 1
        if b not in self._batches:  # pragma: no cover - a batch is kept until its last backward
            raise RuntimeError(f"batch {b} of micro-batch {k} is no longer held on stage {self._pp_stage.stage_index}")
        return self._batches[b]

    def _split(self, item: Any) -> _Batch:
        """The batch's m micro-batches ([Note: how a batch is split]); a :class:`MicroBatches` as it is."""
        st = self._pp_stage
        if isinstance(item, MicroBatches):
            if item.arg_mbs is None and st.is_first and (item.kwarg_mbs is not None or item.target_mbs is not None):
                raise ConfigError("a MicroBatches without arg_mbs is invalid on stage 0: the first stage's module needs "
                                  "each micro-batch's inputs")
            item = self._check_presplit(*item) if item != MicroBatches() else item
            inputs = [None] * self.m if item.arg_mbs is None else [_Args(args) for args in item.arg_mbs]
            kwargs = [{}] * self.m if item.kwarg_mbs is None else list(item.kwarg_mbs)
            return _Batch(inputs, kwargs, item.target_mbs if st.is_last else None, dict(item.loss_kwargs or {}))
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(f"a batch of type {type(item).__name__} is invalid: the data iterator must yield "
                              "(inputs, target) pairs or MicroBatches")
        inputs, target = item
        if st.is_first and self._tree is None and not isinstance(inputs, torch.Tensor):
            raise ConfigError(f"inputs of type {type(inputs).__name__} are invalid on stage 0 without TreeStage: a first "
                              "stage's module gets the batch's inputs as one argument, module(inputs) (docs/"
                              "pipelining.md), and torch's PipelineStage passes it tensors only; wrap the stage module "
                              "in TreeStage, or give the inputs as one tensor")
        mbs = _chunk(inputs, self.m, "inputs") if st.is_first else [None] * self.m
        targets = None if target is None or not st.is_last else _chunk(target, self.m, "target")
        return _Batch(mbs, [{}] * self.m, targets, {})

    def _inputs(self, k: int) -> Any:
        return self._batch_of(k).inputs[k % self.m]

    def _kwargs(self, k: int) -> dict:
        st = self._pp_stage
        if not (st.is_first or st.is_last or self._presplit or self._data is not None):
            return {}
        return self._batch_of(k).kwargs[k % self.m]

    def _first_args(self, inputs: Any) -> tuple:
        """What torch's stage passes the first stage's module for one micro-batch's ``inputs``: the tensor, or a
        TreeStage's tensor leaves, whose layout the TreeStage rebuilds the inputs from ([Note: how a batch is
        split]); a pre-split micro-batch's positional inputs as they are (one, the inputs, with a TreeStage)."""
        if isinstance(inputs, _Args):
            if self._tree is None:
                return tuple(inputs)
            if len(inputs) != 1:
                raise ConfigError(f"arg_mbs entries of {len(inputs)} inputs are invalid with TreeStage: its module gets "
                                  "one argument, give (inputs,)")
            inputs = inputs[0]
        if self._tree is None:
            return (inputs,)
        leaves, self._tree.in_layout = flatten(inputs)
        return tuple(leaves)

    def _target(self, k: int) -> Any:
        targets = self._batch_of(k).targets
        if targets is None:
            raise ConfigError("target=None is invalid on the last stage: the data iterator's batches must carry "
                              "the targets the loss needs")
        return targets[k % self.m]

    def _step_microbatches(self, *args, **kwargs):  # the abstract method of torch's base class: unused
        raise NotImplementedError("SchedulePACI runs through step(data_iterator); it has no per-batch "
                                  "_step_microbatches")


def clip_grad_norm_pp(parameters: Iterable[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None,
                      norm_type: float = 2.0) -> torch.Tensor:
    """Clips the gradients of this rank's stage by the norm over the whole pipeline (torchtitan's PP clipping).

    Call it after ``SchedulePACI.step()`` on every rank: each rank then holds the gradients of the same
    update, so the global norm is that update's. One all-reduce of a scalar: every rank waits for the
    slowest to finish its a-th backward (the cost ``unbubble bench`` measures). Its result is also the global
    non-finite check (``torch.isfinite(norm)``).

    With a data-parallel stage ([Note: data parallelism inside a stage]) the gradients are already the replicas'
    mean (DDP) or its shards (FSDP2, whose norm is gathered over the data-parallel group first), so every
    replica clips by the same norm.

    Args:
        parameters: this stage's parameters (their ``.grad``; FSDP2's DTensors included).
        max_norm: largest allowed total norm.
        group: the pipeline's process group (default: the world).
        norm_type: p of the p-norm (finite).

    Returns:
        The total norm over all stages before clipping, a 0-dim tensor (the same value on every rank).

    Source: the PP branch of torchtitan's ``dist_utils.clip_grad_norm_`` (all-reduce of the p-th power of the
    local norms over the pipeline group), with ``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_``.
    """
    params = [p for p in parameters if p.grad is not None]
    local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type) if params else torch.zeros(())
    if isinstance(local, DTensor):  # FSDP2's sharded gradients: the stage's norm over its shards (as torchtitan)
        local = local.full_tensor()
    total = local.double() ** norm_type
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    total = (total ** (1.0 / norm_type)).to(local.dtype)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def split_torchtitan_model(model: nn.Module, stage: int, n_stages: int,
                           layers_per_stage: list[int] | None = None) -> nn.Module:
    """Prunes a torchtitan-layout model, in place, to what ``stage`` owns in ``split_model``'s plan.

    The model has ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict`` keyed by the original index),
    ``norm`` and ``lm_head`` (torchtitan 0.3.0's ``Decoder``: Llama3, Qwen3, DeepSeek-V3, gpt-oss; ``output`` before
    0.3.0), and its ``forward`` skips the parts that are ``None`` (``h =
    self.tok_embeddings(tokens) if self.tok_embeddings else tokens``), as torchtitan's models do. The cuts are
    :func:`unbubble.models.split.plan_split`'s, the ones ``split_model`` and ``train_model`` make of the same
    model: stage 0 keeps the embeddings, the last stage the norm and the output, the layers are cut contiguously,
    balanced by parameter count (fewer layers on earlier stages where counts tie); the pruning is
    :func:`unbubble.models.split.prune` on the model itself (one process builds one stage; torchtitan builds it on
    the meta device). The remaining parameters keep their fully-qualified names, so checkpoints merge into the
    whole model's.

    Args:
        model: the whole model (on any device, ``meta`` included).
        stage: 0-based stage index.
        n_stages: N ≥ 1.
        layers_per_stage: layers of each stage (each ≥ 1, summing to the model's); default ``plan_split``'s.

    Returns:
        ``model`` itself, pruned.

    Raises:
        ConfigError: the model lacks the layout, has multi-token prediction layers, ``stage`` is out of range, more stages than layers,
            ``layers_per_stage`` that does not fit, or a weight tied across two stages (each rank would train
            its own copy; untie it in the model).
    """
    from unbubble.models.split import plan_split, prune, tied_across_stages

    head = "lm_head" if hasattr(model, "lm_head") else "output"  # torchtitan ≥ 0.3.0: lm_head; before: output
    for name in ("tok_embeddings", "layers", "norm", head):
        if not hasattr(model, name):
            raise ConfigError(f"model={type(model).__name__} is invalid: a torchtitan-layout model has "
                              f"tok_embeddings, layers (nn.ModuleDict), norm and lm_head (output before torchtitan "
                              f"0.3.0); it lacks {name}")
    if getattr(model, "mtp_layers", None) is not None:
        raise ConfigError(f"model={type(model).__name__} with multi-token prediction layers (mtp_layers) is invalid: "
                          "they read the first stage's embeddings and the last stage's head, which asynchronous stages "
                          "cannot share; build it without MTP (mtp_layers empty)")
    if not isinstance(model.layers, nn.ModuleDict):
        raise ConfigError(f"model.layers={type(model.layers).__name__} is invalid: it must be an nn.ModuleDict keyed "
                          "by layer index (torchtitan's layout), so pruned stages keep the original names")
    check_int("n_stages", n_stages, 1, "pipeline stages")
    check_int("stage", stage, 0, f"n_stages={n_stages}", n_stages - 1, valid=f"must be in 0 … {n_stages - 1}")
    n_layers = len(model.layers)
    cuts = None
    if layers_per_stage is None:
        if n_stages > n_layers:
            raise ConfigError(f"n_stages={n_stages} is invalid: the model has {n_layers} layers, at most one stage "
                              "per layer")
    elif len(layers_per_stage) != n_stages or sum(layers_per_stage) != n_layers or min(layers_per_stage) < 1:
        raise ConfigError(f"layers_per_stage={layers_per_stage} is invalid: {n_stages} counts ≥ 1 that sum to the "
                          f"model's {n_layers} layers")
    else:
        cuts = list(itertools.accumulate(layers_per_stage))[:-1]
    plan = plan_split(model, n_stages, cuts)
    for a, b, sa, sb in tied_across_stages(model, plan):
        raise ConfigError(f"{a} (stage {sa}) and {b} (stage {sb}) are one tied tensor on two stages, which "
                          "asynchronous stages cannot share: untie them in the model")
    return prune(model, plan.names[stage], in_place=True)


def pipeline_paci(model: nn.Module, *, device: torch.device, loss_fn: LossFn, n_microbatches: int,
                  a: int | None = None, group: dist.ProcessGroup | None = None,
                  layers_per_stage: list[int] | None = None,
                  parallelize: Callable[[nn.Module], nn.Module] | None = None,
                  flush: bool = False) -> tuple[SchedulePACI, list[nn.Module], bool, bool]:
    """A torchtitan ``pipelining_fn``-style factory: this rank's stage of ``model`` under :class:`SchedulePACI`.

    Args:
        model: a torchtitan-layout model, pruned in place to this rank's stage by :func:`split_torchtitan_model`
            (``split_model``'s cuts, as ``train_model`` makes them).
        device: where the stage runs.
        loss_fn: ``loss_fn(logits, labels) -> scalar`` mean loss.
        n_microbatches: m, micro-batches per batch of the data iterator.
        a: PACI's accumulation factor (default m).
        group: the pipeline's process group (torchtitan: ``parallel_dims.get_mesh("pp").get_group()``);
            default the world. Rank r of the group runs stage r.
        layers_per_stage: as in :func:`split_torchtitan_model`.
        parallelize: applied to the pruned part before it is wrapped (torchtitan's ``parallelize_fn``:
            activation checkpointing, compile, ``fully_shard`` or DDP over the data-parallel group, [Note: data
            parallelism inside a stage]; tensor parallelism is untested).
        flush: see :class:`SchedulePACI`.

    Returns:
        ``(schedule, [model_part], has_first_stage, has_last_stage)``, torchtitan's ``pipeline_llm`` shape.

    Raises:
        ConfigError: as :func:`split_torchtitan_model` and :class:`SchedulePACI`.
    """
    rank, n_ranks = dist.get_rank(group), dist.get_world_size(group)
    part = split_torchtitan_model(model, rank, n_ranks, layers_per_stage)
    if parallelize is not None:
        part = parallelize(part)
    stage = PipelineStage(part, rank, n_ranks, device, group=group)
    schedule = SchedulePACI(stage, n_microbatches, loss_fn, a=a, flush=flush)
    return schedule, [part], rank == 0, rank == n_ranks - 1


def get_schedule_class(schedule_name: str) -> type:
    """torch's ``get_schedule_class`` with ``"PACI"`` (any case) added: :class:`SchedulePACI`.

    torchtitan looks its ``parallelism.pipeline_parallel_schedule`` up with torch's function, whose table is
    closed; this one answers ``"PACI"`` and passes every other name to torch's.

    Raises:
        ConfigError: a name neither ``"PACI"`` nor one of torch's (naming both).
    """
    if isinstance(schedule_name, str) and schedule_name.lower() == "paci":
        return SchedulePACI
    try:
        return _torch_schedule_class(schedule_name)
    except ValueError as exc:
        raise ConfigError(f"pipeline_parallel_schedule={schedule_name!r} is invalid: 'PACI' (unbubble) or one of "
                          f"torch's ({exc})") from None


def build_pipeline_schedule(*, parallelism: Any, local_batch_size: int, stages: list[PipelineStage], loss_fn: Callable,
                            backward_requires_autograd: bool = True, a: int | None = None, scale_grads: bool = False,
                            loss_kwargs: dict[str, Any] | None = None, fallback: Callable[..., Any] | None = None) -> Any:
    """A drop-in for torchtitan 0.3.0's ``_build_pipeline_schedule`` (``torchtitan/distributed/pipeline_parallel.py``,
    which its ``pipeline_llm`` calls with these keywords) that also builds PACI.

    m = ``local_batch_size // parallelism.pipeline_parallel_microbatch_size``, as torchtitan computes it. With
    ``parallelism.pipeline_parallel_schedule == "PACI"`` (any case) it returns ``SchedulePACI(stages[0],
    n_microbatches=m, loss_fn=…, a=a, scale_grads=scale_grads)``. Any other name goes to ``fallback`` (torchtitan's
    own builder, called with torchtitan's keyword arguments) when given, else is built as torchtitan builds torch's
    schedules (single-stage or looped, ``scale_grads=False``). As in torchtitan, ``loss_fn`` may return ``(loss,
    metrics)`` (torchtitan's ``LossFunction``): the schedule gets the loss. Install it (and
    :func:`get_schedule_class`, which torchtitan's stage split calls) over torchtitan's before ``pipeline_llm`` runs;
    docs/pipelining.md has the lines. (torchtitan 0.1–0.2.x's ``build_pipeline_schedule(job_config, stages,
    loss_fn)`` is not taken.)

    Args:
        parallelism: torchtitan's ``ParallelismConfig`` (read: ``pipeline_parallel_schedule``,
            ``pipeline_parallel_microbatch_size``, ``pipeline_parallel_schedule_csv``).
        local_batch_size: samples per step on this data-parallel rank (torchtitan's ``training.local_batch_size``);
            a multiple of the micro-batch size.
        stages: this rank's stages (PACI: exactly one).
        loss_fn: ``loss_fn(output, target, **loss_kwargs) -> loss`` or ``-> (loss, metrics)``.
        backward_requires_autograd: torchtitan's flag for looped schedules (Graph PP); must be True for PACI.
        a: PACI's accumulation factor (default m: one update per torchtitan step).
        scale_grads: PACI only, :class:`SchedulePACI`'s: ``False`` (torchtitan's choice) backpropagates the loss as
            ``loss_fn`` returns it, so the update applies the sum of its a micro-batches' gradients and ``loss_fn``
            must normalise over the update (torchtitan's sum loss divided by the step's ``global_valid_tokens``,
            which its step passes per batch as ``loss_kwargs``); ``True`` multiplies each loss by 1/a.
        loss_kwargs: PACI only: keyword arguments for every ``loss_fn`` call (a batch's own ``loss_kwargs``, given to
            ``step()`` or in a :class:`MicroBatches`, add to them and win).
        fallback: the builder for every other schedule name (torchtitan's ``_build_pipeline_schedule``).

    Returns:
        The schedule (``SchedulePACI`` for ``"PACI"``).

    Raises:
        ConfigError: an unknown schedule name; a ``local_batch_size`` that is not a multiple of the micro-batch size;
            for PACI more than one stage on the rank, a CSV schedule, or ``backward_requires_autograd=False``; a CSV
            schedule without ``fallback``; as :class:`SchedulePACI`.

    Source: torchtitan 0.3.0 ``_build_pipeline_schedule`` (pytorch/torchtitan, PyPI ``torchtitan==0.3.0``).
    """
    name = parallelism.pipeline_parallel_schedule
    csv = getattr(parallelism, "pipeline_parallel_schedule_csv", None)
    mbs = getattr(parallelism, "pipeline_parallel_microbatch_size", 1)
    check_int("local_batch_size", local_batch_size, 1, "samples per step on this data-parallel rank")
    check_int("pipeline_parallel_microbatch_size", mbs, 1, "samples per micro-batch")
    if local_batch_size % mbs:
        raise ConfigError(f"local_batch_size={local_batch_size} is invalid with pipeline_parallel_microbatch_size="
                          f"{mbs}: a multiple of the micro-batch size (m = local_batch_size / micro-batch size)")
    num_microbatches = local_batch_size // mbs

    def scalar_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = loss_fn(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def paci_loss(output: Any, target: Any, **batch_kwargs: Any) -> torch.Tensor:
        return scalar_loss(output, target, **{**(loss_kwargs or {}), **batch_kwargs})

    if not (isinstance(name, str) and name.lower() == "paci"):
        if fallback is not None:
            return fallback(parallelism=parallelism, local_batch_size=local_batch_size, stages=stages, loss_fn=loss_fn,
                            backward_requires_autograd=backward_requires_autograd)
        if csv:
            raise ConfigError(f"pipeline_parallel_schedule_csv={csv!r} needs torchtitan's builder: pass "
                              "fallback=torchtitan's _build_pipeline_schedule")
        cls = get_schedule_class(name)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=num_microbatches, loss_fn=scalar_loss, scale_grads=False)
        return cls(stages, n_microbatches=num_microbatches, loss_fn=scalar_loss, scale_grads=False,
                   backward_requires_autograd=backward_requires_autograd)
    if len(stages) != 1:
        raise ConfigError(f"{len(stages)} stages on this rank are invalid for PACI: SchedulePACI runs one stage per "
                          "rank (pipeline_parallel_layers_per_stage must give one stage per rank)")
    if csv:
        raise ConfigError(f"pipeline_parallel_schedule_csv={csv!r} is invalid with PACI: PACI's order is decided "
                          "at run time by back-pressure; leave the CSV unset")
    if not backward_requires_autograd:
        raise ConfigError("backward_requires_autograd=False is invalid for PACI: SchedulePACI runs autograd "
                          "backwards (Graph PP is not supported)")
    return SchedulePACI(stages[0], n_microbatches=num_microbatches, loss_fn=paci_loss, a=a,
                        scale_grads=scale_grads)
