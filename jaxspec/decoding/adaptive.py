"""Speculation sized to the batch: the draft length k chosen at every loop iteration.

`generate(..., adaptive=AdaptiveK(...))` compiles one verify step per k in `ks` (0 = plain
decoding) and, before each iteration, picks the k that maximises expected tokens per second:

    E_k / c_k,   E_k = 1 + sum_{i<=k} prod_{j<=i} alpha_j

where c_k is the measured cost of one loop iteration at k (`measure_costs`, once at start-up,
on the call's own shapes: batch or slots, prompt width, drafter) and alpha_j the acceptance
rate at depth j given depth j-1 accepted, estimated from the batch's recent verifications
(decayed counts, each depth shrunk towards the one before it while it has few counts). Every
row of a fixed-shape batch pays an iteration whether it is live or not, so the number of
live rows multiplies every candidate's tokens alike and drops out of the choice; the batch
size enters through c_k, measured at that batch.

A depth that is not drafted is not measured (while k = 0 wins, nothing is): probe
iterations (the first one, then every `probe_every`) draft at the deepest k, so every
depth's estimate keeps being refreshed and a stale low one cannot lock a short k in
(probing only one k deeper than the best did: an unlucky early depth-3 estimate kept k = 1
for a whole call). Only when no drafted k could win even with every depth past the first
always accepted (E_k <= 1 + k alpha_1) does a probe draft the shallowest k: it still
measures alpha_1, at the cost of one draft. A
probe that leaves the best k unchanged doubles the interval to the next one (up to
16 x probe_every; a probe at the shallowest k, of a drafter no k could make pay,
quadruples it, up to 64 x probe_every), one that changes it resets the interval: bad
drafts cost few probes. A drafter whose `observe` runs a
network (EAGLE-3, MTP, a draft model) does not observe during k = 0 iterations either: the
last `window` committed entries are kept and observed in one forward before the next draft
(entries older than that are never seen by it: drafts after a long plain stretch see less
context; lossless anyway), and so is the prompt of a row refilled during k = 0 (its
drafter row starts empty).

The loop runs in phases, one compiled program each, switched by the host: a draft phase
(one inner `while_loop` per drafted k, running while that k is the choice) ends where k = 0
is chosen; a plain phase then runs k = 0 in a loop of its own until the next probe (the
choice cannot change before it: k = 0 adds no counts), keeping no per-iteration books and
recording entries for the drafter only in its last `window` iterations. Nested inside the
draft phase's loop, the same k = 0 iterations cost 3% more than plain decoding on CPU; in
their own phase they cost what plain decoding costs. A probe then costs two program
switches besides its draft.

Lossless by construction: with replay the tokens do not depend on the drafts at all; with
rejection sampling the draft length is chosen from past iterations only, and each
iteration's output is exact for any draft length.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AdaptiveK", "expected_tokens", "choose_k", "measure_costs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveK:
    """The per-iteration draft-length policy `generate(adaptive=...)` follows.

    `costs[i]` is the time of one loop iteration at draft length `ks[i]` (any unit; only
    ratios matter), from `measure_costs` on the call's shapes.
    """

    costs: jax.Array  # [len(ks)] float32 seconds per loop iteration at each k
    # [] float32 alpha_1 before any verification (e.g. the previous call's; traced: no recompile)
    prior: jax.Array = 0.5
    ks: tuple = dataclasses.field(default=(0, 1, 2, 3), metadata=dict(static=True))
    probe_every: int = dataclasses.field(default=16, metadata=dict(static=True))
    decay: float = dataclasses.field(default=0.9, metadata=dict(static=True))  # per drafted iteration
    prior_weight: float = dataclasses.field(default=2.0, metadata=dict(static=True))  # pseudo-rows
    window: int = dataclasses.field(default=16, metadata=dict(static=True))  # deferred observations

    def __post_init__(self):
        ks = self.ks
        if (not isinstance(ks, tuple) or not ks
                or any(not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0 for k in ks)
                or list(ks) != sorted(set(ks)) or max(ks) < 1):
            raise ValueError(f"AdaptiveK.ks must be a tuple of distinct increasing ints >= 0 with "
                             f"at least one k >= 1 (0 = plain decoding); got {ks!r}")
        object.__setattr__(self, "ks", tuple(int(k) for k in ks))
        for name, low in (("probe_every", 1), ("window", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"AdaptiveK.{name} must be an int >= {low}; got {value!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"AdaptiveK.decay must be in (0, 1]; got {self.decay!r}")
        if not isinstance(self.prior, jax.core.Tracer):
            prior = np.asarray(self.prior, np.float64)
            if prior.shape != () or not 0.0 <= float(prior) <= 1.0:
                raise ValueError(f"AdaptiveK.prior must be a number in [0, 1]; got {self.prior!r}")
            object.__setattr__(self, "prior", np.asarray(prior, np.float32))
        if not self.prior_weight > 0.0:
            raise ValueError(f"AdaptiveK.prior_weight must be > 0; got {self.prior_weight!r}")
        if isinstance(self.costs, (jax.Array, np.ndarray, list, tuple)):
            shape = np.shape(self.costs)
            if shape != (len(ks),):
                raise ValueError(f"AdaptiveK.costs must hold one cost per k in ks={ks} "
                                 f"(shape ({len(ks)},)); got shape {shape}")
            if not isinstance(self.costs, jax.core.Tracer):
                c = np.asarray(self.costs, np.float64)
                if not np.all(np.isfinite(c) & (c > 0)):
                    raise ValueError(f"AdaptiveK.costs must be finite and > 0; got {c.tolist()}")
                # host arrays: a jit argument placed the same way wherever it was made
                object.__setattr__(self, "costs", np.asarray(c, np.float32))

    @property
    def max_k(self) -> int:
        return self.ks[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptState:
    """Decayed per-depth counts over the live rows of drafted iterations; the probe clock."""

    reached: jax.Array  # [max_k] f32 rows whose drafts before depth j were all accepted
    accepted: jax.Array  # [max_k] f32 ... and whose draft at depth j was accepted too
    next_probe: jax.Array  # [] int32 the iteration of the next probe
    interval: jax.Array  # [] int32 iterations between probes now

    @classmethod
    def zeros(cls, policy: AdaptiveK) -> AdaptState:
        """No counts; the first iteration probes."""
        zero = jnp.zeros((policy.max_k,), jnp.float32)
        return cls(zero, zero, jnp.zeros((), jnp.int32), jnp.asarray(policy.probe_every, jnp.int32))

    def update(self, policy: AdaptiveK, k: int, num_accepted, active, iteration) -> AdaptState:
        """After iteration `iteration` ran at static draft length k: num_accepted [B] drafts
        accepted per row (before any stop-token cut), active [B] rows that were live."""
        counted = self._count(policy, k, num_accepted, active)
        probed = iteration >= self.next_probe
        best = _best(self, policy)
        same = _best(counted, policy) == best
        # a probe of a drafter no k could make pay (`_probe_index`): back off faster, and further
        hopeless = _probe_index(self, policy, best) < len(policy.ks) - 1
        grown = jnp.where(hopeless, jnp.minimum(4 * self.interval, 64 * policy.probe_every),
                          jnp.minimum(2 * self.interval, 16 * policy.probe_every))
        interval = jnp.where(probed, jnp.where(same, grown, policy.probe_every),
                             self.interval).astype(jnp.int32)
        return dataclasses.replace(counted, interval=interval,
                                   next_probe=jnp.where(probed, iteration + interval, self.next_probe))

    def _count(self, policy: AdaptiveK, k: int, num_accepted, active) -> AdaptState:
        if k == 0:
            return self
        depth = jnp.arange(policy.max_k, dtype=jnp.int32)[None, :]  # depth j + 1
        live = active[:, None]
        reached = jnp.sum(live & (num_accepted[:, None] >= depth), axis=0).astype(jnp.float32)
        accepted = jnp.sum(live & (num_accepted[:, None] > depth), axis=0).astype(jnp.float32)
        tried = (depth[0] < k)  # only depths this k drafted decay and learn
        decay = jnp.where(tried, policy.decay, 1.0)
        return dataclasses.replace(
            self,
            reached=self.reached * decay + jnp.where(tried, reached, 0.0),
            accepted=self.accepted * decay + jnp.where(tried, accepted, 0.0),
        )


def conditional_acceptance(state: AdaptState, policy: AdaptiveK) -> jax.Array:
    """[max_k] alpha_j: accepted / reached at depth j, shrunk towards alpha_{j-1} (alpha_0 =
    the prior) with `prior_weight` pseudo-rows, so an untried depth inherits the one above."""
    alphas, prev = [], jnp.asarray(policy.prior, jnp.float32)  # alpha_0: the prior
    w = policy.prior_weight
    for j in range(policy.max_k):
        prev = (state.accepted[j] + w * prev) / (state.reached[j] + w)
        alphas.append(prev)
    return jnp.stack(alphas)


def expected_tokens(alpha, ks) -> jax.Array:
    """alpha [max_k] conditional acceptance -> [len(ks)] expected tokens per row per
    iteration at each k: 1 + sum_{i<=k} prod_{j<=i} alpha_j."""
    survive = jnp.cumprod(alpha)  # P(at least i drafts accepted), i = 1..max_k
    cum = jnp.concatenate([jnp.zeros((1,), survive.dtype), jnp.cumsum(survive)])
    return 1.0 + cum[jnp.asarray(ks)]


def _best(state: AdaptState, policy: AdaptiveK) -> jax.Array:
    """[] int32 index into `policy.ks` of the most expected tokens per cost."""
    rate = expected_tokens(conditional_acceptance(state, policy), policy.ks) / policy.costs
    return jnp.argmax(rate).astype(jnp.int32)


def _probe_index(state: AdaptState, policy: AdaptiveK, best) -> jax.Array:
    """[] int32 index into `policy.ks` a probe drafts at: the deepest k while any drafted k
    could beat the best even if every depth past the first were always accepted (E_k <=
    1 + k alpha_1); otherwise the shallowest drafted k, which still measures alpha_1 (so a
    hopeless drafter's probes cost one draft, not the deepest chain)."""
    alpha = conditional_acceptance(state, policy)
    ks = jnp.asarray(policy.ks, jnp.float32)
    rate = expected_tokens(alpha, policy.ks) / policy.costs
    optimistic = (1.0 + ks * alpha[0]) / policy.costs
    could_win = jnp.any((ks > 0) & (optimistic >= rate[best]))
    shallowest = next(i for i, k in enumerate(policy.ks) if k > 0)
    return jnp.where(could_win, len(policy.ks) - 1, shallowest).astype(jnp.int32)


def choose_k(state: AdaptState, policy: AdaptiveK, iteration) -> jax.Array:
    """[] int32 index into `policy.ks` for loop iteration `iteration` (0-based): the best
    expected tokens per cost; at a probe iteration, `_probe_index`."""
    best = _best(state, policy)
    probe = iteration >= state.next_probe
    return jnp.where(probe, _probe_index(state, policy, best), best).astype(jnp.int32)


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
    prefill-only call (0 iterations) is subtracted; c_k = median over rounds of that over
    the iterations run (floored at a tenth of the whole call's time per iteration, so noise
    cannot make a cost vanish). ks: default 0..drafter.k. Other AdaptiveK fields:
    `dataclasses.replace` the result.
    """
    from jaxspec.decoding import engine  # the engine imports this module
    from jaxspec.timing import interleaved

    if ks is None:
        top = getattr(drafter, "k", None)
        if not isinstance(top, int):
            raise ValueError(f"measure_costs: pass ks (the drafter {type(drafter).__name__} has "
                             f"no chain length k)")
        ks = tuple(range(top + 1))
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1; got {iterations!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1; got {rounds!r}")
    probe = AdaptiveK(jnp.ones((len(ks),), jnp.float32), ks=tuple(ks))

    def call(force, n):
        # one full-length cache: a growing one would charge the deeper k's (which outgrow
        # the first capacity sooner) for the growth, skewing the ratios
        return lambda: engine._generate(policy, prompts, drafter=drafter, adaptive=probe,
                                        force_k=force, max_iterations=n, grow_cache=False,
                                        **generate_kwargs)

    fns = {"prefill": call(-1, 0)}
    fns.update({f"k{k}": call(i, iterations) for i, k in enumerate(probe.ks)})
    runs = {name: fn() for name, fn in fns.items()}  # compiles (once: force and n are traced)
    iters = {name: int(out.stats.target_forwards) for name, out in runs.items()}
    times = interleaved(fns, rounds)
    costs = []
    for k in probe.ks:
        name = f"k{k}"
        if iters[name] < 1:
            raise ValueError(f"measure_costs: no iteration ran at k={k} (every row finished in "
                             f"the prefill?)")
        loop = float(np.median([t - t0 for t, t0 in zip(times[name], times["prefill"])]))
        costs.append(max(loop, 0.1 * float(np.median(times[name]))) / iters[name])
    if verbose:
        base = costs[probe.ks.index(0)] if 0 in probe.ks else costs[0]
        print("adaptive k costs per iteration: " + ", ".join(
            f"k={k} {c * 1e3:.2f} ms ({c / base:.2f}x)" for k, c in zip(probe.ks, costs)), flush=True)
    if not all(math.isfinite(c) and c > 0 for c in costs):
        raise RuntimeError(f"measure_costs: invalid costs {costs}")
    return dataclasses.replace(probe, costs=jnp.asarray(costs, jnp.float32))
