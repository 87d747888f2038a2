"""Grouped matmul: rows sorted by group, each group's rows times its own weight matrix, read
in place (the expert projections of an MoE layer, jaxspec.models.moe).

`grouped_matmul(x, w, starts, ends)` computes, for every group e, rows starts[e]:ends[e] of
x [M, K] times w[e] [K, N] (or w[e]^T, w [E, N, K], with `transpose=True`). One Pallas
program per (group, block of N output columns) walks its group's rows in blocks of
`block_m` and the contraction in blocks of `block_k`, reading its block of w[e] straight
from the stacked [E, K, N] weights: no per-group copy of a weight is made, and a group
with no rows reads nothing (its program ends at once), so a forward reads the weights of
the groups the rows route to, each once per row block (once when a group's rows fit one
block, as at decode and verify sizes). The last row block of a group is shifted back to end
at row M, never past it, and stores only the group's rows, so no read or write leaves the
arrays (no padding copy of x).

`grouped_matmul_t(x, dy, starts, ends)` is the weight gradient, dW[e] = x[rows e]^T @
dy[rows e] [E, K, N] (zero for an empty group), one program per (group, K block, N block).
`grouped_matmul` is differentiable: dx is `grouped_matmul(dy, w, transpose=not transpose)`,
dW `grouped_matmul_t` (both Pallas).

Triton lowering on a GPU, `interpret=True` elsewhere (tests). The products accumulate in
float32 (HIGHEST: float32 operands stay IEEE) and are rounded once to x's dtype.
Requirements (`fits`): M >= 16 rows (a block of at least 16 rows, as Triton's dot needs),
K a multiple of block_k, N of block_n; starts/ends ascending, contiguous and covering rows
0..M-1 (rows outside every group are not written).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.kernels.matmul import HIGHEST, dot
from jaxspec.kernels.split_kv import check_block

__all__ = ["fits", "group_bounds", "grouped_matmul", "grouped_matmul_t", "row_block"]

# Untimed on a GPU (docs/kernels.md): 64 output columns and 64 contraction steps per block.
BLOCK_N, BLOCK_K = 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
MAX_BLOCK_M = 128


def row_block(rows: int, groups: int) -> int:
    """Rows per block: the smallest power of two >= 16 holding twice a group's mean rows,
    at most MAX_BLOCK_M and at most `rows` (a group fits one block unless it has more than
    twice its share)."""
    want = max(16, 1 << max(-(-2 * rows // max(groups, 1)) - 1, 1).bit_length())
    bm = min(want, MAX_BLOCK_M)
    while bm > rows and bm > 16:
        bm //= 2
    return bm


def col_block(size: int, block: int) -> int:
    """`block` halved until it divides `size` (at least 16)."""
    while size % block and block > 16:
        block //= 2
    return block


def fits(rows: int, k: int, n: int) -> bool:
    """Whether `grouped_matmul` takes x [rows, k] @ w[e] [k, n]: rows >= 16, k and n
    multiples of 16."""
    return rows >= 16 and k % 16 == 0 and n % 16 == 0


def group_bounds(
    groups,  # [M] int32: each row's group, rows sorted by it
    num_groups: int,
):  # -> (starts [E] int32, ends [E] int32)
    """Each group's first row and one past its last, from the sorted rows' groups."""
    sizes = jnp.zeros((num_groups,), jnp.int32).at[groups].add(1)
    ends = jnp.cumsum(sizes, dtype=jnp.int32)
    return ends - sizes, ends


def _dot_nt(a, b):  # [m, k] @ [n, k]^T -> [m, n] float32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # [m, k]^T @ [m, n] -> [k, n] float32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


def _row_window(lo, hi, c, block_m: int, rows: int):
    """Block c of a group's rows lo..hi-1: its first row (shifted back to end by row `rows`)
    and which of its block_m rows are the group's and not yet seen."""
    first = lo + c * block_m
    start = jnp.minimum(first, rows - block_m)
    idx = start + jnp.arange(block_m, dtype=jnp.int32)
    return start, (idx >= first) & (idx < hi)


