"""History and hybrid drafts with continuous batching (`generate(slots=S)`, S < prompts).

The index: `lookup` and the proposed tree for rows that hold a shuffled subset of the
prompts, with some group members finished (read from `DraftContext.finished`) and some not
started, against a plain-Python search over candidate lists assembled from the stated rules.
The engine: tokens equal plain decoding whatever the slots and start order; and a follower
drafting from its finished leader (greedy, identical prompts) has every draft accepted, which
a run with the finished rollouts hidden (the negative control) does not.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, generate
from jaxspec.decoding.drafters import Eagle3Drafter
from jaxspec.decoding.driver import capacity_tiers
from jaxspec.decoding.history import HistoryDrafter, HistoryStore, HybridDrafter
from jaxspec.decoding.history_index import lookup, prompt_key, sibling_table
from jaxspec.decoding.protocols import DraftContext, Finished
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.rl.rollouts import leaders_first
from jaxspec.testing.history_trees import reference_tree, tree_paths

# --------------------------------------------------------------------------- the index

SETTINGS = dict(k=3, budget=5, min_n=1, max_n=3, max_matches=6)


def _refill_case(seed, num_prompts=12, batch=5, vocab=4, prompt_width=6, gen_width=10,
                 buf_width=20, store_slots=3, ring=2, store_width=14):
    """A mid-call snapshot: `batch` rows hold a shuffled subset of `num_prompts` prompts in
    groups of unequal sizes (so -1 padded), the others finished or not started (generated
    length 0); junk past every length."""
    rng = np.random.default_rng(seed)
    groups = rng.permutation(np.repeat(np.arange(3), [5, 4, 3]))
    held = rng.permutation(num_prompts)[:batch].astype(np.int32)
    buffer = rng.integers(0, vocab, (batch, buf_width)).astype(np.int32)
    lengths = rng.integers(3, buf_width - 2, batch).astype(np.int32)
    prompt_tokens = rng.integers(0, vocab, (num_prompts, prompt_width)).astype(np.int32)
    prompt_lengths = rng.integers(1, prompt_width + 1, num_prompts).astype(np.int32)
    gen_tokens = rng.integers(0, vocab, (num_prompts, gen_width)).astype(np.int32)
    gen_lengths = rng.integers(1, gen_width + 1, num_prompts).astype(np.int32)
    gen_lengths[rng.random(num_prompts) < 0.35] = 0  # not started (or nothing harvested)
    store_tokens = rng.integers(0, vocab, (store_slots, ring, store_width)).astype(np.int32)
    store_lengths = rng.integers(0, store_width + 1, (store_slots, ring)).astype(np.int32)
    group_slot = rng.integers(-1, store_slots, 3)
    return dict(groups=groups, held=held, buffer=buffer, lengths=lengths,
                prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths,
                gen_tokens=gen_tokens, gen_lengths=gen_lengths, store_tokens=store_tokens,
                store_lengths=store_lengths, slots=group_slot[groups].astype(np.int32))


def _reference_candidates(c, b):
    """Row b's candidates as (source, token list): its group's members in prompt order (a
    held member from its row's buffer, another from its prompt + generated tokens, none if
    it has generated nothing; the row itself is "self"), then its prompt's stored sequences."""
    p = int(c["held"][b])
    held = [int(q) for q in c["held"]]
    out = []
    for q in range(len(c["groups"])):
        if c["groups"][q] != c["groups"][p]:
            continue
        if q in held:
            r = held.index(q)
            out.append(("self" if r == b else "row", [int(t) for t in c["buffer"][r, :c["lengths"][r]]]))
        elif c["gen_lengths"][q] > 0:
            seq = list(c["prompt_tokens"][q, :c["prompt_lengths"][q]]) + \
                list(c["gen_tokens"][q, :c["gen_lengths"][q]])
            out.append(("finished", [int(t) for t in seq]))
        else:
            out.append(("empty", []))
    slot = int(c["slots"][p])
    if slot >= 0:
        out += [("store", [int(t) for t in c["store_tokens"][slot, r, :c["store_lengths"][slot, r]]])
                for r in range(c["store_tokens"].shape[1])]
    return out


def _reference_search(own, cands, *, k, min_n, max_n, max_matches, **_):
    """(n, [(source, continuation tuple)]) of the first max_matches matches of the longest
    suffix of `own` that occurs (with a continuation) in the candidates, in candidate then
    position order."""
    for n in range(max_n, min_n - 1, -1):
        if len(own) < n:
            continue
        suffix = own[-n:]
        found = [(src, tuple(seq[e + 1:e + 1 + k])) for src, seq in cands
                 for e in range(n - 1, len(seq) - 1) if seq[e - n + 1:e + 1] == suffix]
        if found:
            return n, found[:max_matches]
    return 0, []


