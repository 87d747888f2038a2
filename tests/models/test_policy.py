"""Policy forward: ragged prefill + decode, draft-tree verify, KV compaction, cache bounds.

The reference for every cached computation is one cache-free forward over the plain
sequence (causal), so these tests pin prefill, decode and verify to the same function.

Tolerances. float32: 1e-5 absolute on logits of magnitude ~5-10 (rounding level; we see
~1e-6). bfloat16: the cached and the cache-free forwards do the same per-token math, but
attention reduces over differently shaped operands (max_len prefix slots + new tokens vs
the whole sequence), so float32 partial sums differ in the last bits; every activation
is then rounded to bf16 (8 significant bits, relative step 2^-8), so a last-bit
difference can flip one rounding and that 2^-8 step propagates through later layers.
We allow two bf16 rounding steps of the largest logit, 2^-7 * max|logit| (~0.05 here;
we see ~0.01).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import CacheOverflowError, KVCache, ModelConfig, compact, default_eagle3_layers


def _tol(dtype, refs):
    return 1e-5 if dtype == "float32" else 2.0**-7 * max(np.abs(r).max() for r in refs)


PROMPT_LENS = np.array([5, 2, 7])
T_PROMPT = 7
MAX_LEN = 24
V = ModelConfig.tiny("qwen3").vocab_size
# Draft trees, one per row, as parent indices (-1 = child of the root), topological order.
PARENTS = np.array([
    [-1, -1, 0, 0, 1, 3],
    [-1, 0, 1, 2, 3, 4],  # a chain
    [-1, -1, -1, 2, 2, 4],
])
# Accepted node paths (root excluded) for compaction: each a root-to-node chain.
ACCEPTED = [[0, 3, 5], [0, 1], []]


def _ragged_prompts(rng):
    """Row 0 right-padded, row 1 left-padded, row 2 full; padding has position -1."""
    prompts = [rng.integers(0, V, n) for n in PROMPT_LENS]
    tokens = np.zeros((3, T_PROMPT), np.int32)
    positions = np.full((3, T_PROMPT), -1, np.int32)
    for b, p in enumerate(prompts):
        start = T_PROMPT - len(p) if b == 1 else 0
        tokens[b, start:start + len(p)] = p
        positions[b, start:start + len(p)] = np.arange(len(p))
    return prompts, tokens, positions


def _plain_forward(policy, sequences, rows=24, width=16):
    """Cache-free causal forward of each sequence (right-padded); -> list of [len, V].

    One fixed [rows, width] shape for every call, so all references share one compile.
    """
    assert len(sequences) <= rows and max(len(s) for s in sequences) <= width
    tokens = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
        positions[i, :len(s)] = np.arange(len(s))
    logits, _, cache = policy.forward(tokens, positions)
    assert cache is None
    logits = np.asarray(logits)
    return [logits[i, :len(s)] for i, s in enumerate(sequences)]


def _depths(parents):
    depths = np.zeros(len(parents), np.int32)
    for i, p in enumerate(parents):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return depths


def _ancestor_mask(parents):
    """[N+1, N+1] bool over the fed block [root, node_0..]: j is i or an ancestor of i."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), bool)
    mask[:, 0] = True
    for i in range(n):
        mask[i + 1, i + 1] = True
        p = parents[i]
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def _node_path(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def prefilled(request, qwen3_policies):
    policy = qwen3_policies[request.param]
    rng = np.random.default_rng(0)
    prompts, tokens, positions = _ragged_prompts(rng)
    logits, _, cache = policy.forward(tokens, positions, policy.init_cache(3, MAX_LEN))
    return request.param, policy, prompts, tokens, positions, np.asarray(logits), cache


def test_ragged_prefill_then_decode_matches_full_forward(prefilled):
    dtype, policy, prompts, _, positions, prefill_logits, cache = prefilled
    assert prefill_logits.dtype == np.float32  # whatever the param dtype
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS)
    cont = np.random.default_rng(1).integers(0, V, (3, 4)).astype(np.int32)
    decode_logits = []
    for s in range(cont.shape[1]):
        logits, _, cache = policy.forward(cont[:, s:s + 1], (PROMPT_LENS + s)[:, None], cache)
        decode_logits.append(np.asarray(logits[:, 0]))
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS + cont.shape[1])

    refs = _plain_forward(policy, [np.concatenate([p, c]) for p, c in zip(prompts, cont)])
    scale = max(np.abs(r).max() for r in refs)
    assert 2 < scale < 50, scale  # logits are non-trivial, so the tolerance means something
    got, want = [], []
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        got += list(prefill_logits[b][positions[b] >= 0]) + [d[b] for d in decode_logits]
        want += list(ref)
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=_tol(dtype, refs), rtol=0)


