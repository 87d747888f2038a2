"""The gated delta rule over a few tokens (a decode step, a verify) as one Pallas kernel that
reads a layer's recurrent state from the stacked [layers, B, Hv, dk, dv] states in place
once, applies the row's pending tokens (the accepted ones of its last verify, kept in the
cache: jaxspec.models.hybrid.HybridCache.pending) and then the new ones on chip, and writes
the state back into the stack in place (after all tokens, or after the pending ones for a
verify): the state is a decode step's largest operand (134 MB per layer at a
9B Qwen3.5 shape and batch 64), and XLA's fusions pass over it three times per token and
copy its slice out of the stack first (docs/results/hybrid_programs.json).

Per token, as `jaxspec.models.gated_deltanet.delta_rule_recurrent` computes it: with d =
exp(g), c = beta (v - d S^T k), the output d S^T q + (k . q) c and S <- d S + k (x) c. One
program per (row, value head, block of `block_v` value columns): the columns of S are
independent, so each program holds a [dk, block_v] tile. A token with g = 0 and beta = 0 is
the identity on S bit for bit (S * 1 + k * 0); the wrapper pads the tokens to a power of
two with such steps (Triton's blocks are powers of two). Triton lowering on a GPU,
`interpret=True` elsewhere (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["BLOCK_V", "MAX_TOKENS", "recurrent_stacked", "stacked_rule"]

BLOCK_V = 32  # value columns per program; untimed on a GPU
NUM_WARPS, NUM_STAGES = 4, 1
MAX_TOKENS = 16  # the forwards it serves: a decode step, a verify of k + 1 <= 16


def stacked_rule(
    tokens: int,
    stack,  # [L, B, Hv, dk, dv] the layers' states (the forward's cache)
    recurrent: bool,  # the forward runs the recurrent form (a verify)
) -> bool:
    """Whether a forward of `tokens` tokens runs the rule through `recurrent_stacked`: a
    forward built for a GPU (kernels.platform) on at most one device (XLA cannot partition
    the kernel's custom call), with a cache (batch > 0) whose value width BLOCK_V divides,
    running the recurrent form (one token, or `recurrent`) over at most MAX_TOKENS tokens.
    Every recurrent use on such a GPU goes through it (decode, verify, the pending tokens
    either applies first), so a decode step and a verify of the same tokens do the same
    arithmetic."""
    from jaxspec.kernels.platform import platform

    mesh = jax.sharding.get_abstract_mesh()
    return (platform() == "gpu" and (mesh.empty or mesh.size == 1) and stack.shape[1] > 0
            and stack.shape[-1] % BLOCK_V == 0 and (tokens == 1 or recurrent)
            and tokens <= MAX_TOKENS)


def _kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *refs, tokens: int, pending: int,
            rep: int, block_v: int, write: str | None):
    if pending:
        count_ref, pq_ref, pk_ref, pv_ref, pg_ref, pb_ref, s_ref, o_ref, *s_out = refs
    else:
        s_ref, o_ref, *s_out = refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    cols = pl.ds(j * block_v, block_v)
    s = s_ref[layer, b, h, :, cols]  # [dk, block_v] float32

    def step(s, q_t, k_t, v_t, g_t, b_t):
        decay = jnp.exp(g_t)
        sk = jnp.sum(s * k_t[:, None], axis=0)  # [block_v]
        sq = jnp.sum(s * q_t[:, None], axis=0)
        c = b_t * (v_t - decay * sk)
        return s * decay + k_t[:, None] * c[None, :], decay * sq + jnp.sum(k_t * q_t) * c

    if pending:  # the row's accepted tokens of the last verify, then identity steps
        kept, hk = count_ref[b], h // rep
        for t in range(pending):
            new, _ = step(s, pq_ref[layer, b, t, hk, :], pk_ref[layer, b, t, hk, :],
                          pv_ref[layer, b, t, h, cols], pg_ref[layer, b, t, h],
                          pb_ref[layer, b, t, h])
            s = jnp.where(t < kept, new, s)
    if write == "pending":
        s_out[0][layer, b, h, :, cols] = s
    for t in range(tokens):
        s, out = step(s, q_ref[t, :], k_ref[t, :], v_ref[t, :], g_ref[t], b_ref[t])
        o_ref[t, :] = out.astype(o_ref.dtype)
    if write == "all":
        s_out[0][layer, b, h, :, cols] = s


@functools.partial(jax.jit, static_argnames=("write", "out_dtype", "block_v", "interpret"))
def recurrent_stacked(
    q,  # [B, T, Hk, dk] float32, L2-normed and scaled
    k,  # [B, T, Hk, dk] float32, L2-normed
    v,  # [B, T, Hv, dv] float32
    g,  # [B, T, Hv] float32 log decay
    beta,  # [B, T, Hv] float32
    stack,  # [L, B, Hv, dk, dv] float32: every layer's state
    layer,  # [] int32: the layer whose state the rule reads (and writes)
    pending=None,  # None, or (count [B] int32, q [L, B, P, Hk, dk], k, v [L, B, P, Hv, dv],
    # g [L, B, P, Hv], beta) all float32 but count: per row the first count[b] of the P
    # tokens at `layer` run before the T new ones (a verify's accepted tokens; the rest skip)
    *,
    write: str | None,
    out_dtype=jnp.float32,  # the output's dtype (rounded from float32 in the kernel)
    block_v: int = BLOCK_V,
    interpret: bool = False,
):  # -> (out [B, T, Hv, dv] out_dtype, stack)
    """The rule over the row's pending tokens, then the T new ones, from `stack[layer]`, in
    one pass over the state. write="all": the state after every token goes into the stack
    in place (the returned stack aliases the argument; a decode step); "pending": the state
    after the pending tokens only (a verify, whose own tokens become the next pending);
    None: the stack is unchanged."""
    if write not in ("all", "pending", None):
        raise ValueError(f"recurrent_stacked: write={write!r}; valid: 'all', 'pending', None")
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if stack.shape[1:] != (bsz, hv, dk, dv) or dv % block_v or hv % hk:
        raise ValueError(f"recurrent_stacked: q {q.shape}, v {v.shape}, stack {stack.shape}, "
                         f"block_v {block_v}: want stack [L, B, Hv, dk, dv] with block_v "
                         "dividing dv and Hk dividing Hv")
    pad = max(1, 1 << (t - 1).bit_length()) - t  # identity steps: g = 0, beta = 0
    if pad:
        def padded(a):
            return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta = (padded(a) for a in (q, k, v, g, beta))
    tp, rep = t + pad, hv // hk
    p = 0 if pending is None else pending[1].shape[2]
    kernel = functools.partial(_kernel, tokens=tp, pending=p, rep=rep, block_v=block_v,
                               write=write)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)

    def whole(a):  # read in place, indexed in the kernel
        return pl.BlockSpec(a.shape, lambda b, h, j: (0,) * a.ndim)

    extra, extra_specs = (), []
    if p:
        count, *steps = pending
        extra = (count.astype(jnp.int32),) + tuple(steps)
        extra_specs = [whole(a) for a in extra]
    out_spec = pl.BlockSpec((None, tp, None, block_v), lambda b, h, j: (b, 0, h, j))
    out_shape = jax.ShapeDtypeStruct((bsz, tp, hv, dv), out_dtype)
    state_at = 6 + len(extra)
    outs = pl.pallas_call(
        kernel,
        grid=(bsz, hv, dv // block_v),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, j: (0,)),
            pl.BlockSpec((None, tp, None, dk), lambda b, h, j: (b, 0, h // rep, 0)),
            pl.BlockSpec((None, tp, None, dk), lambda b, h, j: (b, 0, h // rep, 0)),
            pl.BlockSpec((None, tp, None, block_v), lambda b, h, j: (b, 0, h, j)),
            pl.BlockSpec((None, tp, None), lambda b, h, j: (b, 0, h)),
            pl.BlockSpec((None, tp, None), lambda b, h, j: (b, 0, h)),
            *extra_specs,
            whole(stack),
        ],
        # written: the stack comes back aliased (updated in place); read only: not an output
        # (an aliased output of a stack still live elsewhere would be a copy of it)
        out_specs=[out_spec, whole(stack)] if write else [out_spec],
        out_shape=[out_shape, jax.ShapeDtypeStruct(stack.shape, stack.dtype)] if write
        else [out_shape],
        input_output_aliases={state_at: 1} if write else {},
        compiler_params=params,
        interpret=interpret,
        name="delta_rule_recurrent",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), q, k, v, g, beta, *extra, stack)
    return outs[0][:, :t], outs[1] if write else stack
