"""Matrix products inside the fused Pallas kernels (kernels.qkv, kernels.swiglu), and the
precision their XLA backwards run at."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

# Pallas' Triton lowering turns a float32 dot of DEFAULT precision into TF32: HIGHEST keeps
# float32 products IEEE (bfloat16 operands are unaffected).
HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def dot(a, b):  # [m, k] @ [k, n] -> [m, n] float32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


def backward_precision(dtype):
    """The context a kernel's XLA backward runs in: HIGHEST for float32, as
    models.config.matmul_precision gives the forward (a custom VJP's backward is traced
    outside that context), JAX's default otherwise."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def token_block(tokens: int, block_m: int) -> int:
    """The token block: block_m halved until it divides `tokens` (a multiple of 16)."""
    bm = block_m
    while tokens % bm:
        bm //= 2
    return bm
