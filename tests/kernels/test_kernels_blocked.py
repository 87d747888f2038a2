"""The default backend (blocked over the live KV) against float64 numpy and the jnp oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import CacheLayer, tree_attention, tree_attention_blocked, tree_attention_reference
from jaxspec.testing.tree_attention import ARG_ORDER, make_inputs, numpy_reference, rel_err

blocked = jax.jit(tree_attention_blocked, static_argnames=("scale", "block_k"))


@pytest.mark.parametrize("block_k", [1, 4, 16, 23, 128])
def test_blocked_matches_numpy_for_any_block(block_k):
    """Block sizes that divide the cache, do not (the last block is shifted back), exceed it."""
    x = make_inputs(3, batch=6, max_len=23, nodes=5, q_heads=8, kv_heads=2, head_dim=8)
    x["tree_mask"][0, 3] = False  # empty prefix and empty mask row: zeros
    args = [x[k] for k in ARG_ORDER]
    for scale in (None, 0.3):
        out = np.asarray(blocked(*args, scale=scale, block_k=block_k))
        assert rel_err(out, numpy_reference(*args, scale=scale)) < 2e-6
        assert np.all(out[0, 3] == 0)


def test_blocks_past_the_longest_row_are_never_read():
    """NaN in every block past max(lengths) leaves the output finite (the oracle reads them)."""
    x = make_inputs(4, batch=3, max_len=64, nodes=3, q_heads=4, kv_heads=2, head_dim=8)
    x["cache_lengths"] = np.array([0, 17, 9], np.int32)  # live blocks of 8: [0, 24)
    for name in ("k_cache", "v_cache"):
        x[name][:, 24:] = np.nan
    args = [x[k] for k in ARG_ORDER]
    out = np.asarray(blocked(*args, block_k=8))
    assert np.all(np.isfinite(out))
    clean = [a[:, :24] if k in ("k_cache", "v_cache") else a for k, a in zip(ARG_ORDER, args)]
    assert rel_err(out, numpy_reference(*clean)) < 2e-6
    assert np.isnan(np.asarray(tree_attention_reference(*args))).any()


def test_cache_layer_of_a_stack_equals_the_layer_array():
    x = make_inputs(5, batch=4, max_len=20, nodes=3, q_heads=4, kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    k_stack = rng.standard_normal((3, 4, 20, 2, 8)).astype(np.float32)
    v_stack = rng.standard_normal((3, 4, 20, 2, 8)).astype(np.float32)
    for layer in range(3):
        x["k_cache"], x["v_cache"] = k_stack[layer], v_stack[layer]
        args = [x[k] for k in ARG_ORDER]
        want = numpy_reference(*args)
        args[1] = CacheLayer(jnp.asarray(k_stack), jnp.int32(layer))
        args[2] = CacheLayer(jnp.asarray(v_stack), jnp.int32(layer))
        out = jax.jit(lambda *a: tree_attention(*a, block_k=8))(*args)
        assert rel_err(out, want) < 2e-6


def test_bfloat16_cache_is_read_as_stored():
    """A bf16 cache with float32 queries (no cast by the caller) equals the oracle on the
    same values upcast."""
    x = make_inputs(6, batch=4, max_len=40, nodes=4, q_heads=4, kv_heads=2, head_dim=16)
    args = [x[k] for k in ARG_ORDER]
    args[1] = jnp.asarray(args[1], jnp.bfloat16)
    args[2] = jnp.asarray(args[2], jnp.bfloat16)
    out = blocked(*args, block_k=16)
    assert out.dtype == jnp.float32
    want = numpy_reference(*[np.asarray(a, np.float32) if i in (1, 2) else a for i, a in enumerate(args)])
    assert rel_err(out, want) < 2e-6


def test_gradients_equal_the_oracles():
    x = make_inputs(7, batch=3, max_len=12, nodes=3, q_heads=4, kv_heads=2, head_dim=8)
    args = [jnp.asarray(x[k]) for k in ARG_ORDER]
    w = jnp.asarray(np.random.default_rng(1).standard_normal(args[0].shape), jnp.float32)

    def loss(fn, q, kc, vc, kn, vn):
        return jnp.sum(w * fn(q, kc, vc, args[3], kn, vn, args[6]))

    diff = (0, 1, 2, 4, 5)
    picked = [args[i] for i in diff]
    got = jax.grad(lambda *a: loss(lambda *b: tree_attention_blocked(*b, block_k=5), *a), argnums=range(5))(*picked)
    want = jax.grad(lambda *a: loss(tree_attention_reference, *a), argnums=range(5))(*picked)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5


def test_bad_block_size_is_named():
    x = make_inputs(8, batch=2, max_len=4, nodes=2, q_heads=2, kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="block_k=0"):
        tree_attention_blocked(*[x[k] for k in ARG_ORDER], block_k=0)


def test_ancestor_keys_are_seen_through_their_mask():
    """WithAncestors: each new token also attends to the earlier nodes its mask allows; equal
    to float64 numpy over the prefix, the allowed earlier nodes and the allowed new ones."""
    from jaxspec.kernels import WithAncestors

    x = make_inputs(9, batch=3, max_len=20, nodes=3, q_heads=4, kv_heads=2, head_dim=8)
    rng = np.random.default_rng(2)
    m = 5
    k_extra = rng.standard_normal((3, m, 2, 8)).astype(np.float32)
    v_extra = rng.standard_normal((3, m, 2, 8)).astype(np.float32)
    seen = rng.random((3, 3, m)) < 0.5
    seen[0, 0] = False  # row 0 has an empty prefix: with no earlier node, only its own mask
    args = [x[k] for k in ARG_ORDER]
    args[1] = WithAncestors(jnp.asarray(x["k_cache"]), jnp.asarray(k_extra), jnp.asarray(seen))
    args[2] = WithAncestors(jnp.asarray(x["v_cache"]), jnp.asarray(v_extra), jnp.asarray(seen))
    out = np.asarray(jax.jit(lambda *a: tree_attention(*a, block_k=8))(*args))
    # numpy: the earlier nodes as extra new entries, one query per real node.
    b, n = 3, 3
    want = np.zeros_like(out, dtype=np.float64)
    for i in range(b):
        for node in range(n):
            keys_new = np.concatenate([k_extra[i], x["k_new"][i]])[None]
            vals_new = np.concatenate([v_extra[i], x["v_new"][i]])[None]
            mask = np.concatenate([seen[i, node], x["tree_mask"][i, node]])[None, None].repeat(m + n, 1)
            q = np.zeros((1, m + n) + x["q"].shape[2:], np.float32)
            q[0, 0] = x["q"][i, node]
            res = numpy_reference(q, x["k_cache"][i : i + 1], x["v_cache"][i : i + 1],
                                  x["cache_lengths"][i : i + 1], keys_new, vals_new, mask)
            want[i, node] = res[0, 0]
    assert rel_err(out, want) < 2e-6