def test_tree_verify_then_compact_matches_plain_decoding(prefilled):
    dtype, policy, prompts, _, _, _, cache = prefilled
    rng = np.random.default_rng(2)
    n = PARENTS.shape[1]
    root = rng.integers(0, V, 3).astype(np.int32)
    nodes = rng.integers(0, V, (3, n)).astype(np.int32)
    fed = np.concatenate([root[:, None], nodes], axis=1)  # [B, N+1]
    depths = np.stack([np.concatenate([[0], _depths(p)]) for p in PARENTS])
    fed_positions = PROMPT_LENS[:, None] + depths
    mask = np.stack([_ancestor_mask(p) for p in PARENTS])
    logits, _, cache = policy.forward(fed, fed_positions, cache, mask=mask)
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS + n + 1)

    # Compact onto the accepted paths, then decode one more (bonus) token.
    width = int(depths.max()) + 1
    path = np.full((3, width), -1, np.int32)
    for b, acc in enumerate(ACCEPTED):
        path[b, :len(acc) + 1] = [0] + [i + 1 for i in acc]
    cache = compact(cache, path, num_fed=n + 1)
    kept = np.array([len(a) + 1 for a in ACCEPTED])
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS + kept)
    bonus = rng.integers(0, V, 3).astype(np.int32)
    bonus_logits, _, cache = policy.forward(bonus[:, None], (PROMPT_LENS + kept)[:, None], cache)

    # References: every root-to-node path, and every accepted path + bonus, fed plainly.
    sequences = []
    for b in range(3):
        for i in range(-1, n):
            path_nodes = _node_path(PARENTS[b], i) if i >= 0 else []
            sequences.append(np.concatenate([prompts[b], [root[b]], nodes[b, path_nodes]]))
    for b in range(3):
        accepted = nodes[b, ACCEPTED[b]]
        sequences.append(np.concatenate([prompts[b], [root[b]], accepted, [bonus[b]]]))
    refs = _plain_forward(policy, sequences)
    logits = np.asarray(logits)
    want = np.stack([r[-1] for r in refs[:3 * (n + 1)]]).reshape(logits.shape)
    np.testing.assert_allclose(logits, want, atol=_tol(dtype, refs), rtol=0, err_msg="tree verify")
    want = np.stack([r[-1] for r in refs[3 * (n + 1):]])
    np.testing.assert_allclose(
        bonus_logits[:, 0], want, atol=_tol(dtype, refs), rtol=0, err_msg="decode after compaction"
    )


def test_compact_and_append_match_numpy():
    """compact against a plain numpy statement of the contract, incl. fed_mask and padding."""
    rng = np.random.default_rng(3)
    layers, batch, max_len, kvh, d = 2, 3, 12, 2, 4
    k = rng.standard_normal((layers, batch, max_len, kvh, d)).astype(np.float32)
    v = rng.standard_normal((layers, batch, max_len, kvh, d)).astype(np.float32)
    lengths = np.array([9, 6, 4], np.int32)  # rows 0, 1 were fed 5 tokens; row 2 nothing
    cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(v), lengths=jnp.asarray(lengths))
    path = np.array([[0, 2, 4], [0, 1, -1], [-1, -1, -1]], np.int32)
    fed = np.array([True, True, False])
    out = compact(cache, path, num_fed=5, fed_mask=fed)
    want_k, want_v, want_len = k.copy(), v.copy(), lengths.copy()
    for b in range(2):
        base = lengths[b] - 5
        keep = [j for j in path[b] if j >= 0]
        want_k[:, b, base:base + len(keep)] = k[:, b, [base + j for j in keep]]
        want_v[:, b, base:base + len(keep)] = v[:, b, [base + j for j in keep]]
        want_len[b] = base + len(keep)
    np.testing.assert_array_equal(out.lengths, want_len)
    np.testing.assert_array_equal(out.k, want_k)
    np.testing.assert_array_equal(out.v, want_v)

    # append writes one layer at each row's length (valid tokens only), advance counts them.
    new = rng.standard_normal((batch, 3, kvh, d)).astype(np.float32)
    valid = np.array([[True, True, True], [False, True, True], [True, False, False]])
    grown = out.append(1, jnp.asarray(new), jnp.asarray(new), valid).advance(valid)
    np.testing.assert_array_equal(grown.lengths, want_len + valid.sum(1))
    want_k[1, 0, 7:10] = new[0]  # row 0: lengths 7 -> slots 7, 8, 9
    want_k[1, 1, 3:5] = new[1, 1:]  # row 1: lengths 3; padding first, then slots 3, 4
    want_k[1, 2, 4] = new[2, 0]
    np.testing.assert_array_equal(grown.k, want_k)


