"""The policy transformer and the `Policy` pytree with one forward.

One forward serves prefill (ragged prompts), decode (T=1) and draft-tree verification
(T=N+1 fed tokens under an ancestor mask). Layers are stacked on a leading `layers` axis
and run by one `jax.lax.scan`, so compile time and HLO size do not grow with depth.

Decoding on CPU and GPU runs them unrolled instead: inside a scan XLA copies each layer's
weight slices before its matmuls (the CPU backend, and the GPU backend as a compile for an
H100 shows), which halves the read bandwidth of a memory-bound decode step
(docs/BENCHMARKS.md, "Layer weights"; docs/results/gpu_programs.json). `Policy.unstack_layers()` (called once
per `generate`, outside its loop) gives the forward per-layer arrays to read in place; the
parameters themselves stay stacked, so checkpoints, sharding and training are unchanged.
The unrolled layers pass the stacked KV cache from one layer's attention to the next
(`kernels.tree_attention(thread=True)`), so XLA keeps it in one buffer (`model.layer_loop:
auto` unrolls on CPU and GPU: `Policy.decodes_unrolled`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.kernels import CacheLayer, platform
from jaxspec.kernels.flash import CausalMask
from jaxspec.models.cache import CacheOverflowError, KVCache, new_token_mask
from jaxspec.models.config import ModelConfig, matmul_precision
from jaxspec.kernels.invariant import invariant_dot
from jaxspec.models.layers import INIT_STD, DecoderLayer, RMSNorm, logical_param

__all__ = ["Policy", "Transformer", "UNROLL_PLATFORMS", "param_path", "random_policy"]

# Where `model.layer_loop: auto` decodes over per-layer weights (Policy.decodes_unrolled).
UNROLL_PLATFORMS = ("cpu", "gpu")


# --------------------------------------------------------------------------- module


class Transformer(nnx.Module):
    """Embedding, `num_layers` stacked decoder layers, final norm, LM head (or tied)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.is_hybrid:
            raise ValueError(f"family {config.family!r} with linear-attention layers is built by "
                             "jaxspec.models.hybrid.HybridPolicy (init / abstract / load_hf), "
                             "not by Policy or Transformer")
        self.config = config
        dtype = config.param_dtype
        self.embed_tokens = logical_param(
            rngs, (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed")
        )

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return DecoderLayer(config, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                            invariant=config.batch_invariant)
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = logical_param(
                rngs, (config.hidden_size, config.vocab_size), dtype, ("embed", "vocab")
            )

    def embed(self, tokens):  # [B, T] -> [B, T, H]
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def logits(self, h):  # [B, T, H] final-normed -> [B, T, V] float32
        if self.config.batch_invariant:
            w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
            return invariant_dot(h, w, jnp.float32)
        if self.lm_head is None:
            return jnp.einsum(
                "bth,vh->btv", h, self.embed_tokens[...], preferred_element_type=jnp.float32
            )
        return jnp.einsum("bth,hv->btv", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens,  # [B, T] int32
        positions,  # [B, T] int32
        k_cache,  # [L, B, S, kv_heads, head_dim]
        v_cache,  # [L, B, S, kv_heads, head_dim]
        cache_lengths,  # [B] int32, <= S
        mask,  # [B, T, T] bool, or a kernels.flash.CausalMask (no cache)
        capture: tuple[int, ...] = (),
        head: bool = True,
        layer_params: tuple | None = None,  # per-layer params (Policy.unstack_layers): unrolled
        shard_rows: bool = False,
    ):
        """Returns (logits [B,T,V] f32, captured [C,B,T,H], k_new [L,B,T,kvh,d], v_new,
        k_cache, v_cache, routing); routing is None for a dense model, else {"router_logits":
        [L,B,T,E] f32, "experts": [L,B,T,K] int32} (jaxspec.models.moe); head=False returns the final-normed hidden states [B,T,H] in place
        of the logits. The caches come back unchanged in value; write into these (the unrolled
        layers pass them on through each attention, so XLA keeps one buffer).

        shard_rows=True pins the activations to the batch sharding at every layer boundary
        (`Policy.forward`)."""
        from jaxspec.parallel import constrain_rows  # (jaxspec.parallel imports this module)

        pin = constrain_rows if shard_rows else (lambda x, dim=0: x)
        x = pin(self.embed(tokens))
        if self.config.batch_invariant:  # float32 activations (see jaxspec.kernels.invariant)
            x = x.astype(jnp.float32)
        unstacked = layer_params
        layer_def, layer_params = nnx.split(self.layers)
        captured = jnp.zeros((len(capture),) + x.shape, x.dtype)
        capture_ids = jnp.asarray(capture, jnp.int32)

        routed = self.config.is_moe

        # Each layer is rematerialised in the backward (a no-op without differentiation): a
        # training step stores one [B, T, H] input per layer, not every layer's internals.
        @functools.partial(jax.checkpoint, prevent_cse=False)
        def run_layer(x, captured, params, index, k_stack, v_stack):
            """-> (x, captured, k_new, v_new, k_stack, v_stack, routing): the stacks as the
            layer's attention passed them on (thread=True; see kernels.blocked); routing the
            MoE layer's (router logits, experts), or None."""
            layer = nnx.merge(layer_def, params)
            x, captured = pin(x), pin(captured, 1)
            # The stacked cache and the layer index, unsliced: the attention reads only the
            # blocks it needs (a sliced layer would be copied whole every step).
            out = layer(x, positions, CacheLayer(k_stack, index), CacheLayer(v_stack, index),
                        cache_lengths, mask, thread=True, index=index, routing=routed)
            x, k_new, v_new, k_layer, v_layer = out[:5]
            if capture:
                hit = (capture_ids == index)[:, None, None, None]
                captured = jnp.where(hit, x[None], captured)
            return x, captured, k_new, v_new, k_layer.stack, v_layer.stack, out[5] if routed else None

        if unstacked is not None:  # unrolled over per-layer arrays
            # Each layer and then the cache write go on with the stacks the previous attention
            # returned: one chain of uses of one buffer, so XLA copies no whole cache per layer
            # per step.
            k_out, v_out, routes = [], [], []
            for index, params in enumerate(unstacked):
                x, captured, k_layer, v_layer, k_cache, v_cache, route = run_layer(
                    x, captured, params, jnp.int32(index), k_cache, v_cache)
                k_out.append(k_layer)
                v_out.append(v_layer)
                routes.append(route)
            k_new, v_new = jnp.stack(k_out), jnp.stack(v_out)
            routing = jax.tree.map(lambda *r: jnp.stack(r), *routes) if routed else None
        else:  # one scan, the stacks in its carry as each layer's attention passed them on
            # (read as closure constants, a kernel that passes them on, aliased, would have
            # XLA copy the whole stack for every layer: the scan needs them unchanged)
            def body(carry, xs):
                x, captured, k_new, v_new, k_stack, v_stack, route = run_layer(
                    *carry[:2], *xs, *carry[2:])
                return (x, captured, k_stack, v_stack), (k_new, v_new, route)

            indices = jnp.arange(self.config.num_layers, dtype=jnp.int32)
            (x, captured, k_cache, v_cache), (k_new, v_new, routing) = jax.lax.scan(
                body, (x, captured, k_cache, v_cache), (layer_params, indices)
            )
        if routed:
            routing = {"router_logits": routing[0], "experts": routing[1]}
        x = self.norm(pin(x))
        return (self.logits(x) if head else x), captured, k_new, v_new, k_cache, v_cache, routing


# --------------------------------------------------------------------------- policy


@functools.partial(jax.jit, static_argnames=("capture", "head", "routing", "shard_rows"))
def _forward(policy, tokens, positions, cache, mask, capture, head=True, routing=False,
             shard_rows=False):
    model = nnx.merge(policy.graphdef, policy.params)
    cfg = policy.config
    b, t = tokens.shape
    if cache is None:
        kv_shape = (cfg.num_layers, b, 0, cfg.num_kv_heads, cfg.head_dim)
        k_cache = v_cache = jnp.zeros(kv_shape, cfg.param_dtype)
        lengths = jnp.zeros((b,), jnp.int32)
    else:
        k_cache, v_cache, lengths = cache.k, cache.v, cache.lengths
    s = k_cache.shape[2]
    if cache is None and mask is None:  # causal over the real tokens: an O(T) mask
        valid, mask = positions >= 0, CausalMask(positions >= 0)
    else:
        valid, mask = new_token_mask(positions, mask)
    logits, captured, k_new, v_new, k_cache, v_cache, route = model(
        tokens, positions, k_cache, v_cache, jnp.minimum(lengths, s), mask, capture, head,
        layer_params=policy.layer_params, shard_rows=shard_rows and cache is None,
    )
    captured = {layer: captured[i] for i, layer in enumerate(capture)}
    extra = (route,) if routing else ()
    if cache is None:
        return logits, captured, None, *extra
    cache = dataclasses.replace(cache, k=k_cache, v=v_cache)
    return logits, captured, cache.write(k_new, v_new, valid).advance(valid), *extra


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: ModelConfig, key):
    """The modules' own init (RMSNorm scales 1, other weights N(0, 0.02^2)) from ONE normal
    draw sliced into the params: one threefry in the program instead of one per parameter,
    which is what made a jitted per-module init slow to compile on CPU."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(Policy.abstract(config).params)
    sizes = [int(np.prod(leaf.shape)) for _, leaf in leaves]
    noise = jax.random.normal(key, (sum(sizes),), jnp.float32)
    values, offset = [], 0
    for (path, leaf), size in zip(leaves, sizes):
        if param_path(path)[-1] == "scale":
            values.append(jnp.ones(leaf.shape, leaf.dtype))
        else:
            chunk = noise[offset:offset + size].reshape(leaf.shape)
            values.append((INIT_STD * chunk).astype(leaf.dtype))
        offset += size
    return jax.tree_util.tree_unflatten(treedef, values)


def param_path(keypath) -> tuple[str, ...]:
    """("layers", "mlp", "up_proj") from a params keypath."""
    return tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))


def _is_concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The verifier/trained model as a pytree: static config + graphdef, params as leaves.

    Pass it to `jax.jit`-ed functions as an argument; `forward` merges inside.
    """

    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    graphdef: nnx.GraphDef = dataclasses.field(metadata=dict(static=True))
    params: nnx.State
    # Per-layer copies of params["layers"] for the unrolled forward (unstack_layers), or None.
    layer_params: tuple | None = None

    @classmethod
    def from_module(cls, module: Transformer) -> Policy:
        graphdef, params = nnx.split(module)
        return cls(config=module.config, graphdef=graphdef, params=params)

    @classmethod
    def init(cls, config: ModelConfig, key) -> Policy:
        """Random init (normal(0.02) weights, unit norms), params in config.dtype."""
        return cls.abstract(config).replace(params=_init_params(config, key))

    @classmethod
    def abstract(cls, config: ModelConfig) -> Policy:
        """Shapes/dtypes only (ShapeDtypeStruct leaves): for loading into shardings."""
        module = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
        return cls.from_module(module)

    def replace(self, **changes) -> Policy:
        """New fields as given (e.g. params=...); to change the config use with_config."""
        return dataclasses.replace(self, **changes)

    def with_config(self, **changes) -> Policy:
        """The same params under a changed config, e.g. with_config(attention_backend="pallas").

        The graphdef is rebuilt (modules read their settings from it); changes that alter
        parameter shapes or dtypes are an error (use astype for the dtype).
        """
        new = Policy.abstract(self.config.replace(**changes))
        ours = jax.tree_util.tree_flatten_with_path(self.params)[0]
        theirs = jax.tree_util.tree_flatten_with_path(new.params)[0]
        spec = [(param_path(p), tuple(x.shape), jnp.dtype(x.dtype)) for p, x in ours]
        new_spec = [(param_path(p), tuple(x.shape), jnp.dtype(x.dtype)) for p, x in theirs]
        if spec != new_spec:
            diff = sorted(set(new_spec) ^ set(spec))[:4]
            raise ValueError(f"with_config({changes}) changes the parameters: {diff}")
        return new.replace(params=self.params)

    def astype(self, dtype: str) -> Policy:
        """The params cast to "float32" or "bfloat16" (config.dtype follows)."""
        new = Policy.abstract(self.config.replace(dtype=dtype))
        params = jax.tree.map(lambda x: x.astype(new.config.param_dtype), self.params)
        return new.replace(params=params)

    def unstack_layers(self) -> Policy:
        """This policy with per-layer copies of the stacked layer weights, which `forward`
        then runs unrolled (the same numbers as the scan, read in place on CPU).

        Call it once outside a decoding loop (the engine does, per `model.layer_loop`):
        the copies cost one read of the layer weights and hold a second copy of them.
        """
        if self.layer_params is not None:
            return self
        stacked = self.params["layers"]
        return self.replace(layer_params=tuple(
            jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.config.num_layers)
        ))

    def without_stacked_layers(self) -> Policy:
        """This policy, with per-layer weights attached (`unstack_layers`), minus the stacked
        layer weights: each stacked leaf becomes an empty array (0 layers), so a program
        that only runs the unrolled forward does not take them as arguments.

        XLA counts a program's arguments against its memory limit and rematerialises (runs
        matmuls again) past it: an H100 decode step of a Qwen3-8B shape at batch 64 over a
        2k cache took both weight copies (31.6 GB) plus the cache (19.3 GB), went past the
        limit and recomputed matmuls (docs/results/gpu_programs.json). The stacked weights
        live on in the caller's policy; only this view drops them. Its scanned forward is an
        error (nothing to scan)."""
        if self.layer_params is None:
            raise ValueError("without_stacked_layers: attach the per-layer weights first "
                             "(unstack_layers); the forward would have no layers")
        params = nnx.State(dict(self.params))
        params["layers"] = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((0,) + tuple(a.shape[1:]), a.dtype)
            if isinstance(a, jax.ShapeDtypeStruct) else jnp.zeros((0,) + a.shape[1:], a.dtype),
            self.params["layers"])
        return self.replace(params=params)

    @property
    def stacked_layers_dropped(self) -> bool:
        """Whether the stacked layer weights were dropped (`without_stacked_layers`)."""
        leaf = jax.tree.leaves(self.params["layers"])[0]
        return leaf.shape[0] == 0

    def decodes_unrolled(self, cache_max_len: int, batch: int) -> bool:
        """Whether decoding with a cache of `cache_max_len` slots per row unrolls the layers:
        `model.layer_loop`, where "auto" unrolls on CPU and GPU (the platform programs are
        built for, `kernels.platform()`: a GPU target compiled for from a CPU counts as GPU).

        Inside a scan over the stacked weights XLA copies each layer's weight slices before
        its matmuls at every step, on CPU (docs/BENCHMARKS.md, "Layer weights") and on a GPU
        alike (an H100 compile: 2.0x the bytes of the unrolled step, docs/results/
        gpu_programs.json); the unrolled loop reads per-layer copies made once per call in
        place and hands the KV cache from layer to layer without copying it. Never with
        batch_invariant (its generation must equal the scanned training forward bit for
        bit), and not on TPU (not measured there). (`cache_max_len` and `batch` no longer
        decide; kept for callers.)"""
        del cache_max_len, batch
        loop = self.config.layer_loop
        if loop != "auto":
            return loop == "unroll"
        return platform() in UNROLL_PLATFORMS and not self.config.batch_invariant

    @property
    def module(self) -> Transformer:
        return nnx.merge(self.graphdef, self.params)

    @property
    def logical_axes(self):
        """PartitionSpecs of logical axis names, one per param (same tree as params)."""
        return nnx.get_partition_spec(self.params)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.zeros(self.config, batch, max_len)

    def embed(self, tokens):  # [B, T] int32 -> [B, T, H] (param dtype)
        return jnp.take(self.params["embed_tokens"][...], tokens, axis=0)

    def forward(
        self,
        tokens,  # [B, T] int32
        positions,  # [B, T] int32; < 0 marks padding (no cache write, never attended to)
        cache: KVCache | None = None,
        *,
        mask=None,  # [B, T, T] bool among the new tokens; default causal
        capture: tuple[int, ...] = (),
        head: bool = True,
        routing: bool = False,
        shard_rows: bool = False,
    ):
        """-> (logits [B,T,V] float32, {layer: hidden [B,T,H]}, cache); routing=True (an MoE
        policy only) appends {"router_logits": [L,B,T,E] float32, "experts": [L,B,T,K]
        int32}: every layer's router logits and chosen experts (a dense layer of a model
        mixing both reports 0 and -1), for the router losses and the routing metrics
        (jaxspec.models.moe).

        head=False returns the final-normed hidden states [B,T,H] instead of the logits, for
        losses fused with the LM head (jaxspec.rl.chunked).

        Each new token sees its row's cached prefix [0, lengths[b]) and the new tokens the
        mask allows. capture=(i, ...) returns the output of decoder layer i (0-based, before
        the final norm), HF's hidden_states[i + 1] (HF reports the last layer after the
        final norm). With cache=None nothing is stored and None is returned.

        shard_rows=True (the training steps; cache=None only) pins the activations to the
        batch sharding at every layer boundary, so that FSDP all-gathers each layer's weights
        instead of all-reducing activations (`parallel.constrain_rows`, docs/scaling.md).

        A float32 policy computes its matrix products in full float32 on every backend, never
        TF32 (`matmul_precision`).
        """
        with matmul_precision(self.config.dtype):
            return self._forward(tokens, positions, cache, mask=mask, capture=capture, head=head,
                                 routing=routing, shard_rows=shard_rows)

    def _forward(self, tokens, positions, cache, *, mask, capture, head, routing=False,
                 shard_rows=False):
        cfg = self.config
        if routing and not cfg.is_moe:
            raise ValueError(f"forward(routing=True): family {cfg.family!r} has no experts")
        if self.layer_params is None and self.stacked_layers_dropped:
            raise ValueError("forward: this policy's stacked layer weights were dropped "
                             "(without_stacked_layers) and no per-layer weights are attached")
        tokens = jnp.asarray(tokens)
        positions = jnp.asarray(positions)
        if tokens.ndim != 2 or positions.shape != tokens.shape:
            raise ValueError(
                f"forward: tokens {tokens.shape} and positions {positions.shape} must both be [B, T]"
            )
        b, t = tokens.shape
        capture = tuple(int(i) for i in capture)
        bad = [i for i in capture if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"forward: capture layers {bad} out of range [0, {cfg.num_layers})")
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.shape != (b, t, t):
                raise ValueError(f"forward: mask shape {mask.shape}; expected {(b, t, t)}")
        if cache is not None:
            if cache.batch != b:
                raise ValueError(f"forward: cache batch {cache.batch} != tokens batch {b}")
            if t > cache.max_len:
                raise CacheOverflowError(
                    f"forward feeds T={t} tokens per row but the KV cache holds max_len="
                    f"{cache.max_len}; use a larger cache (init_cache(batch, max_len>={t}))"
                )
            if _is_concrete(cache.lengths, positions):
                need = np.asarray(cache.lengths) + np.sum(np.asarray(positions) >= 0, axis=1)
                over = np.nonzero(need > cache.max_len)[0]
                if over.size:
                    raise CacheOverflowError(
                        f"forward would write past the KV cache: rows {over.tolist()} need "
                        f"{need[over].tolist()} slots, max_len={cache.max_len}"
                    )
        return _forward(self, tokens, positions, cache, mask, capture, bool(head), bool(routing),
                        bool(shard_rows))


