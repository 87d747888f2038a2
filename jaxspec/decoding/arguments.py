"""Host-side checks of `generate`'s arguments: one clear error per misuse, before compiling.

Every error names the argument, the value given and what would be valid. Values traced
inside a `jax.jit` (a SamplingConfig built from tracers) cannot be checked here.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxspec.decoding.adaptive import AdaptiveK
from jaxspec.decoding.drafters import NoDrafter
from jaxspec.decoding.policy_cache import check_chains
from jaxspec.decoding.protocols import AdaptiveLength, Drafter
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.verify import METHODS
from jaxspec.models import HybridPolicy, Policy


def describe(value, limit: int = 60) -> str:
    """`repr` (shortened) and type name, for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _integer_array(name: str, value, ndim: int) -> np.ndarray:
    """A host int array of the given rank, refusing floats (never truncated) and bools."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        bad = array.reshape(-1)[0] if array.size and array.dtype.kind == "f" else None
        example = "" if bad is None else f" (e.g. {bad!r})"
        raise TypeError(
            f"{name} must hold integer token ids; got dtype {array.dtype}{example}: "
            f"convert with .astype(int) only if the values are exact ids"
        )
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s); got shape {array.shape}")
    return array.astype(np.int64)


def pad_prompts(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A list of token-id lists, or (array[B, P], lengths[B]), as a right-padded array + lengths."""
    if isinstance(prompts, tuple) and len(prompts) == 2 and not _is_int(prompts[0]):
        tokens = _integer_array("prompts[0] (tokens)", prompts[0], 2)
        lengths = _integer_array("prompts[1] (lengths)", prompts[1], 1)
        if lengths.shape != (tokens.shape[0],):
            raise ValueError(
                f"prompts as (tokens, lengths) must be [batch, len] and [batch]; got "
                f"{tokens.shape} and {lengths.shape}"
            )
        if np.any(lengths < 1) or np.any(lengths > tokens.shape[1]):
            raise ValueError(
                f"prompt lengths must be in [1, {tokens.shape[1]}]; got {lengths.tolist()}"
            )
        return tokens.astype(np.int32), lengths.astype(np.int32)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)) or len(prompts) == 0:
        raise TypeError(
            f"prompts must be a non-empty list of token-id lists (e.g. [[1, 2, 3]]) or a "
            f"(tokens[B, P], lengths[B]) pair; got {describe(prompts)}"
        )
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray, jax.Array)):
            raise TypeError(
                f"prompts[{i}] is {describe(p)}; prompts must be a list of token-id lists, "
                f"e.g. [[1, 2, 3]] for one prompt"
            )
        if isinstance(p, (np.ndarray, jax.Array)):
            rows.append(_integer_array(f"prompts[{i}]", p, 1).tolist())
            continue
        bad = [t for t in p if not _is_int(t)]
        if bad:
            raise TypeError(
                f"prompts[{i}] holds {describe(bad[0])}: token ids must be integers "
                f"(floats are refused, never truncated)"
            )
        rows.append([int(t) for t in p])
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"prompts {empty} are empty; every prompt needs at least one token")
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, np.array([len(r) for r in rows], np.int32)


def check_policy(policy) -> None:
    if not isinstance(policy, (Policy, HybridPolicy)):
        raise TypeError(
            f"policy must be a jaxspec.models.Policy or HybridPolicy (Policy.init, load_hf); got "
            f"{describe(policy)}"
        )


def check_drafter(drafter, policy, method: str) -> None:
    if not isinstance(drafter, Drafter):
        raise TypeError(
            f"drafter must implement jaxspec.decoding.Drafter (e.g. Eagle3Drafter(head, k=3)) "
            f"or be None; got {describe(drafter)}"
        )
    drafter.check_compatible(policy)
    check_chains(drafter, policy)
    if method == "rejection" and not drafter.supports_rejection:
        raise ValueError(
            f"method='rejection' needs sampled chain drafts with their probabilities; "
            f"{type(drafter).__name__} with these settings does not provide them "
            f"(use method='replay', which is lossless for any draft)"
        )


def check_adaptive(adaptive, drafter, policy, method: str, max_len: int) -> dict | None:
    """`generate(adaptive=...)` -> {k: the drafter drafting k deep} for every k in
    `adaptive.ks` (k = 0: `NoDrafter`, plain decoding), each checked against the policy and
    the method and keeping the drafter's state shapes; None without adaptive."""
    if adaptive is None:
        return None
    if not isinstance(adaptive, AdaptiveK):
        raise TypeError(f"adaptive must be a jaxspec.decoding.AdaptiveK (from "
                        f"jaxspec.decoding.measure_costs) or None; got {describe(adaptive)}")
    name = type(drafter).__name__
    if method == "rejection":  # per-row k: a verify with a per-row cut of the chain; not done
        raise ValueError(
            "adaptive draft length with method='rejection': k is chosen per iteration for the "
            "whole batch from its acceptance (the counts, or a confidence head's estimate "
            "averaged over the live rows), and under rejection sampling the tokens follow the "
            "drafts, so a row's tokens would depend on the rows that share its call (rows=, "
            "slots); use method='replay' (tokens independent of the drafts and of k), or "
            "adaptive=None (a fixed k)")
    if drafter.num_nodes == 0 or not isinstance(drafter, AdaptiveLength):
        raise ValueError(f"adaptive draft length needs a chain drafter or a tree with a with_k "
                         f"method (EAGLE-3, MTP, draft model, n-gram, history, hybrid, oracle); "
                         f"got {name}")
    variants = {k: drafter.with_k(k) for k in adaptive.ks if k > 0}
    base = jax.eval_shape(lambda d, p: d.init_state(p, 2, max_len), drafter, policy)
    for k, d in variants.items():
        d.check_compatible(policy)
        state = jax.eval_shape(lambda d, p: d.init_state(p, 2, max_len), d, policy)
        if jax.tree.structure(state) != jax.tree.structure(base) or any(
                (a.shape, a.dtype) != (b.shape, b.dtype)
                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(base))):
            raise ValueError(f"adaptive draft length: {name}.with_k({k}) keeps a state of "
                             f"another shape than {name}'s; every k must share one state")
    return {0: NoDrafter(), **variants} if 0 in adaptive.ks else variants


