"""Oracle drafter: drafts are a known rollout's own tokens, corrupted at a chosen rate.

For benchmarking the engine independent of draft quality. Generate the plain rollout
first, then decode the same prompts with the same key and `method="replay"`: the drafts are
exactly the tokens the verifier will sample, except that the draft at depth j (1-based) is
replaced by a wrong token with probability 1 - acceptance[j-1]. The corruption is
deterministic noise keyed by (seed, rollout id, position, depth), so repeated runs agree. A wrong
draft is rejected, and everything after it with it, so acceptance[j-1] is the acceptance
rate at depth j given depth j-1 accepted. Model-free: `forwards_per_*` are 0.

In bf16 on a GPU a verify forward of k + 1 tokens rounds differently from the 1-token
decode step the plain rollout ran, so "perfect" drafts replayed from plain decoding are
rejected where a near-tie flips (tau 2.0 instead of 4 at k = 3 on an H200). `verify_reference`
makes the reference what the verify forward itself emits: one untimed speculative run with
`VerifyWindowDrafter`, which drafts each depth by running the policy over the same (k+1)-token
window the verify will run, at the same positions over the same cache, and picks with the
verifier's own noise. An OracleDrafter over that run's tokens then feeds the engine the very
inputs of that run's verify forwards, so at acceptance 1.0 every draft is accepted, in bf16
and the default forward: tau = k + 1, and the benchmark measures the engine, not rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.draws import choose_draft
from jaxspec.decoding.drafters import ModelFreeDrafter
from jaxspec.decoding.engine import generate
from jaxspec.decoding.policy_cache import cache_axes
from jaxspec.decoding.protocols import DraftContext, Observation
from jaxspec.decoding.tree import Tree

__all__ = ["OracleDrafter", "VerifyWindowDrafter", "oracle_drafter", "verify_reference"]


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
    drafts_chains = True
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyWindowDrafter:
    """Drafts the tokens the policy's verify forward will emit (for `verify_reference`).

    Keeps a copy of the policy's KV cache, filled by the forwards the policy commits (the
    prompt's, then each verify's window: `observe`). Depth i's draft comes from a forward of
    the policy over the verify's window [root, d_1..d_i, pad..] (k + 1 tokens, at the verify's
    positions, over that cache): the verify computes position i from the same inputs in the
    same shape, so picking with the verifier's noise gives the token it will emit. k + 1
    forwards of the policy per step: a reference run, never a timed one."""

    k: int = dataclasses.field(default=3, metadata=dict(static=True))

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"VerifyWindowDrafter.k must be an int >= 1; got {self.k!r}")

    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)
    uses_verifier_noise = True  # DraftContext.verifier_noise (method="replay")
    capture_layers = ()
    drafts_chains = True
    supports_rejection = False
    forwards_per_propose = property(lambda self: self.k)
    forwards_per_observe = 1

    def check_compatible(self, policy) -> None:
        return None  # the policy drafts for itself

    def init_state(self, policy, batch, max_len):
        return policy.init_cache(batch, max_len)

    def state_axes(self, policy):
        return cache_axes(policy)  # the policy's cache (a hybrid's with its states), copied

    def observe(self, cache, policy, obs: Observation):
        _, _, cache = policy.forward(obs.fed_tokens, obs.positions, cache)
        return cache

    def propose(self, cache, policy, ctx: DraftContext):
        batch = ctx.lengths.shape[0]
        window = jnp.zeros((batch, self.k + 1), jnp.int32).at[:, 0].set(ctx.root)
        positions = (ctx.lengths - 1)[:, None] + jnp.arange(self.k + 1, dtype=jnp.int32)[None]
        for i in range(self.k):  # the window's cache writes are dropped: observe commits them
            logits, _, _ = policy.forward(window, positions, cache)
            token, _ = choose_draft(logits[:, i], ctx, i, coupled=True)
            window = window.at[:, i + 1].set(token)
        return Tree.chain(window[:, 1:]), None, cache


def verify_reference(policy, prompts, k: int, **generate_kwargs):
    """The rollouts a speculative run of chain length `k` emits when every draft is what its
    verify forward emits (`VerifyWindowDrafter`): build the OracleDrafter of a benchmark from
    their tokens (`oracle_drafter(..., completions=verify_reference(...).tokens, ...)`) and
    call `generate` with the same prompts, key, sampling and k. Lossless under replay, as
    every run of the engine: in exact arithmetic these are the plain rollouts."""
    if generate_kwargs.get("method", "replay") != "replay":
        raise ValueError(f"verify_reference needs method='replay' (the verifier's noise); "
                         f"got {generate_kwargs['method']!r}")
    return generate(policy, prompts, drafter=VerifyWindowDrafter(k), **generate_kwargs)
