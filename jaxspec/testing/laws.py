"""Independent float64 NumPy definitions of sampling laws, and the chi-square law test.

The statistical tests in tests/decoding compare the engine's draws against these. Needs
scipy (the `test` extra).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

# Every chi-square test in tests/decoding: test_joint_law's 6 lossless cases and
# test_sampling's one-position law. Each runs at ALPHA, so the suite fails by chance with
# probability at most 1e-4 (Bonferroni).
NUM_LAW_TESTS = 7
ALPHA = 1e-4 / NUM_LAW_TESTS


def processed_probs(logits, temperature: float, top_k: int, top_p: float):
    """The processed distribution from its definition, token by token, in float64.

    Token i survives top-k iff fewer than k tokens beat it strictly, and top-p iff the tokens
    that beat it strictly carry less than top_p of the top-k-renormalised mass.
    """
    x = np.asarray(logits, np.float64)
    out = np.zeros_like(x)
    for index in np.ndindex(x.shape[:-1]):
        row = x[index]
        if temperature == 0:
            out[index][np.argmax(row)] = 1.0
            continue
        z = (row - row.max()) / temperature
        keep = np.isfinite(z)
        if top_k > 0:
            keep &= _beaten_by(z, np.ones_like(z)) < top_k
        w = np.where(keep, np.exp(z), 0.0)
        w /= w.sum()
        if top_p < 1.0:
            keep &= _beaten_by(z, w) < top_p
        w = np.where(keep, w, 0.0)
        out[index] = w / w.sum()
    return out


def _beaten_by(z, weights):
    """For each i, the total weight of the tokens j with z_j > z_i."""
    order = np.argsort(z, kind="stable")
    above_or_at = np.concatenate([np.cumsum(weights[order][::-1])[::-1], [0.0]])
    return above_or_at[np.searchsorted(z[order], z, side="right")]


def top_p_margin(logits, temperature: float, top_k: int, top_p: float) -> float:
    """How far top_p is from every cumulative-mass boundary (a near tie would make float32
    and float64 disagree on the kept set)."""
    x = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1])
    margin = np.inf
    for row in x:
        z = (row - row.max()) / temperature
        keep = np.array([(z > zi).sum() < top_k for zi in z]) if top_k > 0 else np.ones(z.shape, bool)
        w = np.where(keep, np.exp(z), 0.0)
        w = np.sort(w / w.sum())[::-1]
        margin = min(margin, np.min(np.abs(np.cumsum(w) - top_p)))
    return margin


def law_test(counts, probs, *, min_expected: float = 5.0):
    """Chi-square goodness of fit of observed counts to exact cell probabilities.

    A count in a cell of probability zero is an outright failure (p-value 0). Cells whose
    expected count is below min_expected are pooled into one. Returns (p-value, statistic,
    number of counts outside the support).
    """
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    total = counts.sum()
    outside = counts[probs <= 0].sum()
    if outside > 0:
        return 0.0, np.inf, int(outside)
    support = probs > 0
    expected = probs[support] * total / probs[support].sum()
    observed = counts[support]
    small = expected < min_expected
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    statistic, p_value = stats.chisquare(observed, expected)
    return float(p_value), float(statistic), 0


def continuation_law(policy, prompt, vocab: int, depth: int, temperature: float = 1.0):
    """[vocab ** depth] float64 P(y_0 .. y_{depth-1} | prompt) at `temperature` (no top-k /
    top-p), from the policy's full forwards over every continuation of depth - 1 tokens: the
    law the first `depth` generated tokens must follow, cell (y_0, ..., y_{depth-1}) in
    row-major order (`continuation_counts`' order)."""
    seqs = np.array([list(prompt) + list(np.unravel_index(i, (vocab,) * (depth - 1)))
                     for i in range(vocab ** (depth - 1))], np.int32)
    logits, _, _ = policy.forward(seqs, np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape))
    logits = np.asarray(logits, np.float64)
    law = np.ones((1,))
    p = len(prompt)
    for d in range(depth):
        stride = vocab ** (depth - 1 - d)  # rows sharing the first d tokens
        probs = processed_probs(logits[::stride, p - 1 + d], temperature, 0, 1.0)  # [vocab^d, vocab]
        law = (law[:, None] * probs).reshape(-1)
    return law


def continuation_counts(tokens, vocab: int, depth: int):
    """[vocab ** depth] how often each sequence of the first `depth` generated tokens
    (tokens [N, >= depth]) occurs, in `continuation_law`'s order."""
    y = np.asarray(tokens)[:, :depth].astype(np.int64)
    return np.bincount(np.ravel_multi_index(tuple(y.T), (vocab,) * depth), minlength=vocab ** depth)
