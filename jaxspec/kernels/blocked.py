"""Tree attention over the live KV only: the jnp/XLA path behind backend "reference".

The cache is read in fixed blocks of `block_k` slots, in its stored dtype, by a loop that
stops after ceil(max(cache_lengths) / block_k) blocks, with an online softmax accumulated in
float32; the tree's own keys come last. Cost follows the longest live row, not the cache's
capacity, and no float32 copy of the cache is ever made (the plain oracle,
`tree_attention_reference`, concatenates and upcasts the whole cache).

The loop is a `while_loop` (its trip count is data-dependent), which reverse-mode autodiff
cannot cross; the VJP recomputes the oracle instead (training forwards have no cache and
take the oracle directly).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.kernels.reference import tree_attention_reference

BLOCK_K = 128  # cache slots per block; the math does not depend on it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheLayer:
    """One layer of a stacked cache, unsliced: what a layer loop passes as its k/v cache so
    that the attention reads only the blocks it needs. (A per-layer slice fed to a loop is a
    whole-layer copy in XLA: a loop's operands are materialised buffers.)"""

    stack: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    index: jax.Array  # [] int32: the layer

    shape = property(lambda self: self.stack.shape[1:])
    dtype = property(lambda self: self.stack.dtype)
    ndim = property(lambda self: self.stack.ndim - 1)

    def read(self):  # -> [batch, max_len, kv_heads, head_dim] (a copy inside loops)
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, axis=0, keepdims=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithAncestors:
    """A cache plus keys (or values) of earlier draft-tree nodes that are not in it: each new
    token also sees the nodes `mask` allows (its ancestors). Tree drafting carries a head's
    per-node keys across depths this way instead of feeding every node again."""

    cache: Any  # [batch, max_len, kv_heads, head_dim] or a CacheLayer
    extra: jax.Array  # [batch, M, kv_heads, head_dim] the earlier nodes'
    mask: jax.Array  # [batch, T, M] bool: new token i may attend to earlier node j

    shape = property(lambda self: self.cache.shape)
    dtype = property(lambda self: self.cache.dtype)
    ndim = property(lambda self: self.cache.ndim)


def split_ancestors(k_cache, v_cache, num_new: int):
    """-> (k_cache, v_cache, k_extra [B,M,kvh,d], v_extra, mask [B,T,M]); M = 0 without any."""
    if isinstance(k_cache, WithAncestors) != isinstance(v_cache, WithAncestors):
        raise ValueError("k_cache and v_cache must both be WithAncestors, or neither")
    if isinstance(k_cache, WithAncestors):
        return k_cache.cache, v_cache.cache, k_cache.extra, v_cache.extra, k_cache.mask.astype(bool)
    b, _, hkv, d = k_cache.shape
    none = jnp.zeros((b, 0, hkv, d), k_cache.dtype)
    return k_cache, v_cache, none, none, jnp.zeros((b, num_new, 0), bool)


def as_stack(cache):  # array [B,S,kvh,d] or CacheLayer -> ([L,B,S,kvh,d], [] int32)
    if isinstance(cache, CacheLayer):
        return cache.stack, jnp.asarray(cache.index, jnp.int32)
    return cache[None], jnp.zeros((), jnp.int32)


def layer_array(cache):  # array or CacheLayer -> [B, S, kvh, d]
    return cache.read() if isinstance(cache, CacheLayer) else cache


def _update(state, qf, keys, values, allowed, scale):
    """One online-softmax step over a key block.

    qf [b, n, hkv, g, d] f32; keys/values [b, s, hkv, d] any float dtype;
    allowed [b, n, s] bool; state (m, l [b, hkv, g, n], acc [b, hkv, g, n, d]) f32.
    """
    m, l, acc = state
    scores = jnp.einsum("bnkgd,bskd->bkgns", qf, keys, preferred_element_type=jnp.float32) * scale
    ok = allowed[:, None, None]  # [b, 1, 1, n, s]
    scores = jnp.where(ok, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen (m == -inf)
    p = jnp.where(ok, jnp.exp(scores - m_safe[..., None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgns,bskd->bkgnd", p, values, preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[..., None] + pv


def _blocked_forward(q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask, scale,
                     block_k):
    b, n, hq, d = q.shape
    s, hkv = k_stack.shape[2], k_stack.shape[3]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(b, n, hkv, g, d)
    lengths = jnp.clip(cache_lengths.astype(jnp.int32), 0, s)
    blk = min(block_k, s)
    num_blocks = (jnp.max(lengths) + blk - 1) // blk

    def body(i, carry):
        # The last block is shifted back to fit the cache; slots already seen are masked.
        state, k_stack, v_stack = carry
        # Not a plain pass-through, or XLA forwards the loop's input to later users again.
        k_stack, v_stack = jax.lax.optimization_barrier((k_stack, v_stack))
        first = i * blk
        start = jnp.minimum(first, s - blk)
        at, size = (layer, 0, start, 0, 0), (1, b, blk, hkv, d)
        keys = jax.lax.dynamic_slice(k_stack, at, size)[0]  # [b, blk, hkv, d] as stored
        values = jax.lax.dynamic_slice(v_stack, at, size)[0]
        slot = start + jnp.arange(blk)
        live = (slot[None, :] >= first) & (slot[None, :] < lengths[:, None])  # [b, blk]
        allowed = jnp.broadcast_to(live[:, None, :], (b, n, blk))
        return _update(state, qf, keys, values, allowed, scale), k_stack, v_stack

    state = (
        jnp.full((b, hkv, g, n), -jnp.inf, jnp.float32),
        jnp.zeros((b, hkv, g, n), jnp.float32),
        jnp.zeros((b, hkv, g, n, d), jnp.float32),
    )
    # The stacks ride in the carry and come back out unchanged: a caller that goes on with the
    # returned ones (the next layer, the cache write) gives XLA one chain of uses of one
    # buffer. Read as closure constants by every layer's loop, the stack was copied whole
    # per layer per step once the write updated it in place (docs/BENCHMARKS.md).
    if blk == s:  # one block holds the cache: no loop to compile. Where no row has a live
        # slot the block leaves the state as it was (its slots are finite: caches start at 0).
        state, k_stack, v_stack = body(jnp.int32(0), (state, k_stack, v_stack))
    else:
        state, k_stack, v_stack = jax.lax.fori_loop(0, num_blocks, body, (state, k_stack, v_stack))
    k_extra, v_extra, extra_mask = extra
    if k_extra.shape[1]:
        state = _update(state, qf, k_extra, v_extra, extra_mask, scale)
    _, l, acc = _update(state, qf, k_new, v_new, tree_mask.astype(bool), scale)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # rows that saw nothing: zeros
    return jnp.moveaxis(out, 3, 1).reshape(b, n, hq, d).astype(q.dtype), k_stack, v_stack


def _oracle(q, k_cache, v_cache, cache_lengths, extra, k_new, v_new, tree_mask, scale):
    """`tree_attention_reference` with the earlier nodes as extra new entries whose own
    outputs are dropped (their queries are zeros and see only themselves)."""
    k_extra, v_extra, extra_mask = extra
    b, m = k_extra.shape[:2]
    if m == 0:
        return tree_attention_reference(
            q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=scale
        )
    n = q.shape[1]
    mask = jnp.concatenate([
        jnp.concatenate([jnp.broadcast_to(jnp.eye(m, dtype=bool), (b, m, m)),
                         jnp.zeros((b, m, n), bool)], axis=2),
        jnp.concatenate([extra_mask, tree_mask.astype(bool)], axis=2),
    ], axis=1)
    out = tree_attention_reference(
        jnp.concatenate([jnp.zeros((b, m) + q.shape[2:], q.dtype), q], axis=1),
        k_cache, v_cache, cache_lengths,
        jnp.concatenate([k_extra.astype(k_new.dtype), k_new], axis=1),
        jnp.concatenate([v_extra.astype(v_new.dtype), v_new], axis=1),
        mask, scale=scale,
    )
    return out[:, m:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _blocked(q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask, scale, block_k):
    return _blocked_forward(
        q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask, scale, block_k
    )


def _blocked_fwd(q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask, scale,
                 block_k):
    outs = _blocked_forward(
        q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask, scale, block_k
    )
    return outs, (q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask)


def _blocked_bwd(scale, block_k, residuals, gs):
    q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask = residuals
    g, g_k, g_v = gs  # the stacks pass through: their cotangents flow straight back

    def oracle(q, k_stack, v_stack, k_extra, v_extra, k_new, v_new):
        k_cache, v_cache = CacheLayer(k_stack, layer).read(), CacheLayer(v_stack, layer).read()
        return _oracle(q, k_cache, v_cache, cache_lengths, (k_extra, v_extra, extra[2]), k_new,
                       v_new, tree_mask, scale)

    _, vjp = jax.vjp(oracle, q, k_stack, v_stack, extra[0], extra[1], k_new, v_new)
    dq, dk, dv, dke, dve, dkn, dvn = vjp(g)
    return dq, dk + g_k, dv + g_v, None, None, (dke, dve, None), dkn, dvn, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def tree_attention_blocked(
    q,  # [batch, num_nodes, q_heads, head_dim]
    k_cache,  # [batch, max_len, kv_heads, head_dim] or a CacheLayer (any float dtype: read as stored)
    v_cache,  # [batch, max_len, kv_heads, head_dim] or a CacheLayer
    cache_lengths,  # [batch] int: valid prefix slots per row
    k_new,  # [batch, num_nodes, kv_heads, head_dim]
    v_new,  # [batch, num_nodes, kv_heads, head_dim]
    tree_mask,  # [batch, num_nodes, num_nodes] bool: node i may attend to node j
    *,
    scale: float | None = None,
    block_k: int | None = None,
    thread: bool = False,
):  # -> [batch, num_nodes, q_heads, head_dim] in q's dtype; thread: (that, k_cache, v_cache)
    """`tree_attention_reference`'s function, reading only the cache blocks some row needs
    (k_cache/v_cache may be `WithAncestors`: earlier tree nodes seen through their mask).

    thread=True also returns the caches, unchanged in value but passed through the block
    loop, for the caller to use from then on (see `_blocked_forward`)."""
    block_k = BLOCK_K if block_k is None else block_k
    if not isinstance(block_k, int) or isinstance(block_k, bool) or block_k < 1:
        raise ValueError(f"block_k={block_k!r} must be a positive int")
    given = (k_cache, v_cache)
    k_cache, v_cache, *extra = split_ancestors(k_cache, v_cache, q.shape[1])
    extra = tuple(extra)
    if k_cache.shape[1] == 0:  # no cache (training forwards): the oracle, differentiable as is
        out = _oracle(q, layer_array(k_cache), layer_array(v_cache), cache_lengths, extra, k_new,
                      v_new, tree_mask, scale)
        return (out, *given) if thread else out
    (k_stack, layer), (v_stack, _) = as_stack(k_cache), as_stack(v_cache)
    scale = None if scale is None else float(scale)
    out, k_stack, v_stack = _blocked(
        q, k_stack, v_stack, layer, cache_lengths, extra, k_new, v_new, tree_mask, scale, block_k
    )
    if not thread:
        return out
    if not isinstance(k_cache, CacheLayer) or isinstance(given[0], WithAncestors):
        return (out, *given)  # only stacked caches are threaded
    return out, CacheLayer(k_stack, k_cache.index), CacheLayer(v_stack, v_cache.index)
