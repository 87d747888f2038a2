"""verify: closed-form law of the rejection rule, replay == sample bit for bit, greedy paths,
edge cases (p == q, q(x) == 0, absent nodes, temperature 0) and hypothesis properties."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.decoding import METHODS, SamplingConfig, Tree, process_logits, sample, verify
from jaxspec.decoding.verify import _rejection_step
from jaxspec.testing.laws import processed_probs

BUSHY = (-1, -1, 0, 0, 1, 2, 2, 5)  # several children per node, depth 4


def bushy_tree(tokens):
    batch = tokens.shape[0]
    return Tree.from_parents(tokens, jnp.broadcast_to(jnp.array(BUSHY), (batch, len(BUSHY))), max_depth=4)


# ----------------------------------------------------------------------------- closed form


def _tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum())


def law_one_draft(p, q, step=_rejection_step):
    """Exact output law at one position: x ~ q, accept with the rule's probability, else the
    rule's residual. Enumerates every draft token x and both sides of the coin."""
    vocab = p.shape[0]
    x = jnp.arange(vocab)
    accept, residual = step(jnp.broadcast_to(p, (vocab, vocab)), jnp.broadcast_to(q, (vocab, vocab)), x)
    emitted = accept[:, None] * jax.nn.one_hot(x, vocab) + (1 - accept)[:, None] * residual
    return jnp.sum(q[:, None] * emitted, axis=0)


def law_two_siblings(p, q, *, without_replacement, step=_rejection_step):
    """Exact law with two candidate children (recursive rejection): x1 ~ q, then x2 ~ q (i.i.d.)
    or x2 ~ q without x1 (renormalised), enumerating all V^2 pairs and the coins."""
    vocab = p.shape[0]
    x1, x2 = [a.reshape(-1) for a in jnp.meshgrid(jnp.arange(vocab), jnp.arange(vocab), indexing="ij")]
    pairs = vocab * vocab
    q1 = jnp.broadcast_to(q, (pairs, vocab))
    q2 = q1
    if without_replacement:
        q2 = jnp.where(jnp.arange(vocab) == x1[:, None], 0.0, q1)
        q2 = q2 / jnp.maximum(jnp.sum(q2, axis=1, keepdims=True), 1e-30)
    a1, r1 = step(jnp.broadcast_to(p, (pairs, vocab)), q1, x1)
    a2, r2 = step(r1, q2, x2)
    second = a2[:, None] * jax.nn.one_hot(x2, vocab) + (1 - a2)[:, None] * r2
    emitted = a1[:, None] * jax.nn.one_hot(x1, vocab) + (1 - a1)[:, None] * second
    weight = q[x1] * q2[jnp.arange(pairs), x2]
    return jnp.sum(weight[:, None] * emitted, axis=0)


@jax.jit
def _probs(target_logits, draft_logits, target_cfg, draft_cfg):
    return jnp.exp(process_logits(target_logits, target_cfg)), jnp.exp(
        process_logits(draft_logits, draft_cfg)
    )


def _pq(vocab, target, draft, *, dtype=jnp.float32, same=False, seed=0):
    """Processed target p and draft q (float32, from jaxspec) and the float64 reference of p."""
    rng = np.random.default_rng(seed)
    target_logits = jnp.asarray(rng.normal(size=vocab) * 2, dtype)
    draft_logits = target_logits if same else target_logits + jnp.asarray(rng.normal(size=vocab), dtype)
    p, q = _probs(target_logits, draft_logits, SamplingConfig(*target), SamplingConfig(*draft))
    return p, q, processed_probs(np.asarray(target_logits.astype(jnp.float32)), *target)


