"""Split-KV bookkeeping shared by the Pallas and Triton kernels.

For small batches a (batch, kv_head) grid leaves most of the GPU idle, so the
prefix is cut into `kv_splits` contiguous chunks handled by separate programs
(flash-decoding). Each program returns an unnormalised partial output with its
running max and denominator; `combine_splits` merges them exactly.
"""

from __future__ import annotations

import jax.numpy as jnp

# Programs a launch should have before splitting the prefix stops paying off:
# about two waves on a 132-SM H100/H200. Untuned; `kv_splits=` overrides it.
TARGET_PROGRAMS = 264
MAX_KV_SPLITS = 16
MIN_BLOCK = 16  # Triton's tl.dot needs every matmul dimension >= 16.


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def prev_pow2(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def check_block(name: str, value: int) -> None:
    """Block sizes are powers of two >= 16 (Triton tensor and tl.dot rules)."""
    if not isinstance(value, int) or value < MIN_BLOCK or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {MIN_BLOCK}")


def row_block(rows: int, block_r: int | None) -> int:
    """Query rows (tree nodes x heads per kv head) per program."""
    if block_r is None:
        return min(64, max(MIN_BLOCK, next_pow2(rows)))
    check_block("block_r", block_r)
    return block_r


def plan_splits(num_kv_blocks: int, other_programs: int, kv_splits: int | None) -> tuple[int, int]:
    """Returns (splits, blocks per split); no split is left without a block."""
    if num_kv_blocks <= 0:
        return 1, 0
    if kv_splits is None:
        want = -(-TARGET_PROGRAMS // max(1, other_programs))
        kv_splits = max(1, min(MAX_KV_SPLITS, want))
    elif not isinstance(kv_splits, int) or kv_splits < 1:
        raise ValueError(f"kv_splits={kv_splits!r} must be a positive int")
    splits = min(kv_splits, num_kv_blocks)
    chunk = -(-num_kv_blocks // splits)
    return -(-num_kv_blocks // chunk), chunk


def combine_splits(
    o,  # [..., splits, rows, head_dim] float32, unnormalised
    m,  # [..., splits, rows] float32 running max (-inf where nothing was seen)
    l,  # [..., splits, rows] float32 softmax denominator
    *,
    axis: int,
):
    """Exact merge of split-KV partials; rows that saw nothing become zeros."""
    m_max = jnp.max(m, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp(m - m_safe)  # 0 for empty splits (m == -inf)
    denom = jnp.sum(w * l, axis=axis)
    out = jnp.sum(jnp.expand_dims(w, -1) * o, axis=axis)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]
