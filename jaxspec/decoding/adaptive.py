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
depth's estimate keeps being refreshed and a stale low one cannot lock a short k in. Only
when no drafted k could win even with every depth past the first
always accepted (E_k <= 1 + k alpha_1) does a probe draft the shallowest k: it still
measures alpha_1, at the cost of one draft. A probe that leaves the best k unchanged
doubles the interval to the next one (up to 16 x probe_every), one that changes it resets
the interval. A probe after which no k could make the drafter pay (whatever it changed)
quadruples it (up to 64 x probe_every) and, once the depth-1 counts outweigh the prior 2
to 1, waits at least probe_cost / (probe_budget x c_0) iterations: `measure_costs`
measures what a probe adds to the k = 0 iteration it replaces (its draft, the deferred
observation, two program switches), so after the call's first probe a drafter found hopeless costs at most
`probe_budget` of the plain time. `AdaptiveK.after(out)` carries the probe clock (and the
acceptance, as the prior) into the next call, so a run of calls spends no more than that
either; otherwise each call starts probing at its first iteration. A drafter whose
`observe` runs a
network (EAGLE-3, MTP, a draft model) does not observe during k = 0 iterations either: the
last `window` committed entries are kept and observed in one forward before the next draft
(entries older than that are never seen by it: drafts after a long plain stretch see less
context; lossless anyway), and so is the prompt of a row refilled during k = 0 (its
drafter row starts empty).

