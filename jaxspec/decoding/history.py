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

`HybridDrafter` puts the history trie and an EAGLE-3 chain into one tree: a head node's
score is the chain's probability under the head (exp of the cumulative log-prob), a history
node's the fraction of matches through it, both estimates of the chance the path is the
continuation, so one top-`budget` selection serves both (a path both propose is one node).
With no history match the tree is the head's chain. Any draft is lossless under replay.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.drafters import Eagle3Drafter, _ModelFree, pick_draft
from jaxspec.decoding.protocols import DraftContext, Observation
from jaxspec.decoding.tree import Tree

__all__ = ["HistoryDrafter", "HistoryStore", "HybridDrafter", "prompt_key", "sibling_table"]

_NEG = -1e30
HISTORY, HEAD = 1, 2  # a hybrid tree node's source bits


def prompt_key(tokens) -> int:  # tokens: [P] int prompt ids (no padding)
    """A prompt's identity in the store: a 31-bit hash of its token ids (a collision only
    costs draft quality, never exactness)."""
    return zlib.crc32(np.asarray(tokens, np.int32).tobytes()) & 0x7FFFFFFF


def sibling_table(groups) -> np.ndarray:  # groups: [B] int -> [B, G] int32
    """Row indices of each row's group (the row itself included), -1 padded to the largest
    group: what `HistoryDrafter.siblings` holds."""
    groups = np.asarray(groups)
    members = {g: np.flatnonzero(groups == g) for g in np.unique(groups)}
    width = max(len(m) for m in members.values())
    out = np.full((len(groups), width), -1, np.int32)
    for i, g in enumerate(groups):
        out[i, : len(members[g])] = members[g]
    return out


