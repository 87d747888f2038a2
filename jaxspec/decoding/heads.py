"""Head drafters: a small network on the policy's hidden states (EAGLE-3, MTP) drafting a
chain, or a dynamic tree (`TreeSpec`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.draws import check_k, choose_draft, target_ids
from jaxspec.decoding.protocols import (
    DraftContext,
    DraftHead,
    Observation,
    StateAxes,
    kv_cache_axes,
)
from jaxspec.decoding.tree import Tree
from jaxspec.errors import FieldError
from jaxspec.kernels import CacheLayer, WithAncestors
from jaxspec.models import KVCache


def _is_invariant(head) -> bool:
    """Whether the head's layer runs the batch-invariant forward (its config's `layer`)."""
    layer = getattr(getattr(head, "config", None), "layer", None)
    return bool(getattr(layer, "batch_invariant", False))


# --------------------------------------------------------------------------- EAGLE-3


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Dynamic draft tree (EAGLE-2/3): expand the top_k children of each frontier node per
    depth, keep the global top_k by cumulative log-prob as the next frontier, then verify the
    best `budget` nodes of everything expanded (ancestors always score higher).

    The one tree schema of the project (the config's `draft.tree` section is this class).
    """

    top_k: int = 4  # children expanded per frontier node, and frontier width
    depth: int = 3  # draft depth (tokens past the root)
    budget: int = 8  # nodes verified per step

    def __post_init__(self):
        for name in ("top_k", "depth", "budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FieldError("TreeSpec", name, value, "must be an int >= 1", "an int >= 1",
                                 message=f"TreeSpec.{name} must be an int >= 1; got {value!r}")
        pool = self.max_nodes(self.top_k, self.depth)
        if not self.depth <= self.budget <= pool:
            raise FieldError(
                "TreeSpec", "budget", self.budget,
                f"not in [depth, nodes expanded] for top_k={self.top_k}, depth={self.depth}",
                f"[{self.depth}, {pool}]",
                message=f"TreeSpec.budget={self.budget} is invalid: it must be in [depth, nodes "
                        f"expanded] = [{self.depth}, {pool}] for top_k={self.top_k}, "
                        f"depth={self.depth}")

    @staticmethod
    def max_nodes(top_k: int, depth: int) -> int:
        """Nodes the expansion produces: top_k at depth 1, top_k * top_k at each later depth."""
        return top_k + (depth - 1) * top_k**2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    cache: KVCache  # the head's single layer
    last_hidden: jax.Array  # [batch, H] pre-norm head output at the last observed position


