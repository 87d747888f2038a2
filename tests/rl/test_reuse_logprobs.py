"""grpo.reuse_generation_logprobs: the generator's log-probs as the old-policy log-probs, after
a measured check. Against the recompute path (the default), an independent policy update with
the generation log-probs, and an injected mismatch that must be refused."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.config import ConfigError
from jaxspec.rl.grpo import group_advantages
from jaxspec.rl.steps import POLICY_INPUTS, policy_update
from jaxspec.rl.trainer import GRPOTrainer, ReuseMismatch
from jaxspec.testing.rl import make_config, warmed_base

REUSE = ["grpo.reuse_generation_logprobs=true"]


@pytest.fixture(scope="module")
def base():
    return warmed_base()[:2]  # shared with test_trainer.py (built once per session)


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_reuse_equals_recompute_within_the_logged_mismatch(base, tmp_path):
    """Step 1 (every row checked) and step 2 (8 sampled rows): the reuse path trains on the
    generation log-probs (bitwise the update computed independently with them), and its loss
    is the recompute path's within max|A| x the logged mismatch."""
    policy, head = base
    reuse = GRPOTrainer(make_config(tmp_path / "reuse", "run.steps=2", *REUSE),
                        policy=policy, head=head)
    plain = GRPOTrainer(make_config(tmp_path / "plain", "run.steps=2"), policy=policy, head=head)
    for step, rows in ((1, 16), (2, 8)):
        before, opt_before = reuse.policy, reuse.opt_state
        mr, mp = reuse.step(), plain.step()
        assert mr["reuse/reused"] == 1 and mr["reuse/checked_rows"] == rows
        tol = reuse.cfg.grpo.reuse_tolerance
        assert 0 <= mr["reuse/mismatch_max"] <= tol
        assert mr["grpo/logprob_mismatch_max"] == mr["reuse/mismatch_max"]  # measured, not 0
        scored = reuse.last_scored
        assert "entropy" not in scored and "logprobs" in scored
        if step == 2:
            continue
        # step 1, the same batch: the full check measures what the recompute path logs
        np.testing.assert_array_equal(reuse.last_batch.tokens, plain.last_batch.tokens)
        assert mr["reuse/mismatch_max"] == pytest.approx(mp["grpo/logprob_mismatch_max"],
                                                         abs=1e-7)
        adv = np.asarray(group_advantages(reuse.last_batch.rewards, 4), np.float32)
        bound = 1.01 * mr["reuse/mismatch_max"] * np.abs(adv).max() + 1e-7
        assert abs(mr["grpo/loss"] - mp["grpo/loss"]) <= bound
        assert mr["grpo/kl"] == pytest.approx(mp["grpo/kl"], abs=1e-7)
        assert mr["grpo/entropy"] == pytest.approx(mp["grpo/entropy"], rel=1e-5)
        assert mr["grpo/grad_norm"] == pytest.approx(mp["grpo/grad_norm"], rel=1e-4)
        # independently: the recompute path's scoring with old := the generation log-probs
        inputs = {k: plain.last_scored[k] for k in POLICY_INPUTS if k in plain.last_scored}
        inputs["logprobs"] = plain.last_scored["gen_logprobs"]
        with reuse.cluster.training():
            expect, _, _ = policy_update(
                before, opt_before, inputs, reuse.cluster.shard_batch(adv), reuse.sampling,
                optimizer=reuse.optimizer, grpo_cfg=reuse.cfg.grpo, minibatches=1,
                filtered=reuse.filtered)
        for a, b in zip(_leaves(reuse.policy.params), _leaves(expect.params), strict=True):
            np.testing.assert_array_equal(a, b)


def _inject(trainer, row: int, delta: float):
    """The generation log-prob of `row`'s first token off by `delta` (a generator bug)."""
    produce = trainer.rollouts.produce

    def bad(*args, **kwargs):
        batch = produce(*args, **kwargs)
        lp = np.array(batch.gen_logprobs)
        lp[row, 0] += delta
        return dataclasses.replace(batch, gen_logprobs=lp)
    trainer.rollouts.produce = bad


