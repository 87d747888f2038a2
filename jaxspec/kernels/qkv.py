"""A decoder layer's attention inputs in one Pallas kernel: RMSNorm, the q/k/v projections,
QK-norm and RoPE.

XLA runs these as a norm pass that writes the normed input, one merged matmul that writes
q, k and v side by side, a QK-norm pass per projection that writes the normed heads, and a
RoPE pass that writes them again (plus a copy of v out of the merged output for any
consumer that needs it contiguous). At a Qwen3-8B verify of 1,024 tokens that is ~55 MB
per layer beyond the weights. Here one program computes one head of one block of tokens:
it walks the hidden dimension in blocks, normalising each input block on the fly (the row
statistics come in, computed by XLA in one small reduction), accumulates the head's two
halves in float32, and in the epilogue applies QK-norm over the head and RoPE (rotate-half:
the halves are two accumulators, so no in-register shuffle), then writes q, or k beside v
(the layout the attention kernel and the cache write read).

Grid: (token blocks, q heads + 2 kv heads): program (i, j) computes q head j, k head
j - q_heads, or v head j - q_heads - kv_heads. Triton lowering on a GPU, `interpret=True`
elsewhere (tests). Every elementwise step rounds to the parameter dtype where XLA rounds
the unfused layer (`qkv_reference`, written with the model's own operations), so
interpreted the kernel equals the unfused layer whenever the matmuls do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.kernels.matmul import backward_precision, dot, token_block
from jaxspec.kernels.platform import fused_kernel_applies
from jaxspec.kernels.split_kv import check_block

BLOCK_M, BLOCK_K = 64, 64  # tokens x hidden per step; the columns are one head
NUM_WARPS, NUM_STAGES = 4, 3


def fits(tokens: int, hidden: int, head_dim: int, *, block_m: int = BLOCK_M,
         block_k: int = BLOCK_K) -> bool:
    """Whether `qkv_pallas` takes these sizes: tokens a multiple of 16 (the token block is
    halved until it divides them), hidden a multiple of block_k, head_dim / 2 a power of two
    >= 16 (each half is a tile)."""
    half = head_dim // 2
    return (tokens >= 16 and tokens % 16 == 0 and hidden % block_k == 0 and head_dim % 2 == 0
            and half >= 16 and half & (half - 1) == 0)


def use_fused(kernel: str, tokens: int, hidden: int, head_dim: int) -> bool:
    """Whether a layer computes its attention inputs with `qkv` for ModelConfig.fused_kernels
    `kernel`, as kernels.swiglu.use_fused decides for the MLP."""
    return fused_kernel_applies(kernel, fits(tokens, hidden, head_dim))


def _kernel(x_ref, inv_ref, ln_ref, wq_ref, wk_ref, wv_ref, qs_ref, ks_ref, cos_ref, sin_ref,
            q_ref, kv_ref, *, q_heads: int, kv_heads: int, block_k: int, k_steps: int,
            eps: float, qk_norm: bool):
    j = pl.program_id(1)
    dtype = q_ref.dtype
    f32 = jnp.float32

    def rnd(v):  # one operation's result in the parameter dtype, as XLA stores it
        return v.astype(dtype).astype(f32)

    rows = x_ref.shape[0]
    half = wq_ref.shape[1] // 2
    inv = inv_ref[...]  # [rows] float32: rsqrt(mean(x^2) + eps) of the input norm

    def project(w_ref):  # -> the head's halves [rows, half] float32, rounded as stored
        def step(i, acc):
            lo, hi = acc
            ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            x = x_ref[:, ks].astype(f32)
            normed = rnd(rnd(x * inv[:, None]) * ln_ref[ks].astype(f32)[None, :]).astype(dtype)
            return (lo + dot(normed, w_ref[ks, pl.ds(0, half)]),
                    hi + dot(normed, w_ref[ks, pl.ds(half, half)]))

        zeros = jnp.zeros((rows, half), f32)
        lo, hi = lax.fori_loop(0, k_steps, step, (zeros, zeros))
        return rnd(lo), rnd(hi)

    def rotate(lo, hi, scale_ref):  # QK-norm over the head, then RoPE (rotate-half)
        if qk_norm:
            var = (jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1)) / (2 * half)
            r = lax.rsqrt(var + eps)[:, None]
            lo = rnd(scale_ref[pl.ds(0, half)].astype(f32)[None, :] * rnd(lo * r))
            hi = rnd(scale_ref[pl.ds(half, half)].astype(f32)[None, :] * rnd(hi * r))
        cos_lo, cos_hi = cos_ref[:, pl.ds(0, half)].astype(f32), cos_ref[:, pl.ds(half, half)].astype(f32)
        sin_lo, sin_hi = sin_ref[:, pl.ds(0, half)].astype(f32), sin_ref[:, pl.ds(half, half)].astype(f32)
        out_lo = rnd(rnd(lo * cos_lo) + rnd(-hi * sin_lo))
        out_hi = rnd(rnd(hi * cos_hi) + rnd(lo * sin_hi))
        return out_lo.astype(dtype), out_hi.astype(dtype)

    @pl.when(j < q_heads)
    def _():
        lo, hi = rotate(*project(wq_ref), qs_ref)
        q_ref[:, pl.ds(0, half)] = lo
        q_ref[:, pl.ds(half, half)] = hi

    @pl.when((j >= q_heads) & (j < q_heads + kv_heads))
    def _():
        lo, hi = rotate(*project(wk_ref), ks_ref)
        kv_ref[:, pl.ds(0, half)] = lo
        kv_ref[:, pl.ds(half, half)] = hi

    @pl.when(j >= q_heads + kv_heads)
    def _():
        lo, hi = project(wv_ref)
        kv_ref[:, pl.ds(0, half)] = lo.astype(dtype)
        kv_ref[:, pl.ds(half, half)] = hi.astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def qkv_pallas(
    x,  # [tokens, hidden]: the residual stream (the layer's input, before its norm)
    inv_rms,  # [tokens] float32: rsqrt(mean(x^2) + norm eps), the input norm's statistics
    ln_scale,  # [hidden]: the input norm's scale
    wq,  # [hidden, q_heads, head_dim]
    wk,  # [hidden, kv_heads, head_dim]
    wv,  # [hidden, kv_heads, head_dim]
    q_scale,  # [head_dim] QK-norm scales, or None (no QK-norm)
    k_scale,  # [head_dim] or None
    cos,  # [tokens, head_dim] RoPE cos per token, in x's dtype (layers.rope_tables)
    sin,  # [tokens, head_dim]
    *,
    eps: float = 1e-6,  # the QK-norm's
    block_m: int = BLOCK_M,
    block_k: int = BLOCK_K,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool = False,
):  # -> q [tokens, q_heads, head_dim], kv [tokens, 2, kv_heads, head_dim] (k, then v)
    """The attention inputs of a layer from its input: norm, projections, QK-norm, RoPE
    (module docstring). Sizes must satisfy `fits`."""
    check_block("block_m", block_m)
    check_block("block_k", block_k)
    m, h = x.shape
    _, hq, d = wq.shape
    hkv = wk.shape[1]
    if wk.shape != (h, hkv, d) or wv.shape != (h, hkv, d) or wq.shape[0] != h:
        raise ValueError(f"qkv_pallas: x {x.shape}, wq {wq.shape}, wk {wk.shape}, wv "
                         f"{wv.shape} do not chain ([tokens, hidden] @ [hidden, heads, dim])")
    if not fits(m, h, d, block_m=block_m, block_k=block_k):
        raise ValueError(f"qkv_pallas: tokens {m}, hidden {h}, head_dim {d} are not whole tiles "
                         f"(tokens a multiple of 16, hidden of block_k={block_k}, head_dim / 2 a "
                         "power of two >= 16)")
    qk_norm = q_scale is not None
    if qk_norm != (k_scale is not None):
        raise ValueError("qkv_pallas: q_scale and k_scale are both given (QK-norm) or both None")
    if not qk_norm:  # unused operands, so that the kernel's signature is one
        q_scale = k_scale = jnp.ones((d,), x.dtype)
    bm = token_block(m, block_m)
    kernel = functools.partial(_kernel, q_heads=hq, kv_heads=hkv, block_k=block_k,
                               k_steps=h // block_k, eps=float(eps), qk_norm=qk_norm)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    def q_col(j):  # the q head this program writes (clamped: k and v programs write none)
        return jnp.minimum(j, hq - 1)

    def kv_col(j):  # [k heads | v heads] as columns of the kv output
        return jnp.clip(j - hq, 0, 2 * hkv - 1)

    q, kv = pl.pallas_call(
        kernel,
        grid=(m // bm, hq + 2 * hkv),
        in_specs=[
            pl.BlockSpec((bm, h), lambda i, j: (i, 0)),
            pl.BlockSpec((bm,), lambda i, j: (i,)),
            pl.BlockSpec((h,), lambda i, j: (0,)),
            pl.BlockSpec((h, d), lambda i, j: (0, q_col(j))),
            pl.BlockSpec((h, d), lambda i, j: (0, jnp.clip(j - hq, 0, hkv - 1))),
            pl.BlockSpec((h, d), lambda i, j: (0, jnp.clip(j - hq - hkv, 0, hkv - 1))),
            pl.BlockSpec((d,), lambda i, j: (0,)),
            pl.BlockSpec((d,), lambda i, j: (0,)),
            pl.BlockSpec((bm, d), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, d), lambda i, j: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((bm, d), lambda i, j: (i, q_col(j))),
            pl.BlockSpec((bm, d), lambda i, j: (i, kv_col(j))),
        ],
        out_shape=[jax.ShapeDtypeStruct((m, hq * d), x.dtype),
                   jax.ShapeDtypeStruct((m, 2 * hkv * d), x.dtype)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="qkv",
    )(x, inv_rms.astype(jnp.float32), ln_scale, wq.reshape(h, hq * d), wk.reshape(h, hkv * d),
      wv.reshape(h, hkv * d), q_scale, k_scale, cos, sin)
    return q.reshape(m, hq, d), kv.reshape(m, 2, hkv, d)


def _rms_scale(x, inv, scale):  # RMSNorm's scaling step in x's dtype (layers.RMSNorm)
    return scale * (x.astype(jnp.float32) * inv).astype(x.dtype)


def qkv_reference(x, inv_rms, ln_scale, wq, wk, wv, q_scale, k_scale, cos, sin, eps=1e-6):
    """The same function by XLA (the backward of the fused kernel): the model's operations
    (layers.RMSNorm, the projections' einsums, QK-norm, layers.apply_rope) in its order."""
    h = _rms_scale(x, inv_rms[:, None], ln_scale)
    q = jnp.einsum("tf,fnd->tnd", h, wq)
    k = jnp.einsum("tf,fnd->tnd", h, wk)
    v = jnp.einsum("tf,fnd->tnd", h, wv)

    def qk_norm(y, scale):
        y32 = y.astype(jnp.float32)
        var = jnp.mean(jnp.square(y32), axis=-1, keepdims=True)
        return _rms_scale(y, lax.rsqrt(var + eps), scale)

    def rope(y):
        half = y.shape[-1] // 2
        rotated = jnp.concatenate([-y[..., half:], y[..., :half]], axis=-1)
        return y * cos[:, None] + rotated * sin[:, None]

    if q_scale is not None:
        q, k = qk_norm(q, q_scale), qk_norm(k, k_scale)
    return rope(q), jnp.stack([rope(k), v], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def qkv(x, inv_rms, ln_scale, wq, wk, wv, q_scale, k_scale, cos, sin, eps=1e-6,
        interpret=False):
    """`qkv_pallas`, differentiable: the backward is `qkv_reference`'s."""
    return qkv_pallas(x, inv_rms, ln_scale, wq, wk, wv, q_scale, k_scale, cos, sin, eps=eps,
                      interpret=interpret)


def _qkv_fwd(x, inv_rms, ln_scale, wq, wk, wv, q_scale, k_scale, cos, sin, eps, interpret):
    out = qkv_pallas(x, inv_rms, ln_scale, wq, wk, wv, q_scale, k_scale, cos, sin, eps=eps,
                     interpret=interpret)
    return out, (x, inv_rms, ln_scale, wq, wk, wv, q_scale, k_scale, cos, sin)


def _qkv_bwd(eps, interpret, residuals, g):
    with backward_precision(residuals[0].dtype):
        _, vjp = jax.vjp(functools.partial(qkv_reference, eps=eps), *residuals)
        return vjp(g)


qkv.defvjp(_qkv_fwd, _qkv_bwd)
