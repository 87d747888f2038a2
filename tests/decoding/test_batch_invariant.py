"""The batch-invariant forward (`ModelConfig.batch_invariant`): bfloat16 replay is bitwise.

With it, a token's logits do not depend on how many rows and tokens share the forward, so
speculative rollouts equal plain ones token for token AND log-prob for log-prob in bfloat16,
and generation log-probs equal a full-sequence (training) forward's, bit for bit. The
reference for "equal" is the plain decoder and the training forward (different shapes:
one token per row, the whole sequence per row), not the code's formula.
docs/BENCHMARKS.md reports the default mode's mismatches on the same setting
(scripts/bench_exactness.py, 512 rows x 24 tokens).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, process_logits
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.testing.drafters import every_drafter

ROWS, TOKENS = 16, 16
KEY = jax.random.key(7)


@pytest.fixture(scope="module")
def policy():
    cfg = ModelConfig.tiny("qwen3", num_layers=2, dtype="bfloat16", max_position_embeddings=64,
                           batch_invariant=True)
    return random_policy(cfg, seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, rng.integers(2, 9)).tolist() for _ in range(ROWS)]


@pytest.fixture(scope="module")
def drafters(policy):
    return every_drafter(policy, draft_vocab=128)


@pytest.fixture(scope="module")
def plain(policy, prompts):
    return {t: generate(policy, prompts, sampling=SamplingConfig(temperature=t), max_new_tokens=TOKENS, key=KEY)
            for t in (0.0, 1.0)}


# A tree and a model-free drafter here (each compiles its own loop); every drafter
# at 512 rows x 24 tokens: scripts/bench_exactness.py (docs/BENCHMARKS.md).
@pytest.mark.parametrize("name", ["ngram", "eagle3_tree"])
def test_bf16_speculative_equals_plain_bitwise(policy, prompts, drafters, plain, name):
    for temperature in (0.0, 1.0):
        spec = generate(policy, prompts, drafter=drafters[name], sampling=SamplingConfig(temperature=temperature),
                        max_new_tokens=TOKENS, key=KEY)
        ref = plain[temperature]
        np.testing.assert_array_equal(spec.tokens, ref.tokens)
        np.testing.assert_array_equal(spec.logprobs, ref.logprobs)
        if name == "eagle3_tree":  # the drafts were used, not all rejected
            assert spec.stats.acceptance_length > 1.0


def test_generation_logprobs_equal_the_training_forward_bitwise(policy, prompts, plain):
    """Score prompt + rollout with one full-sequence forward (as the trainer does): the
    log-probs equal the generation's bit for bit."""
    r = plain[1.0]
    width = max(len(p) for p in prompts) + TOKENS
    seq = np.zeros((ROWS, width), np.int32)
    pos = np.full((ROWS, width), -1, np.int32)
    for i, p in enumerate(prompts):
        n = len(p) + int(r.lengths[i])
        seq[i, :n] = p + np.asarray(r.tokens[i, : int(r.lengths[i])]).tolist()
        pos[i, :n] = np.arange(n)
    logits, _, _ = policy.forward(jnp.asarray(seq), jnp.asarray(pos))
    logp = np.asarray(process_logits(logits, SamplingConfig(temperature=1.0)))
    for i, p in enumerate(prompts):
        n = int(r.lengths[i])
        want = logp[i, len(p) - 1 + np.arange(n), np.asarray(r.tokens[i, :n])]
        np.testing.assert_array_equal(np.asarray(r.logprobs[i, :n]), want)


def test_float32_invariant_forward_matches_the_default_forward():
    """The mode changes rounding only: in float32 its logits equal the default forward's to
    rounding level, over a cached prefix plus a draft tree."""
    cfg = ModelConfig.tiny("llama", num_layers=2)
    default = random_policy(cfg, seed=3)
    inv = default.with_config(batch_invariant=True)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 128, (3, 6)), jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3, -1, -1], [0, 1, 2, 3, 4, 5], [0, 1, -1, -1, -1, -1]], jnp.int32)
    tree = jnp.asarray(rng.integers(0, 128, (3, 4)), jnp.int32)
    mask = jnp.broadcast_to(jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool), (3, 4, 4))
    outs = []
    for pol in (default, inv):
        _, _, cache = pol.forward(tokens, positions, pol.init_cache(3, 20))
        base = cache.lengths[:, None]
        tree_pos = base + jnp.asarray([0, 1, 1, 2])[None, :]
        logits, _, _ = pol.forward(tree, tree_pos, cache, mask=mask)
        full, _, _ = pol.forward(tokens, positions)
        outs.append((logits, full))
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-5)


def test_bad_flag_is_refused():
    with pytest.raises(ValueError, match="batch_invariant"):
        ModelConfig.tiny("qwen3", batch_invariant="yes")
