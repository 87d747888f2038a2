"""GPU targets to compile for without a GPU: XLA target configs and their topologies.

XLA compiles a program for a CUDA GPU on any machine once jax's CUDA plugin is installed
(`pip install -e ".[gpu-aot]"`, ~3 GB of wheels; run with JAX_PLATFORMS=cpu
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1): `topology(target, devices)` describes N GPUs of one
kind from a `GpuTargetConfig` text proto (the files beside this module, written from each
GPU's published figures), `mesh(...)` lays a named mesh over them, and a jitted function
lowered with `lowering_platforms=("cuda",)` and compiled against arguments sharded on that
mesh is the program the GPU would run (`jaxspec.gpu_targets.inspect` reads it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import numpy as np

__all__ = ["TARGETS", "GpuTarget", "PluginMissingError", "check_plugin", "mesh",
           "plugin_installed", "target", "topology"]

_HERE = Path(__file__).parent
INSTALL_HINT = ('pip install -e ".[gpu-aot]"  (jax[cuda12] at the installed jax version, '
                '~3 GB), then run with JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1')


class PluginMissingError(RuntimeError):
    """jax's CUDA plugin is not importable here, so nothing can be compiled for a GPU."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU model: its XLA target config and the figures the inspector's floors use.

    Attributes:
        name: the CLI name ("h100", "h200", "gb200").
        description: the marketing name.
        config_file: the GpuTargetConfig text proto beside this module.
        hbm_bytes: device memory (bytes), as in the config.
        hbm_bandwidth: bytes per second, as in the config.
        bf16_flops: dense bf16 tensor-core peak (FLOP/s), NVIDIA's published figure.
        link_bandwidth: GPU-to-GPU bytes per second per direction (NVLink), what the
            inspector's collective times use (`jaxspec.gpu_targets.collectives`).
        link: the interconnect's name.
    """

    name: str
    description: str
    config_file: str
    hbm_bytes: int
    hbm_bandwidth: float
    bf16_flops: float
    link_bandwidth: float = 450e9
    link: str = "NVLink 4"

    @property
    def config_text(self) -> str:
        """The GpuTargetConfig text proto (comments stripped)."""
        lines = (_HERE / self.config_file).read_text().splitlines()
        return "\n".join(line for line in lines if not line.lstrip().startswith("#")) + "\n"

    @property
    def f32_flops(self) -> float:
        """Dense TF32 tensor-core peak (FLOP/s): f32 dots at XLA's default precision."""
        return F32_DOT_FLOPS[self.name]


# Dense TF32 tensor-core peaks (jaxspec.gpu_targets.estimate): H100 / H200 SXM 494.7 TFLOP/s
# (NVIDIA's H100 and H200 datasheets give 989 with sparsity); GB200 1.25 PFLOP/s per GPU
# (NVL72: 90 PF dense TF32 over 72 GPUs).
F32_DOT_FLOPS = {"h100": 494.7e12, "h200": 494.7e12, "gb200": 1.25e15}


# Dense bf16 peaks: H100/H200 SXM 989 TFLOP/s; GB200 2.5 PFLOP/s per GPU (NVL72: 180 PF
# dense bf16 over 72 GPUs). Memory and bandwidth match the config files (tested).
# Links, per GPU and direction (half NVIDIA's bidirectional figures): H100 / H200 SXM
# NVLink 4, 900 GB/s total (18 links x 50 GB/s) -> 450 GB/s; GB200 NVLink 5, 1.8 TB/s
# -> 900 GB/s, inside one NVL72 domain (up to 72 GPUs). NCCL's measured bus bandwidth is
# below these (all-reduce ~360-480 GB/s on H100 SXM): the times are lower bounds.
TARGETS = {
    "h100": GpuTarget("h100", "NVIDIA H100 SXM5 80GB", "h100.txtpb", 85_520_809_984, 3.35e12,
                      989e12, 450e9, "NVLink 4"),
    "h200": GpuTarget("h200", "NVIDIA H200 SXM 141GB", "h200.txtpb", 150_754_820_096, 4.8e12,
                      989e12, 450e9, "NVLink 4"),
    "gb200": GpuTarget("gb200", "NVIDIA GB200 (one Blackwell GPU)", "gb200.txtpb",
                       186_000_000_000, 8.0e12, 2.5e15, 900e9, "NVLink 5"),
}


def target(name: str) -> GpuTarget:
    """The target called `name`, or a ValueError naming the valid ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; valid: {', '.join(TARGETS)}")
    return TARGETS[name]


def plugin_installed() -> bool:
    """Whether jax's CUDA plugin (jax_plugins.xla_cuda12) is installed here."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def check_plugin() -> None:
    """Raises PluginMissingError (with how to install it) unless jax's CUDA plugin is
    installed, and sets the environment a GPU compile on a machine without one needs."""
    if not plugin_installed():
        raise PluginMissingError(f"jax's CUDA plugin (jax_plugins.xla_cuda12) is not "
                                 f"installed: {INSTALL_HINT}")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def topology(name: str, devices: int = 1):
    """`devices` GPUs of target `name` (one host, topology "1x1xN") as a jax TopologyDescription."""
    gpu = target(name)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}; must be a positive int")
    check_plugin()
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=gpu.config_text,
                                        topology=f"1x1x{devices}")


def mesh(name: str, shape: dict[str, int]):
    """A jax Mesh over prod(shape) GPUs of target `name`, axes named and sized as `shape`."""
    sizes = tuple(shape.values())
    topo = topology(name, int(np.prod(sizes)))
    from jax.experimental import topologies

    return topologies.make_mesh(topo, sizes, tuple(shape))
