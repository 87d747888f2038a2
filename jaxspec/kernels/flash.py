"""Causal self-attention without [heads, T, T] arrays: the training and scoring forward's.

A forward with no KV cache (the logprob stage, the policy update) attends each token to the
earlier tokens of its row that are not padding. Its mask is O(T): `CausalMask(valid)`,
query i sees key j iff j <= i and valid[j]. `causal_attention` is the one entry point;
implementations (ModelConfig.train_attention):

- ``chunked``: jnp on XLA, any platform. Query blocks (a scan) against the key blocks up to
  the diagonal (a loop), an online softmax in float32; the reverse pass (custom VJP)
  recomputes each block's probabilities from the saved log-sum-exp (the flash-attention
  backward: one pass for dq, one for dk/dv). The largest intermediate is a block's scores,
  [B, heads, block, block]. Any padding pattern.
- ``cudnn``: cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`,
  its forward and backward kernels), GPU only, bfloat16/float16. Its masks are causal plus
  per-row lengths, so each row's valid tokens must be one contiguous span (padding at
  either end, never between real tokens: what `Policy.forward` gets from the logprob
  stage's packing and from left-padded prompts); a row with a left pad is shifted to start
  at 0 for the call and back after.

Both match `tree_attention_reference` with the mask `tril & valid[None, :]` (no cache) on
every query that has a real token to see; padding queries are never read by a real token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.kernels.platform import platform

IMPLEMENTATIONS = ("auto", "reference", "chunked", "cudnn")
BLOCK = 128  # query and key tokens per block of the chunked path; the math does not depend on it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CausalMask:
    """The causal mask of a forward with no cache, in O(T): query i may attend to key j iff
    j <= i and valid[j]. What `Policy.forward(cache=None, mask=None)` hands its layers."""

    valid: jax.Array  # [B, T] bool: the token is real (its position is >= 0)

    def dense(self):  # -> [B, T, T] bool, as `models.cache.new_token_mask` builds it
        t = self.valid.shape[1]
        return jnp.tril(jnp.ones((t, t), bool))[None] & self.valid[:, None, :]


def resolve(implementation: str, dtype, platform_name: str | None = None) -> str:
    """The concrete implementation for a name (possibly "auto") and the inputs' dtype, or one
    ValueError naming the valid choices. "auto": cuDNN on a GPU for bfloat16/float16, else
    chunked (cuDNN's fused attention has no float32 kernel)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown train_attention {implementation!r}; valid: "
                         + ", ".join(repr(i) for i in IMPLEMENTATIONS))
    platform_name = platform() if platform_name is None else platform_name
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if implementation == "auto":
        return "cudnn" if platform_name == "gpu" and half else "chunked"
    if implementation == "cudnn" and (platform_name != "gpu" or not half):
        raise ValueError(
            f"train_attention 'cudnn' needs a GPU and bfloat16/float16 inputs; got platform "
            f"{platform_name!r}, dtype {jnp.dtype(dtype).name}; use 'chunked' (any platform, "
            "any dtype) or 'auto'")
    return implementation


def causal_attention(
    q,  # [batch, T, q_heads, head_dim]
    k,  # [batch, T, kv_heads, head_dim]
    v,  # [batch, T, kv_heads, head_dim]
    valid,  # [batch, T] bool: the token is real (keys that are not are never attended to)
    *,
    implementation: str = "auto",
    scale: float | None = None,
    block: int | None = None,
):  # -> [batch, T, q_heads, head_dim] in q's dtype
    """Causal GQA attention over the real tokens of each row, scores and softmax in float32;
    a query with no real key at or before it gets zeros (chunked; cuDNN: its own value).
    ``block`` (chunked only, static) never changes the math. "reference" is not taken here
    (it is tree_attention's dense mask: `Attention.attend`)."""
    b, t, hq, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"causal_attention: q {q.shape}, k {k.shape}, v {v.shape}: want "
                         "q [B,T,Hq,D] and k, v [B,T,Hkv,D] with Hkv dividing Hq")
    if valid.shape != (b, t):
        raise ValueError(f"causal_attention: valid has shape {valid.shape}, expected {(b, t)}")
    block = BLOCK if block is None else block
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"causal_attention: block={block!r} must be a positive int")
    name = resolve(implementation, q.dtype)
    scale = d**-0.5 if scale is None else float(scale)
    if name == "cudnn":
        return _cudnn(q, k, v, valid.astype(bool), scale)
    if name != "chunked":
        raise ValueError(f"causal_attention: implementation {name!r} is the caller's "
                         "(tree_attention over a dense mask); use 'chunked', 'cudnn' or 'auto'")
    blk = min(block, t)
    pad = -t % blk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    out = _chunked(q, k, v, valid.astype(bool), scale, blk)
    return out[:, :t]