CLOSED_FORM_CASES = {  # name: (vocab, target settings, draft settings, extras)
    "plain": (6, (1.0, 0, 1.0), (1.0, 0, 1.0), {}),
    "both processed": (6, (0.7, 4, 0.9), (1.4, 0, 0.8), {}),
    "p == q (zero residual)": (6, (0.8, 3, 1.0), (0.8, 3, 1.0), dict(same=True)),
    "q(x) == 0 where p(x) > 0": (6, (1.0, 0, 1.0), (1.0, 2, 1.0), {}),
    "p(x) == 0 where q(x) > 0": (6, (1.0, 2, 1.0), (1.0, 0, 1.0), {}),
    "target top_k = 1": (6, (1.0, 1, 1.0), (1.0, 0, 1.0), {}),
    "greedy target": (6, (0.0, 0, 1.0), (2.0, 0, 1.0), {}),
    "argmax draft as one-hot q": (6, (0.9, 0, 0.95), (0.0, 0, 1.0), {}),
    "bf16 logits": (6, (0.6, 5, 0.9), (1.0, 0, 1.0), dict(dtype=jnp.bfloat16)),
    "one token": (1, (1.0, 0, 1.0), (1.0, 0, 1.0), {}),
    "larger vocabulary": (300, (1.0, 40, 0.9), (1.2, 0, 1.0), {}),
}


@jax.jit
def _point_mass_laws(p):  # [V] -> [V, V]: row x is the law when the draft was x (q = delta_x)
    vocab = p.shape[0]
    accept, residual = _rejection_step(jnp.broadcast_to(p, (vocab, vocab)), None, jnp.arange(vocab))
    return accept[:, None] * jnp.eye(vocab) + (1 - accept)[:, None] * residual


def test_rejection_closed_form_law_is_the_processed_target():
    """One draft, two sibling drafts (i.i.d. or without replacement) and point-mass drafts:
    the exact output law is the processed target within total variation 1e-6."""
    one_draft = jax.jit(law_one_draft)
    two_siblings = jax.jit(law_two_siblings, static_argnames="without_replacement")
    for case, (vocab, target, draft, extras) in CLOSED_FORM_CASES.items():
        p, q, reference = _pq(vocab, target, draft, **extras)
        assert _tv(one_draft(p, q), reference) < 1e-6, case
        if vocab <= 50:
            assert _tv(two_siblings(p, q, without_replacement=False), reference) < 1e-6, case
            if np.count_nonzero(q) >= 2:  # a second distinct sibling must be possible
                assert _tv(two_siblings(p, q, without_replacement=True), reference) < 1e-6, case
        # Point-mass drafts (draft_probs=None) are lossless whatever token was drafted.
        assert max(_tv(law, reference) for law in _point_mass_laws(p)) < 1e-6, case


def _resample_from_p(p, q, x):
    accept, _ = _rejection_step(p, q, x)
    return accept, p


def _ratio_from_unprocessed_p(p, q, x):  # acceptance uses another p than the emitted one
    accept, _ = _rejection_step(jnp.sqrt(p) / jnp.sum(jnp.sqrt(p), axis=-1, keepdims=True), q, x)
    return accept, _rejection_step(p, q, x)[1]


def test_closed_form_detects_broken_rules():
    p, q, reference = _pq(6, (0.7, 4, 0.9), (1.4, 0, 0.8))
    assert _tv(law_one_draft(p, q, _resample_from_p), reference) > 1e-2
    assert _tv(law_one_draft(p, q, _ratio_from_unprocessed_p), reference) > 1e-2
    # Drafts drawn from q but verified against another q (raw instead of processed).
    vocab = p.shape[0]
    x = jnp.arange(vocab)
    raw_q = jax.nn.softmax(jnp.log(q + 0.05))
    accept, residual = _rejection_step(
        jnp.broadcast_to(p, (vocab, vocab)), jnp.broadcast_to(raw_q, (vocab, vocab)), x
    )
    emitted = accept[:, None] * jnp.eye(vocab) + (1 - accept)[:, None] * residual
    assert _tv(jnp.sum(q[:, None] * emitted, axis=0), reference) > 1e-2


# ----------------------------------------------------------------------------- replay, greedy


