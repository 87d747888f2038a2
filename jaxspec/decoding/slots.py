"""Slots (continuous batching): rollouts leave their rows and waiting prompts take them.

`harvest` copies finished rollouts out of their slots (in prompt order); `refill` starts the
next waiting prompts in the free slots (MaxEngine's `insert`): their buffer rows, a one-row
prefill written into the slot's cache rows, and the drafter's row started afresh, by the
drafter's own hook (`protocols.RefillsRows`) or along its declared row axes
(`protocols.HasStateAxes`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.loop_state import LoopInputs, LoopSpec, LoopState
from jaxspec.decoding.policy_cache import cache_axes, write_row
from jaxspec.decoding.protocols import Observation, StateAxes


def row_axes(drafter, policy) -> tuple:
    """Per flattened leaf of the drafter's state: its declared row axis (None: shared)."""
    axes = jax.tree.leaves(drafter.state_axes(policy), is_leaf=lambda x: isinstance(x, StateAxes))
    return tuple(a.row for a in axes)


def harvest(spec: LoopSpec, inp: LoopInputs, s: LoopState, mask) -> LoopState:
    """Copy the rollouts of the slots where `mask` [slots] is True out, to their prompts' rows
    of `out_*` (a later harvest of an unfinished rollout overwrites it)."""
    plen = inp.prompt_lengths[s.prompt_of]
    n_gen = s.lengths - plen
    offsets = jnp.arange(spec.max_new_tokens, dtype=jnp.int32)[None, :]
    valid = offsets < n_gen[:, None]
    idx = plen[:, None] + offsets
    tok = jnp.where(valid, jnp.take_along_axis(s.buffer, idx, axis=1), spec.pad_id)
    logp = jnp.where(valid, jnp.take_along_axis(s.logprobs, idx, axis=1), 0.0)
    target = jnp.where(mask, s.prompt_of, spec.num_prompts)  # out of range: dropped
    out_routes = s.out_routes
    if s.routes is not None:  # an MoE policy's experts per generated token
        picked = jnp.take_along_axis(s.routes, idx[:, :, None, None], axis=1)
        routes = jnp.where(valid[:, :, None, None], picked, -1)
        out_routes = out_routes.at[target].set(routes, mode="drop")
    return dataclasses.replace(
        s, out_routes=out_routes,
        out_tokens=s.out_tokens.at[target].set(tok, mode="drop"),
        out_logprobs=s.out_logprobs.at[target].set(logp, mode="drop"),
        out_lengths=s.out_lengths.at[target].set(n_gen, mode="drop"),
    )


def refill_draft_row(spec: LoopSpec, inp: LoopInputs, state, slot, obs: Observation):
    """The drafter's state with row `slot` started afresh on a new prompt (`obs`: its one-row
    prefill): the drafter's hook, or every per-row leaf's row from a fresh one-row state that
    has observed the prompt (shared leaves, e.g. counters, taken from it)."""
    drafter, policy = inp.drafter, inp.policy
    if spec.refill_hook:
        return drafter.refill_state(state, policy, slot, obs, spec.max_len)
    leaves, treedef = jax.tree.flatten(state)
    fresh = jax.tree.leaves(drafter.init_state(policy, 1, spec.max_len))
    sub = [old if ax is None else new for old, new, ax in zip(leaves, fresh, spec.row_axes)]
    sub = jax.tree.leaves(drafter.observe(treedef.unflatten(sub), policy, obs))
    out = [
        new if ax is None else jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), slot, ax)
        for old, new, ax in zip(leaves, sub, spec.row_axes)
    ]
    return treedef.unflatten(out)


def reset_draft_rows(spec: LoopSpec, inp: LoopInputs, state, mask):
    """The drafter's state with the rows where `mask` [slots] is True started afresh, without
    observing (one select per per-row leaf, however many rows; shared leaves kept)."""
    leaves, treedef = jax.tree.flatten(state)
    fresh = jax.tree.leaves(inp.drafter.init_state(inp.policy, 1, spec.max_len))
    out = []
    for old, new, ax in zip(leaves, fresh, spec.row_axes):
        if ax is None:
            out.append(old)
            continue
        shape = [1] * old.ndim
        shape[ax] = old.shape[ax]
        out.append(jnp.where(mask.reshape(shape), new.astype(old.dtype), old))
    return treedef.unflatten(out)