def _refill_drafter(c):
    s = HistoryStore.empty(*c["store_tokens"].shape)
    store = HistoryStore(jnp.asarray(c["store_tokens"]), jnp.asarray(c["store_lengths"]),
                         s.owner, s.next, s.written, s.clock)
    return HistoryDrafter(store=store, siblings=jnp.asarray(sibling_table(c["groups"])),
                          slots=jnp.asarray(c["slots"]), **SETTINGS)


def _refill_context(c):
    finished = Finished(*(jnp.asarray(c[name]) for name in
                          ("prompt_tokens", "prompt_lengths", "gen_tokens", "gen_lengths")))
    return DraftContext(buffer=jnp.asarray(c["buffer"]), lengths=jnp.asarray(c["lengths"]),
                        key=jax.random.key(0), sampling=SamplingConfig(), sampled=False,
                        sequences=jnp.asarray(c["held"]), finished=finished)


@jax.jit
def _lookup_and_tree(drafter, c):
    ctx = _refill_context(c)
    tree, _, _ = drafter.propose(None, None, ctx)
    return lookup(drafter, ctx), tree


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_lookup_reads_rows_and_finished_members(seed):
    c = _refill_case(seed)
    drafter = _refill_drafter(c)
    (conts, valid, n), tree = _lookup_and_tree(drafter, {k: jnp.asarray(v) for k, v in c.items()})
    conts, valid, n = map(np.asarray, (conts, valid, n))
    sources = {"self": 0, "row": 0, "finished": 0, "store": 0}  # rows matching each source
    for b in range(len(c["held"])):
        own = [int(t) for t in c["buffer"][b, :c["lengths"][b]]]
        n_ref, found = _reference_search(own, _reference_candidates(c, b), **SETTINGS)
        matches = [cont for _, cont in found]
        assert n[b] == n_ref, b
        got = [tuple(int(t) for t in conts[b, i][valid[b, i]]) for i in range(SETTINGS["max_matches"])
               if valid[b, i, 0]]
        assert got == matches, b
        assert tree_paths(tree, b) == reference_tree(matches, SETTINGS["budget"]), b
        for src in {src for src, _ in found}:
            sources[src] += 1
    # non-trivial: several rows take matches from other rows and from finished members,
    # with several suffix lengths
    assert sources["row"] >= 2 and sources["finished"] >= 2, sources
    assert len(set(n.tolist())) >= 2


# --------------------------------------------------------------------------- the engine

# Two prompts, three samples each (group-major, as the trainer lays out a step).
PROMPTS = [[5, 9, 13, 5]] * 3 + [[77, 3]] * 3
GROUPS = [0, 0, 0, 1, 1, 1]
ROWS = 100 + np.arange(len(PROMPTS), dtype=np.int32)  # global rollout ids
ORDER = leaders_first(2, 3)  # [0, 3, 1, 4, 2, 5]
MAX_NEW = 12
STOPS = (48, 107)  # ragged lengths: some rows stop early, some run to the budget
KEY = jax.random.key(11)


@pytest.fixture(scope="module")
def policy():
    """A tiny random policy with its weights scaled up: its greedy continuations do not
    repeat one token (the unscaled one's do), so a draft that follows them is informative."""
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    return dataclasses.replace(policy, params=jax.tree.map(lambda x: 4.0 * x, policy.params))


@pytest.fixture(scope="module")
def plain(policy):
    """Plain decoding of PROMPTS at temperatures 0 and 1 (no drafter, no slots)."""
    return {t: generate(policy, PROMPTS, sampling=SamplingConfig(temperature=t),
                        max_new_tokens=MAX_NEW, key=KEY, rows=ROWS, stop_tokens=STOPS)
            for t in (0.0, 1.0)}


@pytest.fixture(scope="module")
def drafters(policy):
    """History (with a store of earlier rollouts of the prompts) and hybrid drafters."""
    earlier = generate(policy, PROMPTS, sampling=SamplingConfig(temperature=1.0),
                       max_new_tokens=MAX_NEW, key=jax.random.key(5), rows=ROWS)
    width = 4 + MAX_NEW
    done = [list(p) + np.asarray(t)[:n].tolist()  # prompt + its (unstopped) rollout
            for p, t, n in zip(PROMPTS, earlier.tokens, earlier.lengths)][::2]
    keys = [prompt_key(p) for p in PROMPTS]
    store = HistoryStore.empty(2, 2, width).add(
        keys[::2], [seq + [0] * (width - len(seq)) for seq in done], [len(seq) for seq in done])
    history = HistoryDrafter.for_batch(GROUPS, store=store, prompt_keys=keys, k=3, budget=5)
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    return {"history": history,
            "hybrid": HybridDrafter(history, Eagle3Drafter(head, k=2), budget=6)}


