"""Transformer building blocks shared by the policy and the draft heads (EAGLE-3, MTP).

Every parameter carries logical axis names as nnx metadata (`out_sharding`, with
`eager_sharding=False` so that no mesh is needed to build a model); a mesh/rules module
maps them to mesh axes with `nnx.get_partition_spec` under `flax.linen.logical_axis_rules`.
Logical axes: vocab, embed, heads, kv_heads, head_dim, mlp (and layers, added by stacking).

Numerics follow HF `transformers` in the parameter dtype (norm statistics and RoPE angles
in float32, cast back before the multiply), so float32 parity is at rounding level and a
bfloat16 model rounds where the PyTorch one does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.kernels import WithAncestors, layer_array, platform, swiglu, tree_attention
from jaxspec.kernels import qkv as qkv_kernel
from jaxspec.kernels.flash import CausalMask, causal_attention
from jaxspec.kernels.flash import resolve as resolve_train_attention
from jaxspec.kernels.invariant import invariant_attention, invariant_dot, round_to, tree_sum, uncontracted
from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import MoE

INIT_STD = 0.02  # HF initializer_range


def logical_param(rngs: nnx.Rngs | None, shape, dtype, axes, *, init="normal") -> nnx.Param:
    """A parameter tagged with logical axis names, one per dimension."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    if init == "normal":
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        raise ValueError(f"init={init!r}; valid: 'normal', 'ones'")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """HF-style RMSNorm: statistics in float32, scale applied in the input dtype (`invariant`:
    the mean of squares summed in a fixed order, see jaxspec.kernels.invariant)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32, axis_name: str = "embed",
                 invariant: bool = False):
        self.eps = eps
        self.invariant = invariant
        self.scale = logical_param(None, (dim,), dtype, (axis_name,), init="ones")

    def __call__(self, x):  # [..., dim] -> [..., dim]
        x32 = x.astype(jnp.float32)
        if self.invariant:
            var = (tree_sum(jnp.square(x32)) / x32.shape[-1])[..., None]
        else:
            var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.scale[...] * normed


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); `kernel` as ModelConfig.fused_kernels."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs,
                 invariant: bool = False, kernel: str = "xla"):
        self.invariant = invariant
        self.kernel = kernel
        self.gate_proj = logical_param(rngs, (hidden_size, intermediate_size), dtype, ("embed", "mlp"))
        self.up_proj = logical_param(rngs, (hidden_size, intermediate_size), dtype, ("embed", "mlp"))
        self.down_proj = logical_param(rngs, (intermediate_size, hidden_size), dtype, ("mlp", "embed"))

    def __call__(self, x):  # [B, T, H] -> [B, T, H]
        if not self.invariant:
            b, t, h = x.shape
            if (x.dtype == self.gate_proj.dtype  # the kernel takes one dtype
                    and swiglu.use_fused(self.kernel, b * t, h, self.gate_proj.shape[1])):
                act = swiglu.swiglu(x.reshape(b * t, h), self.gate_proj[...], self.up_proj[...],
                                    platform() != "gpu").reshape(b, t, -1)
            else:
                gate = jnp.einsum("bth,hm->btm", x, self.gate_proj[...])
                up = jnp.einsum("bth,hm->btm", x, self.up_proj[...])
                act = jax.nn.silu(gate) * up
            return jnp.einsum("btm,mh->bth", act, self.down_proj[...])
        gate = invariant_dot(x, self.gate_proj[...])
        up = invariant_dot(x, self.up_proj[...])
        return invariant_dot(jax.nn.silu(gate) * up, self.down_proj[...])


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], with Llama-3 scaling if set.

    Computed in float32 with the same operations, in the same order, as transformers:
    a float64 computation differs from it by an ulp, which at position p shifts the
    angle by ~p * 1e-7 rad and costs 1e-5-level logit parity.
    """
    f32 = np.float32
    dim = config.head_dim
    exponent = np.arange(0, dim, 2).astype(f32) / f32(dim)
    inv_freq = f32(1.0) / (f32(config.rope_theta) ** exponent)
    scaling = config.rope_scaling
    if scaling is not None:
        factor = f32(scaling.factor)
        low, high = f32(scaling.low_freq_factor), f32(scaling.high_freq_factor)
        old_len = f32(scaling.original_max_position_embeddings)
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = f32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return np.asarray(inv_freq, f32)


