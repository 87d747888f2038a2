"""Adaptive draft length: `generate(adaptive=AdaptiveK(...))` picks k (0 = plain) per iteration.

References: plain decoding token for token (replay is lossless for any draft length
schedule), rejection sampling refused (one k for the batch would make a row's tokens
depend on the rows beside it), a brute-force enumeration of acceptance outcomes for the expected tokens per iteration, and
explicit loops for the acceptance counts.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import (
    AdaptiveK,
    SamplingConfig,
    TreeSpec,
    generate,
    measure_costs,
)
from jaxspec.decoding.adaptive import (
    AdaptState,
    choose_k,
    conditional_acceptance,
    expected_tokens,
)
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.drafters import Eagle3Drafter, NGramDrafter
from jaxspec.decoding.oracle import oracle_drafter
from jaxspec.decoding.protocols import Observation, StateAxes
from jaxspec.decoding.tree import Tree
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head

KEY = jax.random.key(7)
STOPS = (5, 9, 17)
SAMPLING = SamplingConfig(temperature=1.0)
MAX_NEW = 24


@pytest.fixture(scope="module")
def setup():
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, policy.config.vocab_size, size=n).tolist() for n in (3, 7, 1, 5, 2, 6, 4)]
    tokens, lengths = pad_prompts(prompts)
    common = dict(sampling=SAMPLING, max_new_tokens=MAX_NEW, key=KEY, stop_tokens=STOPS)
    plain = generate(policy, prompts, **common)
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    vocab = policy.config.vocab_size
    drafters = {
        "eagle3": Eagle3Drafter(head, k=3, coupled=False),  # argmax: random drafts, mostly rejected
        "ngram": NGramDrafter(k=3, min_n=1, max_n=2),
        "oracle": oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=vocab),
        "oracle_perfect": oracle_drafter(tokens, lengths, plain.tokens, [1.0, 1.0, 1.0], vocab_size=vocab),
        "oracle_wrong": oracle_drafter(tokens, lengths, plain.tokens, [0.0, 0.0, 0.0], vocab_size=vocab),
    }
    return dict(policy=policy, prompts=prompts, common=common, plain=plain, drafters=drafters)


def _assert_plain(out, plain):
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=1e-5)


# Costs that make the schedule switch: k = 0 is cheapest per iteration, drafting pays when
# acceptance is high enough (the oracle's 0.9 / 0.7 / 0.5 picks k = 1 or 2).
SWITCHING = AdaptiveK(jnp.array([1.0, 1.5, 1.9, 2.4]), probe_every=4)


@pytest.mark.parametrize("name,slots", [("eagle3", None), ("eagle3", 3), ("ngram", 3),
                                        ("oracle", None), ("oracle", 3)])
def test_adaptive_equals_plain_token_for_token(setup, name, slots):
    out = generate(setup["policy"], setup["prompts"], drafter=setup["drafters"][name],
                   adaptive=SWITCHING, slots=slots, **setup["common"])
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters.sum() == int(out.stats.target_forwards)
    if name in ("eagle3", "ngram"):  # random drafts: mostly plain, with probes
        assert k_iters[0] > 0 and k_iters[1:].sum() > 0


@pytest.mark.parametrize("force", [0, 1, 2, 3])
def test_every_forced_k_equals_plain(setup, force):
    """Each compiled branch alone (k = 0 defers EAGLE-3's observations for the whole call,
    more than the window holds)."""
    out = generate(setup["policy"], setup["prompts"], drafter=setup["drafters"]["eagle3"],
                   adaptive=dataclasses.replace(SWITCHING, force=force), **setup["common"])
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters[force] == int(out.stats.target_forwards) and k_iters.sum() == k_iters[force]


def test_schedule_follows_acceptance(setup):
    """Perfect drafts at near-equal costs: the deepest k from the first verification on.
    Wrong drafts: plain decoding, drafting only at the probes, the first at iteration 0,
    then at intervals growing from probe_every (no probe changes the best k). The first probe
    (alpha_1 = the prior 0.5) drafts the deepest k; it measures alpha_1 near 0, after which
    no k could win: every interval from then on quadruples (up to 64 x probe_every; no probe
    cost, so no budget), and the later probes draft k = 1."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    cheap = AdaptiveK(jnp.array([1.0, 1.05, 1.1, 1.15]), probe_every=4)
    out = generate(policy, prompts, drafter=setup["drafters"]["oracle_perfect"], adaptive=cheap, **common)
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters[3] >= k_iters.sum() - 1, k_iters
    out = generate(policy, prompts, drafter=setup["drafters"]["oracle_wrong"], adaptive=SWITCHING, **common)
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    n = k_iters.sum()
    assert k_iters[2] == 0
    probes, t, interval = 0, 0, 4
    while t < n:  # iterations 0, 16, 80, 336, ...
        probes += 1
        interval = min(4 * interval, 256)
        t += interval
    assert k_iters[3] == 1 and k_iters[1] == probes - 1, (k_iters, probes)


