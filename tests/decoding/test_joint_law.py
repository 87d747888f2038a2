"""Joint law of verified sequences against a toy prefix-dependent target (chi-square).

The toy target and draft are tables of logits indexed by the prefix emitted so far (vocab 4,
up to 3 drafted levels). Each rollout drafts a tree from the draft model, feeds verify the
target logits of every tree node, and completes the emitted prefix to D+1 tokens by plain
sampling with the same key at the following positions (what the engine's next round does).
Lossless verification means these D+1 tokens follow the target's processed joint law
P(y_0..y_D) = prod_d p(y_d | y_<d) exactly; the emitted prefix alone has a random length, so
it is its completion whose law is fixed.

Statistics: 2^20 rollouts per lossless case. Each is a chi-square test at level ALPHA
(jaxspec.testing.laws: 1e-4 over the suite's chi-square tests, Bonferroni), so the false-failure
probability of the whole of tests/decoding is at most 1e-4. Tokens outside the target's
support fail outright (probability 0 under a correct rule). Negative controls (published
bugs, reproduced here) must be rejected by the same test on 2^18 rollouts; their statistics
are 15-150 times the critical value, so they pass by chance with negligible probability.

All cases of one topology run in one compiled function on shared drafts (each case's law is
tested on its own; how the cases correlate does not matter), which keeps compile time down.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, Tree, process_logits, sample, verify
from jaxspec.decoding.sampling import gumbel_noise
from jaxspec.decoding.verify import _rejection_step, _verify_rejection
from jaxspec.testing.laws import ALPHA, law_test, top_p_margin
from jaxspec.testing.toy_law import (
    DRAFT,
    DRAFT_TABLE,
    MAX_DEPTH,
    OFFSETS,
    TARGET,
    TARGET_TABLE,
    VOCAB,
    exact_joint_law,
    faulty_resample_from_p,
)

CHUNK = 1 << 18
NUM_CHUNKS = 4  # 2^20 rollouts per lossless case
NEGATIVE_SHARE = 4  # negative controls run on the first CHUNK / 4 rows of each chunk: 2^18

TOPOLOGIES = {
    "chain": (-1, 0, 1),
    # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 2 -> {5, 6}
    "tree": (-1, -1, 0, 0, 1, 2, 2),
}


def _depths(parents):
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def test_tables_keep_away_from_top_p_boundaries():
    # A cumulative mass within 1e-4 of top_p could make float32 and float64 keep different sets.
    assert top_p_margin(TARGET_TABLE, **TARGET) > 1e-4


def _faulty_residual_at_drafted_token(p, q, x):
    accept_prob, _ = _rejection_step(p, q, x)
    at_x = jnp.arange(p.shape[1]) == x[:, None]
    leftover = jnp.where(at_x, jnp.maximum(p - q, 0.0), p)  # EAGLE #47: subtract q only at x
    return accept_prob, leftover / jnp.sum(leftover, axis=1, keepdims=True)


LOSSLESS_CASES = [  # (topology, how the drafts were drawn, rule)
    ("chain", "sampled", "replay"),
    ("tree", "sampled", "replay"),
    ("chain", "sampled", "rejection"),  # Leviathan/Chen
    ("tree", "sampled", "rejection"),  # siblings i.i.d. from q
    ("tree", "without_replacement", "rejection"),  # siblings distinct, q renormalised
    ("tree", "top_k", "rejection"),  # deterministic drafts, draft_probs=None (point masses)
]
NEGATIVE_CONTROLS = [
    ("chain", "raw_q", "rejection"),  # HF transformers #47932: raw q for processed drafts
    ("chain", "argmax_softmax_q", "rejection"),  # HF #32867: argmax drafts against softmax q
    ("chain", "sampled", "resample_from_p"),  # after a rejection, p instead of the residual
    ("chain", "sampled", "unprocessed_target"),  # vLLM #10198: p before temperature/top-k/top-p
    ("tree", "sampled", "residual_at_drafted_token"),  # EAGLE #47 / xLLM #2175
]


def _draw_tree(key, rows, draft_table, topology, mode):
    """Drafts from the toy draft model: (tree, codes of each node's prefix, processed q, raw q).

    mode: "sampled" (each node from q given its prefix; siblings i.i.d.), "without_replacement"
    (siblings distinct: q with earlier siblings removed, renormalised), "ranked" (deterministic:
    the i-th sibling is the draft's i-th best token).
    """
    parents = TOPOLOGIES[topology]
    depths = _depths(parents)
    batch = rows.shape[0]
    draft_logq_table = process_logits(draft_table, SamplingConfig(**DRAFT))
    draft_rank_table = jnp.argsort(-draft_table, axis=1)
    codes, tokens, processed_q, raw_q = [], [], [], []
    taken = {}  # parent -> [B, V] tokens its earlier children took
    for i, parent in enumerate(parents):
        parent_code = jnp.zeros_like(rows) if parent < 0 else codes[parent]
        table_row = OFFSETS[0 if parent < 0 else depths[parent]] + parent_code
        logq = draft_logq_table[table_row]  # [B, V] the draft's processed distribution
        used = taken.get(parent, jnp.zeros((batch, VOCAB), bool))
        if mode == "without_replacement":
            logq = jnp.where(used, -jnp.inf, logq)
            logq = logq - jax.nn.logsumexp(logq, axis=1, keepdims=True)
        if mode == "ranked":
            x = draft_rank_table[table_row, sum(1 for j in range(i) if parents[j] == parent)]
        else:
            x = jax.random.categorical(jax.random.fold_in(key, i), logq, axis=1)
        taken[parent] = used | (jnp.arange(VOCAB) == x[:, None])
        codes.append(parent_code * VOCAB + x)
        tokens.append(x)
        processed_q.append(jnp.exp(logq))
        raw_q.append(jax.nn.softmax(draft_table[table_row], axis=1))
    tree = Tree(
        jnp.stack(tokens, 1),
        jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (batch, len(parents))),
        jnp.broadcast_to(jnp.asarray(depths, jnp.int32), (batch, len(parents))),
        max_depth=max(depths),
    )
    return tree, codes, jnp.stack(processed_q, 1), jnp.stack(raw_q, 1)


def _verdict(key, target_table, cfg, topology, tree, codes, processed_q, raw_q, positions, rows, draft, rule):
    depths = _depths(TOPOLOGIES[topology])
    fed_rows = [jnp.zeros_like(rows)] + [OFFSETS[d] + c for d, c in zip(depths, codes)]
    target_logits = target_table[jnp.stack(fed_rows, 1)]  # [B, N+1, V]: what the policy would return
    if rule == "replay":
        return verify(key, target_logits, tree, cfg, method="replay", positions=positions, rows=rows)
    draft_probs = {"top_k": None, "raw_q": raw_q}.get(draft, processed_q)
    if rule == "rejection":
        return verify(
            key,
            target_logits,
            tree,
            cfg,
            method="rejection",
            positions=positions,
            draft_probs=draft_probs,
            rows=rows,
        )
    step = {
        "resample_from_p": faulty_resample_from_p,
        "residual_at_drafted_token": _faulty_residual_at_drafted_token,
    }.get(rule, _rejection_step)
    logp = process_logits(target_logits, cfg)
    if rule == "unprocessed_target":
        logp = jax.nn.log_softmax(target_logits, axis=-1)
    return _verify_rejection(key, logp, tree, positions, rows, draft_probs, step=step)


def _first_rows(array, n):
    return array[:n]


DRAFT_MODE = {
    "sampled": "sampled",
    "raw_q": "sampled",
    "without_replacement": "without_replacement",
    "top_k": "ranked",
    "argmax_softmax_q": "ranked",
}


@functools.partial(jax.jit, static_argnames=("cases", "batch", "complete_with_sample"))
def rollouts(key, row_offset, target_table, draft_table, cfg, *, cases, batch, complete_with_sample=False):
    """For each case (all of one topology): codes in [0, V^(D+1)) of the emitted tokens completed
    to D+1 by plain sampling with the same key, as the engine's next rounds would.

    The tables are arguments, not constants, so XLA does not constant-fold the root's work.
    Negative controls use the first batch // NEGATIVE_SHARE rows.
    """
    topology = cases[0][0]
    max_depth = max(_depths(TOPOLOGIES[topology]))
    rows = row_offset + jnp.arange(batch, dtype=jnp.int32)
    positions = 11 + rows % 7
    draft_key = jax.random.fold_in(jax.random.fold_in(key, 7777), row_offset)  # not verify's noise
    drafts = {
        mode: _draw_tree(draft_key, rows, draft_table, topology, mode)
        for mode in sorted({DRAFT_MODE[draft] for _, draft, _ in cases})
    }
    target_logp_table = process_logits(target_table, cfg)
    noise = gumbel_noise(key, rows, positions[:, None] + jnp.arange(max_depth + 1), VOCAB)
    out = {}
    for case in cases:
        _, draft, rule = case
        tree, codes, processed_q, raw_q = drafts[DRAFT_MODE[draft]]
        n = batch if case in LOSSLESS_CASES or complete_with_sample else batch // NEGATIVE_SHARE
        take = functools.partial(_first_rows, n=n)
        verdict = _verdict(
            key,
            target_table,
            cfg,
            topology,
            jax.tree.map(take, tree),
            [take(c) for c in codes],
            take(processed_q),
            take(raw_q),
            take(positions),
            take(rows),
            draft,
            rule,
        )
        code = jnp.zeros((n,), jnp.int32)
        for d in range(max_depth + 1):
            prefix_row = OFFSETS[d] + code
            if complete_with_sample:
                plain, _ = sample(key, target_table[prefix_row], cfg, positions[:n] + d, rows[:n])
            else:
                plain = jnp.argmax(target_logp_table[prefix_row] + noise[:n, d], axis=1)
            token = jnp.where(d <= verdict.num_accepted, verdict.tokens[:, d], plain)
            code = code * VOCAB + token
        out[case] = code
    return out


@functools.cache
def topology_counts(topology):
    """Histogram of completed sequences for every case of `topology` (computed once)."""
    cases = tuple(c for c in LOSSLESS_CASES + NEGATIVE_CONTROLS if c[0] == topology)
    depth = max(_depths(TOPOLOGIES[topology]))
    key, cfg = jax.random.key(0), SamplingConfig(**TARGET)
    counts = {case: np.zeros(VOCAB ** (depth + 1)) for case in cases}
    for chunk in range(NUM_CHUNKS):
        codes = rollouts(
            key, jnp.int32(chunk * CHUNK), TARGET_TABLE, DRAFT_TABLE, cfg, cases=cases, batch=CHUNK
        )
        for case in cases:
            counts[case] += np.bincount(np.asarray(codes[case]), minlength=VOCAB ** (depth + 1))
    return counts, exact_joint_law(TARGET, depth)


@pytest.mark.slow
@pytest.mark.parametrize("case", LOSSLESS_CASES, ids="-".join)
def test_verified_sequences_follow_target_joint_law(case):
    counts, law = topology_counts(case[0])
    assert counts[case].sum() == CHUNK * NUM_CHUNKS
    p_value, statistic, outside = law_test(counts[case], law)
    assert outside == 0, f"{outside} sequences outside the target's support"
    assert p_value > ALPHA, f"chi-square {statistic:.1f}, p-value {p_value:.3g} <= {ALPHA:.1e}"


@pytest.mark.slow
@pytest.mark.parametrize("case", NEGATIVE_CONTROLS, ids="-".join)
def test_known_breaches_are_rejected(case):
    counts, law = topology_counts(case[0])
    p_value, statistic, _ = law_test(counts[case], law)
    assert p_value <= ALPHA, f"breach {case} passed: chi-square {statistic:.1f}, p {p_value:.3g}"


def test_replay_rollout_is_the_plain_rollout():
    """Not only the same law: with the same key, verify + the next rounds' `sample` calls emit
    the very tokens that plain sampling emits, row for row."""
    cfg, key, batch = SamplingConfig(**TARGET), jax.random.key(3), 4096
    case = ("tree", "sampled", "replay")
    speculative = rollouts(
        key,
        jnp.int32(0),
        TARGET_TABLE,
        DRAFT_TABLE,
        cfg,
        cases=(case,),
        batch=batch,
        complete_with_sample=True,
    )[case]

    @jax.jit
    def plain(rows, target_table):
        positions, code = 11 + rows % 7, jnp.zeros_like(rows)
        for d in range(MAX_DEPTH + 1):
            token, _ = sample(key, target_table[OFFSETS[d] + code], cfg, positions + d, rows)
            code = code * VOCAB + token
        return code

    rows = jnp.arange(batch, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(speculative), np.asarray(plain(rows, TARGET_TABLE)))
