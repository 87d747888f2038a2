"""The policy's decoding state as the loop carries it: a `KVCache` (dense and MoE policies),
or a `HybridCache` (Gated DeltaNet policies: the KV cache of the full-attention layers plus
each row's convolution and delta-rule states).

The loop asks four things of it, whatever the policy: a verify forward (`verify_forward`),
keeping what the verdict accepted (`keep_accepted`), a prefilled row written into a slot
(`write_row`) and where each leaf keeps its rows and cache positions (`cache_axes`, for
refills and cache growth). A hybrid verify of k drafts defers its states
(`HybridPolicy.forward(defer_state=True)`: it applies the row's pending tokens and keeps its
own pending) and `keep_accepted` keeps the root and the accepted drafts pending
(`DeltaSteps.commit`), which the row's next forward applies as it reads the states (where
the recurrent kernel runs: the states read and written once per iteration), or applies them
at once elsewhere (CPU, a mesh, the batch-invariant rule: `DeltaSteps.settle`): either way
what plain decoding of the same tokens holds (docs/design.md, "Hybrid policies").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import parallel
from jaxspec.decoding.protocols import DraftsChains, StateAxes, kv_cache_axes
from jaxspec.decoding.tree import Tree
from jaxspec.models import HybridCache, HybridPolicy, KVCache, compact
from jaxspec.models.hybrid import PendingSteps

__all__ = ["cache_axes", "check_chains", "keep_accepted", "sharded", "verify_forward",
           "with_verify_buffer", "write_row"]


def is_recurrent(policy) -> bool:
    """Whether the policy carries recurrent states beside its KV cache (a hybrid policy)."""
    return isinstance(policy, HybridPolicy)


def check_chains(drafter, policy) -> None:
    """Host-side, before anything traces: a hybrid policy verifies chains only (one
    recurrent state per row, not per tree node); raises ValueError naming the drafter and
    the family otherwise."""
    if not is_recurrent(policy) or drafter.num_nodes == 0:
        return
    if isinstance(drafter, DraftsChains) and drafter.drafts_chains:
        return
    name = type(drafter).__name__
    raise ValueError(
        f"{name} proposes draft trees (num_nodes={drafter.num_nodes}, max_depth="
        f"{drafter.max_depth}), which policy family {policy.config.family!r} cannot verify: its "
        f"Gated DeltaNet layers keep one recurrent state per row, and a tree would need one per "
        f"node. Use a chain drafter (NGramDrafter, DraftModelDrafter, Eagle3Drafter or "
        f"MTPDrafter with tree=None, BlockDrafter), or plain decoding (drafter=None)")


def with_verify_buffer(policy, nodes: int):
    """`policy` whose caches hold `nodes` + 1 pending tokens (a hybrid's verify of chains of
    up to `nodes` drafts defers into them: `HybridPolicy.pending_tokens`); others as given."""
    if not is_recurrent(policy):
        return policy
    return policy.replace(pending_tokens=nodes + 1 if nodes else 0)


def cache_axes(policy) -> KVCache | HybridCache:
    """The policy cache's pytree with a `StateAxes` per leaf: its row axis and its cache-slot
    axis (None: the leaf's size does not depend on the capacity)."""
    if not is_recurrent(policy):
        return kv_cache_axes()
    rows = StateAxes(row=1)
    return HybridCache(kv=kv_cache_axes(), conv=rows, state=rows, pending=PendingSteps(
        q=rows, k=rows, v=rows, g=rows, beta=rows, x=rows, count=StateAxes(row=0)))


def sharded(cache: KVCache | HybridCache) -> KVCache | HybridCache:
    """`cache` with rows over the batch mesh axes and KV heads over tensor (no-ops without a
    mesh); a hybrid's recurrent states by row."""
    kv = cache.kv if isinstance(cache, HybridCache) else cache
    kv = KVCache(k=parallel.constrain(kv.k, parallel.KV_CACHE_AXES),
                 v=parallel.constrain(kv.v, parallel.KV_CACHE_AXES),
                 lengths=parallel.constrain(kv.lengths, ("batch",)))
    if not isinstance(cache, HybridCache):
        return kv
    rows = lambda a: parallel.constrain(a, ("layers", "batch") + (None,) * (a.ndim - 2))  # noqa: E731
    p = cache.pending
    return HybridCache(
        kv=kv, conv=rows(cache.conv), state=rows(cache.state),
        pending=PendingSteps(*(rows(a) for a in p.inputs()),
                             count=parallel.constrain(p.count, ("batch",))))


def verify_forward(
    policy,
    fed,  # [B, N+1] int32: each row's root, then its tree's nodes
    positions,  # [B, N+1] int32; < 0 marks padding (rows not fed)
    cache,
    tree: Tree,
    *,
    capture: tuple[int, ...],
    routing: bool,
):  # -> (logits [B, N+1, V] f32, captured {layer: [B, N+1, H]}, cache, routing or None, steps)
    """The verify forward of one loop iteration. A hybrid policy's states stay as they were
    when the tree has drafts (`steps`: the `DeltaSteps` `keep_accepted` commits); a plain
    step (an empty tree: the root alone, always kept) advances them at once (steps None)."""
    if not is_recurrent(policy):
        logits, captured, cache, *route = policy.forward(
            fed, positions, cache, mask=tree.attention_mask(), capture=capture, routing=routing)
        return logits, captured, cache, route[0] if route else None, None
    if not tree.is_chain:  # (check_chains refuses such drafters on the host first)
        raise ValueError(f"policy family {policy.config.family!r} verifies chains only; got a "
                         f"tree of {tree.num_nodes} nodes")
    if tree.num_nodes == 0:
        logits, captured, cache = policy.forward(fed, positions, cache, capture=capture)
        return logits, captured, cache, None, None
    logits, captured, cache, steps = policy.forward(fed, positions, cache, capture=capture,
                                                    defer_state=True)
    return logits, captured, cache, None, steps


def keep_accepted(
    cache,
    steps,  # DeltaSteps of a hybrid verify, or None
    kept,  # [B, N+1] int32: the fed indices kept, in order (root and accepted drafts); -1 none
    *,
    num_fed: int,
    fed_mask,  # [B] bool: rows the verify fed
    prefix: bool,  # the tree is a chain (kept entries already contiguous)
):
    """The cache after a verify holding exactly the kept entries: the KV compacted
    (`jaxspec.models.compact`), and a hybrid's kept entries (the root and the accepted
    drafts) committed (`DeltaSteps.commit`: left pending for the row's next forward, or
    applied at once where it settles); the states then hold what a plain decode of them
    would leave."""
    if not isinstance(cache, HybridCache):
        return compact(cache, kept, num_fed=num_fed, fed_mask=fed_mask, prefix=prefix)
    cache = dataclasses.replace(
        cache, kv=compact(cache.kv, kept, num_fed=num_fed, fed_mask=fed_mask, prefix=prefix))
    if steps is None:
        return cache
    return steps.commit(cache, jnp.sum(kept >= 0, axis=1, dtype=jnp.int32))


def write_row(
    cache,  # the loop's cache: leaves [.., slots, ..]
    sub,  # a one-row cache of the same kind (a prefill), capacity <= the loop's
    slot,  # [] int32 the slot to write
    axes,  # `cache_axes` of the policy
):
    """`cache` with row `slot` replaced by `sub`'s row (its first sub-capacity slots; the rest
    of the row is stale and never read: a row holds slots [0, lengths)). A hybrid row's
    recurrent states are `sub`'s whole, so a refilled slot starts from the prefill's, with
    nothing pending (a prefill leaves none; `sub` must come from the same policy's
    `init_cache`, whose pending buffer has the loop's size)."""
    def put(full, part, ax):
        start = [0] * full.ndim
        start[ax.row] = slot
        return jax.lax.dynamic_update_slice(full, part.astype(full.dtype), tuple(start))

    return jax.tree.map(put, cache, sub, axes, is_leaf=lambda x: isinstance(x, StateAxes))
