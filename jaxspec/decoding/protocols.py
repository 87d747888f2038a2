"""What the rollout engine asks of a drafter (and what more a drafter may declare it can
do), and what a head drafter asks of a draft head.

Both are `typing.Protocol`s: any pytree with these members works, no base class needed.
Shapes: B batch rows, M observed entries per row, N tree nodes, V the policy's vocabulary,
C a head's draft vocabulary, H hidden size, F a head's input feature width.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import SamplingConfig, slot_keys
from jaxspec.decoding.tree import Tree
from jaxspec.models import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Finished:
    """Every rollout of this `generate` call as far as it has left its slot (continuous
    batching): finished rollouts whole, others empty (length 0) or, after a cache growth,
    as far as they had gone. Indexed by prompt (generate's prompt axis)."""

    prompt_tokens: jax.Array  # [prompts, P] int32 right-padded prompts
    prompt_lengths: jax.Array  # [prompts] int32
    tokens: jax.Array  # [prompts, T] int32 generated tokens
    lengths: jax.Array  # [prompts] int32 generated count (0: none harvested)

    def sequences(self, index):  # index [...] int prompt indices (>= 0)
        """-> (prompt + generated tokens [..., P + T] right-padded, their lengths [...]; 0
        where nothing was harvested)."""
        p = self.prompt_tokens.shape[1]
        both = jnp.concatenate([self.prompt_tokens[index], self.tokens[index]], axis=-1)
        plen, n = self.prompt_lengths[index], self.lengths[index]
        j = jnp.arange(both.shape[-1], dtype=jnp.int32)
        src = jnp.where(j < plen[..., None], j, p + j - plen[..., None])
        seq = jnp.take_along_axis(both, jnp.clip(src, 0, both.shape[-1] - 1), axis=-1)
        return seq, jnp.where(n > 0, plen + n, 0)


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What the engine tells a drafter at each proposal (lives inside one trace only)."""

    buffer: jax.Array  # [B, max_len] committed tokens (prompt + generated)
    lengths: jax.Array  # [B] committed count; the root is at lengths - 1
    key: jax.Array  # PRNG key of the drafts (never the verifier's); use `draft_keys`
    sampling: SamplingConfig
    sampled: bool  # draw drafts from q and return q (rejection method) instead of argmax
    rows: jax.Array | None = None  # [B] int32 global rollout ids; None: arange(B)
    # [B] int32 the prompt (index into `generate`'s prompts) each row holds: with slots
    # (continuous batching) a row's prompt changes when it is refilled; None: arange(B)
    sequences: jax.Array | None = None
    # [B, D+1, V] float32 under the replay method for a drafter that declares
    # `CouplesVerifierNoise` with `uses_verifier_noise` True (None otherwise): the verifier's Gumbel noise for the
    # tokens at absolute positions lengths + 0..D (D: the drafter's max_depth). A
    # drafter that picks one token per position may draw it with this noise
    # (`jaxspec.decoding.draws.choose_draft`): the policy's token then equals the draft whenever
    # the two distributions' Gumbel-max draws agree, which a calibrated draft makes far likelier
    # than its argmax does at temperature > 0. Lossless: under replay the emitted tokens are the
    # plain sampler's whatever the draft.
    verifier_noise: jax.Array | None = None
    # the call's rollouts that have left their slots (only with continuous batching: a
    # drafter may read a finished rollout, e.g. a sibling of the same prompt); None otherwise
    finished: Finished | None = None
    # [B] bool: rows still generating (False: finished, or an empty slot); None: every row.
    # A drafter may skip work that only dead rows would need (`HybridDrafter`'s head gate).
    live: jax.Array | None = None

    @property
    def root(self) -> jax.Array:  # [B]
        return jnp.take_along_axis(self.buffer, (self.lengths - 1)[:, None], axis=1)[:, 0]

    def draft_keys(self, offset: int, tag: int = 0) -> jax.Array:  # -> [B] keys
        """The key of each row's draft at absolute position `lengths + offset` (offset 0: the
        first draft after the root): a function of (key, rollout id, position, tag) only, so a
        rollout draws the same drafts whatever batch, split, slot or loop step proposes them."""
        rows = self.rows
        if rows is None:
            rows = jnp.arange(self.lengths.shape[0], dtype=jnp.int32)
        keys = slot_keys(self.key, rows, self.lengths + offset)
        return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, tag)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observation:
    """What the policy has just committed: after the prompt prefill and after each verify step.

    Entry j of row b is the token `fed_tokens[b, j]` at `positions[b, j]` (< 0: padding),
    followed in the sequence by `next_tokens[b, j]`; `captured[layer][b, j]` is the policy's
    hidden state there (only the layers the drafter named in `capture_layers`).
    """

    fed_tokens: jax.Array  # [B, M] int32
    next_tokens: jax.Array  # [B, M] int32
    positions: jax.Array  # [B, M] int32, < 0 marks padding
    captured: dict[int, jax.Array]  # {layer: [B, M, H]}

    def in_position_order(self, limit: int | None = None) -> Observation:
        """The entries sorted by position per row, padding last (deferred entries kept in a
        ring are observed this way, in one forward), keeping the first `limit` columns
        (None: all). Entries hold distinct positions below a cache's capacity, so `limit` =
        that capacity keeps every real entry and sizes the forward to the cache."""
        order = jnp.argsort(jnp.where(self.positions >= 0, self.positions,
                                      jnp.iinfo(jnp.int32).max), axis=1)
        if limit is not None:
            order = order[:, :limit]
        return jax.tree.map(
            lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1),
            self)

    def cleared(self) -> Observation:
        """The same buffers with every entry marked padding."""
        return dataclasses.replace(self, positions=jnp.full_like(self.positions, -1))


@runtime_checkable
class Drafter(Protocol):
    """Proposes a draft tree per row each step; a pytree, so it passes through `jax.jit`.

    The static members size the compiled loop; the engine counts forwards from the declared
    costs (a drafter never counts anything itself). What more a drafter can do it declares
    by implementing the capability protocols below (`HasStateAxes`, `RefillsRows`,
    `AdaptiveLength`, `EstimatesAcceptance`, `CouplesVerifierNoise`, `ReportsStats`,
    `ChecksPrompts`, `DraftsChains`); the engine
    checks them once per call, on the host. A drafter that reads other rollouts finds them
    by prompt, not by row: `DraftContext.sequences` says which prompt each row holds and
    `DraftContext.finished` holds the rollouts that left their rows (as `HistoryDrafter`
    does).
    """

    @property
    def num_nodes(self) -> int: ...  # N: tree nodes per proposal (0: plain decoding)

    @property
    def max_depth(self) -> int: ...  # D: the deepest node of any proposal

    @property
    def capture_layers(self) -> tuple[int, ...]: ...  # policy layers `observe` needs

    @property
    def supports_rejection(self) -> bool: ...  # can sample chains and return q (method="rejection")

    @property
    def forwards_per_propose(self) -> int: ...  # declared cost: draft forwards per proposal

    @property
    def forwards_per_observe(self) -> int: ...  # declared cost: draft forwards per observation

    def check_compatible(self, policy) -> None:
        """Host-side check against the policy before anything compiles; raises ValueError."""

    def init_state(self, policy, batch: int, max_len: int) -> Any:
        """The drafter's own state (a pytree, or None)."""

    def observe(self, state, policy, obs: Observation) -> Any:
        """Absorb what the policy committed; returns the new state."""

    def propose(self, state, policy, ctx: DraftContext) -> tuple[Tree, jax.Array | None, Any]:
        """-> (tree [B, N] after each row's root, draft_probs [B, N, V] (ctx.sampled) or None, state)."""


