"""How a drafter picks each draft token from its draft logits: coupled with the verifier's
noise, argmax, or sampled (rejection); shared by every network drafter."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding.protocols import DraftContext
from jaxspec.decoding.sampling import process_logits, processed_logits


def check_k(k: int, name: str = "k") -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"draft length {name} must be an int >= 1; got {k!r}")


def target_ids(ids, index):  # candidate indices -> target token ids (ids None: the identity)
    return (index if ids is None else ids[index]).astype(jnp.int32)


def pick_draft(logits, ctx: DraftContext, offset: int, ids=None, coupled: bool = True):
    """The candidate index [B] a replay chain drafts from draft logits [B, C] at absolute
    position `lengths + offset`: with `coupled` and the verifier's noise in `ctx`, the
    Gumbel-max draw from the processed q with that noise (`ids` [C]: the candidates' target
    ids, which index the noise; None: the candidates are the target vocabulary), so the draft
    equals the policy's token whenever q and p pick the same token under the same noise (q =
    p: always); otherwise the argmax of q."""
    if not coupled or ctx.verifier_noise is None:
        return jnp.argmax(logits, axis=-1)
    z = processed_logits(logits, ctx.sampling)
    noise = ctx.verifier_noise[:, offset]  # [B, V]
    if ids is not None:
        noise = jnp.take(noise, ids, axis=-1)  # [B, C]
    return jnp.argmax(z + noise, axis=-1)


def choose_draft(logits, ctx: DraftContext, offset: int, ids=None, vocab=None, coupled=True):
    """One draft token per row for absolute position `lengths + offset`, from draft logits
    [batch, C] over candidates whose target ids are `ids` [C] (None: the candidates are the
    target vocabulary of size `vocab`, or C).

    - rejection (`ctx.sampled`): a sample from the processed draft distribution q with the
      row's draft key, and q over the target vocabulary;
    - replay: `pick_draft` (coupled: the verifier's noise; else the argmax), and None.
    """
    if not ctx.sampled:
        return target_ids(ids, pick_draft(logits, ctx, offset, ids, coupled)), None
    logq = process_logits(logits, ctx.sampling)
    keys = ctx.draft_keys(offset)  # [batch]
    drawn = jax.vmap(lambda k, lq: jax.random.categorical(k, lq))(keys, logq)
    token = target_ids(ids, drawn)
    q = jnp.exp(logq)
    if ids is not None:  # q over the target vocabulary: zero outside the draft vocabulary
        q = jnp.zeros(q.shape[:-1] + (vocab,), q.dtype).at[..., ids].set(q)
    return token, q
