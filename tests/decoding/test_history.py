"""History and hybrid drafting: the on-device index against a brute-force Python search,
the draft trees against a Python trie, exactness in the engine, and the joint law.

Joint law: verify (rejection with point-mass drafts, and replay) on the trees these drafters
build, against the toy target of test_joint_law (jaxspec.testing.toy_law: vocab 4, 3 drafted
levels); 2^17 rollouts per case, each a chi-square test at level 1e-5, so these two cases
fail by chance with probability at most 2e-5 (on top of the 1e-4 of tests/decoding's other
law tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, generate, process_logits, verify
from jaxspec.decoding.drafters import Eagle3Drafter
from jaxspec.decoding.history import (
    HistoryDrafter,
    HistoryStore,
    HybridDrafter,
    HEAD,
    HISTORY,
    merge_chain,
)
from jaxspec.decoding.history_index import lookup, prompt_key, sibling_table
from jaxspec.decoding.history_index import select as _select
from jaxspec.decoding.history_index import trie as _trie
from jaxspec.decoding.protocols import DraftContext, Observation
from jaxspec.decoding.sampling import gumbel_noise
from jaxspec.decoding.verify import _verify_rejection
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.testing.history_trees import reference_tree, tree_paths
from jaxspec.testing.laws import law_test
from jaxspec.testing.toy_law import (
    OFFSETS,
    TARGET,
    TARGET_TABLE,
    VOCAB,
    exact_joint_law,
    faulty_resample_from_p,
)

LAW_ALPHA = 1e-5


# --------------------------------------------------------------------------- references


def _reference_lookup(buffer, lengths, siblings, store_tokens, store_lengths, slots, *,
                      k, min_n, max_n, max_matches):
    """Per row: (matched n, [(continuation tokens as a tuple)] of the first max_matches
    matches), by plain Python loops over every candidate and position."""
    out = []
    for b in range(len(lengths)):
        cands = [(list(buffer[s]), int(lengths[s])) for s in siblings[b] if s >= 0]
        if slots[b] >= 0:
            cands += [(list(store_tokens[slots[b], r]), int(store_lengths[slots[b], r]))
                      for r in range(store_tokens.shape[1])]
        n_b, matches = 0, []
        for n in range(max_n, min_n - 1, -1):
            if lengths[b] < n:
                continue
            suffix = list(buffer[b, lengths[b] - n:lengths[b]])
            found = [(seq[e + 1:min(e + 1 + k, length)])
                     for seq, length in cands
                     for e in range(n - 1, length - 1) if seq[e - n + 1:e + 1] == suffix]
            if found:
                n_b, matches = n, [tuple(int(t) for t in f) for f in found[:max_matches]]
                break
        out.append((n_b, matches))
    return out


def _random_case(seed, batch=12, group=4, vocab=3, width=24, slots=3, ring=2, store_width=20):
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(batch // group), group)
    buffer = rng.integers(0, vocab, (batch, width)).astype(np.int32)
    lengths = rng.integers(1, width - 4, batch).astype(np.int32)
    store_tokens = rng.integers(0, vocab, (slots, ring, store_width)).astype(np.int32)
    store_lengths = rng.integers(0, store_width + 1, (slots, ring)).astype(np.int32)
    row_slot = rng.integers(-1, slots, batch // group)
    return groups, buffer, lengths, store_tokens, store_lengths, np.repeat(row_slot, group)


def _drafter_for(case, **settings):
    groups, _, _, store_tokens, store_lengths, slots = case
    s = HistoryStore.empty(*store_tokens.shape)
    store = HistoryStore(jnp.asarray(store_tokens), jnp.asarray(store_lengths), s.owner,
                         s.next, s.written, s.clock)
    return HistoryDrafter(store=store, siblings=jnp.asarray(sibling_table(groups)),
                          slots=jnp.asarray(slots, jnp.int32), **settings)


def _context(buffer, lengths):
    return DraftContext(buffer=jnp.asarray(buffer), lengths=jnp.asarray(lengths),
                        key=jax.random.key(0), sampling=SamplingConfig(), sampled=False)


# --------------------------------------------------------------------------- the index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookup_and_tree_match_brute_force(seed):
    case = _random_case(seed)
    groups, buffer, lengths, store_tokens, store_lengths, slots = case
    settings = dict(k=3, budget=5, min_n=1, max_n=3, max_matches=6)
    drafter = _drafter_for(case, **settings)
    conts, valid, n = jax.jit(lambda d, b, n: lookup(d, _context(b, n)))(drafter, buffer, lengths)
    tree, _, _ = jax.jit(lambda d, b, n: d.propose(None, None, _context(b, n)))(
        drafter, buffer, lengths)
    ref = _reference_lookup(buffer, lengths, sibling_table(groups), store_tokens, store_lengths,
                            slots, k=3, min_n=1, max_n=3, max_matches=6)
    conts, valid, n = map(np.asarray, (conts, valid, n))
    # non-trivial: several suffix lengths, several matches per row
    assert len({nb for nb, _ in ref}) >= 2 and any(len(m) >= 2 for _, m in ref)
    for b, (n_ref, matches) in enumerate(ref):
        assert n[b] == n_ref, b
        got = [tuple(int(t) for t in conts[b, i][valid[b, i]]) for i in range(6)
               if valid[b, i, 0]]
        assert got == matches, b
        assert tree_paths(tree, b) == reference_tree(matches, 5), b
    assert np.all(np.asarray(tree.depths)[np.asarray(tree.tokens) >= 0] <= 3)


def test_no_match_proposes_an_empty_tree():
    buffer = np.array([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 0, 0]], np.int32)
    drafter = HistoryDrafter.for_batch([0, 1], k=2, budget=3)
    tree, _, _ = drafter.propose(None, None, _context(buffer, np.array([4, 4])))
    assert np.all(np.asarray(tree.tokens) == -1)


def test_sibling_table_groups_rows():
    np.testing.assert_array_equal(sibling_table([7, 7, 3, 7]),
                                  [[0, 1, 3], [0, 1, 3], [2, -1, -1], [0, 1, 3]])


def test_store_ring_and_eviction():
    store = HistoryStore.empty(prompts=2, per_prompt=2, width=4)
    seqs = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    store = store.add([10, 10, 20], seqs, [4, 3, 2])
    assert store.slots_of([10, 20, 30]).tolist() == [0, 1, -1]
    store = store.add([10], [[4, 4, 4, 4]], [1])  # the ring of prompt 10 wraps
    np.testing.assert_array_equal(store.tokens[0, 0], [4, 0, 0, 0])
    np.testing.assert_array_equal(store.lengths[0], [1, 3])
    store = store.add([30], [[8, 8, 8, 8]], [4])  # evicts the least recently written (20)
    assert store.slots_of([10, 20, 30]).tolist() == [0, -1, 1]
    np.testing.assert_array_equal(store.lengths[1], [4, 0])
    assert store.size() == 3 and store.stored_tokens() == 8
    assert prompt_key([1, 2]) == prompt_key(np.array([1, 2])) != prompt_key([2, 1])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="budget=2 must be >= k=3"):
        HistoryDrafter.for_batch([0, 0], k=3, budget=2)
    with pytest.raises(ValueError, match="max_n must be an int >= 3"):
        HistoryDrafter.for_batch([0, 0], min_n=3, max_n=2)
    with pytest.raises(ValueError, match="prompt_keys must have one entry per row"):
        HistoryDrafter.for_batch([0, 0], prompt_keys=[1])


# --------------------------------------------------------------------------- the engine

PROMPTS = [[5, 9, 13, 5], [5, 9, 13, 5], [5, 9, 13, 5], [77, 3], [77, 3], [77, 3]]
GROUPS = [0, 0, 0, 1, 1, 1]
MAX_NEW = 16


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))


@pytest.fixture(scope="module")
def history_store(policy):
    """Earlier rollouts of the same prompts (another key): what the trainer stores."""
    earlier = generate(policy, PROMPTS, sampling=SamplingConfig(temperature=1.0),
                       max_new_tokens=MAX_NEW, key=jax.random.key(5))
    width = 4 + MAX_NEW
    seqs = np.zeros((len(PROMPTS), width), np.int32)
    for i, p in enumerate(PROMPTS):
        seqs[i, :len(p)] = p
        seqs[i, len(p):len(p) + MAX_NEW] = np.asarray(earlier.tokens[i])
    lengths = [len(p) + int(n) for p, n in zip(PROMPTS, np.asarray(earlier.lengths))]
    return HistoryStore.empty(4, 2, width).add([prompt_key(p) for p in PROMPTS], seqs, lengths)


@pytest.mark.parametrize("kind", ["history", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_equals_plain(policy, history_store, kind, temperature):
    sampling, key = SamplingConfig(temperature=temperature), jax.random.key(11)
    plain = generate(policy, PROMPTS, sampling=sampling, max_new_tokens=MAX_NEW, key=key)
    drafter = HistoryDrafter.for_batch(GROUPS, store=history_store, k=3, budget=5,
                                       prompt_keys=[prompt_key(p) for p in PROMPTS])
    if kind == "hybrid":
        head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
        drafter = HybridDrafter(drafter, Eagle3Drafter(head, k=2), budget=6)
    spec = generate(policy, PROMPTS, drafter=drafter, sampling=sampling,
                    max_new_tokens=MAX_NEW, key=key)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
    assert int(spec.stats.target_forwards) <= int(plain.stats.target_forwards)
    if temperature == 0.0:  # identical greedy siblings: the group drafts for itself
        assert spec.stats.acceptance_length > 2.0
    if kind == "hybrid":  # accepted drafts by source: every emitted draft counted once
        by_source = sum(int(spec.draft_stats[f"accepted_{s}"]) for s in ("history_only", "head_only", "both"))
        assert by_source == int(np.sum(spec.stats.accepted_at))
        assert by_source > 0 or temperature > 0
        assert set(spec.draft_stats) == {"accepted_history_only", "accepted_head_only",
                                         "accepted_both", "head_drafted"}
        assert 0 <= int(spec.draft_stats["head_drafted"]) <= int(spec.stats.target_forwards)


@pytest.mark.parametrize("seed", [2, 3])
def test_hybrid_gate_drafts_the_head_only_where_history_falls_short(policy, seed):
    """The gate against the brute-force lookup: a row is covered when one of its matches
    continues a full `history.k` tokens. With every live row covered the head is skipped and
    the tree is the history's best `budget` paths; with one uncovered live row the head
    drafts, and a gate-less hybrid proposes the same tree."""
    case = _random_case(seed, vocab=4)  # seeds with both covered and uncovered rows
    groups, buffer, lengths, store_tokens, store_lengths, slots = case
    k, budget = 3, 6
    history = _drafter_for(case, k=k, budget=budget, min_n=1, max_n=3, max_matches=6)
    ref = _reference_lookup(buffer, lengths, sibling_table(groups), store_tokens, store_lengths,
                            slots, k=k, min_n=1, max_n=3, max_matches=6)
    covered = np.array([any(len(m) == k for m in matches) for _, matches in ref])
    assert covered.any() and not covered.all()  # non-trivial: both kinds of row
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    gated = HybridDrafter(history, Eagle3Drafter(head, k=2), budget=budget)
    always = dataclasses.replace(gated, gate=False)
    state = gated.init_state(policy, len(lengths), buffer.shape[1])

    @jax.jit
    def propose(drafter, live):
        ctx = dataclasses.replace(_context(buffer, lengths), live=live)
        tree, _, st = drafter.propose(state, policy, ctx)
        return tree, st.source, drafter.draft_stats(st)

    tree, source, stats = propose(gated, jnp.asarray(covered))  # uncovered rows not live
    assert int(stats["head_drafted"]) == 0
    assert np.all(np.asarray(source)[np.asarray(tree.tokens) >= 0] == HISTORY)
    for b, (_, matches) in enumerate(ref):
        assert tree_paths(tree, b) == reference_tree(matches, budget), b
    live = covered.copy()
    live[np.flatnonzero(~covered)[0]] = True  # one uncovered live row: the head drafts
    tree, source, stats = propose(gated, jnp.asarray(live))
    assert int(stats["head_drafted"]) == 1
    assert np.any(np.asarray(source) & HEAD)
    tree_always, _, stats = propose(always, jnp.asarray(covered))
    assert int(stats["head_drafted"]) == 1
    for b in range(len(lengths)):
        assert tree_paths(tree, b) == tree_paths(tree_always, b), b


def test_merge_chain_dedups_and_tracks_sources():
    """Matches continuing [1, 2], [1, 2], [1, 3] and a head chain [1, 4]: node 1 is kept
    once, with both sources."""
    conts = jnp.asarray([[[1, 2], [1, 2], [1, 3]]], jnp.int32)
    pool = _trie(conts, jnp.ones(conts.shape, bool))
    merged, source = merge_chain(pool, jnp.asarray([[1, 4]]), jnp.asarray([[0.9, 0.5]]))
    tree, src = _select(*merged, 4, 2, extra=source)
    got = {}
    for i, (t, p) in enumerate(zip(np.asarray(tree.tokens[0]), np.asarray(tree.parents[0]))):
        prefix = () if p < 0 else got[int(p)][0]
        got[i] = (prefix + (int(t),), int(src[0, i]))
    assert sorted(got.values()) == [((1,), HISTORY | HEAD), ((1, 2), HISTORY), ((1, 3), HISTORY),
                                    ((1, 4), HEAD)]


def test_store_of_another_vocabulary_is_refused(policy):
    vocab = policy.config.vocab_size
    store = HistoryStore.empty(1, 1, 4).add([1], [[3, vocab, 4, 5]], [4])
    drafter = HistoryDrafter.for_batch([0], store=store, prompt_keys=[1])
    with pytest.raises(ValueError, match=f"token id {vocab}; the policy's vocabulary"):
        generate(policy, [[1, 2]], drafter=drafter, max_new_tokens=2, key=jax.random.key(0))


# --------------------------------------------------------------------------- the joint law


def _law_trees(kind, batch=64):
    """Trees of depth <= 3 over vocab 4 from random sibling buffers and stores."""
    case = _random_case(3, batch=batch, group=4, vocab=VOCAB, width=16, slots=8, ring=2,
                        store_width=12)
    _, buffer, lengths, *_ = case
    history = _drafter_for(case, k=3, budget=6, min_n=1, max_n=2, max_matches=8)
    ctx = _context(buffer, lengths)
    if kind == "history":
        tree, _, _ = history.propose(None, None, ctx)
        return tree
    pool, _ = history.pool(ctx)
    rng = np.random.default_rng(4)
    chain = jnp.asarray(rng.integers(0, VOCAB, (batch, 3)), jnp.int32)
    scores = jnp.asarray(np.cumprod(rng.uniform(0.2, 1.0, (batch, 3)), axis=1), jnp.float32)
    merged, _ = merge_chain(pool, chain, scores)
    return _select(*merged, 7, 3)


@functools.partial(jax.jit, static_argnames=("method", "n"))
def _law_codes(tree, table, key, *, method, n):
    """Codes of 4 tokens: verify's emitted prefix on tree row r % B, completed by plain
    sampling with the same noise (what the engine's next rounds would emit)."""
    batch = tree.tokens.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    t = jax.tree.map(lambda x: x[rows % batch], tree)
    # prefix code of each node (absent nodes: any row; they are never accepted)
    codes = []
    for i in range(t.tokens.shape[1]):
        parent = t.parents[:, i]
        base = jnp.where(parent < 0, 0, jnp.stack(codes + [jnp.zeros_like(rows)], 1)[
            rows, jnp.maximum(parent, 0)])
        codes.append(base * VOCAB + jnp.clip(t.tokens[:, i], 0, VOCAB - 1))
    fed = [jnp.zeros_like(rows)] + [jnp.asarray(OFFSETS)[jnp.clip(t.depths[:, i], 0, 3)] + codes[i]
                                    for i in range(len(codes))]
    logits = table[jnp.stack(fed, 1)]
    cfg = SamplingConfig(**TARGET)
    positions = 11 + rows % 7
    logp = process_logits(table, cfg)
    if method == "resample_from_p":  # a negative control: p instead of the residual
        verdict = _verify_rejection(key, process_logits(logits, cfg), t, positions, rows, None,
                                    step=faulty_resample_from_p)
    else:
        verdict = verify(key, logits, t, cfg, method=method, positions=positions, rows=rows)
    noise = gumbel_noise(key, rows, positions[:, None] + jnp.arange(4), VOCAB)
    code = jnp.zeros_like(rows)
    for d in range(4):
        plain = jnp.argmax(logp[OFFSETS[d] + code] + noise[:, d], axis=1)
        token = jnp.where(d <= verdict.num_accepted, verdict.tokens[:, d], plain)
        code = code * VOCAB + token
    return code, verdict.num_accepted


@pytest.mark.parametrize("kind,method", [("history", "rejection"), ("hybrid", "replay")])
def test_joint_law(kind, method):
    tree = _law_trees(kind)
    n = 1 << 17
    codes, accepted = _law_codes(tree, jnp.asarray(TARGET_TABLE), jax.random.key(9),
                                 method=method, n=n)
    assert float(jnp.mean(accepted)) > 0.3  # the trees do get accepted
    counts = np.bincount(np.asarray(codes), minlength=VOCAB**4)
    p_value, statistic, outside = law_test(counts, exact_joint_law(TARGET, 3))
    assert outside == 0, f"{outside} sequences outside the target's support"
    assert p_value > LAW_ALPHA, f"chi-square {statistic:.1f}, p-value {p_value:.3g}"


def test_joint_law_negative_control():
    """The same test rejects a known breach (resampling p after a rejection) on these trees."""
    codes, _ = _law_codes(_law_trees("history"), jnp.asarray(TARGET_TABLE), jax.random.key(9),
                          method="resample_from_p", n=1 << 17)
    counts = np.bincount(np.asarray(codes), minlength=VOCAB**4)
    p_value, statistic, _ = law_test(counts, exact_joint_law(TARGET, 3))
    assert p_value <= LAW_ALPHA, f"breach passed: chi-square {statistic:.1f}, p {p_value:.3g}"


def _observations(policy, head, batch, steps, width, seed):
    """`steps` observations of `width` entries per row, positions continuing from 0 with a
    random number of valid entries per row and step (the rest padding -1)."""
    rng = np.random.default_rng(seed)
    hidden, vocab = policy.config.hidden_size, policy.config.vocab_size
    nxt = np.zeros(batch, np.int64)
    out = []
    for _ in range(steps):
        n = rng.integers(1, width + 1, batch)
        pos = np.where(np.arange(width)[None] < n[:, None], nxt[:, None] + np.arange(width)[None], -1)
        nxt = nxt + n
        out.append(Observation(
            fed_tokens=jnp.asarray(rng.integers(0, vocab, (batch, width)), jnp.int32),
            next_tokens=jnp.asarray(rng.integers(0, vocab, (batch, width)), jnp.int32),
            positions=jnp.asarray(pos, jnp.int32),
            captured={layer: jnp.asarray(rng.normal(size=(batch, width, hidden)), jnp.float32)
                      for layer in head.capture_layers}))
    return out


@pytest.mark.parametrize("steps", [3, 6])
def test_gated_head_observes_the_ring_as_it_would_have_step_by_step(policy, steps):
    """The gate's deferred observation against the head observing at every step: after 3
    steps (<= 12 entries per row, the ring holds all of them) the flushed head's state (its
    cache and last hidden state) equals the step-by-step one; after 6 (up to 24 entries) the
    ring keeps each row's last 16 positions, and the flush equals observing exactly those
    entries step by step."""
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    chain = Eagle3Drafter(head, k=2)
    hybrid = HybridDrafter(HistoryDrafter.for_batch([0, 0, 1], k=3, budget=4), chain, budget=4)
    batch, max_len = 3, 48
    obs = _observations(policy, head, batch, steps, 4, seed=steps)
    state = hybrid.init_state(policy, batch, max_len)
    for o in obs:
        state = hybrid.observe(state, policy, o)
    flushed = jax.jit(lambda s: hybrid._flush_and_draft(s, policy, _context(
        np.zeros((batch, max_len), np.int32), np.full(batch, 1, np.int32)))[2])(state)
    # the reference: the chain drafter's own observe, step by step, over the entries the ring
    # keeps (each row's last 16 positions)
    newest = np.max([np.asarray(o.positions).max(axis=1) for o in obs], axis=0)
    want = chain.init_state(policy, batch, max_len)
    for o in obs:
        pos = np.asarray(o.positions)
        kept = (pos >= 0) & (pos > newest[:, None] - 16)
        want = chain.observe(want, policy, dataclasses.replace(
            o, positions=jnp.asarray(np.where(kept, pos, -1), jnp.int32)))
    if steps == 3:
        assert np.all(newest + 1 <= 16)  # nothing dropped
    else:
        assert np.any(newest + 1 > 16)  # entries were dropped: the overflow case is exercised
    np.testing.assert_array_equal(flushed.cache.lengths, want.cache.lengths)
    for b in range(batch):
        n = int(want.cache.lengths[b])
        np.testing.assert_allclose(flushed.cache.k[:, b, :n], want.cache.k[:, b, :n], atol=1e-5)
        np.testing.assert_allclose(flushed.cache.v[:, b, :n], want.cache.v[:, b, :n], atol=1e-5)
    np.testing.assert_allclose(flushed.last_hidden, want.last_hidden, atol=1e-4)


def test_hybrid_ring_holds_a_verify_whatever_the_depth():
    """The gate's ring defaults to max(16, max_depth + 1) positions; a window shorter than
    one verify's commits is refused with the value and the minimum."""
    head = Eagle3Head.init_for(Policy.init(ModelConfig.tiny("qwen3", num_layers=2),
                                           jax.random.key(0)), 96, jax.random.key(1))
    deep = HistoryDrafter.for_batch([0, 0], k=20, budget=20)
    assert HybridDrafter(deep, Eagle3Drafter(head, k=2), budget=20).ring_size == 21
    shallow = HistoryDrafter.for_batch([0, 0], k=3, budget=4)
    assert HybridDrafter(shallow, Eagle3Drafter(head, k=2), budget=4).ring_size == 16
    with pytest.raises(ValueError, match="HybridDrafter.window must be an int >= 4; got 3"):
        HybridDrafter(shallow, Eagle3Drafter(head, k=2), budget=4, window=3)


@pytest.mark.parametrize("width", [24, 8])
def test_gated_head_observes_a_prompt_whole(policy, width):
    """A prompt wider than the ring (24 > 16 positions) is observed at once; one the ring
    holds (8) waits in it, with the verify's commits after it, for the next draft (the
    head's cache is untouched until then). Either way, after the prompt and one verify's
    commits the flushed head equals the head that observed both, step by step."""
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    chain = Eagle3Drafter(head, k=2)
    hybrid = HybridDrafter(HistoryDrafter.for_batch([0, 0], k=3, budget=4), chain, budget=4)
    batch, max_len = 2, 64
    prompt, = _observations(policy, head, batch, 1, width, seed=9)
    full = dataclasses.replace(prompt, positions=jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32),
                                                                  (batch, width)))
    step, = _observations(policy, head, batch, 1, 4, seed=10)
    step = dataclasses.replace(step, positions=jnp.where(step.positions >= 0, step.positions + width, -1))
    ctx = _context(np.zeros((batch, max_len), np.int32), np.full(batch, 1, np.int32))

    @jax.jit  # one program each (eager, the head's ops cost ~10 s of dispatch)
    def gated():
        state = hybrid.init_state(policy, batch, max_len)
        state = hybrid.observe(hybrid.observe(state, policy, full), policy, step)
        return hybrid._flush_and_draft(state, policy, ctx)[2], state.head.cache.lengths

    @jax.jit
    def stepwise():
        state = chain.init_state(policy, batch, max_len)
        return chain.observe(chain.observe(state, policy, full), policy, step)

    (flushed, before_flush), want = gated(), stepwise()
    # observed at once (24) or deferred (8): the head's cache before the flush
    np.testing.assert_array_equal(before_flush, np.full(batch, width if width > 16 else 0))
    np.testing.assert_array_equal(flushed.cache.lengths, want.cache.lengths)
    assert int(np.min(want.cache.lengths)) > width  # the whole prompt, then the step
    np.testing.assert_allclose(flushed.cache.k, want.cache.k, atol=1e-5)
    np.testing.assert_allclose(flushed.last_hidden, want.last_hidden, atol=1e-4)