def _probe_schedule(policy, iterations):
    """[iterations] the index into ks chosen at each iteration for a drafter whose every draft
    is rejected (all rows live), the engine's choose/update sequence run by a scan."""
    rows = 8

    def step(state, it):
        index = choose_k(state, policy, it)
        branches = [lambda st, k=k: st if k == 0 else st.update(
            policy, k, jnp.zeros((rows,), jnp.int32), jnp.ones((rows,), bool), it) for k in policy.ks]
        return jax.lax.switch(index, branches, state), index

    _, chosen = jax.jit(lambda: jax.lax.scan(step, AdaptState.zeros(policy),
                                             jnp.arange(iterations, dtype=jnp.int32)))()
    return np.asarray(chosen)


@pytest.mark.parametrize("costs", [[1.0, 1.9, 2.7, 3.4], [1.0, 1.4, 2.0, 2.6]])
def test_hopeless_probes_stay_within_the_budget(costs):
    """A drafter whose drafts are all rejected, at costs like those measured for the random
    EAGLE-3 head on CPU (a draft costs 0.4-2.4 plain iterations, a probe ~7 more; with the
    second costs the prior alpha_1 = 0.5 makes k = 1 pay, so the first probe changes the
    best k): over 20000 iterations the probes after the first take at most probe_budget of
    the k = 0 time
    (probe_cost is what a probe adds to the k = 0 iteration it replaces, its draft included,
    as `measure_costs` measures it). Control:
    without a probe cost the intervals stop growing at 64 x probe_every and the probes take
    more than the budget."""
    costs = jnp.array(costs)
    n = 20000
    for budget in (0.005, 0.02):
        policy = AdaptiveK(costs, probe_cost=7.0, probe_budget=budget)
        chosen = _probe_schedule(policy, n)
        probes = np.flatnonzero(chosen > 0)
        assert probes[0] == 0 and len(probes) >= 2, probes  # it still looks, now and then
        spent = 7.0 * (len(probes) - 1)
        assert spent <= budget * n * 1.0, (budget, probes, spent)
        # the next probe waits no longer than the budget (or the growth rule) asks
        assert np.max(np.diff(probes)) <= max(64 * 16, np.ceil(7.0 / budget)), probes
    control = _probe_schedule(AdaptiveK(costs, probe_budget=0.005), n)
    probes = np.flatnonzero(control > 0)
    assert 7.0 * (len(probes) - 1) > 0.005 * n, probes


