"""EAGLE-3 draft training: the training-time-test (TTT) loss and its optax update.

The head is unrolled for `steps` steps over whole sequences. Step 0 feeds the fused target
features f_t with the embedding of token t+1 at position t; step s > 0 feeds the head's own
step s-1 output at the same position with the embedding of token t+1+s, RoPE position t+s.
Attention at step s sees step 0's keys causally plus, diagonally, the same position's keys
from steps 1..s — exactly what the head sees when it drafts s tokens ahead at inference.
Each step's loss is the soft cross-entropy between the target's distribution restricted to
the draft vocabulary and the head's, weighted decay**s. Features are stop-gradient: draft
training never touches the policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxspec import parallel
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models.hybrid_mtp import HybridMTPHead
from jaxspec.rl import chunked

_UNIT_SAMPLING = SamplingConfig(1.0, 0, 1.0)  # the policy's own softmax (the MTP loss's CE)


# Query rows per block of the TTT attention: its [B, heads, rows, T] scores are what a block
# holds (at T = 5120 the whole [B, heads, T, T] is 3.4 GB per row in float32).
_QUERY_BLOCK = 512


def _ttt_attention(q, k0, v0, diag_k, diag_v, valid, block: int = _QUERY_BLOCK,
                   mask_diag: bool = False):
    """q [B,T,Hq,D]; k0/v0 [B,T,Hkv,D] step-0 keys; diag_* lists of [B,T,Hkv,D]; valid [B,T].

    Computed in blocks of `block` query rows (each row sees all its keys, so the result does
    not depend on the block), each rematerialised in the backward; past one block, the query
    side (q, diag_*) is padded to a multiple of it and the padded rows dropped, so no array
    holds more than [B, heads, block, T] scores. mask_diag: a padding row (valid False) sees
    no diagonal key either (the MTP head's dense mask excludes every padding entry)."""
    t = q.shape[1]
    if t <= block:
        return _ttt_attention_rows(q, k0, v0, diag_k, diag_v, valid, 0,
                                   valid if mask_diag else None)
    pad = -t % block
    if pad:  # padded query rows see every key; they are dropped below

        def pad_rows(x):
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, diag_k, diag_v = pad_rows(q), [pad_rows(k) for k in diag_k], [pad_rows(v) for v in diag_v]
    rows_valid = jnp.pad(valid, [(0, 0), (0, pad)]) if mask_diag else None

    @jax.checkpoint
    def rows(start):
        def sl(x):
            return jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)
        return _ttt_attention_rows(sl(q), k0, v0, [sl(k) for k in diag_k],
                                   [sl(v) for v in diag_v], valid, start,
                                   None if rows_valid is None else sl(rows_valid))

    out = jax.lax.map(rows, jnp.arange(0, t + pad, block, dtype=jnp.int32))  # [n, B, block, Hq, D]
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)[:, :t]


def _ttt_attention_rows(q, k0, v0, diag_k, diag_v, valid, start, rows_valid=None):
    """The TTT attention of query rows start .. start + R: q and diag_* [B,R,...], k0/v0 and
    valid over all T positions; rows_valid [B,R] (or None: unmasked) masks the diagonal keys."""
    b, r, hq, d = q.shape
    t = k0.shape[1]
    hkv = k0.shape[2]
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(b, r, hkv, g, d) * d**-0.5
    s0 = jnp.einsum("btkgd,bskd->bkgts", qf, k0.astype(jnp.float32))  # [B,hkv,g,R,T]
    causal = (jnp.arange(t)[None, :] <= start + jnp.arange(r)[:, None])[None] & valid[:, None, :]
    s0 = jnp.where(causal[:, None, None], s0, -jnp.inf)
    sd = [jnp.einsum("btkgd,btkd->bkgt", qf, kj.astype(jnp.float32))[..., None] for kj in diag_k]
    if rows_valid is not None:
        sd = [jnp.where(rows_valid[:, None, None, :, None], x, -jnp.inf) for x in sd]
    scores = jnp.concatenate([s0] + sd, axis=-1)
    w = jax.nn.softmax(scores, axis=-1)
    w = jnp.where(jnp.isnan(w), 0.0, w)
    out = jnp.einsum("bkgts,bskd->btkgd", w[..., :t], v0.astype(jnp.float32))
    for j, vj in enumerate(diag_v):
        wj = w[..., t + j].transpose(0, 3, 1, 2)[..., None]
        out = out + wj * vj.astype(jnp.float32)[:, :, :, None, :]
    return out.reshape(b, r, hq, d).astype(q.dtype)


