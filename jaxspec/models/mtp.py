"""A DeepSeek-V3-style multi-token-prediction (MTP) head.

The head combines the policy's last hidden state h_t (its final layer's output, before the
final norm) with the embedding of token t+1: x = eh_proj([enorm(embedding); hnorm(h_t)]),
runs one decoder layer over x, and predicts token t+2 with its own final norm followed by
the policy's LM head (shared, so the head adds no vocabulary-sized weights). Chain drafting
feeds the layer's own output back as h.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.models.cache import KVCache, new_token_mask
from jaxspec.models.config import ModelConfig
from jaxspec.models.layers import DecoderLayer, RMSNorm, logical_param


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    layer: ModelConfig  # one decoder layer, sized like the policy's
    capture_layers: tuple[int, ...]  # (the policy's last layer,)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


class MTPModule(nnx.Module):
    def __init__(self, cfg: MTPConfig, rngs: nnx.Rngs):
        lc = cfg.layer
        dtype, h = lc.param_dtype, lc.hidden_size
        self.enorm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.eh_proj = logical_param(rngs, (2 * h, h), dtype, ("mlp", "embed"))
        self.block = DecoderLayer(lc, rngs=rngs)
        self.norm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPHead:
    """The head as a pytree: static config and graphdef, params as leaves."""

    config: MTPConfig = dataclasses.field(metadata=dict(static=True))
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    params: Any
    buffers: Any = dataclasses.field(default_factory=dict)  # none (placement treats heads alike)

    @staticmethod
    def init_for(policy, key: jax.Array) -> "MTPHead":
        pc = policy.config
        layer = pc.replace(num_layers=1)
        cfg = MTPConfig(layer=layer, capture_layers=(pc.num_layers - 1,))
        graphdef, params = nnx.split(MTPModule(cfg, nnx.Rngs(params=key)))
        return MTPHead(cfg, graphdef, params)

    @property
    def module(self) -> MTPModule:
        return nnx.merge(self.graphdef, self.params)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:  # drafts over the policy's whole vocabulary
        return self.config.vocab_size

    def check_compatible(self, policy) -> None:
        pc, lc = policy.config, self.config.layer
        problems = []
        if pc.vocab_size != lc.vocab_size:
            problems.append(f"vocab_size {lc.vocab_size} != policy's {pc.vocab_size}")
        if pc.hidden_size != lc.hidden_size:
            problems.append(f"hidden_size {lc.hidden_size} != policy's {pc.hidden_size}")
        if self.capture_layers != (pc.num_layers - 1,):
            problems.append(f"capture_layers {self.capture_layers} != the policy's last layer ({pc.num_layers - 1},)")
        if problems:
            raise ValueError("MTP head does not match the policy: " + "; ".join(problems))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.zeros(self.config.layer, batch, max_len)

    def forward(
        self,
        embeds,  # [B, T, H] token embeddings of the next tokens
        hidden,  # [B, T, H] the policy's last-layer output, or the head's own output
        positions,  # [B, T] int32; < 0 marks padding
        cache: KVCache,
        *,
        mask=None,  # [B, T, T] bool among the new entries; default causal
        fuse: bool,  # unused: the same projection serves target features and own outputs
    ):
        """One pass of the head over new entries; returns (pre-norm hidden, cache)."""
        del fuse
        m = self.module
        dtype = self.config.layer.param_dtype
        x = jnp.concatenate([m.enorm(embeds.astype(dtype)), m.hnorm(hidden.astype(dtype))], axis=-1)
        x = x @ m.eh_proj[...]
        valid, mask = new_token_mask(positions, mask)
        out, k, v = m.block(
            x, jnp.maximum(positions, 0), cache.k[0], cache.v[0], jnp.minimum(cache.lengths, cache.max_len), mask
        )
        return out, cache.append(0, k, v, valid).advance(valid)

    def draft_logits(self, hidden, policy):  # [..., H] -> (float32 [..., V], None: ids are the target's)
        """Logits through the policy's shared LM head, over the full target vocabulary."""
        normed = self.module.norm(hidden.astype(self.config.layer.param_dtype))
        squeeze = normed.ndim == 2
        normed = normed[:, None] if squeeze else normed
        logits = policy.module.logits(normed)
        return (logits[:, 0] if squeeze else logits), None
