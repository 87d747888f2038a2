"""Batch-invariant attention and projections: a token row's bits do not depend on how many
rows and tokens share the forward (`ModelConfig.batch_invariant`).

Attention lays each query's keys out by absolute position (slot s holds the key of
position s: the cached prefix, then the new tokens the mask allows, wherever they were fed),
so a token decoded alone and the same token inside a verify block or a full-sequence
training forward see identical key rows; the key slots are summed by a scan, so slots with
nothing to attend to add exact zeros and the cache capacity (which differs between plain and
speculative calls) never changes the result. Projections (`invariant_dot`) are dots of one
fixed tile shape: XLA's CPU dot picks its kernel, and so its rounding, by the operands' shapes
(e.g. [M, 64] x [64, 32] rounds differently for M <= 24 than for 600 rows), and one shape
rounds every row alike. Every other reduction (norms, q.k over head_dim) is `tree_sum`:
halving with elementwise adds, one association whatever the shape. The softmax normaliser
(`log_normalizer`) is a fixed tree over blocks of VOCAB_BLOCK vocabulary entries, the one
the trainer's chunked scorer reproduces (jaxspec.rl.chunked). Products summed by these
reductions go through `uncontracted`: no FMA, whose use depends on XLA's fusion.

The mode computes activations in float32 whatever the parameter dtype. bfloat16 activations
cannot be made invariant from JAX: XLA may keep float32 "excess precision" between fused
bf16 ops (`--xla_allow_excess_precision`, on by default), and which roundings it skips depends
on the fusion, i.e. on the shapes. Keys and values are rounded to the cache's dtype with
`round_to` (integer ops XLA cannot elide) so a new token's key equals its cached copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 16  # key rows are padded to a multiple of this many slots
# Vocabulary entries per block of the log-normaliser's fixed reduction tree: the trainer's
# chunked scorer takes vocabulary chunks of a multiple of it (jaxspec.rl.chunked).
VOCAB_BLOCK = 256
# `invariant_dot`'s tiles: rows per dot, and output columns per dot (a multiple of VOCAB_BLOCK;
# the trainer's invariant vocabulary chunks are whole tiles).
ROW_TILE = 16
COL_TILE = 4096
_HIGHEST = jax.lax.Precision.HIGHEST


def round_to(x, dtype):  # float32 [...] -> float32 [...] holding values of `dtype`
    """Round float32 to the nearest (ties to even) bfloat16 value, kept as float32, with
    integer ops that XLA cannot skip; identity for float32. NaN payloads are not preserved."""
    if jnp.dtype(dtype) == jnp.float32:
        return x
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"round_to: dtype {dtype} not supported; valid: float32, bfloat16")
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    lsb = (bits >> 16) & jnp.uint32(1)
    bits = (bits + jnp.uint32(0x7FFF) + lsb) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def invariant_dot(
    x,  # [..., K]
    w,  # [K, ...out]
    preferred_element_type=None,
):  # -> [..., *out] float32 (or preferred_element_type)
    """x @ w per row in float32, every product a dot of one fixed shape: the rows in tiles of
    ROW_TILE (zero-padded), the output columns in tiles of COL_TILE (zero-padded; one tile of
    the whole width when it is at most COL_TILE), each tile a [ROW_TILE, K] x [K, tile] dot in
    a loop. XLA's CPU dot picks its kernel, and so its rounding, by the operands' shapes (the
    row count; a 256-column dot rounds unlike a 4096-column one); a dot of one shape rounds
    each row the same wherever it sits in its tile, so a row's result does not depend on the
    other rows, and a column's does not depend on which COL_TILE-aligned slice of the columns
    is asked for (the trainer's vocabulary chunks, jaxspec.rl.chunked)."""
    k = x.shape[-1]
    out = w.shape[1:]
    # The weight as a new row-major [K, O] array (`uncontracted` is a select XLA cannot fold
    # away): a transposed weight (the tied LM head, embed.T) would otherwise reach the dot as
    # a transposed operand in some programs and as a copy in others, and round differently.
    w2 = uncontracted(w.reshape(k, -1).astype(jnp.float32))
    o = w2.shape[1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    n = rows.shape[0]
    tiles = jnp.pad(rows, ((0, -n % ROW_TILE), (0, 0))).reshape(-1, ROW_TILE, k)
    if o <= COL_TILE:
        y = jax.lax.map(lambda t: jnp.dot(t, w2, precision=_HIGHEST), tiles)  # [n/R, R, O]
    else:
        cols = jnp.pad(w2, ((0, 0), (0, -o % COL_TILE))).reshape(k, -1, COL_TILE).swapaxes(0, 1)

        def row_tile(t):  # [R, K] -> [R, C * COL_TILE]
            y = jax.lax.map(lambda c: jnp.dot(t, c, precision=_HIGHEST), cols)  # [C, R, COL_TILE]
            return y.swapaxes(0, 1).reshape(ROW_TILE, -1)

        y = jax.lax.map(row_tile, tiles)
    total = y.reshape(-1, y.shape[-1])[:n, :o].reshape(*x.shape[:-1], *out)
    return total if preferred_element_type is None else total.astype(preferred_element_type)


@jax.custom_jvp
def uncontracted(x):  # [...] float32 -> the same values (-0.0 read as +0.0)
    """x through a select, so that a multiply producing x is never fused with an add consuming
    it into one FMA: XLA's CPU backend lets LLVM contract a*b + c (one rounding instead of two),
    and whether it does depends on the fusion, i.e. on the shapes (the LM head's products
    rounded differently in a [B, 1, V] decode step than in a training forward's chunk).
    Its derivative is the identity's (the select's would drop it where x == 0)."""
    return jnp.where(x == 0, jnp.zeros_like(x), x)


@uncontracted.defjvp
def _uncontracted_jvp(primals, tangents):
    return uncontracted(primals[0]), tangents[0]


def tree_sum(x):  # [..., N] -> [...]
    """Sum over the last axis by halving with elementwise adds (zero-padded to a power of
    two): log2(N) ops with one association whatever the other dimensions are; the terms are
    `uncontracted` (a product summed here rounds the same in every program)."""
    x = uncontracted(x)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def block_sums(x):  # [..., V] -> [..., ceil(V / VOCAB_BLOCK)]
    """`tree_sum` of every contiguous block of VOCAB_BLOCK entries along the last axis (the
    last block zero-padded): the first level of `log_normalizer`'s reduction, which a scan over
    vocabulary chunks (any multiple of VOCAB_BLOCK wide) computes chunk by chunk."""
    v = x.shape[-1]
    n = -(-v // VOCAB_BLOCK)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * VOCAB_BLOCK - v)])
    return tree_sum(x.reshape(*x.shape[:-1], n, VOCAB_BLOCK))


def normalizer_from_blocks(
    top,  # [...] the shift the exponentials were taken from (no gradient)
    sums,  # [..., nb] block_sums of exp(z - top), in vocabulary order; extra trailing zero
    #        blocks (a chunked scan's padding) change nothing (x + 0 == x exactly)
):  # -> [...] log sum exp(z)
    """The second level of `log_normalizer`: `tree_sum` over the blocks, then the log."""
    return top + jnp.log(tree_sum(sums))


def log_normalizer(z):  # [..., V] float32 with a finite max -> [..., 1]
    """logsumexp over the last axis, rounding the same for every row whatever the shape, and
    the same whether the vocabulary is reduced whole or in chunks of any multiple of
    VOCAB_BLOCK (jaxspec.rl.chunked, the trainer's scorer): a fixed tree, `tree_sum` within
    each block of VOCAB_BLOCK entries and then over the block sums. Up to VOCAB_BLOCK entries
    it is one `tree_sum` of the row (trailing zeros change no bit)."""
    top = jax.lax.stop_gradient(jnp.max(z, axis=-1))  # exact; logsumexp is shift-free
    return normalizer_from_blocks(top, block_sums(jnp.exp(z - top[..., None])))[..., None]


def invariant_attention(
    q,  # [B, T, q_heads, head_dim]
    k_cache,  # [B, S, kv_heads, head_dim] slot s holds position s
    v_cache,  # [B, S, kv_heads, head_dim]
    cache_lengths,  # [B] int32 valid prefix slots
    k_new,  # [B, T, kv_heads, head_dim]
    v_new,  # [B, T, kv_heads, head_dim]
    mask,  # [B, T, T] bool: new token i may attend to new token j (padding already masked)
    positions,  # [B, T] int32 absolute positions of the new tokens, < 0 padding
):  # -> [B, T, q_heads, head_dim] in q's dtype
    """Tree attention with a position-ordered, block-reduced key row per query."""
    b, t, hq, d = q.shape
    s_cache = k_cache.shape[1]
    hkv = k_cache.shape[2]
    group = hq // hkv
    cap = max(s_cache, t)
    cap = -(-cap // BLOCK) * BLOCK
    slots = jnp.arange(cap, dtype=jnp.int32)
    # Which new token sits at slot s of query i's key row: token j is scattered to slot
    # positions[j] of every query that may attend to it (ancestors have distinct positions).
    to_slot = jnp.where(mask & (positions[:, None, :] >= 0), positions[:, None, :], cap)  # [B,T,T]
    at = (jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], to_slot)
    src = jnp.zeros((b, t, cap), jnp.int32).at[at].set(
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t, t)), mode="drop")  # [B, T, cap]
    from_new = jnp.zeros((b, t, cap), bool).at[at].set(True, mode="drop")  # [B, T, cap]
    in_cache = slots[None, :] < cache_lengths[:, None]  # [B, cap]
    allowed = (in_cache[:, None, :] & ~from_new) | from_new  # [B, T, cap]

    def key_rows(cache, new):  # -> [B, T, cap, kvh, d] float32
        cache = jnp.pad(cache, ((0, 0), (0, cap - s_cache), (0, 0), (0, 0))).astype(jnp.float32)
        picked = jnp.take_along_axis(new.astype(jnp.float32)[:, None], src[..., None, None], axis=2)
        return jnp.where(from_new[..., None, None], picked, cache[:, None])

    keys, values = key_rows(k_cache, k_new), key_rows(v_cache, v_new)
    qf = q.astype(jnp.float32).reshape(b, t, hkv, group, d)
    scores = tree_sum(qf[:, :, None] * keys[:, :, :, :, None, :]) * d**-0.5  # [B,T,cap,kvh,g]
    ok = allowed[..., None, None]
    scores = jnp.where(ok, scores, -jnp.inf)
    top = jnp.max(scores, axis=2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(ok, jnp.exp(scores - top), 0.0)  # [B, T, cap, kvh, g]
    # Key slots in order by a scan, the same multiply-add for every slot: slots past a row's
    # keys add exact zeros, so the capacity (which differs between plain and speculative
    # calls) never changes the bits. (A tree over slots would not do: where XLA contracts a
    # product and a sum into one FMA depends on which level of the tree the zeros start.)
    def add_slot(carry, slot):
        w, v = slot  # [B, T, kvh, g], [B, T, kvh, d]
        return (carry[0] + w, carry[1] + uncontracted(w[..., None] * v[:, :, :, None, :])), None

    zeros = (jnp.zeros((b, t, hkv, group), jnp.float32), jnp.zeros((b, t, hkv, group, d), jnp.float32))
    (denom, numer), _ = jax.lax.scan(add_slot, zeros, (jnp.moveaxis(weights, 2, 0), jnp.moveaxis(values, 2, 0)))
    out = numer / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(b, t, hq, d).astype(q.dtype)
