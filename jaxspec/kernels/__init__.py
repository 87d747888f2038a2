"""Draft-tree verification attention: a jnp reference and kernel backends.

`tree_attention` is the one entry point. Backends:

- ``reference``: jnp on XLA, the default on CPU/TPU: the cache read in blocks, in its stored
  dtype, only up to the longest live row (`tree_attention_blocked`); it matches
  `tree_attention_reference`, the plain oracle every backend is tested against;
- ``pallas``: a Pallas kernel (Triton lowering on GPU, ``interpret=True`` elsewhere);
- ``triton``: a Triton kernel called through jax-triton (CUDA only, imported lazily);
- ``auto``: reference on CPU/TPU; pallas on GPU.

On a GPU `auto` is the Pallas kernel because it reads one layer of a stacked cache in place
(a layer loop passes `CacheLayer`s), and its programs compile the same way on a machine
without a GPU, where `scripts/inspect_gpu.py` measures them. The triton backend reads a
stacked cache's layer through a slice, which XLA materialises: a copy of that layer's whole
cache per layer per step in decoding (jax-triton cannot be lowered without a GPU, so no
compiled program shows it; the code path does).

"GPU" is the platform programs are built for (`kernels.platform.platform()`): JAX's backend,
or a GPU target compiled for from a machine without one (`target_platform`).

Kernel backends are differentiable: their VJP recomputes the reference's (the
forward pass is the fast one; training-time attention goes through the reference
math anyway).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.kernels.blocked import (
    CacheLayer,
    WithAncestors,
    layer_array,
    tree_attention_blocked,
)
from jaxspec.kernels.platform import compiler_options, platform, target_platform
from jaxspec.kernels.reference import tree_attention_reference

BACKENDS = ("auto", "reference", "pallas", "triton")


def _platform() -> str:
    return platform()  # "cpu", "gpu" (CUDA and ROCm) or "tpu": the target (kernels.platform)


@functools.cache
def jax_triton_available() -> bool:
    """Whether jax_triton imports here (never true on a CPU-only jaxlib)."""
    try:
        import jax_triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """Maps a backend name (possibly "auto") to the concrete backend, or raises."""
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown tree_attention backend {backend!r}; valid backends: {', '.join(BACKENDS)}"
        )
    platform = _platform() if platform is None else platform
    if backend == "auto":
        return "pallas" if platform == "gpu" else "reference"
    if backend == "triton" and platform != "gpu":
        raise ValueError(
            f"tree_attention backend 'triton' needs a CUDA GPU, but JAX's platform is "
            f"{platform!r}; use backend='reference' (or 'pallas', interpreted off-GPU)"
        )
    return backend


def _check_inputs(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask):
    """One clear error per malformed input, before any tracing of kernels."""
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(
            f"tree_attention wants q [B,N,Hq,D] and k_cache [B,S,Hkv,D]; got q {q.shape}, "
            f"k_cache {k_cache.shape}"
        )
    b, n, hq, d = q.shape
    _, s, hkv, dk = k_cache.shape
    expected = {
        "k_cache": (k_cache.shape, (b, s, hkv, d)),
        "v_cache": (v_cache.shape, (b, s, hkv, d)),
        "cache_lengths": (cache_lengths.shape, (b,)),
        "k_new": (k_new.shape, (b, n, hkv, d)),
        "v_new": (v_new.shape, (b, n, hkv, d)),
        "tree_mask": (tree_mask.shape, (b, n, n)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(
                f"tree_attention: {name} has shape {tuple(got)}, expected {want} "
                f"(from q {q.shape} and k_cache {k_cache.shape})"
            )
    if hq % hkv:
        raise ValueError(f"tree_attention: q heads ({hq}) must be a multiple of kv heads ({hkv})")


@dataclasses.dataclass(frozen=True)
class _KernelCall:
    """A kernel backend with its static settings (hashable: a nondiff argument)."""

    backend: str
    scale: float | None
    knobs: tuple[tuple[str, object], ...]
    thread: bool = True  # the caller goes on with the caches the kernel passes on

    def __call__(self, q, k_cache, v_cache, layer, *rest):
        if self.backend == "pallas":  # reads a stacked cache's layer in place
            from jaxspec.kernels.pallas import tree_attention_pallas

            out = tree_attention_pallas(q, k_cache, v_cache, *rest, scale=self.scale,
                                        layer=layer, alias=self.thread, **dict(self.knobs))
            return out if layer is not None else (out, k_cache, v_cache)
        from jaxspec.kernels.triton_backend import tree_attention_triton

        k_layer, v_layer = k_cache, v_cache
        if layer is not None:
            k_layer, v_layer = CacheLayer(k_cache, layer).read(), CacheLayer(v_cache, layer).read()
        out = tree_attention_triton(q, k_layer, v_layer, *rest, scale=self.scale,
                                    **dict(self.knobs))
        return out, k_cache, v_cache


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kernel_attention(q, k_cache, v_cache, layer, cache_lengths, k_new, v_new, tree_mask, call):
    """-> (out, k_cache, v_cache): the caches as the kernel passed them on (stacked caches
    with a layer: threaded through the Pallas kernel; otherwise the inputs)."""
    return call(q, k_cache, v_cache, layer, cache_lengths, k_new, v_new, tree_mask)


def _kernel_attention_fwd(q, k_cache, v_cache, layer, cache_lengths, k_new, v_new, tree_mask,
                          call):
    outs = call(q, k_cache, v_cache, layer, cache_lengths, k_new, v_new, tree_mask)
    return outs, (q, k_cache, v_cache, layer, cache_lengths, k_new, v_new, tree_mask)


def _kernel_attention_bwd(call, residuals, gs):
    q, k_cache, v_cache, layer, cache_lengths, k_new, v_new, tree_mask = residuals
    g, g_k, g_v = gs  # the caches pass through: their cotangents flow straight back

    def reference(q, k_cache, v_cache, k_new, v_new):
        if layer is not None:  # stacked caches: the layer's slice, differentiably
            k_cache, v_cache = CacheLayer(k_cache, layer).read(), CacheLayer(v_cache, layer).read()
        return tree_attention_reference(
            q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=call.scale
        )

    _, vjp = jax.vjp(reference, q, k_cache, v_cache, k_new, v_new)
    dq, dk, dv, dkn, dvn = vjp(g)
    return dq, dk + g_k, dv + g_v, None, None, dkn, dvn, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def tree_attention(
    q,  # [batch, num_nodes, q_heads, head_dim]
    k_cache,  # [batch, max_len, kv_heads, head_dim], a CacheLayer or WithAncestors
    v_cache,  # [batch, max_len, kv_heads, head_dim], a CacheLayer or WithAncestors
    cache_lengths,  # [batch] int: valid prefix slots per row
    k_new,  # [batch, num_nodes, kv_heads, head_dim]
    v_new,  # [batch, num_nodes, kv_heads, head_dim]
    tree_mask,  # [batch, num_nodes, num_nodes] bool: node i may attend to node j
    *,
    backend: str = "auto",
    scale: float | None = None,
    block_k: int | None = None,
    block_r: int | None = None,
    block_n: int | None = None,
    kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    thread: bool = False,
):
    """Attention of N tree nodes over a ragged cached prefix plus the tree (ancestor mask).

    Output [batch, num_nodes, q_heads, head_dim] in q's dtype; scores and softmax
    in float32; a node that may attend to nothing gets zeros. Tuning knobs (static;
    None = the backend's default) never change the math; ``reference`` uses only
    ``block_k``; ``interpret`` (pallas only) defaults to True off-GPU. ``thread=True``
    returns ``(out, k_cache, v_cache)``: the caches unchanged in value, for the caller to go
    on with (the reference backend passes a stacked cache through its block loop so that a
    layer loop's uses of it form one chain and XLA never copies it; see kernels.blocked).
    """
    _check_inputs(q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask)
    platform = _platform()
    name = resolve_backend(backend, platform)
    if name == "reference" or isinstance(k_cache, WithAncestors):
        # Ancestor keys (tree drafting with a head) are the blocked path's alone, on any platform.
        return tree_attention_blocked(
            q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=scale,
            block_k=block_k, thread=thread,
        )
    given = (k_cache, v_cache)
    layer = None
    if name == "pallas" and isinstance(k_cache, CacheLayer) and k_cache.dtype == k_new.dtype \
            and isinstance(v_cache, CacheLayer) and v_cache.dtype == v_new.dtype:
        # The Pallas kernel reads the layer of the stacked cache in place (no per-layer copy).
        k_cache, v_cache, layer = k_cache.stack, v_cache.stack, jnp.asarray(k_cache.index, jnp.int32)
    else:
        # One layer's array, in the new keys' dtype (a no-op when the cache has it).
        k_cache = layer_array(k_cache).astype(k_new.dtype)
        v_cache = layer_array(v_cache).astype(v_new.dtype)
    dtypes = {x.dtype for x in (q, k_cache, v_cache, k_new, v_new)}
    if len(dtypes) != 1:
        raise ValueError(
            f"tree_attention backend {name!r} needs q, k_cache, v_cache, k_new, v_new of one "
            f"dtype; got {sorted(str(t) for t in dtypes)}"
        )
    knobs = dict(
        block_k=block_k,
        block_r=block_r,
        block_n=block_n,
        kv_splits=kv_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if name == "pallas":
        knobs["interpret"] = platform != "gpu" if interpret is None else bool(interpret)
    elif interpret:
        raise ValueError(
            "interpret=True is for backend='pallas'; the triton backend runs only on a GPU "
            "(its kernel runs interpreted on CPU under TRITON_INTERPRET=1 with torch tensors)"
        )
    knobs = tuple(sorted((k, v) for k, v in knobs.items() if v is not None))
    call = _KernelCall(name, None if scale is None else float(scale), knobs, bool(thread))
    out, k_cache, v_cache = _kernel_attention(q, k_cache, v_cache, layer, cache_lengths, k_new,
                                              v_new, tree_mask, call)
    if not thread:
        return out
    if layer is None:
        return (out, *given)
    # The stacks as the kernel passed them on: later layers and the cache write use these.
    return out, CacheLayer(k_cache, given[0].index), CacheLayer(v_cache, given[1].index)


__all__ = [
    "BACKENDS",
    "CacheLayer",
    "WithAncestors",
    "compiler_options",
    "jax_triton_available",
    "layer_array",
    "platform",
    "resolve_backend",
    "target_platform",
    "tree_attention",
    "tree_attention_blocked",
    "tree_attention_reference",
]