A drafter that estimates every depth's acceptance from its own last draft
(`protocols.EstimatesAcceptance`: the block drafter's confidence head) replaces the counts
with that estimate once it has drafted once: alpha_j is then the estimate alone, not a blend
(the counts, decayed over ~1 / (1 - decay) iterations, would hold back an estimate that is
fresh at every drafted iteration and covers depths never verified). The counts are still kept:
they choose k until the first draft and decide the probe intervals' back-off as before.
Probes stay, because k = 0 iterations draft nothing and so refresh no estimate, but since
any draft refreshes every depth, a probe drafts at the best k when that drafts, else at the
shallowest drafted k (never the deepest just to measure it). The estimate is the previous
draft's, so the k it picks depends on past iterations only.

The loop runs in phases, one compiled program each, switched by the host: a draft phase
(one inner `while_loop` per drafted k, running while that k is the choice) ends where k = 0
is chosen; a plain phase then runs k = 0 in a loop of its own until the next probe (the
choice cannot change before it: k = 0 adds no counts), keeping no per-iteration books and
recording entries for the drafter only in its last `window` iterations (`phases`). A probe
then costs two program switches besides its draft.

Lossless by construction: with replay the tokens do not depend on the drafts at all.
`generate` refuses rejection sampling with it (`arguments.check_adaptive`): choosing k from
past iterations keeps each iteration exact, but one k for the batch comes from every row's
acceptance, and a row's tokens, which follow its drafts, would depend on its neighbours.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["AdaptiveK", "AdaptState", "choose_k", "expected_tokens"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveK:
    """The per-iteration draft-length policy `generate(adaptive=...)` follows.

    `costs[i]` is the time of one loop iteration at draft length `ks[i]` (any unit; only
    ratios matter, but `probe_cost` is in the same unit), from `measure_costs` on the
    call's shapes.
    """

    costs: jax.Array  # [len(ks)] float32 seconds per loop iteration at each k
    # [] float32 alpha_1 before any verification (e.g. the previous call's; traced: no recompile)
    prior: jax.Array = 0.5
    # [] float32 what one probe of a drafter found hopeless costs beyond the k = 0 iteration it
    # replaces (its draft, the deferred observation, the program switches; same unit as
    # costs; `measure_costs` measures it; 0: no budget, the intervals only grow)
    probe_cost: jax.Array = 0.0
    # [] float32 the share of the k = 0 time such probes may take: after a probe finds no k
    # could pay, the next waits at least probe_cost / (probe_budget x c_0) iterations
    probe_budget: jax.Array = 0.002
    # [] int32 the iteration of the call's first probe (0: the first iteration; a caller that
    # makes many calls can carry the probe clock across them)
    first_probe: jax.Array = 0
    # [] int32 an index into ks drafted at every iteration (-1: choose; `measure_costs` times
    # each k this way; traced: no recompile)
    force: jax.Array = -1
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
        # host scalars of fixed dtypes: a python number and an array compile the same
        for name, dtype, valid, what in (
                ("prior", np.float32, lambda x: 0.0 <= x <= 1.0, "a number in [0, 1]"),
                ("probe_cost", np.float32, lambda x: 0.0 <= x < math.inf, "a finite number >= 0"),
                ("probe_budget", np.float32, lambda x: 0.0 < x <= 1.0, "a number in (0, 1]"),
                ("first_probe", np.int32, lambda x: 0 <= x < 2 ** 31 and x == int(x),
                 "an int >= 0"),
                ("force", np.int32, lambda x: -1 <= x < len(ks) and x == int(x),
                 f"-1 (choose) or an index into ks (< {len(ks)})")):
            value = getattr(self, name)
            if isinstance(value, jax.core.Tracer) or not isinstance(
                    value, (numbers.Number, np.ndarray, np.generic, jax.Array, str, bytes, list, tuple)):
                continue  # traced, or a pytree transform's placeholder leaf
            x = np.asarray(value)
            if (x.shape != () or x.dtype == bool or not np.issubdtype(x.dtype, np.number)
                    or not valid(float(x))):
                raise ValueError(f"AdaptiveK.{name} must be {what}; got {value!r}")
            object.__setattr__(self, name, np.asarray(x, dtype))
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

    def after(self, out) -> AdaptiveK:
        """This policy for the next call of a run of calls, from this call's `Rollouts`: the
        depth-1 acceptance it measured as the prior (kept when it drafted nothing) and its
        probe clock carried (the next call's first probe where this call's next one was
        due), so a run of calls spends on a drafter found hopeless what the budget allows,
        not a probe per call. The counts and the interval start afresh in each call."""
        stats = out.stats
        prior = self.prior
        if int(np.asarray(stats.proposed_at)[0]) > 0:
            prior = float(stats.per_position_acceptance[0])
        first = self.first_probe if out.next_probe is None else int(np.asarray(out.next_probe))
        return dataclasses.replace(self, prior=prior, first_probe=first)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptState:
    """Decayed per-depth counts over the live rows of drafted iterations; the drafter's own
    estimate from its last draft (`protocols.EstimatesAcceptance`), if any; the probe clock."""

    reached: jax.Array  # [max_k] f32 rows whose drafts before depth j were all accepted
    accepted: jax.Array  # [max_k] f32 ... and whose draft at depth j was accepted too
    next_probe: jax.Array  # [] int32 the iteration of the next probe
    interval: jax.Array  # [] int32 iterations between probes now
    # [max_k] f32 the drafter's alpha_j from its last draft (None: not kept, as estimated False)
    estimate: jax.Array | None = None
    estimated: jax.Array | None = None  # [] bool: `estimate` holds one (it replaces the counts)

    @classmethod
    def zeros(cls, policy: AdaptiveK) -> AdaptState:
        """No counts, no estimate; the first probe at `policy.first_probe`."""
        zero = jnp.zeros((policy.max_k,), jnp.float32)
        return cls(zero, zero, jnp.asarray(policy.first_probe, jnp.int32),
                   jnp.asarray(policy.probe_every, jnp.int32), zero, jnp.asarray(False))

    def update(self, policy: AdaptiveK, k: int, num_accepted, active, iteration,
               estimate=None) -> AdaptState:
        """After iteration `iteration` ran at static draft length k: num_accepted [B] drafts
        accepted per row (before any stop-token cut), active [B] rows that were live;
        estimate: the drafter's `acceptance_estimate` after this iteration's draft (None: it
        has none)."""
        counted = self._count(policy, k, num_accepted, active)
        if estimate is not None and self.estimate is not None:
            alpha, valid = estimate
            if alpha.shape[-1] < policy.max_k:
                raise ValueError(f"a drafter's acceptance estimate covers {alpha.shape[-1]} depths; "
                                 f"adaptive k drafts up to {policy.max_k}")
            counted = dataclasses.replace(
                counted, estimate=jnp.where(valid, alpha[:policy.max_k].astype(jnp.float32),
                                            self.estimate),
                estimated=self.estimated | valid)
        probed = iteration >= self.next_probe
        best = _best(counted, policy)
        same = best == _best(self, policy)
        # a probe that left a drafter no k could make pay (`_could_win`, on the counts with
        # this probe's): back off faster, and further; and, once the depth-1 counts outweigh
        # the prior 2 to 1 (not a verdict on one or two tail rows), at least as far as the
        # budget says
        hopeless = ~_could_win(counted, policy, best)
        sure = counted.reached[0] >= 2.0 * policy.prior_weight
        pe = policy.probe_every  # saturating before multiplying: no int32 wrap-around
        grown = jnp.where(hopeless,
                          jnp.maximum(4 * jnp.minimum(self.interval, 16 * pe),
                                      jnp.where(sure, budget_interval(policy), 0)),
                          2 * jnp.minimum(self.interval, 8 * pe))
        # a probe that changed the best k probes again soon, unless nothing could pay now
        interval = jnp.where(probed, jnp.where(same | hopeless, grown, pe),
                             self.interval).astype(jnp.int32)
        due = jnp.minimum(iteration, jnp.iinfo(jnp.int32).max - interval) + interval
        return dataclasses.replace(counted, interval=interval,
                                   next_probe=jnp.where(probed, due, self.next_probe))

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


def budget_interval(policy: AdaptiveK) -> jax.Array:
    """[] int32 iterations that pay for one probe within the budget: probe_cost /
    (probe_budget x c_0), c_0 the cost of the cheapest k (plain decoding when 0 is in ks)."""
    base = policy.costs[0]
    iterations = jnp.ceil(jnp.asarray(policy.probe_cost, jnp.float32)
                          / (jnp.asarray(policy.probe_budget, jnp.float32) * base))
    return jnp.clip(iterations, 0, 2 ** 28).astype(jnp.int32)


def conditional_acceptance(state: AdaptState, policy: AdaptiveK) -> jax.Array:
    """[max_k] alpha_j: the drafter's estimate once it has made one; otherwise accepted /
    reached at depth j, shrunk towards alpha_{j-1} (alpha_0 = the prior) with `prior_weight`
    pseudo-rows, so an untried depth inherits the one above."""
    alphas, prev = [], jnp.asarray(policy.prior, jnp.float32)  # alpha_0: the prior
    w = policy.prior_weight
    for j in range(policy.max_k):
        prev = (state.accepted[j] + w * prev) / (state.reached[j] + w)
        alphas.append(prev)
    counted = jnp.stack(alphas)
    if state.estimate is None:
        return counted
    return jnp.where(state.estimated, state.estimate, counted)


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


def _could_win(state: AdaptState, policy: AdaptiveK, best) -> jax.Array:
    """[] bool: some drafted k could beat the best even if every depth past the first were
    always accepted (E_k <= 1 + k alpha_1)."""
    alpha = conditional_acceptance(state, policy)
    ks = jnp.asarray(policy.ks, jnp.float32)
    rate = expected_tokens(alpha, policy.ks) / policy.costs
    optimistic = (1.0 + ks * alpha[0]) / policy.costs
    return jnp.any((ks > 0) & (optimistic >= rate[best]))


def _probe_index(state: AdaptState, policy: AdaptiveK, best) -> jax.Array:
    """[] int32 index into `policy.ks` a probe drafts at. With counts only: the deepest k
    while `_could_win`, otherwise the shallowest drafted k, which still measures alpha_1 (so
    a hopeless drafter's probes cost one draft, not the deepest chain). With the drafter's
    estimate, any draft refreshes every depth's: the best k if it drafts, else the
    shallowest drafted k."""
    shallowest = next(i for i, k in enumerate(policy.ks) if k > 0)
    counted = jnp.where(_could_win(state, policy, best), len(policy.ks) - 1, shallowest)
    if state.estimated is None:
        return counted.astype(jnp.int32)
    drafts = jnp.asarray(policy.ks)[best] > 0
    estimated = jnp.where(drafts, best, shallowest)
    return jnp.where(state.estimated, estimated, counted).astype(jnp.int32)


def choose_k(state: AdaptState, policy: AdaptiveK, iteration) -> jax.Array:
    """[] int32 index into `policy.ks` for loop iteration `iteration` (0-based): the best
    expected tokens per cost; at a probe iteration, `_probe_index`."""
    best = _best(state, policy)
    probe = iteration >= state.next_probe
    return jnp.where(probe, _probe_index(state, policy, best), best).astype(jnp.int32)