@functools.partial(jax.jit, static_argnames="method")
def _verify(key, logits, tree, cfg, positions, draft_probs=None, *, method):
    return verify(key, logits, tree, cfg, method=method, positions=positions, draft_probs=draft_probs)


_sample = jax.jit(sample)


def _sampler_drafts(key, logits, cfg, positions, rng, hit_rate):
    """Bushy-tree tokens that often equal what the sampler draws at their parent's slot."""
    batch = logits.shape[0]
    depths = np.asarray(bushy_tree(jnp.zeros((1, len(BUSHY)), jnp.int32)).depths[0])
    tokens = rng.integers(0, logits.shape[-1], size=(batch, len(BUSHY)))
    for i, parent in enumerate(BUSHY):
        drawn, _ = _sample(key, logits[:, parent + 1], cfg, positions + depths[i] - 1)
        hit = rng.random(batch) < hit_rate
        tokens[:, i] = np.where(hit, np.asarray(drawn), tokens[:, i])
    return bushy_tree(jnp.asarray(tokens, jnp.int32))


def test_replay_emits_exactly_what_sample_emits():
    rng = np.random.default_rng(0)
    batch, vocab = 64, 300
    key = jax.random.key(11)
    logits = jax.random.normal(jax.random.key(1), (batch, len(BUSHY) + 1, vocab)) * 3
    cfg = SamplingConfig(0.9, 40, 0.95)
    positions = jnp.asarray(rng.integers(5, 500, size=batch), jnp.int32)
    tree = _sampler_drafts(key, logits, cfg, positions, rng, hit_rate=0.7)
    verdict = _verify(key, logits, tree, cfg, positions, method="replay")
    num_accepted = np.asarray(verdict.num_accepted)
    assert num_accepted.max() == tree.max_depth and num_accepted.min() == 0
    for d in range(tree.max_depth + 1):
        node = jnp.maximum(verdict.path[:, d], 0)
        node_logits = jnp.take_along_axis(logits, node[:, None, None], axis=1)[:, 0]
        tokens, logp = _sample(key, node_logits, cfg, positions + d)
        emitted = d <= num_accepted
        np.testing.assert_array_equal(np.asarray(verdict.tokens[:, d])[emitted], np.asarray(tokens)[emitted])
        # Log-probs go through a normaliser (a reduction) whose rounding may follow the shape of
        # the batch: equal to float32 rounding, not necessarily to the bit.
        np.testing.assert_allclose(
            np.asarray(verdict.logprobs[:, d])[emitted], np.asarray(logp)[emitted], rtol=1e-6
        )


def test_empty_tree_is_plain_sampling():
    """Plain decoding as the verification of an empty tree (what the engine does)."""
    batch, vocab = 64, 300  # the replay test's sampling shapes: one compile serves both
    key, cfg = jax.random.key(12), SamplingConfig(0.9, 40, 0.95)
    logits = jax.random.normal(jax.random.key(2), (batch, 1, vocab)) * 3
    positions = jnp.arange(batch, dtype=jnp.int32) * 3
    tokens, logp = _sample(key, logits[:, 0], cfg, positions)
    for method in ("replay", "rejection"):
        verdict = _verify(
            key, logits, Tree.chain(jnp.zeros((batch, 0), jnp.int32)), cfg, positions, method=method
        )
        assert verdict.tokens.shape == (batch, 1) and not np.any(verdict.num_accepted)
        np.testing.assert_array_equal(verdict.tokens[:, 0], tokens)
        np.testing.assert_allclose(verdict.logprobs[:, 0], logp, rtol=1e-6)


def walk_reference(parents, tree_tokens, choice_at):
    """Python walk: emit choice_at(node), follow the first child with that token."""
    node, tokens, path = 0, [], [0]
    while True:
        token = choice_at(node)
        tokens.append(token)
        children = [i for i, par in enumerate(parents) if par + 1 == node and tree_tokens[i] == token]
        if not children:
            return tokens, path
        node = children[0] + 1
        path.append(node)


# ----------------------------------------------------------------------------- edge cases