def _prefill_slot(spec: LoopSpec, inp: LoopInputs, slot, prompt, carry, defer_prompts: bool):
    """One started slot: its prompt's prefill into the slot's cache rows, and its drafter row
    (started on the prompt now; or, `defer_prompts`, the prompt kept in `pending_prompt`)."""
    cache, draft_state, pending_prompt, pending_reset = carry
    policy, width = inp.policy, spec.width
    toks = jax.lax.dynamic_slice_in_dim(inp.prompt_tokens, prompt, 1, axis=0)  # [1, P]
    pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    pos = jnp.where(pos < inp.prompt_lengths[prompt] - 1, pos, -1)
    _, captured, sub = policy.forward(toks, pos, policy.init_cache(1, width), capture=spec.capture)
    # the slot's first `width` entries (the rest is stale and never read) and its lengths; a
    # hybrid's recurrent states from the prefill's, which started at zero
    cache = write_row(cache, sub, slot, cache_axes(policy))
    obs = Observation(fed_tokens=toks, next_tokens=jnp.roll(toks, -1, axis=1), positions=pos,
                      captured=captured)
    if not defer_prompts:
        return cache, refill_draft_row(spec, inp, draft_state, slot, obs), pending_prompt, pending_reset
    if spec.refill_hook:  # a hook's row starts empty now; its prompt waits for the flush
        draft_state = inp.drafter.refill_state(draft_state, policy, slot, obs.cleared(), spec.max_len)
    # the slot's whole row: the old rollout's deferred prompt goes
    pending_prompt = jax.tree.map(
        lambda w, e: jax.lax.dynamic_update_slice_in_dim(w, e.astype(w.dtype), slot, axis=0),
        pending_prompt, obs)
    if pending_reset is not None:
        pending_reset = pending_reset.at[slot].set(True)
    return cache, draft_state, pending_prompt, pending_reset


def refill(spec: LoopSpec, inp: LoopInputs, s: LoopState, defer_prompts: bool = False,
           window_live: bool = False) -> LoopState:
    """Start the next waiting prompts in the free slots (in slot order).

    defer_prompts (adaptive k = 0): the prompts' entries wait in `pending_prompt` and the
    drafter's rows are reset at the next flush, so k = 0 pays no drafter work. window_live:
    the deferred window may hold the started rows' old rollouts' entries, which go."""
    free = s.done
    nth = s.next_prompt + jnp.cumsum(free, dtype=jnp.int32) - 1  # places in `order`
    start = free & (nth < spec.num_prompts)
    n_start = jnp.sum(start, dtype=jnp.int32)
    prompt_of = jnp.where(start, inp.order[jnp.minimum(nth, spec.num_prompts - 1)], s.prompt_of)
    started_first = jnp.argsort(~start, stable=True).astype(jnp.int32)
    carry = jax.lax.fori_loop(
        0, n_start,
        lambda i, c: _prefill_slot(spec, inp, started_first[i], prompt_of[started_first[i]], c,
                                   defer_prompts),
        (s.cache, s.draft_state, s.pending_prompt, s.pending_reset))
    cache, draft_state, pending_prompt, pending_reset = carry
    observed = 0 if defer_prompts else n_start * inp.drafter.forwards_per_observe
    stats = dataclasses.replace(s.stats, prefill_forwards=s.stats.prefill_forwards + n_start,
                                draft_forwards=s.stats.draft_forwards + observed)
    pending = s.pending
    if window_live:  # a new rollout's row: the old one's deferred entries go
        pending = dataclasses.replace(pending, positions=jnp.where(start[:, None], -1, pending.positions))
    return dataclasses.replace(
        s, pending=pending, pending_prompt=pending_prompt, pending_reset=pending_reset,
        buffer=jnp.where(start[:, None], inp.padded_prompts[prompt_of], s.buffer),
        logprobs=jnp.where(start[:, None], 0.0, s.logprobs),
        routes=None if s.routes is None else jnp.where(start[:, None, None, None], -1, s.routes),
        lengths=jnp.where(start, inp.prompt_lengths[prompt_of], s.lengths),
        done=s.done & ~start, cache=cache, draft_state=draft_state, stats=stats,
        prompt_of=prompt_of, next_prompt=s.next_prompt + n_start,
    )