# --------------------------------------------------------------------------- the store


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryStore:
    """Finished rollouts (prompt + completion) per prompt: fixed shapes, bounded memory
    (prompts x per_prompt x width int32). A prompt gets a slot on first sight; when every
    slot is taken, the least recently written one is reused."""

    tokens: jax.Array  # [P, R, W] int32 sequences, right-padded
    lengths: jax.Array  # [P, R] int32 (0: empty entry)
    owner: jax.Array  # [P] int32 prompt_key of the slot's prompt, -1: free
    next: jax.Array  # [P] int32 ring position of the slot's next write
    written: jax.Array  # [P] int32 the `clock` value of the slot's last write
    clock: jax.Array  # [] int32 number of `add` calls

    @classmethod
    def empty(cls, prompts: int, per_prompt: int, width: int) -> HistoryStore:
        for name, value in (("prompts", prompts), ("per_prompt", per_prompt), ("width", width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HistoryStore.{name} must be an int >= 1; got {value!r}")
        i32 = jnp.int32
        return cls(tokens=jnp.zeros((prompts, per_prompt, width), i32),
                   lengths=jnp.zeros((prompts, per_prompt), i32),
                   owner=jnp.full((prompts,), -1, i32), next=jnp.zeros((prompts,), i32),
                   written=jnp.zeros((prompts,), i32), clock=jnp.zeros((), i32))

    @property
    def width(self) -> int:
        return self.tokens.shape[2]

    def size(self) -> int:
        """Stored sequences (the index size)."""
        return int(np.sum(np.asarray(self.lengths) > 0))

    def stored_tokens(self) -> int:
        return int(np.sum(np.asarray(self.lengths)))

    def slots_of(self, keys) -> np.ndarray:  # keys: [B] int prompt keys -> [B] int32
        """The slot holding each prompt, -1 where none does."""
        owner = np.asarray(self.owner)
        keys = np.asarray(keys, np.int64)
        hit = owner[None, :] == keys[:, None]
        return np.where(hit.any(1), hit.argmax(1), -1).astype(np.int32)

    def add(
        self,
        keys,  # [B] int prompt_key of each row's prompt
        sequences,  # [B, T] int prompt + completion, right-padded
        lengths,  # [B] int valid tokens per row
    ) -> HistoryStore:
        """The store with each row's sequence appended to its prompt's ring (host side)."""
        tokens, lens = np.array(self.tokens), np.array(self.lengths)
        owner, nxt, written = np.array(self.owner), np.array(self.next), np.array(self.written)
        clock = int(self.clock) + 1
        sequences, lengths = np.asarray(sequences), np.asarray(lengths)
        keys = np.asarray(keys, np.int64)
        if sequences.ndim != 2 or len(sequences) != len(keys) or len(lengths) != len(keys):
            raise ValueError(f"HistoryStore.add: keys {keys.shape}, sequences {sequences.shape} "
                             f"and lengths {lengths.shape} must describe the same rows")
        width = tokens.shape[2]
        for key, seq, n in zip(keys, sequences, lengths):
            hit = np.flatnonzero(owner == key)
            if len(hit):
                slot = hit[0]
            else:  # a free slot, else the least recently written one
                free = np.flatnonzero(owner < 0)
                slot = free[0] if len(free) else int(np.argmin(written))
                owner[slot], nxt[slot] = key, 0
                lens[slot] = 0
            n = int(min(n, width, seq.shape[0]))
            r = nxt[slot]
            tokens[slot, r] = 0
            tokens[slot, r, :n] = seq[:n]
            lens[slot, r] = n
            nxt[slot] = (r + 1) % tokens.shape[1]
            written[slot] = clock
        return HistoryStore(jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(owner),
                            jnp.asarray(nxt), jnp.asarray(written), jnp.asarray(clock, jnp.int32))


# --------------------------------------------------------------------------- lookup


def _candidates(drafter: HistoryDrafter, ctx: DraftContext):
    """-> (tokens [B, C, W], lengths [B, C]): the row's group members (itself included) as
    far as they have gone, then its prompt's stored sequences, padded to one width.

    A member in a row of the batch is read from the engine's token buffer; one that has
    left its row (continuous batching: finished, its row refilled) from `ctx.finished`; one
    not started yet is empty."""
    buf, lengths = ctx.buffer, ctx.lengths
    batch = buf.shape[0]
    held = jnp.arange(batch, dtype=jnp.int32) if ctx.sequences is None else ctx.sequences
    members = drafter.siblings[held]  # [B, G] prompt indices of the row's group, -1 pad
    member = jnp.maximum(members, 0)
    row_of = jnp.full((drafter.siblings.shape[0],), -1, jnp.int32).at[held].set(
        jnp.arange(batch, dtype=jnp.int32))  # the row holding each prompt, -1: none
    row = jnp.where(members >= 0, row_of[member], -1)
    sib_tok = buf[jnp.maximum(row, 0)]  # [B, G, Wb]
    sib_len = jnp.where(row >= 0, lengths[jnp.maximum(row, 0)], 0)
    store, slot = drafter.store, drafter.slots[held]
    hist_tok = store.tokens[jnp.maximum(slot, 0)]  # [B, R, Ws]
    hist_len = jnp.where(slot[:, None] >= 0, store.lengths[jnp.maximum(slot, 0)], 0)
    if ctx.finished is not None:  # members that left their rows (or have not started: empty)
        done_tok, done_len = ctx.finished.sequences(member)  # [B, G, Wf]
        width = max(sib_tok.shape[2], done_tok.shape[2])
        live = (row >= 0)[..., None]
        sib_tok = jnp.where(live, _pad_to(sib_tok, width), _pad_to(done_tok, width))
        sib_len = jnp.where(row >= 0, sib_len, jnp.where(members >= 0, done_len, 0))
    width = max(sib_tok.shape[2], store.width)
    return (jnp.concatenate([_pad_to(sib_tok, width), _pad_to(hist_tok, width)], axis=1),
            jnp.concatenate([sib_len, hist_len], axis=1))


def _pad_to(x, width: int):  # [B, C, W] -> [B, C, width] zero-padded
    return jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[2])))


