"""The toy prefix-dependent target of the joint-law tests, and its exact joint law.

The target and the draft are tables of logits indexed by the prefix emitted so far: row
`OFFSETS[d] + code` holds the logits at depth d after the prefix whose base-VOCAB code is
`code`, for prefixes of up to MAX_DEPTH tokens over a vocabulary of VOCAB. Used by
tests/decoding/test_joint_law.py and test_history.py.
"""

from __future__ import annotations

import numpy as np

from jaxspec.decoding.verify import _rejection_step
from jaxspec.testing.laws import processed_probs

VOCAB = 4
MAX_DEPTH = 3
OFFSETS = np.cumsum([0] + [VOCAB**d for d in range(MAX_DEPTH + 1)])  # table row of (depth, prefix)

TARGET = dict(temperature=1.0, top_k=3, top_p=0.9)  # both filters bite: 72 of 256 sequences
DRAFT = dict(temperature=0.6, top_k=3, top_p=1.0)


def _tables():
    rng = np.random.default_rng(1)
    target = rng.normal(size=(OFFSETS[-1], VOCAB))
    draft = target + rng.normal(size=target.shape)
    return target.astype(np.float32), draft.astype(np.float32)


TARGET_TABLE, DRAFT_TABLE = _tables()  # [OFFSETS[-1], VOCAB] float32 logits each


def exact_joint_law(cfg: dict, depth: int):
    """P(y_0..y_depth) for every sequence, as a flat array indexed by the base-VOCAB code.

    Args:
        cfg: the target's sampling settings (temperature, top_k, top_p).
        depth: the last position of the sequence (depth + 1 tokens).

    Returns:
        [VOCAB ** (depth + 1)] float64 probabilities, from the float64 definition of the
        processed law at each prefix (`laws.processed_probs`).
    """
    probs = processed_probs(TARGET_TABLE, **cfg)
    law = np.ones(1)
    for d in range(depth + 1):
        rows = probs[OFFSETS[d] : OFFSETS[d] + VOCAB**d]  # [V^d, V] in prefix-code order
        law = (law[:, None] * rows).reshape(-1)
    return law


def faulty_resample_from_p(p, q, x):
    """A rejection step with a published bug, for negative controls: after a rejection it
    samples p instead of the residual max(p - q, 0).

    Args:
        p: [B, V] target probabilities.
        q: [B, V] draft probabilities.
        x: [B] drafted tokens.

    Returns:
        (accept probability [B], distribution to sample after a rejection [B, V]).
    """
    accept_prob, _ = _rejection_step(p, q, x)
    return accept_prob, p
