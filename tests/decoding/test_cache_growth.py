"""A KV cache that grows: `generate(grow_cache=True)` starts at a small capacity and moves
the loop state into a doubled one only when a live row needs it.

The reference is the same call with one cache of the full length (`grow_cache=False`),
itself checked against HF logits and one-prompt-at-a-time decoding elsewhere: the tokens
must be equal token for token and the log-probs to float32 rounding, for plain decoding
and every kind of drafter state (a head's one-layer cache, a draft model's cache, a
tree's, refilled slots, adaptive k with deferred observations), and the loop must take the
same number of iterations (a drafter that lost its state across a growth would accept
less). A negative control: growing the cache with the drafter's state reset to a fresh one
changes the acceptance.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import AdaptiveK, SamplingConfig, TreeSpec, driver, generate
from jaxspec.decoding.drafters import DraftModelDrafter, Eagle3Drafter, NGramDrafter
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head

MAX_NEW = 150  # prompts of up to 7 tokens: capacities 64, then the full 161 (or so)
KEY = jax.random.key(11)


@pytest.fixture(scope="module")
def setup():
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, policy.config.vocab_size, size=n).tolist() for n in (3, 7, 1, 5, 2)]
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    small = Policy.init(ModelConfig.tiny("qwen3", num_layers=1), jax.random.key(2))
    # One stop token: rows end at geometric lengths, most past the first capacity (64).
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=MAX_NEW, key=KEY,
                  stop_tokens=(5,))
    return dict(policy=policy, prompts=prompts, head=head, small=small, common=common)


def _drafters(s):
    return {
        "plain": (None, None, None),
        "eagle3_tree": (Eagle3Drafter(s["head"], tree=TreeSpec(top_k=2, depth=3, budget=5)), None, None),
        "ngram": (NGramDrafter(k=3), None, None),
        "draft_model": (DraftModelDrafter(s["small"], k=2), None, None),
        "eagle3_refill": (Eagle3Drafter(s["head"], k=3), 2, None),
        "eagle3_adaptive_refill": (Eagle3Drafter(s["head"], k=3, coupled=False), 2,
                                   AdaptiveK(jnp.array([1.0, 1.5, 2.4]), ks=(0, 1, 3), probe_every=4)),
    }


def _counting_grows(monkeypatch):
    calls = []
    original = driver.grow_state

    def counted(state, *a, capacity, **kw):
        calls.append(capacity)
        return original(state, *a, capacity=capacity, **kw)

    monkeypatch.setattr(driver, "grow_state", counted)
    return calls


@pytest.mark.parametrize("name", ["plain", "eagle3_tree", "ngram", "draft_model",
                                  "eagle3_refill", "eagle3_adaptive_refill"])
def test_growing_cache_equals_full_cache(setup, name, monkeypatch):
    drafter, slots, adaptive = _drafters(setup)[name]
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    full = generate(policy, prompts, drafter=drafter, slots=slots, adaptive=adaptive,
                    grow_cache=False, **common)
    assert int(np.max(np.asarray(full.lengths))) > 64, "no row outgrows the first capacity"
    grows = _counting_grows(monkeypatch)
    grown = generate(policy, prompts, drafter=drafter, slots=slots, adaptive=adaptive,
                     grow_cache=True, **common)
    assert grows, "the cache never grew"
    np.testing.assert_array_equal(np.asarray(grown.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(grown.lengths), np.asarray(full.lengths))
    np.testing.assert_allclose(np.asarray(grown.logprobs), np.asarray(full.logprobs), atol=1e-5)
    assert int(grown.stats.target_forwards) == int(full.stats.target_forwards)
    np.testing.assert_array_equal(np.asarray(grown.stats.accepted_at), np.asarray(full.stats.accepted_at))


def test_two_growths_and_the_capacities(setup, monkeypatch):
    """Capacities double from the first (64 here) while the double fits, then the full
    length; a call whose rows all stop inside the first capacity never grows."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    width = max(len(p) for p in prompts)
    assert driver.capacity_tiers(policy, NGramDrafter(k=3), width, 3, 7 + 300 + 4, True) \
        == [64, 128, 7 + 300 + 4]
    assert driver.capacity_tiers(policy, NGramDrafter(k=3), width, 3, 100, True) == [100]
    assert driver.capacity_tiers(policy, NGramDrafter(k=3), width, 3, 600, False) == [600]
    long = dict(common, max_new_tokens=300, stop_tokens=())  # every row runs to the budget
    full = generate(policy, prompts, grow_cache=False, **long)
    grows = _counting_grows(monkeypatch)
    grown = generate(policy, prompts, grow_cache=True, **long)
    assert grows == [128, 7 + 300 + 1]  # plain: 1 slot of headroom
    np.testing.assert_array_equal(np.asarray(grown.tokens), np.asarray(full.tokens))
    grows.clear()
    every_id_stops = dict(common, max_new_tokens=300, stop_tokens=tuple(range(policy.config.vocab_size)))
    generate(policy, prompts, grow_cache=True, **every_id_stops)
    assert grows == []


def test_growth_that_drops_the_drafter_state_is_caught(setup, monkeypatch):
    """Negative control: a growth that restarts the EAGLE-3 head's state from scratch
    leaves the tokens equal (replay) but not the acceptance, which the test above checks."""
    drafter = Eagle3Drafter(setup["head"], k=3)
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    full = generate(policy, prompts, drafter=drafter, grow_cache=False, **common)
    original = driver.grow_state.__wrapped__

    @partial(jax.jit, static_argnames=("capacity", "pad_id", "axes", "classes"))
    def forgetful(state, policy, drafter, *, capacity, pad_id, axes, classes=()):
        grown = original(state, policy, drafter, capacity=capacity, pad_id=pad_id, axes=axes,
                         classes=classes)
        batch = state.buffer.shape[0]
        return dataclasses.replace(grown, draft_state=drafter.init_state(policy, batch, capacity))

    monkeypatch.setattr(driver, "grow_state", forgetful)
    broken = generate(policy, prompts, drafter=drafter, grow_cache=True, **common)
    np.testing.assert_array_equal(np.asarray(broken.tokens), np.asarray(full.tokens))
    assert not np.array_equal(np.asarray(broken.stats.accepted_at), np.asarray(full.stats.accepted_at))


def test_bad_grow_cache_fails_before_compiling(setup):
    with pytest.raises(ValueError, match="grow_cache must be True, False or None"):
        generate(setup["policy"], setup["prompts"], grow_cache="yes", **setup["common"])
