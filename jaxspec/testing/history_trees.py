"""Brute-force references for the history drafter's trees (tests/decoding/test_history*.py)."""

from __future__ import annotations

import numpy as np


def reference_tree(matches, budget: int) -> set:
    """The `budget` trie paths with the most matches through them (ties: shallower first,
    then the earliest match).

    Args:
        matches: continuation token tuples, in match order.
        budget: how many paths (tree nodes) to keep.

    Returns:
        The kept paths, as a set of token tuples.
    """
    nodes = {}  # path -> (count, depth, first match index)
    for i, cont in enumerate(matches):
        for d in range(1, len(cont) + 1):
            path = cont[:d]
            count, _, first = nodes.get(path, (0, d, i))
            nodes[path] = (count + 1, d, first)
    total = max(len(matches), 1)
    ranked = sorted(nodes, key=lambda p: (-nodes[p][0] / total + 1e-6 * nodes[p][1],
                                          (nodes[p][1] - 1) * 1000 + nodes[p][2]))
    return set(ranked[:budget])


def tree_paths(tree, row: int) -> set:
    """The root-to-node token paths of one row of a drafted `Tree` (tokens < 0 are unused
    nodes), as a set of token tuples; asserts that parents come before children."""
    tokens, parents = np.asarray(tree.tokens[row]), np.asarray(tree.parents[row])
    paths = []
    for i, t in enumerate(tokens):
        if t < 0:
            paths.append(None)
            continue
        p = parents[i]
        assert p < i, "parents come before children"
        paths.append((paths[p] if p >= 0 else ()) + (int(t),))
    return {p for p in paths if p is not None}