def test_first_probe_waits(setup):
    """Perfect drafts at costs where the prior alone does not make drafting pay (alpha 0.5:
    k = 0 is best, though k = 3 could win if deeper drafts were always accepted): with the
    first probe past the end of the call nothing is drafted; with it at iteration 3 the
    probe drafts k = 3, finds them perfect and drafting follows. Tokens equal plain."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    drafter = setup["drafters"]["oracle_perfect"]
    costly = AdaptiveK(jnp.array([1.0, 1.6, 2.0, 2.4]), probe_every=4)
    never = dataclasses.replace(costly, first_probe=10_000)
    out = generate(policy, prompts, drafter=drafter, adaptive=never, **common)
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters[1:].sum() == 0 and k_iters[0] == int(out.stats.target_forwards), k_iters
    later = dataclasses.replace(costly, first_probe=3)
    out = generate(policy, prompts, drafter=drafter, adaptive=later, **common)
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters[0] == 3 and k_iters[3] >= 1, k_iters


def test_after_carries_the_probe_clock(setup):
    """Two calls with a drafter whose drafts are all rejected, the probe budget set so a probe
    pays for itself in 40 iterations (probe_cost 0.08 = 40 x budget 0.002 x c_0 1.0). The
    first call probes at iteration 0 (the deepest k: the prior 0.5 could pay) and would next
    at 40, past its end; `after` carries the 40 - n still due and the measured acceptance
    (0) into the second call, which probes once, at 40 - n (k = 1: nothing could pay), and
    would next 40 later. Tokens equal plain in both."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    drafter = setup["drafters"]["oracle_wrong"]
    first = dataclasses.replace(SWITCHING, probe_cost=0.08, probe_budget=0.002)
    out = generate(policy, prompts, drafter=drafter, adaptive=first, **common)
    _assert_plain(out, setup["plain"])
    n = int(out.stats.target_forwards)
    assert 40 - n > 0 and np.asarray(out.stats.k_iterations).tolist() == [n - 1, 0, 0, 1]
    assert int(out.next_probe) == 40 - n
    second = first.after(out)
    assert float(second.prior) == 0.0 and int(second.first_probe) == 40 - n
    again = generate(policy, prompts, drafter=drafter, adaptive=second, **common)
    _assert_plain(again, setup["plain"])
    assert np.asarray(again.stats.k_iterations).tolist() == [n - 1, 1, 0, 0]
    assert int(again.next_probe) == (40 - n) + 40 - n
    # without a probe in the call the clock runs on and the prior stays
    quiet = generate(policy, prompts, drafter=drafter, adaptive=dataclasses.replace(first, first_probe=1000),
                     **common)
    assert int(quiet.next_probe) == 1000 - n
    assert float(dataclasses.replace(first, first_probe=1000).after(quiet).prior) == 0.5


def _expected_tokens_brute_force(alpha, k):
    """Sum over the accept/reject outcomes of the k drafts: the run of accepted drafts ends
    at the first rejection (later coins are not looked at: one canonical outcome each)."""
    total = 0.0
    for outcome in itertools.product([True, False], repeat=k):
        stop = outcome.index(False) if False in outcome else k
        if any(outcome[stop + 1 :]):
            continue
        prob = np.prod(alpha[:stop]) * (1 - alpha[stop] if stop < k else 1.0)
        total += prob * (1 + stop)
    return total


def _alpha_reference(reached, accepted, prior, weight):
    alpha, prev = [], prior
    for r, a in zip(reached, accepted):
        prev = (a + weight * prev) / (r + weight)
        alpha.append(prev)
    return np.array(alpha)


def test_choice_against_brute_force():
    rng = np.random.default_rng(0)
    ks = (0, 1, 2, 3, 5)
    for trial in range(40):
        reached = rng.uniform(0, 40, size=5)
        accepted = reached * rng.uniform(0, 1, size=5)
        costs = np.sort(rng.uniform(1.0, 4.0, size=len(ks)))
        costs[0] = 1.0
        prior = float(rng.uniform())
        iteration = int(rng.integers(0, 9))
        next_probe = int(rng.integers(0, 9))
        policy = AdaptiveK(jnp.asarray(costs), prior=prior, ks=ks, probe_every=4)
        state = AdaptState(jnp.asarray(reached, jnp.float32), jnp.asarray(accepted, jnp.float32),
                           jnp.asarray(next_probe, jnp.int32), jnp.asarray(4, jnp.int32))
        alpha = _alpha_reference(reached, accepted, prior, policy.prior_weight)
        np.testing.assert_allclose(np.asarray(conditional_acceptance(state, policy)), alpha, rtol=1e-5)
        expected = np.array([_expected_tokens_brute_force(alpha, k) for k in ks])
        np.testing.assert_allclose(np.asarray(expected_tokens(jnp.asarray(alpha), ks)), expected, rtol=1e-5)
        rate = expected / costs
        best = int(np.argmax(rate))
        if iteration >= next_probe:  # the probe: the deepest k, unless no k > 0 could win
            hopeful = any((1 + k * alpha[0]) / c >= rate[best] for k, c in zip(ks, costs) if k > 0)
            best = len(ks) - 1 if hopeful else 1  # ks[1] = 1: the shallowest drafted k
        if np.sort(rate)[-1] - np.sort(rate)[-2] > 1e-4:  # no near-tie
            assert int(choose_k(state, policy, iteration)) == best, (trial, rate, iteration)


