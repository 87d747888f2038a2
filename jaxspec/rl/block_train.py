"""Training the block draft model (DFlash, DSpark) on the policy's rollouts: the loss, its
optax update (online in each RL step and offline in scripts/train_draft.py), guarded as the
EAGLE-3 update is.

Each row gets `anchors` anchor positions spread over its response (a per-row offset varies
them from step to step). The block at anchor a is [token a, mask, ...] at positions a ..
a + block - 1, bidirectional within itself, attending to the context (the fused policy
features) at positions < a: exactly what the drafter computes when token a is the last
committed one. Position j >= 1 of the block drafts token a + j; its loss is the soft
cross-entropy against the policy's distribution there (its logits at a + j - 1), weighted
exp(-(j - 1) / gamma) (DFlash's position decay), plus `tv` x the total variation between
the two (DSpark's CE + TV mix: 1 - TV is the acceptance rate of a sampled draft). With a
Markov head the token before position j is the rollout's own (teacher forcing); the
confidence head learns, by binary cross-entropy, the policy's probability of the draft's
argmax (the acceptance of that draft given the ones before it were accepted). Features and
the policy's embedding and LM head are stop-gradient: draft training never touches the
policy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxspec.models import Policy
from jaxspec.rl.chunked import lm_head
from jaxspec.rl.steps import FINITE_KEYS, _keep_if_finite, _tree_finite

__all__ = ["BlockLossConfig", "block_loss", "block_update"]


@dataclasses.dataclass(frozen=True)
class BlockLossConfig:
    anchors: int = 16  # blocks per row
    gamma: float = 7.0  # position j's weight exp(-(j - 1) / gamma)
    tv: float = 0.0  # weight of the total-variation term (DSpark: > 0)
    confidence: float = 0.1  # weight of the confidence head's BCE (when it has one)


def _anchors(response, tokens, count: int):
    """[B, A] anchor positions spread evenly over each row's usable anchors (a position whose
    next token is a response token), from a per-row offset; [B, A] bool: real ones."""
    b, t = response.shape
    usable = jnp.roll(response, -1, axis=1).at[:, -1].set(False)
    n = jnp.sum(usable, axis=1)  # [B]
    order = jnp.argsort(jnp.where(usable, jnp.arange(t), t + jnp.arange(t)), axis=1)  # usable first
    offset = jnp.sum(tokens, axis=1) % jnp.maximum(n, 1)  # varies with the rollout
    rank = (offset[:, None] + (jnp.arange(count)[None] * jnp.maximum(n, 1)[:, None]) // count) \
        % jnp.maximum(n, 1)[:, None]
    anchors = jnp.take_along_axis(order, rank, axis=1)
    real = jnp.arange(count)[None] < n[:, None]
    return anchors.astype(jnp.int32), real


def _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_ok):
    """q [B,A,S,Hq,D]; k/v_ctx [B,T,Hkv,D]; k/v_blk [B,A,S,Hkv,D]; ctx_ok [B,A,T] bool: the
    context positions each block reads. Every block query also reads its whole block."""
    b, a, s, hq, d = q.shape
    hkv = k_ctx.shape[2]
    qf = q.astype(jnp.float32).reshape(b, a, s, hkv, hq // hkv, d) * d ** -0.5
    sc = jnp.einsum("basjgd,btjd->basjgt", qf, k_ctx.astype(jnp.float32))
    sc = jnp.where(ctx_ok[:, :, None, None, None, :], sc, -jnp.inf)
    sb = jnp.einsum("basjgd,baujd->basjgu", qf, k_blk.astype(jnp.float32))
    w = jax.nn.softmax(jnp.concatenate([sc, sb], axis=-1), axis=-1)
    t = k_ctx.shape[1]
    out = (jnp.einsum("basjgt,btjd->basjgd", w[..., :t], v_ctx.astype(jnp.float32))
           + jnp.einsum("basjgu,baujd->basjgd", w[..., t:], v_blk.astype(jnp.float32)))
    return out.reshape(b, a, s, hq, d).astype(q.dtype)


def block_hidden(head, params, embed_fn, features, tokens, positions, anchors):
    """The body's final-normed hidden states [B, A, S, H] of the blocks at `anchors` [B, A]
    (features [B,T,F] stop-gradient here; positions [B,T], < 0 padding)."""
    m = nnx.merge(head.graphdef, params)
    cfg = head.config
    dtype = cfg.layer.param_dtype
    s = cfg.block_size
    b, a = anchors.shape
    ctx = m.hidden_norm(jax.lax.stop_gradient(features).astype(dtype) @ m.fc[...])
    block_tok = jnp.concatenate([jnp.take_along_axis(tokens, anchors, axis=1)[..., None],
                                 jnp.full((b, a, s - 1), cfg.mask_token_id, jnp.int32)], axis=-1)
    block_pos = anchors[..., None] + jnp.arange(s, dtype=jnp.int32)  # [B, A, S]
    ctx_ok = (positions[:, None, :] >= 0) & (jnp.arange(tokens.shape[1])[None, None] < anchors[..., None])
    x = jax.lax.stop_gradient(embed_fn(block_tok.reshape(b, a * s))).astype(dtype)
    flat_pos = block_pos.reshape(b, a * s)
    for layer in m.layers:
        _, k_ctx, v_ctx = layer.self_attn.project(ctx, jnp.maximum(positions, 0))
        q, k, v = layer.self_attn.project(layer.attention_input(x), flat_pos)
        split = lambda z: z.reshape((b, a, s) + z.shape[2:])  # noqa: E731
        heads = _block_attention(split(q), k_ctx, v_ctx, split(k), split(v), ctx_ok)
        x = layer.finish(x, heads.reshape((b, a * s) + heads.shape[3:]))
    return m.norm(x).reshape(b, a, s, -1)


def block_loss(head, params, policy: Policy, features, tokens, positions, response, target_hidden,
               cfg: BlockLossConfig):
    """(loss, metrics): draft_loss, draft_acc_j (position j + 1's argmax is the policy's),
    draft_tv_j, and the confidence head's draft_conf_bce. target_hidden [B,T,H]: the policy's
    final-normed hidden states (its logits at t predict token t + 1)."""
    hc = head.config
    s = hc.block_size
    anchors, real = _anchors(response, tokens, cfg.anchors)
    hidden = head.drafted(block_hidden(head, params, policy.embed, features, tokens, positions,
                                       anchors))  # [B, A, S - 1, H]: token j after the anchor
    weight, axis = lm_head(policy)
    weight = jax.lax.stop_gradient(weight.T if axis == 0 else weight).astype(jnp.float32)  # [H, V]
    mh = dataclasses.replace(head, params=params)
    t = tokens.shape[1]
    total, metrics, conf_terms = 0.0, {}, []
    for j in range(1, s):
        at = jnp.clip(anchors + j, 0, t - 1)  # the drafted token's position
        counts = real & (anchors + j < t) & jnp.take_along_axis(response, at, axis=1)
        previous = jnp.take_along_axis(tokens, at - 1, axis=1)  # teacher forcing
        tgt = jnp.take_along_axis(target_hidden, (at - 1)[..., None], axis=1)  # [B, A, H]
        p = jax.nn.softmax(jax.lax.stop_gradient(tgt).astype(jnp.float32) @ weight, axis=-1)
        h = hidden[:, :, j - 1]
        logits = h.astype(jnp.float32) @ weight + mh.markov_bias(previous)
        logq = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.sum(p * logq, axis=-1)
        tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(logq)), axis=-1)
        n = jnp.maximum(jnp.sum(counts), 1)
        term = jnp.sum(jnp.where(counts, ce + cfg.tv * tv, 0.0)) / n
        total = total + jnp.exp(-(j - 1) / cfg.gamma) * term
        best = jnp.argmax(logits, axis=-1)
        metrics[f"draft_loss_{j - 1}"] = jnp.sum(jnp.where(counts, ce, 0.0)) / n
        metrics[f"draft_acc_{j - 1}"] = jnp.sum(counts & (best == jnp.argmax(p, -1))) / n
        metrics[f"draft_tv_{j - 1}"] = jnp.sum(jnp.where(counts, tv, 0.0)) / n
        if hc.confidence:
            label = jax.lax.stop_gradient(jnp.take_along_axis(p, best[..., None], axis=-1)[..., 0])
            c = mh.confidence_logit(h, previous)
            bce = optax.sigmoid_binary_cross_entropy(c, label)
            conf_terms.append((jnp.sum(jnp.where(counts, bce, 0.0)), jnp.sum(counts)))
    if conf_terms:
        bce = sum(x for x, _ in conf_terms) / jnp.maximum(sum(n for _, n in conf_terms), 1)
        metrics["draft_conf_bce"] = bce
        total = total + cfg.confidence * bce
    metrics["draft_loss"] = total
    return total, metrics


@functools.partial(jax.jit, static_argnames=("optimizer", "loss_cfg"))
def block_update(head, opt_state, policy: Policy, scored: dict, *, optimizer, loss_cfg):
    """One update of the block model with its own optimizer on the logprob stage's
    (stop-gradient) features; a non-finite loss, gradient norm or new parameter keeps the old
    model and optimizer state (the FINITE_KEYS flags say which)."""
    def loss_fn(params):
        return block_loss(head, params, policy, scored["features"], scored["tokens"],
                          scored["positions"], scored["response"], scored["target_hidden"],
                          loss_cfg)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(head.params)
    updates, new_opt_state = optimizer.update(grads, opt_state, head.params)
    new_head = dataclasses.replace(head, params=optax.apply_updates(head.params, updates))
    metrics["draft_grad_norm"] = optax.tree.norm(grads)
    flags = (jnp.isfinite(metrics["draft_loss"]), jnp.isfinite(metrics["draft_grad_norm"]),
             _tree_finite(new_head.params))
    head, opt_state = _keep_if_finite(flags, (new_head, new_opt_state), (head, opt_state))
    metrics.update({k: f for k, f in zip(FINITE_KEYS, flags, strict=True)})
    return head, opt_state, metrics
