"""The block-parallel drafter (DFlash, with DSpark's Markov and confidence heads): a whole
chain from one forward of a `jaxspec.models.block.BlockHead`, whatever its length."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.draws import check_k, choose_draft, pick_draft
from jaxspec.decoding.protocols import DraftContext, Observation, kv_cache_axes
from jaxspec.decoding.tree import Tree
from jaxspec.models import KVCache

__all__ = ["BlockDrafter", "BlockState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    cache: KVCache  # the body's context: [layers, B, S, kv_heads, head_dim] per committed token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    """Drafts a chain of k <= block_size - 1 tokens from one body forward over [root, mask x
    (block_size - 1)] at positions lengths - 1 ...: the logits at mask position i (plus the
    Markov head's bias from the token drafted before it, when the model has one and `markov`)
    draft the token i + 1 after the root. Each draft is picked as the other chain drafters
    pick theirs (`draws.choose_draft`): under replay coupled with the verifier's noise
    (`coupled`) or the argmax; sampled with its q for rejection. The body always runs the
    whole trained block (its attention is bidirectional, so fewer masks would change every
    position); a shorter k (adaptive length) verifies fewer of its tokens."""

    head: object  # a jaxspec.models.block.BlockHead
    k: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # None: block - 1
    coupled: bool = dataclasses.field(default=True, metadata=dict(static=True))
    markov: bool = dataclasses.field(default=True, metadata=dict(static=True))  # use its Markov head

    def __post_init__(self):
        from jaxspec.models.block import BlockHead

        if not isinstance(self.head, BlockHead) and not hasattr(self.head, "config"):
            raise TypeError(f"BlockDrafter needs a jaxspec.models.block.BlockHead; got "
                            f"{type(self.head).__name__}")
        most = self.head.config.block_size - 1
        if self.k is None:
            object.__setattr__(self, "k", most)
        check_k(self.k)
        if self.k > most:
            raise ValueError(f"BlockDrafter k={self.k} exceeds what one block drafts: "
                             f"block_size - 1 = {most}")

    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)
    capture_layers = property(lambda self: self.head.capture_layers)
    uses_verifier_noise = property(lambda self: self.coupled)  # DraftContext.verifier_noise
    supports_rejection = True
    forwards_per_propose = 1  # the body, once per draft
    forwards_per_observe = 1  # the context projections

    @property
    def block_size(self) -> int:
        return self.head.config.block_size

    @property
    def uses_markov(self) -> bool:
        return self.markov and self.head.config.markov_rank > 0

    def with_k(self, k: int) -> BlockDrafter:
        """The same drafter verifying the first k of its block (adaptive draft length)."""
        return dataclasses.replace(self, k=k)

    def check_compatible(self, policy) -> None:
        self.head.check_compatible(policy)

    def init_state(self, policy, batch: int, max_len: int) -> BlockState:
        return BlockState(self.head.init_cache(batch, max_len))

    def state_axes(self, policy) -> BlockState:
        return BlockState(kv_cache_axes())

    def observe(self, state: BlockState, policy, obs: Observation) -> BlockState:
        features = jnp.concatenate([obs.captured[i] for i in self.head.capture_layers], axis=-1)
        return BlockState(self.head.context(features, obs.positions, state.cache))

    def drafted_hidden(self, state: BlockState, policy, ctx: DraftContext):
        """The body's final-normed hidden states at the k drafted positions: [B, k, H]."""
        batch = ctx.lengths.shape[0]
        cfg = self.head.config
        block = jnp.concatenate(
            [ctx.root[:, None], jnp.full((batch, cfg.block_size - 1), cfg.mask_token_id, jnp.int32)],
            axis=1)
        positions = (ctx.lengths - 1)[:, None] + jnp.arange(cfg.block_size, dtype=jnp.int32)
        hidden = self.head.block(policy.embed(block), positions, state.cache)
        return hidden[:, 1:1 + self.k]

    def _draft(self, state, policy, ctx: DraftContext, pick):
        """The chain, each token chosen by `pick(logits [B, V], i) -> token [B]` from the
        body's logits at position i plus the Markov bias from the token before it."""
        base = self.head.logits(self.drafted_hidden(state, policy, ctx), policy)  # [B, k, V]
        previous, tokens = ctx.root, []
        for i in range(self.k):
            logits = base[:, i]
            if self.uses_markov:
                logits = logits + self.head.markov_bias(previous)
            previous = pick(logits, i)
            tokens.append(previous)
        return jnp.stack(tokens, axis=1)

    def propose(self, state: BlockState, policy, ctx: DraftContext):
        probs = []

        def pick(logits, i):
            token, q = choose_draft(logits, ctx, i, coupled=self.coupled)
            probs.append(q)
            return token

        tokens = self._draft(state, policy, ctx, pick)
        draft_probs = jnp.stack(probs, axis=1) if ctx.sampled else None
        return Tree.chain(tokens), draft_probs, state

    def scored_chain(self, state: BlockState, policy, ctx: DraftContext):
        """The replay chain and its cumulative log-probs under the draft ([B, k] int32, [B, k]
        float32): what `HybridDrafter` merges with the history's tree."""
        logps, total = [], [0.0]

        def pick(logits, i):
            best = pick_draft(logits, ctx, i, None, coupled=self.coupled)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            total[0] = total[0] + jnp.take_along_axis(logp, best[:, None], axis=1)[:, 0]
            logps.append(total[0])
            return best.astype(jnp.int32)

        tokens = self._draft(state, policy, ctx, pick)
        return tokens, jnp.stack(logps, axis=1)
