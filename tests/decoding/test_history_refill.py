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
from test_history import _reference_tree, _tree_paths

from jaxspec.decoding import SamplingConfig, generate
from jaxspec.decoding.drafters import Eagle3Drafter
from jaxspec.decoding.history import (
    HistoryDrafter,
    HistoryStore,
    HybridDrafter,
    lookup,
    prompt_key,
    sibling_table,
)
from jaxspec.decoding.protocols import DraftContext, Finished
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.rl.rollouts import leaders_first

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
        assert _tree_paths(tree, b) == _reference_tree(matches, SETTINGS["budget"]), b
        for src in {src for src, _ in found}:
            sources[src] += 1
    # non-trivial: several rows take matches from other rows and from finished members,
    # with several suffix lengths
    assert sources["row"] >= 2 and sources["finished"] >= 2, sources
    assert len(set(n.tolist())) >= 2
