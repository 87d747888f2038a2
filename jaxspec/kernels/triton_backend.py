"""Draft-tree attention through jax-triton's `triton_call` (CUDA only).

Imported lazily by `tree_attention(backend="triton")`, so a CPU install never
imports triton or jax_triton. `triton_call` has no CPU mode, no autodiff (the
dispatcher adds a reference-based VJP) and no vmap.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp


def import_jax_triton():
    """jax_triton, or one clear error saying why it is unusable here."""
    try:
        import jax_triton
    except Exception as e:  # ImportError, or jax-triton failing on a CPU-only jaxlib
        raise ImportError(
            "tree_attention backend 'triton' needs jax-triton and triton with a CUDA "
            f"jaxlib (pip install 'jaxspec[gpu]'); importing jax_triton failed: {e!r}. "
            "Use backend='pallas' or 'reference' instead."
        ) from e
    return jax_triton


def _triton_call(jt, *args, out_shapes, name, **kwargs):
    # jax-triton renamed out_shape= to out_type= (the old name warns, then goes) and added
    # name=; in older versions an unknown keyword would become a kernel metaparameter.
    params = inspect.signature(jt.triton_call).parameters
    kwargs["out_type" if "out_type" in params else "out_shape"] = out_shapes
    if "name" in params:
        kwargs["name"] = name
    return jt.triton_call(*args, **kwargs)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_k",
        "block_r",
        "block_n",
        "kv_splits",
        "num_warps",
        "num_stages",
    ),
)
def tree_attention_triton(
    q,  # [batch, num_nodes, q_heads, head_dim]
    k_cache,  # [batch, max_len, kv_heads, head_dim]
    v_cache,  # [batch, max_len, kv_heads, head_dim]
    cache_lengths,  # [batch] int
    k_new,  # [batch, num_nodes, kv_heads, head_dim]
    v_new,  # [batch, num_nodes, kv_heads, head_dim]
    tree_mask,  # [batch, num_nodes, num_nodes] bool
    *,
    scale: float | None = None,
    block_k: int = 64,
    block_r: int | None = None,
    block_n: int = 64,
    kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """Same function as `tree_attention_reference`; the knobs never change the math."""
    jt = import_jax_triton()
    from jaxspec.kernels.split_kv import combine_splits
    from jaxspec.kernels.triton_kernel import launch_config, tree_attention_kernel

    grid, constexprs, shapes = launch_config(
        q.shape,
        k_cache.shape,
        scale=scale,
        block_k=block_k,
        block_r=block_r,
        block_n=block_n,
        kv_splits=kv_splits,
    )
    s = k_cache.shape[1]
    o, m, l = _triton_call(
        jt,
        q,
        k_cache,
        v_cache,
        jnp.clip(cache_lengths.astype(jnp.int32), 0, s),
        k_new,
        v_new,
        tree_mask.astype(jnp.int8),
        kernel=tree_attention_kernel,
        out_shapes=[jax.ShapeDtypeStruct(shp, jnp.float32) for shp in shapes],
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        name="tree_attention",
        **constexprs,
    )
    return combine_splits(o, m, l, axis=0).astype(q.dtype)
