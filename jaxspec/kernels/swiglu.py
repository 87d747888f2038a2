"""The SwiGLU MLP's first half, silu(x @ w_gate) * (x @ w_up), as one Pallas kernel.

XLA runs the gate and up projections as two matmuls: each writes its [tokens, mlp] output
to memory and the SwiGLU product reads both back (on a GPU, with XLA's Triton GEMM
fusions, the product is fused into the second matmul, which still reads the first one's
output). Per layer of a Qwen3-8B-shaped policy verifying 1,024 tokens that is ~109 MB
written and read beyond the weights (both [1024, 12288] outputs written and read back, the
input read twice): 3.9 GB per step. This kernel keeps both accumulators of a
[block_m, block_n] tile in registers, walks the hidden dimension in blocks, and writes only
the product: the input and the two weights read once, the product written once.

One program computes one [block_m, block_n] tile of the output (grid: token blocks x mlp
blocks); Triton lowering on a GPU, `interpret=True` elsewhere (tests). The epilogue rounds
where XLA rounds the unfused MLP (`swiglu_epilogue`), so interpreted it equals XLA's unfused
MLP whenever the projections do (tests/kernels/test_swiglu.py); on a GPU, Triton's exp may
differ from XLA's in the last bit. Tile shapes never change the math except for the
matmuls' float32 summation order.
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

# Tile defaults: a [128, 64] tile of each of the two projections (128 output columns of
# work per program), the hidden dimension in steps of 64. Untimed on a GPU (docs/kernels.md).
BLOCK_M, BLOCK_N, BLOCK_K = 128, 64, 64
NUM_WARPS, NUM_STAGES = 8, 3


def swiglu_epilogue(gate, up, dtype):
    """silu(gate) * up from float32 projections, computed as XLA computes the unfused MLP
    (layers.MLP) in `dtype`: silu as x / (1 + exp(-x)) expanded, each operation in float32
    and rounded to `dtype` (the identity in float32). Triton has no bfloat16 exp, hence the
    explicit float32 arithmetic."""
    f32 = jnp.float32

    def rnd(v):
        return v.astype(dtype).astype(f32)

    g, u = rnd(gate), rnd(up)
    sig = rnd(1.0 / rnd(rnd(jnp.exp(-g)) + 1.0))
    return (rnd(g * sig) * u).astype(dtype)


def _swiglu_kernel(x_ref, wg_ref, wu_ref, o_ref, *, block_k: int, k_steps: int):
    rows, cols = o_ref.shape
    zeros = jnp.zeros((rows, cols), jnp.float32)

    def step(i, acc):
        gate, up = acc
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[:, ks]
        return gate + dot(x, wg_ref[ks, :]), up + dot(x, wu_ref[ks, :])

    gate, up = lax.fori_loop(0, k_steps, step, (zeros, zeros))
    o_ref[...] = swiglu_epilogue(gate, up, o_ref.dtype)


def use_fused(kernel: str, tokens: int, hidden: int, mlp: int) -> bool:
    """Whether the MLP runs `swiglu` for ModelConfig.fused_kernels `kernel` ("auto", "xla" or
    "pallas") at these sizes (`tokens` rows of width `hidden`, `mlp` intermediate)."""
    return fused_kernel_applies(kernel, fits(tokens, hidden, mlp))


def fits(tokens: int, hidden: int, mlp: int, *, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
         block_k: int = BLOCK_K) -> bool:
    """Whether `swiglu_pallas` takes these sizes: whole tiles (tokens a multiple of 16 with
    the token block shrunk to divide it, hidden and mlp multiples of their blocks)."""
    return (tokens % 16 == 0 and tokens >= 16 and hidden % block_k == 0 and mlp % block_n == 0)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def swiglu_pallas(
    x,  # [tokens, hidden]
    w_gate,  # [hidden, mlp]
    w_up,  # [hidden, mlp]
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool = False,
):  # -> [tokens, mlp] in x's dtype
    """silu(x @ w_gate) * (x @ w_up), float32 accumulation, one kernel (module docstring).

    Sizes must satisfy `fits`; block sizes are powers of two >= 16 (the token block is
    halved until it divides the tokens)."""
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_block(name, value)
    m, h = x.shape
    if w_gate.shape != w_up.shape or w_gate.shape[0] != h:
        raise ValueError(f"swiglu_pallas: x {x.shape}, w_gate {w_gate.shape} and w_up "
                         f"{w_up.shape} do not chain ([tokens, hidden] @ [hidden, mlp])")
    n = w_gate.shape[1]
    if not fits(m, h, n, block_m=block_m, block_n=block_n, block_k=block_k):
        raise ValueError(f"swiglu_pallas: tokens {m}, hidden {h}, mlp {n} are not whole tiles "
                         f"(tokens a multiple of 16, hidden of block_k={block_k}, mlp of "
                         f"block_n={block_n})")
    if len({x.dtype, w_gate.dtype, w_up.dtype}) != 1:
        raise ValueError(f"swiglu_pallas: x, w_gate, w_up must share a dtype; got {x.dtype}, "
                         f"{w_gate.dtype}, {w_up.dtype}")
    bm = token_block(m, block_m)
    kernel = functools.partial(_swiglu_kernel, block_k=block_k, k_steps=h // block_k)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=(m // bm, n // block_n),
        in_specs=[
            pl.BlockSpec((bm, h), lambda i, j: (i, 0)),
            pl.BlockSpec((h, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((h, block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="swiglu",
    )(x, w_gate, w_up)


def swiglu_reference(x, w_gate, w_up):
    """The same function by XLA's matmuls (the backward of the fused kernel)."""
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    return swiglu_epilogue(gate, up, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def swiglu(x, w_gate, w_up, interpret: bool = False):
    """`swiglu_pallas`, differentiable: the backward is `swiglu_reference`'s."""
    return swiglu_pallas(x, w_gate, w_up, interpret=interpret)


def _swiglu_fwd(x, w_gate, w_up, interpret):
    return swiglu_pallas(x, w_gate, w_up, interpret=interpret), (x, w_gate, w_up)


def _swiglu_bwd(interpret, residuals, g):
    with backward_precision(residuals[0].dtype):
        _, vjp = jax.vjp(swiglu_reference, *residuals)
        return vjp(g)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
