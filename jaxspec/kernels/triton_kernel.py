"""The Triton kernel of draft-tree attention, importable without jax-triton.

`tree_attention_kernel` is a plain `@triton.jit` function: `triton_backend.py`
calls it from JAX through `jax_triton.triton_call`, and the CPU tests run the
same function in Triton's interpreter over torch tensors. `launch_config` is
the one place that turns shapes and knobs into the grid and the constexprs, so
both callers launch it identically.

Layout: inputs are the caller's contiguous arrays (no transposes or copies);
query row r of a program is tree node r // GROUP, q head kv_head * GROUP + r % GROUP.
Outputs are split-KV partials: o [splits, B, N, Hq, D] float32 (unnormalised),
m and l [splits, B, N, Hq] float32, merged by `split_kv.combine_splits(axis=0)`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from jaxspec.kernels.split_kv import (
    MIN_BLOCK,
    check_block,
    next_pow2,
    plan_splits,
    row_block,
)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, allowed, v):
    """One block of the online softmax; masked scores never contribute (no NaN when all are)."""
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def tree_attention_kernel(
    q_ptr,  # [B, N, HQ, D]
    k_cache_ptr,  # [B, S, HKV, D]
    v_cache_ptr,  # [B, S, HKV, D]
    lengths_ptr,  # [B] int32
    k_new_ptr,  # [B, N, HKV, D]
    v_new_ptr,  # [B, N, HKV, D]
    mask_ptr,  # [B, N, N] int8
    o_ptr,  # [SPLITS, B, N, HQ, D] float32
    m_ptr,  # [SPLITS, B, N, HQ] float32
    l_ptr,  # [SPLITS, B, N, HQ] float32
    BATCH: tl.constexpr,
    N: tl.constexpr,
    S: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in float32 from upcast operands (CPU interpreter)
):
    HQ: tl.constexpr = HKV * GROUP
    pid_bh = tl.program_id(0)  # batch row x kv head: the big axis (CUDA y/z stop at 65535)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    b64 = b.to(tl.int64)

    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N * GROUP
    node = rows // GROUP
    head = h * GROUP + rows % GROUP
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < HEAD_DIM

    q_off = b64 * (N * HQ * HEAD_DIM) + node[:, None] * (HQ * HEAD_DIM) + head[:, None] * HEAD_DIM
    q = tl.load(q_ptr + q_off + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)

    # Prefix: this split's KV blocks, up to the row's cache length (masked tail).
    length = tl.load(lengths_ptr + b)
    kv_base = b64 * (S * HKV * HEAD_DIM) + h * HEAD_DIM
    lo = pid_s * CHUNK_BLOCKS
    hi = tl.minimum(lo + CHUNK_BLOCKS, tl.cdiv(length, BLOCK_K))
    for blk in range(lo, hi):
        pos = blk * BLOCK_K + tl.arange(0, BLOCK_K)
        pos_ok = pos < length
        kv_off = kv_base + pos[:, None] * (HKV * HEAD_DIM) + dd[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, pos_ok[None, :], v)

    # Tree nodes under the ancestor mask, in blocks, once per (row, kv head): split 0.
    if pid_s == 0:
        for j0 in range(0, N, BLOCK_N):
            jj = j0 + tl.arange(0, BLOCK_N)
            j_ok = jj < N
            new_off = b64 * (N * HKV * HEAD_DIM) + jj[:, None] * (HKV * HEAD_DIM) + h * HEAD_DIM
            new_mask = j_ok[:, None] & d_ok[None, :]
            kn = tl.load(k_new_ptr + new_off + dd[None, :], mask=new_mask, other=0.0)
            vn = tl.load(v_new_ptr + new_off + dd[None, :], mask=new_mask, other=0.0)
            if UPCAST:
                kn = kn.to(tl.float32)
                vn = vn.to(tl.float32)
            tree_off = b64 * (N * N) + node[:, None] * N + jj[None, :]
            allowed = (
                tl.load(mask_ptr + tree_off, mask=row_ok[:, None] & j_ok[None, :], other=0) != 0
            )
            s = tl.dot(q, tl.trans(kn), input_precision="ieee") * SCALE
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, allowed, vn)

    split_off = pid_s.to(tl.int64) * (BATCH * N * HQ) + b64 * (N * HQ) + node * HQ + head
    tl.store(m_ptr + split_off, m_i, mask=row_ok)
    tl.store(l_ptr + split_off, l_i, mask=row_ok)
    o_off = split_off[:, None] * HEAD_DIM + dd[None, :]
    tl.store(o_ptr + o_off, acc, mask=row_ok[:, None] & d_ok[None, :])


def launch_config(
    q_shape: tuple[int, int, int, int],  # (batch, num_nodes, q_heads, head_dim)
    cache_shape: tuple[int, int, int, int],  # (batch, max_len, kv_heads, head_dim)
    *,
    scale: float | None = None,
    block_k: int = 64,
    block_r: int | None = None,
    block_n: int = 64,
    kv_splits: int | None = None,
    upcast: bool = False,
):
    """Returns (grid, constexprs, partial output shapes) for `tree_attention_kernel`."""
    check_block("block_k", block_k)
    check_block("block_n", block_n)
    b, n, hq, d = q_shape
    s, hkv = cache_shape[1], cache_shape[2]
    g = hq // hkv
    rows = n * g
    br = row_block(rows, block_r)
    row_blocks = -(-rows // br)
    splits, chunk = plan_splits(-(-s // block_k), b * hkv * row_blocks, kv_splits)
    constexprs = dict(
        BATCH=b,
        N=n,
        S=s,
        HKV=hkv,
        GROUP=g,
        HEAD_DIM=d,
        SCALE=float(d**-0.5 if scale is None else scale),
        BLOCK_R=br,
        BLOCK_K=block_k,
        BLOCK_N=min(block_n, max(MIN_BLOCK, next_pow2(n))),
        BLOCK_D=max(MIN_BLOCK, next_pow2(d)),
        CHUNK_BLOCKS=max(chunk, 1),
        UPCAST=bool(upcast),
    )
    grid = (b * hkv, row_blocks, splits)
    out_shapes = ((splits, b, n, hq, d), (splits, b, n, hq), (splits, b, n, hq))
    return grid, constexprs, out_shapes
