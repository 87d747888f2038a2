"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (Yang, Kautz and
Hatamizadeh, "Gated Delta Networks", 2024), in two forms that compute the same function:

- `delta_rule_recurrent`: one token at a time, the form a decode step runs;
- `delta_rule_chunked`: chunks of C tokens, each a few matrix products plus one triangular
  solve, the state carried across chunks: the form prefill and training run.

Per value head the state S [dk, dv] evolves, for a token with key k (L2-normed), value v,
query q (L2-normed, times dk^-1/2), decay g <= 0 (log space) and rate beta in (0, 1), as

    S' = exp(g) S;   S_new = S' + k (beta (v - S'^T k))^T;   out = S_new^T q.

Within a chunk with cumulative log-decays c_i = g_1 + ... + g_i and start state S_0, the
corrections u_i = beta_i (v_i - S'_i^T k_i) satisfy (I + A) U = beta V - (beta exp(c) K) S_0
with A_ij = beta_i exp(c_i - c_j) k_i . k_j for j < i, so one unit-lower triangular solve
gives them all; then out_i = exp(c_i) S_0^T q_i + sum_{j <= i} exp(c_i - c_j) (q_i . k_j) u_j
and S_C = exp(c_C) S_0 + sum_j exp(c_C - c_j) k_j u_j^T. Everything runs in float32.

`causal_conv` is the short depthwise causal convolution before the rule, with the state a
decode carries: the last kernel-1 inputs of each row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.kernels.invariant import tree_sum, uncontracted

__all__ = ["causal_conv", "chunk_cumsum", "delta_rule_chunked", "delta_rule_invariant",
           "delta_rule_recurrent", "l2_normalize", "CHUNK"]

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)

# The rule's products run in full float32 whatever precision the caller's context sets (a
# bfloat16 policy, `DeltaSteps.commit` outside the forward): JAX's default rounds float32
# operands to TF32 on a GPU, and the two forms would then drift apart (speculative rollouts
# replay the recurrent one against the chunked one's prefill state).
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
_matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)


def l2_normalize(x, eps: float = 1e-6, invariant: bool = False):  # [..., d] -> [..., d]
    """FLA's l2norm: x rsqrt(|x|^2 + eps); `invariant` (ModelConfig.batch_invariant): the
    squares summed by `tree_sum`, one association whatever the shape."""
    x = x.astype(jnp.float32)
    squares = tree_sum(x * x)[..., None] if invariant else jnp.sum(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(squares + eps)


def _two_sum(a, b):  # -> (s, e): s = fl(a + b) and its rounding error, a + b = s + e exactly
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


def chunk_cumsum(g):  # [..., C] -> [..., C]: prefix sums, each rounded once to float32
    """Prefix sums of the log decays as transformers' CPU `cumsum` gives them (it accumulates
    float32 in float64): a float32 running sum drifts by an ulp of the sum per step, and the
    chunked rule's decays exp(c_i - c_j) take that drift as a relative error (c reaches
    -1000 in a chunk of strong decay, an ulp 6e-5). Each sum is carried as a float32
    (value, rounding error) pair (Knuth's two-sum) and rounded once at the end."""
    def add(x, y):
        s, e = _two_sum(x[0], y[0])
        e = e + (x[1] + y[1])
        hi = s + e
        return hi, e - (hi - s)

    g = g.astype(jnp.float32)
    hi, lo = jax.lax.associative_scan(add, (g, jnp.zeros_like(g)), axis=-1)
    return hi + lo


def _expand_heads(q, k, num_v_heads):  # [B, T, Hk, dk] -> [B, T, Hv, dk]: a key head serves
    # num_v_heads // Hk consecutive value heads
    rep = num_v_heads // q.shape[2]
    if rep == 1:
        return q, k
    return jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)


UNROLL_TOKENS = 16  # the recurrent rule over at most this many tokens runs without a loop


def delta_rule_recurrent(
    q,  # [B, T, Hk, dk] L2-normed and scaled
    k,  # [B, T, Hk, dk] L2-normed
    v,  # [B, T, Hv, dv]
    g,  # [B, T, Hv] log decay (<= 0); 0 with beta 0 leaves the state as it was
    beta,  # [B, T, Hv]
    state,  # [B, Hv, dk, dv] float32
):  # -> (out [B, T, Hv, dv] float32, state [B, Hv, dk, dv] float32)
    """The gated delta rule token by token (a `lax.scan` over T)."""
    from jaxspec.kernels.platform import platform  # (jaxspec.kernels imports the models)

    q, k = _expand_heads(q, k, v.shape[2])
    f32 = jnp.float32
    as_matmul = platform() == "cpu"

    def step(s, xs):
        # S' = d S + k (x) c with c = beta (v - d S^T k), and the output S'^T q = d S^T q +
        # (k . q) c: both products from one read of S, which is then read and written once
        # (the state is the decode step's largest operand: three passes over it, not five)
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, dk], [B, Hv, dk], [B, Hv, dv], [B, Hv], [B, Hv]
        decay = jnp.exp(g_t)[..., None]  # [B, Hv, 1]
        kq = jnp.stack([k_t, q_t], axis=2)  # [B, Hv, 2, dk]
        if as_matmul:  # (CPU) XLA's CPU reduction over dk ran this step 8x slower at the
            # configs/hybrid.yaml shape (294 vs 36 us for a 4-token verify's rule)
            both = _einsum("bhkv,bhck->bhcv", s, kq)
        else:  # a reduction, not a matmul: a GPU's XLA fuses the read of a layer's state
            # from the stacked cache into it (a matmul's operand is a copy of the slice first)
            both = jnp.sum(s[:, :, None] * kq[..., None], axis=3)  # [B, Hv, 2, dv]
        correction = b_t[..., None] * (v_t - decay * both[:, :, 0])
        out = decay * both[:, :, 1] + jnp.sum(k_t * q_t, axis=-1)[..., None] * correction
        return s * decay[..., None] + k_t[..., :, None] * correction[..., None, :], out

    xs = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (q, k, v, g, beta))
    state, out = _over_tokens(step, state.astype(f32), xs)
    return out, state


