"""The gated delta rule over a few tokens (a decode step, a verify, its commit) as one Pallas
kernel that reads a layer's recurrent state from the stacked [layers, B, Hv, dk, dv] states
in place once, keeps it on chip across the tokens, and (if asked) writes the new state back
into the stack in place: the state is a decode step's largest operand (134 MB per layer at a
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
MAX_TOKENS = 16  # the forwards it serves: a decode step, a verify of k + 1 <= 16, its commit


def stacked_rule(
    tokens: int,
    stack,  # [L, B, Hv, dk, dv] the layers' states (the forward's cache)
    recurrent: bool,  # the forward runs the recurrent form (a verify, its commit)
) -> bool:
    """Whether a forward of `tokens` tokens runs the rule through `recurrent_stacked`: a
    forward built for a GPU (kernels.platform) on at most one device (XLA cannot partition
    the kernel's custom call), with a cache (batch > 0) whose value width BLOCK_V divides,
    running the recurrent form (one token, or `recurrent`) over at most MAX_TOKENS tokens.
    Every recurrent use on such a GPU goes through it (decode, verify, commit), so a decode
    step and a verify of the same tokens do the same arithmetic."""
    from jaxspec.kernels.platform import platform

    mesh = jax.sharding.get_abstract_mesh()
    return (platform() == "gpu" and (mesh.empty or mesh.size == 1) and stack.shape[1] > 0
            and stack.shape[-1] % BLOCK_V == 0 and (tokens == 1 or recurrent)
            and tokens <= MAX_TOKENS)


def _kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref=None, *,
            tokens: int, block_v: int, write: bool):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    cols = pl.ds(j * block_v, block_v)
    s = s_ref[layer, b, h, :, cols]  # [dk, block_v] float32
    for t in range(tokens):
        decay = jnp.exp(g_ref[t])
        k_t, q_t, v_t = k_ref[t, :], q_ref[t, :], v_ref[t, :]
        sk = jnp.sum(s * k_t[:, None], axis=0)  # [block_v]
        sq = jnp.sum(s * q_t[:, None], axis=0)
        c = b_ref[t] * (v_t - decay * sk)
        o_ref[t, :] = decay * sq + jnp.sum(k_t * q_t) * c
        s = s * decay + k_t[:, None] * c[None, :]
    if write:
        s_out_ref[layer, b, h, :, cols] = s


@functools.partial(jax.jit, static_argnames=("write", "block_v", "interpret"))
def recurrent_stacked(
    q,  # [B, T, Hk, dk] float32, L2-normed and scaled
    k,  # [B, T, Hk, dk] float32, L2-normed
    v,  # [B, T, Hv, dv] float32
    g,  # [B, T, Hv] float32 log decay
    beta,  # [B, T, Hv] float32
    stack,  # [L, B, Hv, dk, dv] float32: every layer's state
    layer,  # [] int32: the layer whose state the rule reads (and writes)
    *,
    write: bool,
    block_v: int = BLOCK_V,
    interpret: bool = False,
):  # -> (out [B, T, Hv, dv] float32, stack: with layer's state after the T tokens if write)
    """The rule over T tokens from `stack[layer]`; with `write` the new state goes into the
    stack in place (the returned stack aliases the argument), else the stack is unchanged."""
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
    kernel = functools.partial(_kernel, tokens=tp, block_v=block_v, write=write)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    whole = pl.BlockSpec(stack.shape, lambda b, h, j: (0,) * 5)  # indexed in the kernel
    out_spec = pl.BlockSpec((None, tp, None, block_v), lambda b, h, j: (b, 0, h, j))
    out_shape = jax.ShapeDtypeStruct((bsz, tp, hv, dv), jnp.float32)
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
            whole,
        ],
        # written: the stack comes back aliased (updated in place); read only: not an output
        # (an aliased output of a stack still live elsewhere would be a copy of it)
        out_specs=[out_spec, whole] if write else [out_spec],
        out_shape=[out_shape, jax.ShapeDtypeStruct(stack.shape, stack.dtype)] if write
        else [out_shape],
        input_output_aliases={6: 1} if write else {},
        compiler_params=params,
        interpret=interpret,
        name="delta_rule_recurrent",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), q, k, v, g, beta, stack)
    return outs[0][:, :t], outs[1] if write else stack