def lookup(drafter: HistoryDrafter, ctx: DraftContext):
    """The continuations of each row's longest matched suffix.

    -> (conts [B, M, k] int32, valid [B, M, k] bool, n [B] int32 matched length, 0 if none):
    the first M = max_matches matches in (candidate, end position) order; a match of the
    last n committed tokens ending at position e of a candidate continues with its tokens
    e+1 .. e+k (valid while inside the candidate's length).
    """
    cand, clen = _candidates(drafter, ctx)
    batch, num_c, width = cand.shape
    lengths = ctx.lengths
    hi, lo, k, m = drafter.max_n, drafter.min_n, drafter.k, drafter.max_matches
    s_idx = lengths[:, None] - hi + jnp.arange(hi)[None, :]
    suffix = jnp.take_along_axis(ctx.buffer, jnp.maximum(s_idx, 0), axis=1)  # [B, hi]
    e = jnp.arange(width)[None, None, :]
    match = jnp.ones((batch, num_c, width), bool)
    best = jnp.zeros((batch, num_c, width), bool)
    best_n = jnp.zeros((batch,), jnp.int32)
    for i in range(hi):  # match of n = i + 1 tokens ending at e
        shifted = jnp.pad(cand, ((0, 0), (0, 0), (i, 0)))[:, :, :width]  # cand[..., e - i]
        match = match & (shifted == suffix[:, hi - 1 - i, None, None]) & (e >= i)
        n = i + 1
        if n < lo:
            continue
        ok = match & (e + 1 < clen[:, :, None]) & (lengths[:, None, None] >= n)
        found = jnp.any(ok, axis=(1, 2))
        best = jnp.where(found[:, None, None], ok, best)  # longer n overrides shorter
        best_n = jnp.where(found, n, best_n)
    # The first m matches: the j-th sits where the running count of matches reaches j + 1,
    # i.e. after every position whose count is below j + 1 (one compare-and-count, no sort:
    # a top_k here was a full sort of rows x candidates x width on CPU).
    rank = jnp.cumsum(best.reshape(batch, -1), axis=1, dtype=jnp.int32)  # [B, C*W]
    nth = jnp.arange(1, m + 1, dtype=jnp.int32)
    where = jnp.sum(rank[:, None, :] < nth[None, :, None], axis=2, dtype=jnp.int32)  # [B, m]
    hit = nth[None, :] <= rank[:, -1:]
    where = jnp.where(hit, where, 0)
    c_idx, e_idx = where // width, where % width
    steps = e_idx[..., None] + 1 + jnp.arange(k)[None, None, :]  # [B, M, k]
    seqs = cand[jnp.arange(batch)[:, None], c_idx]  # [B, M, W]
    conts = jnp.take_along_axis(seqs, jnp.minimum(steps, width - 1), axis=2)
    limit = jnp.take_along_axis(clen, c_idx, axis=1)  # [B, M]
    valid = hit[..., None] & (steps < limit[..., None])
    return conts, valid, best_n


def _trie(conts, valid):
    """Matches' continuations [B, M, k] as trie nodes in a pool indexed (depth-1) * M + m.

    Node (d, m) is the path conts[m, :d]; it is kept once (at the first m with that path).
    -> (tokens, parents (pool index, -1: the root), depths, scores: fraction of matches
    through the node, present) each [B, k * M].
    """
    batch, m, k = conts.shape
    total = jnp.maximum(jnp.sum(valid[:, :, 0], axis=1), 1).astype(jnp.float32)  # [B]
    same = jnp.ones((batch, m, m), bool)
    first_prev = None
    toks, pars, deps, scores, present = [], [], [], [], []
    for d in range(k):
        same = same & (conts[:, :, None, d] == conts[:, None, :, d]) \
            & valid[:, :, None, d] & valid[:, None, :, d]
        first = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B, M] first equal match
        count = jnp.sum(same, axis=2).astype(jnp.float32)
        toks.append(conts[:, :, d])
        pars.append(jnp.full((batch, m), -1, jnp.int32) if d == 0 else (d - 1) * m + first_prev)
        deps.append(jnp.full((batch, m), d + 1, jnp.int32))
        scores.append(count / total[:, None])
        present.append(valid[:, :, d] & (first == jnp.arange(m)[None, :]))
        first_prev = first
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    return cat(toks), cat(pars), cat(deps), cat(scores), cat(present)


