"""The LM-head losses computed in chunks (jaxspec.rl.chunked) against float64 NumPy of the whole
logits, their gradients against the closed-form softmax gradients, the chunked EAGLE-3 draft
loss against the unchunked one, micro-batching against one forward, and XLA's compiled memory
of the chunked logprob stage against the size of the logits it no longer holds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.transformer import random_policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.rl import chunked
from jaxspec.rl.draft import DraftLossConfig, TargetHead, draft_loss, draft_train_step
from jaxspec.rl.grpo import GRPOConfig, k3_kl
from jaxspec.rl.steps import POLICY_INPUTS, policy_update, score_rollouts

H, V = 16, 40
_SGD = optax.sgd(1.0)  # params move by the gradient itself: a gradient difference shows as is


def _np_reference(h, w, targets, temperature, top_k=0, top_p=1.0):
    """float64 log p(target), entropy, p, kept of softmax(h @ w / T) restricted to the top-k /
    top-p set (a token is kept when fewer than k tokens are strictly larger and the tokens
    strictly larger carry less than top_p of the top-k mass). The counts and masses of the
    strictly larger tokens come from each row sorted ascending (searchsorted past ties), so a
    9000-token vocabulary needs no [V, V] comparison."""
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64) / (temperature or 1.0)
    rows = z.reshape(-1, z.shape[-1])
    order = np.sort(rows, axis=-1)
    # per row: where each z_i's strictly larger tokens start in the ascending order
    first_above = np.stack([np.searchsorted(o, r, side="right") for o, r in zip(order, rows)])
    above_count = (rows.shape[-1] - first_above).reshape(z.shape)
    kept = np.ones(z.shape, bool) if not top_k else above_count < top_k
    q = np.where(kept, np.exp(z - z.max(-1, keepdims=True)), 0.0)
    q /= q.sum(-1, keepdims=True)
    if top_p < 1.0:  # the kept mass of the strictly larger tokens: a suffix sum of the order
        q_rows = q.reshape(-1, q.shape[-1])
        q_sorted = np.take_along_axis(q_rows, np.argsort(rows, axis=-1, kind="stable"), -1)
        suffix = np.concatenate([np.cumsum(q_sorted[:, ::-1], -1)[:, ::-1],
                                 np.zeros((len(q_rows), 1))], -1)
        mass_above = np.take_along_axis(suffix, first_above, -1).reshape(z.shape)
        kept &= mass_above < top_p
    logp = np.where(kept, z, -np.inf)
    top = z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp - top).sum(-1, keepdims=True)) - top
    p = np.exp(logp)
    lp = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    entropy = -np.where(p > 0, p * np.where(kept, logp, 0.0), 0.0).sum(-1)
    return lp, entropy, p, np.where(kept, logp, 0.0)


def _np_reference_pairwise(h, w, targets, temperature, top_k=0, top_p=1.0):
    """The same by the [V, V] comparison of every pair (small vocabularies only): checks the
    sorted reference above."""
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64) / (temperature or 1.0)
    above = z[..., None, :] > z[..., :, None]  # [..., i, j]: z_j > z_i
    kept = np.ones(z.shape, bool) if not top_k else above.sum(-1) < top_k
    q = np.where(kept, np.exp(z - z.max(-1, keepdims=True)), 0.0)
    q /= q.sum(-1, keepdims=True)
    if top_p < 1.0:
        kept &= (np.where(above, q[..., None, :], 0.0).sum(-1) < top_p)
    return kept


def test_the_sorted_reference_keeps_what_the_pairwise_one_keeps():
    rng = np.random.default_rng(3)
    h = rng.standard_normal((4, 6, 8))
    w = np.round(rng.standard_normal((8, 300)), 1)  # rounded: ties among the logits
    w[:, 150:] = w[:, :150]  # and exact duplicate columns
    targets = np.zeros((4, 6), np.int32)
    for top_k, top_p in ((0, 1.0), (7, 1.0), (0, 0.6), (12, 0.8), (1, 0.3)):
        kept = _np_reference(h, w, targets, 0.9, top_k, top_p)[2] > 0.0
        want = _np_reference_pairwise(h, w, targets, 0.9, top_k, top_p)
        np.testing.assert_array_equal(kept, want, err_msg=(top_k, top_p))


def _np_grads(h, w, targets, temperature, d_lp, d_entropy, **filters):
    """Closed-form d/dh and d/dw of sum(d_lp * lp + d_entropy * entropy): with p the kept
    distribution, dlp/dz = onehot - p and dH/dz = -p (log p + H), then z = h w / T."""
    lp, entropy, p, logp = _np_reference(h, w, targets, temperature, **filters)
    onehot = np.eye(w.shape[1])[targets]
    dz = d_lp[..., None] * (onehot - p) - d_entropy[..., None] * p * (logp + entropy[..., None])
    dz /= temperature or 1.0
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    return dz @ w64.T, h64.reshape(-1, h64.shape[-1]).T @ dz.reshape(-1, dz.shape[-1])


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((3, 5, H)).astype(np.float32)
    w = (rng.standard_normal((H, V)) / 2).astype(np.float32)
    targets = rng.integers(0, V, (3, 5)).astype(np.int32)
    return h, w, targets


@pytest.mark.parametrize("chunk", [7, 8, 0])  # 7 does not divide V = 40, 8 does, 0 = whole
@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_unfiltered_logprobs_entropy_and_gradients_match_float64(chunk, vocab_axis):
    h, w, targets = _inputs()
    temperature = 0.7
    weight = w.T if vocab_axis == 0 else w
    sampling = SamplingConfig(temperature)

    def f(h, weight):
        return chunked.token_logprobs(h, weight, targets, sampling, vocab_axis=vocab_axis,
                                      chunk=chunk)

    lp, entropy = jax.jit(f)(jnp.asarray(h), jnp.asarray(weight))
    want_lp, want_entropy, _, _ = _np_reference(h, w, targets, temperature)
    np.testing.assert_allclose(lp, want_lp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=2e-5, rtol=1e-5)

    rng = np.random.default_rng(1)
    d_lp, d_entropy = rng.standard_normal((2, 3, 5))
    dh, dw = jax.jit(jax.grad(lambda h, w: jnp.sum(d_lp * f(h, w)[0] + d_entropy * f(h, w)[1]),
                              argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(weight))
    want_dh, want_dw = _np_grads(h, w, targets, temperature, d_lp, d_entropy)
    np.testing.assert_allclose(dh, want_dh, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(dw.T if vocab_axis == 0 else dw, want_dw, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [3, 0])
def test_filtered_logprobs_use_row_chunks_and_match_float64(chunk):
    """top-k / top-p: rows of the whole vocabulary (3 x 5 x 3 // 40 = 1 row per chunk)."""
    h, w, targets = _inputs(2)
    filters = dict(top_k=6, top_p=0.8)
    _, _, p, _ = _np_reference(h, w, targets, 1.3, **filters)
    targets = p.argmax(-1).astype(np.int32)  # rollout tokens are always in the kept set
    sampling = SamplingConfig(1.3, 6, 0.8)

    def f(h, w):
        return chunked.token_logprobs(h, w, targets, sampling, vocab_axis=1, filtered=True,
                                      chunk=chunk)

    lp, entropy = jax.jit(f)(jnp.asarray(h), jnp.asarray(w))
    want_lp, want_entropy, _, _ = _np_reference(h, w, targets, 1.3, **filters)
    np.testing.assert_allclose(lp, want_lp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=2e-5, rtol=1e-5)
    d_lp, d_entropy = np.random.default_rng(3).standard_normal((2, 3, 5))
    dh, dw = jax.jit(jax.grad(lambda h, w: jnp.sum(d_lp * f(h, w)[0] + d_entropy * f(h, w)[1]),
                              argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
    want_dh, want_dw = _np_grads(h, w, targets, 1.3, d_lp, d_entropy, **filters)
    np.testing.assert_allclose(dh, want_dh, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(dw, want_dw, atol=2e-5, rtol=1e-4)


def test_kl_gradient_through_chunked_logprobs_matches_float64():
    """k3 KL to a reference, differentiated through the chunked log-probs: the chain rule on
    the closed form, d k3 / d lp = 1 - e^(ref - lp)."""
    h, w, targets = _inputs(4)
    ref_lp = _np_reference(h, w, targets, 1.0)[0] + np.random.default_rng(5).normal(0, 0.3, (3, 5))
    sampling = SamplingConfig(1.0)

    def kl(h, w):
        lp, _ = chunked.token_logprobs(h, w, targets, sampling, vocab_axis=1, chunk=9)
        return jnp.sum(k3_kl(lp, jnp.asarray(ref_lp, jnp.float32)))

    lp = _np_reference(h, w, targets, 1.0)[0]
    np.testing.assert_allclose(jax.jit(kl)(jnp.asarray(h), jnp.asarray(w)),
                               np.sum(np.exp(ref_lp - lp) - (ref_lp - lp) - 1), rtol=1e-5)
    dh, dw = jax.jit(jax.grad(kl, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
    want_dh, want_dw = _np_grads(h, w, targets, 1.0, 1 - np.exp(ref_lp - lp), np.zeros((3, 5)))
    np.testing.assert_allclose(dh, want_dh, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(dw, want_dw, atol=2e-5, rtol=1e-4)


def test_chunked_argmax_is_the_first_maximum():
    h, w, _ = _inputs(6)
    w[:, 33] = w[:, 5]  # a tie across chunks: the earlier token wins, as jnp.argmax
    h = h.reshape(-1, H)
    got = chunked.argmax(jnp.asarray(h), jnp.asarray(w), vocab_axis=1, chunk=7)
    np.testing.assert_array_equal(got, np.argmax(h.astype(np.float64) @ w, -1))


@pytest.fixture(scope="module")
def policy():
    return random_policy(ModelConfig.tiny(vocab_size=V * 3), seed=0)


@pytest.mark.parametrize("tied,chunk", [(True, 7), (False, 10)])
def test_chunked_draft_loss_matches_the_unchunked_loss_and_gradients(tied, chunk):
    """TargetHead (policy hidden + LM head, chunks of 7 / 10 over V = 120 and Vd = 50) vs the
    whole [B, T, V] target logits."""
    policy = random_policy(ModelConfig.tiny(vocab_size=V * 3, tie_embeddings=tied), seed=1)
    head = Eagle3Head.init_for(policy, 50, jax.random.key(3)).with_vocab(np.arange(50) * 2 + 1)
    b, t = 2, 9
    tokens = jax.random.randint(jax.random.key(6), (b, t), 0, V * 3)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, captured, _ = policy.forward(tokens, positions, capture=head.capture_layers)
    hidden, _, _ = policy.forward(tokens, positions, head=False)
    feats = jnp.concatenate([captured[i] for i in head.capture_layers], axis=-1)
    mask = jnp.arange(t)[None, :] >= jnp.array([[2], [1]])
    weight, axis = chunked.lm_head(policy)
    cfg = DraftLossConfig(steps=2, decay=0.8, chunk=chunk)

    def loss(params, target):
        return draft_loss(head, params, policy.embed, feats, tokens, target, mask, cfg)

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (want, want_m), want_g = step(head.params, logits)
    (got, got_m), got_g = step(head.params, TargetHead(hidden, weight, vocab_axis=axis))
    assert float(want_m["draft_loss_0"]) > 0  # some positions count
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for k in want_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=2e-5, atol=1e-6, err_msg=k)
    for a, e in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)


def test_micro_batched_draft_update_equals_one_batch():
    """draft_train_step over micro-batches of 2 rows (gradient accumulated, per-step counts of
    the whole batch) equals one batch: metrics and the SGD-updated head."""
    policy = random_policy(ModelConfig.tiny(vocab_size=V * 3, tie_embeddings=False), seed=2)
    head = Eagle3Head.init_for(policy, 50, jax.random.key(4)).with_vocab(np.arange(50) * 2 + 1)
    b, t = 4, 8
    tokens = jax.random.randint(jax.random.key(7), (b, t), 0, V * 3)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden, captured, _ = policy.forward(tokens, positions, capture=head.capture_layers, head=False)
    feats = jnp.concatenate([captured[i] for i in head.capture_layers], axis=-1)
    mask = jnp.arange(t)[None, :] >= jnp.array([[2], [1], [5], [3]])
    target = TargetHead(hidden, *chunked.lm_head(policy))
    out = {}
    for micro in (0, 2):
        cfg = DraftLossConfig(steps=2, decay=0.8, chunk=16, micro_batch=micro)
        out[micro] = jax.jit(lambda h: draft_train_step(
            h, _SGD.init(h.params), _SGD, policy.embed, feats, tokens, target, mask, cfg))(head)
    assert float(out[0][2]["draft_loss_0"]) > 0
    for k, v in out[0][2].items():
        np.testing.assert_allclose(out[2][2][k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    for a, e in zip(jax.tree.leaves(out[2][0].params), jax.tree.leaves(out[0][0].params)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def _batch(policy, b=4, p=3, n=6, seed=0):
    rng = np.random.default_rng(seed)
    v = policy.config.vocab_size
    return (jnp.asarray(rng.integers(1, v, (b, p)), jnp.int32), jnp.array([3, 2, 3, 1][:b], jnp.int32),
            jnp.asarray(rng.integers(1, v, (b, n)), jnp.int32), jnp.array([6, 4, 1, 5][:b], jnp.int32),
            jnp.asarray(rng.normal(-2, 0.5, (b, n)), jnp.float32))


def test_micro_batched_scoring_and_update_equal_one_forward(policy):
    """score_rollouts and policy_update with micro_batch=2 (and chunk 7) equal the whole
    batch unchunked: same log-probs, metrics and new params (float tolerance)."""
    sampling = SamplingConfig(0.9)
    batch = _batch(policy)
    whole = score_rollouts(policy, policy.params, *batch, sampling, chunk=0)
    micro = score_rollouts(policy, policy.params, *batch, sampling, chunk=7, micro_batch=2)
    for k in whole:
        np.testing.assert_allclose(micro[k], whole[k], rtol=1e-5, atol=1e-5, err_msg=k)
    scored = {k: whole[k] for k in POLICY_INPUTS}
    scored["logprobs"] = scored["logprobs"] - 0.05  # ratios away from 1: the clip is exercised
    adv = jnp.array([1.0, -0.5, 0.3, -0.8])
    optimizer = _SGD  # params move by the gradient itself: a gradient difference shows as is
    out = {}
    for name, cfg in (("whole", GRPOConfig(logprob_chunk=0)),
                      ("micro", GRPOConfig(logprob_chunk=7, micro_batch=2))):
        out[name] = policy_update(policy, optimizer.init(policy.params), scored, adv, sampling,
                                  optimizer=optimizer, grpo_cfg=cfg, minibatches=1, filtered=False)
    for k, v in out["whole"][2].items():
        np.testing.assert_allclose(out["micro"][2][k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    for a, e in zip(jax.tree.leaves(out["micro"][0].params), jax.tree.leaves(out["whole"][0].params)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def test_bad_chunk_and_micro_batch_are_errors_before_compiling(policy):
    with pytest.raises(ValueError, match=r"GRPOConfig.logprob_chunk=-1 .*>= 0"):
        GRPOConfig(logprob_chunk=-1)
    with pytest.raises(ValueError, match=r"GRPOConfig.micro_batch=1.5"):
        GRPOConfig(micro_batch=1.5)
    with pytest.raises(ValueError, match=r"micro_batch=3 does not divide the 4 rows"):
        score_rollouts(policy, None, *_batch(policy), SamplingConfig(1.0), micro_batch=3)
    from jaxspec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="grpo.micro_batch"):
        load_config(None, ["grpo.micro_batch=7"])


def test_chunked_scoring_compiles_to_far_less_memory_than_its_logits():
    """XLA's compiled temp memory of the logprob stage at B x T x V = 8 x 256 x 32768 (256 MiB
    of float32 logits): unchunked it holds them (temp > the logits, 512 MiB measured), chunked
    by 512 it needs under an eighth of them (26 MiB measured, mostly attention and the
    weight's chunked copy). Abstract params: nothing is allocated."""
    config = ModelConfig.tiny(vocab_size=32_768, tie_embeddings=False)
    policy = Policy.abstract(config)
    b, p, n = 8, 64, 192
    args = (jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n), jnp.float32))
    logits_bytes = b * (p + n) * config.vocab_size * 4
    temp = {}
    for chunk in (0, 512):
        compiled = score_rollouts.lower(policy, None, *args, SamplingConfig(1.0), chunk=chunk).compile()
        temp[chunk] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[0] > logits_bytes, temp
    assert temp[512] < logits_bytes / 8 and temp[512] < temp[0] / 15, temp


def test_ttt_attention_in_query_blocks_equals_the_whole():
    """The draft's TTT attention in blocks of 4 query rows (T = 12) equals it computed whole,
    values and gradients."""
    from jaxspec.rl.draft import _ttt_attention

    keys = jax.random.split(jax.random.key(9), 7)
    b, t, hkv, g, d = 2, 12, 2, 2, 8
    q = jax.random.normal(keys[0], (b, t, hkv * g, d))
    k0, v0, k1, v1, k2, v2 = (jax.random.normal(k, (b, t, hkv, d)) for k in keys[1:])
    valid = jnp.arange(t)[None, :] < jnp.array([[12], [9]])

    def f(q, block):
        return _ttt_attention(q, k0, v0, [k1, k2], [v1, v2], valid, block=block)

    np.testing.assert_allclose(f(q, 4), f(q, 64), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda q, block: jnp.sum(jnp.sin(f(q, block))), argnums=0)
    np.testing.assert_allclose(grad(q, 4), grad(q, 64), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- the invariant reduction
# A vocabulary of 3 COL_TILEs (the last one partial): the invariant scorer's chunked path
# (two scans: the row max, then block sums) against float64 NumPy, its gradients against the
# closed form and against jax.nn.log_softmax's, and chunk-size independence bit for bit.
VI = 9000


def _invariant_inputs(seed):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((3, 5, H)).astype(np.float32)
    w = (rng.standard_normal((H, VI)) / 2).astype(np.float32)
    return h, w, rng.integers(0, VI, (3, 5)).astype(np.int32)


@pytest.mark.parametrize("temperature, filters", [(0.7, {}), (1.3, dict(top_k=6, top_p=0.8)),
                                                  (0.0, {})])
def test_invariant_logprobs_and_gradients_match_float64_at_any_chunk(temperature, filters):
    """Temperature 0 scores the unscaled, unfiltered softmax (the generator's convention)."""
    h, w, targets = _invariant_inputs(6)
    sampling = SamplingConfig(temperature, filters.get("top_k", 0), filters.get("top_p", 1.0))
    if filters:
        targets = _np_reference(h, w, targets, temperature, **filters)[2].argmax(-1).astype(np.int32)
    d_lp, d_entropy = np.random.default_rng(7).standard_normal((2, 3, 5))
    want_lp, want_entropy, _, _ = _np_reference(h, w, targets, temperature, **filters)
    want_dh, want_dw = _np_grads(h, w, targets, temperature, d_lp, d_entropy, **filters)
    results = []
    for chunk in (4096, 5000, 0):  # chunks are whole COL_TILEs: 5000 runs as 8192
        def f(h, w, chunk=chunk):
            return chunked.token_logprobs(h, w, targets, sampling, vocab_axis=1,
                                          filtered=bool(filters), chunk=chunk, invariant=True)

        lp, entropy = jax.jit(f)(jnp.asarray(h), jnp.asarray(w))
        grads = jax.jit(jax.grad(lambda h, w: jnp.sum(d_lp * f(h, w)[0] + d_entropy * f(h, w)[1]),
                                 argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
        results.append((np.asarray(lp), np.asarray(entropy)))
        np.testing.assert_allclose(lp, want_lp, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(entropy, want_entropy, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(grads[0], want_dh, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(grads[1], want_dw, atol=2e-5, rtol=1e-4)
        if not filters:  # d lp / d(h, w) as jax.nn.log_softmax's autodiff gives it
            def plain(h, w):
                z = (h @ w) / (temperature or 1.0)
                lp = jnp.take_along_axis(jax.nn.log_softmax(z), targets[..., None], -1)[..., 0]
                return jnp.sum(d_lp * lp)
            ref = jax.grad(plain, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
            got = jax.grad(lambda h, w: jnp.sum(d_lp * f(h, w)[0]), argnums=(0, 1))(
                jnp.asarray(h), jnp.asarray(w))
            for a, b in zip(got, ref):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    for lp, entropy in results[1:]:  # the same bits at every chunk size
        np.testing.assert_array_equal(lp, results[0][0])
        np.testing.assert_array_equal(entropy, results[0][1])


def test_invariant_draft_soft_cross_entropy_is_chunk_independent_and_matches_float64():
    rng = np.random.default_rng(8)
    th = rng.standard_normal((6, H)).astype(np.float32)
    tw = (rng.standard_normal((H, VI)) / 2).astype(np.float32)
    dh = rng.standard_normal((6, 12)).astype(np.float32)
    dw = (rng.standard_normal((12, VI)) / 2).astype(np.float32)
    zt, zq = th.astype(np.float64) @ tw, dh.astype(np.float64) @ dw
    p = np.exp(zt - zt.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logq = zq - zq.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    want = -(p * logq).sum(-1)
    outs = []
    for chunk in (4096, 7000, 0):
        ce, agree = chunked.soft_cross_entropy(jnp.asarray(th), jnp.asarray(tw), jnp.asarray(dh),
                                               jnp.asarray(dw), chunk=chunk, invariant=True)
        np.testing.assert_allclose(ce, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(agree, zt.argmax(-1) == zq.argmax(-1))
        outs.append(np.asarray(ce))
        grad = jax.grad(lambda d: jnp.sum(chunked.soft_cross_entropy(
            jnp.asarray(th), jnp.asarray(tw), d, jnp.asarray(dw), chunk=chunk,
            invariant=True)[0]))(jnp.asarray(dh))
        q = np.exp(logq)
        np.testing.assert_allclose(grad, (q - p) @ dw.T.astype(np.float64), atol=1e-5, rtol=1e-4)
    for ce in outs[1:]:
        np.testing.assert_array_equal(ce, outs[0])
