"""Tree layout: constructors, ancestor masks and positions against a plain-Python walk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import Tree
from jaxspec.testing.tree_attention import ancestor_mask as walk_ancestors

PARENTS = np.array(
    [
        [-1, -1, 0, 0, 1, 2, 2, -1],  # a bushy tree, depth 3
        [-1, 0, 1, 2, 3, 4, 5, 6],  # a chain, depth 8
    ],
    np.int32,
)


def walk_depths(parents):
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def test_from_parents_depths_masks_and_positions():
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    tree = jax.jit(Tree.from_parents, static_argnums=2)(tokens, PARENTS, 8)
    assert tree.max_depth == 8
    np.testing.assert_array_equal(tree.depths, [walk_depths(p) for p in PARENTS])

    nodes_only = np.asarray(tree.attention_mask(include_root=False))
    fed = np.asarray(tree.attention_mask())
    assert fed.shape == (2, 9, 9)
    for b in range(2):
        expected = walk_ancestors(PARENTS[b])
        np.testing.assert_array_equal(nodes_only[b], expected)
        np.testing.assert_array_equal(fed[b, 1:, 1:], expected)
        assert fed[b, :, 0].all() and not fed[b, 0, 1:].any()

    positions = np.asarray(tree.positions(jnp.array([10, 20])))
    np.testing.assert_array_equal(positions[:, 0], [10, 20])
    np.testing.assert_array_equal(positions[:, 1:], np.array([10, 20])[:, None] + tree.depths)


def test_chain_layout():
    tree = Tree.chain(jnp.array([[5, 6, 7]]))
    assert tree.max_depth == 3
    np.testing.assert_array_equal(tree.parents, [[-1, 0, 1]])
    np.testing.assert_array_equal(tree.depths, [[1, 2, 3]])
    np.testing.assert_array_equal(tree.attention_mask()[0], np.tril(np.ones((4, 4), bool)))
    empty = Tree.chain(jnp.zeros((2, 0), jnp.int32))  # plain decoding: nothing drafted
    assert empty.max_depth == 0 and empty.attention_mask().shape == (2, 1, 1)
    np.testing.assert_array_equal(empty.positions(jnp.array([4, 9])), [[4], [9]])


def test_tree_is_a_pytree_with_static_max_depth():
    tree = Tree.chain(jnp.ones((2, 3), jnp.int32))
    assert len(jax.tree.leaves(tree)) == 3
    doubled = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))(tree)
    assert isinstance(doubled, Tree) and doubled.max_depth == 3
    np.testing.assert_array_equal(doubled.depths, [[2, 4, 6]] * 2)


def test_bad_shapes_raise_clearly():
    with pytest.raises(ValueError, match="one shape"):
        Tree(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="max_depth"):
        Tree(
            jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1, 2), jnp.int32),
            max_depth=-1,
        )