def _over_tokens(step, state, xs):  # xs: [T, B, ...] each -> (state, out [B, T, ...])
    """`step` over the tokens: a `lax.scan` past UNROLL_TOKENS, else unrolled (a decode's or
    a verify's few tokens without a loop: a loop takes a copy of the state)."""
    if xs[0].shape[0] > UNROLL_TOKENS:
        state, out = jax.lax.scan(step, state, xs)
        return state, jnp.moveaxis(out, 0, 1)
    outs = []
    for t in range(xs[0].shape[0]):
        state, o = step(state, tuple(a[t] for a in xs))
        outs.append(o)
    return state, jnp.stack(outs, axis=1)


def delta_rule_invariant(
    q,  # [B, T, Hk, dk] L2-normed and scaled
    k,  # [B, T, Hk, dk] L2-normed
    v,  # [B, T, Hv, dv]
    g,  # [B, T, Hv] log decay (<= 0); 0 with beta 0 leaves the state as it was
    beta,  # [B, T, Hv]
    state,  # [B, Hv, dk, dv] float32
):  # -> (out [B, T, Hv, dv] float32, state [B, Hv, dk, dv] float32)
    """The recurrent rule of the batch-invariant forward (ModelConfig.batch_invariant): its
    steps as `delta_rule_recurrent`'s, every sum over dk a `tree_sum` and every product
    `uncontracted` (no dot, no FMA), so a row's bits depend on its own tokens only: not on
    the batch, the token count, nor whether the steps are unrolled (<= UNROLL_TOKENS) or
    scanned. Prefill, decode, verify, the pending tokens' commit and the training forward
    all run it (chunked and recurrent forms round differently)."""
    q, k = _expand_heads(q, k, v.shape[2])

    def step(s, xs):  # s [B, Hv, dv, dk]: the state transposed, dk last for tree_sum
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, dk], [B, Hv, dk], [B, Hv, dv], [B, Hv], [B, Hv]
        decay = jnp.exp(g_t)[..., None]  # [B, Hv, 1]
        read_k = tree_sum(s * k_t[:, :, None, :])  # S^T k [B, Hv, dv]
        read_q = tree_sum(s * q_t[:, :, None, :])  # S^T q
        correction = b_t[..., None] * (v_t - uncontracted(decay * read_k))
        kq = tree_sum(k_t * q_t)[..., None]
        out = uncontracted(decay * read_q) + uncontracted(kq * correction)
        s = (uncontracted(s * decay[..., None])
             + uncontracted(correction[..., :, None] * k_t[:, :, None, :]))
        return s, out

    # the inputs `uncontracted` too: a caller's product (v = silu(conv) = conv sigmoid(conv))
    # fused into the step would otherwise meet its subtraction as one FMA in some programs
    xs = tuple(jnp.moveaxis(uncontracted(a.astype(jnp.float32)), 1, 0)
               for a in (q, k, v, g, beta))
    s, out = _over_tokens(step, jnp.swapaxes(state.astype(jnp.float32), -1, -2), xs)
    return out, jnp.swapaxes(s, -1, -2)


