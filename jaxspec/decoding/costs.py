"""The costs adaptive k weighs: one loop iteration's time at each draft length, measured on
the call's own shapes through `generate`'s public arguments (`AdaptiveK.force`,
`max_iterations`)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.adaptive import AdaptiveK, budget_interval
from jaxspec.decoding.engine import generate
from jaxspec.timing import interleaved

__all__ = ["measure_costs"]


def measure_costs(
    policy,
    drafter,
    prompts,
    *,
    ks=None,
    iterations: int = 32,
    rounds: int = 5,
    verbose: bool = False,
    **generate_kwargs,
) -> AdaptiveK:
    """Measure c_k, the time of one loop iteration at each draft length k, on the shapes of
    `generate(policy, prompts, drafter=drafter, **generate_kwargs)` (same prompts, slots,
    max_new_tokens, ...), and return the AdaptiveK that `generate(adaptive=...)` takes.

    The programs of the real call serve every k: k is forced through a traced argument (on
    one full-length cache, `generate(grow_cache=False)`; k = 0 times the plain phase, as it
    runs). Per round and k: the first `iterations` iterations at k are timed and the
    prefill-only call (0 iterations, through the same phase program) is subtracted; c_k = median over rounds of that over
    the iterations run (floored at a tenth of the whole call's time per iteration, so noise
    cannot make a cost vanish). With k = 0 in ks, also `probe_cost`: a call with one probe
    (after `iterations` plain iterations) minus k = 0 for as many iterations, median over
    rounds, at least c_1 - c_0 for the shallowest drafted k. ks: default 0..drafter.k.
    Other AdaptiveK fields: `dataclasses.replace` the result.
    """
    if ks is None:
        ks = tuple(range(drafter.max_depth + 1))
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1; got {iterations!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1; got {rounds!r}")
    probe = AdaptiveK(jnp.ones((len(ks),), jnp.float32), ks=tuple(ks))

    def call(force, n):
        # one full-length cache: a growing one would charge the deeper k's (which outgrow
        # the first capacity sooner) for the growth, skewing the ratios
        forced = dataclasses.replace(probe, force=force)
        return lambda: generate(policy, prompts, drafter=drafter, adaptive=forced,
                                max_iterations=n, grow_cache=False, **generate_kwargs)

    # the prefill-only baseline, per program path: a call at k = 0 goes from the prefill to
    # the plain phase's program, one drafting to the draft phase's (each dispatched once)
    fns = {"prefill": call(-1, 0)}
    if 0 in probe.ks:
        fns["prefill_plain"] = call(probe.ks.index(0), 0)
    fns.update({f"k{k}": call(i, iterations) for i, k in enumerate(probe.ks)})
    measure_probe = 0 in probe.ks
    if measure_probe:
        # one probe after `iterations` plain ones, of a drafter no k can make pay (alpha 0 and
        # drafts that cost 1e6 plain iterations: the probe drafts the shallowest k, then k = 0
        # again), against k = 0 for as many iterations: what a probe costs in the real call
        # (its deferred observation, its draft, the switches to its program and back)
        after = iterations + 4
        hopeless = dataclasses.replace(
            probe, prior=0.0, first_probe=iterations,
            costs=jnp.asarray([1.0 if k == 0 else 1e6 for k in probe.ks], jnp.float32))
        fns["probe"] = lambda: generate(policy, prompts, drafter=drafter, adaptive=hopeless,
                                        max_iterations=after, grow_cache=False, **generate_kwargs)
        fns["k0_probe"] = call(probe.ks.index(0), after)
    runs = {name: fn() for name, fn in fns.items()}  # compiles (once: force and n are traced)
    iters = {name: int(out.stats.target_forwards) for name, out in runs.items()}
    times = interleaved(fns, rounds)
    costs = []
    for k in probe.ks:
        name = f"k{k}"
        if iters[name] < 1:
            raise ValueError(f"measure_costs: no iteration ran at k={k} (every row finished in "
                             f"the prefill?)")
        prefill = times["prefill_plain" if k == 0 else "prefill"]
        loop = float(np.median([t - t0 for t, t0 in zip(times[name], prefill)]))
        costs.append(max(loop, 0.1 * float(np.median(times[name]))) / iters[name])
    if not all(math.isfinite(c) and c > 0 for c in costs):
        raise RuntimeError(f"measure_costs: invalid costs {costs}")
    probe_cost, probed = 0.0, False
    if measure_probe:
        # at least the draft iteration's own extra cost, and never free: timing noise on a
        # loaded machine can put c_1 under c_0 (then 1% of c_1)
        floor = max(costs[1] - costs[0], 0.01 * costs[1])
        k_iters = np.asarray(runs["probe"].stats.k_iterations)
        probed = (iters["probe"] == iters["k0_probe"] == after and int(k_iters[1:].sum()) == 1)
        if probed:
            extra = float(np.median([t - t0 for t, t0 in zip(times["probe"], times["k0_probe"])]))
            probe_cost = max(extra, floor)
        else:  # every row finished before the probe: its deferred work is not measurable here
            probe_cost = floor
    adaptive = dataclasses.replace(probe, costs=jnp.asarray(costs, jnp.float32), probe_cost=probe_cost)
    if verbose:
        base = costs[0]
        print("adaptive k costs per iteration: " + ", ".join(
            f"k={k} {c * 1e3:.2f} ms ({c / base:.2f}x)" for k, c in zip(probe.ks, costs)), flush=True)
        if measure_probe:
            print(f"adaptive k probe: {probe_cost * 1e3:.2f} ms beyond a k = 0 iteration"
                  f"{'' if probed else ' (the draft iteration only: no row lived to the probe)'}; "
                  f"a drafter no k can make pay is probed every >= "
                  f"{int(budget_interval(adaptive))} iterations "
                  f"({float(adaptive.probe_budget):.1%} of the time)", flush=True)
    return adaptive
