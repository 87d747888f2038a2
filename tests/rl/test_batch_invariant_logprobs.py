"""Generation log-probs == the trainer's scoring log-probs, bit for bit, under
`model.batch_invariant` at a Qwen3-sized vocabulary (151,936 = 594 blocks of
`kernels.invariant.VOCAB_BLOCK` in the normaliser, 38 matmul tiles of `COL_TILE`, 19 chunks of
the default `grpo.logprob_chunk`), bf16, for
256 rows x 24 tokens at temperature 1, 0.7 with top-k/top-p, and 0 (issue 38). The
references are the generator (the engine's decode forward, one token per row) and a float64
NumPy log-softmax of the policy's logits, not the scorer's own formula. A 1-layer policy
8 wide keeps the [rows, V] work small; every row runs to 24 tokens (no stop token). The
suite runs 16 rows; `JAXSPEC_FULL_EXACTNESS=1` runs all 256.

(The module name holds "test_batch_invariant": tests/conftest.py compiles it as users do.)
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.rl import chunked
from jaxspec.rl.steps import score_rollouts

VOCAB = 151_936  # Qwen3
# The suite runs 16 rows; JAXSPEC_FULL_EXACTNESS=1 runs the 256 rows x 24 tokens
# (about 17 min of CPU on a 2-core Intel Xeon).
FULL = os.environ.get("JAXSPEC_FULL_EXACTNESS", "") not in ("", "0")
ROWS, BATCHES, TOKENS, PROMPT = (64, 4, 24, 8) if FULL else (16, 1, 24, 8)
SETTINGS = {"t1": SamplingConfig(1.0), "t0.7_topk_topp": SamplingConfig(0.7, 50, 0.9),
            "t0": SamplingConfig(0.0)}


@pytest.fixture(scope="module")
def policy():
    cfg = ModelConfig.tiny("qwen3", num_layers=1, vocab_size=VOCAB, hidden_size=8,
                           intermediate_size=16, num_heads=1, num_kv_heads=1, head_dim=8,
                           dtype="bfloat16", max_position_embeddings=PROMPT + TOKENS + 1,
                           batch_invariant=True)
    return random_policy(cfg, seed=0)


def _batch(b):  # -> prompts [ROWS, PROMPT] right-padded, their lengths [ROWS]
    rng = np.random.default_rng(b)
    lengths = rng.integers(2, PROMPT + 1, ROWS).astype(np.int32)
    prompts = rng.integers(0, VOCAB, (ROWS, PROMPT)).astype(np.int32)
    return np.where(np.arange(PROMPT) < lengths[:, None], prompts, 0), lengths


@pytest.fixture(scope="module")
def rollouts(policy):
    """{setting: [(prompts, prompt lengths, Rollouts)] x BATCHES} and the scorer's output
    at the default logprob_chunk (8192) for each batch."""
    out = {}
    for name, sampling in SETTINGS.items():
        out[name] = []
        for b in range(BATCHES):
            prompts, lengths = _batch(b)
            r = generate(policy, [p[:n].tolist() for p, n in zip(prompts, lengths)],
                         sampling=sampling, max_new_tokens=TOKENS, key=jax.random.key(b))
            scored = score_rollouts(policy, None, jnp.asarray(prompts), jnp.asarray(lengths),
                                    r.tokens, r.lengths, r.logprobs, sampling,
                                    filtered=name == "t0.7_topk_topp")
            out[name].append((prompts, lengths, r, scored))
    return out


@pytest.mark.parametrize("name", list(SETTINGS))
def test_generation_logprobs_equal_score_rollouts_bitwise(rollouts, name):
    tokens = 0
    for _, _, r, scored in rollouts[name]:
        assert np.all(np.asarray(r.lengths) == TOKENS)
        mask = np.asarray(scored["mask"])
        gen, train = np.asarray(scored["gen_logprobs"])[mask], np.asarray(scored["logprobs"])[mask]
        np.testing.assert_array_equal(train, gen)
        assert np.all(np.isfinite(gen)) and np.all(gen <= 0)
        tokens += mask.sum()
    assert tokens == ROWS * BATCHES * TOKENS  # every token of every row compared


def _logits(policy, prompts, lengths, r):  # the policy's logits before each rollout token
    seq = np.concatenate([prompts, np.zeros((ROWS, TOKENS), np.int32)], 1)
    rows = np.arange(ROWS)[:, None]
    seq[rows, lengths[:, None] + np.arange(TOKENS)] = np.asarray(r.tokens)
    positions = np.where(np.arange(PROMPT + TOKENS) < (lengths + TOKENS)[:, None],
                         np.arange(PROMPT + TOKENS), -1)
    logits, _, _ = policy.forward(jnp.asarray(seq[:8]), jnp.asarray(positions[:8], jnp.int32))
    at = lengths[:8, None] - 1 + np.arange(TOKENS)
    return np.asarray(logits, np.float64)[np.arange(8)[:, None], at]  # [8, TOKENS, V]


def test_temperature_zero_reports_the_unscaled_softmax_on_both_sides(policy, rollouts):
    """The convention (docs/training.md): a greedy token's log-prob is its log-prob under the
    policy's unscaled, unfiltered softmax, generator and scorer alike (bitwise above); here
    against float64 NumPy, and the tokens are the argmax."""
    prompts, lengths, r, scored = rollouts["t0"][0]
    logits = _logits(policy, prompts, lengths, r)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    tokens = np.asarray(r.tokens[:8])
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    want = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(r.logprobs[:8]), want, rtol=0, atol=2e-6)
    assert np.all(want < -1.0)  # a flat random policy: not the point mass's log p = 0


def test_negative_control_log_softmax_is_not_bitwise(policy, rollouts):
    """The same comparison with the previous normaliser (jax.nn.log_softmax, the
    non-invariant path) finds differing bits: the bitwise test above can fail."""
    prompts, lengths, r, _ = rollouts["t1"][0]
    logits = jnp.asarray(_logits(policy, prompts, lengths, r), jnp.float32)
    tokens = jnp.asarray(r.tokens[:8])
    plain, _ = chunked.dense_logprobs(logits, tokens, SETTINGS["t1"], False, invariant=False)
    assert np.sum(np.asarray(plain) != np.asarray(r.logprobs[:8])) > 0


@pytest.mark.parametrize("chunk, micro", [(5000, 0), (0, 0), (8192, 2)] + (
    [(4096, 0), (65536, 0), (8192, 4)] if FULL else []))
def test_scores_do_not_depend_on_chunk_or_micro_batch(policy, rollouts, chunk, micro):
    """logprob_chunk 5000 runs as 8192 (whole COL_TILEs); 0 is the unchunked forward.
    Log-probs and entropies equal the default (8192, one forward) bit for bit."""
    prompts, lengths, r, scored = rollouts["t1"][0]
    n = 8
    base = score_rollouts(policy, None, jnp.asarray(prompts[:n]), jnp.asarray(lengths[:n]),
                          r.tokens[:n], r.lengths[:n], r.logprobs[:n], SETTINGS["t1"])
    other = score_rollouts(policy, None, jnp.asarray(prompts[:n]), jnp.asarray(lengths[:n]),
                           r.tokens[:n], r.lengths[:n], r.logprobs[:n], SETTINGS["t1"],
                           chunk=chunk, micro_batch=micro)
    mask = np.asarray(base["mask"])
    np.testing.assert_array_equal(np.asarray(base["logprobs"])[:n], np.asarray(scored["logprobs"])[:n])
    np.testing.assert_array_equal(np.asarray(other["logprobs"])[mask], np.asarray(base["logprobs"])[mask])
    np.testing.assert_array_equal(np.asarray(other["entropy"])[mask], np.asarray(base["entropy"])[mask])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_tied_vocabulary_main_job_shape_is_bitwise(dtype):
    """The main job's shape of LM head (a small character vocabulary, tied to the embedding,
    eight query heads): a transposed tied head once reached the matmul as a transposed
    operand in the decode program and as a copy in the scorer's, and 84 of 192 log-probs
    differed in their last bits."""
    cfg = ModelConfig.tiny("qwen3", num_layers=1, vocab_size=24, hidden_size=32, intermediate_size=64,
                           num_heads=8, num_kv_heads=4, head_dim=32, dtype=dtype,
                           max_position_embeddings=64, batch_invariant=True, tie_embeddings=True)
    policy = random_policy(cfg, seed=0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 9, 8).astype(np.int32)
    prompts = np.where(np.arange(8) < lengths[:, None], rng.integers(1, 24, (8, 8)), 0).astype(np.int32)
    r = generate(policy, [p[:n].tolist() for p, n in zip(prompts, lengths)], sampling=SETTINGS["t1"],
                 max_new_tokens=24, key=jax.random.key(0))
    scored = score_rollouts(policy, None, jnp.asarray(prompts), jnp.asarray(lengths), r.tokens,
                            r.lengths, r.logprobs, SETTINGS["t1"])
    mask = np.asarray(scored["mask"])
    assert mask.sum() > 100
    np.testing.assert_array_equal(np.asarray(scored["logprobs"])[mask],
                                  np.asarray(scored["gen_logprobs"])[mask])