def delta_rule_chunked(
    q,  # [B, T, Hk, dk] L2-normed and scaled
    k,  # [B, T, Hk, dk] L2-normed
    v,  # [B, T, Hv, dv]
    g,  # [B, T, Hv] log decay (<= 0)
    beta,  # [B, T, Hv]
    state,  # [B, Hv, dk, dv] float32
    chunk: int = CHUNK,
):  # -> (out [B, T, Hv, dv] float32, state [B, Hv, dk, dv] float32)
    """The gated delta rule over chunks of `chunk` tokens (see the module docstring); T is
    padded to whole chunks with tokens that leave the state unchanged (g = 0, beta = 0)."""
    q, k = _expand_heads(q, k, v.shape[2])
    f32 = jnp.float32
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = min(chunk, t)
    pad = -t % c
    n = (t + pad) // c

    def chunks(a):  # [B, T, Hv, ...] -> [N, B, Hv, C, ...]
        a = jnp.pad(a.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((b, n, c) + a.shape[2:])
        return jnp.swapaxes(jnp.moveaxis(a, 1, 0), 2, 3)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))  # g, beta: [N, B, Hv, C]
    cum = chunk_cumsum(g)  # [N, B, Hv, C]
    lower = jnp.tril(jnp.ones((c, c), bool))  # j <= i
    strict = jnp.tril(jnp.ones((c, c), bool), -1)  # j < i
    gap = cum[..., :, None] - cum[..., None, :]  # c_i - c_j
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gap, 0.0)), 0.0)  # [N, B, Hv, C, C]
    kk = _einsum("...ik,...jk->...ij", k, k)
    system = jnp.eye(c, dtype=f32) + jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(cum))[..., None] * k], axis=-1)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,
                                             unit_diagonal=True)
    u_free, w = solved[..., :dv], solved[..., dv:]  # U = u_free - w S_0
    qk = _einsum("...ik,...jk->...ij", q, k) * decay
    q_decayed = jnp.exp(cum)[..., None] * q
    k_to_end = jnp.exp(cum[..., -1:] - cum)[..., None] * k
    end_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, B, Hv, 1, 1]

    def step(s, xs):
        u_free, w, q_decayed, qk, k_to_end, end_decay = xs
        u = u_free - _matmul(w, s)  # [B, Hv, C, dv]
        out = _matmul(q_decayed, s) + _matmul(qk, u)
        s = end_decay * s + _matmul(jnp.swapaxes(k_to_end, -1, -2), u)
        return s, out

    state, out = jax.lax.scan(step, state.astype(f32),
                              (u_free, w, q_decayed, qk, k_to_end, end_decay))
    out = jnp.moveaxis(out, 0, 1)  # [B, N, Hv, C, dv]
    out = jnp.swapaxes(out, 2, 3).reshape(b, n * c, h, dv)
    return out[:, :t], state


def causal_conv(
    x,  # [B, T, C] each row's real inputs first (`counts[b]` of them), then padding
    conv_state,  # [B, C, K-1] the row's previous K-1 inputs, oldest first
    weight,  # [C, K] depthwise taps, the last one on the current input
    counts,  # [B] int32: real inputs per row
    invariant: bool = False,
):  # -> (out [B, T, C] float32 before the activation, conv_state [B, C, K-1])
    """Depthwise causal convolution over [previous inputs; x], and the state a later call
    goes on from: the last K-1 real inputs (padding never enters it). `invariant`
    (ModelConfig.batch_invariant): each tap's product `uncontracted` (no FMA)."""
    kernel = weight.shape[1]
    t = x.shape[1]
    window = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)
    w = weight.astype(jnp.float32)
    taps = [window[:, j:j + t].astype(jnp.float32) * w[:, j] for j in range(kernel)]
    out = sum(uncontracted(tap) for tap in taps) if invariant else sum(taps)
    keep = counts[:, None] + jnp.arange(kernel - 1)[None, :]  # [B, K-1] into the window
    new_state = jnp.take_along_axis(window, keep[:, :, None], axis=1)  # [B, K-1, C]
    return out, jnp.swapaxes(new_state, 1, 2).astype(conv_state.dtype)
