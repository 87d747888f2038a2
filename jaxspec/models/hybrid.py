"""Hybrid policies (`family: qwen3_5`, `qwen3_next`, `qwen3_5_moe`): Gated DeltaNet layers
between gated full-attention layers, as HF `Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` /
`Qwen3_5MoeForCausalLM` compute them.

A layer is a token mixer then a feed-forward, each with its residual:
- "linear_attention" (`GatedDeltaNet`): in_proj_qkv, a short depthwise causal convolution
  (silu), L2-normed queries and keys, the gated delta rule (jaxspec.models.gated_deltanet:
  chunked for a forward of several tokens, recurrent for one), an RMSNorm gated by
  silu(in_proj_z x), out_proj;
- "full_attention" (`GatedAttention`): GQA with QK-norm, RoPE on the first
  `partial_rotary_factor` of each head, and the output gated by sigmoid of a second half of
  q_proj's output (per head: [query | gate]);
- the feed-forward: the SwiGLU MLP, or (qwen3_next with experts, qwen3_5_moe) the MoE of
  jaxspec.models.moe with its gated shared expert, per `ModelConfig.sparse_layers`.
Every RMSNorm but the gated one stores its scale as an offset from 1 (HF's zero-centred
norm, `(x_normed * (1 + w)).to(dtype)`).

Layers of one kind are stacked (params "linear_layers", "full_layers", "mlps", "moes", each
on a leading axis over the layers of that kind) and the forward runs them unrolled in
`layer_types` order: the stack is not one scan of identical layers.

The cache (`HybridCache`) holds the full-attention layers' keys and values and the row
lengths (a `KVCache`), and per linear layer and row the convolution's last K-1 inputs, the
delta rule's state, and the tokens of the row's last verify not yet applied to them
(`PendingSteps`: a verify's accepted tokens, which the row's next forward applies first).
A linear layer reads a row's real tokens in order (padding, marked by positions < 0, never
enters a state), so the forward takes no tree mask: a tree of drafts needs one state per
node (issue 51).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.kernels import CacheLayer, tree_attention
from jaxspec.models.cache import CacheOverflowError, KVCache, new_token_mask
from jaxspec.models.config import ModelConfig, matmul_precision
from jaxspec.models.gated_deltanet import (
    causal_conv,
    delta_rule_chunked,
    delta_rule_invariant,
    delta_rule_recurrent,
    l2_normalize,
)
from jaxspec.kernels.blocked import layer_array
from jaxspec.kernels.invariant import (invariant_attention, invariant_dot, round_to, tree_sum,
                                       uncontracted)
from jaxspec.kernels.delta_rule import recurrent_stacked, stacked_rule
from jaxspec.kernels.flash import causal_attention
from jaxspec.models.layers import INIT_STD, MLP, _per_row_shards, logical_param
from jaxspec.models.moe import MoE
from jaxspec.models.transformer import param_path

__all__ = ["DeltaSteps", "GatedAttention", "GatedDeltaNet", "HybridCache", "HybridPolicy",
           "HybridTransformer", "layer_plan", "random_hybrid_policy"]

_STACKS = ("linear_layers", "full_layers", "mlps", "moes")


def layer_plan(config: ModelConfig) -> tuple[tuple[str, int, str, int], ...]:
    """Per layer: (mixer stack, index in it, feed-forward stack, index in it)."""
    seen = dict.fromkeys(_STACKS, 0)
    plan = []
    for kind, sparse in zip(config.layer_types, config.sparse_layers):
        mixer = "linear_layers" if kind == "linear_attention" else "full_layers"
        ffn = "moes" if sparse else "mlps"
        plan.append((mixer, seen[mixer], ffn, seen[ffn]))
        seen[mixer] += 1
        seen[ffn] += 1
    return tuple(plan)


def _stack_sizes(config: ModelConfig) -> dict[str, int]:
    sizes = dict.fromkeys(_STACKS, 0)
    for mixer, _, ffn, _ in layer_plan(config):
        sizes[mixer] += 1
        sizes[ffn] += 1
    return sizes


# --------------------------------------------------------------------------- layers


class CenteredRMSNorm(nnx.Module):
    """HF Qwen3.5's RMSNorm: statistics in float32, times (1 + scale), then the input dtype
    (`invariant`: the mean of squares by `tree_sum`, see jaxspec.kernels.invariant)."""

    def __init__(self, dim: int, eps: float, *, dtype, axis_name: str = "embed",
                 invariant: bool = False):
        self.eps = eps
        self.invariant = invariant
        self.scale = nnx.Param(jnp.zeros((dim,), dtype), out_sharding=(axis_name,),
                               eager_sharding=False)

    def __call__(self, x):  # [..., dim] -> [..., dim]
        normed = _rms_normed(x, self.eps, self.invariant)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def _rms_normed(x, eps: float, invariant: bool):  # [..., d] -> [..., d] float32
    """x / rms(x) in float32; `invariant`: the mean of squares by `tree_sum`."""
    x32 = x.astype(jnp.float32)
    if invariant:
        mean = (tree_sum(jnp.square(x32)) / x32.shape[-1])[..., None]
    else:
        mean = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(mean + eps)


class GatedDeltaNet(nnx.Module):
    """The linear-attention layer's mixer with its input norm (module docstring)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype, h = config.param_dtype, config.hidden_size
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + hv * dv
        self.input_layernorm = CenteredRMSNorm(h, config.rms_norm_eps, dtype=dtype,
                                               invariant=config.batch_invariant)
        if config.family == "qwen3_next":  # HF's fused projections, grouped by key head:
            # per key head [q (dk) | k (dk) | its r value heads' v (r dv) | their z (r dv)]
            # and [their b (r) | their a (r)], r = Hv / Hk
            hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
            r = hv // hk
            self.in_proj_qkvz = logical_param(rngs, (h, hk, 2 * dk + 2 * r * dv), dtype,
                                              ("embed", None, None))
            self.in_proj_ba = logical_param(rngs, (h, hk, 2 * r), dtype, ("embed", None, None))
        else:  # qwen3_5: [q | k | v] (the convolution's channels), z, b, a apart
            self.in_proj_qkv = logical_param(rngs, (h, conv_dim), dtype, ("embed", None))
            self.in_proj_z = logical_param(rngs, (h, hv * dv), dtype, ("embed", None))
            self.in_proj_b = logical_param(rngs, (h, hv), dtype, ("embed", None))
            self.in_proj_a = logical_param(rngs, (h, hv), dtype, ("embed", None))
        self.conv_weight = logical_param(rngs, (conv_dim, config.linear_conv_kernel_dim),
                                         dtype, (None, None))
        self.dt_bias = logical_param(None, (hv,), dtype, (None,), init="ones")
        self.A_log = logical_param(None, (hv,), dtype, (None,), init="ones")
        self.gate_norm = logical_param(None, (dv,), dtype, (None,), init="ones")
        self.out_proj = logical_param(rngs, (hv * dv, h), dtype, (None, "embed"))

    def project(
        self,
        h,  # [B, T, H] normed
    ):  # -> (mixed [B, T, conv_dim] = [q | k | v], z [B, T, Hv, dv], b [B, T, Hv], a [B, T, Hv])
        cfg = self.config
        b, t, _ = h.shape
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        inv = cfg.batch_invariant  # (float32 [B, T, ...] from fixed-shape dots)
        if cfg.family != "qwen3_next":
            # four views of h, so that XLA's dot merger does not fuse the four matmuls into
            # one over a concatenation of their weights, a copy of the layer's input
            # projections at every decode step on a GPU (169 MB per layer at Qwen3.5-27B)
            hq, hz, hb, ha = (h,) * 4 if inv else jax.lax.optimization_barrier((h, h, h, h))
            mm = invariant_dot if inv else jnp.matmul
            return (mm(hq, self.in_proj_qkv[...]),
                    mm(hz, self.in_proj_z[...]).reshape(b, t, hv, dv),
                    mm(hb, self.in_proj_b[...]), mm(ha, self.in_proj_a[...]))
        r = hv // hk
        if inv:
            qkvz, ba = invariant_dot(h, self.in_proj_qkvz[...]), invariant_dot(h, self.in_proj_ba[...])
        else:
            qkvz = jnp.einsum("bth,hgc->btgc", h, self.in_proj_qkvz[...])  # [B, T, Hk, ...]
            ba = jnp.einsum("bth,hgc->btgc", h, self.in_proj_ba[...])
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
        mixed = jnp.concatenate([a.reshape(b, t, -1) for a in (q, k, v)], axis=-1)
        return (mixed, z.reshape(b, t, hv, dv), ba[..., :r].reshape(b, t, hv),
                ba[..., r:].reshape(b, t, hv))

    def __call__(
        self,
        x,  # [B, T, H] the residual stream
        order,  # [B, T] int32: the row's real tokens first, in order, then its padding
        counts,  # [B] int32: real tokens per row
        conv_state,  # [B, conv_dim, K-1]
        state,  # [B, Hv, dk, dv] float32, or a CacheLayer of the stacked states (then the
        # stack comes back: kernels.delta_rule, where stacked_rule says)
        pending=None,  # None, or (PendingSteps of every layer [L, B, P, ..], index [] int32):
        # this layer's row-wise tokens of the last verify, run first (HybridCache.pending)
        defer: bool = False,
        recurrent: bool = False,
    ):  # -> (x [B, T, H], conv_state, state, new pending inputs of this layer or None)
        """The pending tokens (the accepted ones of the row's last verify) are applied to the
        committed states first. defer=False: then the new tokens; the states after all come
        back. defer=True (a verify): the states after the pending tokens come back, and the
        new tokens' rule inputs `(q, k, v, g, beta, x)` ([B, T, ..]) to become the pending
        ones (`HybridTransformer`), run by the row's next forward once `DeltaSteps.commit`
        has said how many were accepted."""
        cfg = self.config
        b, t, _ = x.shape
        dtype = x.dtype
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        h = jnp.take_along_axis(self.input_layernorm(x), order[:, :, None], axis=1)
        inputs, z, beta_in, rate_in = self.project(h)
        inv = cfg.batch_invariant
        if inv:  # the convolution's inputs as its state (param dtype) holds them
            inputs = round_to(inputs, cfg.param_dtype)
        mine = None
        if pending is not None:  # the convolution state after the accepted pending inputs
            steps, at = pending
            mine = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, at, keepdims=False),
                                steps.inputs())
            conv_state = _conv_after(conv_state, mine[5], steps.count)
        conv, new_conv_state = causal_conv(inputs, conv_state, self.conv_weight[...], counts,
                                           invariant=inv)
        mixed = jax.nn.silu(conv).astype(dtype)
        q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
        q = l2_normalize(q.reshape(b, t, hk, dk), invariant=inv) * dk ** -0.5
        k = l2_normalize(k.reshape(b, t, hk, dk), invariant=inv)
        v = v.reshape(b, t, hv, dv)
        real = (jnp.arange(t)[None, :] < counts[:, None])[..., None]  # [B, T, 1]
        beta = jnp.where(real, jax.nn.sigmoid(beta_in).astype(jnp.float32), 0.0)
        rate = jax.nn.softplus(rate_in.astype(jnp.float32)
                               + self.dt_bias[...].astype(jnp.float32))
        g = jnp.where(real, -jnp.exp(self.A_log[...].astype(jnp.float32)) * rate, 0.0)
        f32 = jnp.float32
        if isinstance(state, CacheLayer):  # the stacked states, in place (one GPU): one pass
            # over the state for the pending tokens and the new ones
            extra = None if pending is None else (steps.count,) + steps.inputs()[:5]
            out, new_state = recurrent_stacked(q.astype(f32), k.astype(f32), v.astype(f32), g,
                                               beta, state.stack, state.index, extra,
                                               write="pending" if defer else "all",
                                               out_dtype=dtype)  # (as cast below)
        else:
            # the batch-invariant forward: one form everywhere (gated_deltanet)
            one = delta_rule_invariant if inv else delta_rule_recurrent
            if pending is not None:
                state = one(*_kept_steps(mine[:5], steps.count), state)[1]
            rule = one if t == 1 or defer or recurrent or inv else delta_rule_chunked
            out, new_state = rule(q, k, v, g, beta, state)
            if defer:  # the state after the pending tokens
                new_state = state
        new = None
        if defer:  # this verify's tokens, the next pending ones
            new = (q.astype(f32), k.astype(f32), v.astype(f32), g, beta, inputs)
            new_conv_state = conv_state
        out = out.astype(dtype)
        # the gated RMSNorm: normed in float32, scaled in the dtype, gated by silu(z) in float32
        normed = _rms_normed(out, cfg.rms_norm_eps, inv).astype(dtype)
        gated = ((self.gate_norm[...] * normed).astype(jnp.float32)
                 * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
        y = (invariant_dot if inv else jnp.matmul)(gated.reshape(b, t, hv * dv),
                                                    self.out_proj[...])
        inverse = jnp.argsort(order, axis=1)
        return x + jnp.take_along_axis(y, inverse[:, :, None], axis=1), new_conv_state, \
            new_state, new


def _kept_steps(
    steps,  # (q [B, P, Hk, dk], k, v [B, P, Hv, dv], g [B, P, Hv], beta) float32
    count,  # [B] int32: the first count[b] tokens of row b are kept
):  # -> the same with the later tokens made identity steps (g, beta, k, v zero: S unchanged)
    q, k, v, g, beta = steps
    keep = jnp.arange(g.shape[1])[None, :] < count[:, None]  # [B, P]
    return (q, jnp.where(keep[..., None, None], k, 0.0), jnp.where(keep[..., None, None], v, 0.0),
            jnp.where(keep[..., None], g, 0.0), jnp.where(keep[..., None], beta, 0.0))


def _conv_after(
    conv_state,  # [B, C, K-1] the committed convolution state
    inputs,  # [B, P, C] the pending tokens' convolution inputs
    count,  # [B] int32: the first count[b] of them are kept
):  # -> [B, C, K-1]: the last K-1 inputs of [conv_state, inputs[:count]] (no concatenation:
    # a [B, C, K-1+P] window is a copy of the inputs on a GPU)
    width = conv_state.shape[-1]
    at = count[:, None] + jnp.arange(width)[None, :]  # [B, K-1] into [conv_state, inputs]
    old = jnp.take_along_axis(conv_state, jnp.minimum(at, width - 1)[:, None, :], axis=2)
    new = jnp.take_along_axis(inputs, jnp.maximum(at - width, 0)[:, :, None], axis=1)
    return jnp.where((at < width)[:, None, :], old, jnp.swapaxes(new, 1, 2).astype(old.dtype))


def rope_partial_inv_freq(config: ModelConfig) -> np.ndarray:  # -> [rotary_dim // 2] float32
    """Inverse frequencies of the rotated dims, in float32 as transformers computes them."""
    f32 = np.float32
    dim = config.rotary_dim
    return f32(1.0) / (f32(config.rope_theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim)))


