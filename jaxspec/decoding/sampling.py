"""Sampling settings, the processed target distribution, and position-keyed sampling.

Every rule in `jaxspec.decoding` draws its randomness from `(key, row, position)` only, so
the plain sampler and the verifiers see the same noise for the same token slot: the
`replay` verifier reproduces plain sampling token for token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.invariant import log_normalizer
from jaxspec.errors import FieldError

# Slot keys live in their own domain of the caller's key, so a drafter that folds small ints
# into the same key (fold_in(key, round)) cannot land on a slot's noise by accident.
_SLOT_DOMAIN = 0x5107
# Stream tags folded into a slot's key: the sampler's Gumbel noise uses the slot key itself;
# other independent draws at the same slot (verification coins) add a tag.
_COIN_STREAM = 1
# Up to this vocabulary size top-k/top-p compare all pairs of tokens; above it they bisect.
_PAIRWISE_MAX_VOCAB = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Temperature, top-k and top-p as traced scalars: a new value never recompiles.

    temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off. Python, NumPy
    and concrete jax.Array values are checked here (a device value costs one transfer) and
    stored as float32 / int32 / float32 arrays. Values traced inside `jax.jit` cannot be
    checked: they are used as given (a negative traced temperature acts as greedy, a traced
    top_p <= 0 keeps only the top token), so check them before entering the trace.
    """

    temperature: jax.Array | float = 1.0  # [] float32, finite, >= 0
    top_k: jax.Array | int = 0  # [] int32, >= 0
    top_p: jax.Array | float = 1.0  # [] float32, in (0, 1]

    def __post_init__(self):
        for name, dtype in _SETTING_DTYPES.items():
            value = getattr(self, name)
            if isinstance(value, jax.core.Tracer):  # inside a trace: nothing to check
                if value.dtype != dtype:
                    object.__setattr__(self, name, value.astype(dtype))
                continue
            if isinstance(value, (bool, np.bool_, str, bytes, dict, list, set)):
                raise TypeError(f"SamplingConfig.{name} must be a number; got {value!r} ({type(value).__name__})")
            if isinstance(value, jax.Array) and value.is_fully_addressable:
                host = np.asarray(value)
            elif isinstance(value, (int, float, np.ndarray, np.generic)):
                host = np.asarray(value)
            else:  # pytree plumbing (None, ShapeDtypeStruct, shardings...): not a setting
                continue
            if host.ndim != 0:
                raise ValueError(f"SamplingConfig.{name} must be a scalar; got shape {host.shape}")
            if host.dtype.kind not in "iuf":
                raise TypeError(f"SamplingConfig.{name} must be a number; got {value!r} (dtype {host.dtype})")
            _check_setting(name, host.item())
            if not (isinstance(value, jax.Array) and value.dtype == dtype):
                object.__setattr__(self, name, jnp.asarray(host, dtype))

    @classmethod
    def greedy(cls) -> SamplingConfig:
        return cls(temperature=0.0)

    def without_unused_filters(self) -> SamplingConfig:
        """This config as one whose program holds no top-k/top-p filter (no conditional, fewer
        kernels) where its concrete top_k is 0 and top_p 1.0; itself otherwise (a filter on,
        or values traced or not on this host). `generate` compiles with it, so switching a
        filter on (off) compiles one more program, a new value within either never does."""
        if type(self) is not SamplingConfig:
            return self
        top_k, top_p = _host_value(self.top_k), _host_value(self.top_p)
        if top_k == 0 and top_p == 1.0:
            return _Unfiltered(self.temperature, self.top_k, self.top_p)
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Unfiltered(SamplingConfig):
    """A SamplingConfig whose top-k and top-p are off (top_k 0, top_p 1.0), known before
    tracing, so the processed distribution compiles without the filters
    (`SamplingConfig.without_unused_filters`). Its own pytree type with a static field of its
    own: jax (0.10) compares `register_dataclass` structures by their static fields alone,
    not their classes, so without one a program compiled for the one could serve the other."""

    unfiltered: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def __post_init__(self):
        super().__post_init__()
        if self.unfiltered is not True:
            raise ValueError(f"an unfiltered SamplingConfig has unfiltered=True; got {self.unfiltered!r}")
        top_k, top_p = _host_value(self.top_k), _host_value(self.top_p)
        if (top_k is not None and top_k != 0) or (top_p is not None and top_p != 1.0):
            raise ValueError(f"an unfiltered SamplingConfig needs top_k 0 and top_p 1.0; got "
                             f"top_k={top_k}, top_p={top_p}")


