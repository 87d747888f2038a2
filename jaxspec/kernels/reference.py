"""Plain-jnp draft-tree attention: the oracle every kernel backend is tested against."""

from __future__ import annotations

import jax.numpy as jnp


def tree_attention_reference(
    q,  # [batch, num_nodes, q_heads, head_dim]
    k_cache,  # [batch, max_len, kv_heads, head_dim]
    v_cache,  # [batch, max_len, kv_heads, head_dim]
    cache_lengths,  # [batch] int32: valid prefix slots per row
    k_new,  # [batch, num_nodes, kv_heads, head_dim]
    v_new,  # [batch, num_nodes, kv_heads, head_dim]
    tree_mask,  # [batch, num_nodes, num_nodes] bool: node i may attend to node j
    *,
    scale: float | None = None,
):
    """Each node attends to its row's cached prefix and to the nodes the mask allows.

    Scores and softmax are float32 whatever the input dtype; the output has q's dtype.
    A query that may attend to nothing (an all-false mask row over an empty prefix)
    returns zeros instead of NaN.
    """
    b, n, hq, d = q.shape
    s = k_cache.shape[1]
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale

    keys = jnp.concatenate([k_cache, k_new], axis=1).astype(jnp.float32)  # [b, s+n, hkv, d]
    values = jnp.concatenate([v_cache, v_new], axis=1).astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(b, n, hkv, group, d)
    scores = jnp.einsum("bnkgd,bskd->bkgns", qf, keys) * scale  # [b, hkv, g, n, s+n]

    prefix_ok = jnp.arange(s)[None, :] < cache_lengths[:, None]  # [b, s]
    allowed = jnp.concatenate(
        [jnp.broadcast_to(prefix_ok[:, None, :], (b, n, s)), tree_mask.astype(bool)], axis=-1
    )  # [b, n, s+n]
    allowed = allowed[:, None, None, :, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgns,bskd->bnkgd", weights, values)
    return out.reshape(b, n, hq, d).astype(q.dtype)