def ttt_logits(head, params, embed_fn, features, tokens, valid, steps: int):
    """Draft logits [steps, B, T, draft_vocab] of the unrolled head.

    features [B,T,3H] target features (stop-gradient applied here); tokens [B,T] the
    sequence; valid [B,T] real (non-pad) positions; embed_fn maps tokens to the target's
    frozen embeddings.
    """
    module = nnx.merge(head.graphdef, params, head.buffers)
    hidden = ttt_hidden(head, params, embed_fn, features, tokens, valid, steps)
    return jnp.stack([module.logits(h) for h in hidden])


def ttt_hidden(head, params, embed_fn, features, tokens, valid, steps: int):
    """The unrolled head's hidden states before its final norm, one [B, T, H] per step
    (its logits are `module.logits` of them); arguments as `ttt_logits`."""
    module = nnx.merge(head.graphdef, params, head.buffers)
    b, t = tokens.shape
    dtype = head.config.layer.param_dtype
    features = jax.lax.stop_gradient(features).astype(dtype)
    base_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    hidden = module.fuse(features)
    k0 = v0 = None
    diag_k, diag_v, out = [], [], []
    for s in range(steps):
        nxt = jnp.roll(tokens, -(1 + s), axis=1)
        embeds = jax.lax.stop_gradient(embed_fn(nxt)).astype(dtype)
        # The head's own decoder layer, split around the TTT attention pattern.
        q, k, v = module.self_attn.project(module.attention_input(hidden, embeds), base_pos + s)
        if s == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        attn = _ttt_attention(q, k0, v0, diag_k, diag_v, valid)
        hidden = module.finish(hidden, attn)
        out.append(hidden)
    return out


@dataclasses.dataclass(frozen=True)
class DraftLossConfig:
    steps: int = 7
    decay: float = 0.8
    chunk: int = 8192  # vocabulary entries per chunk of the fused LM heads (TargetHead); 0: whole
    micro_batch: int = 0  # rows per forward; the gradient accumulates over them; 0: all rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetHead:
    """The policy's logits as final-normed hidden states and its LM head, so the draft loss
    computes them in chunks (jaxspec.rl.chunked) instead of holding [B, T, V]."""

    hidden: jax.Array  # [B, T, H]
    weight: jax.Array  # [V, H] (vocab_axis 0, tied embeddings) or [H, V] (vocab_axis 1)
    vocab_axis: int = dataclasses.field(default=1, metadata=dict(static=True))
    invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))


def _target_argmax_ok(head, target, cfg):
    """[B, T] bool: the target's top token at t is in the draft vocabulary (no gradient)."""
    in_draft = jnp.zeros((head.config.vocab_size,), bool).at[head.draft_to_target()].set(True)
    if not isinstance(target, TargetHead):
        return in_draft[jnp.argmax(jax.lax.stop_gradient(target), axis=-1)]
    b, t, _ = target.hidden.shape
    top = chunked.argmax(target.hidden.reshape(b * t, -1), target.weight, chunk=cfg.chunk,
                         vocab_axis=target.vocab_axis, invariant=target.invariant)
    return in_draft[top.reshape(b, t)]


def _counts(loss_mask, argmax_ok, s: int):
    """[B, T] bool: positions whose step-s prediction (token t+2+s, from the target's logits
    at t+1+s) counts: a response token, the target's top token in the draft vocabulary."""
    t = loss_mask.shape[1]
    shift = 1 + s
    return (jnp.roll(loss_mask, -(shift + 1), axis=1) & jnp.roll(argmax_ok, -shift, axis=1)
            & (jnp.arange(t)[None, :] + shift + 1 < t))


def draft_loss(head, params, embed_fn, features, tokens, target, loss_mask, cfg: DraftLossConfig,
               *, denominators=None):
    """Σ_s decay^s · soft-CE_s; returns (loss, metrics).

    target: the policy's logits [B,T,V] (position t predicts token t+1), or a TargetHead,
    with which the target and draft logits are computed in vocabulary chunks of cfg.chunk;
    loss_mask [B,T] true where token t is a response token (the draft is trained to
    predict those only). denominators [steps] or None: the positions that count at each
    step in the whole batch when this call sees one micro-batch of it (the loss and the
    metrics are then this micro-batch's parts of the batch's).
    """
    b, t = tokens.shape
    valid = jnp.ones((b, t), bool)
    argmax_ok = _target_argmax_ok(head, target, cfg)
    if isinstance(target, TargetHead):
        term = _chunked_ce_terms(head, params, embed_fn, features, tokens, valid, target, cfg)
    else:
        logits = ttt_logits(head, params, embed_fn, features, tokens, valid, cfg.steps)
        target_logits = jax.lax.stop_gradient(target.astype(jnp.float32))
        p_draft = jax.nn.softmax(target_logits[..., head.draft_to_target()], axis=-1)  # [B,T,Vd]

        def term(s):  # (soft CE, argmaxes agree) [B,T] of step s
            tgt = jnp.roll(p_draft, -(1 + s), axis=1)
            logq = jax.nn.log_softmax(logits[s], axis=-1)
            return -jnp.sum(tgt * logq, axis=-1), jnp.argmax(logits[s], -1) == jnp.argmax(tgt, -1)
    total = jnp.zeros((), jnp.float32)
    metrics: dict[str, Any] = {}
    for s in range(cfg.steps):
        ok = _counts(loss_mask, argmax_ok, s)
        ce, agree = term(s)
        n = jnp.maximum(jnp.sum(ok), 1) if denominators is None else denominators[s]
        loss_s = jnp.sum(jnp.where(ok, ce, 0.0)) / n
        acc_s = jnp.sum(ok & agree) / n
        total = total + cfg.decay**s * loss_s
        metrics[f"draft_loss_{s}"] = loss_s
        metrics[f"draft_acc_{s}"] = acc_s
    metrics["draft_loss"] = total
    return total, metrics


