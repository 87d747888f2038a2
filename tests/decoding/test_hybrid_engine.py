"""The engine with a hybrid (Gated DeltaNet) policy: plain and speculative rollouts.

References: transformers' Qwen3_5ForCausalLM (its own cached greedy `generate` and its full
forward's log-probs) on the same weights for plain decoding; plain decoding token for token
for every chain drafter under replay (with stops, refilled slots, cache growth, adaptive k,
float32 and bfloat16); plain decoding's recurrent states for the commit after a verify; and
the policy's joint law (float64, full forwards) for rejection sampling, with a negative
control that keeps the states after the whole draft and must fail. These run the default
forward (equal within rounding); the batch-invariant forward's bit-equalities across batch
compositions and forwards are tests/decoding/test_hybrid_invariant.py's.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import (
    AdaptiveK,
    BlockDrafter,
    DraftModelDrafter,
    Eagle3Drafter,
    HistoryDrafter,
    HybridDrafter,
    NGramDrafter,
    SamplingConfig,
    TreeSpec,
    driver,
    generate,
)
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.oracle import oracle_drafter, verify_reference
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.block import BlockHead
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.hybrid import HybridPolicy, random_hybrid_policy
from jaxspec.testing.laws import continuation_counts, continuation_law, law_test

L, F = "linear_attention", "full_attention"
KEY = jax.random.key(11)
MAX_NEW = 14
PROMPTS = [[5, 9, 13, 5, 9, 13, 5], [77, 3], [40, 41, 42, 43, 40, 41], [8], [60, 61, 62]]
LEVEL = 1e-5  # each chi-square test's false-failure probability (on top of the suite's others)


def _config(**kw):
    """Linear, full, linear: a linear layer on both sides of the attention."""
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
                layer_types=(L, F, L), linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8)
    return ModelConfig.tiny("qwen3_5", **{**base, **kw})


def _small_dense(vocab):
    return Policy.init(ModelConfig.tiny("qwen3", vocab_size=vocab, num_layers=1, hidden_size=32,
                                        num_heads=2, num_kv_heads=1), jax.random.key(2))


@pytest.fixture(scope="module")
def policy():
    return random_hybrid_policy(_config(), seed=1)


@pytest.fixture(scope="module")
def setup(policy):
    sampling = SamplingConfig(temperature=1.0)
    plain = generate(policy, PROMPTS, sampling=sampling, max_new_tokens=MAX_NEW, key=KEY,
                     stop_tokens=(17,))
    tokens, lengths = pad_prompts(PROMPTS)
    # EAGLE-3 and block heads shaped for the policy (their init_for reads only the config's
    # sizes, from a dense config: a hybrid one's layer pattern would go into their layer)
    dense_like = types.SimpleNamespace(config=ModelConfig.tiny(
        "qwen3", vocab_size=128, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2))
    head = Eagle3Head.init_for(dense_like, 96, jax.random.key(1), capture_layers=(0, 1, 2))
    block = BlockHead.init_for(dense_like, jax.random.key(2), block_size=4, num_layers=1)
    drafters = {
        "oracle": oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=128),
        "ngram": NGramDrafter(k=3, min_n=1, max_n=2),
        "draft_model": DraftModelDrafter(_small_dense(128), k=2),
        "eagle3_chain": Eagle3Drafter(head, k=3),
        "block": BlockDrafter(block, k=3),  # reads the policy's LM head (HybridPolicy.module)
    }
    return dict(plain=plain, sampling=sampling, drafters=drafters, head=head)


def _assert_plain(out, plain, atol=1e-5):
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=atol)


# --------------------------------------------------------------------------- plain decoding


def test_plain_generate_equals_transformers(policy, setup, tmp_path):
    """Greedy tokens equal transformers' own cached greedy `generate` on the exported weights
    (its recurrent rule and conv cache, not ours); the sampled rollouts' log-probs equal
    log-softmax of transformers' full forward over each finished sequence."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxspec.models import save_hf

    save_hf(policy, tmp_path)
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    greedy = generate(policy, PROMPTS, sampling=SamplingConfig(temperature=0.0),
                      max_new_tokens=MAX_NEW, key=KEY)
    sampled = setup["plain"]
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
        np.testing.assert_array_equal(np.asarray(greedy.tokens[b]), ids[0, len(prompt):].numpy())
        n = int(sampled.lengths[b])
        seq = prompt + np.asarray(sampled.tokens[b, :n]).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()
        np.testing.assert_allclose(np.asarray(sampled.logprobs[b, :n]),
                                   logp[np.arange(n), seq[len(prompt):]], atol=2e-5)
    assert int(sampled.lengths.min()) < MAX_NEW  # the stop token ended a row early


