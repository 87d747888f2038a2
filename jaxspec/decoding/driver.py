"""The host side of a `generate` call: the loop in segments, each one call of a compiled
program that continues the state of the one before.

A segment ends when the loop ends, when a live row outgrows the current cache (the next
runs in a larger one: `capacity_tiers`, `grow_state`), or, under adaptive k, when the
choice switches between drafting and k = 0 (`phases`: a draft and a plain program).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import parallel
from jaxspec.decoding.loop import start, where_now
from jaxspec.decoding.loop_state import LoopInputs, LoopSpec, LoopState
from jaxspec.decoding.phases import (
    draft_phase,
    full_loop,
    pick,
    plain_index,
    plain_phase,
)
from jaxspec.decoding.policy_cache import cache_axes, sharded
from jaxspec.decoding.protocols import HasStateAxes, ReportsStats, StateAxes
from jaxspec.decoding.slots import harvest
from jaxspec.decoding.stats import Rollouts
from jaxspec.kernels import compiler_options, platform

FIRST_CAPACITY = 64  # cache slots of the first segment when the cache grows


def growth_axes(policy, drafter) -> tuple | None:
    """Per flattened leaf of (policy cache, drafter state): its declared capacity axis, or
    None (fixed size); None overall when the drafter declares no axes (then no growing)."""
    if not isinstance(drafter, HasStateAxes):
        return None
    axes = jax.tree.leaves((cache_axes(policy), drafter.state_axes(policy)),
                           is_leaf=lambda x: isinstance(x, StateAxes))
    return tuple(a.length for a in axes)


def capacity_tiers(policy, drafter, width: int, nodes: int, max_len: int, grow_cache) -> list[int]:
    """The cache capacities generation runs through: [max_len], or, growing, the smallest
    power of two >= max(FIRST_CAPACITY, 2 (width + nodes + 1)), doubled while the double
    still fits in max_len, then max_len (a max_len under twice the first: just [max_len]).
    grow_cache None: grow on CPU only."""
    if grow_cache is None:
        grow_cache = platform() == "cpu"  # the target's platform (jaxspec.kernels.platform)
    first = max(FIRST_CAPACITY, 1 << (2 * (width + nodes + 1) - 1).bit_length())
    if not grow_cache or 2 * first > max_len or growth_axes(policy, drafter) is None:
        return [max_len]
    tiers = []
    while 2 * first <= max_len:
        tiers.append(first)
        first *= 2
    return tiers + [max_len]


@partial(jax.jit, static_argnames=("capacity", "pad_id", "axes", "classes"))  # (donating: no buffer has the new shape)
def grow_state(state: LoopState, policy, drafter, *, capacity: int, pad_id: int, axes: tuple,
               classes: tuple = ()) -> LoopState:
    """`state` moved into a cache of `capacity` slots: every capacity-sized leaf (the token
    buffer, log-probs, the policy's KV cache (`policy_cache.cache_axes`), the drafter's leaves along their declared
    `length` axis: `axes`, from `growth_axes`) copied into the front of a fresh one.
    `classes` (`LoopSpec.classes`) keeps the program of one drafter class from another's."""
    del classes
    batch, old = state.buffer.shape
    fresh = (policy.init_cache(batch, capacity), drafter.init_state(policy, batch, capacity))
    leaves, treedef = jax.tree.flatten((state.cache, state.draft_state))
    grown = [
        x if ax is None else jax.lax.dynamic_update_slice(f, x.astype(f.dtype), (0,) * x.ndim)
        for x, f, ax in zip(leaves, jax.tree.leaves(fresh), axes)
    ]
    cache, draft_state = jax.tree.unflatten(treedef, grown)
    cache = sharded(cache)  # (a hybrid's recurrent states have no capacity axis: carried as is)
    pad = ((0, 0), (0, capacity - old))
    return dataclasses.replace(
        state,
        buffer=parallel.constrain(jnp.pad(state.buffer, pad, constant_values=pad_id), ("batch", "length")),
        logprobs=jnp.pad(state.logprobs, pad), cache=cache, draft_state=draft_state,
        routes=None if state.routes is None else jnp.pad(
            state.routes, pad + ((0, 0), (0, 0)), constant_values=-1))