def test_a_mismatch_over_the_tolerance_is_refused_or_recomputed(base, tmp_path):
    policy, head = base
    refused = GRPOTrainer(make_config(tmp_path / "a", "run.steps=1", *REUSE),
                          policy=policy, head=head)
    _inject(refused, row=5, delta=0.01)
    with pytest.raises(ReuseMismatch, match=r"up to 0\.01 on 16 checked rows \(1 of \d+ tokens\)"
                       r".*grpo.reuse_tolerance=1e-05.*model.batch_invariant=true"):
        refused.step()
    assert refused.completed == 0 and len(refused.queue) == 1  # nothing applied, batch kept
    for a, b in zip(_leaves(refused.policy.params), _leaves(policy.params), strict=True):
        np.testing.assert_array_equal(a, b)

    fallback = GRPOTrainer(make_config(tmp_path / "b", "run.steps=1", *REUSE,
                                       "grpo.reuse_on_mismatch=recompute"),
                           policy=policy, head=head)
    _inject(fallback, row=5, delta=0.01)
    plain = GRPOTrainer(make_config(tmp_path / "c", "run.steps=1"), policy=policy, head=head)
    mf, mp = fallback.step(), plain.step()
    assert mf["reuse/reused"] == 0
    assert mf["reuse/mismatch_max"] == pytest.approx(0.01, rel=1e-3)
    assert mf["grpo/logprob_mismatch_max"] == pytest.approx(0.01, rel=1e-3)  # still logged
    assert mf["grpo/loss"] == mp["grpo/loss"]  # the recompute path, bit for bit
    for a, b in zip(_leaves(fallback.policy.params), _leaves(plain.policy.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_reuse_is_refused_in_async_mode(base, tmp_path):
    policy, head = base
    cfg = make_config(tmp_path, *REUSE, "async.enabled=true", "grpo.tis=token")
    with pytest.raises(ConfigError, match="grpo.reuse_generation_logprobs.*false when async"):
        GRPOTrainer(cfg, policy=policy, head=head)


INVARIANT = ["model.batch_invariant=true", "grpo.reuse_tolerance=0", "grpo.tis=token",
             "grpo.micro_batch=8", "grpo.logprob_chunk=256"]


@pytest.mark.parametrize("temperature", ["1.0", "0.0"])
def test_invariant_reuse_is_bitwise_the_recompute_path_every_step(base, tmp_path, temperature):
    """Issue 38's done-when on the shortened tiny config: with model.batch_invariant the
    generation log-probs are the scorer's bit for bit (tolerance 0), so every step reuses them
    (reported as reuse/reused) and trains to the recompute path's losses and params exactly;
    the truncated importance weights exp(old - gen) are exactly 1, at temperature 1 and at 0
    (greedy: both sides report the unscaled softmax), with logprob_chunk 256 (one tile of the
    small vocabulary here) and micro-batched."""
    policy, head = base
    policy = policy.with_config(batch_invariant=True)
    extra = [*INVARIANT, f"sampling.temperature={temperature}", "run.steps=3"]
    reuse = GRPOTrainer(make_config(tmp_path / "reuse", *REUSE, *extra), policy=policy, head=head)
    plain = GRPOTrainer(make_config(tmp_path / "plain", *extra), policy=policy, head=head)
    for _ in range(3):
        mr, mp = reuse.step(), plain.step()
        np.testing.assert_array_equal(reuse.last_batch.tokens, plain.last_batch.tokens)
        assert mr["reuse/reused"] == 1 and mr["reuse/mismatch_max"] == 0.0
        assert mp["grpo/logprob_mismatch_max"] == 0.0  # the recompute path measures 0 too
        assert mp["grpo/importance_weight_mean"] == 1.0
        assert mp["grpo/importance_weight_truncated_fraction"] == 0.0
        for key in ("grpo/loss", "grpo/kl", "grpo/grad_norm", "grpo/ratio_mean"):
            assert mr[key] == mp[key], key
        for a, b in zip(_leaves(reuse.policy.params), _leaves(plain.policy.params), strict=True):
            np.testing.assert_array_equal(a, b)
    if temperature == "0.0":  # the unscaled softmax, not the point mass's log p = 0
        lp = np.asarray(plain.last_scored["gen_logprobs"])[np.asarray(plain.last_scored["mask"])]
        assert lp.min() < -1e-3