@dataclasses.dataclass(frozen=True)
class _HeadDrafter:
    """Drafting with a head conditioned on the policy's hidden states (EAGLE-3, MTP): a chain
    of k drafts (under replay drawn with the verifier's noise, `coupled`; else argmax, or
    sampled for rejection), or a dynamic tree (`TreeSpec`) of each node's top-k."""

    head: DraftHead
    k: int = dataclasses.field(default=3, metadata=dict(static=True))
    tree: TreeSpec | None = dataclasses.field(default=None, metadata=dict(static=True))
    # replay chains: draw each draft from q with the verifier's noise at its position, so it
    # equals the policy's token whenever q and p agree there (`draws.choose_draft`); False: argmax of q
    coupled: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def __post_init__(self):
        check_k(self.k)
        if not isinstance(self.head, DraftHead):
            raise TypeError(
                f"{type(self).__name__} needs a draft head (jaxspec.decoding.DraftHead: an "
                f"Eagle3Head or MTPHead); got {type(self.head).__name__}"
            )
        if self.tree is not None and not isinstance(self.tree, TreeSpec):
            raise TypeError(f"tree must be a TreeSpec or None; got {self.tree!r}")

    @property
    def num_nodes(self) -> int:
        return self.k if self.tree is None else self.tree.budget

    @property
    def max_depth(self) -> int:
        return self.k if self.tree is None else self.tree.depth

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.head.capture_layers

    @property
    def uses_verifier_noise(self) -> bool:  # coupled chains draw with DraftContext.verifier_noise
        return self.coupled and self.tree is None

    @property
    def supports_rejection(self) -> bool:
        return self.tree is None

    @property
    def drafts_chains(self) -> bool:
        return self.tree is None

    @property
    def forwards_per_propose(self) -> int:
        return self.k - 1 if self.tree is None else self.tree.depth - 1

    forwards_per_observe = 1

    def with_k(self, k: int):
        """The same head drafting k deep (adaptive draft length): a chain of k, or the tree
        cut to depth k (its budget capped at what that depth expands, at least k)."""
        check_k(k)
        if self.tree is None:
            return dataclasses.replace(self, k=k)
        spec = self.tree
        budget = max(k, min(spec.budget, TreeSpec.max_nodes(spec.top_k, k)))
        return dataclasses.replace(self, tree=TreeSpec(top_k=spec.top_k, depth=k, budget=budget))

    def check_compatible(self, policy) -> None:
        self.head.check_compatible(policy)
        vocab = self.head.draft_vocab_size
        if self.tree is not None and self.tree.top_k > vocab:
            raise ValueError(
                f"TreeSpec.top_k {self.tree.top_k} exceeds the head's draft vocabulary ({vocab} tokens)"
            )

    def init_state(self, policy, batch, max_len):
        hidden = self.head.hidden_size
        return HeadState(
            cache=self.head.init_cache(batch, max_len),
            last_hidden=jnp.zeros((batch, hidden), jnp.float32),
        )

    def state_axes(self, policy):
        return HeadState(cache=kv_cache_axes(), last_hidden=StateAxes(row=0))

    def observe(self, state, policy, obs: Observation):
        positions = obs.positions
        features = jnp.concatenate([obs.captured[i] for i in self.head.capture_layers], axis=-1)
        embeds = policy.embed(obs.next_tokens)
        hidden, cache = self.head.forward(embeds, features, positions, state.cache, fuse=True)
        # The last valid position of each row carries the state the next draft starts from.
        last = jnp.argmax(jnp.where(positions >= 0, positions, -1), axis=1)
        has_any = jnp.any(positions >= 0, axis=1)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        last_hidden = jnp.where(has_any[:, None], last_hidden.astype(jnp.float32), state.last_hidden)
        return HeadState(cache=cache, last_hidden=last_hidden)

    def propose(self, state, policy, ctx: DraftContext):
        if self.tree is None:
            return self._propose_chain(state, policy, ctx)
        return self._propose_tree(state, policy, ctx)

    def _propose_chain(self, state, policy, ctx):
        cache = state.cache
        start_lengths = cache.lengths
        hidden = state.last_hidden
        pos = ctx.lengths - 1  # a draft step pairs (hidden at t-1, token t) at position t-1
        tokens, probs = [], []
        for i in range(self.k):
            if i > 0:
                embeds = policy.embed(tokens[-1][:, None])
                out, cache = self.head.forward(
                    embeds, hidden[:, None], (pos + i - 1)[:, None], cache, fuse=False
                )
                hidden = out[:, 0].astype(jnp.float32)
            logits, ids = self.head.draft_logits(hidden, policy)  # [batch, C], [C] | None
            token, q = choose_draft(logits, ctx, i, ids, policy.config.vocab_size, coupled=self.coupled)
            tokens.append(token)
            probs.append(q)
        cache = dataclasses.replace(cache, lengths=start_lengths)
        draft_probs = jnp.stack(probs, axis=1) if ctx.sampled else None
        return Tree.chain(jnp.stack(tokens, axis=1)), draft_probs, HeadState(cache, state.last_hidden)

    def _propose_tree(self, state, policy, ctx):
        """Each depth feeds only the new frontier; it sees the head's cache and its ancestors'
        keys and values, carried from the depths that computed them (linear in depth). The
        batch-invariant mode, whose attention takes no carried keys, re-feeds instead."""
        return self._expand_tree(state, policy, ctx, refeed=_is_invariant(self.head))

    def _propose_tree_refeed(self, state, policy, ctx):
        """The same tree, feeding every frontier node so far at each depth (quadratic in
        depth): the invariant mode's path and the reference the carried path is tested on."""
        return self._expand_tree(state, policy, ctx, refeed=True)

    def _expand_tree(self, state, policy, ctx, *, refeed: bool):
        spec = self.tree
        kk = spec.top_k
        cache = state.cache
        batch = ctx.lengths.shape[0]
        pos = ctx.lengths - 1
        b_idx = jnp.arange(batch)[:, None]
        eye = jnp.broadcast_to(jnp.eye(kk, dtype=bool), (batch, kk, kk))

        logits, ids = self.head.draft_logits(state.last_hidden, policy)  # [batch, C], [C] | None
        score, idx = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), kk)  # [batch, kk]
        tok = target_ids(ids, idx)
        # The pool holds every expanded node; the frontier is the subset fed next.
        pool_tok, pool_score = [tok], [score]
        pool_parent = [jnp.full((batch, kk), -1, jnp.int32)]
        pool_depth = [jnp.ones((batch, kk), jnp.int32)]
        pool_size = kk
        fed_tok = tok  # frontier nodes fed so far, in feeding order
        fed_hidden_in = jnp.broadcast_to(state.last_hidden[:, None], (batch, kk, state.last_hidden.shape[-1]))
        fed_depth = jnp.ones((batch, kk), jnp.int32)
        fed_anc = eye  # [batch, fed, fed]: node j is node i or its ancestor
        fed_k = fed_v = None  # [batch, fed - kk, kv_heads, head_dim]: keys of earlier depths
        front_pool = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32), (batch, kk))
        front_score = score

        for _ in range(1, spec.depth):
            num_fed = fed_tok.shape[1]
            if refeed:
                out, _ = self.head.forward(
                    policy.embed(fed_tok), fed_hidden_in, pos[:, None] + fed_depth - 1, cache,
                    mask=fed_anc, fuse=False,
                )
            else:
                # the stacked cache, unsliced (a slice fed to the block loop is a whole copy)
                k_cache, v_cache = CacheLayer(cache.k, jnp.int32(0)), CacheLayer(cache.v, jnp.int32(0))
                if fed_k is not None:  # the frontier also sees its ancestors among them
                    seen = fed_anc[:, -kk:, : num_fed - kk]  # [batch, kk, fed - kk]
                    k_cache, v_cache = WithAncestors(k_cache, fed_k, seen), WithAncestors(v_cache, fed_v, seen)
                out, k, v = self.head.layer_step(
                    policy.embed(fed_tok[:, -kk:]), fed_hidden_in[:, -kk:],
                    pos[:, None] + fed_depth[:, -kk:] - 1, k_cache, v_cache,
                    jnp.minimum(cache.lengths, cache.max_len), mask=eye, fuse=False,
                )
                fed_k = k if fed_k is None else jnp.concatenate([fed_k, k], axis=1)
                fed_v = v if fed_v is None else jnp.concatenate([fed_v, v], axis=1)
            front_out = out[:, -kk:].astype(jnp.float32)  # [batch, kk, H]
            child_logits, _ = self.head.draft_logits(front_out, policy)
            c_score, c_idx = jax.lax.top_k(jax.nn.log_softmax(child_logits, axis=-1), kk)  # [batch, kk, kk]
            c_tok = target_ids(ids, c_idx)
            c_score = front_score[..., None] + c_score
            c_parent_pool = jnp.broadcast_to(front_pool[..., None], c_tok.shape)
            depth = pool_depth[-1][:, :1] + 1
            pool_tok.append(c_tok.reshape(batch, -1))
            pool_score.append(c_score.reshape(batch, -1))
            pool_parent.append(c_parent_pool.reshape(batch, -1))
            pool_depth.append(jnp.broadcast_to(depth, (batch, kk * kk)))
            # Next frontier: the global top kk children.
            best_score, best = jax.lax.top_k(c_score.reshape(batch, -1), kk)
            parent_front = best // kk  # index into the current frontier
            new_tok = c_tok.reshape(batch, -1)[b_idx, best]
            new_hidden_in = front_out[b_idx, parent_front]
            parent_fed = num_fed - kk + parent_front  # index among fed nodes
            anc_rows = fed_anc[b_idx, parent_fed]  # [batch, kk, num_fed]
            fed_anc = jnp.concatenate(
                [
                    jnp.concatenate([fed_anc, jnp.zeros((batch, num_fed, kk), bool)], axis=2),
                    jnp.concatenate([anc_rows, eye], axis=2),
                ],
                axis=1,
            )
            fed_tok = jnp.concatenate([fed_tok, new_tok], axis=1)
            fed_hidden_in = jnp.concatenate([fed_hidden_in, new_hidden_in], axis=1)
            fed_depth = jnp.concatenate([fed_depth, jnp.broadcast_to(depth, (batch, kk))], axis=1)
            front_pool = pool_size + best
            front_score = best_score
            pool_size += kk * kk

        all_tok = jnp.concatenate(pool_tok, axis=1)
        all_score = jnp.concatenate(pool_score, axis=1)
        all_parent = jnp.concatenate(pool_parent, axis=1)
        all_depth = jnp.concatenate(pool_depth, axis=1)
        # Best `budget` nodes; a small depth penalty breaks ties in favour of ancestors.
        rank = jnp.where(jnp.isfinite(all_score), all_score, -1e30) - 1e-6 * all_depth
        _, keep = jax.lax.top_k(rank, spec.budget)
        keep = jnp.sort(keep, axis=1)  # pool order is depth-major: parents come first
        slot_of = jnp.full((batch, all_tok.shape[1]), -1, jnp.int32).at[b_idx, keep].set(
            jnp.arange(spec.budget, dtype=jnp.int32)[None, :]
        )
        kept_parent_pool = all_parent[b_idx, keep]
        parents = jnp.where(kept_parent_pool >= 0, slot_of[b_idx, jnp.maximum(kept_parent_pool, 0)], -1)
        tree = Tree(
            tokens=all_tok[b_idx, keep],
            parents=parents,
            depths=all_depth[b_idx, keep],
            max_depth=spec.depth,
        )
        return tree, None, state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(_HeadDrafter):
    """EAGLE-3: a `jaxspec.models.Eagle3Head` fusing three policy layers."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPDrafter(_HeadDrafter):
    """DeepSeek-V3-style MTP: a `jaxspec.models.mtp.MTPHead` on the policy's last layer."""