def apply_partial_rope(
    x,  # [B, T, heads, head_dim]
    positions,  # [B, T] int; negative (padding) treated as 0
    config: ModelConfig,
):  # -> [B, T, heads, head_dim]: the first rotary_dim dims rotated (rotate_half), the rest as is
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * jnp.asarray(
        rope_partial_inv_freq(config))
    emb = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    r = config.rotary_dim
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    if config.batch_invariant:  # no FMA: its contraction depends on the fusion (shapes)
        return jnp.concatenate([uncontracted(rot * cos) + uncontracted(rotated * sin), rest], -1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


class GatedAttention(nnx.Module):
    """Full attention with an output gate (module docstring) and its input norm."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype, h, eps = config.param_dtype, config.hidden_size, config.rms_norm_eps
        nq, nkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        inv = config.batch_invariant
        self.input_layernorm = CenteredRMSNorm(h, eps, dtype=dtype, invariant=inv)
        # per head [query | gate], as HF's q_proj output viewed [.., heads, 2 * head_dim]
        self.q_proj = logical_param(rngs, (h, nq, 2 * d), dtype, ("embed", "heads", None))
        self.k_proj = logical_param(rngs, (h, nkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = logical_param(rngs, (h, nkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = logical_param(rngs, (nq, d, h), dtype, ("heads", "head_dim", "embed"))
        self.q_norm = CenteredRMSNorm(d, eps, dtype=dtype, axis_name="head_dim", invariant=inv)
        self.k_norm = CenteredRMSNorm(d, eps, dtype=dtype, axis_name="head_dim", invariant=inv)

    def __call__(
        self,
        x,  # [B, T, H] the residual stream
        positions,  # [B, T] int32
        k_cache,  # [B, S, kv_heads, head_dim], or a CacheLayer of the stacked cache
        v_cache,  # [B, S, kv_heads, head_dim], or a CacheLayer
        cache_lengths,  # [B] int32, <= S
        mask,  # [B, T, T] bool among the new tokens
    ):  # -> (x [B, T, H], k [B, T, kv_heads, head_dim], v), + the stacks for CacheLayers
        cfg = self.config
        q, gate, k, v = self.project_gated(self.input_layernorm(x), positions)
        threaded = isinstance(k_cache, CacheLayer)
        if cfg.batch_invariant:  # keys by absolute position, cached or new, in every forward
            heads = invariant_attention(q, layer_array(k_cache), layer_array(v_cache),
                                        cache_lengths, k, v, mask, positions)
            heads = (heads, k_cache, v_cache) if threaded else heads
        elif not threaded and k_cache.shape[1] == 0 and cfg.train_attention != "reference":
            # no cache (training, scoring): causal over the real tokens without [B, heads,
            # T, T] scores (kernels.flash, model.train_attention), as the dense policy does
            heads = _per_row_shards(functools.partial(
                causal_attention, implementation=cfg.train_attention), q, k, v, positions >= 0)
        else:
            heads = tree_attention(q, k_cache, v_cache, cache_lengths, k, v, mask,
                                   backend=cfg.attention_backend, thread=threaded)
        if threaded:  # the stacks passed on (kernels.blocked): XLA keeps one buffer
            heads, k_cache, v_cache = heads
        x = self.gated_output(x, heads, gate)
        return (x, k, v, k_cache.stack, v_cache.stack) if threaded else (x, k, v)

    def project_gated(
        self,
        h,  # [B, T, H] input-normed
        positions,  # [B, T] int32
    ):  # -> (q [B, T, heads, d] normed + RoPE, gate [B, T, heads, d], k [B, T, kv_heads, d], v)
        cfg = self.config
        d = cfg.head_dim
        if cfg.batch_invariant:  # float32 from fixed-shape dots; keys and values rounded as
            # the cache stores them (kernels.invariant.round_to)
            qg, k, v = (invariant_dot(h, w[...]) for w in (self.q_proj, self.k_proj, self.v_proj))
            v = round_to(v, cfg.param_dtype)
        else:
            qg = jnp.einsum("btf,fnd->btnd", h, self.q_proj[...])
            k = jnp.einsum("btf,fnd->btnd", h, self.k_proj[...])
            v = jnp.einsum("btf,fnd->btnd", h, self.v_proj[...])
        # normed beside its gate half, then sliced: the query half of the projection fed to
        # the norm is a copy on a GPU (2.1 MB per layer at Qwen3.5-9B, batch 64, 4 tokens)
        q = self.q_norm(qg.reshape(qg.shape[:-1] + (2, d)))[..., 0, :]
        q = apply_partial_rope(q, positions, cfg)
        k = apply_partial_rope(self.k_norm(k), positions, cfg)
        if cfg.batch_invariant:
            k = round_to(k, cfg.param_dtype)
        return q, qg[..., d:], k, v

    def gated_output(
        self,
        x,  # [B, T, H] the layer's input (residual stream)
        heads,  # [B, T, heads, d] attention output
        gate=None,  # [B, T, heads, d]; None: recomputed from x
    ):  # -> [B, T, H]: x + o_proj(heads * sigmoid(gate))
        d = self.config.head_dim
        inv = self.config.batch_invariant
        if gate is None:
            h, w = self.input_layernorm(x), self.q_proj[...][..., d:]
            gate = invariant_dot(h, w) if inv else jnp.einsum("btf,fnd->btnd", h, w)
        heads = heads * jax.nn.sigmoid(gate)
        b, t, n, _ = heads.shape
        return x + (invariant_dot if inv else jnp.dot)(heads.reshape(b, t, n * d),
                                                       self.o_proj[...].reshape(n * d, -1))


class FeedForward(nnx.Module):
    """post_attention_layernorm, then the SwiGLU MLP or the experts."""

    def __init__(self, config: ModelConfig, *, sparse: bool, rngs: nnx.Rngs):
        dtype, h = config.param_dtype, config.hidden_size
        inv = config.batch_invariant
        self.post_attention_layernorm = CenteredRMSNorm(h, config.rms_norm_eps, dtype=dtype,
                                                        invariant=inv)
        self.mlp = None if sparse else MLP(h, config.intermediate_size, dtype=dtype, rngs=rngs,
                                           invariant=inv)
        self.moe = MoE(config, rngs=rngs) if sparse else None

    def __call__(self, x):  # [B, T, H] -> [B, T, H]
        h = self.post_attention_layernorm(x)
        out = self.mlp(h) if self.moe is None else self.moe(h)[0]
        return x + out.astype(x.dtype)


def _stacked(make, n: int, rngs: nnx.Rngs):
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_all(rngs):
        return make(rngs)

    return make_all(rngs)


class HybridTransformer(nnx.Module):
    """Embedding, the layers by kind (stacked per kind), final norm, LM head (or tied)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not config.is_hybrid:
            raise ValueError(f"HybridTransformer: family {config.family!r} is not hybrid")
        self.config = config
        dtype = config.param_dtype
        sizes = _stack_sizes(config)
        self.embed_tokens = logical_param(
            rngs, (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed"))
        self.linear_layers = _stacked(lambda r: GatedDeltaNet(config, rngs=r),
                                      sizes["linear_layers"], rngs)
        self.full_layers = _stacked(lambda r: GatedAttention(config, rngs=r),
                                    sizes["full_layers"], rngs)
        self.mlps = _stacked(lambda r: FeedForward(config, sparse=False, rngs=r),
                             sizes["mlps"], rngs)
        self.moes = _stacked(lambda r: FeedForward(config, sparse=True, rngs=r),
                             sizes["moes"], rngs)
        self.norm = CenteredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                    invariant=config.batch_invariant)
        self.lm_head = None if config.tie_embeddings else logical_param(
            rngs, (config.hidden_size, config.vocab_size), dtype, ("embed", "vocab"))

    def __call__(
        self,
        tokens,  # [B, T] int32
        positions,  # [B, T] int32; < 0 marks padding
        cache: HybridCache,
        mask,  # [B, T, T] bool (causal among the real tokens)
        capture: tuple[int, ...] = (),
        head: bool = True,
        defer: bool = False,
        layer_params: dict | None = None,  # {stack: per-layer params} (unstack_layers)
        recurrent: bool = False,  # the recurrent rule for several tokens too (delta_rule)
    ):  # -> (logits [B, T, V] f32 or hidden [B, T, H], {layer: [B, T, H]}, HybridCache,
        #     DeltaSteps or None); defer: see GatedDeltaNet
        cfg = self.config
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if cfg.batch_invariant:  # float32 activations (see jaxspec.kernels.invariant)
            x = x.astype(jnp.float32)
        valid, mask = new_token_mask(positions, mask)
        order = jnp.argsort(~valid, axis=1, stable=True).astype(jnp.int32)
        counts = jnp.sum(valid, axis=1, dtype=jnp.int32)
        lengths = jnp.minimum(cache.lengths, cache.max_len)
        split = {name: nnx.split(getattr(self, name)) for name in _STACKS
                 if getattr(self, name) is not None}

        def layer(name, j):
            graphdef, params = split[name]
            if layer_params is not None:  # per-layer arrays: read in place (no slice copy)
                return nnx.merge(graphdef, layer_params[name][j])
            return nnx.merge(graphdef, jax.tree.map(lambda a: a[j], params))

        # The states are updated in place layer by layer and the attention reads its layer
        # of the stacked KV cache unsliced (a slice or a stack of per-layer results is a
        # copy of the whole state or cache layer in XLA).
        conv_all, state_all = cache.conv, cache.state
        pending = cache.pending if cache.pending.g.shape[2] else None  # (a buffer of 0: none)
        fresh = pending  # this verify's tokens, written layer by layer
        # Where the kernel runs (one GPU) a commit leaves the kept tokens pending and the next
        # forward applies them in its one pass over the state; elsewhere (CPU, a mesh, the
        # batch-invariant rule) the commit applies them at once (`DeltaSteps.settle`), which
        # XLA on CPU ran at 0.08 ms against 0.65 ms inside the next verify (4 pending tokens,
        # configs/hybrid.yaml's shape), so no forward there reads pending tokens
        fold = (pending is not None and not cfg.batch_invariant
                and stacked_rule(1, state_all, True))
        k_stack, v_stack = cache.kv.k, cache.kv.v
        keys, values, captured = [], [], {}
        for i, (mixer, m, ffn, f) in enumerate(layer_plan(cfg)):
            if mixer == "linear_layers":
                # read and written at a traced index: XLA then updates the stacked state in
                # place from its own slice (at a constant one it copies the slice first)
                at = jax.lax.optimization_barrier(jnp.asarray(m, jnp.int32))
                kernel = (k_stack.shape[2] > 0 and not cfg.batch_invariant  # decoding (a
                          # cache), no grads; the invariant rule runs in XLA everywhere
                          and stacked_rule(tokens.shape[1], state_all, defer or recurrent))
                x, conv, state, new = layer(mixer, m)(
                    x, order, counts, jax.lax.dynamic_index_in_dim(conv_all, at, keepdims=False),
                    CacheLayer(state_all, at) if kernel else
                    jax.lax.dynamic_index_in_dim(state_all, at, keepdims=False),
                    # (the buffer as the earlier layers wrote it: theirs changed, not this
                    # layer's; reading the unwritten one would keep a copy of it alive)
                    (fresh, at) if fold else None, defer, recurrent)
                # the states after the pending tokens (deferred) or after every token
                conv_all = jax.lax.dynamic_update_index_in_dim(conv_all, conv, at, 0)
                if kernel:  # the kernel wrote the stack in place
                    state_all = state
                else:
                    state_all = jax.lax.dynamic_update_index_in_dim(state_all, state, at, 0)
                if defer:  # into the pending buffer in place, after the layer read its own
                    # (the barrier orders the write after the reads: else XLA copies the
                    # buffer for them, 50-100 MB per layer at Qwen3.5-9B, batch 64)
                    conv_all, state_all, fresh = jax.lax.optimization_barrier(
                        (conv_all, state_all, fresh))
                    fresh = fresh.written(at, new)
            elif k_stack.shape[2]:  # slots to attend to
                index = jnp.asarray(m, jnp.int32)
                x, k, v, k_stack, v_stack = layer(mixer, m)(
                    x, positions, CacheLayer(k_stack, index), CacheLayer(v_stack, index),
                    lengths, mask)
                keys.append(k)
                values.append(v)
            else:  # a stateless forward: no cached slots
                x, k, v = layer(mixer, m)(x, positions, k_stack[m], v_stack[m], lengths, mask)
                keys.append(k)
                values.append(v)
            x = layer(ffn, f)(x)
            if i in capture:
                captured[i] = x
        x = self.norm(x)
        if head:
            x = self.logits(x)
        kv = dataclasses.replace(cache.kv, k=k_stack, v=v_stack)
        if keys and kv.max_len:  # (a stateless forward's cache holds no slots)
            kv = kv.write(jnp.stack(keys), jnp.stack(values), valid)
        kv = kv.advance(valid)
        if pending is not None:  # applied: none pending until a commit says how many
            fresh = dataclasses.replace(fresh, count=jnp.zeros_like(pending.count))
        cache = HybridCache(kv=kv, conv=conv_all, state=state_all,
                            pending=cache.pending if pending is None else fresh)
        return x, captured, cache, DeltaSteps(tokens.shape[1], settle=not fold,
                                              invariant=cfg.batch_invariant) if defer else None

    def logits(self, h):  # [B, T, H] final-normed -> [B, T, V] float32 (the LM head, or tied)
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        if self.config.batch_invariant:
            return invariant_dot(h, w, jnp.float32)
        return jnp.einsum("bth,hv->btv", h, w, preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------- cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """A hybrid policy's decoding state: the full-attention layers' keys/values with the row
    lengths, and per linear layer and row the convolution's and the delta rule's states."""

    kv: KVCache  # [L_full, batch, max_len, kv_heads, head_dim] and lengths [batch]
    conv: jax.Array  # [L_linear, batch, conv_dim, K-1] (param dtype): last K-1 conv inputs
    state: jax.Array  # [L_linear, batch, Hv, dk, dv] float32: the delta rule's state
    # per row, the accepted tokens of its last verify, not yet in conv and state (the row's
    # next forward applies them: docs/design.md, "Hybrid policies"); a buffer of P tokens
    # (P = 0: no verify defers into this cache)
    pending: PendingSteps

    @property
    def batch(self) -> int:
        return self.kv.batch

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def lengths(self):  # -> [batch] int32
        return self.kv.lengths

    @property
    def overflowed(self):  # -> [batch] bool
        return self.kv.overflowed

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int,
              pending: int = 0) -> HybridCache:
        """Empty rows; `pending`: the most tokens a verify forward into it feeds (k + 1)."""
        sizes = _stack_sizes(config)
        if batch < 1 or max_len < 0 or pending < 0:
            raise ValueError(f"HybridCache sizes: batch={batch} (>= 1), max_len={max_len} "
                             f"(>= 0), pending={pending} (>= 0)")
        full = sizes["full_layers"]
        shape = (full, batch, max_len, config.num_kv_heads, config.head_dim)
        kv = KVCache(k=jnp.zeros(shape, config.param_dtype),
                     v=jnp.full(shape, -0.0, config.param_dtype),
                     lengths=jnp.zeros((batch,), jnp.int32))
        linear = sizes["linear_layers"]
        hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        return cls(
            kv=kv,
            conv=jnp.zeros((linear, batch, conv_dim, config.linear_conv_kernel_dim - 1),
                           config.param_dtype),
            state=jnp.zeros((linear, batch, hv, dk, dv), jnp.float32),
            pending=PendingSteps(
                q=jnp.zeros((linear, batch, pending, hk, dk), jnp.float32),
                k=jnp.zeros((linear, batch, pending, hk, dk), jnp.float32),
                v=jnp.zeros((linear, batch, pending, hv, dv), jnp.float32),
                g=jnp.zeros((linear, batch, pending, hv), jnp.float32),
                beta=jnp.zeros((linear, batch, pending, hv), jnp.float32),
                x=jnp.zeros((linear, batch, pending, conv_dim), config.param_dtype),
                count=jnp.zeros((batch,), jnp.int32)),
        )

    @functools.partial(jax.jit, static_argnames=("invariant",))
    def settled(self, invariant: bool = False) -> HybridCache:
        """This cache with the pending tokens applied to the convolution and delta-rule
        states (the recurrent rule in XLA; `invariant`: the batch-invariant one, as a
        `batch_invariant` policy's forwards run it) and none left pending: the states plain
        decoding of the same tokens holds."""
        p = self.pending
        if not p.g.shape[2]:
            return self
        rule = delta_rule_invariant if invariant else delta_rule_recurrent
        conv, state = self.conv, self.state
        for at in range(p.g.shape[0]):  # updated layer by layer (a stack of per-layer
            # results is a copy of all the states); at a constant index, which CPU runs at
            # the stack's speed and the forward's traced one (optimization_barrier) at 2x
            mine = tuple(a[at] for a in p.inputs())
            conv = conv.at[at].set(_conv_after(conv[at], mine[5], p.count))
            state = state.at[at].set(rule(*_kept_steps(mine[:5], p.count), state[at])[1])
        return dataclasses.replace(self, conv=conv, state=state,
                                   pending=dataclasses.replace(p, count=jnp.zeros_like(p.count)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingSteps:
    """Per linear layer and row, the delta rule's and the convolution's inputs of the tokens
    a verify fed (the first `count` kept, by `DeltaSteps.commit`), in a buffer of P tokens."""

    q: jax.Array  # [L_linear, B, P, Hk, dk] float32, L2-normed and scaled
    k: jax.Array  # [L_linear, B, P, Hk, dk] float32, L2-normed
    v: jax.Array  # [L_linear, B, P, Hv, dv] float32
    g: jax.Array  # [L_linear, B, P, Hv] float32 log decay
    beta: jax.Array  # [L_linear, B, P, Hv] float32
    x: jax.Array  # [L_linear, B, P, conv_dim] (param dtype): the convolution's inputs
    count: jax.Array  # [B] int32: tokens kept per row (0: none pending)

    def inputs(self) -> tuple:  # -> (q, k, v, g, beta, x)
        return self.q, self.k, self.v, self.g, self.beta, self.x

    def written(
        self,
        layer,  # [] int32
        new: tuple,  # (q [B, T, Hk, dk], k, v [B, T, Hv, dv], g [B, T, Hv], beta, x [B, T, C])
    ) -> PendingSteps:
        """These with `layer`'s first T tokens replaced by `new` (in place; the later ones,
        stale, are never kept: a commit keeps at most T)."""
        out = [jax.lax.dynamic_update_slice(a, n[None].astype(a.dtype),
                                            (layer,) + (0,) * (a.ndim - 1))
               for a, n in zip(self.inputs(), new)]
        return PendingSteps(*out, count=self.count)


# --------------------------------------------------------------------------- policy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaSteps:
    """What a verify forward (`forward(defer_state=True)`) over `tokens` fed tokens left
    pending in the cache: `commit` says how many of them each row keeps."""

    tokens: int = dataclasses.field(metadata=dict(static=True))
    # the commit applies the kept tokens at once (`HybridCache.settled`) instead of leaving
    # them to the next forward: wherever that forward would not run the kernel (see
    # HybridTransformer.__call__), so it never has to read them
    settle: bool = dataclasses.field(default=False, metadata=dict(static=True))
    invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))  # its rule

    def commit(
        self,
        cache: HybridCache,
        accepted,  # [B] int32: the fed tokens (real ones, in order) whose updates are kept
    ) -> HybridCache:
        """The cache with each row's first `accepted` fed tokens pending: the row's next
        forward applies their updates to the committed states as it reads them (the later
        tokens' are skipped), then runs its own; nothing is recomputed here (docs/design.md,
        "Hybrid policies"). With `settle` (wherever the next forward would not run the
        kernel: CPU, a mesh, the batch-invariant rule) `HybridCache.settled` applies them at
        once instead. The KV cache and the
        lengths are left to `jaxspec.models.cache.compact`."""
        accepted = jnp.clip(jnp.asarray(accepted, jnp.int32), 0, self.tokens)
        cache = dataclasses.replace(cache, pending=dataclasses.replace(cache.pending,
                                                                       count=accepted))
        return cache.settled(self.invariant) if self.settle else cache


@functools.partial(jax.jit, static_argnames=("capture", "head", "stateless", "defer"))
def _forward(policy, tokens, positions, cache, mask, capture, head, stateless, defer=False):
    model = nnx.merge(policy.graphdef, policy.params)
    logits, captured, cache, steps = model(tokens, positions, cache, mask, capture, head, defer,
                                           policy.layer_params,
                                           policy.delta_rule == "recurrent")
    out = (logits, captured, None if stateless else cache)
    return out + (steps,) if defer else out


@dataclasses.dataclass(frozen=True)
class HybridPolicy:
    """A hybrid policy as a pytree (static config + graphdef, params as leaves) with
    `Policy.forward`'s contract: forward(tokens, positions, cache, *, mask, capture, head)
    -> (logits, captured, cache)."""

    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    graphdef: nnx.GraphDef = dataclasses.field(metadata=dict(static=True))
    params: nnx.State
    # {stack: (layer 0's params, ...)}: per-layer copies of the stacked weights, which the
    # forward reads in place instead of slicing the stacks (`unstack_layers`)
    layer_params: dict | None = None
    # the delta rule of a forward of several tokens: "chunked" (HF's form; the default), or
    # "recurrent" (a scan over the tokens; the trainer's choice on CPU, where it ran the
    # GRPO gradient 5x faster at the configs/hybrid.yaml shape). One token: recurrent always.
    delta_rule: str = dataclasses.field(default="chunked", metadata=dict(static=True))
    # the most tokens a verify forward defers (k + 1 of the deepest chain): the size of
    # init_cache's pending buffer (HybridCache.pending); 0: no verify (plain decoding)
    pending_tokens: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self):
        if self.delta_rule not in ("chunked", "recurrent"):
            raise ValueError(f"HybridPolicy.delta_rule={self.delta_rule!r}; valid: 'chunked', "
                             "'recurrent'")
        if not isinstance(self.pending_tokens, int) or self.pending_tokens < 0:
            raise ValueError(f"HybridPolicy.pending_tokens={self.pending_tokens!r}; valid: an "
                             "int >= 0 (k + 1 of the deepest verified chain)")

    def unstack_layers(self) -> HybridPolicy:
        """This policy with per-layer copies of its stacked weights, which `forward` reads
        instead of slicing a stack per layer (a slice feeding a matmul is a copy of the
        layer's weights at every step on a GPU: 2.8x the decode floor at a Qwen3.5-27B
        shape, docs/BENCHMARKS.md). The same numbers. Call it once outside a decoding loop:
        the copies cost one read of the weights and hold a second copy of them."""
        if self.layer_params is not None:
            return self
        stacks = {name: self.params[name] for name in _STACKS if name in self.params}
        return self.replace(layer_params={
            name: tuple(jax.tree.map(lambda a, j=j: a[j], stack)
                        for j in range(jax.tree.leaves(stack)[0].shape[0]))
            for name, stack in stacks.items() if jax.tree.leaves(stack)})

    def without_stacked_layers(self) -> HybridPolicy:
        """This policy with per-layer weights attached (`unstack_layers`) minus the stacked
        weights (each an empty array): a program that runs the forward from the per-layer
        copies does not take both as arguments (XLA counts arguments against its memory
        limit and rematerialises past it)."""
        if self.layer_params is None:
            raise ValueError("without_stacked_layers: attach the per-layer weights first "
                             "(unstack_layers); the forward would have no layers")
        params = nnx.State(dict(self.params))
        for name in self.layer_params:
            params[name] = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct((0,) + tuple(a.shape[1:]), a.dtype)
                if isinstance(a, jax.ShapeDtypeStruct) else jnp.zeros((0,) + a.shape[1:], a.dtype),
                self.params[name])
        return self.replace(params=params)

    @classmethod
    def abstract(cls, config: ModelConfig) -> HybridPolicy:
        """Shapes/dtypes only (ShapeDtypeStruct leaves)."""
        module = nnx.eval_shape(lambda: HybridTransformer(config, rngs=nnx.Rngs(params=0)))
        graphdef, params = nnx.split(module)
        return cls(config=config, graphdef=graphdef, params=params)

    @classmethod
    def init(cls, config: ModelConfig, key) -> HybridPolicy:
        """transformers' init: normal(0.02) weights, zero-centred norms 0, the gated norm and
        dt_bias 1, A_log = log(uniform(0.01, 16)) (from one key, drawn with NumPy)."""
        seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
        return _drawn(cls.abstract(config), seed, hf_init=True)

    def replace(self, **changes) -> HybridPolicy:
        return dataclasses.replace(self, **changes)

    def with_config(self, **changes) -> HybridPolicy:
        """The same params (and per-layer copies) under a changed config, e.g.
        with_config(batch_invariant=True): the graphdef is rebuilt (modules read their settings
        from it); a change of the parameters' shapes or dtypes is an error (astype: dtype)."""
        new = HybridPolicy.abstract(self.config.replace(**changes))
        shapes = lambda p: [(tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(p)]  # noqa: E731
        if (jax.tree.structure(new.params) != jax.tree.structure(self.params)
                or shapes(new.params) != shapes(self.params)):
            raise ValueError(f"with_config({changes}) changes the parameters; valid: changes "
                             "that keep every parameter's shape and dtype")
        return dataclasses.replace(self, config=new.config, graphdef=new.graphdef)

    def astype(self, dtype: str) -> HybridPolicy:
        """The params cast to "float32" or "bfloat16" (config.dtype follows)."""
        new = HybridPolicy.abstract(self.config.replace(dtype=dtype))
        return new.replace(params=jax.tree.map(lambda x: x.astype(new.config.param_dtype),
                                               self.params), delta_rule=self.delta_rule,
                           pending_tokens=self.pending_tokens)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))

    @property
    def logical_axes(self):
        return nnx.get_partition_spec(self.params)

    @property
    def module(self) -> HybridTransformer:  # (its `logits`: the LM head draft heads run)
        return nnx.merge(self.graphdef, self.params)

    def init_cache(self, batch: int, max_len: int) -> HybridCache:
        return HybridCache.zeros(self.config, batch, max_len, self.pending_tokens)

    def embed(self, tokens):  # [B, T] int32 -> [B, T, H]
        return jnp.take(self.params["embed_tokens"][...], tokens, axis=0)

    def forward(
        self,
        tokens,  # [B, T] int32
        positions,  # [B, T] int32; < 0 marks padding (no cache write, no state update)
        cache: HybridCache | None = None,
        *,
        mask=None,  # None, or [B, T, T] bool that must be causal (no trees: module docstring)
        capture: tuple[int, ...] = (),
        head: bool = True,
        defer_state: bool = False,
        shard_rows: bool = False,
    ):
        """-> (logits [B,T,V] float32 (head=False: final-normed hidden [B,T,H]), {layer:
        hidden [B,T,H]}, cache). A forward of several tokens runs the chunked delta rule, of
        one token the recurrent one. With cache=None the states start at zero and None is
        returned.

        A cache's pending tokens (the accepted ones of the row's last verify) are applied to
        the linear layers' states first. defer_state=True (a speculative verify) runs the
        recurrent rule, writes the KV cache and lengths as usual, writes the states after
        the pending tokens only and keeps its own tokens' rule inputs pending (the cache's
        buffer must hold them: `pending_tokens`), and appends `DeltaSteps`: once the accepted
        count is known, `steps.commit(cache, accepted)` keeps exactly that prefix pending
        (`compact` trims the KV); the row's next forward applies it.

        shard_rows=True (the training steps; cache=None only) pins the tokens and the output
        to the batch sharding (`parallel.constrain_rows`) at the forward's ends, not at every
        layer as `Policy.forward` does."""
        cfg = self.config
        tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
        if tokens.ndim != 2 or positions.shape != tokens.shape:
            raise ValueError(f"forward: tokens {tokens.shape} and positions {positions.shape} "
                             "must both be [B, T]")
        b, t = tokens.shape
        capture = tuple(int(i) for i in capture)
        if any(not 0 <= i < cfg.num_layers for i in capture):
            raise ValueError(f"forward: capture layers {capture} out of range [0, {cfg.num_layers})")
        if mask is not None:
            causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
            if isinstance(mask, jax.core.Tracer) or not np.array_equal(np.asarray(mask), causal):
                raise ValueError(
                    f"forward: family {cfg.family!r} takes no tree mask (its linear-attention "
                    "layers read a row's tokens in order; a tree needs one recurrent state per "
                    "node); pass mask=None")
            mask = None
        stateless = cache is None
        if defer_state and stateless:
            raise ValueError("forward(defer_state=True) needs a cache to defer its states in")
        if defer_state and cache.pending.g.shape[2] < t:
            raise ValueError(
                f"forward(defer_state=True) over {t} tokens needs a cache whose pending buffer "
                f"holds >= {t} tokens; it holds {cache.pending.g.shape[2]} (init_cache of "
                f"policy.replace(pending_tokens={t}))")
        if stateless:
            cache = HybridCache.zeros(cfg, b, 0)
        elif cache.batch != b:
            raise ValueError(f"forward: cache batch {cache.batch} != tokens batch {b}")
        elif not any(isinstance(a, jax.core.Tracer) for a in (cache.lengths, positions)):
            need = np.asarray(cache.lengths) + np.sum(np.asarray(positions) >= 0, axis=1)
            over = np.nonzero(need > cache.max_len)[0]
            if over.size:
                raise CacheOverflowError(
                    f"forward would write past the cache: rows {over.tolist()} need "
                    f"{need[over].tolist()} slots, max_len={cache.max_len}")
        pin = lambda x: x  # noqa: E731
        if shard_rows and stateless:
            from jaxspec.parallel import constrain_rows  # (jaxspec.parallel imports the models)

            pin = constrain_rows
            tokens, positions = pin(tokens), pin(positions)
        with matmul_precision(cfg.dtype):
            out = _forward(self, tokens, positions, cache, None, capture, bool(head), stateless,
                           bool(defer_state))
        return (pin(out[0]),) + out[1:]


