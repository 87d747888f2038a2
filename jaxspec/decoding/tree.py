"""Static-shape draft trees: node tokens, parent indices, depths, and the masks they imply.

The root of a tree is the last committed token (not stored here; its KV is not cached yet).
The verify forward feeds the block [root, node_0, ..., node_{N-1}]: fed index 0 is the root,
fed index i+1 is node i. A chain of k drafts is the tree whose node i has parent i-1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """A batch of draft trees in topological order (a node's parent comes before it).

    A node whose token lies outside [0, V) is absent: no rule accepts it (or its subtree), so
    -1 pads a row that drafted fewer than N nodes. `max_depth` (static) bounds every depth and
    fixes the length D+1 of a verdict.
    """

    tokens: jax.Array  # [B, N] int32 drafted tokens
    parents: jax.Array  # [B, N] int32: -1 = the root, else a node index j < i
    depths: jax.Array  # [B, N] int32: 1 + the parent's depth (the root has depth 0)
    max_depth: int = dataclasses.field(default=None, metadata=dict(static=True))
    # node i extends node i - 1 in every row (`chain`): an accepted path is a prefix of the
    # fed block, already contiguous in the cache
    is_chain: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        fields = ("tokens", "parents", "depths")
        for name in fields:
            value = getattr(self, name)
            if isinstance(value, (list, tuple, np.ndarray)):
                object.__setattr__(self, name, jnp.asarray(value, jnp.int32))
            elif isinstance(value, jax.Array) and value.dtype != jnp.int32:
                object.__setattr__(self, name, value.astype(jnp.int32))
        shapes = [getattr(getattr(self, name), "shape", None) for name in fields]
        if all(shape is not None for shape in shapes):
            if len(shapes[0]) != 2 or len(set(shapes)) != 1:
                raise ValueError(
                    f"Tree tokens, parents and depths must share one shape [batch, nodes]; got {shapes}"
                )
            if self.max_depth is None:
                object.__setattr__(self, "max_depth", shapes[0][1])
        if self.max_depth is not None and (not isinstance(self.max_depth, int) or self.max_depth < 0):
            raise ValueError(f"Tree.max_depth must be a python int >= 0, got {self.max_depth!r}")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def chain(cls, tokens) -> Tree:  # tokens: [B, k] int32, drafted left to right
        """The chain tree: node i extends node i-1; depth i+1; max_depth k."""
        tokens = jnp.asarray(tokens, jnp.int32)
        batch, k = tokens.shape
        parents = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32) - 1, (batch, k))
        depths = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), (batch, k))
        return cls(tokens, parents, depths, max_depth=k, is_chain=True)

    @classmethod
    def from_parents(
        cls,
        tokens,  # [B, N] int32
        parents,  # [B, N] int32, topological (-1 = root)
        max_depth: int | None = None,
    ) -> Tree:
        """A tree whose depths are computed from its parents; max_depth defaults to N."""
        tokens = jnp.asarray(tokens, jnp.int32)
        parents = jnp.asarray(parents, jnp.int32)

        def set_depth(i, depths):
            parent = parents[:, i]
            parent_depth = jnp.take_along_axis(depths, jnp.maximum(parent, 0)[:, None], axis=1)[:, 0]
            return depths.at[:, i].set(jnp.where(parent < 0, 1, parent_depth + 1))

        depths = jax.lax.fori_loop(0, tokens.shape[1], set_depth, jnp.zeros_like(parents))
        return cls(tokens, parents, depths, max_depth=max_depth)

    def attention_mask(self, include_root: bool = True):
        """bool [B, N+1, N+1] (fed-block order) or [B, N, N] among the nodes alone.

        Entry [b, i, j] is true iff j is i or an ancestor of i; the root is everyone's ancestor.
        """
        batch, n = self.parents.shape
        node_ids = jnp.arange(n, dtype=jnp.int32)
        current = jnp.broadcast_to(node_ids, (batch, n))  # walks from each node up to the root
        mask = jnp.zeros((batch, n, n), bool)
        for _ in range(min(self.max_depth, n)):
            mask = mask | (current[:, :, None] == node_ids)
            step = jnp.take_along_axis(self.parents, jnp.maximum(current, 0), axis=1)
            current = jnp.where(current >= 0, step, -1)
        if not include_root:
            return mask
        root_column = jnp.ones((batch, n, 1), bool)
        root_row = jnp.zeros((batch, 1, n + 1), bool).at[:, 0, 0].set(True)
        return jnp.concatenate([root_row, jnp.concatenate([root_column, mask], axis=2)], axis=1)

    def positions(self, root_positions):  # root_positions: [B] int32 -> [B, N+1] int32
        """Absolute positions of the fed block: the root's position plus depth."""
        root_positions = jnp.asarray(root_positions, jnp.int32)
        fed_depths = jnp.pad(self.depths, ((0, 0), (1, 0)))
        return root_positions[:, None] + fed_depths
