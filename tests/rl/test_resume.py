"""Resume: 4 steps straight equal 2 steps, a stop right after step 2's checkpoint, and a
resumed run of 2 more steps: identical parameters, optimizer states and metrics."""

import json
import pathlib

import jax
import numpy as np
import pytest
from test_trainer import SHORT, warmed_base

from jaxspec.checkpoint import CheckpointManager
from jaxspec.config import load_config
from jaxspec.rl.trainer import GRPOTrainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
MODES = {
    "sync": [],
    "async": ["async.enabled=true", "async.generation_devices=4", "async.training_devices=4",
              "grpo.tis=token", "async.max_policy_lag=1"],
}
TIMING = ("time/", "share/", "generation_time_s", "generation_plain_time_s", "generation_speedup")


def make_config(run_dir, *extra):
    return load_config(TINY, SHORT + [f"run.dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def base():
    return warmed_base()[:2]  # shared with test_trainer.py (built once per session)


class Killed(Exception):
    pass


def rows(run_dir):
    with open(run_dir / "metrics.jsonl") as fh:
        out = [json.loads(line) for line in fh]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in out]


def assert_same_tree(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_equals_an_uninterrupted_run(base, tmp_path, mode):
    policy, head = base
    extra = ["run.steps=4", *MODES[mode]]
    straight = GRPOTrainer(make_config(tmp_path / "straight", *extra), policy=policy, head=head)
    straight.run()

    first = GRPOTrainer(make_config(tmp_path / "killed", *extra), policy=policy, head=head)

    def kill(step, row):
        if step == 2:
            raise Killed  # right after step 2's checkpoint, as a SIGKILL would leave it

    with pytest.raises(Killed):
        first.run(on_step=kill)
    assert CheckpointManager(tmp_path / "killed" / "checkpoints", create=False).all_steps() == [2]

    lines = []  # no policy / head given: everything comes from the checkpoint
    resumed = GRPOTrainer(make_config(tmp_path / "killed", *extra, "run.resume=true"),
                          log=lines.append)
    assert resumed.completed == 2 and not any("warm-up" in line for line in lines)
    assert [int(b.step) for b in resumed.queue] == ([2] if mode == "async" else [])  # 0-based
    resumed.run()

    assert resumed.completed == straight.completed == 4
    assert_same_tree(resumed.policy.params, straight.policy.params)
    assert_same_tree(resumed.opt_state, straight.opt_state)
    assert_same_tree(resumed.head, straight.head)
    assert_same_tree(resumed.draft_opt_state, straight.draft_opt_state)
    assert_same_tree(resumed.ref_params, straight.ref_params)
    assert rows(tmp_path / "killed") == rows(tmp_path / "straight")
    assert [r["step"] for r in rows(tmp_path / "killed")] == [1, 2, 3, 4]
