"""The logged row of one GRPO step (rollouts, speculation, losses) and the
acceptance-collapse alarm. Stage times come from `jaxspec.metrics.StageTimer`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["collapse_alarm", "step_metrics"]


def step_metrics(batch, grpo_metrics: dict, draft_metrics: dict, *,
                 completed: int) -> dict[str, Any]:
    """The row of the step that trained on `batch` (a host RolloutBatch) and made policy
    version `completed`: reward, completion length, speculation (from the batch's
    RolloutStats), the plain-decoding comparison when it ran, and the loss metrics under
    grpo/ and draft/. `fraction_properly_ended`: rows that stopped at an EOS (the rest hit
    max_new_tokens and, by default, scored 0)."""
    stats = batch.stats
    m: dict[str, Any] = {
        "reward": float(np.mean(batch.rewards)),
        "reward_std": float(np.std(batch.rewards)),
        "accuracy": float(np.mean(batch.rewards >= 1.0)),
        "completion_length": float(np.mean(batch.lengths)),
        "acceptance_length": stats.acceptance_length,
        # the batch's pace: tokens per loop iteration per slot, and idle slot-iterations
        "tokens_per_slot_step": stats.tokens_per_slot_step,
        "wasted_row_steps": stats.wasted_row_steps,
        "generation_time_s": float(stats.wall_time_s),
        "policy_version": int(batch.version),
        "policy_lag": completed - 1 - int(batch.version),
    }
    ended = getattr(batch, "ended", None)
    if ended is not None:  # completions that stopped at an EOS, not at max_new_tokens
        m["fraction_properly_ended"] = float(np.mean(ended))
    proposed = np.asarray(stats.proposed_at, np.float64)
    if proposed.size:  # all depths together (RolloutStats has the per-depth rates only)
        accepted = np.asarray(stats.accepted_at, np.float64)
        m["acceptance_rate"] = float(accepted.sum() / max(proposed.sum(), 1.0))
        for j, rate in enumerate(stats.per_position_acceptance):
            m[f"spec/acceptance_at_{j + 1}"] = float(rate)
    if getattr(stats, "k_iterations", None) is not None:  # draft.adaptive_k
        m["spec/mean_k"] = stats.mean_k
        m["spec/plain_fraction"] = float(np.asarray(stats.k_iterations)[0]
                                         / max(int(stats.target_forwards), 1))
    m["spec/target_forwards"] = int(stats.target_forwards)
    m["spec/draft_forwards"] = int(stats.draft_forwards)
    if not math.isnan(float(batch.plain_time_s)):
        m["generation_plain_time_s"] = float(batch.plain_time_s)
        m["generation_speedup"] = float(batch.plain_time_s) / max(float(stats.wall_time_s), 1e-9)
        m["replay_identical"] = float(batch.replay_identical)
    routing = float(getattr(batch, "routing_mismatch", math.nan))
    if not math.isnan(routing):  # an MoE policy: generation vs training routing
        m["moe/routing_mismatch"] = routing
        gaps = float(getattr(batch, "routing_gaps", math.nan))
        if not math.isnan(gaps):  # fed tokens with no route record: not in the mismatch
            m["moe/routing_gaps"] = int(gaps)
    for k, v in grpo_metrics.items():
        m[f"grpo/{k}"] = float(v)
    for k, v in draft_metrics.items():
        m[f"draft/{k.removeprefix('draft_')}"] = float(v)
    return m


def collapse_alarm(acceptance_length: float, collapsed_steps: int, *, threshold: float,
                   patience: int) -> tuple[int, str | None]:
    """(consecutive steps below `threshold` including this one, the warning to log when
    that count has reached `patience`, else None): the draft is not helping."""
    collapsed_steps = collapsed_steps + 1 if acceptance_length < threshold else 0
    if collapsed_steps < patience:
        return collapsed_steps, None
    return collapsed_steps, (
        f"WARNING: acceptance length {acceptance_length:.3f} < {threshold} for "
        f"{collapsed_steps} steps in a row: the draft is not helping (weights dropped at "
        f"sync? draft diverged?)")
