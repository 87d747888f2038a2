"""History drafting in chains (`HistoryDrafter(chain=True)`), what a hybrid (Gated DeltaNet)
policy verifies: the chain is the trie's best path, checked against a brute-force count over
the raw matched continuations; under replay a hybrid policy's rollouts drafted by it equal
plain decoding token for token, with slots refilled mid-call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import HistoryDrafter, SamplingConfig, generate
from jaxspec.decoding.history_index import best_path, trie
from jaxspec.models import ModelConfig
from jaxspec.models.hybrid import random_hybrid_policy

L, F = "linear_attention", "full_attention"


def _brute_path(conts, valid, k, fill):
    """Greedy over the matches themselves: at each depth, among the matches that agree with
    the path so far (and are valid that deep), the next token most of them continue with
    (a tie: the one that occurs first in match order)."""
    path, alive = [], list(range(conts.shape[0]))
    for d in range(k):
        alive = [m for m in alive if valid[m, d]]
        if not alive:
            path.extend([fill] * (k - d))
            break
        counts = {}
        for m in alive:
            counts.setdefault(int(conts[m, d]), 0)
            counts[int(conts[m, d])] += 1
        top = max(counts.values())
        token = next(int(conts[m, d]) for m in alive if counts[int(conts[m, d])] == top)
        path.append(token)
        alive = [m for m in alive if conts[m, d] == token]
    return path


def test_best_path_is_the_most_matched_chain():
    rng = np.random.default_rng(0)
    batch, m, k = 64, 6, 4
    conts = rng.integers(0, 3, (batch, m, k)).astype(np.int32)  # 3 tokens: many shared paths
    # a match is valid up to its own length (a continuation cut by its candidate's end)
    depth = rng.integers(0, k + 1, (batch, m))
    valid = np.arange(k)[None, None, :] < depth[:, :, None]
    fill = rng.integers(5, 9, (batch,)).astype(np.int32)
    got = np.asarray(best_path(*trie(jnp.asarray(conts), jnp.asarray(valid)), k,
                               jnp.asarray(fill)))
    want = np.array([_brute_path(conts[b], valid[b], k, int(fill[b])) for b in range(batch)])
    np.testing.assert_array_equal(got, want)
    assert (want == fill[:, None]).any() and (want != fill[:, None]).all(axis=1).any()


def test_chain_settings():
    drafter = HistoryDrafter.for_batch([0, 0], k=5, budget=2, chain=True)  # budget unused
    assert drafter.drafts_chains and drafter.num_nodes == 5 and drafter.max_depth == 5
    assert drafter.with_k(2).num_nodes == 2 and drafter.with_k(2).chain
    tree = HistoryDrafter.for_batch([0, 0], k=3, budget=4)
    assert not tree.drafts_chains and tree.num_nodes == 4
    with pytest.raises(ValueError, match="budget.*must be >= k"):
        HistoryDrafter.for_batch([0, 0], k=3, budget=2)
    with pytest.raises(ValueError, match="chain must be a bool"):
        HistoryDrafter.for_batch([0, 0], chain=1)


def test_hybrid_policy_history_chains_equal_plain():
    """Each prompt sampled three times (a GRPO group); two slots, so rows are refilled
    mid-call and a later sample drafts from its finished siblings' rollouts."""
    policy = random_hybrid_policy(ModelConfig.tiny(
        "qwen3_5", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=3,
        layer_types=(L, F, L), linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8), seed=3)
    base = [[1, 2, 3, 1, 2], [7, 7], [4, 5, 6]]
    prompts = [p for p in base for _ in range(3)]
    groups = np.repeat(np.arange(len(base)), 3)
    common = dict(sampling=SamplingConfig(temperature=0.1), max_new_tokens=16,
                  key=jax.random.key(4), slots=2)
    plain = generate(policy, prompts, **common)
    drafter = HistoryDrafter.for_batch(groups, k=4, chain=True)
    out = generate(policy, prompts, drafter=drafter, **common)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=1e-5)
    assert float(out.stats.acceptance_length) > 1.3  # the siblings' drafts are accepted
    assert int(out.stats.target_forwards) < int(plain.stats.target_forwards)