def _gmm_kernel(start_ref, end_ref, x_ref, w_ref, o_ref, *, block_m: int, block_k: int,
                transpose: bool):
    lo, hi = start_ref[...], end_ref[...]
    rows, depth = x_ref.shape
    cols = o_ref.shape[1]

    def row_block_(c, carry):
        start, valid = _row_window(lo, hi, c, block_m, rows)
        here = pl.ds(start, block_m)

        def step(i, acc):
            ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            xb = x_ref[here, ks]
            if transpose:
                return acc + _dot_nt(xb, w_ref[:, ks])
            return acc + dot(xb, w_ref[ks, :])

        acc = lax.fori_loop(0, depth // block_k, step, jnp.zeros((block_m, cols), jnp.float32))
        out = acc.astype(o_ref.dtype)
        from jax.experimental.pallas import triton as plgpu

        plgpu.store(o_ref.at[here, :], out, mask=valid[:, None])
        return carry

    lax.fori_loop(0, pl.cdiv(hi - lo, block_m), row_block_, 0)


def _tgmm_kernel(start_ref, end_ref, x_ref, dy_ref, o_ref, *, block_m: int):
    lo, hi = start_ref[...], end_ref[...]
    rows = x_ref.shape[0]

    def row_block_(c, acc):
        start, valid = _row_window(lo, hi, c, block_m, rows)
        here = pl.ds(start, block_m)
        xb = jnp.where(valid[:, None], x_ref[here, :], 0)
        db = jnp.where(valid[:, None], dy_ref[here, :], 0)
        return acc + _dot_tn(xb, db)

    acc = lax.fori_loop(0, pl.cdiv(hi - lo, block_m), row_block_,
                        jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _check(name, x, w, starts, ends, block_k, block_n, transpose):
    for b, v in (("block_k", block_k), ("block_n", block_n)):
        check_block(b, v)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"{name}: x must be [M, K] and w [E, K, N]; got {x.shape}, {w.shape}")
    e = w.shape[0]
    k, n = (w.shape[2], w.shape[1]) if transpose else (w.shape[1], w.shape[2])
    if x.shape[1] != k:
        raise ValueError(f"{name}: x {x.shape} and w {w.shape} (transpose={transpose}) do "
                         f"not chain")
    if starts.shape != (e,) or ends.shape != (e,):
        raise ValueError(f"{name}: starts {starts.shape} and ends {ends.shape} must be [{e}]")
    if not fits(x.shape[0], k, n) or k % block_k or n % block_n:
        raise ValueError(f"{name}: rows {x.shape[0]} (>= 16), K {k} (a multiple of "
                         f"block_k={block_k}) and N {n} (of block_n={block_n}) do not fit")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x and w must share a dtype; got {x.dtype}, {w.dtype}")
    return e, k, n


def _params(interpret, num_warps, num_stages):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("transpose", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def grouped_matmul_pallas(
    x,  # [M, K], rows sorted by group
    w,  # [E, K, N] ([E, N, K] with transpose)
    starts,  # [E] int32: each group's first row
    ends,  # [E] int32: one past its last row
    *,
    transpose: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool = False,
):  # -> [M, N] in x's dtype
    """x[rows of e] @ w[e] (w[e]^T with transpose) for every group e, one kernel. Blocks
    default to BLOCK_N / BLOCK_K halved until they divide N / K."""
    kdim = w.shape[2] if transpose else w.shape[1]
    block_k = block_k or col_block(kdim, BLOCK_K)
    block_n = block_n or col_block(w.shape[1] if transpose else w.shape[2], BLOCK_N)
    e, k, n = _check("grouped_matmul", x, w, starts, ends, block_k, block_n, transpose)
    m = x.shape[0]
    bm = block_m or row_block(m, e)
    w_spec = (pl.BlockSpec((None, block_n, k), lambda g, j: (g, j, 0)) if transpose
              else pl.BlockSpec((None, k, block_n), lambda g, j: (g, 0, j)))
    kernel = functools.partial(_gmm_kernel, block_m=bm, block_k=block_k, transpose=transpose)
    return pl.pallas_call(
        kernel,
        grid=(e, n // block_n),
        in_specs=[
            pl.BlockSpec((None,), lambda g, j: (g,)),
            pl.BlockSpec((None,), lambda g, j: (g,)),
            pl.BlockSpec((m, k), lambda g, j: (0, 0)),
            w_spec,
        ],
        out_specs=pl.BlockSpec((m, block_n), lambda g, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=_params(interpret, num_warps, num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), x, w)


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_matmul_t(
    x,  # [M, K], rows sorted by group
    dy,  # [M, N]
    starts,  # [E] int32
    ends,  # [E] int32
    *,
    interpret: bool = False,
):  # -> [E, K, N] in x's dtype
    """x[rows of e]^T @ dy[rows of e] for every group e (zeros for an empty group)."""
    m, k = x.shape
    n = dy.shape[1]
    e = starts.shape[0]
    block_k, block_n = col_block(k, BLOCK_K), col_block(n, BLOCK_N)
    if dy.shape[0] != m or not fits(m, k, n) or k % block_k or n % block_n:
        raise ValueError(f"grouped_matmul_t: x {x.shape} and dy {dy.shape} do not fit (same "
                         f"rows >= 16, K a multiple of {block_k}, N of {block_n})")
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=row_block(m, e)),
        grid=(e, k // block_k, n // block_n),
        in_specs=[
            pl.BlockSpec((None,), lambda g, i, j: (g,)),
            pl.BlockSpec((None,), lambda g, i, j: (g,)),
            pl.BlockSpec((m, block_k), lambda g, i, j: (0, i)),
            pl.BlockSpec((m, block_n), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, block_k, block_n), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((e, k, n), x.dtype),
        compiler_params=_params(interpret, NUM_WARPS, NUM_STAGES),
        interpret=interpret,
        name="grouped_matmul_t",
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def grouped_matmul(
    x,  # [M, K], rows sorted by group
    w,  # [E, K, N] ([E, N, K] with transpose)
    starts,  # [E] int32
    ends,  # [E] int32
    transpose: bool = False,
    interpret: bool = False,
):  # -> [M, N] in x's dtype
    """`grouped_matmul_pallas`, differentiable in x and w (module docstring)."""
    return grouped_matmul_pallas(x, w, starts, ends, transpose=transpose, interpret=interpret)


def _fwd(x, w, starts, ends, transpose, interpret):
    out = grouped_matmul_pallas(x, w, starts, ends, transpose=transpose, interpret=interpret)
    return out, (x, w, starts, ends)


def _bwd(transpose, interpret, residuals, g):
    x, w, starts, ends = residuals
    g = g.astype(x.dtype)
    dx = grouped_matmul_pallas(g, w, starts, ends, transpose=not transpose, interpret=interpret)
    if transpose:  # y = x @ w[e]^T: dw[e] = g^T @ x
        dw = grouped_matmul_t(g, x, starts, ends, interpret=interpret)
    else:
        dw = grouped_matmul_t(x, g, starts, ends, interpret=interpret)
    return dx, dw, np.zeros(starts.shape, jax.dtypes.float0), np.zeros(ends.shape,
                                                                       jax.dtypes.float0)


grouped_matmul.defvjp(_fwd, _bwd)
