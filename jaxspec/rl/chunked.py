"""Losses of the LM head fused with its matmul and computed in chunks, so that the float32
[B, T, V] logits never exist: at Qwen3-8B's vocabulary (151,936) and an RL batch of
512 x 5120 tokens they alone are 1.5 TB.

- `token_logprobs`: log p(target) under the sampling distribution the generator used, and
  that distribution's entropy. Without top-k/top-p ("unfiltered") it scans over vocabulary
  chunks with an online logsumexp; top-k/top-p need each row's whole distribution (their
  thresholds are found by bisection over it), so filtered rows are scanned in row chunks of
  the full vocabulary instead, each holding no more logits than a vocabulary chunk would.
- `soft_cross_entropy`: the EAGLE-3 TTT loss term, soft CE between the target's distribution
  over the draft vocabulary and the head's, both fused with their LM heads, over draft-vocab
  chunks. `argmax` finds the target's top token over the full vocabulary in chunks.

Every chunk body is under `jax.checkpoint`: the backward recomputes a chunk's logits instead
of storing them, so it never holds more than one chunk either. Maxima are stop-gradient
(logsumexp does not depend on the shift), so autodiff through the online recurrences gives
the exact gradients. `dense_logprobs` is the unchunked form (the reference, and the path
taken when the vocabulary fits in one chunk).

With the policy's `batch_invariant` mode every normaliser here is the generator's
(`kernels.invariant.log_normalizer`: exp(z - max) summed within fixed VOCAB_BLOCK blocks, then
over the blocks): the scan finds the row maximum first, then the block sums, in chunks of
whole blocks, so log-probs, entropies and draft losses are the same bits at any chunk size
and row count, and the log-probs are the generator's. Temperature 0 scores the unscaled,
unfiltered softmax, as the generator reports greedy tokens (docs/training.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import SamplingConfig, process_logits
from jaxspec.kernels.invariant import (COL_TILE, VOCAB_BLOCK, block_sums, invariant_dot, normalizer_from_blocks,
                                       tree_sum)
from jaxspec.models.config import matmul_precision

__all__ = ["accumulate_gradients", "argmax", "dense_logprobs", "join_rows", "lm_head", "soft_cross_entropy", "split_rows",
           "token_logprobs"]


def lm_head(policy) -> tuple[jax.Array, int]:
    """The policy's output projection and its vocabulary axis: embed_tokens [V, H] (tied,
    axis 0) or lm_head [H, V] (axis 1)."""
    if policy.config.tie_embeddings:
        return policy.params["embed_tokens"][...], 0
    return policy.params["lm_head"][...], 1


def _project(h, w, vocab_axis: int, invariant: bool):
    """h [..., H] @ w ([c, H] if vocab_axis == 0 else [H, c]) -> [..., c] float32, the
    same op as the policy's own `Transformer.logits`, at the same precision
    (`matmul_precision`: float32 weights never run as TF32)."""
    if invariant:
        return invariant_dot(h, w.T if vocab_axis == 0 else w, jnp.float32)
    spec = "...h,vh->...v" if vocab_axis == 0 else "...h,hv->...v"
    with matmul_precision(w.dtype):
        return jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)


def _weight_chunks(w, vocab_axis: int, chunk: int):
    """w split into [n, c, H] / [n, H, c] chunks along the vocabulary (zero-padded)."""
    v = w.shape[vocab_axis]
    n = -(-v // chunk)
    pad = [(0, 0), (0, 0)]
    pad[vocab_axis] = (0, n * chunk - v)
    w = jnp.pad(w, pad)
    if vocab_axis == 0:
        return w.reshape(n, chunk, w.shape[1])
    return w.reshape(w.shape[0], n, chunk).transpose(1, 0, 2)


def _temperature(sampling: SamplingConfig):
    """The divisor of the logits. Temperature 0 (greedy) scores the policy's unscaled,
    unfiltered softmax, the convention the generator reports greedy tokens under
    (`jaxspec.decoding.sampling.report_logprobs`; docs/training.md)."""
    t = jnp.asarray(sampling.temperature, jnp.float32)
    return jnp.where(t > 0, t, 1.0)


def dense_logprobs(
    logits,  # [..., V] any float dtype
    targets,  # [...] int32
    sampling: SamplingConfig,
    filtered: bool,
    invariant: bool = False,
):  # -> (log p(target) [...], entropy [...]) float32
    """log p(target) under the processed sampling distribution and its entropy, from whole
    logits. Differentiable: temperature scaling, then (when `filtered`, at temperature > 0)
    the kept set of `process_logits` as a constant mask. `invariant`: normalised by the
    generator's `log_normalizer` (bitwise its log-probs, any row count), else by
    `jax.nn.log_softmax`."""
    x = logits.astype(jnp.float32)
    z = (x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))) / _temperature(sampling)
    if filtered:
        greedy = jnp.asarray(sampling.temperature, jnp.float32) <= 0  # unfiltered (convention)
        kept = jnp.isfinite(jax.lax.stop_gradient(process_logits(x, sampling))) | greedy
        z = jnp.where(kept, z, -jnp.inf)
    if invariant:
        top = jax.lax.stop_gradient(jnp.max(z, axis=-1))
        e = jnp.exp(z - top[..., None])  # 0 outside the kept set
        log_z = normalizer_from_blocks(top, block_sums(e))
        zt = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
        ez = jnp.where(e > 0, e * (z - top[..., None]), 0.0)
        return zt - log_z, _entropy(log_z - top, block_sums(ez), block_sums(e))
    logp = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    p = jnp.exp(logp)
    # -inf outside the kept set: zeroed before the product, so its gradient is 0, not nan
    entropy = -jnp.sum(p * jnp.where(jnp.isfinite(logp), logp, 0.0), axis=-1)
    return lp, entropy


def _entropy(log_s, ez_sums, e_sums):
    """Entropy log S - sum(e z) / S of softmax(z) from the block sums of e = exp(z - top) and
    e (z - top), log_s = log S (the invariant paths' one formula, chunked or not)."""
    return log_s - tree_sum(ez_sums) / tree_sum(e_sums)


def _online_update(m, s, zs, z, valid):
    """One chunk of an online softmax: m [N] the running max (constant), s [N] = sum e^(z-m),
    zs [N] = sum e^(z-m) (z-m); z [N, c] float32, valid [c]. Returns the new (m, s, zs)."""
    m_new = jnp.maximum(m, jax.lax.stop_gradient(jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1)))
    delta = jnp.where(jnp.isfinite(m), m - m_new, 0.0)  # <= 0; 0 before the first chunk
    scale = jnp.exp(delta)
    d = z - m_new[:, None]
    e = jnp.where(valid, jnp.exp(jnp.where(valid, d, 0.0)), 0.0)
    s_new = s * scale + jnp.sum(e, axis=-1)
    zs_new = scale * (zs + delta * s) + jnp.sum(e * jnp.where(valid, d, 0.0), axis=-1)
    return m_new, s_new, zs_new