def test_acceptance_counts_against_loops():
    policy = AdaptiveK(jnp.ones(4), decay=0.5)
    state = AdaptState.zeros(policy)
    num_accepted = np.array([0, 2, 1, 2, 0, 1])
    active = np.array([True, True, True, False, True, True])
    new = state.update(policy, 2, jnp.asarray(num_accepted), jnp.asarray(active), 0)
    reached = np.zeros(3)
    accepted = np.zeros(3)
    for n, a in zip(num_accepted, active):
        for depth in range(2):  # k = 2: depths 1 and 2 were drafted
            if a and n >= depth:
                reached[depth] += 1
                accepted[depth] += n > depth
    np.testing.assert_allclose(np.asarray(new.reached), reached)
    np.testing.assert_allclose(np.asarray(new.accepted), accepted)
    again = new.update(policy, 1, jnp.asarray(num_accepted), jnp.asarray(active), 1)
    np.testing.assert_allclose(np.asarray(again.reached), [0.5 * reached[0] + reached[0], reached[1], 0])
    same = new.update(policy, 0, jnp.asarray(num_accepted), jnp.asarray(active), 2)  # k = 0: no data
    np.testing.assert_array_equal(np.asarray(same.reached), np.asarray(new.reached))
    # The probe clock: iteration 0 probed; at equal costs the deepest k is best before and
    # after (every alpha > 0), so the interval doubled from probe_every (16) to 32.
    assert int(new.interval) == 32 and int(new.next_probe) == 32