def test_commit_keeps_the_states_plain_decoding_holds(policy):
    """A verify of 4 tokens with deferred states, committed after a different count per row
    (kept pending, then applied: `settled`, as the row's next forward does), holds the
    convolution and delta-rule states of one-token decode steps over those tokens:
    within 1e-6 in the first layer (its inputs are the embeddings either way; XLA may fuse
    the rule's steps differently), 1e-5 in the later ones (a 4-token forward rounds their
    inputs differently), and far from the states after any other count; the verify's logits
    are the decode steps'."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 128, (3, 5))
    fed = rng.integers(0, 128, (3, 4))
    policy = policy.replace(pending_tokens=4)
    cache = policy.init_cache(3, 16)
    _, _, cache = policy.forward(prompt, np.broadcast_to(np.arange(5), (3, 5)), cache)
    steps_cache, decoded, logits = cache, [cache], []
    for j in range(4):
        out, _, steps_cache = policy.forward(fed[:, j:j + 1], np.full((3, 1), 5 + j), steps_cache)
        decoded.append(steps_cache)
        logits.append(out[:, 0])
    verified, _, after, steps = policy.forward(fed, np.broadcast_to(5 + np.arange(4), (3, 4)),
                                               cache, defer_state=True)
    np.testing.assert_allclose(np.asarray(verified), np.stack(logits, 1), atol=1e-5, rtol=1e-5)
    for accepted in ([0, 2, 4], [1, 3, 1], [4, 0, 2]):
        committed = steps.commit(after, jnp.asarray(accepted, jnp.int32)).settled()
        for row, a in enumerate(accepted):
            for name in ("conv", "state"):
                got = np.asarray(getattr(committed, name)[:, row])
                want = [np.asarray(getattr(d, name)[:, row]) for d in decoded]
                np.testing.assert_allclose(got[0], want[a][0], atol=1e-6, rtol=1e-6)
                np.testing.assert_allclose(got, want[a], atol=1e-5, rtol=1e-5)
                others = [np.abs(got - w).max() for j, w in enumerate(want) if j != a]
                assert min(others) > 1e-2, (name, row, a, others)


# --------------------------------------------------------------------------- replay


@pytest.mark.parametrize("name", ["oracle", "ngram", "draft_model", "eagle3_chain", "block"])
def test_speculative_equals_plain(policy, setup, name):
    out = generate(policy, PROMPTS, drafter=setup["drafters"][name], sampling=setup["sampling"],
                   max_new_tokens=MAX_NEW, key=KEY, stop_tokens=(17,))
    _assert_plain(out, setup["plain"])
    assert int(out.stats.target_forwards) <= int(setup["plain"].stats.target_forwards)
    if name == "oracle":  # drafts accepted and rejected at every depth
        accepted = np.asarray(out.stats.accepted_at)
        proposed = np.asarray(out.stats.proposed_at)
        assert np.all(accepted > 0) and np.all(accepted < proposed), (accepted, proposed)


def test_refilled_slots_equal_plain_qwen3_next():
    """Family qwen3_next (fused projections, experts: its rollouts carry no routes): five
    prompts through two slots, rows refilled mid-call (a row ends at the stop token or its
    budget), each refilled slot's states starting from its prompt's prefill."""
    policy = random_hybrid_policy(ModelConfig.tiny(
        "qwen3_next", hidden_size=32, intermediate_size=64, num_layers=3, layer_types=(L, F, L),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16),
        seed=2)
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=MAX_NEW, key=KEY,
                  stop_tokens=(17,))
    plain = generate(policy, PROMPTS, **common)
    tokens, lengths = pad_prompts(PROMPTS)
    drafter = oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=128)
    out = generate(policy, PROMPTS, drafter=drafter, slots=2, **common)
    _assert_plain(out, plain)
    assert int(out.stats.prefill_forwards) == len(PROMPTS) - 2
    assert out.routes is None and float(out.stats.acceptance_length) > 1.5


def test_adaptive_k_equals_plain(policy, setup):
    """k chosen per iteration among 0 (plain decoding: states advanced at once), 1 and 3
    (deferred and committed), with slots."""
    adaptive = AdaptiveK(jnp.array([1.0, 1.5, 2.4]), ks=(0, 1, 3), probe_every=4)
    out = generate(policy, PROMPTS, drafter=setup["drafters"]["eagle3_chain"], adaptive=adaptive,
                   sampling=setup["sampling"], max_new_tokens=MAX_NEW, key=KEY,
                   stop_tokens=(17,), slots=3)
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)  # random drafts: mostly k = 0, and probes
    assert k_iters[0] > 0 and k_iters[1:].sum() > 0, k_iters


def test_cache_growth_carries_the_states(policy, monkeypatch):
    """150 new tokens from a 64-slot cache: the loop state moves to the full length mid-call
    (the states have no capacity axis and move as they are), with speculation and refills,
    for the oracle and for `verify_reference`'s drafter (its state: a copy of the policy's
    HybridCache); the reference is plain decoding in one full-length cache."""
    grows = []
    original = driver.grow_state
    monkeypatch.setattr(driver, "grow_state",
                        lambda *a, capacity, **kw: grows.append(capacity) or original(
                            *a, capacity=capacity, **kw))
    prompts = PROMPTS[:3]
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=150, key=KEY)
    plain = generate(policy, prompts, grow_cache=False, **common)
    assert not grows
    tokens, lengths = pad_prompts(prompts)
    drafter = oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=128)
    out = generate(policy, prompts, drafter=drafter, grow_cache=True, slots=2, **common)
    assert grows, "the cache never grew"
    _assert_plain(out, plain, atol=1e-4)  # log-probs of ~-3 after 150 tokens: float32 rounding
    # a drafter whose state is a copy of the policy's HybridCache, grown and refilled with it
    grows.clear()
    ref = verify_reference(policy, prompts, 3, grow_cache=True, slots=2, **common)
    assert grows and float(ref.stats.acceptance_length) > 3.5
    _assert_plain(ref, plain, atol=1e-4)


def test_bfloat16_speculative_equals_plain():
    bf16 = random_hybrid_policy(_config(), seed=1).astype("bfloat16")
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=MAX_NEW, key=KEY)
    plain = generate(bf16, PROMPTS, **common)
    tokens, lengths = pad_prompts(PROMPTS)
    drafter = oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=128)
    out = generate(bf16, PROMPTS, drafter=drafter, **common)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=2e-2)
    assert float(out.stats.acceptance_length) > 1.5


# --------------------------------------------------------------------------- refusals


_TRACES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, _secs, **_: _TRACES.append(name)
    if name == "/jax/core/compile/jaxpr_trace_duration" else None)


def test_tree_drafters_are_refused_before_tracing(policy, setup):
    head = setup["head"]
    history = HistoryDrafter.for_batch(np.zeros(len(PROMPTS), int), k=3, budget=4)
    trees = {
        "Eagle3Drafter": Eagle3Drafter(head, tree=TreeSpec(top_k=2, depth=3, budget=5)),
        "HistoryDrafter": history,
        "HybridDrafter": HybridDrafter(history, Eagle3Drafter(head, k=3), budget=6),
    }
    for name, drafter in trees.items():
        _TRACES.clear()
        with pytest.raises(ValueError, match=f"{name} proposes draft trees") as info:
            generate(policy, PROMPTS, drafter=drafter, max_new_tokens=4, key=KEY)
        assert "'qwen3_5'" in str(info.value) and not _TRACES, (str(info.value), _TRACES)
    dense = _small_dense(128)
    _TRACES.clear()
    with pytest.raises(ValueError, match="DraftModelDrafter.model must be a jaxspec.models.Policy"):
        generate(dense, PROMPTS, drafter=DraftModelDrafter(policy, k=2), max_new_tokens=4, key=KEY)
    assert not _TRACES


# --------------------------------------------------------------------------- joint law


@dataclasses.dataclass(frozen=True)
class _StateAfterWholeDraft(HybridPolicy):
    """The negative control: a verify that advances the states over every fed token (the
    whole draft) and commits nothing."""

    def forward(self, tokens, positions, cache=None, *, defer_state=False, **kw):
        out = super().forward(tokens, positions, cache, **kw)
        return (*out, types.SimpleNamespace(commit=lambda c, accepted: c)) if defer_state else out


jax.tree_util.register_dataclass(_StateAfterWholeDraft)


def test_states_after_the_whole_draft_break_replay_equality(policy, setup):
    """The negative control of the token-for-token tests: with the states kept after the
    whole draft, the oracle's rollouts leave the plain ones (a rejected draft's tokens stay
    in the linear layers' states)."""
    faulty = _StateAfterWholeDraft(config=policy.config, graphdef=policy.graphdef,
                                   params=policy.params)
    out = generate(faulty, PROMPTS, drafter=setup["drafters"]["oracle"],
                   sampling=setup["sampling"], max_new_tokens=MAX_NEW, key=KEY,
                   stop_tokens=(17,))
    assert not np.array_equal(np.asarray(out.tokens), np.asarray(setup["plain"].tokens))


