"""The platform a program is built for: JAX's backend, or a GPU being compiled for from here.

The library's backend-dependent choices (the attention backend under "auto", whether
decoding unrolls the layers, whether the KV cache grows) ask `platform()`, not
`jax.default_backend()`. Compiling for a GPU target on a machine without one
(`jaxspec.gpu_targets`) runs inside `target_platform("gpu")`, so that those choices are the
GPU's, as they would be on the GPU itself.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

PLATFORMS = ("cpu", "gpu", "tpu")

# XLA options the decoding programs compile with on a GPU (`compiler_options`).
# xla_gpu_memory_limit_slop_factor: the limit XLA's rematerialization pass works to, in
# percent of its default base (default 95). Its live-memory estimate counts a donated
# argument twice (as the argument and as the output aliased to it): a Qwen3-8B decode step
# at batch 64 over a 2k cache (19.3 GB of KV) was estimated at 54 GiB against an H100 limit
# of 46.9 GiB, although the compiled program needs 36 GB, and XLA recomputed the fused
# q/k/v projections to get under it (reading their weights twice: 1.187x the HBM floor
# instead of 1.126x; docs/results/gpu_programs.json). Doubling the limit leaves room for
# the double-counted KV cache, whose real size is bounded by the device's memory.
# xla_disable_hlo_passes=dot-strength-reduction: at one row XLA rewrites a vector-matrix
# product into a multiply and a reduction, and for some shapes (the Qwen3-30B-A3B attention
# projections on an H200) leaves the two unfused, writing and re-reading the product: the
# MoE decode step at batch 1 read 1.54x its floor with it and 1.01x without it, and no
# other inspected program moves (docs/BENCHMARKS.md, MoE). Compiled, not yet timed.
# xla_gpu_experimental_force_split_k=1: without autotuning XLA splits the contraction of a
# compute-bound matmul (e.g. 256 tokens x 4096 -> 4096: split 2) and writes float32 partial
# sums that a second kernel reads back and adds. The hybrid verify k = 3 at batch 64
# (Qwen3.5-9B shape, H100) read 33.79 GB with it and 32.52 GB (1.188x its floor) without.
# Compiled, not yet timed (a split can add parallelism to a small matmul on the device).
GPU_COMPILER_OPTIONS = {"xla_gpu_memory_limit_slop_factor": "200",
                        "xla_disable_hlo_passes": "dot-strength-reduction",
                        "xla_gpu_experimental_force_split_k": "1"}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxspec_target_platform", default=None)


def platform() -> str:
    """"cpu", "gpu" (CUDA and ROCm) or "tpu": the target set by `target_platform`, else
    JAX's default backend."""
    target = _TARGET.get()
    return jax.default_backend() if target is None else target


def compiler_options() -> dict[str, str]:
    """The XLA compile options of the decoding programs on the target platform
    (`GPU_COMPILER_OPTIONS` when it is "gpu", else none): the engine's jits and the GPU
    inspector (jaxspec.gpu_targets) compile with exactly these."""
    return dict(GPU_COMPILER_OPTIONS) if platform() == "gpu" else {}


@contextlib.contextmanager
def target_platform(name: str):
    """Builds programs for `name` ("cpu", "gpu" or "tpu") inside the block, whatever backend
    runs here.

    JAX reuses traced functions from its caches without asking which platform they were
    traced for, so the caches are cleared on entering and on leaving a block whose platform
    differs from the current one (every jitted function traces again afterwards: this is
    for compile-only tools such as scripts/inspect_gpu.py, not for a training loop).
    """
    if name not in PLATFORMS:
        raise ValueError(f"target_platform({name!r}): unknown platform; valid: "
                         + ", ".join(repr(p) for p in PLATFORMS))
    changes = name != platform()
    if changes:
        jax.clear_caches()
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)
        if changes:
            jax.clear_caches()


def fused_kernel_applies(choice: str, fits: bool) -> bool:
    """Whether a layer uses one of its fused Pallas kernels (kernels.qkv, kernels.swiglu) for
    ModelConfig.fused_kernels `choice`: only under "pallas", where the sizes are the kernel's
    whole tiles (`fits`). "auto" keeps XLA on every platform: timed on a GPU, the kernels lose
    to XLA's autotuned matmuls at the verify sizes they were built for (docs/kernels.md)."""
    return choice == "pallas" and fits
