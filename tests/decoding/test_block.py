"""The block drafter (DFlash body, DSpark Markov head) is lossless: speculative rollouts equal
plain ones token for token under replay (chain, hybrid, slots, adaptive length, with and
without the Markov head), and rollouts verified by rejection sampling follow the policy's
joint law (chi-square against float64 forwards of the policy), where a drafter that reports
its q without the Markov bias is rejected (negative control). The chain itself is checked
against a NumPy reference of one body forward followed by the Markov head's left-to-right
picks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import (
    AdaptiveK,
    BlockDrafter,
    DraftContext,
    HistoryDrafter,
    HybridDrafter,
    SamplingConfig,
    generate,
    process_logits,
)
from jaxspec.models import ModelConfig
from jaxspec.models.block import BlockHead
from jaxspec.models.transformer import random_policy
from jaxspec.testing.drafters import with_params
from jaxspec.testing.laws import continuation_counts, continuation_law, law_test

SAMPLING = SamplingConfig(0.5)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 3], [4, 4, 4]]
KEY = jax.random.key(3)


def _bigram_head(policy, vocab: int, *, block_size: int, scale: float, seed: int = 2):
    """A block model whose Markov head holds the policy's bigram log-frequencies (from its
    own plain rollouts), with the body's logits shrunk (final norm x 0.05): its drafts are
    often accepted, so the tests walk accepted paths too."""
    plain = generate(policy, PROMPTS * 4, sampling=SAMPLING, max_new_tokens=24, key=jax.random.key(7))
    counts = np.full((vocab, vocab), 0.1)
    for row in np.asarray(plain.tokens):
        np.add.at(counts, (row[:-1], row[1:]), 1.0)
    table = np.log(counts / counts.sum(1, keepdims=True))
    head = BlockHead.init_for(policy, jax.random.key(seed), block_size=block_size, num_layers=2,
                              markov_rank=vocab, confidence=True)
    return with_params(head, {"markov_w1": lambda x: np.eye(vocab), "markov_w2": lambda x: scale * table,
                        "['norm']": lambda x: 0.05 * x})


@pytest.fixture(scope="module")
def setup():
    vocab = 24
    policy = random_policy(ModelConfig.tiny("qwen3", vocab_size=vocab, num_layers=2), seed=1)
    head = _bigram_head(policy, vocab, block_size=5, scale=4.0)
    plain = generate(policy, PROMPTS, sampling=SAMPLING, max_new_tokens=16, key=KEY)
    return dict(policy=policy, head=head, plain=np.asarray(plain.tokens))


def _speculative(setup, drafter, **kw):
    return generate(setup["policy"], PROMPTS, drafter=drafter, sampling=SAMPLING, max_new_tokens=16,
                    key=KEY, **kw)


@pytest.mark.parametrize("markov", [True, False])
def test_replay_chain_equals_plain(setup, markov):
    out = _speculative(setup, BlockDrafter(setup["head"], markov=markov))
    np.testing.assert_array_equal(np.asarray(out.tokens), setup["plain"])
    if markov:  # the bigram Markov head's drafts are accepted: the accepted path is walked
        assert out.stats.acceptance_length > 1.5
    # one body forward per draft and one context forward per observation
    st = out.stats
    assert int(st.draft_forwards) <= 2 * int(st.target_forwards) + 1


def test_replay_with_slots_and_adaptive_length_equals_plain(setup):
    drafter = BlockDrafter(setup["head"], k=3)
    slots = _speculative(setup, drafter, slots=2)
    np.testing.assert_array_equal(np.asarray(slots.tokens), setup["plain"])
    switching = AdaptiveK(jnp.array([1.0, 1.2, 1.3, 1.4]), probe_every=4)
    adaptive = _speculative(setup, drafter, adaptive=switching, slots=3)
    np.testing.assert_array_equal(np.asarray(adaptive.tokens), setup["plain"])
    assert adaptive.stats.acceptance_length > 1.0


@pytest.mark.parametrize("gate", [True, False])
def test_replay_hybrid_equals_plain(setup, gate):
    history = HistoryDrafter.for_batch(np.arange(len(PROMPTS)) // 2, k=3, budget=5)
    hybrid = HybridDrafter(history, BlockDrafter(setup["head"], k=3), budget=5, gate=gate)
    out = _speculative(setup, hybrid)
    np.testing.assert_array_equal(np.asarray(out.tokens), setup["plain"])
    stats = out.draft_stats
    assert int(stats["accepted_head_only"]) + int(stats["accepted_both"]) > 0


def test_chain_is_one_body_forward_then_markov_picks(setup):
    """Argmax chains (coupled=False) against NumPy: the body's logits at the k positions,
    then left to right argmax(base_i + w1[previous] @ w2) from the root."""
    policy, head = setup["policy"], setup["head"]
    drafter = BlockDrafter(head, coupled=False)
    buffer = np.zeros((2, 32), np.int32)
    buffer[0, :4], buffer[1, :3] = PROMPTS[0], PROMPTS[1]
    lengths = np.array([4, 3], np.int32)
    state = drafter.init_state(policy, 2, 32)
    ctx = DraftContext(jnp.asarray(buffer), jnp.asarray(lengths), jax.random.key(0), SAMPLING, False)
    tree, _, _ = drafter.propose(state, policy, ctx)
    base = np.asarray(head.logits(drafter.drafted_hidden(state, policy, ctx), policy), np.float64)
    params = {jax.tree_util.keystr(p): np.asarray(x, np.float64)
              for p, x in jax.tree_util.tree_flatten_with_path(head.params)[0]}
    w1, w2 = params["['markov_w1'].value"], params["['markov_w2'].value"]
    previous, expected = buffer[np.arange(2), lengths - 1], []
    for i in range(drafter.k):
        previous = np.argmax(base[:, i] + w1[previous] @ w2, axis=-1)
        expected.append(previous)
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.stack(expected, 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _QWithoutMarkov(BlockDrafter):
    """Negative control: draws with the Markov bias, reports q without it."""

    def propose(self, state, policy, ctx):
        tree, _, state = super().propose(state, policy, ctx)
        base = self.head.logits(self.drafted_hidden(state, policy, ctx), policy)
        return tree, jnp.exp(process_logits(base, ctx.sampling)), state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _VerifiesOnlyItsMode(BlockDrafter):
    """Negative control: a draft length chosen from the current draft's own token (a row's
    first draft is verified only when it is q's mode; otherwise the node is absent), not from
    the committed prefix as the confidence length's is."""

    def propose(self, state, policy, ctx):
        tree, q, state = super().propose(state, policy, ctx)
        first = tree.tokens[:, 0]
        kept = jnp.where(first == jnp.argmax(q[:, 0], axis=-1), first, -1)
        return dataclasses.replace(tree, tokens=tree.tokens.at[:, 0].set(kept)), q, state