def test_rejection_sampling_follows_the_policy_joint_law():
    """Chi-square: 4096 rollouts of one prompt, 3 tokens each, rejection-sampled against a
    dense draft model's sampled chains of 2, against the hybrid policy's joint law (float64,
    full forwards). Level 1e-5. Negative control on the same draws' settings: states kept
    after the whole draft instead of the accepted prefix must be rejected."""
    vocab, n, prompt = 6, 4096, [1, 2, 1]
    policy = random_hybrid_policy(_config(vocab_size=vocab, max_position_embeddings=16), seed=5)
    drafter = DraftModelDrafter(_small_dense(vocab), k=2)
    law = continuation_law(policy, prompt, vocab, 3)
    common = dict(drafter=drafter, method="rejection", sampling=SamplingConfig(1.0),
                  max_new_tokens=3, key=jax.random.key(9))
    out = generate(policy, [prompt] * n, **common)
    assert 1.0 < float(out.stats.acceptance_length) < 2.5  # drafts accepted and rejected
    counts = continuation_counts(np.asarray(out.tokens), vocab, 3)
    p_value, statistic, outside = law_test(counts, law)
    assert outside == 0 and p_value >= LEVEL, (p_value, statistic)
    faulty = _StateAfterWholeDraft(config=policy.config, graphdef=policy.graphdef,
                                   params=policy.params)
    bad = generate(faulty, [prompt] * n, **common)
    p_value, statistic, _ = law_test(continuation_counts(np.asarray(bad.tokens), vocab, 3), law)
    assert p_value < LEVEL, f"the whole-draft state passed: chi-square {statistic:.1f}"