def _vocab_chunked(h, w, vocab_axis, targets, temperature, chunk):
    """(log p(target), entropy) [N] of softmax(h w / temperature), scanning vocab chunks."""
    v = w.shape[vocab_axis]
    chunks = _weight_chunks(w, vocab_axis, chunk)
    starts = jnp.arange(chunks.shape[0], dtype=jnp.int32) * chunk

    @jax.checkpoint
    def body(carry, xs):
        m, s, zs, z_target = carry
        wc, start = xs
        z = _project(h, wc, vocab_axis, False) / temperature  # [N, c]
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        z_target = z_target + jnp.sum(jnp.where(cols == targets[:, None], z, 0.0), axis=-1)
        return (*_online_update(m, s, zs, z, cols < v), z_target), None

    n = h.shape[0]
    init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)), jnp.zeros((n,)))
    (m, s, zs, z_target), _ = jax.lax.scan(body, init, (chunks, starts))
    log_s = jnp.log(s)
    return z_target - (m + log_s), log_s - zs / s


def _invariant_vocab_chunked(h, w, vocab_axis, targets, temperature, chunk):
    """`_vocab_chunked` with the generator's reduction (`log_normalizer`): a first scan finds
    each row's logit maximum (exact in any order), a second sums exp((x - max) / T) over
    vocabulary blocks; chunk is a multiple of COL_TILE (so of VOCAB_BLOCK), so the blocks, their sums and the
    tree over them are the same at any chunk size and the same as the whole row's."""
    v = w.shape[vocab_axis]
    chunks = _weight_chunks(w, vocab_axis, chunk)
    starts = jnp.arange(chunks.shape[0], dtype=jnp.int32) * chunk
    n = h.shape[0]

    def peak_body(m, xs):  # [N] running max of the logits (no gradient)
        wc, start = xs
        x = _project(jax.lax.stop_gradient(h), jax.lax.stop_gradient(wc), vocab_axis, True)
        valid = start + jnp.arange(chunk, dtype=jnp.int32) < v
        return jnp.maximum(m, jnp.max(jnp.where(valid, x, -jnp.inf), axis=-1)), None

    peak, _ = jax.lax.scan(peak_body, jnp.full((n,), -jnp.inf), (chunks, starts))
    peak = jax.lax.stop_gradient(peak)

    @jax.checkpoint
    def body(z_target, xs):
        wc, start = xs
        z = (_project(h, wc, vocab_axis, True) - peak[:, None]) / temperature  # [N, c], <= 0
        valid = start + jnp.arange(chunk, dtype=jnp.int32) < v
        e = jnp.where(valid, jnp.exp(jnp.where(valid, z, 0.0)), 0.0)  # the row max is exactly 0
        ez = jnp.where(e > 0, e * z, 0.0)
        at = targets - start
        here = (at >= 0) & (at < chunk)
        picked = jnp.take_along_axis(z, jnp.clip(at, 0, chunk - 1)[:, None], axis=1)[:, 0]
        return jnp.where(here, picked, z_target), (block_sums(e), block_sums(ez))

    z_target, (e_sums, ez_sums) = jax.lax.scan(body, jnp.zeros((n,)), (chunks, starts))
    e_sums, ez_sums = (jnp.moveaxis(x, 0, 1).reshape(n, -1) for x in (e_sums, ez_sums))
    log_z = normalizer_from_blocks(jnp.zeros((n,)), e_sums)  # the shift: max z = 0
    return z_target - log_z, _entropy(log_z, ez_sums, e_sums)