def _joint_law_counts(drafter_of, method: str, n: int = 4096):
    vocab, prompt = 6, [1, 2, 1]
    policy = random_policy(ModelConfig.tiny("qwen3", vocab_size=vocab, num_layers=1,
                                            max_position_embeddings=16), seed=5)
    head = BlockHead.init_for(policy, jax.random.key(4), block_size=3, num_layers=1,
                              markov_rank=vocab)
    rng = np.random.default_rng(0)
    head = with_params(head, {"markov_w1": lambda x: np.eye(vocab),
                        "markov_w2": lambda x: 3.0 * rng.standard_normal((vocab, vocab)),
                        "['norm']": lambda x: 0.05 * x})  # the Markov bias dominates q
    sampling = SamplingConfig(1.0)
    out = generate(policy, [prompt] * n, drafter=drafter_of(head), sampling=sampling,
                   max_new_tokens=3, key=jax.random.key(11), method=method)
    y = np.asarray(out.tokens)
    return continuation_counts(y, vocab, 3), continuation_law(policy, prompt, vocab, 3), out.stats


@pytest.mark.parametrize("method, markov", [("rejection", True), ("replay", True),
                                           ("rejection", False)])
def test_rollouts_follow_the_policy_joint_law(method, markov):
    """Chi-square at level 1e-5 per case (3 cases: at most 3e-5 of false failures on top of
    the 1e-4 of jaxspec.testing.laws.ALPHA's tests): 4096 rollouts of 3 tokens, drafted by a
    block drafter whose Markov head is far from the policy (sampled drafts and their q under
    rejection; coupled drafts under replay), or by its body alone (markov=False: q is the
    body's near-uniform distribution)."""
    counts, law, stats = _joint_law_counts(lambda head: BlockDrafter(head, markov=markov), method)
    p_value, statistic, outside = law_test(counts, law)
    assert outside == 0 and p_value >= 1e-5, (p_value, statistic)
    assert stats.acceptance_length > 1.0  # drafts were accepted, so the rule was exercised


def test_q_without_the_markov_bias_is_caught():
    """Negative control: rejection sampling given the body's q while the drafts came from
    q with the Markov bias (HF #47932's kind of bug) leaves the joint law."""
    counts, law, _ = _joint_law_counts(lambda head: _QWithoutMarkov(head), "rejection")
    p_value, statistic, _ = law_test(counts, law)
    assert p_value < 1e-5, (p_value, statistic)


def test_a_length_chosen_from_the_draft_itself_is_caught():
    """Negative control for adaptive length: verifying a position only when its own drafted
    token looks likely (here: is q's mode) leaves the joint law (that token is then accepted
    with probability p(x)(2 - q(x)) where p < q); the confidence length avoids it by choosing
    k from the previous draft's estimate (test_block_confidence_length.py)."""
    counts, law, _ = _joint_law_counts(lambda head: _VerifiesOnlyItsMode(head), "rejection")
    p_value, statistic, _ = law_test(counts, law)
    assert p_value < 1e-5, (p_value, statistic)
