"""The loops one segment runs: all iterations at the drafter's depth, or, under adaptive k,
a draft phase and a plain phase (one compiled program each, switched by the host driver).

The draft phase runs one inner `while_loop` per drafted k, each while that k is the choice
(not a `lax.switch`: XLA copies the loop state, the KV cache included, into a conditional's
branch every iteration, while loops update it in place), and ends where k = 0 is chosen. The
plain phase runs k = 0 until the next probe in a loop of its own at the program's top level
(the choice cannot change before it: k = 0 adds no counts), keeping entries for the drafter
only in its last `window` iterations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.adaptive import choose_k
from jaxspec.decoding.loop import running, step
from jaxspec.decoding.loop_state import LoopInputs, LoopSpec, LoopState
from jaxspec.decoding.schedule import AdaptiveDepth, FullDepth, flush


def plain_index(inp: LoopInputs) -> int | None:
    """The index of k = 0 in the adaptive ks (None: no adaptive k, or no k = 0)."""
    ks = () if inp.adaptive is None else inp.adaptive.ks
    return ks.index(0) if 0 in ks else None


def pick(inp: LoopInputs, s: LoopState):
    """[] int32 the index into adaptive.ks of the next iteration's k (forced, or chosen)."""
    return jnp.where(inp.force_k >= 0, inp.force_k,
                     choose_k(s.adapt, inp.adaptive, s.stats.target_forwards))


def full_loop(spec: LoopSpec, inp: LoopInputs, s: LoopState) -> LoopState:
    """Every iteration at the drafter's own depth, while `running`."""
    return jax.lax.while_loop(lambda s: running(spec, inp, s),
                              lambda s: step(spec, inp, s, FullDepth()), s)


def draft_phase(spec: LoopSpec, inp: LoopInputs, s: LoopState) -> LoopState:
    """Adaptive k: iterations at the chosen drafted k, until the loop stops or k = 0 is
    chosen, after the drafter has observed what k = 0 deferred (`schedule.flush`: once, at
    the phase's start, as nothing is deferred while it drafts; counted as draft forwards
    where the loop runs). Every inner pass runs at least one iteration."""
    ks, zero = inp.adaptive.ks, plain_index(inp)

    def goes_on(s):  # another drafted iteration: running, and k = 0 (if a choice) not chosen
        return running(spec, inp, s) if zero is None else running(spec, inp, s) & (pick(inp, s) != zero)

    if spec.defer:
        s, forwards = flush(spec, inp, s, when=goes_on(s))
        s = dataclasses.replace(s, stats=dataclasses.replace(
            s.stats, draft_forwards=s.stats.draft_forwards + forwards))

    def body(s):
        for i, k in enumerate(ks):
            if k:
                s = jax.lax.while_loop(lambda s, i=i: running(spec, inp, s) & (pick(inp, s) == i),
                                       lambda s, k=k: step(spec, inp, s, AdaptiveDepth(k)), s)
        return s

    return jax.lax.while_loop(goes_on, body, s)


def plain_phase(spec: LoopSpec, inp: LoopInputs, s: LoopState) -> LoopState:
    """Adaptive k = 0 until the next probe (or to the iteration cap when k = 0 is forced);
    entries kept for the drafter only in the last `window` iterations (a traced `record`:
    one loop, one copy of the step). Its iterations are counted at k = 0 when it ends."""
    window = inp.adaptive.window
    forced = inp.force_k == plain_index(inp)
    start = s.stats.target_forwards
    end = jnp.where(forced, inp.max_iterations, s.adapt.next_probe)
    s = jax.lax.while_loop(  # (forced: `running` stops at the cap, which is `end`)
        lambda s: running(spec, inp, s) & (s.stats.target_forwards < end),
        lambda s: step(spec, inp, s, AdaptiveDepth(
            0, record=~forced & (s.stats.target_forwards >= end - window))), s)
    st = s.stats
    return dataclasses.replace(s, stats=dataclasses.replace(
        st, k_iterations=st.k_iterations.at[0].add(st.target_forwards - start)))