def test_rejection_with_p_equal_q_accepts_every_draft():
    batch, vocab = 256, 20
    logits = jax.random.normal(jax.random.key(6), (batch, 4, vocab)) * 2
    cfg = SamplingConfig(0.8, 10, 0.9)
    logq = jax.jit(process_logits)(logits[:, :3], cfg)
    drafts = jax.random.categorical(jax.random.key(7), logq, axis=-1).astype(jnp.int32)
    verdict = _verify(
        jax.random.key(8),
        logits,
        Tree.chain(drafts),
        cfg,
        jnp.zeros(batch, jnp.int32),
        jnp.exp(logq),
        method="rejection",
    )
    assert np.all(np.asarray(verdict.num_accepted) == 3)
    assert np.all(np.isfinite(np.asarray(verdict.logprobs)))


def test_never_accepts_a_draft_the_reported_q_could_not_produce():
    batch, vocab = 256, 20  # the shapes of the test above: one compiled verify serves both
    logits = jnp.zeros((batch, 4, vocab))  # p uniform: any real draft could be accepted
    drafts = jnp.broadcast_to(jnp.array([2, 3, 4]), (batch, 3))
    q = jnp.asarray(np.where(np.arange(vocab) == 2, 0.0, 1 / (vocab - 1)), jnp.float32)
    q = jnp.broadcast_to(q, (batch, 3, vocab))
    verdict = _verify(
        jax.random.key(9),
        logits,
        Tree.chain(drafts),
        SamplingConfig(),
        jnp.zeros(batch, jnp.int32),
        q,
        method="rejection",
    )
    assert np.all(np.asarray(verdict.num_accepted) == 0)
    # max(p - q, 0) lives on token 2 alone: the mass q lacks there is what the correction adds.
    assert np.all(np.asarray(verdict.tokens[:, 0]) == 2)


def test_bad_arguments_raise_clearly():
    tree = Tree.chain(jnp.zeros((2, 3), jnp.int32))
    logits = jnp.zeros((2, 4, 5))
    key, cfg, pos = jax.random.key(0), SamplingConfig(), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="unknown method"):
        verify(key, logits, tree, cfg, method="typical", positions=pos)
    with pytest.raises(ValueError, match="N\\+1"):
        verify(key, logits[:, :3], tree, cfg, positions=pos)
    with pytest.raises(ValueError, match="rejection"):
        verify(key, logits, tree, cfg, method="replay", positions=pos, draft_probs=jnp.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match="draft_probs"):
        verify(key, logits, tree, cfg, method="rejection", positions=pos, draft_probs=jnp.zeros((2, 3, 6)))


# ----------------------------------------------------------------------------- properties

PROPERTY_BATCH, PROPERTY_NODES, PROPERTY_DEPTH, PROPERTY_VOCAB = 3, 6, 6, 70


_from_parents = jax.jit(Tree.from_parents, static_argnums=2)