def _select(tokens, parents, depths, scores, present, budget: int, max_depth: int,
            extra=None) -> Tree:
    """The best `budget` present pool nodes as a Tree (pool order is topological and a
    parent scores at least its child, so ancestors are kept; a depth penalty breaks ties).
    Slots left over hold absent nodes (token -1). With `extra` ([B, pool] per-node values)
    -> (Tree, extra of the kept nodes [B, budget], 0 at absent ones)."""
    batch, size = tokens.shape
    if size < budget:  # pad the pool with absent nodes
        more = budget - size
        pad = lambda x, v: jnp.pad(x, ((0, 0), (0, more)), constant_values=v)  # noqa: E731
        tokens, parents, depths = pad(tokens, -1), pad(parents, -1), pad(depths, 1)
        scores, present = pad(scores, 0.0), pad(present, False)
        extra = None if extra is None else pad(extra, 0)
        size = budget
    rank = jnp.where(present, scores - 1e-6 * depths, _NEG)
    top, keep = jax.lax.top_k(rank, budget)
    keep = jnp.sort(keep, axis=1)
    b = jnp.arange(batch)[:, None]
    kept = present[b, keep]
    slot_of = jnp.full((batch, size), -1, jnp.int32).at[b, keep].set(
        jnp.arange(budget, dtype=jnp.int32)[None, :])
    par = parents[b, keep]
    par = jnp.where((par >= 0) & kept, slot_of[b, jnp.maximum(par, 0)], -1)
    tree = Tree(tokens=jnp.where(kept, tokens[b, keep], -1), parents=par,
                depths=jnp.where(kept, depths[b, keep], 1), max_depth=max_depth)
    if extra is None:
        return tree
    return tree, jnp.where(kept, extra[b, keep], 0)


def _check_int(owner: str, name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}; got {value!r}")


# --------------------------------------------------------------------------- drafters


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryDrafter(_ModelFree):
    """Drafts from the row's group (in flight) and its prompt's stored rollouts; model-free.

    Build one per batch with `HistoryDrafter.for_batch`. A row's tree holds the `budget`
    trie nodes with the most matches (depth <= k); with no match it is empty (all absent).
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

    def __post_init__(self):
        name = type(self).__name__
        for field, low in (("k", 1), ("budget", 1), ("min_n", 1), ("max_matches", 1)):
            _check_int(name, field, getattr(self, field), low)
        _check_int(name, "max_n", self.max_n, self.min_n)
        if self.budget < self.k:
            raise ValueError(f"{name}.budget={self.budget} must be >= k={self.k} (a chain "
                             f"of k drafts must fit)")

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

    num_nodes = property(lambda self: self.budget)
    max_depth = property(lambda self: self.k)
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
        """The trie of the row's matches (see `_trie`) and the matched suffix length [B]."""
        conts, valid, n = lookup(self, ctx)
        return _trie(conts, valid), n

    def propose(self, state, policy, ctx: DraftContext):
        (tokens, parents, depths, scores, present), _ = self.pool(ctx)
        return _select(tokens, parents, depths, scores, present, self.budget, self.k), None, state


def _head_chain(head_drafter: Eagle3Drafter, state, policy, ctx: DraftContext):
    """The head's chain and its cumulative log-probs under the head: ([B, k] int32, [B, k]
    float32). Each draft is picked as `Eagle3Drafter` picks a chain's (`drafters.pick_draft`):
    coupled under replay, the Gumbel-max draw with the verifier's noise; else the argmax."""
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
    """A history pool (from `_trie`) with a chain appended: a chain node whose path is
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
        scores = scores.at[jnp.arange(batch), twin].max(jnp.where(dup, chain_scores[:, j], _NEG))
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
    head: Any  # the EAGLE-3 chain drafter's state
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
    """One tree from the history trie and an EAGLE-3 chain, `budget` nodes scored on one
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
    head: Eagle3Drafter  # a chain drafter (tree None)
    budget: int = dataclasses.field(default=6, metadata=dict(static=True))
    gate: bool = dataclasses.field(default=True, metadata=dict(static=True))
    # gate: the ring's positions per row (None: max(16, max_depth + 1); at least max_depth + 1,
    # what one verify commits)
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if not isinstance(self.history, HistoryDrafter):
            raise TypeError(f"HybridDrafter.history must be a HistoryDrafter; got "
                            f"{type(self.history).__name__}")
        if not isinstance(self.head, Eagle3Drafter) or self.head.tree is not None:
            raise TypeError("HybridDrafter.head must be an Eagle3Drafter drafting a chain "
                            "(tree=None)")
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
            # later, just before it drafts (a prompt observed at once costs a head forward
            # per started rollout: the main job's speculative generation took 1.2-1.4x as
            # long, docs/BENCHMARKS.md)
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
        tree, source = _select(*merged, self.budget, self.max_depth, extra=source)
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
