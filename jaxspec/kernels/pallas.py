"""Pallas draft-tree attention (Triton lowering on GPU, `interpret=True` on CPU).

One program handles one (batch row, kv head, block of query rows, prefix split).
Query rows are the N tree nodes times the q heads that share the kv head
(GQA), so K and V of a kv head are read once for all of them. The program runs
an online softmax over KV blocks of its part of the prefix, up to the row's
cache length (a `fori_loop` with a data-dependent trip count and a masked tail
block), then over the tree nodes in blocks under the ancestor mask (split 0 only).
Splits are merged exactly in `split_kv.combine_splits`; with one split the program
normalises and writes the output in q's dtype itself (what that merge computes for one
split, without the float32 partial and the merging pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.kernels.split_kv import (
    MIN_BLOCK,
    check_block,
    combine_splits,
    next_pow2,
    plan_splits,
    prev_pow2,
    row_block,
)

_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)  # fp32: IEEE, not TF32


def _dot_t(a, b):  # a [m, k] @ b[n, k].T -> [m, n] float32
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _dot(a, b):  # a [m, k] @ b [k, n] -> [m, n] float32
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _online_softmax_step(carry, scores, allowed, v):
    """One block of the online softmax; masked entries never contribute (no NaN when all are)."""
    o, m, l = carry  # [rows, d] f32, [rows] f32, [rows] f32
    scores = jnp.where(allowed, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(scores - m_safe[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    o = alpha[:, None] * o + _dot(p.astype(v.dtype), v)
    return o, m_new, l


def _tree_attention_kernel(
    len_ref,  # [] int32: this row's cache length
    layer_ref,  # [] int32: the layer of the stacked cache to read
    q_ref,  # [block_r, d], or [block_r // g, g, d]: whole nodes read from q's own layout
    k_ref,  # [layers, b, s, kv_heads, d]: the whole stacked cache, read in place
    v_ref,  # [layers, b, s, kv_heads, d]
    kn_ref,  # [nodes, d]: tree keys (read in blocks of block_n, masked past the last node)
    vn_ref,  # [nodes, d]
    mask_ref,  # [block_r, n_pad] int8: query row may attend to tree node
    o_ref,  # [block_r, d] float32, unnormalised (normalize: the output in its dtype, as
    # [block_r // g, g, d] when the block holds whole nodes)
    *rest,  # m_ref, l_ref [block_r] float32 (not when normalize), then the stacked caches'
    # aliased outputs (threaded through, never written)
    scale: float,
    block_k: int,
    block_n: int,
    chunk_blocks: int,
    normalize: bool,
):
    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    cache_len = k_ref.shape[2]
    layer = layer_ref[...]
    length = len_ref[...]
    q = q_ref[...]
    q = q.reshape(-1, q.shape[-1])  # [block_r, d]
    rows = q.shape[0]
    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )

    def prefix_block(i, carry):
        # The last block is shifted back to end at the cache's end (no out-of-bounds
        # read when block_k does not divide max_len); positions before i*block_k
        # were already seen and are masked.
        if cache_len % block_k:
            start = jnp.minimum(i * block_k, cache_len - block_k)
        else:
            start = pl.multiple_of(i * block_k, block_k)
        idx = start + jnp.arange(block_k, dtype=jnp.int32)
        allowed = ((idx >= i * block_k) & (idx < length))[None, :]
        k = k_ref[layer, row, pl.ds(start, block_k), head, :]
        v = v_ref[layer, row, pl.ds(start, block_k), head, :]
        return _online_softmax_step(carry, _dot_t(q, k) * scale, allowed, v)

    lo = split * chunk_blocks
    hi = jnp.minimum(lo + chunk_blocks, pl.cdiv(length, block_k))
    carry = lax.fori_loop(lo, jnp.maximum(lo, hi), prefix_block, init)

    num_nodes = kn_ref.shape[0]

    def tree_block(j, carry):
        nodes = pl.ds(j * block_n, block_n)
        allowed = mask_ref[:, nodes] != 0
        if num_nodes % block_n:  # the last block runs past the nodes: masked loads, zeros
            real = (j * block_n + jnp.arange(block_n) < num_nodes)[:, None]
            kn = plgpu.load(kn_ref.at[nodes, :], mask=real, other=0.0)
            vn = plgpu.load(vn_ref.at[nodes, :], mask=real, other=0.0)
        else:
            kn, vn = kn_ref[nodes, :], vn_ref[nodes, :]
        scores = _dot_t(q, kn) * scale
        return _online_softmax_step(carry, scores, allowed, vn)

    # The tree nodes under the ancestor mask, once per (row, kv head): split 0.
    # Both bounds int32 values: a `where` of two Python ints lowered to an i1 bound, and
    # Triton rejects an scf.for whose bounds differ in type ("Failed to parse Triton
    # module", seen on an H100 with jax 0.11.2).
    tree_blocks = jnp.where(split == 0, jnp.int32(-(-num_nodes // block_n)), jnp.int32(0))
    o, m, l = lax.fori_loop(jnp.int32(0), tree_blocks, tree_block, carry)
    if normalize:
        # One split: the whole softmax is here, so the program writes the output itself, as
        # combine_splits would for one split (o / l; 0 where nothing was seen), in its final
        # dtype: half the bytes of the float32 partial, and no combining pass. A block of
        # whole nodes goes straight to its [nodes, group, d] place of [b, n, q_heads, d].
        out = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
        o_ref[...] = out.reshape(o_ref.shape)
        return
    m_ref, l_ref = rest[0], rest[1]
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_k",
        "block_r",
        "block_n",
        "kv_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "alias",
    ),
)
def tree_attention_pallas(
    q,  # [batch, num_nodes, q_heads, head_dim]
    k_cache,  # [batch, max_len, kv_heads, head_dim]
    v_cache,  # [batch, max_len, kv_heads, head_dim]
    cache_lengths,  # [batch] int
    k_new,  # [batch, num_nodes, kv_heads, head_dim]
    v_new,  # [batch, num_nodes, kv_heads, head_dim]
    tree_mask,  # [batch, num_nodes, num_nodes] bool
    *,
    scale: float | None = None,
    block_k: int = 64,
    block_r: int | None = None,
    block_n: int = 64,
    kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    layer=None,
    alias: bool = True,
):
    """Same function as `tree_attention_reference`; the knobs never change the math.

    With `layer` (an int32 scalar, may be traced), k_cache and v_cache are stacked caches
    [layers, batch, max_len, kv_heads, head_dim] and the kernel reads layer `layer` of them
    in place: slicing the layer out first is a copy of the whole layer at every call (a
    layer loop's operands are materialised buffers), which on a GPU costs more than the
    attention reads. It then returns (out, k_cache, v_cache): the stacks passed through the
    kernel as outputs aliased to its inputs, unchanged, for the caller to go on with, so that
    a layer loop's reads and the cache write form one chain of uses of one buffer and XLA
    copies no stack (kernels.blocked threads the reference backend's the same way).
    alias=False reads the stack without passing it on (returns the inputs): for a caller
    that reads the same stack again without writing it (the block drafter's body), where an
    aliased output it discards would make XLA copy the stack at every call.

    block_k: cached positions per inner step; block_r: query rows per program;
    block_n: tree nodes per inner step; kv_splits: prefix chunks per (row, kv head)
    (None: 1 in interpret mode, else enough programs to fill the GPU). Head dims that are
    not a power of two >= 16, and caches shorter than 16, are zero-padded (a copy; real
    models use 64/128).
    """
    check_block("block_k", block_k)
    check_block("block_n", block_n)
    stacked = layer is not None
    given = (k_cache, v_cache)
    if not stacked:  # one layer's cache: a stack of one (a free reshape)
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    b, n, hq, d = q.shape
    s, hkv = k_cache.shape[2], k_cache.shape[3]
    g = hq // hkv
    scale = float(d**-0.5 if scale is None else scale)

    d_pad = max(MIN_BLOCK, next_pow2(d))
    s_pad = max(MIN_BLOCK, s)
    # a padded stack is a copy: not threaded
    thread = alias and stacked and d_pad == d and s_pad == s
    if d_pad != d or s_pad != s:
        pad_cache = ((0, 0), (0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d))
        k_cache, v_cache = jnp.pad(k_cache, pad_cache), jnp.pad(v_cache, pad_cache)
        pad_d = ((0, 0), (0, 0), (0, 0), (0, d_pad - d))
        q, k_new, v_new = jnp.pad(q, pad_d), jnp.pad(k_new, pad_d), jnp.pad(v_new, pad_d)
    bk = min(block_k, prev_pow2(s_pad))
    bn = min(block_n, max(MIN_BLOCK, next_pow2(n)))
    n_pad = -(-n // bn) * bn
    rows = n * g
    br = row_block(rows, block_r)
    if block_r is None and rows % br and d_pad == d:
        # Prefer a smaller block of whole nodes that divides the rows: q is then read and the
        # output written in their own layouts with no padded copy of either.
        whole = [c for c in (br // 2, br // 4) if c >= MIN_BLOCK and c % g == 0 and rows % c == 0]
        br = whole[0] if whole else br
    row_blocks = -(-rows // br)
    r_pad = row_blocks * br
    if kv_splits is None and interpret:
        kv_splits = 1
    splits, chunk = plan_splits(-(-s_pad // bk), b * hkv * row_blocks, kv_splits)

    # Query row r = node * g + head-in-group, grouped by kv head.
    # Blocks of whole nodes without head padding read q in its own layout [b, n, hkv, g, d]
    # (no transposed copy of q; nodes padded only when the last block is partial); else q
    # regrouped to [b, hkv, rows, d] first.
    natural = br % g == 0 and d_pad == d
    if natural:
        qg = jnp.pad(q.reshape(b, n, hkv, g, d), ((0, 0), (0, r_pad // g - n), (0, 0), (0, 0),
                                                  (0, 0)))
        q_spec = pl.BlockSpec((None, br // g, None, g, d), lambda i, h, r, j: (i, r, h, 0, 0))
    else:
        qg = q.reshape(b, n, hkv, g, d_pad).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d_pad)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r_pad - rows), (0, 0)))
        q_spec = pl.BlockSpec((None, None, br, d_pad), lambda i, h, r, j: (i, h, r, 0))
    mask_rows = jnp.repeat(tree_mask.astype(jnp.int8), g, axis=1)  # [b, rows, n]
    mask_rows = jnp.pad(mask_rows, ((0, 0), (0, r_pad - rows), (0, n_pad - n)))
    # The tree's keys and values as one operand [b, n, 2, hkv, d], unpadded (the kernel masks
    # the last node block): what kernels.qkv writes, or one pass that applies RoPE to the keys
    # and writes the values beside them, where a separate values operand sliced from the
    # q/k/v projection XLA merged would be one more copy per layer.
    kv_new = jnp.stack([k_new, v_new], axis=2)
    lengths = jnp.clip(cache_lengths.astype(jnp.int32), 0, s)

    normalize = splits == 1
    kernel = functools.partial(
        _tree_attention_kernel, scale=scale, block_k=bk, block_n=bn, chunk_blocks=chunk,
        normalize=normalize,
    )
    # The whole stack, unblocked: the kernel indexes its (layer, row, head) itself.
    kv_spec = pl.BlockSpec(k_cache.shape, lambda i, h, r, j: (0, 0, 0, 0, 0))
    k_spec = pl.BlockSpec((None, n, None, None, d_pad), lambda i, h, r, j: (i, 0, 0, h, 0))
    v_spec = pl.BlockSpec((None, n, None, None, d_pad), lambda i, h, r, j: (i, 0, 1, h, 0))
    compiler_params = None
    if not interpret:
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    stack_specs = [kv_spec, kv_spec] if thread else []
    stack_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k_cache, v_cache)]
    ml_spec = pl.BlockSpec((None, None, None, br), lambda i, h, r, j: (i, h, j, r))
    ml_shape = jax.ShapeDtypeStruct((b, hkv, splits, r_pad), jnp.float32)
    # One split with blocks of whole nodes and no head padding: the output in its final
    # layout [b, nodes, kv_heads, g, d] (no transpose pass after the kernel); else per
    # (row, kv head) blocks of query rows, rearranged below.
    placed = normalize and natural
    if placed:
        o_spec = pl.BlockSpec((None, br // g, None, g, d), lambda i, h, r, j: (i, r, h, 0, 0))
        o_shape = jax.ShapeDtypeStruct((b, r_pad // g, hkv, g, d), q.dtype)
    else:
        o_spec = pl.BlockSpec((None, None, None, br, d_pad), lambda i, h, r, j: (i, h, j, r, 0))
        o_shape = jax.ShapeDtypeStruct((b, hkv, splits, r_pad, d_pad),
                                       q.dtype if normalize else jnp.float32)
    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, r, j: (i,)),
            pl.BlockSpec((None,), lambda i, h, r, j: (0,)),
            q_spec,
            kv_spec,
            kv_spec,
            k_spec,
            v_spec,
            pl.BlockSpec((None, br, n_pad), lambda i, h, r, j: (i, r, 0)),
        ],
        out_specs=[o_spec, *([] if normalize else [ml_spec, ml_spec]), *stack_specs],
        out_shape=[
            o_shape,
            *([] if normalize else [ml_shape, ml_shape]),
            *(stack_shapes if thread else []),
        ],
        # the stacks' operand indices (3, 4) alias the outputs after o (and m, l)
        input_output_aliases=({3: 1, 4: 2} if normalize else {3: 3, 4: 4}) if thread else {},
        compiler_params=compiler_params,
        interpret=interpret,
        name="tree_attention",
    )(lengths, layer, qg, k_cache, v_cache, kv_new, kv_new, mask_rows)

    if placed:
        out, stacks = outs[0], outs[1:]  # [b, r_pad // g, hkv, g, d], q's dtype
        out = out[:, :n].reshape(b, n, hq, d)
    else:
        if normalize:
            out, stacks = outs[0][:, :, 0], outs[1:]  # [b, hkv, r_pad, d_pad], q's dtype
        else:
            o, m, l, *stacks = outs
            out = combine_splits(o, m, l, axis=2)  # [b, hkv, r_pad, d_pad]
        out = out[:, :, :rows, :d].reshape(b, hkv, n, g, d).transpose(0, 2, 1, 3, 4)
        out = out.reshape(b, n, hq, d).astype(q.dtype)
    if not stacked:
        return out
    return (out, *stacks) if thread else (out, *given)