# --------------------------------------------------------------------------- cuDNN


def _cudnn(q, k, v, valid, scale):
    """cuDNN's causal attention with per-row lengths; rows whose span starts later are shifted
    to 0 first (a gather), under a cond so that right-padded batches never pay for it."""
    t = valid.shape[1]
    count = jnp.sum(valid, axis=1).astype(jnp.int32)  # [B]
    start = jnp.where(count > 0, jnp.argmax(valid, axis=1), 0).astype(jnp.int32)  # [B]

    def attend(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn",
            query_seq_lengths=count, key_value_seq_lengths=count)

    def shifted(q, k, v):
        idx = jnp.arange(t, dtype=jnp.int32)[None, :]
        take = lambda x, at: jnp.take_along_axis(x, at[:, :, None, None], axis=1)
        src = (idx + start[:, None]) % t
        out = attend(take(q, src), take(k, src), take(v, src))
        return take(out, (idx - start[:, None]) % t)

    return jax.lax.cond(jnp.any(start > 0), shifted, attend, q, k, v)


# --------------------------------------------------------------------------- chunked


def _blocks(x, blk):  # [B, Tp, ...] -> [Tp / blk, B, blk, ...]
    b, tp = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, tp // blk, blk) + x.shape[2:]), 1, 0)


def _unblock(x):  # [n, B, blk, ...] -> [B, n * blk, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _block_scores(qb, kb, valid, i, j, blk, scale):
    """Scores of query block i against key block j and where they are allowed.

    qb [B, blk, hkv, g, d] f32, kb [B, blk, hkv, d]; -> s [B, hkv, g, blk_q, blk_k] f32,
    allowed [B, 1, 1, blk_q, blk_k] bool."""
    s = jnp.einsum("bnkgd,bskd->bkgns", qb, kb.astype(jnp.float32)) * scale
    qpos = i * blk + jnp.arange(blk)
    kpos = j * blk + jnp.arange(blk)
    key_ok = jax.lax.dynamic_slice_in_dim(valid, j * blk, blk, axis=1)  # [B, blk]
    allowed = (kpos[None, :] <= qpos[:, None])[None] & key_ok[:, None, :]
    return s, allowed[:, None, None]


def _forward(q, k, v, valid, scale, blk):
    """-> out [B, Tp, hq, d] (q's dtype), lse [n, B, hkv, g, blk] f32 (+inf: saw nothing)."""
    b, tp, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qs = _blocks(q.astype(jnp.float32).reshape(b, tp, hkv, g, d), blk)

    def query_block(_, xs):
        i, qb = xs

        def key_block(j, state):
            m, l, acc = state
            kb = jax.lax.dynamic_slice_in_dim(k, j * blk, blk, axis=1)
            vb = jax.lax.dynamic_slice_in_dim(v, j * blk, blk, axis=1).astype(jnp.float32)
            s, allowed = _block_scores(qb, kb, valid, i, j, blk, scale)
            s = jnp.where(allowed, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen (m == -inf)
            p = jnp.where(allowed, jnp.exp(s - m_safe[..., None]), 0.0)
            pv = jnp.einsum("bkgns,bskd->bkgnd", p, vb)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        state = (jnp.full((b, hkv, g, blk), -jnp.inf, jnp.float32),
                 jnp.zeros((b, hkv, g, blk), jnp.float32),
                 jnp.zeros((b, hkv, g, blk, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, state)  # key blocks to the diagonal
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]  # [B, hkv, g, blk, d]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return None, (jnp.moveaxis(out, 3, 1).reshape(b, blk, hq, d).astype(q.dtype), lse)

    n = tp // blk
    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(n), qs))
    return _unblock(out), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(q, k, v, valid, scale, blk):
    return _forward(q, k, v, valid, scale, blk)[0]