@dataclasses.dataclass(frozen=True)
class StateAxes:
    """Where one leaf of a drafter's state keeps its rows and its cache positions (a pytree
    leaf: `HasStateAxes.state_axes` returns one per state leaf, in the state's structure)."""

    row: int | None = None  # the axis with one entry per batch row; None: shared by all rows
    length: int | None = None  # the axis with one entry per cache slot; None: fixed size


def kv_cache_axes() -> KVCache:
    """The axes of a `jaxspec.models.KVCache`: k, v [layers, batch, max_len, kv_heads,
    head_dim], lengths [batch]."""
    return KVCache(k=StateAxes(row=1, length=2), v=StateAxes(row=1, length=2),
                   lengths=StateAxes(row=0))


@runtime_checkable
class HasStateAxes(Protocol):
    """A drafter whose state rows can be started afresh one at a time (continuous batching)
    and whose cache-sized leaves can move into a larger cache (`generate(grow_cache=...)`)."""

    def state_axes(self, policy) -> Any:
        """The `init_state` pytree with a `StateAxes` in place of each leaf (None: no state)."""


@runtime_checkable
class RefillsRows(Protocol):
    """A drafter that starts a row afresh itself (then it needs no row axes)."""

    def refill_state(self, state, policy, row, obs: Observation, max_len: int) -> Any:
        """`state` with row `row` (a traced int32 scalar) started on a new prompt whose one-row
        prefill is `obs` (under adaptive k = 0 every position is padding: the row starts
        empty and the prompt is observed later)."""


