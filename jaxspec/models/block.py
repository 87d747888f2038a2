"""A block-parallel draft model (DFlash) with DSpark's optional Markov and confidence heads.

The body drafts a whole block in one forward. Its input is the block [anchor, mask, ...,
mask] (the anchor: the last committed token; `block_size - 1` mask tokens), embedded with
the policy's (frozen) embedding; its layers are decoder layers whose attention is
bidirectional within the block and also reads a context: the policy's hidden states of
the committed prefix from several layers, fused (`fc`, no bias) and normed (`hidden_norm`)
once, then projected by each layer's own k/v projections (with its k-norm and RoPE at the
prefix positions). Those context keys and values are what the drafter caches (one entry per
committed token per layer); the block's own keys are never cached. The body's output goes
through its final `norm` and the policy's LM head: the logits at mask position i draft the
token i positions after the anchor (DFlash; with `sample_from_anchor`, DSpark's convention,
slot i drafts the token i + 1 positions after it, the anchor's slot included).

DSpark adds a low-rank Markov head, a bias `markov_w1[previous token] @ markov_w2` on the
logits at each position (restoring the dependency between the block's tokens the parallel
body lacks; drafted left to right), and a confidence head, a linear map of [normed hidden;
Markov embedding] to the logit of the probability that the position's draft is accepted
given that the ones before it were.

Layout of the weights (the one `z-lab/*-DFlash-b16` checkpoints use; see `block_formats`):
fc, hidden_norm, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.models.cache import KVCache, new_token_mask
from jaxspec.models.config import ModelConfig, matmul_precision
from jaxspec.models.layers import DecoderLayer, RMSNorm, logical_param


def default_block_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's captured layers (outputs): `count` layers spread evenly from layer 1 to layer
    L - 3 (one: the middle layer). Always strictly increasing, as DSpark's readers require:
    where that spread repeats a layer (policies of under ~count + 3 layers) it is
    min(count, L - 1) layers spread over 0 .. L - 2 instead (the last layer, which DeepSpec
    refuses, only for a one-layer policy)."""
    if num_target_layers <= 0 or count <= 0:
        raise ValueError(f"num_target_layers={num_target_layers}, count={count}; both must be positive")
    if count == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]
    if end > start and len(set(ids)) == count:
        return tuple(ids)
    n, last = min(count, max(num_target_layers - 1, 1)), max(num_target_layers - 2, 0)
    if n == 1:
        return (last,)
    return tuple(sorted({int(round(i * last / (n - 1))) for i in range(n)}))


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The body's layers are described by a `ModelConfig` (its heads, RoPE, norms, dtype and
    attention backend; `num_layers` = the body's depth); the rest is what DFlash / DSpark add."""

    layer: ModelConfig  # vocab_size = the policy's vocabulary
    block_size: int  # anchor + block_size - 1 drafted positions per forward
    target_hidden_size: int
    capture_layers: tuple[int, ...]  # policy layer outputs fused as the context
    mask_token_id: int  # the token fed at the drafted positions (its policy embedding)
    markov_rank: int = 0  # DSpark's Markov head (0: none)
    confidence: bool = False  # DSpark's confidence head
    # which block slot drafts the token j after the anchor: slot j (False, DFlash: the anchor's
    # own slot drafts nothing) or slot j - 1 (True, DSpark's layout; its consumers' default
    # sample_from_anchor)
    sample_from_anchor: bool = False

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2 (an anchor and a drafted token); "
                             f"got {self.block_size!r}")
        if not 0 <= self.mask_token_id < self.layer.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, {self.layer.vocab_size}); got "
                             f"{self.mask_token_id!r}")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank must be an int >= 0; got {self.markov_rank!r}")
        if not self.capture_layers:
            raise ValueError("capture_layers must name at least one policy layer")
        if not isinstance(self.sample_from_anchor, bool):
            raise ValueError(f"sample_from_anchor must be True or False; got "
                             f"{self.sample_from_anchor!r}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


class BlockModule(nnx.Module):
    """The body (fc, hidden_norm, decoder layers, norm) and the optional DSpark heads."""

    def __init__(self, cfg: BlockConfig, rngs: nnx.Rngs):
        lc = cfg.layer
        dtype, h = lc.param_dtype, lc.hidden_size
        self.fc = logical_param(rngs, (len(cfg.capture_layers) * cfg.target_hidden_size, h), dtype,
                                ("mlp", "embed"))
        self.hidden_norm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(lc, rngs=rngs) for _ in range(lc.num_layers)])
        self.norm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        r = cfg.markov_rank
        if r:  # the bias starts at zero: a fresh Markov head drafts as the body does
            self.markov_w1 = logical_param(rngs, (lc.vocab_size, r), dtype, ("vocab", None))
            self.markov_w2 = nnx.Param(jnp.zeros((r, lc.vocab_size), dtype),
                                       out_sharding=(None, "vocab"), eager_sharding=False)
        if cfg.confidence:  # starts at acceptance 1/2 everywhere
            self.confidence_w = nnx.Param(jnp.zeros((h + r, 1), jnp.float32),
                                          out_sharding=(None, None), eager_sharding=False)
            self.confidence_b = nnx.Param(jnp.zeros((1,), jnp.float32),
                                          out_sharding=(None,), eager_sharding=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockHead:
    """The block draft model as a pytree: static config and graphdef, params as leaves."""

    config: BlockConfig = dataclasses.field(metadata=dict(static=True))
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    params: Any
    buffers: Any = dataclasses.field(default_factory=dict)  # none (placement treats heads alike)

    @staticmethod
    def init(config: BlockConfig, key: jax.Array) -> BlockHead:
        graphdef, params = nnx.split(BlockModule(config, nnx.Rngs(params=key)), nnx.Param)
        return BlockHead(config, graphdef, params)

    @staticmethod
    def init_for(policy, key: jax.Array, *, block_size: int = 8, num_layers: int = 1,
                 capture_layers=None, mask_token_id: int | None = None, markov_rank: int = 0,
                 confidence: bool = False, sample_from_anchor: bool = False) -> BlockHead:
        """A body of `num_layers` layers shaped like the policy's (Qwen3 layers with QK-norm,
        as DFlash's), reading `capture_layers` (default: DFlash's spread of max(3,
        num_layers) layers); the mask token defaults to the vocabulary's last id.
        `sample_from_anchor`: DSpark's slot convention (BlockConfig)."""
        pc = policy.config
        layers = (tuple(capture_layers) if capture_layers is not None
                  else default_block_layers(pc.num_layers, max(3, num_layers)))
        layer = pc.without_experts().replace(num_layers=num_layers, qk_norm=True,
                                             tie_embeddings=False, family="qwen3")
        mask = pc.vocab_size - 1 if mask_token_id is None else int(mask_token_id)
        cfg = BlockConfig(layer, int(block_size), pc.hidden_size, layers, mask, int(markov_rank),
                          bool(confidence), bool(sample_from_anchor))
        return BlockHead.init(cfg, key)

    @property
    def module(self) -> BlockModule:
        return nnx.merge(self.graphdef, self.params)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def check_compatible(self, policy) -> None:
        pc, hc = policy.config, self.config
        problems = []
        if pc.vocab_size != hc.vocab_size:
            problems.append(f"vocab_size {hc.vocab_size} != policy's {pc.vocab_size}")
        if pc.hidden_size != hc.target_hidden_size:
            problems.append(f"target_hidden_size {hc.target_hidden_size} != policy's hidden_size "
                            f"{pc.hidden_size}")
        if pc.hidden_size != hc.hidden_size:
            problems.append(f"hidden_size {hc.hidden_size} != policy's {pc.hidden_size} (the body "
                            f"uses the policy's token embedding and LM head)")
        bad = [i for i in hc.capture_layers if not 0 <= i < pc.num_layers]
        if bad:
            problems.append(f"capture_layers {bad} outside the policy's {pc.num_layers} layers")
        if problems:
            raise ValueError("block draft model does not match the policy: " + "; ".join(problems))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """The context keys and values: one entry per committed token in each body layer."""
        return KVCache.zeros(self.config.layer, batch, max_len)

    def context(
        self,
        features,  # [B, T, F] the captured policy layers, concatenated (F = layers x H_target)
        positions,  # [B, T] int32; < 0 marks padding
        cache: KVCache,
    ) -> KVCache:
        """Append the context entries of new committed tokens to every layer's cache."""
        m = self.module
        dtype = self.config.layer.param_dtype
        ctx = m.hidden_norm(features.astype(dtype) @ m.fc[...])
        pos = jnp.maximum(positions, 0)
        ks, vs = [], []
        for layer in m.layers:
            _, k, v = layer.self_attn.project(ctx, pos)  # the unused q is dropped by XLA
            ks.append(k)
            vs.append(v)
        valid = positions >= 0
        return cache.write(jnp.stack(ks), jnp.stack(vs), valid).advance(valid)

    def block(
        self,
        embeds,  # [B, S, H] policy embeddings of [anchor, mask, ...]
        positions,  # [B, S] int32 their positions (anchor's: the committed count - 1)
        cache: KVCache,  # the context (not written)
    ):  # -> [B, S, H] final-normed hidden states
        """The body over one block, bidirectional within it, reading the whole context."""
        from jaxspec.kernels import CacheLayer  # kernels import models

        m = self.module
        b, s = positions.shape
        _, mask = new_token_mask(positions, jnp.ones((b, s, s), bool))
        lengths = jnp.minimum(cache.lengths, cache.max_len)
        x = embeds.astype(self.config.layer.param_dtype)
        for i, layer in enumerate(m.layers):
            x, _, _ = layer(x, jnp.maximum(positions, 0), CacheLayer(cache.k, jnp.int32(i)),
                            CacheLayer(cache.v, jnp.int32(i)), lengths, mask)
        return m.norm(x)

    def drafted(self, hidden):  # [..., S, H] the block's slots -> [..., S - 1, H]
        """The slots that draft the tokens 1 .. S - 1 after the anchor, in order."""
        return hidden[..., :-1, :] if self.config.sample_from_anchor else hidden[..., 1:, :]

    def logits(self, normed, policy):  # [..., H] final-normed -> float32 [..., V]
        """Through the policy's LM head (shared, as DFlash's)."""
        squeeze = normed.ndim == 2
        x = normed[:, None] if squeeze else normed
        with matmul_precision(policy.config.dtype):  # as Policy.forward runs this LM head
            out = policy.module.logits(x.astype(policy.config.param_dtype))
        return out[:, 0] if squeeze else out

    def markov_embed(self, previous):  # [...] int32 token ids -> [..., r] (r = 0: empty)
        if not self.config.markov_rank:
            return jnp.zeros(previous.shape + (0,), jnp.float32)
        return jnp.take(self.module.markov_w1[...], previous, axis=0).astype(jnp.float32)

    def markov_bias(self, previous):  # [...] int32 -> float32 [..., V] (zeros without the head)
        """The Markov head's logit bias for the token after `previous`."""
        if not self.config.markov_rank:
            return jnp.zeros(previous.shape + (self.config.vocab_size,), jnp.float32)
        w2 = self.module.markov_w2[...].astype(jnp.float32)
        return self.markov_embed(previous) @ w2

    def confidence_logit(self, normed, previous):  # [..., H], [...] int32 -> float32 [...]
        """The logit of P(this position's draft is accepted | the earlier ones were)."""
        if not self.config.confidence:
            raise ValueError("this block draft model has no confidence head")
        m = self.module
        x = jnp.concatenate([normed.astype(jnp.float32), self.markov_embed(previous)], axis=-1)
        return (x @ m.confidence_w[...])[..., 0] + m.confidence_b[...][0]