def _row_chunked(h, w, vocab_axis, targets, sampling, filtered, rows, invariant):
    """(log p(target), entropy) [N], `rows` rows at a time over the whole vocabulary."""
    n = h.shape[0]
    count = -(-n // rows)
    pad = count * rows - n
    hc = jnp.pad(h, ((0, pad), (0, 0))).reshape(count, rows, h.shape[1])
    tc = jnp.pad(targets, (0, pad)).reshape(count, rows)

    @jax.checkpoint
    def body(_, xs):
        logits = _project(xs[0], w, vocab_axis, invariant)  # [rows, V]
        return None, dense_logprobs(logits, xs[1], sampling, filtered, invariant)

    _, (lp, entropy) = jax.lax.scan(body, None, (hc, tc))
    return lp.reshape(-1)[:n], entropy.reshape(-1)[:n]


def token_logprobs(
    hidden,  # [..., H] final-normed hidden states
    weight,  # the LM head: [V, H] (vocab_axis 0) or [H, V] (vocab_axis 1)
    targets,  # [...] int32 token whose log-prob is wanted at each position
    sampling: SamplingConfig,
    *,
    vocab_axis: int,
    filtered: bool = False,
    chunk: int = 0,
    invariant: bool = False,
):  # -> (log p(target) [...], entropy [...]) float32
    """`dense_logprobs` of the logits hidden @ weight without materialising them when
    0 < chunk < V: unfiltered, in vocabulary chunks of `chunk`; filtered (top-k/top-p), in
    row chunks of at most rows x chunk logits (at least one row). chunk 0, or a vocabulary
    that fits in one chunk, computes the logits whole. `invariant` (the policy's
    batch_invariant mode): the batch-invariant matmul and the generator's log-normaliser,
    vocabulary chunks rounded up to a multiple of `COL_TILE` (whole tiles of that matmul and
    whole `VOCAB_BLOCK`s of the normaliser): the log-probs are the
    generator's bit for bit whatever `chunk` and the row count."""
    if vocab_axis not in (0, 1):
        raise ValueError(f"token_logprobs: vocab_axis={vocab_axis!r}; valid: 0 ([V, H]) or 1 "
                         f"([H, V])")
    if not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"token_logprobs: chunk={chunk!r}; valid: an int >= 0 (0: unchunked)")
    vocab = weight.shape[vocab_axis]
    if invariant and chunk:
        chunk = -(-chunk // COL_TILE) * COL_TILE
    if chunk == 0 or chunk >= vocab:
        logits = _project(hidden, weight, vocab_axis, invariant)
        return dense_logprobs(logits, targets.astype(jnp.int32), sampling, filtered, invariant)
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(jnp.int32)
    if filtered:
        rows = max(1, h.shape[0] * chunk // vocab)
        lp, entropy = _row_chunked(h, weight, vocab_axis, t, sampling, filtered, rows, invariant)
    elif invariant:
        lp, entropy = _invariant_vocab_chunked(h, weight, vocab_axis, t, _temperature(sampling),
                                               chunk)
    else:
        lp, entropy = _vocab_chunked(h, weight, vocab_axis, t, _temperature(sampling), chunk)
    return lp.reshape(lead), entropy.reshape(lead)


def argmax(
    hidden,  # [N, H]
    weight,  # [V, H] (vocab_axis 0) or [H, V] (vocab_axis 1)
    *,
    vocab_axis: int,
    chunk: int,
    invariant: bool = False,
):  # -> [N] int32: argmax of hidden @ weight (the first on ties), no gradient
    """The top token of every row over the whole vocabulary, `chunk` columns at a time."""
    hidden = jax.lax.stop_gradient(hidden)
    weight = jax.lax.stop_gradient(weight)
    vocab = weight.shape[vocab_axis]
    if chunk == 0 or chunk >= vocab:
        logits = _project(hidden, weight, vocab_axis, invariant)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    chunks = _weight_chunks(weight, vocab_axis, chunk)
    starts = jnp.arange(chunks.shape[0], dtype=jnp.int32) * chunk

    def body(carry, xs):
        best, index = carry
        wc, start = xs
        z = _project(hidden, wc, vocab_axis, invariant)
        z = jnp.where(start + jnp.arange(chunk) < vocab, z, -jnp.inf)
        top = jnp.max(z, axis=-1)
        better = top > best  # strict: an earlier chunk keeps a tie
        return (jnp.where(better, top, best),
                jnp.where(better, start + jnp.argmax(z, axis=-1).astype(jnp.int32), index)), None

    n = hidden.shape[0]
    init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,), jnp.int32))
    (_, index), _ = jax.lax.scan(body, init, (chunks, starts))
    return index