@jax.jit
def _all_methods(key, logits, tree, cfg, positions, q):
    verdicts = {
        method: verify(key, logits, tree, cfg, method=method, positions=positions) for method in METHODS
    }
    verdicts["rejection+q"] = verify(
        key, logits, tree, cfg, method="rejection", positions=positions, draft_probs=q
    )
    # the reported law: the processed target's; at temperature 0 the unscaled softmax
    # (sampling.report_logprobs: the convention the trainer scores greedy rollouts under)
    unscaled = process_logits(logits, SamplingConfig(1.0))
    return verdicts, jnp.where(cfg.temperature > 0, process_logits(logits, cfg), unscaled)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.sampled_from([1, 2, 5, PROPERTY_VOCAB]),  # tokens >= vocab get -inf logits
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.1, 3.0, 40.0]),
    temperature=st.sampled_from([0.0, 0.05, 1.0, 3.0]),
    top_k=st.sampled_from([0, 1, 2, 100]),
    top_p=st.sampled_from([1.0, 0.6, 0.05]),
    bf16=st.booleans(),
)
def test_verdicts_are_well_formed(vocab, seed, scale, temperature, top_k, top_p, bf16):
    """Any topology, settings and drafts: shapes, ranges, padding, the accepted path is a chain
    of drafted nodes, log-probs are the processed target's, greedy follows the argmax, every
    method is greedy at temperature 0, and no setting recompiles."""
    rng = np.random.default_rng(seed)
    parents = np.array([[rng.integers(-1, i) for i in range(PROPERTY_NODES)] for _ in range(PROPERTY_BATCH)])
    logits = rng.normal(size=(PROPERTY_BATCH, PROPERTY_NODES + 1, PROPERTY_VOCAB)) * scale
    logits[rng.random(logits.shape) < 0.2] = -np.inf
    logits[..., 0] = np.maximum(logits[..., 0], 0.0)  # at least one finite logit per row
    logits[..., vocab:] = -np.inf
    logits = np.asarray(jnp.asarray(logits, jnp.bfloat16 if bf16 else jnp.float32).astype(jnp.float32))
    # Drafts: the target argmax (often accepted), random tokens, or absent (-1).
    argmax_at_parent = np.take_along_axis(logits.argmax(-1), parents + 1, axis=1)
    choice = rng.integers(0, 3, size=parents.shape)
    tokens = np.where(
        choice == 0, argmax_at_parent, np.where(choice == 1, rng.integers(0, vocab, parents.shape), -1)
    )
    tree = _from_parents(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), PROPERTY_DEPTH)
    q = jax.nn.softmax(
        jnp.asarray(rng.normal(size=(PROPERTY_BATCH, PROPERTY_NODES, PROPERTY_VOCAB)) * 2, jnp.float32)
    )
    positions = jnp.asarray(rng.integers(0, 1000, PROPERTY_BATCH), jnp.int32)
    cfg = SamplingConfig(temperature, top_k, top_p)
    verdicts, logp = _all_methods(jax.random.key(seed), jnp.asarray(logits), tree, cfg, positions, q)
    assert _all_methods._cache_size() == 1  # settings are traced: one compile for all examples
    logp = np.asarray(logp)
    depths = np.asarray(tree.depths)
    for name, verdict in verdicts.items():
        n_acc = np.asarray(verdict.num_accepted)
        tok, lp, path = (np.asarray(a) for a in (verdict.tokens, verdict.logprobs, verdict.path))
        assert tok.shape == lp.shape == path.shape == (PROPERTY_BATCH, PROPERTY_DEPTH + 1)
        assert not np.isnan(lp).any()
        assert np.all((n_acc >= 0) & (n_acc <= PROPERTY_DEPTH))
        assert np.all((tok >= 0) & (tok < vocab))
        for b in range(PROPERTY_BATCH):
            n = n_acc[b] + 1
            assert path[b, 0] == 0
            assert np.all(tok[b, n:] == 0) and np.all(lp[b, n:] == 0) and np.all(path[b, n:] == -1)
            # Emitted tokens lie in the processed target's support, with the reported log-probs.
            np.testing.assert_array_equal(lp[b, :n], logp[b, path[b, :n], tok[b, :n]])
            assert np.all(np.isfinite(lp[b, :n])) and np.all(lp[b, :n] <= 0)
            for d in range(1, n):  # the accepted path is a root-down chain of drafted tokens
                node = path[b, d] - 1
                assert parents[b, node] + 1 == path[b, d - 1]
                assert tokens[b, node] == tok[b, d - 1] and depths[b, node] == d
            if name == "greedy":
                row_argmax = logits[b].argmax(-1)
                want_tokens, want_path = walk_reference(parents[b], tokens[b], row_argmax.__getitem__)
                assert list(tok[b, :n]) == want_tokens and list(path[b, :n]) == want_path
        if temperature == 0.0:
            for got, want in zip(jax.tree.leaves(verdict), jax.tree.leaves(verdicts["greedy"])):
                np.testing.assert_array_equal(got, want)
