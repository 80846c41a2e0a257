"""Accelerator presets for the analytic cost model: peak compute, memory, links (SI units).

Every number carries its source. Peak FLOP/s are dense BF16 tensor-core figures (the data sheets
print the 2:4-sparsity figure, twice as large, beside them). Link bandwidths are one direction of one
GPU: NVLink's printed total is bidirectional, so it is halved; the inter-node figure is one NIC per GPU
as in NVIDIA's DGX systems.

``achievable`` is the fraction of peak that the compute of F/B/I/W reaches in practice. It scales
every compute duration, so it moves absolute throughput only: ratios between schedules (bubbles,
speed-ups) do not depend on it. The defaults are end-to-end model-FLOP utilisations published for
Megatron-LM GPT training on that hardware (they include some pipeline bubble, so they slightly
underestimate the compute-only fraction). Override with ``--achievable``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from unbubble.errors import ConfigError, check_int, did_you_mean

GB = 1e9  # data sheets use decimal units


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and how it is wired.

    Attributes:
        name: preset name.
        peak_flops: dense BF16 tensor-core peak (FLOP/s).
        achievable: fraction of ``peak_flops`` reached by F/B/I/W compute, in (0, 1].
        memory_bytes: device memory (bytes).
        hbm_bytes_per_s: device-memory bandwidth (bytes/s); the optimizer update is bound by it.
        intra_node_bytes_per_s: point-to-point bandwidth between GPUs of one node, one direction (bytes/s).
        inter_node_bytes_per_s: bandwidth between nodes per GPU, one direction (bytes/s).
        gpus_per_node: GPUs sharing a node (stage boundaries every this many ranks cross nodes).
        intra_latency_s, inter_latency_s: per-message latency (s); order-of-magnitude assumptions for
            NCCL point-to-point, not spec-sheet values.
        source: where the numbers come from.
    """

    name: str
    peak_flops: float
    achievable: float
    memory_bytes: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 1e-5
    source: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.achievable <= 1:
            raise ConfigError(f"achievable={self.achievable!r} is invalid: the fraction of peak must be in (0, 1] "
                              "(set --achievable)")
        for name in ("peak_flops", "memory_bytes", "hbm_bytes_per_s", "intra_node_bytes_per_s",
                     "inter_node_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be > 0")
        check_int("gpus_per_node", self.gpus_per_node)

    @property
    def flops(self) -> float:
        """Sustained FLOP/s assumed for compute: ``peak_flops * achievable``."""
        return self.peak_flops * self.achievable

    def link(self, rank_a: int, rank_b: int) -> tuple[float, float]:
        """``(latency_s, bytes_per_s)`` between two ranks (0-based); ranks ``r // gpus_per_node`` share a node."""
        if rank_a // self.gpus_per_node == rank_b // self.gpus_per_node:
            return self.intra_latency_s, self.intra_node_bytes_per_s
        return self.inter_latency_s, self.inter_node_bytes_per_s

    def with_(self, **changes) -> "Hardware":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_A100_SRC = ("NVIDIA A100 Tensor Core GPU data sheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): A100 80GB SXM "
             "BF16 312 TFLOPS dense, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (bidirectional); DGX A100 data sheet: "
             "8x 200 Gb/s HDR InfiniBand (one per GPU). achievable 0.52: Narayanan et al., Efficient Large-Scale "
             "Language Model Training on GPU Clusters Using Megatron-LM, arXiv 2104.04473, abstract and §5.1 "
             "(163 TFLOP/s per A100, 52% of peak)")
_H100_SRC = ("NVIDIA H100 Tensor Core GPU data sheet: H100 SXM BF16 1,979 TFLOPS with sparsity (989.5 dense), 80 GB "
             "HBM3 at 3.35 TB/s, NVLink 900 GB/s (bidirectional); DGX H100: 8x 400 Gb/s ConnectX-7 (NDR). achievable "
             "0.47: NVIDIA Megatron-Core performance summary, up to 47% MFU on H100 (GPT-3 175B)")
_H200_SRC = ("NVIDIA H200 Tensor Core GPU data sheet: H200 SXM BF16 1,979 TFLOPS with sparsity (989.5 dense), 141 GB "
             "HBM3e at 4.8 TB/s, NVLink 900 GB/s (bidirectional); DGX H200: 8x 400 Gb/s ConnectX-7. achievable 0.47: "
             "the H100's (same GH100 compute die; assumption)")

#: Name -> preset (``--hardware``).
HARDWARE: dict[str, Hardware] = {
    "a100-80g": Hardware("a100-80g", 312e12, 0.52, 80 * GB, 2039 * GB, 300 * GB, 25 * GB, source=_A100_SRC),
    "h100": Hardware("h100", 989.5e12, 0.47, 80 * GB, 3350 * GB, 450 * GB, 50 * GB, source=_H100_SRC),
    "h200": Hardware("h200", 989.5e12, 0.47, 141 * GB, 4800 * GB, 450 * GB, 50 * GB, source=_H200_SRC),
}


def get_hardware(name: str, achievable: float | None = None) -> Hardware:
    """A preset by name, optionally with another achievable fraction.

    Raises:
        ConfigError: unknown name (the message lists the presets) or ``achievable`` outside (0, 1].
    """
    key = name.lower()
    if key not in HARDWARE:
        raise ConfigError(f"hardware={name!r} is unknown{did_you_mean(name, HARDWARE)}: valid presets are {', '.join(HARDWARE)} (set --hardware)")
    hw = HARDWARE[key]
    return hw if achievable is None else hw.with_(achievable=achievable)