def test_deferred_observation_equals_step_by_step(setup):
    """What k = 0 relies on: EAGLE-3 observing entries in one call leaves the same head
    state as observing them one at a time."""
    policy, drafter = setup["policy"], setup["drafters"]["eagle3"]
    batch, n, max_len = 2, 4, 16
    seq = jnp.asarray(np.random.default_rng(1).integers(3, 60, size=(batch, n + 1)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    _, captured, _ = policy.forward(seq[:, :n], positions, policy.init_cache(batch, max_len),
                                    capture=drafter.capture_layers)
    obs = Observation(seq[:, :n], seq[:, 1:], positions, captured)
    together = drafter.observe(drafter.init_state(policy, batch, max_len), policy, obs)
    apart = drafter.init_state(policy, batch, max_len)
    for i in range(n):
        apart = drafter.observe(apart, policy, jax.tree.map(lambda x: x[:, i : i + 1], obs))
    np.testing.assert_allclose(np.asarray(together.last_hidden), np.asarray(apart.last_hidden), atol=1e-5)
    np.testing.assert_allclose(np.asarray(together.cache.k), np.asarray(apart.cache.k), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(together.cache.lengths), np.asarray(apart.cache.lengths))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Recorder:
    """A network-like drafter (one forward per observe, so adaptive k = 0 defers its
    observations) that drafts junk and checks, at every draft, that its row has observed
    exactly the committed entries 0..lengths - 2, each once, in position order, each with
    the token fed there and the one that followed it (read against the engine's buffer)."""

    k: int = dataclasses.field(default=3, metadata=dict(static=True))
    capture_layers = ()
    forwards_per_propose = 0
    forwards_per_observe = 1
    supports_rejection = False
    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)

    def with_k(self, k):
        return dataclasses.replace(self, k=k)

    def check_compatible(self, policy):
        return None

    def state_axes(self, policy):
        per_position, per_row, shared = StateAxes(row=0, length=1), StateAxes(row=0), StateAxes()
        return dict(seen=per_position, last=per_row, fed=per_position, next=per_position,
                    ok=shared, drafts=shared)

    def init_state(self, policy, batch, max_len):
        return dict(seen=jnp.zeros((batch, max_len), bool), last=jnp.full((batch,), -1, jnp.int32),
                    fed=jnp.zeros((batch, max_len), jnp.int32), next=jnp.zeros((batch, max_len), jnp.int32),
                    ok=jnp.asarray(True), drafts=jnp.zeros((), jnp.int32))

    def observe(self, state, policy, obs):
        p = obs.positions  # [B, M] entries in order; padding (< 0) skipped
        valid = p >= 0
        # each valid entry lies past every entry observed before it (this call's and earlier)
        running = jax.lax.cummax(jnp.where(valid, p, -1), axis=1)
        before = jnp.maximum(state["last"][:, None], jnp.pad(running[:, :-1], ((0, 0), (1, 0)),
                                                                 constant_values=-1))
        ok = state["ok"] & jnp.all(~valid | (p > before))
        last = jnp.maximum(state["last"], running[:, -1])
        rows = jnp.arange(p.shape[0])[:, None]
        at = jnp.where(valid, p, state["seen"].shape[1])
        seen = state["seen"].at[rows, at].set(True, mode="drop")
        fed = state["fed"].at[rows, at].set(obs.fed_tokens, mode="drop")
        nxt = state["next"].at[rows, at].set(obs.next_tokens, mode="drop")
        return dict(state, seen=seen, last=last, fed=fed, next=nxt, ok=ok)

    def propose(self, state, policy, ctx):
        want = jnp.arange(state["seen"].shape[1])[None, :] < (ctx.lengths - 1)[:, None]
        ok = state["ok"] & jnp.all(state["seen"] == want)
        ok &= jnp.all(~want | (state["fed"] == ctx.buffer))  # entry p fed buffer[p] ...
        ok &= jnp.all(~want | (state["next"] == jnp.roll(ctx.buffer, -1, axis=1)))  # ... then p + 1
        tokens = jnp.zeros((ctx.lengths.shape[0], self.k), jnp.int32)
        return Tree.chain(tokens), None, dict(state, ok=ok, drafts=state["drafts"] + 1)

    def draft_stats(self, state):
        return dict(ok=state["ok"], drafts=state["drafts"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _HookedRecorder(_Recorder):
    """The recorder with its own `refill_state` and a state leaf no row axis describes
    ([batch, batch]: the engine's default refill could not slice it)."""

    def init_state(self, policy, batch, max_len):
        return dict(super().init_state(policy, batch, max_len), pairs=jnp.zeros((batch, batch)))

    def state_axes(self, policy):  # (for cache growth; the refill goes through the hook)
        return dict(super().state_axes(policy), pairs=StateAxes())

    def refill_state(self, state, policy, row, obs, max_len):
        fresh = super().init_state(policy, 1, max_len)
        state = dict(state, **{k: jax.lax.dynamic_update_slice_in_dim(state[k], fresh[k], row, 0)
                               for k in ("seen", "last", "fed", "next")})
        b = state["last"].shape[0]  # the one-row prefill on every row, padding but on `row`
        wide = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:]), obs)
        mine = (jnp.arange(b) == row)[:, None]
        return self.observe(state, policy, dataclasses.replace(
            wide, positions=jnp.where(mine, wide.positions, -1)))


def test_a_refill_hook_replaces_the_row_axes(setup):
    """A drafter with `refill_state` refills through it, under adaptive k = 0 too (its row
    starts empty and its prompt is observed at the next flush), and needs no row axis for
    its state (a [batch, batch] leaf): every committed entry still reaches it once, in order."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    adaptive = dataclasses.replace(SWITCHING, window=MAX_NEW + 8)
    out = generate(policy, prompts, drafter=_HookedRecorder(), adaptive=adaptive, slots=3, **common)
    _assert_plain(out, setup["plain"])
    k_iters = np.asarray(out.stats.k_iterations)
    assert k_iters[0] > 0 and k_iters[1:].sum() > 1, k_iters
    assert bool(out.draft_stats["ok"])


@pytest.mark.parametrize("slots", [None, 3])
def test_deferred_observations_reach_the_drafter_whole_and_in_order(setup, slots):
    """Adaptive k = 0 defers a network drafter's observations (the window, and the prompts of
    rows refilled meanwhile) to the next draft: with a window longer than any rollout the
    drafter has seen every committed entry once, in order, whenever it drafts. A window too
    short for the plain stretches between probes loses entries: the check fails (control)."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    control = [(2, False)] if slots else []  # the control once (with refill: the harder case)
    for window, holds in [(MAX_NEW + 8, True)] + control:
        adaptive = dataclasses.replace(SWITCHING, window=window)
        out = generate(policy, prompts, drafter=_Recorder(), adaptive=adaptive, slots=slots, **common)
        _assert_plain(out, setup["plain"])
        k_iters = np.asarray(out.stats.k_iterations)
        assert k_iters[0] > 0 and k_iters[1:].sum() > 1, k_iters  # plain stretches between probes
        assert int(out.draft_stats["drafts"]) == k_iters[1:].sum()
        assert bool(out.draft_stats["ok"]) == holds, (window, slots)


