"""Numeric precision and activation recomputation of a stage: what each mode computes and holds.

``fp32``, ``bf16`` (bf16 parameters stepped in place from fp32 masters), ``bf16-autocast`` and full
recomputation differ in which weights a backward uses and what a micro-batch in flight holds: [Note:
precision and version semantics] in docs/architecture.md#precision-and-recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from unbubble.errors import ConfigError, did_you_mean

#: ``--precision``: fp32; bf16 compute with fp32 weights (autocast); bf16 weights with an fp32 master copy.
PRECISIONS = ("fp32", "bf16-autocast", "bf16")
#: ``--recompute``: keep the forward's activations, or only the stage's input (recompute before the backward).
RECOMPUTE = ("none", "full")


def check_modes(precision: str, recompute: str, device: torch.device | None = None) -> None:
    """Refuses an unknown mode, or bf16 on a device without bf16 support, in one line.

    Args:
        precision: one of :data:`PRECISIONS`.
        recompute: one of :data:`RECOMPUTE`.
        device: the stage's device (``None``: the CPU).

    Raises:
        ConfigError: naming the value and what is valid.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is invalid{did_you_mean(precision, PRECISIONS)}: must be one of {', '.join(PRECISIONS)} "
                          "(set --precision)")
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={recompute!r} is invalid{did_you_mean(recompute, RECOMPUTE)}: must be one of {', '.join(RECOMPUTE)} "
                          "(set --recompute)")
    if precision != "fp32" and device is not None and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision={precision!r} needs bf16, which {torch.cuda.get_device_name(device)} does not "
                          "support (compute capability < 8.0): use --precision fp32")