def _chunked_ce_terms(head, params, embed_fn, features, tokens, valid, target: TargetHead, cfg):
    """step s -> (soft CE [B,T], argmaxes agree [B,T]), computed in draft-vocabulary chunks
    fused with the two LM heads."""
    module = nnx.merge(head.graphdef, params, head.buffers)
    hidden = ttt_hidden(head, params, embed_fn, features, tokens, valid, cfg.steps)
    b, t = tokens.shape
    th = jax.lax.stop_gradient(target.hidden)
    w_draft = jnp.take(target.weight, head.draft_to_target(), axis=target.vocab_axis)
    w_draft = w_draft.T if target.vocab_axis == 0 else w_draft  # [H, Vd] the target head on Vd

    def term(s):
        tgt = jnp.roll(th, -(1 + s), axis=1).reshape(b * t, -1)
        ce, agree = chunked.soft_cross_entropy(
            tgt, w_draft, module.norm(hidden[s]).reshape(b * t, -1), module.lm_head[...],
            chunk=cfg.chunk, invariant=target.invariant)
        return ce.reshape(b, t), agree.reshape(b, t)
    return term


def draft_train_step(head, opt_state, optimizer, embed_fn, features, tokens, target, loss_mask,
                     cfg):
    """One optax update of the head's params; returns (head, opt_state, metrics). With
    cfg.micro_batch, the gradient accumulates over micro-batches of that many rows."""
    b = tokens.shape[0]
    micro = cfg.micro_batch if 0 < cfg.micro_batch < b else 0
    if micro and b % micro:
        raise ValueError(f"DraftLossConfig.micro_batch={micro} does not divide the {b} rows; "
                         f"valid: 0 or a divisor of {b}")
    if not micro:
        def loss_fn(params):
            return draft_loss(head, params, embed_fn, features, tokens, target, loss_mask, cfg)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(head.params)
        grads = parallel.constrain_params(grads)
    else:
        is_head = isinstance(target, TargetHead)
        rows = chunked.split_rows((features, tokens, target.hidden if is_head else target,
                                   loss_mask), micro)

        def part(x):  # a micro-batch's target
            return dataclasses.replace(target, hidden=x) if is_head else x

        def counted(xs):  # [steps] positions that count in a micro-batch
            ok = _target_argmax_ok(head, part(xs[2]), cfg)
            return jnp.stack([jnp.sum(_counts(xs[3], ok, s)) for s in range(cfg.steps)])

        denominators = jnp.maximum(jnp.sum(jax.lax.map(counted, rows), axis=0), 1)

        def part_grad(xs):
            # rows over the batch devices, gradients onto the params' shards (FSDP)
            f, tok, tgt, mask = (parallel.constrain_rows(x) for x in xs)

            def loss_fn(params):
                return draft_loss(head, params, embed_fn, f, tok, part(tgt), mask, cfg,
                                  denominators=denominators)

            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(head.params)
            return parallel.constrain_params(grads), metrics

        grads, metrics = chunked.accumulate_gradients(part_grad, head.params, rows)
        metrics = {k: v.sum() for k, v in metrics.items()}  # parts of the batch's values
    updates, opt_state = optimizer.update(grads, opt_state, head.params)
    params = optax.apply_updates(head.params, updates)
    metrics["draft_grad_norm"] = optax.tree.norm(grads)
    return dataclasses.replace(head, params=params), opt_state, metrics


# ----------------------------------------------------------------------------- MTP

