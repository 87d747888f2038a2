"""The block-parallel drafter (DFlash, with DSpark's Markov and confidence heads): a whole
chain from one forward of a `jaxspec.models.block.BlockHead`, whatever its length.

Draft length from confidence (`confidence_length`): each draft also estimates, with the
confidence head, the conditional acceptance alpha_j of every depth of the block, and adaptive
k (`jaxspec.decoding.adaptive`) chooses the next iteration's verified length from it. The
head learned P(argmax draft at j accepted | the drafts before it were), with the policy's
token before j as its Markov input (`jaxspec.rl.block_train`); given acceptance that token
is the greedy draft before j, so the estimate walks the argmax chain of the body's logits
(plus the Markov bias) from the root, whatever the drafts themselves were (coupled or sampled).
Per row, it averages the survival prod_{i<=j} alpha_i over the live rows and keeps the
ratios of consecutive averages (the batch's alpha_j, as the counts measure it). Its cost:
a [H + r] dot per position; with a Markov head also the LM head at the block's positions
past k, and one Markov bias and argmax per position for the greedy chain (shared with the
draft's when the drafts are argmaxes).

Exactness: this iteration's k comes from the previous draft's estimate, a function of the
committed prefix only (the greedy chain uses no draft or verifier randomness), and under
replay the tokens never depend on the drafts. `generate` refuses rejection sampling with
adaptive k: each iteration would be exact, but the estimate averages the live rows, so a
row's tokens would depend on the rows beside it. Choosing k from the current block's sampled tokens
would not be exact under rejection: verifying x_1 only when x_1 (or a token drawn after it)
looks likely changes the law x_1 is verified under. The current block's greedy estimate
would be (it too depends on the prefix only) but needs the body before the choice: one
forward more per iteration or the draft moved into `observe`, for a one-iteration-fresher
estimate; not done. Per row: a row's verify costs the same whatever its k in this
static-shape engine, so cutting a row's draft short saves nothing and only loses tokens;
the length is chosen per iteration only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.draws import check_k, choose_draft, pick_draft
from jaxspec.decoding.protocols import DraftContext, Observation, StateAxes, kv_cache_axes
from jaxspec.decoding.tree import Tree
from jaxspec.models import KVCache

__all__ = ["BlockDrafter", "BlockState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    cache: KVCache  # the body's context: [layers, B, S, kv_heads, head_dim] per committed token
    # [block_size - 1] float32 the confidence head's alpha_j over the last draft's live rows
    acceptance: jax.Array
    estimated: jax.Array  # [] bool: `acceptance` holds an estimate (a draft has been made)


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
    position); a shorter k (adaptive length) verifies fewer of its tokens. With a
    confidence head and `confidence_length`, each draft estimates the acceptance of every depth
    (`acceptance_estimate`), which adaptive k follows (the module's docstring)."""

    head: object  # a jaxspec.models.block.BlockHead
    k: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # None: block - 1
    coupled: bool = dataclasses.field(default=True, metadata=dict(static=True))
    markov: bool = dataclasses.field(default=True, metadata=dict(static=True))  # use its Markov head
    # adaptive k from the confidence head's estimate, when the model has one (else ignored)
    confidence_length: bool = dataclasses.field(default=True, metadata=dict(static=True))

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
        if not isinstance(self.confidence_length, bool):
            raise ValueError(f"BlockDrafter confidence_length must be True or False; got "
                             f"{self.confidence_length!r}")

    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)
    capture_layers = property(lambda self: self.head.capture_layers)
    uses_verifier_noise = property(lambda self: self.coupled)  # DraftContext.verifier_noise
    drafts_chains = True
    supports_rejection = True
    forwards_per_propose = 1  # the body, once per draft
    forwards_per_observe = 1  # the context projections

    @property
    def block_size(self) -> int:
        return self.head.config.block_size

    @property
    def uses_markov(self) -> bool:
        return self.markov and self.head.config.markov_rank > 0

    @property
    def estimates_acceptance(self) -> bool:
        """Whether each draft estimates every depth's acceptance (a confidence head, used)."""
        return self.confidence_length and self.head.config.confidence

    def acceptance_estimate(self, state: BlockState):
        """(alpha [block_size - 1] float32, [] bool valid) from the last draft; None without
        `estimates_acceptance` (`protocols.EstimatesAcceptance`)."""
        if not self.estimates_acceptance:
            return None
        return state.acceptance, state.estimated

    def with_k(self, k: int) -> BlockDrafter:
        """The same drafter verifying the first k of its block (adaptive draft length)."""
        return dataclasses.replace(self, k=k)

    def check_compatible(self, policy) -> None:
        self.head.check_compatible(policy)

    def init_state(self, policy, batch: int, max_len: int) -> BlockState:
        return BlockState(self.head.init_cache(batch, max_len),
                          jnp.zeros((self.block_size - 1,), jnp.float32), jnp.asarray(False))

    def state_axes(self, policy) -> BlockState:
        return BlockState(kv_cache_axes(), StateAxes(), StateAxes())  # the estimate: all rows'

    def observe(self, state: BlockState, policy, obs: Observation) -> BlockState:
        features = jnp.concatenate([obs.captured[i] for i in self.head.capture_layers], axis=-1)
        return dataclasses.replace(state, cache=self.head.context(features, obs.positions, state.cache))

    def block_hidden(self, state: BlockState, policy, ctx: DraftContext):
        """The body's final-normed hidden states at the block's block_size - 1 drafted
        positions: [B, block_size - 1, H]."""
        batch = ctx.lengths.shape[0]
        cfg = self.head.config
        block = jnp.concatenate(
            [ctx.root[:, None], jnp.full((batch, cfg.block_size - 1), cfg.mask_token_id, jnp.int32)],
            axis=1)
        positions = (ctx.lengths - 1)[:, None] + jnp.arange(cfg.block_size, dtype=jnp.int32)
        hidden = self.head.block(policy.embed(block), positions, state.cache)
        return self.head.drafted(hidden)

    def drafted_hidden(self, state: BlockState, policy, ctx: DraftContext):
        """The body's final-normed hidden states at the k drafted positions: [B, k, H]."""
        return self.block_hidden(state, policy, ctx)[:, :self.k]

    def _draft(self, state, policy, ctx: DraftContext, pick, *, estimate: bool = False,
               argmax: bool = False):
        """The chain, each token chosen by `pick(logits [B, V], i) -> token [B]` from the
        body's logits at position i plus the Markov bias from the token before it; and, with
        `estimate` (and `estimates_acceptance`), the confidence head's acceptance [B,
        block_size - 1] (else None; `argmax`: the picks are the argmaxes, so the chain is the
        estimate's greedy chain as far as it goes)."""
        estimate = estimate and self.estimates_acceptance
        hidden = self.block_hidden(state, policy, ctx)  # [B, block - 1, H]
        greedy = estimate and self.head.config.markov_rank > 0  # Markov inputs needed
        width = max(self.k, self.block_size - 2) if greedy else self.k
        base = self.head.logits(hidden[:, :width], policy)  # [B, width, V]

        def logits_after(previous, i):  # [B] -> [B, V] the draft logits at position i
            if self.uses_markov:
                return base[:, i] + self.head.markov_bias(previous)
            return base[:, i]

        previous, tokens = ctx.root, []
        for i in range(self.k):
            previous = pick(logits_after(previous, i), i)
            tokens.append(previous)
        tokens = jnp.stack(tokens, axis=1)
        if not estimate:
            return tokens, None
        # the Markov input before each position: the root, then the greedy chain
        inputs = [ctx.root]
        for i in range(self.block_size - 2 if greedy else 0):
            inputs.append(tokens[:, i] if argmax and i < self.k
                          else jnp.argmax(logits_after(inputs[-1], i), axis=-1).astype(jnp.int32))
        inputs += [ctx.root] * (self.block_size - 1 - len(inputs))  # no Markov input: unused
        logit = self.head.confidence_logit(hidden, jnp.stack(inputs, axis=1))
        return tokens, jax.nn.sigmoid(logit)

    def _estimated(self, state: BlockState, accept, live) -> BlockState:
        """The state with the batch's alpha_j from accept [B, block - 1] (per row, P(depth j
        accepted | those before were)): ratios of the live rows' mean survival; kept as it
        was when no row is live."""
        live = jnp.ones(accept.shape[:1], bool) if live is None else live
        n = jnp.sum(live)
        survive = jnp.sum(jnp.where(live[:, None], jnp.cumprod(accept, axis=1), 0.0), axis=0)
        survive = survive / jnp.maximum(n, 1)
        before = jnp.concatenate([jnp.ones((1,), survive.dtype), survive[:-1]])
        alpha = jnp.clip(survive / jnp.maximum(before, jnp.finfo(jnp.float32).tiny), 0.0, 1.0)
        return dataclasses.replace(state, acceptance=jnp.where(n > 0, alpha, state.acceptance),
                                   estimated=state.estimated | (n > 0))

    def propose(self, state: BlockState, policy, ctx: DraftContext):
        probs = []

        def pick(logits, i):
            token, q = choose_draft(logits, ctx, i, coupled=self.coupled)
            probs.append(q)
            return token

        argmax = not ctx.sampled and (not self.coupled or ctx.verifier_noise is None)
        tokens, accept = self._draft(state, policy, ctx, pick, estimate=True, argmax=argmax)
        if accept is not None:
            state = self._estimated(state, accept, ctx.live)
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

        tokens, _ = self._draft(state, policy, ctx, pick)
        return tokens, jnp.stack(logps, axis=1)
