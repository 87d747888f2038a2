"""The policy as the engine decodes with it: per-layer weight copies made once per params."""

from __future__ import annotations

import threading
import weakref

import jax

from jaxspec.models import HybridPolicy, Policy

# The last params unstacked for decoding: (weak references to their leaves, the per-layer
# copies). One entry: a new params object replaces it, and it goes when its params die. The
# lock makes the check-and-replace one step for threads generating with different params.
_UNSTACKED: list = []
_UNSTACKED_LOCK = threading.RLock()  # reentrant: a finalizer may run inside the lock


@jax.jit
def _unstack(policy: Policy | HybridPolicy) -> tuple | dict:
    return policy.unstack_layers().layer_params


def _forget(entry) -> None:  # a cached entry's params were freed: free its copies too
    with _UNSTACKED_LOCK:
        if _UNSTACKED and _UNSTACKED[0] is entry:
            _UNSTACKED.clear()


def decoding_policy(policy: Policy | HybridPolicy) -> Policy | HybridPolicy:
    """`policy` as `generate` decodes with it: with its per-layer weight copies attached
    when decoding unrolls the layers (CPU, `Policy.decodes_unrolled`; a hybrid's always),
    made once per params
    object and reused by every later call with the same arrays. Made inside each call's
    program instead, the copies would cost every call one pass over the weights into fresh
    memory. The cache holds one params object's copies (one more copy of the
    layer weights in host memory) and only weak references to the params: the copies go
    when the params do.

    Time a policy's forwards through it to measure what the engine pays: a bare policy's
    forward on CPU scans the stacked layers, which copies each layer's weights at every
    forward."""
    # (a HybridPolicy always runs its layers unrolled: HybridPolicy.unstack_layers)
    unrolled = policy.decodes_unrolled(0, 0) if isinstance(policy, Policy) else True
    if policy.layer_params is not None or not unrolled:
        return policy
    leaves = jax.tree.leaves(policy.params)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):  # under a trace: nothing to keep
        return policy.unstack_layers().without_stacked_layers()
    with _UNSTACKED_LOCK:
        entry = _UNSTACKED[0] if _UNSTACKED else None
        if entry is None or len(entry[0]) != len(leaves) or any(
                ref() is not x for ref, x in zip(entry[0], leaves)):
            _UNSTACKED.clear()  # the old copies go before the new ones are made
            entry = ([weakref.ref(x) for x in leaves], _unstack(policy))
            _UNSTACKED.append(entry)
            weakref.finalize(leaves[0], _forget, entry)
    # Without the stacked weights: the programs take the per-layer copies only (XLA counts
    # arguments against its memory limit; Policy.without_stacked_layers).
    return policy.replace(layer_params=entry[1]).without_stacked_layers()