def test_compact_of_a_prefix_path_moves_nothing():
    """prefix=True (a chain's accepted path 0..n) against the numpy contract: lengths set,
    every slot unchanged."""
    rng = np.random.default_rng(4)
    k = rng.standard_normal((2, 3, 10, 2, 4)).astype(np.float32)
    lengths = np.array([8, 5, 7], np.int32)  # each row was fed 4 tokens (rows 0, 1) or none (row 2)
    cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(-k), lengths=jnp.asarray(lengths))
    path = np.array([[0, 1, 2, -1], [0, -1, -1, -1], [-1, -1, -1, -1]], np.int32)
    fed = np.array([True, True, False])
    out = compact(cache, path, num_fed=4, fed_mask=fed, prefix=True)
    np.testing.assert_array_equal(out.lengths, [8 - 4 + 3, 5 - 4 + 1, 7])
    np.testing.assert_array_equal(out.k, k)
    np.testing.assert_array_equal(out.v, -k)
    general = compact(cache, path, num_fed=4, fed_mask=fed)
    np.testing.assert_array_equal(general.k, out.k)
    np.testing.assert_array_equal(general.lengths, out.lengths)


def test_capture_out_of_range_is_an_error(qwen3_policies):
    # Captured values are checked against HF hidden_states in test_hf.py.
    policy = qwen3_policies["float32"]
    with pytest.raises(ValueError, match=r"capture layers \[3\] out of range \[0, 3\)"):
        policy.forward(np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32), capture=(3,))


def test_cache_overflow_is_an_error_or_dropped_never_corrupting(qwen3_policies):
    policy = qwen3_policies["float32"]
    cache = policy.init_cache(2, 8)
    # Known from shapes: more tokens per row than slots.
    with pytest.raises(CacheOverflowError, match=r"T=9 .* max_len=8"):
        policy.forward(np.zeros((2, 9), np.int32), np.zeros((2, 9), np.int32), cache)
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6)
    positions = np.array([np.arange(6), [-1] * 6], np.int32)  # row 1 all padding
    _, _, cache = policy.forward(tokens, positions, cache)
    np.testing.assert_array_equal(cache.lengths, [6, 0])
    step = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    step_pos = np.array([[6, 7, 8], [0, 1, 2]], np.int32)
    # Known from concrete lengths (eager call): row 0 needs 9 slots.
    with pytest.raises(CacheOverflowError, match=r"rows \[0\] need \[9\] slots, max_len=8"):
        policy.forward(step, step_pos, cache)
    # Under jit the lengths are traced: the entry past capacity is dropped, the row is
    # flagged, and nothing else changes: compare with the same step, third token of row 0
    # marked as padding (fits exactly, same compiled program).
    jitted = jax.jit(lambda p, t, pos, c: p.forward(t, pos, c)[2])
    over = jitted(policy, step, step_pos, cache)
    np.testing.assert_array_equal(over.lengths, [9, 3])
    np.testing.assert_array_equal(over.overflowed, [True, False])
    fits = jitted(policy, step, np.array([[6, 7, -1], [0, 1, 2]], np.int32), cache)
    np.testing.assert_array_equal(fits.lengths, [8, 3])
    np.testing.assert_array_equal(fits.overflowed, [False, False])
    np.testing.assert_array_equal(over.k, fits.k)
    np.testing.assert_array_equal(over.v, fits.v)
    np.testing.assert_array_equal(over.k[:, 0, :6], cache.k[:, 0, :6])
    assert np.abs(np.asarray(over.k[:, 0, 6:8])).min() > 0  # the two that fit were written


