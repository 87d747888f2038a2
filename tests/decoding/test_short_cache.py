"""Adaptive k and the hybrid's gated head on a cache sized for a short call.

A 5-token prompt with max_new_tokens=3 gives a cache of 12 slots, less than the deferred
observation's window (`AdaptiveK.window`, 16; plus the prompt width with slots) and the
hybrid's ring (16). Reference: plain decoding, token for token (replay is lossless for any
draft and any draft-length schedule).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import (
    AdaptiveK,
    DraftModelDrafter,
    Eagle3Drafter,
    HistoryDrafter,
    HybridDrafter,
    MTPDrafter,
    SamplingConfig,
    TreeSpec,
    generate,
)
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.mtp import MTPHead

PROMPTS = [[5, 9, 13, 5, 9], [77, 3, 4, 5, 6], [5, 9, 13, 5, 11]]
COMMON = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=3, key=jax.random.key(3))
# k = 0 cheapest, so after the first iteration's probe the loop defers observations and the
# next draft flushes them (the flush is what overflowed the short cache)
ADAPTIVE = AdaptiveK(jnp.array([1.0, 1.5, 2.0]), ks=(0, 1, 2), probe_every=2)


@pytest.fixture(scope="module")
def setup():
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    small = Policy.init(ModelConfig.tiny("qwen3", num_layers=1, hidden_size=32, num_heads=2,
                                         num_kv_heads=1), jax.random.key(2))
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    history = HistoryDrafter.for_batch([0, 0, 1], k=2, budget=4)
    drafters = {
        "draft_model": DraftModelDrafter(small, k=3),
        "eagle3_chain": Eagle3Drafter(head, k=3),
        "eagle3_tree": Eagle3Drafter(head, tree=TreeSpec(top_k=2, depth=2, budget=3)),
        "mtp": MTPDrafter(MTPHead.init_for(policy, jax.random.key(3)), k=2),
        "hybrid": HybridDrafter(history, Eagle3Drafter(head, k=2), budget=4),
    }
    return policy, drafters, generate(policy, PROMPTS, **COMMON)


@pytest.mark.parametrize("slots", [None, 1])
@pytest.mark.parametrize("name", ["draft_model", "eagle3_chain", "eagle3_tree", "mtp", "hybrid"])
def test_adaptive_on_a_short_cache_equals_plain(setup, name, slots):
    policy, drafters, plain = setup
    out = generate(policy, PROMPTS, drafter=drafters[name], adaptive=ADAPTIVE, slots=slots,
                   **COMMON)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters.sum() == int(out.stats.target_forwards)
    assert k_iters[1:].sum() >= 1  # the first iteration probes: a draft ran


@pytest.mark.parametrize("slots", [None, 1])
def test_gated_hybrid_on_a_short_cache_equals_plain(setup, slots):
    """Without adaptive k: the gated head's ring (16 positions) flushed into a 12-slot cache."""
    policy, drafters, plain = setup
    out = generate(policy, PROMPTS, drafter=drafters["hybrid"], slots=slots, **COMMON)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))


def test_adaptive_without_k_0_drafts_every_iteration(setup):
    """ks without 0: one program drafting at the chosen k every iteration (never plain)."""
    policy, drafters, plain = setup
    adaptive = AdaptiveK(jnp.array([1.0, 1.2]), ks=(1, 2))
    out = generate(policy, PROMPTS, drafter=drafters["draft_model"], adaptive=adaptive, **COMMON)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters[0] == 0 and k_iters.sum() == int(out.stats.target_forwards) > 0