def _chunked_fwd(q, k, v, valid, scale, blk):
    out, lse = _forward(q, k, v, valid, scale, blk)
    return out, (q, k, v, valid, out, lse)


def _chunked_bwd(scale, blk, residuals, dout):
    q, k, v, valid, out, lse = residuals
    b, tp, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    n = tp // blk
    f32 = jnp.float32
    shape = (b, tp, hkv, g, d)
    qs = _blocks(q.astype(f32).reshape(shape), blk)  # [n, B, blk, hkv, g, d]
    dos = _blocks(dout.astype(f32).reshape(shape), blk)
    # delta_i = sum_d dout * out: the softmax's backward term per query
    delta = _blocks(jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1).reshape(b, tp, hkv, g),
                    blk)  # [n, B, blk, hkv, g]
    delta = jnp.moveaxis(delta, 2, -1)  # [n, B, hkv, g, blk]

    def probs(i, j, qb, kb, lse_i):  # -> p [B, hkv, g, blk_q, blk_k] f32 (0 where masked)
        s, allowed = _block_scores(qb, kb, valid, i, j, blk, scale)
        return jnp.where(allowed, jnp.exp(jnp.where(allowed, s, 0.0) - lse_i[..., None]), 0.0)

    def ds_of(p, dob, vb, delta_i):  # the scores' cotangent
        dp = jnp.einsum("bnkgd,bskd->bkgns", dob, vb)
        return p * (dp - delta_i[..., None])

    def dq_block(_, xs):  # one query block against the key blocks up to the diagonal
        i, qb, dob, lse_i, delta_i = xs

        def key_block(j, dq):
            kb = jax.lax.dynamic_slice_in_dim(k, j * blk, blk, axis=1).astype(f32)
            vb = jax.lax.dynamic_slice_in_dim(v, j * blk, blk, axis=1).astype(f32)
            ds = ds_of(probs(i, j, qb, kb, lse_i), dob, vb, delta_i)
            return dq + jnp.einsum("bkgns,bskd->bnkgd", ds, kb) * scale

        dq = jax.lax.fori_loop(0, i + 1, key_block, jnp.zeros((b, blk, hkv, g, d), f32))
        return None, dq

    def dkv_block(_, xs):  # one key block against the query blocks from the diagonal on
        j, kb, vb = xs
        kb, vb = kb.astype(f32), vb.astype(f32)

        def query_block(i, dkv):
            dk, dv = dkv
            qb, dob = qs[i], dos[i]
            p = probs(i, j, qb, kb, lse[i])
            ds = ds_of(p, dob, vb, delta[i])
            dv = dv + jnp.einsum("bkgns,bnkgd->bskd", p, dob)
            dk = dk + jnp.einsum("bkgns,bnkgd->bskd", ds, qb) * scale
            return dk, dv

        zeros = jnp.zeros((b, blk, hkv, d), f32)
        return None, jax.lax.fori_loop(j, n, query_block, (zeros, zeros))

    _, dq = jax.lax.scan(dq_block, None, (jnp.arange(n), qs, dos, lse, delta))
    _, (dk, dv) = jax.lax.scan(dkv_block, None, (jnp.arange(n), _blocks(k, blk), _blocks(v, blk)))
    dq = _unblock(dq).reshape(q.shape).astype(q.dtype)
    return dq, _unblock(dk).astype(k.dtype), _unblock(dv).astype(v.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


__all__ = ["BLOCK", "IMPLEMENTATIONS", "CausalMask", "causal_attention", "resolve"]
