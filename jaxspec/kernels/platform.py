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

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxspec_target_platform", default=None)


def platform() -> str:
    """"cpu", "gpu" (CUDA and ROCm) or "tpu": the target set by `target_platform`, else
    JAX's default backend."""
    target = _TARGET.get()
    return jax.default_backend() if target is None else target


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