def run_segment(inp: LoopInputs, state_in: LoopState | None, *, spec: LoopSpec, phase: str = "all"):
    """`segment`, compiled with the target platform's XLA options (`kernels.compiler_options`:
    on a GPU, room for the donated KV cache in XLA's rematerialization limit)."""
    options = compiler_options()
    key = tuple(sorted(options.items()))
    program = _SEGMENTS.get(key)
    if program is None:  # state_in is donated: a later segment's loop takes over its buffers
        program = _SEGMENTS[key] = jax.jit(segment, static_argnames=("spec", "phase"),
                                           donate_argnames=("state_in",),
                                           compiler_options=options or None)
    return program(inp, state_in, spec=spec, phase=phase)


_SEGMENTS: dict = {}  # compiled `segment` per set of compile options


def segment(inp: LoopInputs, state_in: LoopState | None, *, spec: LoopSpec, phase: str = "all"):
    """One segment: from `state_in` (None: the prefill), the loop of `phase` ("all": no
    adaptive k or no k = 0; "init": the prefill only; "draft" / "plain": adaptive k's
    phases). -> (state, Rollouts so far (None for "init"), `where_now` [3] bool)."""
    padded = jnp.full((spec.num_prompts, spec.max_len), spec.pad_id, jnp.int32)
    inp = dataclasses.replace(inp, padded_prompts=padded.at[:, :spec.width].set(inp.prompt_tokens))
    state = start(spec, inp) if state_in is None else state_in
    zero = plain_index(inp)
    if phase == "init":  # k = 0 goes on only where it is also the choice (a carried clock
        now = where_now(spec, inp, state, zero)  # can put the first probe later)
        if zero is not None:
            now = now.at[2].set(now[2] & (pick(inp, state) == zero))
        return state, None, now
    if phase == "plain":
        final = plain_phase(spec, inp, state)
    elif phase == "draft" or inp.adaptive is not None:  # (adaptive k without k = 0: one phase)
        final = draft_phase(spec, inp, state)
    else:
        final = full_loop(spec, inp, state)
    # Every slot's rollout so far (a later segment harvests unfinished ones again).
    final = harvest(spec, inp, final, jnp.ones((spec.slots,), bool))
    # Rows over the batch mesh axes, as the inputs were (the harvest scatter loses it).
    return final, Rollouts(
        parallel.constrain(final.out_tokens, ("batch", "length")),
        parallel.constrain(final.out_lengths, ("batch",)),
        parallel.constrain(final.out_logprobs, ("batch", "length")),
        final.stats,
        inp.drafter.draft_stats(final.draft_state) if isinstance(inp.drafter, ReportsStats) else {},
        next_probe=None if final.adapt is None
        else jnp.maximum(final.adapt.next_probe - final.stats.target_forwards, 0),
        routes=final.out_routes,
    ), where_now(spec, inp, final, zero)


def _flags(now) -> tuple[bool, bool, bool]:  # where_now on the host: ended, outgrew, k = 0 goes on
    return tuple(bool(x) for x in np.asarray(now))


def _phased(inp: LoopInputs, state, spec: LoopSpec, in_plain: bool):
    """Adaptive k with k = 0: draft and plain phases alternating until the loop ends or a
    live row outgrows the capacity. -> (state, rollouts, ended, in_plain)."""
    if state is None:  # a call that starts at k = 0 starts in the plain phase
        state, _, now = run_segment(inp, None, spec=spec, phase="init")
        in_plain = _flags(now)[2]
    while True:
        if not in_plain:
            state, out, now = run_segment(inp, state, spec=spec, phase="draft")
            ended, outgrew, _ = _flags(now)
            if ended or outgrew:
                return state, out, ended, False
        state, out, now = run_segment(inp, state, spec=spec, phase="plain")
        ended, outgrew, in_plain = _flags(now)
        if ended or outgrew:
            return state, out, ended, in_plain
        in_plain = False


def drive(inp: LoopInputs, spec: LoopSpec, tiers: list[int], axes: tuple | None) -> Rollouts:
    """Run the loop through the capacities `tiers` (`capacity_tiers`; `axes`: `growth_axes`)
    -> the call's Rollouts (wall time not filled in)."""
    phased = plain_index(inp) is not None
    state, in_plain = None, False  # a plain phase that a growth cut short goes on after it
    for i, capacity in enumerate(tiers):
        seg = dataclasses.replace(spec, max_len=capacity)
        if state is not None:  # a live row outgrew the last capacity: continue in a larger one
            state = grow_state(state, inp.policy, inp.drafter, capacity=capacity,
                               pad_id=spec.pad_id, axes=axes, classes=spec.classes)
        if phased:
            state, out, ended, in_plain = _phased(inp, state, seg, in_plain)
        else:
            state, out, now = run_segment(inp, state, spec=seg)
            ended = _flags(now)[0] if i + 1 < len(tiers) else True
        if ended:
            break
    return out
