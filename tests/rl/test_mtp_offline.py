"""Offline MTP initialisation: scripts/train_draft.py with draft.kind=mtp trains an MTP head
on the policy's own rollouts with the online mtp update, writes it in the DeepSeek-V3 layout,
and a GRPO config with draft.kind mtp accepts it through draft.hf_path."""

import re

import jax
import numpy as np

from jaxspec.config import load_config
from jaxspec.decoding.drafters import MTPDrafter
from jaxspec.decoding.engine import generate
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import load_hf
from jaxspec.models.mtp import MTPHead, load_mtp
from jaxspec.rl.plan import prepare_run
from jaxspec.rl.rollouts import encode_prompts
from jaxspec.rl.tasks import make_task
from jaxspec.testing import rl
from jaxspec.testing.scripts import load_script

TINY = str(rl.TINY)

# a short policy warm-up: the head learns the (imperfect) policy's own continuations
FAST = ["warmup.steps=40", "warmup.batch_size=16", "warmup.draft_rollouts=32",
        "warmup.draft_steps=40", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "draft.kind=mtp"]


def test_offline_mtp_lowers_its_loss_and_writes_a_head_that_drafts(tmp_path, capsys):
    run_dir = tmp_path / "mtp"
    train_draft = load_script("train_draft")
    assert train_draft.main([TINY, *FAST, f"run.dir={run_dir}"]) == 0
    out = capsys.readouterr()
    first, last = map(float, re.search(r"draft init: .* loss ([\d.]+) -> ([\d.]+)",
                                       out.out + out.err).groups())
    assert last < 0.7 * first, (first, last)

    policy, head = load_hf(run_dir / "policy"), load_mtp(run_dir / "mtp")
    head.check_compatible(policy)
    # its drafts beat a fresh head's on prompts neither the warm-up nor the head saw: the
    # same rollouts (replay) with more tokens per policy forward
    cfg = load_config(TINY, [*FAST, f"run.dir={run_dir}"])
    task = make_task(cfg.task.name, seed=cfg.run.seed, **cfg.task.params)
    prompts = encode_prompts(task.tokenizer, [ex.prompt for ex in task.batch(10_000, 32)],
                             cfg.rollout.max_prompt_len)

    def rollouts(h):
        return generate(policy, prompts, drafter=MTPDrafter(h, k=cfg.draft.k),
                        sampling=SamplingConfig(), max_new_tokens=cfg.rollout.max_new_tokens,
                        key=jax.random.key(11), stop_tokens=(task.tokenizer.eos_id,))

    # Measured (fixed keys): loss 7.82 -> 2.62 over 40 steps; 1.20 vs 1.01 tokens per
    # policy forward (32 prompts). The thresholds sit midway.
    trained, fresh = rollouts(head), rollouts(MTPHead.init_for(policy, jax.random.key(5)))
    np.testing.assert_array_equal(trained.tokens, fresh.tokens)
    assert trained.stats.acceptance_length > fresh.stats.acceptance_length + 0.1, (
        trained.stats.acceptance_length, fresh.stats.acceptance_length)

    # a GRPO run's draft.hf_path reads it (checked before compiling)
    prepare_run(load_config(TINY, [*FAST, f"run.dir={tmp_path / 'grpo'}",
                                   f"draft.hf_path={run_dir / 'mtp'}"]))
