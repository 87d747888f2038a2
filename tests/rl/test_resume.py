"""Resume: 4 steps straight equal 2 steps, a stop right after step 2's checkpoint, and a
resumed run of 2 more steps: identical parameters, optimizer states and metrics."""

import pytest

from jaxspec.checkpoint import CheckpointManager
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.rl import Killed, assert_same_tree, make_config, rows, warmed_base

MODES = {
    "sync": [],
    "async": ["async.enabled=true", "async.generation_devices=4", "async.training_devices=4",
              "grpo.tis=token", "async.max_policy_lag=1"],
}


@pytest.fixture(scope="module")
def base():
    return warmed_base()[:2]  # shared with tests/rl (built once per process)


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
