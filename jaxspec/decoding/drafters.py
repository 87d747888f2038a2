"""Drafters: pytrees that carry their own params and settings through `jax.jit`.

Each satisfies `jaxspec.decoding.protocols.Drafter`; `NoDrafter` (the empty tree) is plain
decoding, so the engine has one code path. The head drafters (EAGLE-3, MTP) live in
`jaxspec.decoding.heads` and are importable from here too.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.draws import check_k, choose_draft
from jaxspec.decoding.heads import Eagle3Drafter, HeadState, MTPDrafter, TreeSpec
from jaxspec.decoding.protocols import DraftContext, Observation, kv_cache_axes
from jaxspec.decoding.tree import Tree
from jaxspec.errors import FieldError
from jaxspec.models import Policy

__all__ = ["DraftModelDrafter", "Eagle3Drafter", "HeadState", "MTPDrafter", "ModelFreeDrafter",
           "NGramDrafter", "NoDrafter", "TreeSpec"]


# --------------------------------------------------------------------------- model-free


class ModelFreeDrafter(abc.ABC):
    """The base of drafters without a model (n-gram, history, oracle): no state, no captured
    layers, no forwards. A subclass declares `num_nodes`, `max_depth`, `supports_rejection`
    and implements `propose`."""

    capture_layers = ()
    forwards_per_propose = 0
    forwards_per_observe = 0

    def check_compatible(self, policy) -> None:
        """Nothing to check against the policy unless the subclass says otherwise."""
        return None

    def init_state(self, policy, batch: int, max_len: int):
        return None

    def state_axes(self, policy):
        return None  # no state: nothing to refill or grow

    def observe(self, state, policy, obs: Observation):
        return state

    @abc.abstractmethod
    def propose(self, state, policy, ctx: DraftContext):
        """-> (tree [B, N] after each row's root, draft_probs [B, N, V] or None, state)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoDrafter(ModelFreeDrafter):
    """Plain decoding: the empty tree every step (`generate(drafter=None)` uses it)."""

    num_nodes = 0
    max_depth = 0
    drafts_chains = True  # (the empty chain)
    supports_rejection = True  # rejection over an empty tree is plain sampling

    def propose(self, state, policy, ctx: DraftContext):
        return Tree.chain(jnp.zeros((ctx.lengths.shape[0], 0), jnp.int32)), None, state


# --------------------------------------------------------------------------- n-gram


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGramDrafter(ModelFreeDrafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, copy what followed.

    Tries n = max_n down to min_n; with no match it proposes the root repeated (harmless:
    verification rejects it).
    """

    k: int = dataclasses.field(default=3, metadata=dict(static=True))
    min_n: int = dataclasses.field(default=1, metadata=dict(static=True))
    max_n: int = dataclasses.field(default=3, metadata=dict(static=True))

    def __post_init__(self):
        check_k(self.k)
        if not (isinstance(self.min_n, int) and isinstance(self.max_n, int) and 1 <= self.min_n <= self.max_n):
            text = f"needs 1 <= min_n <= max_n; got min_n={self.min_n!r}, max_n={self.max_n!r}"
            max_bad = isinstance(self.min_n, int) and self.min_n >= 1 and not (
                isinstance(self.max_n, int) and self.max_n >= 1)  # else min_n is the culprit
            field = "max_n" if max_bad else "min_n"
            raise FieldError("NGramDrafter", field, getattr(self, field), text,
                             "1 <= min_n <= max_n", message=f"NGramDrafter {text}")

    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)
    drafts_chains = True
    supports_rejection = False

    def with_k(self, k: int) -> NGramDrafter:
        """The same drafter proposing chains of k (adaptive draft length)."""
        return dataclasses.replace(self, k=k)

    def propose(self, state, policy, ctx: DraftContext):
        buf, lengths = ctx.buffer, ctx.lengths
        batch, width = buf.shape
        found = jnp.zeros((batch,), bool)
        source = jnp.zeros((batch,), jnp.int32)  # position where the copied continuation starts
        for n in range(self.max_n, self.min_n - 1, -1):
            starts = width - n + 1
            suffix_idx = jnp.clip(lengths[:, None] - n + jnp.arange(n)[None, :], 0, width - 1)
            suffix = jnp.take_along_axis(buf, suffix_idx, axis=1)  # [batch, n]
            match = jnp.ones((batch, starts), bool)
            for i in range(n):
                match &= buf[:, i : i + starts] == suffix[:, i : i + 1]
            j = jnp.arange(starts)[None, :]
            match &= (j + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
            latest = jnp.max(jnp.where(match, j, -1), axis=1)
            hit = (latest >= 0) & ~found
            source = jnp.where(hit, latest + n, source)
            found |= hit
        idx = source[:, None] + jnp.arange(self.k)[None, :]
        # Continuation tokens must be committed ones; past the end repeat the root.
        ok = found[:, None] & (idx < lengths[:, None])
        copied = jnp.take_along_axis(buf, jnp.clip(idx, 0, width - 1), axis=1)
        tokens = jnp.where(ok, copied, ctx.root[:, None])
        return Tree.chain(tokens), None, state


# --------------------------------------------------------------------------- draft model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """A small policy of the same tokenizer drafts a chain of k tokens autoregressively."""

    model: Policy  # a small policy sharing the verifier's tokenizer
    k: int = dataclasses.field(default=3, metadata=dict(static=True))
    # replay: draw each draft with the verifier's noise at its position (`draws.choose_draft`); False:
    # the draft model's argmax
    coupled: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def __post_init__(self):
        check_k(self.k)

    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)
    uses_verifier_noise = property(lambda self: self.coupled)  # DraftContext.verifier_noise
    capture_layers = ()
    drafts_chains = True
    supports_rejection = True
    forwards_per_propose = property(lambda self: self.k)
    forwards_per_observe = 1

    def with_k(self, k: int) -> DraftModelDrafter:
        """The same drafter proposing chains of k (adaptive draft length)."""
        return dataclasses.replace(self, k=k)

    def check_compatible(self, policy) -> None:
        if not isinstance(self.model, Policy):  # a hybrid draft model's states would keep the
            # drafts it proposed (propose rolls back only the KV lengths)
            raise ValueError(
                f"DraftModelDrafter.model must be a jaxspec.models.Policy (dense or MoE); got "
                f"{type(self.model).__name__} (family {self.model.config.family!r}), whose "
                f"recurrent states propose cannot roll back")
        mine, theirs = self.model.config.vocab_size, policy.config.vocab_size
        if mine != theirs:
            raise ValueError(
                f"draft model vocabulary size {mine} differs from the policy's {theirs}; "
                f"a draft model must share the policy's tokenizer"
            )

    def init_state(self, policy, batch, max_len):
        return self.model.init_cache(batch, max_len)

    def state_axes(self, policy):
        return kv_cache_axes()  # the draft model's KV cache

    def observe(self, cache, policy, obs: Observation):
        _, _, cache = self.model.forward(obs.fed_tokens, obs.positions, cache)
        return cache

    def propose(self, cache, policy, ctx: DraftContext):
        start_lengths = cache.lengths
        token = ctx.root
        pos = ctx.lengths - 1
        tokens, probs = [], []
        for i in range(self.k):
            logits, _, cache = self.model.forward(token[:, None], (pos + i)[:, None], cache)
            token, q = choose_draft(logits[:, 0], ctx, i, coupled=self.coupled)
            tokens.append(token)
            probs.append(q)
        cache = dataclasses.replace(cache, lengths=start_lengths)  # drafts are not committed
        draft_probs = jnp.stack(probs, axis=1) if ctx.sampled else None
        return Tree.chain(jnp.stack(tokens, axis=1)), draft_probs, cache