def rope_tables(
    positions,  # [B, T] int; negative (padding) positions are treated as 0
    config: ModelConfig,
    dtype,
):  # -> cos, sin [B, T, head_dim] in dtype
    """RoPE's cos and sin per token, as `apply_rope` computes them (angles in float32, rounded
    to `dtype`), for the fused attention-input kernel (kernels.qkv)."""
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * jnp.asarray(
        rope_inv_freq(config))  # [B, T, D/2]
    emb = jnp.concatenate([angles, angles], axis=-1)  # [B, T, D]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(
    x,  # [B, T, heads, head_dim]
    positions,  # [B, T] int; negative (padding) positions are treated as 0
    config: ModelConfig,
):
    """Rotary embedding, HF "rotate_half" layout; angles in float32, product in x's dtype."""
    inv_freq = jnp.asarray(rope_inv_freq(config))
    pos = jnp.maximum(positions, 0).astype(jnp.float32)
    freqs = pos[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos = jnp.cos(emb).astype(x.dtype)
    sin = jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    if config.batch_invariant:  # no FMA: its contraction depends on the fusion (shapes)
        return uncontracted(x * cos) + uncontracted(rotated * sin)
    return x * cos + rotated * sin


def _per_row_shards(
    attention,  # (q, k, v, valid) -> out, row by row independent
    q,  # [B, T, heads, head_dim]
    k,  # [B, T, kv_heads, head_dim]
    v,  # [B, T, kv_heads, head_dim]
    valid,  # [B, T] bool
):  # -> [B, T, heads, head_dim]
    """`attention` on each device's rows (a shard_map over the mesh's batch axes) where it is
    cuDNN's under a mesh whose batch axes divide B; elsewhere called as is. Left to XLA's
    propagation, cuDNN's partitioner all-gathered q, k, v and the softmax statistics of every
    row in the FSDP update's backward (8 H100s, 5,120 tokens: 2,304 gathers of 335 MB)."""
    from jaxspec import parallel  # (jaxspec.parallel imports the models)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or resolve_train_attention(attention.keywords["implementation"],
                                             q.dtype) != "cudnn":
        return attention(q, k, v, valid)
    axes = tuple(a for a in (parallel.resolve_rules()["batch"] or ()) if mesh.shape[a] > 1)
    if not axes or q.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return attention(q, k, v, valid)
    rows = jax.sharding.PartitionSpec(axes[0] if len(axes) == 1 else axes)
    # manual over every mesh axis: cuDNN's partitioner fails inside a partly manual
    # shard_map (the other axes replicate the rows' attention, as their specs say)
    return jax.shard_map(attention, in_specs=(rows,) * 4, out_specs=rows,
                         axis_names=frozenset(mesh.axis_names), check_vma=False)(q, k, v, valid)