@pytest.mark.parametrize("slots", [1, 2, None])
@pytest.mark.parametrize("kind", ["history", "hybrid"])
def test_refilled_drafts_equal_plain(policy, plain, drafters, kind, slots):
    """Leaders first in `slots` slots (None: all rows, in the permuted order): tokens,
    lengths and log-probs of plain decoding, at temperature 0 and 1 (replay)."""
    for temperature, ref in plain.items():
        out = generate(policy, PROMPTS, drafter=drafters[kind],
                       sampling=SamplingConfig(temperature=temperature), max_new_tokens=MAX_NEW,
                       key=KEY, rows=ROWS, stop_tokens=STOPS, slots=slots, order=ORDER)
        np.testing.assert_array_equal(out.lengths, ref.lengths)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
        np.testing.assert_array_equal(out.stats.tokens_generated, ref.lengths)
        if temperature == 0.0 and slots is not None:  # identical greedy samples, started
            assert out.stats.acceptance_length > 1.5  # after a sibling: drafts from it
    lengths = np.asarray(plain[1.0].lengths)
    assert len(set(lengths.tolist())) >= 3 and lengths.max() == MAX_NEW  # ragged


def _greedy_followers(policy, k):
    """Greedy, one slot, leaders first, no stop: -> (plain, speculative) Rollouts."""
    kw = dict(sampling=SamplingConfig(temperature=0.0), max_new_tokens=MAX_NEW, key=KEY,
              rows=ROWS)
    drafter = HistoryDrafter.for_batch(GROUPS, k=k, budget=k)  # one chain, no store
    return (generate(policy, PROMPTS, **kw),
            generate(policy, PROMPTS, drafter=drafter, slots=1, order=ORDER, **kw))


def test_followers_draft_from_their_finished_leader(policy, monkeypatch):
    """Identical greedy samples in one slot, leaders first: each follower starts after its
    leader finished and drafts from it (its only source besides itself), so every draft is
    accepted: ceil(L / (k + 1)) forwards for L tokens. Negative control: with the finished
    rollouts hidden, a follower drafts from itself alone, exactly as its leader did (same
    forwards), far more than that."""
    k = 4
    plain, out = _greedy_followers(policy, k)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    tokens, lengths = np.asarray(plain.tokens), np.asarray(plain.lengths)
    assert np.all(lengths == MAX_NEW)
    for leader in (0, 3):  # the followers' completions are the leader's
        np.testing.assert_array_equal(tokens[leader + 1:leader + 3], tokens[[leader] * 2])
        assert len(set(tokens[leader].tolist())) >= MAX_NEW - 2  # not one repeated token
    steps = np.asarray(out.stats.row_steps)
    followers, leaders = [1, 2, 4, 5], [0, 0, 3, 3]
    np.testing.assert_array_equal(steps[followers], math.ceil(MAX_NEW / (k + 1)))
    assert np.all(steps[[0, 3]] >= MAX_NEW - 3)  # a leader has nothing ahead of it

    # The same run with every finished rollout hidden (as if generated nothing).
    jax.clear_caches()  # retrace the loop with the patched method
    seqs = Finished.sequences
    monkeypatch.setattr(Finished, "sequences",
                        lambda self, index: (seqs(self, index)[0], 0 * seqs(self, index)[1]))
    try:
        _, hidden = _greedy_followers(policy, k)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # no later call may reuse the patched trace
    np.testing.assert_array_equal(hidden.tokens, plain.tokens)
    hidden_steps = np.asarray(hidden.stats.row_steps)
    np.testing.assert_array_equal(hidden_steps[followers], steps[leaders])
    assert hidden.stats.acceptance_length < 0.6 * out.stats.acceptance_length


def test_drafts_survive_a_cache_growth(policy):
    """Rollouts longer than the first cache tier (64 slots: the loop state grows mid-call,
    harvesting and restoring the rows): the same tokens as plain decoding and the same
    forwards per rollout, so the same drafts, as with the full cache from the start."""
    kw = dict(sampling=SamplingConfig(temperature=0.0), max_new_tokens=140, key=KEY, rows=ROWS)
    plain = generate(policy, PROMPTS, **kw)
    drafter = HistoryDrafter.for_batch(GROUPS, k=4, budget=6)
    # the case grows: a 64-slot cache first, then prompt width 4 + 140
    assert capacity_tiers(policy, drafter, 4, 6, 4 + 140, True) == [64, 144]
    grown, full = (generate(policy, PROMPTS, drafter=drafter, slots=1, order=ORDER,
                            grow_cache=grow, **kw) for grow in (True, False))
    for out in (grown, full):
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(grown.stats.row_steps, full.stats.row_steps)
    steps = np.asarray(full.stats.row_steps)
    assert np.all(steps[[1, 2, 4, 5]] < steps[[0, 0, 3, 3]] / 3)  # followers draft from leaders
