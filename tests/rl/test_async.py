"""Async GRPO on 8 simulated CPU devices: generation on 4, training on the other 4, rollouts
made by params `max_policy_lag` steps old, corrected by truncated importance weights.

The reference for "which params generated this batch" and for the importance weights is
a plain one-device forward of parameter snapshots taken after every step."""

import pathlib

import jax
import numpy as np
import pytest

from jaxspec.config import load_config
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.rl import SHORT, rollout_logprobs, warmed_base

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
ASYNC = ["async.enabled=true", "async.generation_devices=4", "async.training_devices=4",
         "grpo.tis=token"]


def make_config(run_dir, *extra):
    return load_config(TINY, SHORT + ASYNC + [f"run.dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def base():
    return warmed_base()[:2]  # shared with test_trainer.py (built once per session)


def devices_of(tree):
    return set().union(*(x.sharding.device_set for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("lag", [1, 2])
def test_async_generation_uses_lagged_params_and_importance_weights(base, tmp_path, lag):
    policy, head = base
    cfg = make_config(tmp_path, f"async.max_policy_lag={lag}", "run.steps=3")
    trainer = GRPOTrainer(cfg, policy=policy, head=head)
    devices = jax.devices()
    assert len(devices) == 8
    gen, train = set(devices[:4]), set(devices[4:])
    assert devices_of(trainer.policy.params) == train
    assert devices_of(trainer.opt_state) == train
    gen_policy, drafter = trainer.sync_weights()
    assert devices_of(gen_policy.params) == gen and devices_of(drafter.head.params) == gen

    one = jax.devices()[0]
    ref = jax.device_put(policy, one)
    snapshots = [jax.device_put(trainer.policy.params, one)]  # params of version v
    for s in range(3):
        m = trainer.step()
        batch = trainer.last_batch
        version = max(0, s - lag)
        assert int(batch.step) == s and int(batch.version) == version
        assert m["policy_lag"] == s - version and m["policy_version"] == version
        mask = np.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]
        # the generator's log-probs are those of the lagged params ...
        lagged = np.asarray(rollout_logprobs(ref, snapshots[version], batch))
        np.testing.assert_allclose(batch.gen_logprobs[mask], lagged[mask], atol=1e-4)
        # ... and the trainer corrects them towards the current params (version s)
        current = np.asarray(rollout_logprobs(ref, snapshots[s], batch))
        log_w = current - batch.gen_logprobs
        weights = np.exp(np.minimum(log_w, np.log(cfg.grpo.tis_cap)))[mask]
        assert m["grpo/importance_weight_mean"] == pytest.approx(weights.mean(), abs=1e-4)
        assert m["grpo/logprob_mismatch_mean"] == pytest.approx(np.abs(log_w[mask]).mean(),
                                                                abs=1e-4)
        if s > version:
            assert np.max(np.abs(weights - 1.0)) > 1e-3  # stale rollouts: weights are not 1
        else:
            assert np.max(np.abs(weights - 1.0)) < 1e-4  # on-policy: weights are 1
        snapshots.append(jax.device_put(trainer.policy.params, one))
        # the queue holds the next batches, made by the current or older params
        assert all(int(b.version) <= trainer.completed for b in trainer.queue)
        assert [int(b.step) for b in trainer.queue] == list(
            range(s + 1, min(s + 1 + lag, cfg.run.steps)))
    assert m["acceptance_length"] > 1.0 and "draft/loss" in m