class Attention(nnx.Module):
    """GQA self-attention with optional QK-norm, in three steps: `project` (q/k/v, QK-norm,
    RoPE), `attend` (through `jaxspec.kernels.tree_attention`, config.attention_backend) and
    `output` (o_proj). `in_features` is the width q/k/v project from (H; EAGLE-3 uses 2H).
    """

    def __init__(self, config: ModelConfig, *, in_features: int | None = None, rngs: nnx.Rngs):
        self.config = config
        dtype = config.param_dtype
        f = config.hidden_size if in_features is None else in_features
        nq, nkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = logical_param(rngs, (f, nq, d), dtype, ("embed", "heads", "head_dim"))
        self.k_proj = logical_param(rngs, (f, nkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = logical_param(rngs, (f, nkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = logical_param(
            rngs, (nq, d, config.hidden_size), dtype, ("heads", "head_dim", "embed")
        )
        if config.qk_norm:
            inv = config.batch_invariant
            self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, axis_name="head_dim", invariant=inv)
            self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, axis_name="head_dim", invariant=inv)
        else:
            self.q_norm = None
            self.k_norm = None

    def project(
        self,
        x,  # [B, T, in_features]
        positions,  # [B, T] int32
    ):  # -> q [B, T, heads, head_dim], k, v [B, T, kv_heads, head_dim]; q and k after QK-norm and RoPE
        """The attention's inputs, as every caller (cached forward, TTT unroll) must compute them."""
        if self.config.batch_invariant:
            q, k, v = (invariant_dot(x, w[...]) for w in (self.q_proj, self.k_proj, self.v_proj))
        else:
            q = jnp.einsum("btf,fnd->btnd", x, self.q_proj[...])
            k = jnp.einsum("btf,fnd->btnd", x, self.k_proj[...])
            v = jnp.einsum("btf,fnd->btnd", x, self.v_proj[...])
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, positions, self.config), apply_rope(k, positions, self.config), v

    def project_normed(
        self,
        x,  # [B, T, H] the residual stream, before the layer's input norm
        norm: RMSNorm,  # the layer's input norm
        positions,  # [B, T] int32
    ):  # -> q, k, v as project(norm(x), positions) returns them
        """`project` of the normed input in one fused kernel (jaxspec.kernels.qkv): the norm's
        statistics here, the rest in the kernel (see ModelConfig.fused_kernels)."""
        b, t, f = x.shape
        cfg = self.config
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1) + norm.eps)  # [B, T]
        cos, sin = rope_tables(positions, cfg, x.dtype)
        scales = ((self.q_norm.scale[...], self.k_norm.scale[...]) if self.q_norm is not None
                  else (None, None))
        q, kv = qkv_kernel.qkv(
            x.reshape(b * t, f), inv.reshape(b * t), norm.scale[...], self.q_proj[...],
            self.k_proj[...], self.v_proj[...], *scales, cos.reshape(b * t, -1),
            sin.reshape(b * t, -1), float(cfg.rms_norm_eps), platform() != "gpu")
        kv = kv.reshape(b, t, 2, cfg.num_kv_heads, cfg.head_dim)
        return q.reshape(b, t, cfg.num_heads, cfg.head_dim), kv[:, :, 0], kv[:, :, 1]

    def output(self, heads):  # [B, T, heads, head_dim] -> [B, T, H]
        if self.config.batch_invariant:
            b, t, n, d = heads.shape
            return invariant_dot(heads.reshape(b, t, n * d), self.o_proj[...].reshape(n * d, -1))
        # One [B*T, n*d] x [n*d, H] matmul: the weight's reshape is free, where the einsum
        # over (n, d) made XLA's CPU backend transpose-copy o_proj at every decode step.
        b, t, n, d = heads.shape
        return jnp.dot(heads.reshape(b, t, n * d), self.o_proj[...].reshape(n * d, -1))

    def attend(
        self,
        q,  # [B, T, heads, head_dim] from `project`
        k,  # [B, T, kv_heads, head_dim]
        v,  # [B, T, kv_heads, head_dim]
        k_cache,  # [B, S, kv_heads, head_dim] or a kernels.CacheLayer (read as stored)
        v_cache,  # [B, S, kv_heads, head_dim] or a kernels.CacheLayer
        cache_lengths,  # [B] int32, <= S
        mask,  # [B, T, T] bool: new token i may attend to new token j; or a CausalMask
        positions=None,  # [B, T] int32 (needed by the batch-invariant mode)
        thread: bool = False,
    ):  # -> [B, T, heads, head_dim]; thread: (that, k_cache, v_cache) (kernels.tree_attention)
        """New tokens over the cached prefix plus the new tokens the mask allows; the cache
        is never cast or copied here (the default backend reads only its live blocks).

        A `CausalMask` (a forward with no cache: training and scoring) goes to
        `kernels.flash.causal_attention` per config.train_attention, which never forms the
        [B, heads, T, T] scores; "reference" and the batch-invariant forward take its dense
        mask instead."""
        if isinstance(mask, CausalMask):
            if self.config.batch_invariant or self.config.train_attention == "reference":
                mask = mask.dense()
            else:
                if k_cache.shape[1]:
                    raise ValueError("a CausalMask is for forwards with no cache; got a cache "
                                     f"of {k_cache.shape[1]} slots")
                out = _per_row_shards(functools.partial(
                    causal_attention, implementation=self.config.train_attention),
                    q, k, v, mask.valid)
                return (out, k_cache, v_cache) if thread else out
        if self.config.batch_invariant:
            if positions is None:
                raise ValueError("the batch-invariant attention needs the new tokens' positions")
            if isinstance(k_cache, WithAncestors):
                raise ValueError("the batch-invariant attention takes no ancestor keys "
                                 "(WithAncestors); feed the tree's nodes as new tokens")
            out = invariant_attention(
                q, layer_array(k_cache), layer_array(v_cache), cache_lengths, k, v, mask, positions
            )
            return (out, k_cache, v_cache) if thread else out
        return tree_attention(
            q, k_cache, v_cache, cache_lengths, k, v, mask,
            backend=self.config.attention_backend, thread=thread,
        )


