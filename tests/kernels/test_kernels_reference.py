"""The jnp reference against an independent per-query numpy softmax."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import tree_attention_reference
from jaxspec.testing.tree_attention import ARG_ORDER, make_inputs, numpy_reference, rel_err


def naive_tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=None):
    """One query at a time in float64: gather the keys it may see, softmax, weighted sum."""
    b, n, hq, d = q.shape
    group = hq // k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = np.zeros((b, n, hq, d))
    for i in range(b):
        for node in range(n):
            for h in range(hq):
                kv = h // group
                visible = [j for j in range(n) if tree_mask[i, node, j]]
                keys = np.concatenate([k_cache[i, : cache_lengths[i], kv], k_new[i, visible, kv]])
                values = np.concatenate([v_cache[i, : cache_lengths[i], kv], v_new[i, visible, kv]])
                if len(keys) == 0:
                    continue  # nothing to attend to: zeros
                logits = keys.astype(np.float64) @ q[i, node, h].astype(np.float64) * scale
                w = np.exp(logits - logits.max())
                out[i, node, h] = (w / w.sum()) @ values
    return out


def test_reference_matches_naive_softmax():
    x = make_inputs(0, batch=5, max_len=7, nodes=4, q_heads=4, kv_heads=2, head_dim=8)
    # Row 0 has an empty cache; give its node 2 an empty mask row too: it sees nothing.
    x["tree_mask"][0, 2] = False
    args = [x[k] for k in ARG_ORDER]
    for scale in (None, 0.3):
        out = np.asarray(
            jax.jit(tree_attention_reference, static_argnames="scale")(*args, scale=scale)
        )
        want = naive_tree_attention(*args, scale=scale)
        assert rel_err(out, want) < 1e-6
        # The vectorised numpy copy used where jnp should not run (Triton interpreter test).
        assert rel_err(numpy_reference(*args, scale=scale), want) < 1e-12
        assert np.all(out[0, 2] == 0)


def test_reference_is_gqa_of_repeated_heads():
    """GQA ratio 4 equals MHA on kv heads repeated 4 times (head h uses kv head h // 4)."""
    x = make_inputs(1, batch=3, max_len=9, nodes=3, q_heads=8, kv_heads=2, head_dim=8)
    args = [x[k] for k in ARG_ORDER]
    mha = dict(x)
    for k in ("k_cache", "v_cache", "k_new", "v_new"):
        mha[k] = np.repeat(x[k], 4, axis=2)
    reference = jax.jit(tree_attention_reference)
    out = reference(*args)
    want = reference(*[mha[k] for k in ARG_ORDER])
    assert rel_err(out, want) < 1e-6


def test_reference_gradient_matches_float64_finite_differences():
    """jax.grad of the reference (the backward every backend uses) against central finite
    differences of the independent float64 numpy attention, along random directions."""
    x = make_inputs(2, batch=3, max_len=6, nodes=4, q_heads=4, kv_heads=2, head_dim=8)
    args = [x[k] for k in ARG_ORDER]
    float_ids = (0, 1, 2, 4, 5)  # q, k_cache, v_cache, k_new, v_new
    weights = np.random.default_rng(3).standard_normal(np.shape(x["q"]))

    def loss_np(*floats):
        full = list(args)
        for i, f in zip(float_ids, floats):
            full[i] = f
        return float(np.sum(weights * np.sin(numpy_reference(*full))))

    def loss_jax(*floats):
        full = list(args)
        for i, f in zip(float_ids, floats):
            full[i] = f
        return jnp.sum(weights * jnp.sin(tree_attention_reference(*full)))

    floats = [np.asarray(args[i], np.float64) for i in float_ids]
    grads = jax.jit(jax.grad(loss_jax, argnums=range(5)))(*[jnp.asarray(f, jnp.float32) for f in floats])
    rng = np.random.default_rng(4)
    for which, grad in enumerate(grads):
        for _ in range(3):
            direction = rng.standard_normal(floats[which].shape)
            eps = 1e-5
            plus = [f + eps * direction if i == which else f for i, f in enumerate(floats)]
            minus = [f - eps * direction if i == which else f for i, f in enumerate(floats)]
            numeric = (loss_np(*plus) - loss_np(*minus)) / (2 * eps)
            analytic = float(np.sum(np.asarray(grad, np.float64) * direction))
            assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), (which, analytic, numeric)