@runtime_checkable
class AdaptiveLength(Protocol):
    """A drafter whose draft depth can be chosen per iteration (`generate(adaptive=...)`)."""

    def with_k(self, k: int) -> Drafter:
        """The same drafter drafting at most k deep, keeping a state of the same shapes."""


@runtime_checkable
class EstimatesAcceptance(Protocol):
    """An adaptive-length drafter that predicts, from its own last draft, the acceptance at
    every depth (adaptive k then chooses from that instead of the measured counts)."""

    def acceptance_estimate(self, state) -> tuple[jax.Array, jax.Array] | None:
        """-> (alpha [depths] float32: P(the draft at depth j is accepted | those before it
        were), over the live rows of the last draft made; [] bool: a draft has been made), or
        None where this drafter, as configured, has no estimate. Only past drafts enter it, so
        a k chosen from it depends on past iterations only."""


@runtime_checkable
class DraftsChains(Protocol):
    """A drafter that may declare that its every proposal is a chain (`Tree.is_chain`): a
    hybrid (Gated DeltaNet) policy verifies nothing else (one recurrent state per row)."""

    @property
    def drafts_chains(self) -> bool: ...  # True: every proposal is a chain


@runtime_checkable
class CouplesVerifierNoise(Protocol):
    """A drafter that may read `DraftContext.verifier_noise` (replay)."""

    @property
    def uses_verifier_noise(self) -> bool: ...  # False: the engine draws no noise for it


@runtime_checkable
class ReportsStats(Protocol):
    """A drafter with counters of its own, returned as `Rollouts.draft_stats`."""

    def draft_stats(self, state) -> dict:
        """{name: [] array} from the final state."""


@runtime_checkable
class ChecksPrompts(Protocol):
    """A drafter built for one call's prompts."""

    def check_prompts(self, n: int) -> None:
        """Host-side, before anything compiles: raise ValueError unless built for n prompts."""


@runtime_checkable
class DraftHead(Protocol):
    """A small network on the policy's hidden states (EAGLE-3, MTP) that `Eagle3Drafter` and
    `MTPDrafter` run, one decoder layer per draft step."""

    @property
    def capture_layers(self) -> tuple[int, ...]: ...  # policy layers whose outputs it reads

    @property
    def hidden_size(self) -> int: ...  # H of the head's own output

    @property
    def draft_vocab_size(self) -> int: ...  # C: candidates per draft step

    def check_compatible(self, policy) -> None:
        """Raises ValueError naming every mismatch with the policy."""

    def init_cache(self, batch: int, max_len: int) -> Any:
        """An empty KVCache for the head's layer."""

    def forward(
        self,
        embeds,  # [B, T, H] policy embeddings of the tokens that follow each entry
        hidden,  # [B, T, F] captured policy features (fuse=True) or the head's own output [B, T, H]
        positions,  # [B, T] int32, < 0 marks padding
        cache,
        *,
        mask=None,  # [B, T, T] bool among the new entries; default causal
        fuse: bool,
    ) -> tuple[jax.Array, Any]:
        """-> (pre-norm hidden [B, T, H], cache with the new entries appended)."""

    def layer_step(
        self,
        embeds,  # [B, T, H]
        hidden,  # [B, T, F] or [B, T, H], as in `forward`
        positions,  # [B, T] int32
        k_cache,  # [B, S, kv_heads, head_dim], a jaxspec.kernels.CacheLayer or WithAncestors view
        v_cache,  # [B, S, kv_heads, head_dim], a CacheLayer or WithAncestors view
        cache_lengths,  # [B] int32
        *,
        mask,  # [B, T, T] bool among the new entries
        fuse: bool,
        thread: bool = False,
    ) -> tuple:
        """`forward` without storing: -> (pre-norm hidden [B, T, H], k, v [B, T, kv_heads,
        head_dim]); thread=True appends (k_cache, v_cache) as the attention passed them on
        (`jaxspec.kernels.tree_attention`), which `forward` stores into."""

    def draft_logits(self, hidden, policy) -> tuple[jax.Array, jax.Array | None]:
        """hidden [..., H] -> (float32 logits [..., C], target ids [C] of the candidates, or None
        when the candidates are the policy's vocabulary itself)."""