#: /proc/cpuinfo flags of native bf16 arithmetic: AVX512-BF16 and AMX (x86), FEAT_BF16 (Arm).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes in bf16 natively, or ``None`` when it cannot tell (no /proc/cpuinfo).

    ``torch.backends.cpu.get_cpu_capability()`` cannot answer: it says ``"AVX512"`` with or
    without AVX512-BF16. PyTorch's own checks (``torch.cpu._is_avx512_bf16_supported``,
    ``_is_amx_tile_supported``, private) answer "yes" first; otherwise the flags of /proc/cpuinfo
    decide (:data:`BF16_CPU_FLAGS`).

    Args:
        cpuinfo: the text of /proc/cpuinfo (``None``: read it, and ask PyTorch first).
    """
    if cpuinfo is None:
        for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            if getattr(torch.cpu, check, lambda: False)():
                return True
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = {flag for line in cpuinfo.splitlines() if line.split(":")[0].strip() in ("flags", "Features")
             for flag in line.split(":", 1)[1].split()}
    return bool(flags & set(BF16_CPU_FLAGS))


def slow_bf16_warning(precision: str, device: str, native_bf16: bool | None) -> str | None:
    """The warning for bf16 on a CPU that emulates it, else ``None``.

    Without native bf16 every bf16 matrix product and element-wise op converts to fp32 and back.
    The README's ``unbubble train --precision bf16 --recompute full`` ran at 805 tokens/s
    against ≈ 5,200 in fp32 on such a CPU (6.5×); with oneDNN and ATen held to AVX2
    (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``) on a 2-core AVX512-BF16 machine, 910–1,235
    (bf16) and 964 (bf16-autocast) against 5,122–6,324 (4–7×, other jobs' load varying). Without
    those limits the same machine ran bf16 at 11,336 and fp32 at 11,779 tokens/s.

    Args:
        precision: one of :data:`PRECISIONS`.
        device: where the stages compute, ``"cpu"`` or ``"cuda"``.
        native_bf16: :func:`cpu_has_native_bf16` (``None``: unknown, no warning).
    """
    if precision == "fp32" or device != "cpu" or native_bf16 is not False:
        return None
    return (f"precision={precision!r} on a CPU without native bf16 (no {'/'.join(BF16_CPU_FLAGS)} flag): expect "
            "4–7× fewer tokens/s than fp32 (emulated bf16); use --precision fp32 here, or bf16 on a GPU")


def device_type(module: nn.Module) -> str:
    """``"cuda"`` or ``"cpu"``: where ``module``'s parameters live (autocast's device type)."""
    p = next(module.parameters(), None)
    return "cpu" if p is None else p.device.type


def compute_context(precision: str, device: str) -> contextlib.AbstractContextManager:
    """The context a forward runs in: ``torch.autocast(device, torch.bfloat16)`` for
    ``bf16-autocast``, nothing otherwise."""
    if precision == "bf16-autocast":
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_bf16(module: nn.Module) -> list[nn.Parameter]:
    """Makes ``module`` a bf16 module and returns fp32 master copies of its trainable parameters.

    The masters are new ``nn.Parameter`` leaves (the optimizer's parameters); the module's
    parameters and floating buffers become bf16 in place of the fp32 ones.

    Returns:
        One fp32 master per trainable parameter, in ``module.parameters()`` order (bit-equal to
        the fp32 weights before the cast).
    """
    masters = [nn.Parameter(p.detach().float().clone()) for p in module.parameters() if p.requires_grad]
    module.to(torch.bfloat16)
    return masters


def fold_grads(params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
    """Adds each bf16 parameter's ``.grad`` into its fp32 master's ``.grad`` and clears it
    (fp32 accumulation across the micro-batches of an update)."""
    for p, m in zip(params, masters):
        g = p.grad
        if g is None:
            continue
        if m.grad is None:
            m.grad = g.float()
        else:
            m.grad.add_(g)
        p.grad = None


def copy_masters(params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
    """Writes the fp32 masters into the bf16 parameters in place (round to nearest even).
    In-flight graphs, built under ``versions.SavedByReference``, then see the new weights (v_B)."""
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)


def rng_state(device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG state a forward starts from: CPU generator, and the current CUDA device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None


@contextlib.contextmanager
def replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Runs the block from a saved :func:`rng_state` and restores the RNG afterwards, so a
    recomputed forward draws its forward's dropout masks and the training stream moves on as if
    nothing ran."""
    cpu, cuda = state
    devices = [torch.cuda.current_device()] if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        yield


class SavedBytes:
    """Measures what autograd saves for backward inside the block (``torch.autograd.graph.saved_tensors_hooks``).

    Each saved tensor's storage is counted once. Storages of the stage's parameters and buffers
    are held by reference and cost nothing; a saved tensor reached from a parameter only through
    dtype casts and views (``grad_fn`` chain ToCopyBackward0 / TBackward0 / views → AccumulateGrad)
    is a **weight copy** (autocast's per-forward bf16 cast); everything else is an **activation**.
    Hooks already active around the block (a user's offloading, a test's counter) still run: the
    counter passes every tensor on to them (``torch._C._autograd._top_saved_tensors_default_hooks``).

    Attributes:
        activation_bytes: bytes of saved activation storages.
        weight_copy_bytes: bytes of saved weight copies.

    Args:
        module: the stage's module (its parameters and buffers are excluded).
        exclude: tensors already counted elsewhere (a recomputed forward's kept input).
        by_value: also count as a weight copy a saved tensor equal by value to a parameter (or its
            transpose) cast to its dtype. A compiled stage ([Note: compiled stages] in
            docs/architecture.md) saves tensors made inside one compiled function, with no per-op
            ``grad_fn`` chain to follow; this finds its copies instead (it compares each saved
            tensor with the parameters of its shape: meant for the one measured forward per shape).
    """

    _CAST_OR_VIEW = ("ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "ExpandBackward0",
                     "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0")

    def __init__(self, module: nn.Module, exclude: Sequence[torch.Tensor] = (), by_value: bool = False):
        self._by_value = [p.detach() for p in module.parameters()] if by_value else None
        self._shared = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers(), *exclude]}
        self._params = {id(p) for p in module.parameters()}
        self._seen: set[int] = set()
        self.activation_bytes = 0
        self.weight_copy_bytes = 0
        self._outer = None
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._shared and ptr not in self._seen:
            self._seen.add(ptr)
            if self._is_weight_copy(t):
                self.weight_copy_bytes += storage.nbytes()
            else:
                self.activation_bytes += storage.nbytes()
        return t if self._outer is None else self._outer[0](t)

    def _unpack(self, packed):
        return packed if self._outer is None else self._outer[1](packed)

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        return self._copy_by_grad_fn(t) or (self._by_value is not None and self._copy_by_value(t))

    def _copy_by_value(self, t: torch.Tensor) -> bool:
        if not t.is_floating_point() or t.requires_grad:  # a leaf passed in as weights (a stashed version)
            return False
        for p in self._by_value:
            for cand in (p, p.t()) if p.dim() == 2 else (p,):
                if cand.shape == t.shape and torch.equal(cand.to(t.dtype), t.detach()):
                    return True
        return False

    def _copy_by_grad_fn(self, t: torch.Tensor) -> bool:
        fn, cast = t.grad_fn, False
        for _ in range(4):
            if fn is None or type(fn).__name__ not in self._CAST_OR_VIEW:
                break
            cast |= type(fn).__name__ == "ToCopyBackward0"
            nxt = [f for f, _ in fn.next_functions if f is not None]
            if len(nxt) != 1:
                return False
            fn = nxt[0]
            if type(fn).__name__ == "AccumulateGrad":
                return cast and id(fn.variable) in self._params
        return False

    def __enter__(self) -> "SavedBytes":
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def tensor_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of ``tensors`` (``None`` entries skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
