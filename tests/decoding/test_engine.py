"""The rollout engine: speculative rollouts equal plain rollouts token for token.

Replay verification draws, at every position, the token the plain sampler would draw with
the same key, so for ANY drafter the speculative rollout must equal the plain one exactly
(float32; the verify and decode forwards differ only in rounding). Greedy likewise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, process_logits
from jaxspec.decoding.drafters import (
    DraftContext,
    DraftModelDrafter,
    Eagle3Drafter,
    NGramDrafter,
    TreeSpec,
)
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.testing.drafters import PROMPTS, every_drafter

MAX_NEW = 14
KEY = jax.random.key(11)


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))


@pytest.fixture(scope="module")
def drafters(policy):
    return {**every_drafter(policy), "self_draft": DraftModelDrafter(policy, k=3)}


def _plain(policy, temperature, stops=()):
    return generate(policy, PROMPTS, sampling=SamplingConfig(temperature=temperature),
                    max_new_tokens=MAX_NEW, key=KEY, stop_tokens=stops)


@pytest.fixture(scope="module")
def stop_token(policy):
    """A token that ends row 0 early (its 6th greedy token), so early stops are exercised."""
    r = _plain(policy, 0.0)
    return int(r.tokens[0, 5])


@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle3_chain", "eagle3_tree", "self_draft", "mtp_chain"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_equals_plain(policy, drafters, stop_token, name, temperature):
    stops = (stop_token,)
    plain = _plain(policy, temperature, stops)
    spec = generate(policy, PROMPTS, drafter=drafters[name], sampling=SamplingConfig(temperature=temperature),
                    max_new_tokens=MAX_NEW, key=KEY, stop_tokens=stops)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
    if temperature == 0.0:
        assert int(plain.lengths[0]) <= 6  # the stop token cut row 0 short
    # Speculation never needs more policy forwards than plain decoding of the same tokens.
    assert int(spec.stats.target_forwards) <= int(plain.stats.target_forwards)


def test_greedy_method_on_a_tree(policy, drafters):
    plain = _plain(policy, 0.0)
    spec = generate(policy, PROMPTS, drafter=drafters["eagle3_tree"], method="greedy",
                    sampling=SamplingConfig(temperature=0.0), max_new_tokens=MAX_NEW, key=KEY)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)


def test_logprobs_match_a_fresh_forward(policy, drafters):
    """Emitted log-probs are log p(token) under the processed policy, as a full forward
    over the finished sequences computes them (top-k/top-p/temperature applied)."""
    cfg = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
    r = generate(policy, PROMPTS, drafter=drafters["eagle3_chain"], sampling=cfg, max_new_tokens=MAX_NEW, key=KEY)
    for b, prompt in enumerate(PROMPTS):
        n = int(r.lengths[b])
        seq = jnp.asarray([prompt + np.asarray(r.tokens[b, :n]).tolist()])
        logits, _, _ = policy.forward(seq, jnp.arange(seq.shape[1])[None])
        logp = process_logits(logits[0, len(prompt) - 1 : -1], cfg)
        want = np.take_along_axis(np.asarray(logp), np.asarray(r.tokens[b, :n])[:, None], 1)[:, 0]
        np.testing.assert_allclose(np.asarray(r.logprobs[b, :n]), want, atol=1e-5)
        assert np.all(np.asarray(r.logprobs[b, n:]) == 0)


def test_acceptance_stats_closed_form(policy, drafters):
    """Drafting with the policy itself: every greedy draft is accepted, so each forward emits
    k+1 tokens except where the budget cuts; rejection sampling with q == p accepts all too."""
    d = drafters["self_draft"]
    for method, temp in (("replay", 0.0), ("rejection", 1.0)):
        r = generate(policy, PROMPTS, drafter=d, method=method, sampling=SamplingConfig(temperature=temp),
                     max_new_tokens=12, key=KEY)
        steps = np.asarray(r.stats.row_steps)
        np.testing.assert_array_equal(steps, np.ceil(12 / 4) * np.ones(3))
        assert r.stats.acceptance_length == pytest.approx(12 / 3)
        np.testing.assert_allclose(r.stats.per_position_acceptance, [1.0, 1.0, 1.0])
        assert r.stats.acceptance_rate == 1.0
    plain = _plain(policy, 1.0)
    assert plain.stats.acceptance_length == 1.0 and plain.stats.acceptance_rate == 0.0
    assert plain.stats.per_position_acceptance.shape == (0,)
    np.testing.assert_array_equal(plain.stats.row_steps, plain.lengths)


def test_bf16_mismatch_rate_is_small(policy, drafters):
    """In bf16 the verify forward (k+1 tokens) and the decode forward (1 token) round
    differently, so replay can pick a different token where two candidates are within
    rounding; after the first difference the rows diverge. On CPU there is none (asserted);
    docs/BENCHMARKS.md reports the measured rates."""
    pol16 = policy.astype("bfloat16")
    head = Eagle3Head.init_for(pol16, 96, jax.random.key(1))
    cfg = SamplingConfig(temperature=1.0)
    plain = generate(pol16, PROMPTS, sampling=cfg, max_new_tokens=MAX_NEW, key=KEY)
    spec = generate(pol16, PROMPTS, drafter=Eagle3Drafter(head, k=3), sampling=cfg, max_new_tokens=MAX_NEW, key=KEY)
    same = np.asarray(spec.tokens) == np.asarray(plain.tokens)
    if jax.default_backend() == "cpu":
        # Near-uniform logits (0.02 init) on 3 rows: no mismatch here.
        assert same.all()
    else:  # GPU libraries pick tiles by shape: measure, and bound loosely
        agree_prefix = np.argmin(np.concatenate([same, np.zeros((3, 1), bool)], 1), axis=1)
        assert agree_prefix.mean() / MAX_NEW >= 0.5


def test_bad_inputs_fail_before_compiling(policy):
    with pytest.raises(ValueError, match="draft length k must be an int >= 1; got 0"):
        NGramDrafter(k=0)
    other = Policy.init(ModelConfig.tiny("qwen3", vocab_size=64, num_layers=1), jax.random.key(0))
    with pytest.raises(ValueError, match="vocabulary size 64 differs from the policy's 128"):
        generate(policy, PROMPTS, drafter=DraftModelDrafter(other, k=2), max_new_tokens=4, key=KEY)
    with pytest.raises(ValueError, match="exceeds the policy's max_position_embeddings 512"):
        generate(policy, [[1] * 600], max_new_tokens=4, key=KEY)
    with pytest.raises(ValueError, match="method='rejection' needs sampled chain drafts"):
        generate(policy, PROMPTS, drafter=NGramDrafter(k=2), method="rejection", max_new_tokens=4, key=KEY)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 128\)"):
        generate(policy, [[1, 200]], max_new_tokens=4, key=KEY)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        generate(policy, [[1], []], max_new_tokens=4, key=KEY)
    small_head = Eagle3Head.init_for(policy, 2, jax.random.key(1))
    with pytest.raises(ValueError, match=r"TreeSpec.top_k 3 exceeds the head's draft vocabulary \(2 tokens\)"):
        generate(policy, PROMPTS, drafter=Eagle3Drafter(small_head, tree=TreeSpec(3, 2, 4)), max_new_tokens=4, key=KEY)
    with pytest.raises(ValueError, match=r"TreeSpec.budget=40 is invalid: it must be in \[depth, nodes expanded\] = \[2, 6\]"):
        TreeSpec(top_k=2, depth=2, budget=40)


def test_draft_choice_over_a_reduced_vocabulary_matches_the_full_vocabulary():
    """Drafting over the draft vocabulary and mapping winners through d2t equals drafting
    over a full-vocabulary array with -inf outside it (the argmax, and the q returned)."""
    from jaxspec.decoding.draws import choose_draft as _choose

    ids = jnp.array([3, 7, 8, 20, 31], jnp.int32)
    logits = jax.random.normal(jax.random.key(5), (4, 5)) * 2
    full = jnp.full((4, 40), -jnp.inf).at[:, ids].set(logits)
    for sampled in (False, True):
        ctx = DraftContext(jnp.zeros((4, 8), jnp.int32), jnp.ones((4,), jnp.int32), jax.random.key(0),
                           SamplingConfig(temperature=0.7, top_k=3), sampled)
        tok, q = _choose(logits, ctx, 0, ids, 40)
        tok_full, q_full = _choose(full, ctx, 0)
        assert set(np.asarray(tok).tolist()) <= set(np.asarray(ids).tolist())
        if not sampled:
            np.testing.assert_array_equal(tok, tok_full)
        else:
            np.testing.assert_allclose(q, q_full, atol=1e-6)
            assert np.all(np.take_along_axis(np.asarray(q), np.asarray(tok)[:, None], 1) > 0)


def test_layer_copies_are_made_once_per_params_and_never_stale(policy, monkeypatch):
    """On CPU decoding runs the layers unrolled over per-layer copies, made once per params
    object and reused: three calls alternating two policies of the same shapes copy each
    one's layers when it comes (3 copies: A, B, A again), and every call's rollouts equal
    that policy's scanned decode (no copies at all): a copy keyed by shapes alone would
    decode B's call with A's weights. A changed config over the same params reuses the
    copies and keeps its own config."""
    from jaxspec.decoding import unstack as engine

    assert policy.decodes_unrolled(0, 0)  # CPU, layer_loop auto: the path under test
    other = Policy.init(policy.config, jax.random.key(7))
    made = []
    unstack = engine._unstack
    monkeypatch.setattr(engine, "_unstack", lambda p: made.append(1) or unstack(p))
    monkeypatch.setattr(engine, "_UNSTACKED", [])
    sampling = SamplingConfig(temperature=1.0)

    def run(p):
        return np.asarray(generate(p, PROMPTS, sampling=sampling, max_new_tokens=MAX_NEW,
                                   key=KEY).tokens)

    want = {name: run(p.with_config(layer_loop="scan")) for name, p in (("a", policy), ("b", other))}
    assert not np.array_equal(want["a"], want["b"])  # the two policies decode differently
    for name, p in (("a", policy), ("b", other), ("a", policy)):
        np.testing.assert_array_equal(run(p), want[name])
    assert len(made) == 3
    np.testing.assert_array_equal(run(policy), want["a"])  # the same params again: no copy
    assert len(made) == 3
    renamed = policy.with_config(attention_backend="reference")  # new config, same params
    assert engine.decoding_policy(renamed).config is renamed.config and len(made) == 3


def test_layer_copies_go_with_their_params():
    """The cache keeps only weak references to the params: once they are freed, so are the
    copies (a long-lived process never holds a dead policy's layers)."""
    import gc

    from jaxspec.decoding import unstack as engine

    p = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(3))
    engine.decoding_policy(p)
    assert engine._UNSTACKED and engine._UNSTACKED[0][0][0]() is jax.tree.leaves(p.params)[0]
    del p
    gc.collect()
    assert not engine._UNSTACKED


