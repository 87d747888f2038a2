"""Draft length from the block model's confidence head: each draft estimates every depth's
acceptance (checked against a NumPy reference of the greedy chain, the head and the batch's
survival ratios, and shown not to depend on the drafts' randomness), adaptive k picks the
closed-form argmax of E_k / c_k on that estimate, and rollouts with the length it chooses are
the plain ones token for token under replay; rejection sampling with it is refused (the
estimate averages the batch, so a row's tokens would depend on its neighbours)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import AdaptiveK, BlockDrafter, DraftContext, SamplingConfig, generate
from jaxspec.decoding.adaptive import AdaptState, choose_k
from jaxspec.decoding.protocols import EstimatesAcceptance
from jaxspec.models import ModelConfig
from jaxspec.models.block import BlockHead
from jaxspec.models.transformer import random_policy
from jaxspec.testing.drafters import with_params

SAMPLING = SamplingConfig(0.7)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 3], [4, 4, 4]]
KEY = jax.random.key(3)
COSTS = jnp.array([1.0, 1.2, 1.3, 1.4])  # k = 0..3


def _head(policy, *, block_size: int, bias: float, scale: float = 0.0, seed: int = 2):
    """A block model with a Markov head of rank 4 (random) and a confidence head of weights
    `scale` x N(0, 1 / fan-in) and bias `bias`."""
    rng = np.random.default_rng(seed)
    head = BlockHead.init_for(policy, jax.random.key(seed), block_size=block_size, num_layers=1,
                              markov_rank=4, confidence=True)
    return with_params(head, {"markov_w1": lambda x: rng.standard_normal(x.shape),
                        "markov_w2": lambda x: rng.standard_normal(x.shape),
                        "confidence_w": lambda x: scale * rng.standard_normal(x.shape) / np.sqrt(x.shape[0]),
                        "confidence_b": lambda x: np.full(x.shape, bias)})


@pytest.fixture(scope="module")
def policy():
    return random_policy(ModelConfig.tiny("qwen3", vocab_size=24, num_layers=2), seed=1)


def _params(head) -> dict:
    return {jax.tree_util.keystr(p).split("'")[1]: np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_flatten_with_path(head.params)[0]}


def test_estimate_against_numpy(policy):
    """k = 2 of a block of 5: the Markov inputs past k come from the greedy chain; the third
    row is not live and does not count. Sampled drafts (rejection, two draft keys) leave the
    estimate as it is: it depends on the committed prefix only."""
    head = _head(policy, block_size=5, bias=0.0, scale=2.0)
    drafter = BlockDrafter(head, k=2, coupled=False)
    assert isinstance(drafter, EstimatesAcceptance)
    buffer = np.zeros((3, 32), np.int32)
    for row, prompt in enumerate(PROMPTS[:3]):
        buffer[row, :len(prompt)] = prompt
    lengths = np.array([4, 3, 2], np.int32)
    live = np.array([True, True, False])
    state = drafter.init_state(policy, 3, 32)
    assert drafter.acceptance_estimate(state)[1].item() is False
    ctx = DraftContext(jnp.asarray(buffer), jnp.asarray(lengths), jax.random.key(0), SAMPLING, False,
                       live=jnp.asarray(live))
    _, _, after = drafter.propose(state, policy, ctx)
    alpha, valid = drafter.acceptance_estimate(after)

    hidden = np.asarray(drafter.block_hidden(state, policy, ctx), np.float64)  # [3, 4, H]
    base = np.asarray(head.logits(drafter.block_hidden(state, policy, ctx), policy), np.float64)
    w = _params(head)
    previous = buffer[np.arange(3), lengths - 1]
    inputs = [previous]
    for i in range(3):
        previous = np.argmax(base[:, i] + w["markov_w1"][previous] @ w["markov_w2"], axis=-1)
        inputs.append(previous)

    def reference(inputs):  # [3, 4] Markov inputs -> [4] alpha_j
        x = np.concatenate([hidden, w["markov_w1"][inputs]], axis=-1)
        accept = 1.0 / (1.0 + np.exp(-(x @ w["confidence_w"][:, 0] + w["confidence_b"][0])))
        survive = np.cumprod(accept[live], axis=1).mean(0)
        return survive / np.concatenate([[1.0], survive[:-1]])

    expected = reference(np.stack(inputs, 1))
    assert bool(valid)
    np.testing.assert_allclose(np.asarray(alpha), expected, rtol=1e-4)
    assert np.ptp(expected) > 0.05, expected  # the depths differ: the test sees which is which
    # the Markov inputs matter: the root at every position gives another estimate
    assert np.abs(reference(np.repeat(inputs[0][:, None], 4, 1)) - expected).max() > 0.01

    for key in (jax.random.key(5), jax.random.key(6)):
        sampled = dataclasses.replace(ctx, key=key, sampled=True)
        _, _, s = drafter.propose(state, policy, sampled)
        np.testing.assert_array_equal(np.asarray(s.acceptance), np.asarray(alpha))

    # no live row: the estimate is kept as it was
    none = dataclasses.replace(ctx, live=jnp.zeros(3, bool))
    _, _, kept = drafter.propose(after, policy, none)
    np.testing.assert_array_equal(np.asarray(kept.acceptance), np.asarray(alpha))
    # off, or a model without the head: no estimate
    assert BlockDrafter(head, confidence_length=False).acceptance_estimate(after) is None


def _closed_form_best(alpha, ks, costs) -> int:
    expected = [1.0 + sum(np.prod(alpha[:i]) for i in range(1, k + 1)) for k in ks]
    return int(np.argmax(np.array(expected) / np.asarray(costs)))


def test_choose_k_follows_the_estimate():
    """The drafter's estimate replaces the counts (here all rejections at depth 1, which alone
    would choose k = 0); k is the closed-form argmax of E_k / c_k; a probe drafts the best k,
    or the shallowest drafted k when k = 0 is the best."""
    rng = np.random.default_rng(0)
    ks = (0, 1, 2, 3, 5)
    for trial in range(40):
        costs = np.sort(rng.uniform(1.0, 3.0, size=len(ks)))
        costs[0] = 1.0
        policy = AdaptiveK(jnp.asarray(costs), ks=ks, probe_every=4)
        alpha = rng.uniform(0.0, 1.0, size=7).astype(np.float32)  # a block deeper than max_k
        if trial < 2:  # the confidence head's extremes: bias +-20
            alpha[:] = 1.0 / (1.0 + np.exp(-20.0)) if trial == 0 else 1.0 / (1.0 + np.exp(20.0))
        state = AdaptState.zeros(policy).update(
            policy, 5, jnp.zeros(8, jnp.int32), jnp.ones(8, bool), 0,
            (jnp.asarray(alpha), jnp.asarray(True)))
        best = _closed_form_best(alpha[:5].astype(np.float64), ks, costs)
        if trial == 0:
            assert best == len(ks) - 1
        if trial == 1:
            assert best == 0
        expected = np.array([1.0 + np.sum(np.cumprod(alpha[:5])[:k]) for k in ks]) / costs
        if np.sort(expected)[-1] - np.sort(expected)[-2] < 1e-4:
            continue  # a near-tie
        next_probe = int(state.next_probe)
        assert int(choose_k(state, policy, next_probe - 1)) == best, (trial, expected)
        assert int(choose_k(state, policy, next_probe)) == (best if best else 1)
        # no estimate yet: the counts decide (8 rows reached depth 1, none accepted: alpha_1 =
        # (0 + 2 x prior) / (8 + 2), and the depths below inherit it)
        unestimated = dataclasses.replace(state, estimated=jnp.asarray(False))
        counted = _closed_form_best(np.full(5, 1.0 / 10.0), ks, costs)
        assert int(choose_k(unestimated, policy, next_probe - 1)) == counted


@pytest.mark.parametrize("bias", [20.0, -20.0])
def test_replay_equals_plain_with_the_confidence_length(policy, bias):
    """alpha ~ 1: every iteration verifies the deepest k; alpha ~ 0: after the first
    iteration (a probe at the deepest k, from the prior) k = 0 (any later probe at k = 1:
    none here, the first found the drafter hopeless and backs off 4 x probe_every). The
    rollouts are the plain ones token for token either way."""
    head = _head(policy, block_size=5, bias=bias)
    plain = generate(policy, PROMPTS, sampling=SAMPLING, max_new_tokens=12, key=KEY)
    adaptive = AdaptiveK(COSTS, probe_every=4)
    for slots in (None, 3):
        out = generate(policy, PROMPTS, drafter=BlockDrafter(head, k=3), adaptive=adaptive,
                       sampling=SAMPLING, max_new_tokens=12, key=KEY, slots=slots)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
        k_iters = np.asarray(out.stats.k_iterations)
        if bias > 0:
            assert k_iters[3] == k_iters.sum() and k_iters[:3].sum() == 0, k_iters
        else:
            assert k_iters[3] == 1 and k_iters[2] == 0, k_iters
            assert k_iters[0] >= 0.8 * k_iters.sum(), k_iters


def test_rejection_with_the_confidence_length_is_refused(policy):
    """The estimate averages the live rows, so under rejection sampling (tokens following
    the drafts) a row's tokens would depend on the rows beside it: 8 rows in one call and
    in two calls with rows= differed. generate refuses the combination before compiling."""
    head = _head(policy, block_size=4, bias=0.0, scale=2.0)
    adaptive = AdaptiveK(jnp.array([1.0, 1.3, 1.6, 1.9]), probe_every=2)
    with pytest.raises(ValueError, match="adaptive draft length with method='rejection'"):
        generate(policy, PROMPTS, drafter=BlockDrafter(head), adaptive=adaptive,
                 method="rejection", sampling=SamplingConfig(1.0), max_new_tokens=3,
                 key=jax.random.key(11))