def mtp_hidden(head, params, embed_fn, features, tokens, positions, steps: int):
    """The MTP head unrolled `steps` draft steps over whole sequences, as its chain drafting
    runs it: step 0 reads (h_t, embedding of token t+1) at position t; step s > 0 reads its
    own step s-1 output at t with the embedding of token t+1+s at position t+s, and attends
    to step 0's entries up to t plus the same position's entries of steps 1..s (what the
    drafter's cache holds s tokens ahead). Returns one pre-norm [B,T,H] per step.

    features [B,T,H] (stop-gradient here); tokens / positions [B,T], positions < 0 padding."""
    head = dataclasses.replace(head, params=params)
    block = head.module.block
    valid = positions >= 0
    hidden = jax.lax.stop_gradient(features)
    k0 = v0 = None
    diag_k, diag_v, out = [], [], []
    for s in range(steps):
        embeds = jax.lax.stop_gradient(embed_fn(jnp.roll(tokens, -(1 + s), axis=1)))
        x = head.layer_input(embeds, hidden)
        # the decoder layer split around the TTT pattern (`_ttt_attention`, padding masked)
        q, k, v = block.self_attn.project(block.attention_input(x),
                                          jnp.where(valid, positions + s, 0))
        if s == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        attn = _ttt_attention(q, k0, v0, diag_k, diag_v, valid, mask_diag=True)
        hidden = block.finish(x, attn)
        out.append(hidden)
    return out


def mtp_loss(head, params, embed_fn, features, tokens, positions, response,
             target: TargetHead,
             *, steps: int = 1, decay: float = 0.8, chunk: int = 8192):
    """DeepSeek-V3's MTP loss on stop-gradient policy features, unrolled as the head drafts
    (`mtp_hidden`): step s at position t is scored by cross-entropy on token t+2+s where it
    is a response token, weighted decay**s. Logits go through the policy's final LM head
    (`target.weight`, frozen) in vocabulary chunks. Returns (loss, metrics: mtp_loss_s,
    mtp_acc_s = the head's argmax is that token).

    features [B,T,H]; tokens / positions / response [B,T] (score_rollouts' packing; positions
    < 0 on padding); target: the policy's LM head (its `hidden` is unused, except by a
    Qwen3.5 / Qwen3-Next head (HybridMTPHead): that head reads the policy's final-normed
    hidden states in place of `features`, and its outputs are already normed)."""
    b, t = tokens.shape
    normed_states = isinstance(head, HybridMTPHead)
    if normed_states:
        features = target.hidden
    hidden = mtp_hidden(head, params, embed_fn, features, tokens, positions, steps)
    module = dataclasses.replace(head, params=params).module
    weight = jax.lax.stop_gradient(target.weight)
    total = jnp.zeros((), jnp.float32)
    metrics = {}
    for s, h in enumerate(hidden):
        normed = h if normed_states else module.norm(h.astype(head.config.layer.param_dtype))
        goal = jnp.roll(tokens, -(2 + s), axis=1)
        counts = jnp.roll(response, -(2 + s), axis=1) & (jnp.arange(t)[None, :] + 2 + s < t)
        lp, _ = chunked.token_logprobs(normed, weight, goal, _UNIT_SAMPLING,
                                       vocab_axis=target.vocab_axis, filtered=False, chunk=chunk,
                                       invariant=target.invariant)
        top = chunked.argmax(jax.lax.stop_gradient(normed).reshape(b * t, -1), weight,
                             chunk=chunk, vocab_axis=target.vocab_axis,
                             invariant=target.invariant).reshape(b, t)
        n = jnp.maximum(jnp.sum(counts), 1)
        loss_s = -jnp.sum(jnp.where(counts, lp, 0.0)) / n
        metrics[f"mtp_loss_{s}"] = loss_s
        metrics[f"mtp_acc_{s}"] = jnp.sum(counts & (top == goal)) / n
        total = total + decay**s * loss_s
    metrics["mtp_loss"] = total
    return total, metrics


def mtp_train_step(head, opt_state, optimizer, embed_fn, features, tokens, positions, response,
                   target: TargetHead, *, steps: int = 1, decay: float = 0.8, chunk: int = 8192):
    """One optax update of the MTP head's params only (its own optimizer and clip); returns
    (head, opt_state, metrics named as the EAGLE-3 update's: draft_loss, draft_loss_s,
    draft_acc_s, draft_grad_norm)."""
    def loss_fn(params):
        return mtp_loss(head, params, embed_fn, features, tokens, positions, response, target,
                        steps=steps, decay=decay, chunk=chunk)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(head.params)
    updates, opt_state = optimizer.update(grads, opt_state, head.params)
    params = optax.apply_updates(head.params, updates)
    metrics = {k.replace("mtp_", "draft_"): v for k, v in metrics.items()}
    metrics["draft_grad_norm"] = optax.tree.norm(grads)
    return dataclasses.replace(head, params=params), opt_state, metrics
