"""Draft training without [T, T] score arrays (issue 49): the TTT attention in query blocks at
any T (the query side padded to a block multiple), and the MTP unroll through it, against the
dense (s+1)T-entry forward its mask defines."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.rl.draft import _QUERY_BLOCK, _ttt_attention, mtp_hidden
from jaxspec.testing.torch_mtp import random_head


@pytest.mark.parametrize("mask_diag", [False, True])
def test_ttt_attention_padded_to_query_blocks_equals_the_whole(mask_diag):
    """T = 10 in blocks of 4 (the last block padded by 2 rows) equals it whole, values and
    gradients; the padded rows change nothing."""
    keys = jax.random.split(jax.random.key(3), 7)
    b, t, hkv, g, d = 2, 10, 2, 2, 8
    q = jax.random.normal(keys[0], (b, t, hkv * g, d))
    k0, v0, k1, v1, k2, v2 = (jax.random.normal(k, (b, t, hkv, d)) for k in keys[1:])
    valid = jnp.arange(t)[None, :] < jnp.array([[10], [7]])

    def f(q, k0, k1, v2, block):
        return _ttt_attention(q, k0, v0, [k1, k2], [v1, v2], valid, block=block,
                              mask_diag=mask_diag)

    args = (q, k0, k1, v2)
    np.testing.assert_allclose(f(*args, 4), f(*args, 64), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a[:4], a[4]))), argnums=(0, 1, 2, 3))
    for got, want in zip(grad(*args, 4), grad(*args, 64)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _dense_mtp_hidden(head, params, embed_fn, features, tokens, positions, steps,
                      diagonal=True):
    """The unroll as one forward of the head over all (s+1)T entries at step s, with the mask
    the drafter's cache implies: an entry of step s_q at base position a sees the step-0
    entries at positions <= a and the entries of steps 1..s_q at a (the forward's mask
    excludes padding entries). diagonal=False: without the steps 1..s_q (negative control)."""
    b, t = tokens.shape
    head = head.__class__(head.config, head.graphdef, params, head.buffers)
    inputs = [features]
    out = []
    for s in range(steps):
        n = (s + 1) * t
        embeds = jnp.concatenate([embed_fn(jnp.roll(tokens, -(1 + j), axis=1))
                                  for j in range(s + 1)], axis=1)
        pos = jnp.concatenate([jnp.where(positions >= 0, positions + j, -1)
                               for j in range(s + 1)], axis=1)
        step = jnp.repeat(jnp.arange(s + 1), t)[:, None]  # [n, 1] each query entry's step
        at = jnp.tile(jnp.arange(t), s + 1)[:, None]  # [n, 1] its base position
        mask = (((step.T == 0) & (at.T <= at))  # step-0 keys at positions <= its own
                | (diagonal & (step.T >= 1) & (step.T <= step) & (at.T == at)))  # 1..s_q at its own
        h, _ = head.forward(embeds, jnp.concatenate(inputs, axis=1), pos, head.init_cache(b, n),
                            mask=jnp.broadcast_to(jnp.asarray(mask), (b, n, n)), fuse=True)
        out.append(h[:, s * t:])
        inputs.append(out[-1])
    return out


def _inputs(policy, b, t, lengths, seed):
    rng = np.random.default_rng(seed)
    idx = np.arange(t)[None, :]
    positions = np.where(idx < np.array(lengths)[:, None], idx, -1).astype(np.int32)
    tokens = np.where(positions >= 0, rng.integers(0, policy.config.vocab_size, (b, t)), 0)
    features = rng.standard_normal((b, t, policy.config.hidden_size)).astype(np.float32)
    return jnp.asarray(features), jnp.asarray(tokens, jnp.int32), jnp.asarray(positions)


@pytest.fixture(scope="module")
def policy_and_head():
    policy = random_policy(ModelConfig.tiny("qwen3"), seed=3)
    return policy, random_head(policy, seed=4)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_mtp_hidden_and_gradients_equal_the_dense_mask_forward(policy_and_head, steps):
    """float32, right padding (rows of 9, 6 and 3 real tokens of 9): every step's hidden
    states, padding rows included, and the parameters' gradients."""
    policy, head = policy_and_head
    features, tokens, positions = _inputs(policy, 3, 9, [9, 6, 3], seed=steps)
    assert head.config.layer.param_dtype == jnp.float32

    def run(fn):
        def loss(params):
            hs = fn(head, params, policy.embed, features, tokens, positions, steps)
            return sum(jnp.sum(jnp.sin(h) * (i + 1)) for i, h in enumerate(hs)), hs
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(head.params)

    (_, got), got_g = run(mtp_hidden)
    (_, want), want_g = run(_dense_mtp_hidden)
    assert len(got) == steps
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, float(np.abs(w).max())), rtol=0)
    if steps > 1:  # negative control: the mask without the steps 1..s_q is another function
        other = _dense_mtp_hidden(head, head.params, policy.embed, features, tokens, positions,
                                  steps, diagonal=False)
        assert np.abs(np.asarray(other[-1]) - np.asarray(got[-1])).max() > 1e-2


def test_mtp_hidden_past_one_query_block_equals_the_dense_mask_forward(policy_and_head):
    """T = 600 (the query side padded to 2 blocks of 512), two steps, with padding."""
    policy, head = policy_and_head
    features, tokens, positions = _inputs(policy, 2, 600, [600, 555], seed=7)
    got, want = (jax.jit(lambda f, t, p, fn=fn: fn(head, head.params, policy.embed, f, t, p, 2))(
        features, tokens, positions) for fn in (mtp_hidden, _dense_mtp_hidden))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_mtp_training_program_holds_no_t_by_t_array(policy_and_head):
    """The jitted loss-and-gradient of a 3-step unroll at T = 2,500 (5 query blocks of 512):
    no array with two dims >= T / 2 (the dense form's (s+1)T-square scores are 7,500^2)."""
    policy, head = policy_and_head
    b, t = 1, 2500
    assert _QUERY_BLOCK < t // 2
    features = jax.ShapeDtypeStruct((b, t, policy.config.hidden_size), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def step(fn, steps):
        def grads(params, features, tokens, positions):
            return jax.grad(lambda p: sum(jnp.sum(h ** 2) for h in fn(
                head, p, policy.embed, features, tokens, positions, steps)))(params)
        return jax.jit(grads).lower(head.params, features, ids, ids).compile().as_text()

    def big_square(text):
        shapes = re.findall(r"\[([0-9,]+)\]", text)
        return [s for s in shapes if sum(int(n) >= t // 2 for n in s.split(",")) >= 2]

    assert big_square(step(mtp_hidden, 3)) == []
    assert big_square(step(_dense_mtp_hidden, 1))  # negative control: [T, T] already at 1 step