def test_rejection_with_adaptive_k_is_refused_before_compiling(setup):
    """One k serves the batch and follows its acceptance; under rejection sampling the tokens
    follow the drafts, so a row's tokens would depend on the rows sharing its call. generate
    refuses it (ValueError from the argument checks, before any trace). The control, replay
    with the same arguments: test_adaptive_equals_plain_token_for_token."""
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    with pytest.raises(ValueError, match=r"adaptive draft length with method='rejection'.*"
                                         r"rows that share its call.*method='replay'"):
        generate(policy, prompts, drafter=setup["drafters"]["eagle3"], adaptive=SWITCHING,
                 **dict(common, method="rejection"))


def test_measure_costs_returns_positive_costs(setup):
    adaptive = measure_costs(setup["policy"], setup["drafters"]["ngram"], setup["prompts"],
                             iterations=8, rounds=2, **setup["common"])
    assert adaptive.ks == (0, 1, 2, 3)
    costs = np.asarray(adaptive.costs)
    assert costs.shape == (4,) and np.all(np.isfinite(costs) & (costs > 0))
    # a probe costs at least its draft iteration's extra over k = 0
    assert np.isfinite(adaptive.probe_cost) and adaptive.probe_cost >= costs[1] - costs[0] - 1e-9
    assert int(adaptive.first_probe) == 0


def test_bad_adaptive_fails_before_compiling(setup):
    policy, prompts, common = setup["policy"], setup["prompts"], setup["common"]
    eagle = setup["drafters"]["eagle3"]
    with pytest.raises(ValueError, match="AdaptiveK.ks must be"):
        AdaptiveK(jnp.ones(2), ks=(1, 0))
    with pytest.raises(ValueError, match="AdaptiveK.ks must be"):
        AdaptiveK(jnp.ones(1), ks=(0,))
    with pytest.raises(ValueError, match="one cost per k"):
        AdaptiveK(jnp.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        AdaptiveK(jnp.array([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="prior must be a number in"):
        AdaptiveK(jnp.ones(4), prior=1.5)
    with pytest.raises(ValueError, match="probe_every must be an int"):
        AdaptiveK(jnp.ones(4), probe_every=0)
    with pytest.raises(ValueError, match=r"probe_budget must be a number in \(0, 1\]; got 0"):
        AdaptiveK(jnp.ones(4), probe_budget=0)
    with pytest.raises(ValueError, match="probe_cost must be a finite number >= 0; got -1"):
        AdaptiveK(jnp.ones(4), probe_cost=-1.0)
    with pytest.raises(ValueError, match="first_probe must be an int >= 0; got 2.5"):
        AdaptiveK(jnp.ones(4), first_probe=2.5)
    with pytest.raises(TypeError, match="adaptive must be a jaxspec.decoding.AdaptiveK"):
        generate(policy, prompts, drafter=eagle, adaptive=[0, 1], **common)
    with pytest.raises(ValueError, match="needs a chain drafter"):
        generate(policy, prompts, adaptive=SWITCHING, **common)
    # a tree drafts k deep with its budget capped at what depth k expands (top_k at depth 1)
    tree = dataclasses.replace(eagle, tree=TreeSpec(top_k=2, depth=2, budget=3))
    assert tree.with_k(1).tree == TreeSpec(top_k=2, depth=1, budget=2)
    with pytest.raises(ValueError, match="AdaptiveK.force must be -1"):
        AdaptiveK(jnp.ones(4), force=4)
    with pytest.raises(ValueError, match="max_iterations must be an int >= 0"):
        generate(policy, prompts, max_iterations=-1, **common)
    with pytest.raises(ValueError, match="depths 1..3; k=5"):
        generate(policy, prompts, drafter=setup["drafters"]["oracle"],
                 adaptive=AdaptiveK(jnp.ones(3), ks=(0, 1, 5)), **common)
