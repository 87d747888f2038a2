"""The batch-invariant forward of the hybrid family (`ModelConfig.batch_invariant` with
family qwen3_5 / qwen3_next): a row's bits do not depend on the forward it is in.

References: the same row computed alone in one full-sequence (training) forward, for the
logits of a batched forward, of one-token decode steps, of a deferred verify and of the
forward after its commit; plain decoding, token for token and log-prob for log-prob, for
every chain drafter under replay with refilled slots, a grown cache and adaptive k, in float32
and bfloat16. Negative control: without the mode the same comparisons find differing bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.policy_cache import keep_accepted
from jaxspec.models.gated_deltanet import UNROLL_TOKENS, delta_rule_invariant
from jaxspec.testing.hybrid_invariant import (
    assert_speculative_is_plain_bitwise,
    hybrid_policy,
    plain_rollouts,
)

SEQ = 22  # tokens per row of the forward tests: more than UNROLL_TOKENS (the rule scans)


def _sequences():  # -> tokens [3, SEQ], lengths [3]: ragged rows, right-padded
    rng = np.random.default_rng(0)
    lengths = np.array([SEQ, 17, 9])
    return np.where(np.arange(SEQ) < lengths[:, None], rng.integers(0, 128, (3, SEQ)), 0), lengths


def _positions(lengths, width):  # [B, width]: 0.. for the real tokens, -1 padding
    at = np.arange(width)[None, :]
    return np.where(at < lengths[:, None], at, -1).astype(np.int32)


def _alone(policy, tokens, lengths):  # -> [row][n, V]: each row in a full forward by itself
    return [np.asarray(policy.forward(tokens[i:i + 1], _positions(lengths[i:i + 1], SEQ))[0][0,
                                                                                          :n])
            for i, n in enumerate(lengths)]


def _decoded(policy, tokens, lengths):  # -> [row][n, V]: a prefill of 5, then decode steps
    cache = policy.init_cache(len(lengths), SEQ + 8)
    logits, _, cache = policy.forward(tokens[:, :5], _positions(lengths, 5), cache)
    steps = [np.asarray(logits)]
    for j in range(5, SEQ):
        pos = np.where(j < lengths, j, -1).astype(np.int32)[:, None]
        logits, _, cache = policy.forward(tokens[:, j:j + 1], pos, cache)
        steps.append(np.asarray(logits))
    decoded = np.concatenate(steps, 1)
    return [decoded[i, :n] for i, n in enumerate(lengths)]


def _every_forward(policy, tokens, lengths):
    """{way: [row][positions, V]}: the rows' logits in a batched full forward, in a prefill
    of 5 then one-token decode steps (every row in the batch), and in a prefill of 5 then
    deferred verifies of 4 tokens, each committed after a different count per row (the
    next verify starts at the first uncommitted token and applies the pending ones)."""
    b = len(lengths)
    full = np.asarray(policy.forward(tokens, _positions(lengths, SEQ))[0])
    out = {"batched": [full[i, :n] for i, n in enumerate(lengths)]}
    out["decoded"] = _decoded(policy, tokens, lengths)
    cache = policy.init_cache(b, SEQ + 8)
    logits, _, cache = policy.forward(tokens[:, :5], _positions(lengths, 5), cache)
    got = [[row] for row in np.asarray(logits)]
    done = np.full(b, 5)
    rng = np.random.default_rng(1)
    while np.any(done < lengths):
        at = done[:, None] + np.arange(4)[None, :]  # (a block may run past the row's end:
        # the engine's verifies feed k + 1 tokens to every row they feed)
        fed = np.take_along_axis(np.pad(tokens, ((0, 0), (0, 4))), at, 1)
        pos = np.where((done < lengths)[:, None], at, -1).astype(np.int32)
        logits, _, cache, deferred = policy.forward(fed, pos, cache, defer_state=True)
        keep = np.minimum(rng.integers(1, 5, b), np.maximum(lengths - done, 0))
        kept = np.where(np.arange(4)[None, :] < keep[:, None], np.arange(4)[None, :], -1)
        cache = keep_accepted(cache, deferred, jnp.asarray(kept, jnp.int32), num_fed=4,
                              fed_mask=jnp.asarray(pos[:, 0] >= 0), prefix=True)
        for i in range(b):
            got[i].append(np.asarray(logits[i, :keep[i]]))
        done = done + keep
    out["verified"] = [np.concatenate(g, 0)[:n] for g, n in zip(got, lengths)]
    return out


@pytest.mark.parametrize("dtype,family", [("float32", "qwen3_5"), ("bfloat16", "qwen3_5"),
                                          ("bfloat16", "qwen3_next")])
def test_a_rows_logits_are_the_same_in_every_forward(dtype, family):
    """Batched with ragged rows, decoded token by token, verified in deferred blocks with
    partial commits: each row's logits equal, bit for bit, the row's own full forward (the
    training forward's shape: more tokens than UNROLL_TOKENS, so its delta rule scans)."""
    policy = hybrid_policy(dtype, family)
    tokens, lengths = _sequences()
    want = _alone(policy, tokens, lengths)
    for way, rows in _every_forward(policy, tokens, lengths).items():
        for i, row in enumerate(rows):
            np.testing.assert_array_equal(row, want[i], err_msg=f"{way}, row {i}")


def test_negative_control_without_the_mode():
    """Without batch_invariant the comparison finds differing bits: a row decoded in a batch
    of three vs the same row decoded alone (a batch composition; measured in float32: 1,817
    of its 2,816 logits differ; 88 in bfloat16)."""
    policy = hybrid_policy("float32", invariant=False)
    tokens, lengths = _sequences()
    assert np.any(_decoded(policy, tokens, lengths)[1]
                  != _decoded(policy, tokens[1:2], lengths[1:2])[0])


def test_the_rule_scanned_equals_unrolled_and_batched_bitwise():
    """delta_rule_invariant over 2 UNROLL_TOKENS + 3 tokens (scanned) equals, bit for bit,
    one-token calls, unrolled blocks of 4 and each row alone; and is within float32 rounding
    of a float64 NumPy loop of the rule's definition (the module docstring's update)."""
    rng = np.random.default_rng(2)
    b, t, hk, hv, dk, dv = 3, 2 * UNROLL_TOKENS + 3, 2, 4, 8, 8

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.standard_normal((b, t, hk, dk))) * dk ** -0.5
    k = unit(rng.standard_normal((b, t, hk, dk)))
    v = rng.standard_normal((b, t, hv, dv))
    g = -rng.uniform(0, 2, (b, t, hv))
    beta = rng.uniform(0, 1, (b, t, hv))
    s0 = 0.1 * rng.standard_normal((b, hv, dk, dv))
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]
    rule = jax.jit(delta_rule_invariant)
    out, state = map(np.asarray, rule(*args, jnp.asarray(s0, jnp.float32)))

    def blocks(width):
        s, outs = jnp.asarray(s0, jnp.float32), []
        for j in range(0, t, width):
            o, s = rule(*(a[:, j:j + width] for a in args), s)
            outs.append(np.asarray(o))
        return np.concatenate(outs, 1), np.asarray(s)

    for width in (1, 4):
        got_out, got_state = blocks(width)
        np.testing.assert_array_equal(got_out, out)
        np.testing.assert_array_equal(got_state, state)
    alone = rule(*(a[1:2] for a in args), jnp.asarray(s0[1:2], jnp.float32))
    np.testing.assert_array_equal(np.asarray(alone[0])[0], out[1])
    # float64 reference: S' = exp(g) S; S += k (beta (v - S'^T k))^T; out = S^T q
    rep = hv // hk
    s, want = s0.copy(), np.zeros((b, t, hv, dv))
    for j in range(t):
        kj, qj = np.repeat(k[:, j], rep, 1), np.repeat(q[:, j], rep, 1)
        s = np.exp(g[:, j])[..., None, None] * s
        u = beta[:, j][..., None] * (v[:, j] - np.einsum("bhkv,bhk->bhv", s, kj))
        s = s + kj[..., :, None] * u[..., None, :]
        want[:, j] = np.einsum("bhkv,bhk->bhv", s, qj)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(state, s, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- engine


@pytest.mark.parametrize("dtype,name", [("bfloat16", "oracle"), ("float32", "ngram")])
def test_speculative_equals_plain_bitwise(dtype, name, monkeypatch):
    """Two slots (rows refilled mid-call), a cache that grows from 32 slots: tokens AND
    log-probs equal plain decoding's bit for bit (every chain drafter, adaptive k:
    test_hybrid_invariant_drafters.py, compiled as the suite compiles)."""
    policy = hybrid_policy(dtype)
    common, plain = plain_rollouts(policy)
    assert_speculative_is_plain_bitwise(policy, name, common, plain, monkeypatch)


# --------------------------------------------------------------------------- trainer


# test_hybrid_grpo's tiny Qwen3.5-layout policy in the trainer's config (configs/tiny.yaml)
HYBRID = ["model.family=qwen3_5", "model.num_layers=2",
          "model.layer_types=[linear_attention, full_attention]", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
          "model.linear_key_head_dim=16", "model.linear_value_head_dim=16",
          "model.linear_conv_kernel_dim=4", "model.partial_rotary_factor=0.25",
          "draft.kind=ngram", "draft.k=3", "warmup.steps=0"]


def test_grpo_trainer_generation_logprobs_are_the_training_forwards_bitwise(tmp_path):
    """The GRPO trainer with a batch-invariant hybrid policy: the generator's log-probs equal
    the logprob stage's (a full-sequence forward of 16 rollouts) exactly, and the step's speculative rollouts are the plain ones; without the mode the same
    run's first step measures a mismatch (the scoring forward batches and shapes the rows
    unlike the generator's forwards)."""
    from jaxspec.rl.trainer import GRPOTrainer
    from jaxspec.testing.rl import make_config, rows

    GRPOTrainer(make_config(tmp_path / "inv", *HYBRID, "model.batch_invariant=true",
                            "run.steps=1")).run()
    got = rows(tmp_path / "inv")
    assert [r["grpo/logprob_mismatch_max"] for r in got] == [0.0], got
    assert [r["replay_identical"] for r in got if "replay_identical" in r] == [True]
    GRPOTrainer(make_config(tmp_path / "default", *HYBRID, "run.steps=1")).run()
    assert rows(tmp_path / "default")[0]["grpo/logprob_mismatch_max"] > 0


def test_with_config_keeps_the_params():
    """HybridPolicy.with_config (the warm-up's switch out of and back into the mode): the
    same arrays under the new config; a change of the parameters is refused."""
    policy = hybrid_policy("bfloat16")
    default = policy.with_config(batch_invariant=False)
    assert not default.config.batch_invariant and default.pending_tokens == 4
    assert all(a is b for a, b in zip(jax.tree.leaves(default.params),
                                      jax.tree.leaves(policy.params)))
    with pytest.raises(ValueError, match="changes the parameters"):
        policy.with_config(hidden_size=64)