def soft_cross_entropy(
    target_hidden,  # [N, Ht] the target's final-normed hidden states (no gradient)
    target_weight,  # [Ht, Vd] the target's LM head restricted to the draft vocabulary
    draft_hidden,  # [N, Hd] the draft head's final-normed hidden states
    draft_weight,  # [Hd, Vd] the draft head's LM head
    *,
    chunk: int,
    invariant: bool = False,
):  # -> (CE [N] float32, agree [N] bool: the two argmaxes match)
    """-sum_v p(v) log q(v) with p = softmax(target_hidden @ target_weight) and q =
    softmax(draft_hidden @ draft_weight), over draft-vocab chunks (chunk 0: whole).
    `invariant` (the policy's batch_invariant mode): the target's batch-invariant matmul and
    the generator's reduction (`_invariant_soft_cross_entropy`), the same at any chunk."""
    target_hidden = jax.lax.stop_gradient(target_hidden)
    target_weight = jax.lax.stop_gradient(target_weight)
    vd = draft_weight.shape[1]
    if invariant:  # chunks of whole matmul tiles, at most the (tile-padded) vocabulary
        whole = -(-vd // COL_TILE) * COL_TILE
        chunk = min(-(-chunk // COL_TILE) * COL_TILE, whole) if chunk else whole
        return _invariant_soft_cross_entropy(target_hidden, target_weight, draft_hidden,
                                             draft_weight, chunk)
    chunk = vd if chunk == 0 or chunk >= vd else chunk
    tw = _weight_chunks(target_weight, 1, chunk)
    dw = _weight_chunks(draft_weight, 1, chunk)
    starts = jnp.arange(tw.shape[0], dtype=jnp.int32) * chunk

    @jax.checkpoint
    def body(carry, xs):
        mt, st, cross, mq, sq, best_t, arg_t, best_q, arg_q = carry
        twc, dwc, start = xs
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        valid = cols < vd
        zt = _project(target_hidden, twc, 1, False)
        zq = (draft_hidden @ dwc).astype(jnp.float32)  # as Eagle3Module.logits
        mt_new, st_new, _ = _online_update(mt, st, jnp.zeros_like(st), zt, valid)
        et = jnp.where(valid, jnp.exp(jnp.where(valid, zt - mt_new[:, None], 0.0)), 0.0)
        scale_t = jnp.exp(jnp.where(jnp.isfinite(mt), mt - mt_new, 0.0))
        cross = cross * scale_t + jnp.sum(et * jnp.where(valid, zq, 0.0), axis=-1)
        mq, sq, _ = _online_update(mq, sq, jnp.zeros_like(sq), zq, valid)
        out = [mt_new, st_new, cross, mq, sq]
        for best, arg, z in ((best_t, arg_t, zt), (best_q, arg_q, zq)):
            z = jax.lax.stop_gradient(jnp.where(valid, z, -jnp.inf))
            top = jnp.max(z, axis=-1)
            better = top > best
            out += [jnp.where(better, top, best),
                     jnp.where(better, start + jnp.argmax(z, axis=-1).astype(jnp.int32), arg)]
        return tuple(out), None

    n = draft_hidden.shape[0]
    neg = jnp.full((n,), -jnp.inf)
    zero = jnp.zeros((n,))
    index = jnp.zeros((n,), jnp.int32)
    init = (neg, zero, zero, neg, zero, neg, index, neg, index)
    (mt, st, cross, mq, sq, _, arg_t, _, arg_q), _ = jax.lax.scan(body, init, (tw, dw, starts))
    return mq + jnp.log(sq) - cross / st, arg_t == arg_q


def _invariant_soft_cross_entropy(target_hidden, target_weight, draft_hidden, draft_weight,
                                  chunk: int):
    """`soft_cross_entropy` reduced as `log_normalizer` reduces: a first scan finds both
    distributions' maxima and argmaxes (exact in any order), a second sums exp(z - max) and
    p's unnormalised weights times (zq - max) over VOCAB_BLOCK blocks (chunk a multiple of
    it), then a tree over the blocks: CE = log Sq - sum(et (zq - mq)) / St."""
    vd = draft_weight.shape[1]
    tw = _weight_chunks(target_weight, 1, chunk)
    dw = _weight_chunks(draft_weight, 1, chunk)
    starts = jnp.arange(tw.shape[0], dtype=jnp.int32) * chunk
    n = draft_hidden.shape[0]

    def logits(twc, dwc, hq):  # -> zt, zq [N, c] float32, both by the tiled matmul (chunk-free)
        return _project(target_hidden, twc, 1, True), invariant_dot(hq, dwc, jnp.float32)

    def peak_body(carry, xs):
        twc, dwc, start = xs
        valid = start + jnp.arange(chunk, dtype=jnp.int32) < vd
        out = []
        for (best, arg), z in zip((carry[:2], carry[2:]),
                                  logits(twc, dwc, jax.lax.stop_gradient(draft_hidden))):
            z = jnp.where(valid, z, -jnp.inf)
            top = jnp.max(z, axis=-1)
            better = top > best  # strict: an earlier chunk keeps a tie
            out += [jnp.where(better, top, best),
                    jnp.where(better, start + jnp.argmax(z, axis=-1).astype(jnp.int32), arg)]
        return tuple(out), None

    neg, index = jnp.full((n,), -jnp.inf), jnp.zeros((n,), jnp.int32)
    (mt, arg_t, mq, arg_q), _ = jax.lax.scan(peak_body, (neg, index, neg, index), (tw, dw, starts))
    mt, mq = jax.lax.stop_gradient(mt), jax.lax.stop_gradient(mq)

    @jax.checkpoint
    def body(_, xs):
        twc, dwc, start = xs
        valid = start + jnp.arange(chunk, dtype=jnp.int32) < vd
        zt, zq = logits(twc, dwc, draft_hidden)
        dq = jnp.where(valid, zq - mq[:, None], 0.0)
        et = jnp.where(valid, jnp.exp(jnp.where(valid, zt - mt[:, None], 0.0)), 0.0)
        eq = jnp.where(valid, jnp.exp(dq), 0.0)
        return None, (block_sums(et), block_sums(eq), block_sums(et * dq))

    _, sums = jax.lax.scan(body, None, (tw, dw, starts))
    st, sq, cross = (tree_sum(jnp.moveaxis(x, 0, 1).reshape(n, -1)) for x in sums)
    return jnp.log(sq) - cross / st, arg_t == arg_q


def split_rows(tree, micro: int):
    """Every leaf's leading axis B -> [B // micro, micro]; micro-batch j takes rows j, j + n,
    j + 2n, ... (n = B // micro), so a batch sharded in contiguous rows stays evenly sharded
    inside each micro-batch."""
    def split(x):
        return x.reshape((micro, x.shape[0] // micro) + x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, tree)


def join_rows(tree):
    """Inverse of split_rows."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape((-1,) + x.shape[2:]), tree)


def accumulate_gradients(grad_fn, params, parts):
    """The sum over micro-batches of grad_fn(part) -> (grads, metrics), a scan over the
    leading axis of `parts` accumulating in float32; returns (grads in the params' dtypes,
    metrics stacked [n])."""
    def body(total, part):
        grads, metrics = grad_fn(part)
        return jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads), metrics

    zeros = jax.tree.map(
        lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), params)
    total, metrics = jax.lax.scan(body, zeros, parts)
    return jax.tree.map(lambda g, x: g.astype(x.dtype), total, params), metrics