def check_slots(slots, batch: int) -> int:
    """`generate`'s slots as the static slot count in [1, batch]."""
    if slots is None:
        return batch
    if not _is_int(slots) or slots < 1:
        raise ValueError(f"slots must be an int >= 1 (rows decoded at once) or None (one per "
                         f"prompt); got {describe(slots)}")
    return min(int(slots), batch)


def check_prompt_ids(tokens, vocab: int) -> None:  # tokens [B, P] int
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(
            f"prompt token ids must be in [0, {vocab}); got min {tokens.min()}, max {tokens.max()}"
        )


def check_length(width: int, max_new_tokens: int, nodes: int, limit: int) -> int:
    """The cache length a call needs (prompt, new tokens, one verify's headroom of nodes + 1)
    -> that length, if within the policy's max_position_embeddings `limit`."""
    max_len = width + max_new_tokens + nodes + 1
    if max_len > limit:
        raise ValueError(
            f"prompt length {width} + max_new_tokens {max_new_tokens} + draft headroom "
            f"{nodes + 1} = {max_len} exceeds the policy's max_position_embeddings {limit}"
        )
    return max_len


def check_sampling(sampling, method: str) -> SamplingConfig:
    if sampling is None:
        return SamplingConfig()
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(
            f"sampling must be a jaxspec.decoding.SamplingConfig, e.g. "
            f"SamplingConfig(temperature=1.0, top_p=0.95); got {describe(sampling)}"
        )
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(sampling, name)
        if not isinstance(value, jax.Array):
            raise TypeError(f"SamplingConfig.{name} must be a number; got {describe(value)}")
    temperature = sampling.temperature
    if method == "greedy" and not isinstance(temperature, jax.core.Tracer):
        t = float(np.asarray(temperature))
        if t != 0:
            raise ValueError(
                f"method='greedy' emits the argmax, which is lossless only at temperature 0; "
                f"got SamplingConfig.temperature={t!r}: use method='replay' (lossless at any "
                f"temperature) or SamplingConfig(temperature=0.0)"
            )
    return sampling.without_unused_filters()  # no filter compiled where both are off


def check_method(method) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {describe(method)}")


def check_key(key) -> jax.Array:
    """A typed PRNG key (jax.random.key) or a raw uint32[2] one (jax.random.PRNGKey)."""
    if isinstance(key, (jax.Array, np.ndarray)):
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == np.uint32 and key.shape == (2,):
            return jax.numpy.asarray(key)
    raise TypeError(
        f"key must be one PRNG key: jax.random.key(seed), or a raw uint32[2] "
        f"jax.random.PRNGKey(seed); got {describe(key)}"
    )


def check_positive_int(name: str, value, low: int = 1) -> int:
    """`value` as an int >= low (1 unless told)."""
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; got {describe(value)}")
    return int(value)


def check_token(name: str, value, vocab: int) -> int:
    if not _is_int(value) or not 0 <= value < vocab:
        raise ValueError(f"{name} must be an int token id in [0, {vocab}); got {describe(value)}")
    return int(value)


def check_stop_tokens(stop_tokens, vocab: int) -> list[int]:
    if isinstance(stop_tokens, (np.ndarray, jax.Array)):
        stop_tokens = _integer_array("stop_tokens", stop_tokens, 1).tolist()
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (Sequence, np.ndarray, set, frozenset)):
        raise TypeError(
            f"stop_tokens must be a sequence of token ids, e.g. [2] or (); got {describe(stop_tokens)}"
        )
    values = list(stop_tokens)
    bad_type = [t for t in values if not _is_int(t)]
    if bad_type:
        raise TypeError(f"stop_tokens must hold int token ids; got {describe(bad_type[0])}")
    bad = [int(t) for t in values if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_tokens {bad} are outside the vocabulary [0, {vocab})")
    return [int(t) for t in values]


def check_rows(rows, batch: int):
    """Global rollout ids [batch] (int), or None for arange(batch). A jax.Array keeps its
    placement (the trainer shards rows over the generation mesh): only dtype and shape are read."""
    if rows is None:
        return np.arange(batch, dtype=np.int32)
    array = rows if isinstance(rows, jax.Array) else np.asarray(rows)
    if array.dtype.kind not in "iu" or tuple(array.shape) != (batch,):
        raise ValueError(
            f"rows must be {batch} integer rollout ids (shape ({batch},)); got dtype "
            f"{array.dtype} and shape {tuple(array.shape)}"
        )
    return array.astype(np.int32) if array.dtype != np.int32 else array


def check_order(order, batch: int) -> np.ndarray:
    """The order in which prompts take slots: a permutation of 0..batch-1 (None: prompt
    order)."""
    if order is None:
        return np.arange(batch, dtype=np.int32)
    array = np.asarray(order)
    if array.dtype.kind not in "iu" or array.shape != (batch,) \
            or not np.array_equal(np.sort(array), np.arange(batch)):
        raise ValueError(f"order must be a permutation of the {batch} prompt indices 0..{batch - 1}; "
                         f"got {describe(order)}")
    return array.astype(np.int32)
