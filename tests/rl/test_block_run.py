"""draft.kind block in the GRPO trainer: the block model (with DSpark's Markov and
confidence heads) is trained offline, then online next to the policy, checkpointed, and a
resumed run continues to the same models, optimizer states and metrics as an uninterrupted
one; the export in the DFlash layout loads back as the trained model."""

import jax
import numpy as np

from jaxspec.checkpoint import CheckpointManager
from jaxspec.models.block import BlockHead
from jaxspec.models.block_formats import load_dflash
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.rl import assert_same_tree, kill_after, make_config, rows

# A random policy (no warm-up) and a short offline init keep this cheap; what is checked is
# the training loop's bookkeeping, not the drafts' quality.
BLOCK = ["draft.kind=block", "draft.k=3", "draft.block.size=4", "draft.block.markov_rank=4",
         "draft.block.confidence=true", "draft.block.anchors=4", "warmup.steps=0",
         "warmup.draft_rollouts=8", "warmup.draft_steps=2", "rollout.prompts_per_step=2",
         "run.steps=3", "run.compare_plain=1"]


def flat(params) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(params)])


def test_block_run_trains_and_resumes(tmp_path):
    straight = GRPOTrainer(make_config(tmp_path / "straight", *BLOCK))
    assert isinstance(straight.head, BlockHead)
    initial = flat(straight.head.params)  # after the offline init
    straight.run()
    # the online updates moved the block model
    assert np.abs(flat(straight.head.params) - initial).max() > 1e-4
    got = rows(tmp_path / "straight")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all(r["replay_identical"] == 1.0 for r in got)  # lossless every step
    assert all(np.isfinite(r["draft/loss"]) and r["draft/loss"] > 0 for r in got)

    killed = GRPOTrainer(make_config(tmp_path / "killed", *BLOCK))
    kill_after(killed, 2)
    assert CheckpointManager(tmp_path / "killed" / "checkpoints", create=False).all_steps() == [2]
    resumed = GRPOTrainer(make_config(tmp_path / "killed", *BLOCK, "run.resume=true"))
    assert resumed.completed == 2
    assert_same_tree(resumed.head.params, killed.head.params)  # from the checkpoint
    assert_same_tree(resumed.draft_opt_state, killed.draft_opt_state)
    resumed.run()
    assert_same_tree(resumed.policy.params, straight.policy.params)
    assert_same_tree(resumed.opt_state, straight.opt_state)
    assert_same_tree(resumed.head.params, straight.head.params)
    assert_same_tree(resumed.draft_opt_state, straight.draft_opt_state)
    assert rows(tmp_path / "killed") == got

    exported = load_dflash(tmp_path / "straight" / "block")
    assert_same_tree(exported.params, straight.head.params)
