"""RL post-training on speculative rollouts: tasks and rewards, GRPO, draft training, the
supervised warm-up and the GRPO trainer (sync and async).

Names are imported on first use (module `__getattr__`), so `import jaxspec.rl.tasks` or
`import jaxspec.rl.grpo` does not import the trainer, orbax or optax."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DraftLossConfig": "jaxspec.rl.draft",
    "draft_loss": "jaxspec.rl.draft",
    "draft_train_step": "jaxspec.rl.draft",
    "group_advantages": "jaxspec.rl.grpo",
    "grpo_loss": "jaxspec.rl.grpo",
    "k3_kl": "jaxspec.rl.grpo",
    "TASKS": "jaxspec.rl.tasks",
    "CharTokenizer": "jaxspec.rl.tasks",
    "Task": "jaxspec.rl.tasks",
    "make_task": "jaxspec.rl.tasks",
    "prepare_run": "jaxspec.rl.plan",
    "Cluster": "jaxspec.rl.cluster",
    "DraftLearner": "jaxspec.rl.drafting",
    "RolloutBatch": "jaxspec.rl.rollouts",
    "make_optimizer": "jaxspec.rl.steps",
    "score_rollouts": "jaxspec.rl.steps",
    "GRPOTrainer": "jaxspec.rl.trainer",
    "read_metrics": "jaxspec.metrics",
    "run_summary": "jaxspec.metrics",
    "draft_corpus": "jaxspec.rl.warmup",
    "encode_pairs": "jaxspec.rl.warmup",
    "init_eagle3_head": "jaxspec.rl.warmup",
    "supervised_warmup": "jaxspec.rl.warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxspec.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
