"""The history drafter's index: the store of earlier rollouts, and the brute-force suffix
lookup whose matches' continuations form a trie of scored draft nodes (see
`jaxspec.decoding.history`)."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.protocols import DraftContext
from jaxspec.decoding.tree import Tree

__all__ = ["HistoryStore", "lookup", "prompt_key", "select", "sibling_table", "trie"]

NEG = -1e30


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


def _candidates(drafter, ctx: DraftContext):  # drafter: a history.HistoryDrafter
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


def lookup(drafter, ctx: DraftContext):  # drafter: a history.HistoryDrafter
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
    # i.e. after every position whose count is below j + 1 (one compare-and-count, no sort
    # of rows x candidates x width).
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


def trie(conts, valid):
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


def best_path(tokens, parents, depths, scores, present, k: int, fill):  # pool from `trie`
    """The pool's best chain k deep: from the root, each step to the present child of the
    previous node with the highest score (the most matches through it; the first in pool
    order on a tie). Where a row's path ends early the rest is `fill` ([B] int32, e.g. the
    root's token: a guess the verify may still accept). -> [B, k] int32 (`Tree.chain`)."""
    batch = tokens.shape[0]
    b = jnp.arange(batch)
    prev = jnp.full((batch,), -1, jnp.int32)  # the previous node's pool index, -1: the root
    alive = jnp.ones((batch,), bool)
    out = []
    for d in range(1, k + 1):
        child = present & (depths == d) & (parents == prev[:, None])
        best = jnp.argmax(jnp.where(child, scores, NEG), axis=1).astype(jnp.int32)
        alive = alive & jnp.any(child, axis=1)
        out.append(jnp.where(alive, tokens[b, best], fill))
        prev = jnp.where(alive, best, -2)  # -2: no node's parent
    return jnp.stack(out, axis=1).astype(jnp.int32)


def select(tokens, parents, depths, scores, present, budget: int, max_depth: int,
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
    rank = jnp.where(present, scores - 1e-6 * depths, NEG)
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