jax.tree_util.register_dataclass(Policy)


def random_policy(config: ModelConfig, seed: int = 0) -> Policy:
    """Random weights like Policy.init's, but rescaled to ~1/sqrt(fan_in) and norm scales
    1 + 0.3 N(0,1), drawn with NumPy (the same weights on every backend).

    The HF-style init (std 0.02, unit norms) gives near-uniform logits, against which any
    tolerance is meaningless; these give logits of order 1-10 and non-trivial norms.
    """
    policy = Policy.abstract(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(policy.params)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = "/".join(str(getattr(k, "key", "")) for k in path)
        noise = rng.standard_normal(leaf.shape, np.float32)
        if name.endswith("scale"):
            value = 1.0 + 0.3 * noise
        elif "embed_tokens" in name:
            value = noise
        elif "down_proj" in name:
            width = (config.shared_expert_intermediate_size if "shared_expert" in name
                     else config.moe_intermediate_size if "moe" in name else config.intermediate_size)
            value = noise / np.sqrt(width)
        elif "o_proj" in name:
            value = noise / np.sqrt(config.num_heads * config.head_dim)
        else:
            value = noise / np.sqrt(config.hidden_size)
        out.append(jnp.asarray(value, config.param_dtype))
    return policy.replace(params=jax.tree_util.tree_unflatten(treedef, out))