jax.tree_util.register_dataclass(HybridPolicy)


def _drawn(policy: HybridPolicy, seed: int, *, hf_init: bool) -> HybridPolicy:
    """Params drawn with NumPy by name (the same on every backend): `HybridPolicy.init`'s
    (hf_init) or `random_hybrid_policy`'s."""
    cfg = policy.config
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(policy.params)
    out = []
    for path, leaf in leaves:
        name = "/".join(param_path(path))
        shape = tuple(leaf.shape)
        noise = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("A_log"):
            value = np.log(rng.uniform(0.01 if hf_init else 1.0, 16.0, shape))
        elif name.endswith(("dt_bias", "gate_norm")):
            value = np.ones(shape) if hf_init else 1.0 + 0.3 * noise
        elif name.endswith("scale"):
            value = np.zeros(shape) if hf_init else 0.3 * noise
        elif hf_init:
            value = INIT_STD * noise
        elif "embed_tokens" in name:
            value = noise
        else:  # ~1/sqrt(fan_in): the stacked axis leads, the input dims follow it
            if name.endswith("o_proj"):
                fan_in = cfg.num_heads * cfg.head_dim
            elif name.endswith("conv_weight"):
                fan_in = shape[-1]
            elif name.endswith(("down_proj", "out_proj")):
                fan_in = shape[-2]
            else:
                fan_in = cfg.hidden_size
            value = noise / np.sqrt(fan_in)
        out.append(jnp.asarray(value, cfg.param_dtype))
    return policy.replace(params=jax.tree_util.tree_unflatten(treedef, out))


def random_hybrid_policy(config: ModelConfig, seed: int = 0) -> HybridPolicy:
    """Weights of ~1/sqrt(fan_in) and norms 0.3 N(0,1) away from 1 (as `random_policy`'s):
    logits of order 1-10, against which a tolerance means something."""
    return _drawn(HybridPolicy.abstract(config), seed, hf_init=False)
