"""Random tree-attention inputs and a float64 NumPy reference for the kernel tests (numpy
only: a process that imports this compiles nothing)."""

from __future__ import annotations

import numpy as np

TOL = {"float32": 1e-5, "bfloat16": 1e-2}  # max|out - ref| / max|ref|


def random_parents(rng, n: int, depth: int) -> np.ndarray:
    """Parent array (-1 = root, else an earlier node) of a random tree of max depth `depth`."""
    chain = np.sort(rng.choice(n, size=depth, replace=False))
    parents = np.full(n, -1, np.int32)
    depths = np.zeros(n, np.int32)
    on_chain = {int(c): k for k, c in enumerate(chain)}
    for i in range(n):
        if i in on_chain:
            k = on_chain[i]
            parents[i] = -1 if k == 0 else chain[k - 1]
        else:
            options = [-1] + [j for j in range(i) if depths[j] < depth]
            parents[i] = options[rng.integers(len(options))]
        depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
    assert depths.max() == depth
    return parents


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """mask[i, j]: node j is node i or one of its ancestors."""
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_masks(rng, n: int, batch: int) -> np.ndarray:
    """Rows 0..n-1: random trees of depth 1..n (depth n is the chain); then random depths."""
    depths = [1 + (i % n) if i < n else int(rng.integers(1, n + 1)) for i in range(batch)]
    return np.stack([ancestor_mask(random_parents(rng, n, d)) for d in depths])


def make_inputs(
    seed: int,
    *,
    batch: int,
    max_len: int,
    nodes: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
):
    """float32 numpy inputs; lengths start with 0 and max_len (empty and full caches)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    lengths = rng.integers(0, max_len + 1, size=batch).astype(np.int32)
    lengths[0], lengths[min(1, batch - 1)] = 0, max_len
    return dict(
        q=normal(batch, nodes, q_heads, head_dim),
        k_cache=normal(batch, max_len, kv_heads, head_dim),
        v_cache=normal(batch, max_len, kv_heads, head_dim),
        cache_lengths=lengths,
        k_new=normal(batch, nodes, kv_heads, head_dim),
        v_new=normal(batch, nodes, kv_heads, head_dim),
        tree_mask=tree_masks(rng, nodes, batch),
    )


FLOAT_ARGS = ("q", "k_cache", "v_cache", "k_new", "v_new")
ARG_ORDER = ("q", "k_cache", "v_cache", "cache_lengths", "k_new", "v_new", "tree_mask")


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def numpy_reference(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=None):
    """Vectorised float64 numpy tree attention (for processes that should not compile jnp)."""
    b, n, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale

    def f64(a):
        return np.asarray(a, np.float64)

    keys = np.concatenate([f64(k_cache), f64(k_new)], axis=1)  # [b, s+n, hkv, d]
    values = np.concatenate([f64(v_cache), f64(v_new)], axis=1)
    qg = f64(q).reshape(b, n, hkv, g, d)
    scores = np.einsum("bnkgd,bskd->bkgns", qg, keys) * scale
    prefix = np.arange(s)[None, :] < np.asarray(cache_lengths)[:, None]  # [b, s]
    allowed = np.concatenate([np.broadcast_to(prefix[:, None], (b, n, s)), tree_mask], axis=-1)
    allowed = allowed[:, None, None]  # [b, 1, 1, n, s+n]
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    w = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    denom = w.sum(-1, keepdims=True)
    w = w / np.where(denom > 0, denom, 1.0)
    return np.einsum("bkgns,bskd->bnkgd", w, values).reshape(b, n, hq, d)
