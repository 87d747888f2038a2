"""Coupled drafts: under replay a drafter draws its token at position t with the verifier's own
Gumbel noise at t (`DraftContext.verifier_noise`).

References: the closed-form probability that two Gumbel-max draws with shared noise agree,
P = sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) (token i wins both draws iff g_i - g_j clears the
larger of the two log-ratios for every j, a Gumbel-max race with weights max(...)), tested with
a binomial bound; the independent-noise probability sum_i p_i q_i as the negative control; and
plain decoding token for token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, generate
from jaxspec.decoding.drafters import DraftModelDrafter
from jaxspec.decoding.draws import choose_draft as _choose
from jaxspec.decoding.protocols import DraftContext
from jaxspec.decoding.sampling import sample
from jaxspec.decoding.verify import replay_noise
from jaxspec.models import ModelConfig, Policy

N = 20_000  # rows per check: the binomial standard error is <= 0.0036
Z = 5.0  # |freq - P| < Z standard errors: two-sided false-failure rate 5.7e-7 per check


def _closed_form(p, q):  # P(the two shared-noise Gumbel-max draws agree)
    total = 0.0
    for i in range(len(p)):
        if p[i] > 0 and q[i] > 0:
            total += 1.0 / np.sum(np.maximum(p / p[i], q / q[i]))
    return total


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _agreement(p_logits, q_logits, cfg, *, offset, ids=None, draft_offset=None, replay_key=None):
    """Frequency over N rows of the coupled draft at `draft_offset` equalling the verifier's token
    at `offset`."""
    key = jax.random.key(11)
    rows = jnp.arange(N, dtype=jnp.int32) * 7 + 3
    lengths = jnp.asarray(np.random.default_rng(0).integers(4, 60, size=N), jnp.int32)
    noise = replay_noise(key if replay_key is None else replay_key, lengths, 2, len(p_logits), rows)
    ctx = DraftContext(buffer=jnp.zeros((N, 64), jnp.int32), lengths=lengths, key=jax.random.key(5),
                       sampling=cfg, sampled=False, rows=rows, verifier_noise=noise)
    q = jnp.broadcast_to(jnp.asarray(q_logits, jnp.float32), (N, len(q_logits)))
    ids_arr = None if ids is None else jnp.asarray(ids, jnp.int32)
    draft, _ = _choose(q, ctx, offset if draft_offset is None else draft_offset, ids_arr, len(p_logits))
    p = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (N, len(p_logits)))
    target, _ = sample(key, p, cfg, positions=lengths + offset, rows=rows)
    return float(jnp.mean(draft == target))


P_LOGITS = np.log(np.array([0.45, 0.25, 0.15, 0.1, 0.05]))
Q_LOGITS = np.log(np.array([0.3, 0.35, 0.1, 0.15, 0.1]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("offset", [0, 2])
def test_agreement_matches_closed_form(temperature, offset):
    cfg = SamplingConfig(temperature=temperature)
    p, q = _softmax(P_LOGITS / temperature), _softmax(Q_LOGITS / temperature)
    expected = _closed_form(p, q)
    freq = _agreement(P_LOGITS, Q_LOGITS, cfg, offset=offset)
    se = np.sqrt(expected * (1 - expected) / N)
    assert abs(freq - expected) < Z * se, (freq, expected)
    # The closed form is well above what argmax drafts (p[argmax q]) or independent draws give.
    assert expected > max(p[np.argmax(q)], np.sum(p * q)) + 0.1


def test_draft_vocabulary_subset_matches_closed_form():
    """A head over candidates [0, 2, 3] of a 5-token vocabulary: its draws take the verifier's
    noise at those ids."""
    ids = [0, 2, 3]
    q_sub = np.log(np.array([0.5, 0.2, 0.3]))
    q_full = np.zeros(5)
    q_full[ids] = np.exp(q_sub)
    expected = _closed_form(_softmax(P_LOGITS), q_full)
    freq = _agreement(P_LOGITS, q_sub, SamplingConfig(), offset=1, ids=ids)
    assert abs(freq - expected) < Z * np.sqrt(expected * (1 - expected) / N), (freq, expected)


@pytest.mark.parametrize("control", ["shifted position", "other key"])
def test_negative_controls_give_independent_agreement(control):
    """Noise from the wrong position or key is independent of the verifier's: agreement drops to
    sum_i p_i q_i, which the closed-form check rejects."""
    cfg = SamplingConfig()
    p, q = _softmax(P_LOGITS), _softmax(Q_LOGITS)
    kw = dict(draft_offset=1) if control == "shifted position" else dict(replay_key=jax.random.key(12))
    freq = _agreement(P_LOGITS, Q_LOGITS, cfg, offset=0, **kw)
    independent, coupled = np.sum(p * q), _closed_form(p, q)
    se = np.sqrt(independent * (1 - independent) / N)
    assert abs(freq - independent) < Z * se, (freq, independent)
    assert abs(freq - coupled) > 10 * se


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)])
def test_self_draft_is_always_accepted_and_equals_plain(policy, sampling):
    """The policy drafting for itself with coupled draws proposes exactly the tokens plain
    sampling emits (q = p: the closed form is 1), so every draft is accepted; with argmax drafts
    a near-uniform random policy rarely agrees. Both equal plain decoding token for token."""
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    common = dict(sampling=sampling, max_new_tokens=16, key=jax.random.key(3))
    plain = generate(policy, prompts, **common)
    accept = {}
    for coupled in (True, False):
        out = generate(policy, prompts, drafter=DraftModelDrafter(policy, k=3, coupled=coupled), **common)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
        accept[coupled] = out.stats.per_position_acceptance
    # 16 tokens per row with k = 3: 4 full chains, the last one cut by the budget.
    assert np.all(accept[True][:2] == 1.0), accept
    assert np.all(accept[False] < 0.5), accept


def test_only_coupled_chains_take_the_verifier_noise(policy):
    """The engine draws the replay noise before the forward (held across it) only for drafters
    that draw with it: coupled chains; a tree proposes top-k children and an argmax chain
    ignores it, so verify draws it itself."""
    from jaxspec.decoding import TreeSpec
    from jaxspec.decoding.drafters import Eagle3Drafter, NGramDrafter
    from jaxspec.models.eagle3 import Eagle3Head

    head = Eagle3Head.init_for(policy, 32, jax.random.key(1))
    assert Eagle3Drafter(head, k=3).uses_verifier_noise
    assert not Eagle3Drafter(head, k=3, coupled=False).uses_verifier_noise
    assert not Eagle3Drafter(head, tree=TreeSpec(top_k=2, depth=2, budget=3)).uses_verifier_noise
    assert DraftModelDrafter(policy, k=2).uses_verifier_noise
    assert not getattr(NGramDrafter(k=2), "uses_verifier_noise", False)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_hybrid_head_draws_as_its_chain_drafter_does(policy, temperature):
    """A hybrid with no history (no group members, not even the row itself; no store) drafts
    the head's chain
    alone: its acceptance per depth equals the same head's `Eagle3Drafter` chain (a separate
    implementation), coupled and argmax alike. At temperature 1 the coupled draws are accepted
    far more often than the argmax (near-uniform random p and q: the shared noise decides
    both); at temperature 0 there is no noise and the two are the same. All equal plain."""
    from jaxspec.decoding import (
        Eagle3Drafter,
        HistoryDrafter,
        HistoryStore,
        HybridDrafter,
    )
    from jaxspec.models.eagle3 import Eagle3Head

    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    common = dict(sampling=SamplingConfig(temperature=temperature), max_new_tokens=16,
                  key=jax.random.key(5))
    plain = generate(policy, prompts, **common)
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    history = HistoryDrafter(HistoryStore.empty(1, 1, 1), siblings=jnp.full((3, 1), -1, jnp.int32),
                             slots=jnp.full((3,), -1, jnp.int32), k=2, budget=2)
    accepted = {}
    for coupled in (True, False):
        chain = Eagle3Drafter(head, k=2, coupled=coupled)
        for name, drafter in (("chain", chain),
                              ("hybrid", HybridDrafter(history, chain, budget=2, gate=False))):
            out = generate(policy, prompts, drafter=drafter, **common)
            np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
            accepted[name, coupled] = np.asarray(out.stats.accepted_at)
        np.testing.assert_array_equal(accepted["hybrid", coupled], accepted["chain", coupled])
    if temperature == 0.0:
        np.testing.assert_array_equal(accepted["hybrid", True], accepted["hybrid", False])
    else:
        assert accepted["hybrid", True][0] >= 5 * max(accepted["hybrid", False][0], 1), accepted
