"""Accelerators and clusters: the published per-device numbers the roofline needs.

Peak numbers are vendor datasheet values (dense BF16, no sparsity). What a real kernel
achieves of them is an *efficiency* in `jaxspec.sim.assumptions.Assumptions`, never here.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPU", "Cluster", "GPUS", "get_gpu"]


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator: compute, memory and links, as published."""

    name: str
    peak_bf16_flops: float  # dense BF16 tensor-core FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float  # usable HBM capacity, bytes
    nvlink_bandwidth: float  # bytes/s per GPU per direction inside the NVLink domain
    nvlink_domain: int  # GPUs reachable over NVLink (8 for an HGX board, 72 for NVL72)
    scaleout_bandwidth: float  # bytes/s per GPU over the network (InfiniBand / Ethernet)
    gpus_per_node: int  # GPUs per host (what "a node" means in the paper's layouts)


_TB = 1e12
_GB = 1e9

GPUS: dict[str, GPU] = {
    # GB200 NVL72: 180 PF dense BF16, 13.4 TB HBM3e and 576 TB/s over 72 GPUs; NVLink 5
    # 1.8 TB/s bidirectional per GPU; a compute tray (node) holds 4 GPUs; 800 Gb/s NIC each.
    "GB200": GPU("GB200", 2.5e15, 8.0 * _TB, 186 * _GB, 900 * _GB, 72, 100 * _GB, 4),
    # H200 SXM: 989 TF dense BF16, 141 GB HBM3e at 4.8 TB/s; NVLink 4 900 GB/s bidirectional;
    # HGX board of 8; 400 Gb/s NIC per GPU.
    "H200": GPU("H200", 989e12, 4.8 * _TB, 141 * _GB, 450 * _GB, 8, 50 * _GB, 8),
    # H100 SXM: 989 TF dense BF16, 80 GB HBM3 at 3.35 TB/s; NVLink 4; HGX board of 8.
    "H100": GPU("H100", 989e12, 3.35 * _TB, 80 * _GB, 450 * _GB, 8, 50 * _GB, 8),
}


def get_gpu(name: str) -> GPU:
    """The preset named `name` (case-insensitive)."""
    key = name.upper()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[key]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`num_gpus` identical GPUs."""

    gpu: GPU
    num_gpus: int

    def __post_init__(self):
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