def _host_value(value):
    """A setting's value on the host, or None (traced, pytree plumbing, or not addressable)."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, jax.Array):
        return np.asarray(value).item() if value.is_fully_addressable else None
    if isinstance(value, (int, float, np.ndarray, np.generic)):
        return np.asarray(value).item()
    return None


_SETTING_DTYPES = {"temperature": jnp.float32, "top_k": jnp.int32, "top_p": jnp.float32}


def check_settings(temperature, top_k, top_p) -> None:
    """SamplingConfig's checks on plain host values, with no device work (the config layer
    runs them when a file is loaded, before any device or compile)."""
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_setting(name, value)


def _check_setting(name: str, value) -> None:
    """One ValueError naming the setting, its value and the valid range."""
    finite = isinstance(value, int) or np.isfinite(value)
    valid = {
        "temperature": (finite and value >= 0, "a finite number >= 0 (0 means greedy)"),
        "top_k": (isinstance(value, int) and 0 <= value < 2**31, "an integer >= 0 (0 means off)"),
        "top_p": (finite and 0 < value <= 1, "in (0, 1] (1.0 means off)"),
    }[name]
    if not valid[0]:
        raise FieldError("SamplingConfig", name, value, "out of range", valid[1],
                         message=f"SamplingConfig.{name}={value!r} is invalid: it must be {valid[1]}")


def process_logits(
    logits,  # [..., V] any float dtype
    cfg: SamplingConfig,
):  # -> [..., V] float32 log-probs of the processed distribution (-inf outside its support)
    """Temperature, then top-k, then top-p, as log-probabilities in float32.

    Both filters keep every token tied with the last one kept, so the kept set is a function of
    the values alone (never of sort order) and the top token is always kept. temperature 0 gives
    the point mass on the argmax (the first one on ties).
    """
    z = processed_logits(logits, cfg)
    return z - log_normalizer(z)


def processed_logits(
    logits,  # [..., V] any float dtype
    cfg: SamplingConfig,
):  # -> [..., V] float32: the processed distribution's logits, top entry 0, -inf outside
    """The unnormalised form of `process_logits`: shifted by the row max (exact), divided by the
    temperature, filtered. Samplers draw from it (Gumbel-max needs no normaliser): no rounded
    reduction enters it (only top-p's kept set depends on a sum, and only at an exact boundary),
    so a row gives the same bits in a [B, V] decode batch as in a [B, N+1, V] verify block.
    Rows need at least one finite logit."""
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    temperature = jnp.asarray(cfg.temperature, jnp.float32)
    top_k = jnp.asarray(cfg.top_k, jnp.int32)
    top_p = jnp.asarray(cfg.top_p, jnp.float32)

    peak = jnp.max(x, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    # Shift before dividing: the top logit becomes exactly 0, so a tiny temperature cannot
    # overflow to inf - inf.
    z = (x - peak) / jnp.where(temperature > 0, temperature, 1.0)

    def truncate(z):
        # top-k keeps z_i iff fewer than k tokens are strictly larger; top-p keeps z_i iff the
        # tokens strictly larger carry less than top_p of the top-k mass. Both keep every tie.
        # No sort (k and p stay traced): small vocabularies compare all pairs, large ones find
        # each threshold by bisection over float32 values.
        k = jnp.clip(top_k, 1, vocab)
        if vocab <= _PAIRWISE_MAX_VOCAB:
            beaten_by = z[..., None, :] > z[..., :, None]  # [..., i, j]: z_j > z_i
            kept_k = (top_k == 0) | (jnp.sum(beaten_by, axis=-1) < k)
        else:
            threshold = _smallest_float_where(z, lambda t: jnp.sum(z > t, axis=-1) < k)
            kept_k = (top_k == 0) | (z >= threshold)
        z = jnp.where(kept_k, z, -jnp.inf)
        weights = jnp.exp(z)  # the top logit is 0: no overflow
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if vocab <= _PAIRWISE_MAX_VOCAB:
            mass_above = jnp.sum(jnp.where(beaten_by, weights[..., None, :], 0.0), axis=-1)
            kept_p = mass_above < top_p
        else:
            threshold = _smallest_float_where(
                z, lambda t: jnp.sum(jnp.where(z > t, weights, 0.0), axis=-1) < top_p
            )
            kept_p = z >= threshold
        # The top token (z == 0) survives whatever the settings, even traced invalid ones.
        return jnp.where((top_p >= 1.0) | kept_p | (z >= 0), z, -jnp.inf)

    if not isinstance(cfg, _Unfiltered):  # (unfiltered: both filters known to be off)
        z = jax.lax.cond((top_k > 0) | (top_p < 1.0), truncate, lambda z: z, z)
    greedy = jnp.where(jnp.arange(vocab) == jnp.argmax(x, axis=-1, keepdims=True), 0.0, -jnp.inf)
    return jnp.where(temperature > 0, z, greedy.astype(jnp.float32))


def _ordered(x):  # float32 -> uint32, monotone (-inf < ... < -0.0 < +0.0 < ... < +inf)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _unordered(u):  # inverse of _ordered
    bits = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_float_where(
    z,  # [..., V] float32 whose largest entry is 0
    holds,  # t [..., 1] -> bool [...]: monotone in t and true for every t > 0
):  # -> [..., 1] float32: the smallest float32 t > -inf at which `holds` is true, exactly
    """Binary search over the 2^32 ordered float32 values: 32 halvings of [-inf, 0]."""
    shape = z.shape[:-1] + (1,)
    lo = jnp.full(shape, _ordered(jnp.float32(-jnp.inf)))  # treated as false
    hi = jnp.full(shape, _ordered(jnp.float32(0.0)) + 1)  # true

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        true_at_mid = holds(_unordered(mid))[..., None]
        return jnp.where(true_at_mid, lo, mid), jnp.where(true_at_mid, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return _unordered(hi)


def slot_keys(
    key,  # PRNG key (typed or raw uint32)
    rows,  # [B] int32 rollout ids
    positions,  # [B] or [B, T] int32 absolute positions
):  # -> keys with positions' shape
    """The key of token slot (row, position): a function of (key, row, position) only."""
    domain = jax.random.fold_in(key, _SLOT_DOMAIN)
    per_row = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(domain, rows)
    if positions.ndim == 1:
        return jax.vmap(jax.random.fold_in)(per_row, positions)
    return jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))(per_row, positions)


def gumbel_noise(
    key,
    rows,  # [B] int32
    positions,  # [B] or [B, T] int32
    vocab: int,
):  # -> positions.shape + [V] float32
    """The sampler's noise at each (row, position): Gumbel(0, 1) per vocabulary entry."""
    keys = slot_keys(key, rows, positions)
    flat = keys.reshape(-1, *keys.shape[positions.ndim :])
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(flat)
    return noise.reshape(*positions.shape, vocab)


def coin_flips(
    key,
    rows,  # [B] int32
    positions,  # [B, T] int32: the slot each coin decides
    tags,  # [B, T] int32: distinguishes several coins at one slot (e.g. a node index)
):  # -> [B, T] float32 uniform on [0, 1)
    """Acceptance coins, independent of the sampler's Gumbel noise at the same slot."""
    keys = slot_keys(key, rows, positions)
    flat_keys = keys.reshape(-1, *keys.shape[positions.ndim :])
    coin_keys = jax.vmap(jax.random.fold_in)(
        jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat_keys, _COIN_STREAM), tags.reshape(-1)
    )
    coins = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(coin_keys)
    return coins.reshape(positions.shape)


