"""Speculative decoding against a mixture-of-experts policy (family qwen3_moe): every drafter
gives the plain rollout token for token under replay, and rollouts follow the MoE policy's
joint law (chi-square) under rejection sampling with sampled EAGLE-3 drafts and under replay
with n-gram drafts in refilled slots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.drafters import Eagle3Drafter, NGramDrafter
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.transformer import random_policy
from jaxspec.testing.drafters import PROMPTS, every_drafter
from jaxspec.testing.laws import continuation_counts, continuation_law, law_test

MAX_NEW = 12
KEY = jax.random.key(11)
LEVEL = 1e-5  # each chi-square test's false-failure probability (on top of the suite's others)


def _moe(**kw):
    base = dict(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    return ModelConfig.tiny("qwen3_moe", **{**base, **kw})


@pytest.fixture(scope="module")
def policy():
    return random_policy(_moe(), seed=4)


@pytest.fixture(scope="module")
def drafters(policy):
    return every_drafter(policy)


@pytest.fixture(scope="module")
def plain(policy):
    return generate(policy, PROMPTS, sampling=SamplingConfig(1.0), max_new_tokens=MAX_NEW, key=KEY)


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle3_chain", "eagle3_tree", "mtp_chain"])
def test_speculative_equals_plain_on_an_moe_policy(policy, drafters, plain, name):
    sampling = SamplingConfig(temperature=1.0)
    spec = generate(policy, PROMPTS, drafter=drafters[name], sampling=sampling,
                    max_new_tokens=MAX_NEW, key=KEY)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
    assert int(spec.stats.target_forwards) <= int(plain.stats.target_forwards)


def test_rollouts_route_through_many_experts(policy, plain):
    """The policy under test really routes: a rollout's tokens use most experts, in many sets."""
    seq = jnp.asarray([PROMPTS[0] + np.asarray(plain.tokens[0]).tolist()])
    _, _, _, routing = policy.forward(seq, jnp.arange(seq.shape[1])[None], routing=True)
    experts = np.asarray(routing["experts"])
    assert len(np.unique(experts)) >= 6
    assert len({tuple(sorted(e)) for e in experts[0, 0]}) >= 4


@pytest.mark.parametrize("case", ["rejection-eagle3", "replay-ngram-slots"])
def test_moe_rollouts_follow_the_policy_joint_law(case):
    """Chi-square: 4096 rollouts of one prompt, 3 tokens each, against the MoE policy's joint
    law (float64, full forwards). Level 1e-5 per case. Power: the same counts against the law
    at temperature 0.5 are rejected."""
    vocab, n, prompt = 6, 4096, [1, 2, 1]
    policy = random_policy(_moe(vocab_size=vocab, num_layers=1, max_position_embeddings=16),
                           seed=5)
    if case == "rejection-eagle3":
        head = Eagle3Head.init_for(policy, vocab, jax.random.key(3))
        out = generate(policy, [prompt] * n, drafter=Eagle3Drafter(head, k=2), method="rejection",
                       sampling=SamplingConfig(1.0), max_new_tokens=3, key=jax.random.key(9))
    else:
        out = generate(policy, [prompt] * n, drafter=NGramDrafter(k=2, min_n=1, max_n=1),
                       sampling=SamplingConfig(1.0), max_new_tokens=3, key=jax.random.key(9),
                       slots=64)
    assert float(out.stats.acceptance_length) > 1.0  # drafts were accepted
    y = np.asarray(out.tokens)
    counts = continuation_counts(y, vocab, 3)
    p_value, statistic, outside = law_test(counts, continuation_law(policy, prompt, vocab, 3))
    assert outside == 0 and p_value >= LEVEL, (p_value, statistic)
    assert law_test(counts, continuation_law(policy, prompt, vocab, 3, temperature=0.5))[0] < LEVEL
