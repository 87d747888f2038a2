"""Group-aware drafting: suffix matches in the other rollouts of the same prompt.

GRPO samples each prompt G times per step and sees the same prompts again in later epochs,
and the rollouts of one prompt share long stretches. `HistoryDrafter` drafts, for each row,
the continuations that followed the row's current suffix (the longest n = max_n..min_n that
occurs) in two sources:

- the rollouts of its group in this `generate` call (its siblings, itself included): a
  sibling in a row of the batch is read from the engine's token buffer, which the jitted
  loop updates after every verify step, so its freshly committed tokens are visible at the
  next proposal; with continuous batching a sibling that finished and left its row is read
  from the call's outputs (`DraftContext.finished`), and one not started yet is empty. The
  trainer starts one sample of every prompt first (`jaxspec.rl.rollouts.leaders_first`), so
  the later samples have a sibling ahead of them to draft from;
- the finished rollouts of the same prompt from earlier steps: `HistoryStore`, a ring of
  `per_prompt` sequences for each of `prompts` prompt slots, updated by the trainer after
  each step (host side) and saved with the run's checkpoint.

The "index" is brute force on device, bounded by fixed shapes: each proposal compares the
row's suffix with every position of its G + per_prompt candidate sequences (rows x (G + R)
x width x max_n comparisons), keeps the first `max_matches` matches (candidate order, then
position), and merges their k-token continuations into a trie whose node score is the
fraction of matches through it (a count). The best `budget` nodes form the draft tree.

`HybridDrafter` puts the history trie and an EAGLE-3 (or block) chain into one tree: a head node's
score is the chain's probability under the head (exp of the cumulative log-prob), a history
node's the fraction of matches through it, both estimates of the chance the path is the
continuation, so one top-`budget` selection serves both (a path both propose is one node).
With no history match the tree is the head's chain. Any draft is lossless under replay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.block import BlockDrafter
from jaxspec.decoding.drafters import Eagle3Drafter, ModelFreeDrafter
from jaxspec.decoding.draws import pick_draft
from jaxspec.decoding.history_index import (
    NEG,
    HistoryStore,
    best_path,
    lookup,
    prompt_key,
    select,
    sibling_table,
    trie,
)
from jaxspec.decoding.protocols import DraftContext, Observation, StateAxes
from jaxspec.decoding.tree import Tree
from jaxspec.errors import FieldError

__all__ = ["HistoryDrafter", "HistoryStore", "HybridDrafter", "prompt_key", "sibling_table"]

HISTORY, HEAD = 1, 2  # a hybrid tree node's source bits


def _check_int(owner: str, name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise FieldError(owner, name, value, f"must be an int >= {low}", f"an int >= {low}",
                         message=f"{owner}.{name} must be an int >= {low}; got {value!r}")


# --------------------------------------------------------------------------- drafters


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryDrafter(ModelFreeDrafter):
    """Drafts from the row's group (in flight) and its prompt's stored rollouts; model-free.

    Build one per batch with `HistoryDrafter.for_batch`. A row's tree holds the `budget`
    trie nodes with the most matches (depth <= k); with no match it is empty (all absent).
    With `chain=True` it is one chain k deep instead, the trie's best path (for a hybrid
    policy, which verifies chains only); where the path ends early the rest repeats the root.
    """

    store: HistoryStore
    # [N, G] int32 for each of generate's N prompts, the prompts of its group (itself
    # included), -1 pad
    siblings: jax.Array
    slots: jax.Array  # [N] int32 the store slot of each prompt, -1: none
    k: int = dataclasses.field(default=4, metadata=dict(static=True))  # draft depth
    budget: int = dataclasses.field(default=4, metadata=dict(static=True))  # tree nodes
    min_n: int = dataclasses.field(default=1, metadata=dict(static=True))
    max_n: int = dataclasses.field(default=4, metadata=dict(static=True))
    max_matches: int = dataclasses.field(default=8, metadata=dict(static=True))
    # True: one chain, the trie's best path k deep (`history_index.best_path`), what a hybrid
    # (Gated DeltaNet) policy verifies; budget is then unused
    chain: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        name = type(self).__name__
        if not isinstance(self.chain, bool):
            raise FieldError(name, "chain", self.chain, "must be a bool", "true or false",
                             message=f"{name}.chain must be a bool; got {self.chain!r}")
        for field, low in (("k", 1), ("budget", 1), ("min_n", 1), ("max_matches", 1)):
            _check_int(name, field, getattr(self, field), low)
        _check_int(name, "max_n", self.max_n, self.min_n)
        if self.budget < self.k and not self.chain:
            raise FieldError(name, "budget", self.budget,
                             f"must be >= k={self.k} (a chain of k drafts must fit)",
                             f">= {self.k}", message=f"{name}.budget={self.budget} must be >= "
                             f"k={self.k} (a chain of k drafts must fit)")

    @classmethod
    def for_batch(cls, groups, *, store: HistoryStore | None = None, prompt_keys=None,
                  **settings) -> HistoryDrafter:
        """groups: [N] int group id of each of generate's prompts (the G samples of one
        prompt share one); prompt_keys: [N] int `prompt_key` of each (None: no stored
        history). The drafter serves a `generate` call on these N prompts, in any number of
        slots (continuous batching: a member that finished is read from the call's outputs)."""
        groups = np.asarray(groups)
        if groups.ndim != 1 or groups.size == 0:
            raise ValueError(f"groups must be a non-empty [batch] array of group ids; got "
                             f"shape {groups.shape}")
        store = HistoryStore.empty(1, 1, 1) if store is None else store
        if prompt_keys is None:
            slots = np.full(groups.shape, -1, np.int32)
        else:
            if np.shape(prompt_keys) != groups.shape:
                raise ValueError(f"prompt_keys must have one entry per row ({groups.shape}); "
                                 f"got shape {np.shape(prompt_keys)}")
            slots = store.slots_of(prompt_keys)
        return cls(store=store, siblings=jnp.asarray(sibling_table(groups)),
                   slots=jnp.asarray(slots), **settings)

    num_nodes = property(lambda self: self.k if self.chain else self.budget)
    max_depth = property(lambda self: self.k)
    drafts_chains = property(lambda self: self.chain)
    supports_rejection = False

    def with_k(self, k: int) -> HistoryDrafter:
        """The same drafter drafting k deep (adaptive draft length; budget kept, >= k)."""
        _check_int(type(self).__name__, "k", k, 1)
        return dataclasses.replace(self, k=k, budget=max(self.budget, k))

    def check_prompts(self, n: int) -> None:
        if n != self.siblings.shape[0]:
            raise ValueError(f"{type(self).__name__} was built for {self.siblings.shape[0]} "
                             f"prompts; generate got {n} (build it with for_batch on these "
                             f"prompts)")

    def check_compatible(self, policy) -> None:
        vocab = policy.config.vocab_size
        top = int(np.max(np.asarray(self.store.tokens)))
        if top >= vocab:
            raise ValueError(f"the history store holds token id {top}; the policy's vocabulary "
                             f"has {vocab} ids (store rollouts of this policy's tokenizer)")

    def init_state(self, policy, batch, max_len):
        return None

    def pool(self, ctx: DraftContext):
        """The trie of the row's matches (see `trie`) and the matched suffix length [B]."""
        conts, valid, n = lookup(self, ctx)
        return trie(conts, valid), n

    def propose(self, state, policy, ctx: DraftContext):
        (tokens, parents, depths, scores, present), _ = self.pool(ctx)
        if self.chain:
            path = best_path(tokens, parents, depths, scores, present, self.k, ctx.root)
            return Tree.chain(path), None, state
        return select(tokens, parents, depths, scores, present, self.budget, self.k), None, state


def _head_chain(head_drafter, state, policy, ctx: DraftContext):
    """The head's chain and its cumulative log-probs under the head: ([B, k] int32, [B, k]
    float32). Each draft is picked as `Eagle3Drafter` picks a chain's (`draws.pick_draft`):
    coupled under replay, the Gumbel-max draw with the verifier's noise; else the argmax.
    A `BlockDrafter` scores its one-forward chain itself."""
    if isinstance(head_drafter, BlockDrafter):
        return head_drafter.scored_chain(state, policy, ctx)
    head, cache, hidden = head_drafter.head, state.cache, state.last_hidden
    pos = ctx.lengths - 1
    tokens, logps, total = [], [], 0.0
    for i in range(head_drafter.k):
        if i > 0:
            out, cache = head.forward(policy.embed(tokens[-1][:, None]), hidden[:, None],
                                      (pos + i - 1)[:, None], cache, fuse=False)
            hidden = out[:, 0].astype(jnp.float32)
        logits, ids = head.draft_logits(hidden, policy)  # [B, C], [C] | None
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        best = pick_draft(logits, ctx, i, ids, coupled=head_drafter.coupled)  # [B] candidate
        total = total + jnp.take_along_axis(logp, best[:, None], axis=1)[:, 0]
        tokens.append((best if ids is None else ids[best]).astype(jnp.int32))
        logps.append(total)
    return jnp.stack(tokens, 1), jnp.stack(logps, 1)


def _ring_write(ring: Observation, obs: Observation) -> Observation:
    """`obs`'s entries written into `ring` ([B, W]) at slot position % W: the ring keeps each
    row's last W positions (an entry more than W before the row's newest is dropped)."""
    w = ring.positions.shape[1]
    pos = obs.positions
    newest = jnp.max(pos, axis=1, keepdims=True)
    keep = (pos >= 0) & (pos > newest - w)
    slot = jnp.where(keep, pos % w, w)  # w: out of range, dropped
    rows = jnp.arange(pos.shape[0])[:, None]
    return jax.tree.map(lambda r, x: r.at[rows, slot].set(x.astype(r.dtype), mode="drop"), ring, obs)


def merge_chain(pool, chain_tokens, chain_scores, chain_present=None):
    """A history pool (from `trie`) with a chain appended: a chain node whose path is
    already a present pool node becomes that node (score: the larger of the two).
    chain_tokens, chain_scores: [B, c]; chain_present: [] or [B] bool, False: no chain (its
    nodes absent, the pool unchanged; None: True). -> (the merged pool, same layout,
    size + c; each node's source [B, size + c] int32: HISTORY, HEAD or HISTORY | HEAD)."""
    tokens, parents, depths, scores, present = pool
    batch, size = tokens.shape
    c = chain_tokens.shape[1]
    on = jnp.broadcast_to(True if chain_present is None else chain_present, (batch,))
    chain_tokens = jnp.where(on[:, None], chain_tokens, -2)  # -2 matches no pool node
    b = jnp.arange(batch)[:, None]
    # path_eq[b, p]: pool node p's path equals the chain's first depth(p) tokens
    path_eq = jnp.zeros((batch, size), bool)
    new_tok, new_par, new_dep, new_score, new_present = [], [], [], [], []
    source = jnp.full((batch, size), HISTORY, jnp.int32)
    prev = jnp.full((batch,), -1, jnp.int32)  # pool index of the chain's previous node
    for j in range(c):
        parent_ok = jnp.where(parents >= 0, path_eq[b, jnp.maximum(parents, 0)], True)
        at_j = present & (depths == j + 1) & (tokens == chain_tokens[:, j, None]) & parent_ok
        path_eq = path_eq | at_j
        dup = jnp.any(at_j, axis=1)
        twin = jnp.argmax(at_j, axis=1).astype(jnp.int32)
        scores = scores.at[jnp.arange(batch), twin].max(jnp.where(dup, chain_scores[:, j], NEG))
        source = source.at[jnp.arange(batch), twin].set(
            jnp.where(dup, HISTORY | HEAD, source[jnp.arange(batch), twin]))
        new_tok.append(chain_tokens[:, j])
        new_par.append(prev)
        new_dep.append(jnp.full((batch,), j + 1, jnp.int32))
        new_score.append(chain_scores[:, j])
        new_present.append(~dup & on)
        prev = jnp.where(dup, twin, size + j)
    st = lambda xs: jnp.stack(xs, 1)  # noqa: E731
    cat = lambda a, x: jnp.concatenate([a, st(x)], axis=1)  # noqa: E731
    pool = (cat(tokens, new_tok), cat(parents, new_par), cat(depths, new_dep),
            cat(scores, new_score), cat(present, new_present))
    return pool, jnp.concatenate([source, jnp.full((batch, c), HEAD, jnp.int32)], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridState:
    head: Any  # the chain drafter's state (EAGLE-3 or block)
    tokens: jax.Array  # [B, N] int32 the last proposed tree (-1: none yet / absent)
    parents: jax.Array  # [B, N] int32
    source: jax.Array  # [B, N] int32 source bits of each node (HISTORY, HEAD)
    accepted: jax.Array  # [3] int32 accepted drafts from history only, head only, both
    head_drafts: jax.Array  # [] int32 proposals where the head drafted (`HybridDrafter.gate`)
    # gate: committed entries [B, window] the head has not observed yet, a ring keyed by
    # position (None without the gate: the head observes every step)
    pending: Observation | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    """One tree from the history trie and an EAGLE-3 or block chain, `budget` nodes scored on one
    scale (see the module docstring); the head's state and forwards are the chain's.

    `gate` (default True): the head runs only in iterations where some live row's history
    pool has no path as deep as `history.k` (no full-depth match: a leader with no sibling
    ahead, a prompt not seen before, a suffix never seen). When every live row has one, the
    tree is the history's best `budget` nodes and the head does nothing: no draft, and no
    observation of the verified tokens either. Those wait in a ring of the last
    `ring_size` positions per row (`window`, default max(16, max_depth + 1)), and the head
    observes them in one forward just before its next draft (older ones it never sees: a
    draft after a long history stretch has less context; lossless anyway). A prompt no
    wider than the ring goes into it the same way (so its oldest entries, too, drop out
    when more than `ring_size` positions are committed before the head's next draft); a
    wider one the head observes at once, whole. False: the
    head observes and drafts at every iteration. (RolloutStats' draft_forwards counts the
    head's forwards as if it ran every iteration; `draft_stats` has the iterations it did
    run.)"""

    history: HistoryDrafter
    head: Eagle3Drafter | BlockDrafter  # a chain drafter (EAGLE-3: tree None)
    budget: int = dataclasses.field(default=6, metadata=dict(static=True))
    gate: bool = dataclasses.field(default=True, metadata=dict(static=True))
    # gate: the ring's positions per row (None: max(16, max_depth + 1); at least max_depth + 1,
    # what one verify commits)
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if not isinstance(self.history, HistoryDrafter):
            raise TypeError(f"HybridDrafter.history must be a HistoryDrafter; got "
                            f"{type(self.history).__name__}")
        if not (isinstance(self.head, BlockDrafter)
                or isinstance(self.head, Eagle3Drafter) and self.head.tree is None):
            raise TypeError("HybridDrafter.head must be an Eagle3Drafter drafting a chain "
                            "(tree=None) or a BlockDrafter")
        _check_int("HybridDrafter", "budget", self.budget, self.head.k)
        if not isinstance(self.gate, bool):
            raise ValueError(f"HybridDrafter.gate must be True or False; got {self.gate!r}")
        if self.window is not None:  # a verify commits up to max_depth + 1 entries
            _check_int("HybridDrafter", "window", self.window, self.max_depth + 1)

    num_nodes = property(lambda self: self.budget)
    max_depth = property(lambda self: max(self.history.k, self.head.k))
    ring_size = property(lambda self: self.window or max(16, self.max_depth + 1))
    capture_layers = property(lambda self: self.head.capture_layers)
    uses_verifier_noise = property(lambda self: self.head.uses_verifier_noise)  # the head's chain
    supports_rejection = False
    check_prompts = property(lambda self: self.history.check_prompts)
    forwards_per_propose = property(lambda self: self.head.forwards_per_propose)
    forwards_per_observe = property(lambda self: self.head.forwards_per_observe)

    def with_k(self, k: int) -> HybridDrafter:
        """The same drafter drafting at most k deep (adaptive draft length): the history's
        depth and the head's chain cut to k, the budget and the ring kept (one state shape
        for every k)."""
        _check_int(type(self).__name__, "k", k, 1)
        return dataclasses.replace(self, history=self.history.with_k(min(k, self.history.k)),
                                   head=self.head.with_k(min(k, self.head.k)),
                                   window=self.ring_size)

    def check_compatible(self, policy) -> None:
        self.history.check_compatible(policy)
        self.head.check_compatible(policy)

    def init_state(self, policy, batch, max_len):
        self.history.init_state(policy, batch, max_len)
        none = jnp.full((batch, self.budget), -1, jnp.int32)
        pending = None
        if self.gate:
            w, hidden = self.ring_size, policy.config.hidden_size
            zeros = jnp.zeros((batch, w), jnp.int32)
            pending = Observation(
                fed_tokens=zeros, next_tokens=zeros, positions=jnp.full((batch, w), -1, jnp.int32),
                captured={layer: jnp.zeros((batch, w, hidden), policy.config.param_dtype)
                          for layer in self.head.capture_layers})
        return HybridState(self.head.init_state(policy, batch, max_len), none, none,
                           jnp.zeros_like(none), jnp.zeros((3,), jnp.int32),
                           jnp.zeros((), jnp.int32), pending)

    def state_axes(self, policy) -> HybridState:
        row, shared = StateAxes(row=0), StateAxes()
        pending = None
        if self.gate:  # the ring: [B, ring_size] entries, whatever the cache capacity
            pending = Observation(fed_tokens=row, next_tokens=row, positions=row,
                                  captured={layer: row for layer in self.head.capture_layers})
        return HybridState(self.head.state_axes(policy), row, row, row, shared, shared, pending)

    def observe(self, state: HybridState, policy, obs: Observation):
        # Which proposed nodes the policy accepted: entries 1.. of the observation follow the
        # root along the accepted path (the prompt's observation matches no tree: tokens -1).
        current = jnp.full(obs.fed_tokens.shape[:1], -1, jnp.int32)
        accepted = state.accepted
        for j in range(1, min(obs.fed_tokens.shape[1], self.max_depth + 1)):
            child = (state.parents == current[:, None]) & (state.tokens >= 0) \
                & (state.tokens == obs.fed_tokens[:, j, None]) & (obs.positions[:, j, None] >= 0)
            hit = jnp.any(child, axis=1)
            node = jnp.argmax(child, axis=1).astype(jnp.int32)
            src = jnp.take_along_axis(state.source, node[:, None], axis=1)[:, 0]
            accepted = accepted + jnp.stack([jnp.sum(hit & (src == s)) for s in
                                             (HISTORY, HEAD, HISTORY | HEAD)]).astype(jnp.int32)
            current = jnp.where(hit, node, -2)
        if self.gate and obs.positions.shape[1] <= self.ring_size:
            # a verify's commits, or a prompt the ring holds whole: the head observes them
            # later, just before it drafts (no head forward per started rollout)
            return dataclasses.replace(state, accepted=accepted,
                                       pending=_ring_write(state.pending, obs))
        # wider than the ring: a long prompt, observed now and whole (its row is fresh, so
        # nothing is pending)
        head = self.head.observe(state.head, policy, obs)
        return dataclasses.replace(state, head=head, accepted=accepted)

    def _flush_and_draft(self, state: HybridState, policy, ctx: DraftContext):
        """The head observes its pending entries (in position order), then drafts its chain.
        -> (chain, log-probs, head state, the emptied ring)."""
        ring = state.pending.in_position_order(limit=state.head.cache.max_len)  # fits the cache
        head = self.head.observe(state.head, policy, ring)
        chain, logp = _head_chain(self.head, head, policy, ctx)
        return chain, logp, head, state.pending.cleared()

    def propose(self, state: HybridState, policy, ctx: DraftContext):
        pool, _ = self.history.pool(ctx)
        if self.gate:  # the head only where some live row's history has no full-depth path
            _, _, depths, _, present = pool
            covered = jnp.any(present & (depths == self.history.k), axis=1)
            live = jnp.ones_like(covered) if ctx.live is None else ctx.live
            use_head = jnp.any(live & ~covered)
            batch, k = covered.shape[0], self.head.k
            chain, logp, head, pending = jax.lax.cond(
                use_head, lambda: self._flush_and_draft(state, policy, ctx),
                lambda: (jnp.zeros((batch, k), jnp.int32), jnp.zeros((batch, k), jnp.float32),
                         state.head, state.pending))
            state = dataclasses.replace(state, head=head, pending=pending)
        else:
            use_head = jnp.asarray(True)
            chain, logp = _head_chain(self.head, state.head, policy, ctx)
        merged, source = merge_chain(pool, chain, jnp.exp(logp), chain_present=use_head)
        tree, source = select(*merged, self.budget, self.max_depth, extra=source)
        state = dataclasses.replace(state, tokens=tree.tokens, parents=tree.parents, source=source,
                                    head_drafts=state.head_drafts + use_head.astype(jnp.int32))
        return tree, None, state

    def draft_stats(self, state: HybridState) -> dict:
        """Accepted drafts by source ('accepted_history_only', 'accepted_head_only',
        'accepted_both') and the proposals where the head drafted ('head_drafted'; the others
        it skipped)."""
        a = state.accepted
        return {"accepted_history_only": a[0], "accepted_head_only": a[1], "accepted_both": a[2],
                "head_drafted": state.head_drafts}