class DecoderLayer(nnx.Module):
    """The one decoder layer of the project: x + attn(norm(x)), then x + mlp(norm(x)).

    The policy stacks it; the MTP head runs one; the EAGLE-3 head is one with
    `embed_input=True`: its attention then reads [input_layernorm(embedding); hidden_norm(x)]
    (2H wide) while x stays the residual. `attention_input`, `self_attn.project` and
    `finish` are its halves, for callers with their own attention pattern (the TTT loss).
    """

    def __init__(self, config: ModelConfig, *, embed_input: bool = False, rngs: nnx.Rngs):
        dtype, h, eps = config.param_dtype, config.hidden_size, config.rms_norm_eps
        inv = config.batch_invariant
        self.input_layernorm = RMSNorm(h, eps=eps, dtype=dtype, invariant=inv)
        self.hidden_norm = RMSNorm(h, eps=eps, dtype=dtype, invariant=inv) if embed_input else None
        self.self_attn = Attention(config, in_features=2 * h if embed_input else h, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, dtype=dtype, invariant=inv)
        self.sparse = config.sparse_layers
        # qwen3_moe: the experts (jaxspec.models.moe); a model mixing dense and sparse layers
        # stacks both MLPs in every layer, each layer running its own kind (`feed_forward`)
        self.mlp = MLP(h, config.intermediate_size, dtype=dtype, rngs=rngs,
                       invariant=config.batch_invariant,
                       kernel=config.fused_kernels) if config.has_dense_mlp else None
        self.moe = MoE(config, rngs=rngs) if config.is_moe else None

    def attention_input(
        self,
        x,  # [B, T, H] the residual stream
        embeds=None,  # [B, T, H] token embeddings (embed_input layers only)
    ):  # -> [B, T, H] or [B, T, 2H]
        if self.hidden_norm is None:
            return self.input_layernorm(x)
        return jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(x)], axis=-1)

    def feed_forward(
        self,
        h,  # [B, T, H] post-attention-normed
        index=None,  # int32 scalar: this layer's index (decides dense vs sparse when mixed)
    ):  # -> (out [B, T, H], routing): routing (router logits [B,T,E] f32, experts [B,T,K]) or None
        """The dense MLP, or the mixture of experts with its routing (dense layers of a mixed
        model report logits 0 and experts -1)."""
        if self.moe is None:
            return self.mlp(h), None
        if self.mlp is None:
            out, logits, experts = self.moe(h)
            return out, (logits, experts)
        b, t, _ = h.shape
        cfg = self.moe.config

        def dense(h):
            return (self.mlp(h).astype(h.dtype), jnp.zeros((b, t, cfg.num_experts), jnp.float32),
                    jnp.full((b, t, cfg.num_experts_per_tok), -1, jnp.int32))

        def sparse(h):
            out, logits, experts = self.moe(h)
            return out.astype(h.dtype), logits, experts

        if index is None:
            raise ValueError("a model mixing dense and sparse layers needs the layer index")
        out, logits, experts = jax.lax.cond(jnp.asarray(self.sparse)[index], sparse, dense, h)
        return out, (logits, experts)

    def finish(
        self,
        x,  # [B, T, H] the residual stream
        heads,  # [B, T, heads, head_dim] attention output before o_proj
        index=None,  # int32 scalar layer index (a model mixing dense and sparse layers)
        routing: bool = False,  # also return the MoE routing (feed_forward)
    ):  # -> [B, T, H] the layer's output (routing=True: (output, routing))
        x = x + self.self_attn.output(heads)
        out, route = self.feed_forward(self.post_attention_layernorm(x), index)
        return (x + out, route) if routing else x + out

    def __call__(
        self,
        x,  # [B, T, H]
        positions,  # [B, T]
        k_cache,  # [B, S, kv_heads, head_dim]
        v_cache,  # [B, S, kv_heads, head_dim]
        cache_lengths,  # [B]
        mask,  # [B, T, T] bool or a CausalMask (Attention.attend)
        embeds=None,  # [B, T, H] token embeddings (embed_input layers only)
        thread: bool = False,
        index=None,  # int32 scalar layer index (a model mixing dense and sparse layers)
        routing: bool = False,
    ):
        """Returns (x_out [B, T, H], k_new [B, T, kv_heads, head_dim], v_new); thread=True
        appends (k_cache, v_cache) as the attention passed them on (kernels.tree_attention);
        routing=True appends the MoE routing (`feed_forward`; None for a dense layer)."""
        if (embeds is None) != (self.hidden_norm is None):
            raise ValueError("embeds is required by (and only by) a layer built with embed_input=True")
        cfg = self.self_attn.config
        b, t, h = x.shape
        if (self.hidden_norm is None and not cfg.batch_invariant and x.dtype == cfg.param_dtype
                and qkv_kernel.use_fused(cfg.fused_kernels, b * t, h, cfg.head_dim)):
            q, k, v = self.self_attn.project_normed(x, self.input_layernorm, positions)
        else:
            q, k, v = self.self_attn.project(self.attention_input(x, embeds), positions)
        if self.self_attn.config.batch_invariant:  # float32 activations: keys as the cache stores them
            dtype = self.self_attn.config.param_dtype
            k, v = round_to(k, dtype), round_to(v, dtype)
        if thread:
            heads, k_cache, v_cache = self.self_attn.attend(q, k, v, k_cache, v_cache, cache_lengths,
                                                            mask, positions, thread=True)
            out = (k, v, k_cache, v_cache)
        else:
            heads = self.self_attn.attend(q, k, v, k_cache, v_cache, cache_lengths, mask, positions)
            out = (k, v)
        x, route = self.finish(x, heads, index, routing=True)
        return (x, *out, route) if routing else (x, *out)
