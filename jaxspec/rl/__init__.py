"""RL post-training on speculative rollouts: tasks and rewards, GRPO, draft training, the
supervised warm-up and the GRPO trainer (sync and async).

The names below are imported on first use, so `import jaxspec.rl.tasks` or `jaxspec.rl.grpo`
does not import the trainer (optax, orbax).
"""

import importlib

_EXPORTS = {
    "DraftLossConfig": "draft", "draft_loss": "draft", "draft_optimizer": "draft",
    "draft_train_step": "draft",
    "group_advantages": "grpo", "grpo_loss": "grpo", "k3_kl": "grpo",
    "TASKS": "tasks", "CharTokenizer": "tasks", "Task": "tasks", "make_task": "tasks",
    "GRPOTrainer": "trainer", "RolloutBatch": "trainer", "make_optimizer": "trainer",
    "read_metrics": "trainer", "run_summary": "trainer", "score_rollouts": "trainer",
    "prepare_run": "plan",
    "draft_corpus": "warmup", "encode_pairs": "warmup", "init_eagle3_head": "warmup",
    "supervised_warmup": "warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"jaxspec.rl.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