def _default_rows(batch: int, rows):
    if rows is None:
        return jnp.arange(batch, dtype=jnp.int32)
    return jnp.asarray(rows, jnp.int32)


def sample(
    key,
    logits,  # [B, V] or [B, T, V] any float dtype
    cfg: SamplingConfig,
    positions,  # [B] or [B, T] int32: absolute position of the token being drawn
    rows=None,  # [B] int32 rollout ids; default arange(B)
):  # -> (tokens [B] or [B, T] int32 in [0, V), logprobs same shape float32)
    """Gumbel-max sampling from the processed distribution with position-keyed noise.

    The token at (row r, position t) depends only on (key, r, t) and that slot's logits; the
    log-probs are those of the processed distribution.
    """
    batch, vocab = logits.shape[0], logits.shape[-1]
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), logits.shape[:-1])
    z = processed_logits(logits, cfg)
    noise = gumbel_noise(key, _default_rows(batch, rows), positions, vocab)
    tokens = jnp.argmax(z + noise, axis=-1).astype(jnp.int32)
    z_token = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
    return tokens, report_logprobs(z_token - log_normalizer(z)[..., 0], logits, tokens, cfg)


def report_logprobs(
    logprobs,  # [...] float32 the emitted tokens' log-probs under the processed distribution
    logits,  # [..., V] (or [B, N, V] with `fed`) any float dtype: the policy's logits
    tokens,  # [...] int32 the emitted tokens
    cfg: SamplingConfig,
    fed=None,  # [B, D] int32 or None: token [b, d] was drawn from logits[b, fed[b, d]]
):  # -> [...] float32 the log-probs the generator reports (Rollouts.logprobs)
    """The reported log-prob of an emitted token: under the processed distribution at
    temperature > 0; at temperature 0 (greedy: a point mass, log p = 0 for every emitted
    token) under the policy's unscaled, unfiltered softmax, which the trainer scores the same
    way (`jaxspec.rl.chunked`), so the GRPO ratio, the KL and the importance weights see a
    log-prob with a gradient and generation and training agree (docs/training.md)."""

    def unscaled(_):
        x = logits if fed is None else jnp.take_along_axis(logits, fed[..., None], axis=-2)
        x = x.astype(jnp.float32)
        peak = jnp.max(x, axis=-1, keepdims=True)
        z = (x - jnp.where(jnp.isfinite(peak), peak, 0.0)) / jnp.float32(1.0)  # as the scorer
        z_token = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
        return z_token - log_normalizer(z)[..., 0]

    temperature = jnp.asarray(cfg.temperature, jnp.float32)
    return jax.lax.cond(temperature > 0, lambda _: logprobs.astype(jnp.float32), unscaled, None)
