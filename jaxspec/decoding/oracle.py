"""Oracle drafter: drafts are a known rollout's own tokens, corrupted at a chosen rate.

For benchmarking the engine independent of draft quality. Generate the plain rollout
first, then decode the same prompts with the same key and `method="replay"`: the drafts are
exactly the tokens the verifier will sample, except that the draft at depth j (1-based) is
replaced by a wrong token with probability 1 - acceptance[j-1]. The corruption is
deterministic noise keyed by (seed, rollout id, position, depth), so repeated runs agree. A wrong
draft is rejected, and everything after it with it, so acceptance[j-1] is the acceptance
rate at depth j given depth j-1 accepted. Model-free: `forwards_per_*` are 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.drafters import ModelFreeDrafter
from jaxspec.decoding.protocols import DraftContext
from jaxspec.decoding.tree import Tree

__all__ = ["OracleDrafter", "oracle_drafter"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OracleDrafter(ModelFreeDrafter):
    """Chain drafts read from `reference`, the full token sequences (prompt + plain rollout)
    at the engine's buffer positions."""

    reference: jax.Array  # [batch, ref_len] int32 prompt + plain completion, right-padded
    acceptance: tuple = dataclasses.field(default=(1.0,), metadata=dict(static=True))
    vocab_size: int = dataclasses.field(default=2, metadata=dict(static=True))
    seed: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self):
        acc = tuple(float(a) for a in self.acceptance)
        if not acc or any(not 0.0 <= a <= 1.0 for a in acc):
            raise ValueError(f"OracleDrafter.acceptance must be a non-empty sequence of rates "
                             f"in [0, 1] (one per depth); got {self.acceptance!r}")
        object.__setattr__(self, "acceptance", acc)
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"OracleDrafter.vocab_size must be an int >= 2 (a wrong token "
                             f"must exist); got {self.vocab_size!r}")

    k = property(lambda self: len(self.acceptance))
    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)
    supports_rejection = False

    def with_k(self, k: int) -> OracleDrafter:
        """The first k depths of the same drafts (adaptive draft length)."""
        if not 1 <= k <= self.k:
            raise ValueError(f"OracleDrafter has acceptance rates for depths 1..{self.k}; "
                             f"k={k} is out of that range")
        return dataclasses.replace(self, acceptance=self.acceptance[:k])

    def check_compatible(self, policy) -> None:
        if self.vocab_size != policy.config.vocab_size:
            raise ValueError(f"OracleDrafter.vocab_size {self.vocab_size} differs from the "
                             f"policy's {policy.config.vocab_size}")

    def init_state(self, policy, batch, max_len):
        if batch > self.reference.shape[0]:  # fewer with slots: rows read `ctx.sequences`
            raise ValueError(f"OracleDrafter.reference has {self.reference.shape[0]} rows; "
                             f"the batch has {batch}")
        return None

    def propose(self, state, policy, ctx: DraftContext):
        batch = ctx.lengths.shape[0]
        width = self.reference.shape[1]
        # The reference row of each slot's prompt (slots refill: a slot's prompt changes).
        seq = jnp.arange(batch, dtype=jnp.int32) if ctx.sequences is None else ctx.sequences
        pos = ctx.lengths[:, None] + jnp.arange(self.k, dtype=jnp.int32)[None, :]  # [B, k]
        right = jnp.take_along_axis(self.reference[seq], jnp.clip(pos, 0, width - 1), axis=1)
        # Noise keyed by (seed, rollout id, position, depth): independent of the engine's
        # keys, and of the batch, slot or step that drafts it.
        ids = seq if ctx.rows is None else ctx.rows
        base = jax.random.key(self.seed)
        depth = jnp.arange(self.k, dtype=jnp.int32)[None, :]

        def uniform(r, p, d):
            return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(
                jax.random.fold_in(base, r), p), d))

        u = jax.vmap(jax.vmap(uniform, (None, 0, 0)), (0, 0, None))(ids, pos, depth[0])
        keep = u < jnp.asarray(self.acceptance, jnp.float32)[None, :]
        wrong = (right + 1) % self.vocab_size
        return Tree.chain(jnp.where(keep, right, wrong)), None, state


def oracle_drafter(
    prompts,  # [batch, P] int32 right-padded prompt tokens (as given to `generate`)
    prompt_lengths,  # [batch] int32
    completions,  # [batch, N] int32 the plain rollout's tokens (`Rollouts.tokens`)
    acceptance,
    *,
    vocab_size: int,
    seed: int = 0,
) -> OracleDrafter:
    """An OracleDrafter whose reference places each completion right after its prompt."""
    prompts = np.asarray(prompts, np.int32)
    lengths = np.asarray(prompt_lengths, np.int32)
    completions = np.asarray(completions, np.int32)
    batch, n = completions.shape
    ref = np.zeros((batch, prompts.shape[1] + n), np.int32)
    for i in range(batch):
        ref[i, :lengths[i]] = prompts[i, :lengths[i]]
        ref[i, lengths[i]:lengths[i] + n] = completions[i]
    return OracleDrafter(jnp.asarray(ref), tuple(acceptance), vocab_size=vocab_size, seed=seed)