def test_a_drafter_subclass_never_runs_its_parents_program(policy, drafters):
    """jax 0.10 compares the tree structures of two `register_dataclass` classes equal when
    only their classes differ (an EAGLE-3 drafter and this subclass that drafts nothing), so
    a jit cache could serve one the other's program: seen in a suite run, where a negative
    control drafter ran as its parent and the joint-law test it must fail passed. The engine
    keys its programs on the classes of its inputs too (`LoopSpec.classes`)."""
    import dataclasses

    from jaxspec.decoding.engine import _checked

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class _DraftsNothing(Eagle3Drafter):
        def propose(self, state, policy, ctx):
            tree, q, state = super().propose(state, policy, ctx)
            return dataclasses.replace(tree, tokens=jnp.full_like(tree.tokens, -1)), q, state

    parent = drafters["eagle3_chain"]
    child = _DraftsNothing(**{f.name: getattr(parent, f.name) for f in dataclasses.fields(parent)})
    args = (PROMPTS, None, MAX_NEW, KEY, (), "replay", None, 0, None, None, None, None)
    spec_parent, spec_child = (_checked(policy, args[0], d, *args[1:])[1] for d in (parent, child))
    assert spec_parent != spec_child and hash(spec_parent) != hash(spec_child)
    runs = {name: generate(policy, PROMPTS, drafter=d, max_new_tokens=MAX_NEW, key=KEY)
            for name, d in (("parent", parent), ("child", child), ("parent again", parent))}
    assert runs["child"].stats.acceptance_length == 1.0  # its own program: no draft at all
    assert runs["parent"].stats.acceptance_length > 1.0
    np.testing.assert_array_equal(runs["parent again"].tokens, runs["parent"].tokens)
    np.testing.assert_array_equal(runs["child"].tokens, runs["parent"].tokens)  # replay: lossless
