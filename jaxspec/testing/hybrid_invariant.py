"""A tiny batch-invariant hybrid policy, every chain drafter it accepts, and the engine run
that compares speculative rollouts with plain ones bit for bit (slots, cache growth, adaptive
k): what tests/decoding/test_hybrid_invariant*.py share."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import (
    AdaptiveK,
    BlockDrafter,
    DraftModelDrafter,
    Eagle3Drafter,
    HistoryDrafter,
    NGramDrafter,
    SamplingConfig,
    driver,
    generate,
)
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.oracle import oracle_drafter
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.block import BlockHead
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.hybrid import HybridPolicy, random_hybrid_policy
from jaxspec.models.hybrid_mtp import HybridMTPDrafter, HybridMTPHead

L, F = "linear_attention", "full_attention"
KEY = jax.random.key(5)
PROMPTS = [[5, 9, 13, 5, 9, 13, 5], [77, 3], [40, 41, 42, 43, 40, 41], [8], [60, 61, 62]]
MAX_NEW = 60  # past the first cache (32 slots with FIRST_CAPACITY 16): the cache grows
CHAIN_DRAFTERS = ("oracle", "ngram", "history_chain", "draft_model", "eagle3_chain", "block",
                  "mtp")


def hybrid_config(family: str = "qwen3_5", **kw) -> ModelConfig:
    """Linear, full, linear (test_hybrid_engine's shape), batch-invariant unless kw says."""
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
                layer_types=(L, F, L), linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, batch_invariant=True)
    if family == "qwen3_next":
        base.update(moe_intermediate_size=16, shared_expert_intermediate_size=16)
    return ModelConfig.tiny(family, **{**base, **kw})


def hybrid_policy(dtype: str, family: str = "qwen3_5", invariant: bool = True) -> HybridPolicy:
    """O(1) random weights (seed 1) in `dtype`, with a pending buffer for verifies of 4."""
    return random_hybrid_policy(hybrid_config(family, batch_invariant=invariant),
                                seed=1).astype(dtype).replace(pending_tokens=4)


def chain_drafter(name: str, policy: HybridPolicy, plain):
    """One of CHAIN_DRAFTERS for `policy` (fixed keys; `plain`: the plain rollouts of PROMPTS,
    which the oracle drafts from)."""
    dense_like = types.SimpleNamespace(config=ModelConfig.tiny(  # heads shaped for the policy
        "qwen3", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2))
    if name == "oracle":  # accepted and rejected at every depth
        tokens, lengths = pad_prompts(PROMPTS)
        return oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=128)
    if name == "ngram":
        return NGramDrafter(k=3, min_n=1, max_n=2)
    if name == "history_chain":  # the group's earlier rollouts, one chain (hybrids: no trees)
        return HistoryDrafter.for_batch(np.zeros(len(PROMPTS), int), k=3, chain=True)
    if name == "draft_model":
        return DraftModelDrafter(Policy.init(ModelConfig.tiny(
            "qwen3", vocab_size=128, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1),
            jax.random.key(2)), k=2)
    if name == "eagle3_chain":
        return Eagle3Drafter(Eagle3Head.init_for(dense_like, 96, jax.random.key(1),
                                                 capture_layers=(0, 1, 2)), k=3)
    if name == "block":
        return BlockDrafter(BlockHead.init_for(dense_like, jax.random.key(2), block_size=4,
                                               num_layers=1), k=3)
    if name == "mtp":
        return HybridMTPDrafter(HybridMTPHead.init_for(policy, jax.random.key(3)), k=3)
    raise ValueError(f"chain_drafter: {name!r}; valid: {', '.join(CHAIN_DRAFTERS)}")


def plain_rollouts(policy: HybridPolicy):  # -> (generate's common arguments, plain Rollouts)
    common = dict(sampling=SamplingConfig(1.0), max_new_tokens=MAX_NEW, key=KEY,
                  stop_tokens=(17,))
    return common, generate(policy, PROMPTS, grow_cache=False, **common)


def assert_speculative_is_plain_bitwise(policy: HybridPolicy, name: str, common, plain,
                                        monkeypatch, adaptive: bool = False):
    """generate with drafter `name` in two slots (rows refilled mid-call) and a cache that
    grows from 32 slots (`driver.FIRST_CAPACITY` 16 via `monkeypatch`; plain: one full-length
    cache), adaptive k in (0, 1, 3) if asked: tokens, lengths AND log-probs equal `plain`'s
    bit for bit."""
    grows = []
    original = driver.grow_state
    monkeypatch.setattr(driver, "FIRST_CAPACITY", 16)
    monkeypatch.setattr(driver, "grow_state", lambda *a, capacity, **kw: grows.append(
        capacity) or original(*a, capacity=capacity, **kw))
    k = AdaptiveK(jnp.array([1.0, 1.5, 2.4]), ks=(0, 1, 3), probe_every=4) if adaptive else None
    out = generate(policy, PROMPTS, drafter=chain_drafter(name, policy, plain), slots=2,
                   grow_cache=True, adaptive=k, **common)
    assert grows, "the cache never grew"
    assert int(out.stats.prefill_forwards) == len(PROMPTS) - 2  # refilled slots
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(plain.logprobs))
    if name == "oracle":  # drafts accepted and rejected
        assert 1.5 < float(out.stats.acceptance_length) < 4.0
    if adaptive:  # plain iterations (k = 0) and speculative ones
        k_iters = np.asarray(out.stats.k_iterations)
        assert k_iters[0] > 0 and k_iters[1:].sum() > 0, k_iters
    return out