def test_policy_passes_through_jit_without_recompiling(qwen3_policies, make_policy):
    policy = qwen3_policies["float32"]
    other = make_policy(policy.config, seed=7)
    tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
    positions = np.tile(np.arange(4, dtype=np.int32), (2, 1))
    traces = []

    @jax.jit
    def logits_fn(p, t, pos):
        traces.append(1)
        return p.forward(t, pos)[0]

    a = logits_fn(policy, tokens, positions)
    b = logits_fn(other, tokens, positions)
    assert len(traces) == 1  # new param values, same config: no new trace
    np.testing.assert_allclose(a, policy.forward(tokens, positions)[0], atol=1e-6)
    np.testing.assert_allclose(b, other.forward(tokens, positions)[0], atol=1e-6)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2
    assert a.dtype == jnp.float32


def test_with_config_rebuilds_the_graph_and_astype_casts(qwen3_policies):
    policy = qwen3_policies["float32"]
    tokens = np.zeros((1, 2), np.int32)
    positions = np.array([[0, 1]], np.int32)
    # The backend setting is a new config over the same params; an unknown backend is
    # refused by ModelConfig itself (the names of jaxspec.kernels.BACKENDS).
    triton = policy.with_config(attention_backend="triton")
    assert triton.config.attention_backend == "triton"
    assert triton.params is policy.params
    if jax.default_backend() != "gpu":  # the setting reaches the kernel call (a forward with a
        # mask: one with no cache and no mask takes model.train_attention instead)
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            triton.forward(tokens, positions, mask=np.tril(np.ones((1, 2, 2), bool)))
    with pytest.raises(ValueError, match="no-such-backend"):
        policy.with_config(attention_backend="no-such-backend")
    with pytest.raises(ValueError, match=r"changes the parameters"):
        policy.with_config(intermediate_size=96)
    cast = policy.astype("bfloat16")
    assert cast.config == qwen3_policies["bfloat16"].config
    for a, b in zip(jax.tree.leaves(cast.params), jax.tree.leaves(qwen3_policies["bfloat16"].params)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a, b)


def test_embed_is_the_token_embedding(qwen3_policies):
    policy = qwen3_policies["bfloat16"]
    tokens = np.array([[3, 7]], np.int32)
    emb = policy.embed(tokens)
    assert emb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(emb[0], policy.params["embed_tokens"][...][tokens[0]])


GOLDEN_AXES = {
    "embed_tokens": ("vocab", "embed"),
    "norm/scale": ("embed",),
    "layers/input_layernorm/scale": ("layers", "embed"),
    "layers/post_attention_layernorm/scale": ("layers", "embed"),
    "layers/self_attn/q_proj": ("layers", "embed", "heads", "head_dim"),
    "layers/self_attn/k_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/self_attn/v_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/self_attn/o_proj": ("layers", "heads", "head_dim", "embed"),
    "layers/self_attn/q_norm/scale": ("layers", "head_dim"),
    "layers/self_attn/k_norm/scale": ("layers", "head_dim"),
    "layers/mlp/gate_proj": ("layers", "embed", "mlp"),
    "layers/mlp/up_proj": ("layers", "embed", "mlp"),
    "layers/mlp/down_proj": ("layers", "mlp", "embed"),
    "lm_head": ("embed", "vocab"),
}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_logical_axes_are_pinned(family):
    from jaxspec.models import Policy

    policy = Policy.abstract(ModelConfig.tiny(family))
    specs = jax.tree_util.tree_flatten_with_path(
        policy.logical_axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )[0]
    got = {"/".join(k.key for k in path if hasattr(k, "key")): tuple(s) for path, s in specs}
    want = dict(GOLDEN_AXES)
    if family == "qwen3":  # tied embeddings, QK-norm
        del want["lm_head"]
    else:
        del want["layers/self_attn/q_norm/scale"], want["layers/self_attn/k_norm/scale"]
    assert got == want
    shapes = {
        "/".join(k.key for k in path if hasattr(k, "key")): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(policy.params)[0]
    }
    assert all(len(shapes[name]) == len(axes) for name, axes in got.items())


def test_default_eagle3_layers():
    assert default_eagle3_layers(36) == (1, 17, 32)
    assert default_eagle3_layers(28) == (1, 13, 24)
    assert default_eagle3_layers(3) == (1, 0, 0)
    assert default_eagle3_layers(1) == (0, 0, 0)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig.tiny(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="dtype='float16'"):
        ModelConfig.tiny(dtype="float16")
    with pytest.raises(ValueError, match="family='gpt2'"):
        ModelConfig.tiny("gpt2")
