"""The KV cache pytree: per-layer keys/values, per-row lengths, and tree-path compaction."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig


class CacheOverflowError(ValueError):
    """A forward would write past the KV cache's capacity (max_len)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys/values (post-RoPE) and per-row lengths; row b holds slots [0, lengths[b]).

    Each row writes at its own length. Entries that would land at or past max_len are
    dropped (never written elsewhere); `lengths` still counts them, so a row that ran past
    capacity shows lengths > max_len (`overflowed`). Readers clamp to max_len.
    """

    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim] (param dtype)
    v: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    lengths: jax.Array  # [batch] int32

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def overflowed(self):  # -> [batch] bool
        return self.lengths > self.max_len

    @classmethod
    def create(
        cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
    ) -> KVCache:
        if min(num_layers, batch, max_len, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                f"KV cache sizes must be positive: num_layers={num_layers}, batch={batch}, "
                f"max_len={max_len}, num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        # v starts at -0.0, not 0.0: two identical constants are merged by XLA into one
        # buffer that is then copied for each (a 2048-slot cache took 21 ms instead of 8 ms
        # per generate call at batch 16). Slots past a row's length are never read.
        return cls(
            k=jnp.zeros(shape, dtype), v=jnp.full(shape, -0.0, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int) -> KVCache:
        return cls.create(
            num_layers=config.num_layers, batch=batch, max_len=max_len,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=config.param_dtype,
        )

    def slots(self, valid):  # [B, T] bool -> [B, T] int32
        """Where each new token goes: row b's valid tokens, in order, at lengths[b], +1, ...;
        padding and anything at or past max_len get max_len (out of range: dropped)."""
        s = self.max_len
        slots = self.lengths[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
        return jnp.where(valid & (slots < s), slots, s)

    def write(
        self,
        k,  # [layers, B, T, kv_heads, head_dim]
        v,  # [layers, B, T, kv_heads, head_dim]
        valid=None,  # [B, T] bool; default all
    ) -> KVCache:
        """Store new entries for every layer at each row's length; lengths unchanged."""
        valid = jnp.ones(k.shape[1:3], bool) if valid is None else valid
        slots = self.slots(valid)
        rows = jnp.arange(self.batch)[:, None]
        return dataclasses.replace(
            self,
            k=self.k.at[:, rows, slots].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, rows, slots].set(v.astype(self.v.dtype), mode="drop"),
        )

    def append(
        self,
        layer: int,
        k,  # [B, T, kv_heads, head_dim]
        v,  # [B, T, kv_heads, head_dim]
        valid=None,  # [B, T] bool; default all
    ) -> KVCache:
        """Store new entries for one layer at each row's length; lengths unchanged."""
        valid = jnp.ones(k.shape[:2], bool) if valid is None else valid
        slots = self.slots(valid)
        rows = jnp.arange(self.batch)[:, None]
        return dataclasses.replace(
            self,
            k=self.k.at[layer, rows, slots].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[layer, rows, slots].set(v.astype(self.v.dtype), mode="drop"),
        )

    def advance(self, valid) -> KVCache:  # valid [B, T] bool
        """Count the valid new tokens into each row's length (after write/append)."""
        return dataclasses.replace(
            self, lengths=self.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
        )


def new_token_mask(
    positions,  # [B, T] int32; < 0 marks padding
    mask=None,  # [B, T, T] bool among the new tokens, or None for causal
):  # -> (valid [B, T] bool, mask [B, T, T] bool)
    """Which new tokens are real, and which new tokens each may attend to (never padding)."""
    b, t = positions.shape
    valid = positions >= 0
    if mask is None:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return valid, mask.astype(bool) & valid[:, None, :]


def compact(
    cache: KVCache,
    path,  # [B, P] int32: fed-block indices to keep, in order; -1 = padding
    num_fed: int,
    *,
    fed_mask=None,  # [B] bool: rows the last forward fed (others are left as they are)
    prefix: bool = False,  # every path is 0, 1, ..., n then padding: nothing moves
) -> KVCache:
    """Keep only the accepted path of the last forward's fed block, contiguously.

    The last forward fed `num_fed` tokens at slots base = lengths - num_fed. Entry
    path[b, j] >= 0 of that block moves to slot base + j; lengths become base + #(path >= 0).
    Paths are ancestor chains in topological order, so every source index is >= its
    destination index and a gather-then-scatter never reads an overwritten slot.
    Rows with fed_mask False (fed only padding) keep their slots and lengths. prefix=True
    (a chain's accepted path: the fed block's first entries) only sets the lengths.
    """
    path = jnp.asarray(path, jnp.int32)
    if path.ndim != 2 or path.shape[0] != cache.batch:
        raise ValueError(f"compact: path shape {path.shape}; expected [batch={cache.batch}, P]")
    if not 0 < path.shape[1] <= num_fed:
        raise ValueError(f"compact: path length {path.shape[1]} must be in [1, num_fed={num_fed}]")
    s = cache.max_len
    fed = jnp.ones((cache.batch,), bool) if fed_mask is None else jnp.asarray(fed_mask, bool)
    base = cache.lengths - num_fed  # [B]
    keep = (path >= 0) & fed[:, None]
    src = base[:, None] + jnp.where(keep, path, 0)  # [B, P]
    dst = base[:, None] + jnp.arange(path.shape[1])[None, :]
    dst = jnp.where(keep & (dst >= 0) & (dst < s), dst, s)  # s = out of range: dropped
    rows = jnp.arange(cache.batch)[:, None]

    def move(buf):  # [L, B, S, kvh, d]
        picked = buf[:, rows, jnp.clip(src, 0, s - 1)]  # [L, B, P, kvh, d]
        return buf.at[:, rows, dst].set(picked, mode="drop")

    kept = base + jnp.sum(keep, axis=1, dtype=jnp.int32)
    lengths = jnp.where(fed, kept, cache.lengths)
    if prefix:  # source == destination for every kept entry
        return dataclasses.replace(cache, lengths=lengths)
    return KVCache(k=move(cache.k), v=move(cache.v), lengths=lengths)


def single_layer_forward(layer_step, embeds, hidden, positions, cache: KVCache, *, mask, fuse: bool):
    """A draft head's one decoder layer over new entries, their keys and values appended to
    its one-layer `cache`: `layer_step(embeds, hidden, positions, k_cache, v_cache, lengths,
    mask=, fuse=, thread=True) -> (hidden, k, v, k_cache, v_cache)` is the head's (EAGLE-3,
    MTP). The cache goes in unsliced and comes back from the attention (threaded, as the
    policy's layers do): a sliced layer would be copied whole at every call, a cost that
    grew with the capacity. Returns (hidden, cache)."""
    from jaxspec.kernels import CacheLayer  # kernels import this module

    valid, mask = new_token_mask(positions, mask)
    layer = jnp.int32(0)
    out, k, v, k_layer, v_layer = layer_step(
        embeds, hidden, positions, CacheLayer(cache.k, layer), CacheLayer(cache.v, layer),
        jnp.minimum(cache.lengths, cache.max_len), mask=mask, fuse=fuse, thread=True,
    )
    cache = dataclasses.replace(cache, k=k_layer.stack, v=v_layer.stack)
    return out, cache.append(0, k, v, valid).advance(valid)
