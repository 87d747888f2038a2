"""The draft depth of a loop iteration, as a policy object the loop step is handed.

`FullDepth`: the drafter as given, observing every iteration. `AdaptiveDepth(k)`: one static
draft length of adaptive k (`jaxspec.decoding.adaptive`): the drafter's `with_k(k)` (k = 0:
plain decoding), the acceptance counts and probe clock updated after drafted iterations,
and, for a drafter whose `observe` runs a network (`LoopSpec.defer`), k = 0 iterations that
keep the committed entries in a window (`record`) instead of observing them; the draft
phase observes them first, in one forward sized to the draft cache (`flush`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.loop_state import LoopInputs, LoopSpec, LoopState
from jaxspec.decoding.protocols import Drafter, EstimatesAcceptance, Observation
from jaxspec.decoding.slots import reset_draft_rows


@dataclasses.dataclass(frozen=True)
class FullDepth:
    """Every iteration drafts with the drafter as given (no adaptive k)."""

    k = None

    def drafter(self, inp: LoopInputs) -> Drafter:
        return inp.drafter

    def drafted(self, spec: LoopSpec) -> int:  # depths the iteration proposes
        return spec.max_depth

    def refill_options(self, spec: LoopSpec) -> dict:
        """`slots.refill`'s options: refills observe their prompts at once."""
        return dict(defer_prompts=False, window_live=False)

    def absorb(self, spec: LoopSpec, inp: LoopInputs, s: LoopState, draft_state, obs: Observation):
        """-> (draft state, deferred window, draft forwards): the drafter observes now."""
        return inp.drafter.observe(draft_state, inp.policy, obs), s.pending, inp.drafter.forwards_per_observe

    def after(self, inp: LoopInputs, s: LoopState, num_accepted, active, iteration) -> LoopState:
        """The state's adaptive books after the iteration: none."""
        return s


@dataclasses.dataclass(frozen=True)
class AdaptiveDepth:
    """One iteration at static draft length k of `inp.adaptive`; `record` (k = 0, [] bool,
    traced: `phases.plain_phase`): keep the iteration's entries for the drafter's next
    observation."""

    k: int
    record: jax.Array | bool = True

    def drafter(self, inp: LoopInputs) -> Drafter:  # (k = 0: NoDrafter)
        return inp.variants[self.k]

    def drafted(self, spec: LoopSpec) -> int:
        return self.k

    def defers(self, spec: LoopSpec) -> bool:  # k = 0 of a drafter that defers its observations
        return spec.defer and self.k == 0

    def refill_options(self, spec: LoopSpec) -> dict:
        """`slots.refill`'s options after this iteration: prompts started during k = 0 wait
        for the flush, and a started row's old entries leave the window (which is empty
        before k = 0's recording iterations: the clearing changes nothing there)."""
        return dict(defer_prompts=self.defers(spec), window_live=self.defers(spec))

    def absorb(self, spec: LoopSpec, inp: LoopInputs, s: LoopState, draft_state, obs: Observation):
        """-> (draft state, deferred window, draft forwards)."""
        if not self.defers(spec):
            return (inp.drafter.observe(draft_state, inp.policy, obs), s.pending,
                    inp.drafter.forwards_per_observe)
        at = s.stats.target_forwards % spec.window  # one entry per row, over the window's oldest

        def put(w, e):  # (a record that is False writes the old entry back)
            e = jnp.where(self.record, e, jax.lax.dynamic_slice_in_dim(w, at, 1, axis=1))
            return jax.lax.dynamic_update_slice_in_dim(w, e, at, axis=1)
        return draft_state, jax.tree.map(put, s.pending, obs), 0

    def after(self, inp: LoopInputs, s: LoopState, num_accepted, active, iteration) -> LoopState:
        """Drafted iterations count at their k and update the acceptance counts, and the
        drafter's estimate from this iteration's draft where it makes one (k = 0's iterations
        are counted when its phase ends, `phases.plain_phase`)."""
        if self.k == 0:
            return s
        stats = dataclasses.replace(s.stats, k_iterations=s.stats.k_iterations.at[self.k].add(1))
        estimate = (inp.drafter.acceptance_estimate(s.draft_state)
                    if isinstance(inp.drafter, EstimatesAcceptance) else None)
        adapt = s.adapt.update(inp.adaptive, self.k, num_accepted, active, iteration, estimate)
        return dataclasses.replace(s, stats=stats, adapt=adapt)


def flush(spec: LoopSpec, inp: LoopInputs, s: LoopState, when):
    """Where `when` ([] bool; the draft phase: its loop runs), reset the drafter rows of
    rollouts started during k = 0 (if any) and observe the deferred entries (if any: their
    prompts, then the window) in one forward, in position order and cut to the draft cache's
    capacity (the entries hold distinct positions below it, so no real entry is cut).
    -> (state with the deferred buffers emptied where `when`, draft forwards spent)."""
    pending, pending_prompt, pending_reset = s.pending, s.pending_prompt, s.pending_reset
    both = pending if pending_prompt is None else jax.tree.map(
        lambda a, b: jnp.concatenate([a, b], axis=1), pending_prompt, pending)
    has = jnp.any(both.positions >= 0) & when
    resets = (jnp.asarray(False) if pending_reset is None else jnp.any(pending_reset)) & when

    def catch_up(st):  # the inner conditionals run only where there is something to do
        if pending_reset is not None:
            st = jax.lax.cond(resets, lambda t: reset_draft_rows(spec, inp, t, pending_reset),
                              lambda t: t, st)
        observe = lambda t: inp.drafter.observe(t, inp.policy, both.in_position_order(limit=spec.max_len))  # noqa: E731
        return jax.lax.cond(has, observe, lambda t: t, st)

    draft_state = jax.lax.cond(has | resets, catch_up, lambda st: st, s.draft_state)
    emptied = lambda new, old: jax.tree.map(lambda a, b: jnp.where(when, a, b), new, old)  # noqa: E731
    s = dataclasses.replace(
        s, draft_state=draft_state, pending=emptied(pending.cleared(), pending),
        pending_prompt=None if pending_prompt is None else emptied(pending_prompt.cleared(), pending_prompt),
        pending_reset=None if pending_reset is None else pending_reset & ~when)
    return s, has.astype(jnp.int32) * inp.drafter.forwards_per_observe
