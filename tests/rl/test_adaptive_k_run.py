"""`draft.adaptive_k` in the trainer: costs measured once, k chosen per iteration, rollouts
equal to plain decoding (replay), the schedule logged, and the settings that cannot adapt
refused by the config."""

import pathlib

import numpy as np
import pytest

from jaxspec.config import ConfigError, load_config
from jaxspec.rl.trainer import GRPOTrainer

TINY = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
# A mechanics check: a barely warmed-up policy and head are enough (acceptance is low, so
# the schedule is mostly k = 0 with probes, both of which must equal plain decoding).
QUICK = ["rollout.prompts_per_step=4", "rollout.group_size=4", "warmup.steps=20",
         "warmup.batch_size=16", "warmup.draft_rollouts=16", "warmup.draft_steps=2",
         "run.save_every=0", "run.compare_plain=1"]


def test_adaptive_k_run_equals_plain_and_logs_the_schedule(tmp_path):
    cfg = load_config(TINY, QUICK + ["draft.adaptive_k=true", "run.steps=2", f"run.dir={tmp_path}"])
    trainer = GRPOTrainer(cfg, log=lambda line: None)
    before = None
    for step in range(2):
        m = trainer.step()
        assert m["replay_identical"] == 1.0  # every row equals plain decoding
        stats = trainer.last_batch.stats
        k_iters = np.asarray(stats.k_iterations)
        assert k_iters.shape == (cfg.draft.k + 1,) and k_iters.sum() == int(stats.target_forwards)
        assert m["spec/mean_k"] == pytest.approx(np.dot(np.arange(4), k_iters) / k_iters.sum())
        assert m["spec/plain_fraction"] == pytest.approx(k_iters[0] / k_iters.sum())
        adaptive = trainer.rollouts.adaptive
        if step == 0 or k_iters[1:].sum() > 0:
            assert k_iters[1:].sum() > 0  # the first call (no compile() before) probes first
            # the next call starts from this call's first-depth acceptance
            assert float(adaptive.prior) == pytest.approx(stats.per_position_acceptance[0], abs=1e-6)
        else:  # the carried clock was not due in this call: it ran on, the prior stayed
            assert int(adaptive.first_probe) == int(before.first_probe) - int(stats.target_forwards)
            assert float(adaptive.prior) == float(before.prior)
        before = adaptive
    assert adaptive.ks == (0, 1, 2, 3)
    assert np.all(np.asarray(adaptive.costs) > 0) and float(adaptive.probe_cost) > 0


@pytest.mark.parametrize("overrides,match", [
    (["draft.kind=history"], "adaptive draft length needs chain drafts; draft kind 'history'"),
    (["draft.tree={top_k: 2, depth: 2, budget: 3}"], "with draft.tree"),
    (["rollout.method=rejection"], "would not be reproducible"),
])
def test_config_refuses_what_cannot_adapt(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, ["draft.adaptive_k=true", *overrides])
