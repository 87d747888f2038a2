"""RL post-training on speculative rollouts: tasks and rewards, GRPO, draft training, the
supervised warm-up and the GRPO trainer (sync and async)."""

from jaxspec.rl.draft import (
    DraftLossConfig,
    draft_loss,
    draft_train_step,
)
from jaxspec.rl.grpo import group_advantages, grpo_loss, k3_kl
from jaxspec.rl.tasks import TASKS, CharTokenizer, Task, make_task
from jaxspec.rl.trainer import (
    GRPOTrainer,
    RolloutBatch,
    make_optimizer,
    prepare_run,
    read_metrics,
    run_summary,
    score_rollouts,
)
from jaxspec.rl.warmup import (
    draft_corpus,
    encode_pairs,
    init_eagle3_head,
    supervised_warmup,
)

__all__ = [
    "TASKS",
    "CharTokenizer",
    "DraftLossConfig",
    "GRPOTrainer",
    "RolloutBatch",
    "Task",
    "draft_corpus",
    "draft_loss",
    "draft_train_step",
    "encode_pairs",
    "group_advantages",
    "grpo_loss",
    "init_eagle3_head",
    "k3_kl",
    "make_optimizer",
    "make_task",
    "prepare_run",
    "read_metrics",
    "run_summary",
    "score_rollouts",
    "supervised_warmup",
]
