"""What `generate` returns: the rollouts and the counters of the call."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Counters of one `generate` call; derived rates are properties."""

    target_forwards: jax.Array  # [] loop iterations: verify forwards (prefills excluded)
    draft_forwards: jax.Array  # [] drafter forwards (0 for model-free drafters)
    row_steps: jax.Array  # [prompts] policy forwards while the rollout was generating
    tokens_generated: jax.Array  # [prompts] (prompt order, whatever slot ran it)
    accepted_at: jax.Array  # [max_depth] row-steps whose draft at depth j+1 was accepted
    proposed_at: jax.Array  # [max_depth] row-steps that proposed a draft at depth j+1
    wall_time_s: jax.Array  # [] host wall time of the call, compilation included
    # [] loop iterations x slots: every slot pays each iteration, live or not (None: not
    # counted; then target_forwards x batch, a static batch)
    slot_steps: jax.Array | None = None
    prefill_forwards: jax.Array | None = None  # [] in-loop prefills of refilled slots
    # [max_k + 1] loop iterations run at each draft length k (adaptive k only, else None)
    k_iterations: jax.Array | None = None

    @classmethod
    def zeros(cls, batch: int, max_depth: int, max_k: int | None = None) -> RolloutStats:
        """Counters before the first step (`jax.eval_shape(RolloutStats.zeros, ...)` for shapes);
        max_k: the largest adaptive draft length (None: no adaptive k)."""
        i32 = jnp.int32
        return cls(
            target_forwards=jnp.zeros((), i32),
            draft_forwards=jnp.zeros((), i32),
            row_steps=jnp.zeros((batch,), i32),
            tokens_generated=jnp.zeros((batch,), i32),
            accepted_at=jnp.zeros((max_depth,), i32),
            proposed_at=jnp.zeros((max_depth,), i32),
            wall_time_s=jnp.zeros((), jnp.float32),
            slot_steps=jnp.zeros((), i32),
            prefill_forwards=jnp.zeros((), i32),
            k_iterations=None if max_k is None else jnp.zeros((max_k + 1,), i32),
        )

    @property
    def mean_k(self) -> float | None:
        """Mean draft length over loop iterations (adaptive k), else None."""
        if self.k_iterations is None:
            return None
        counts = np.asarray(self.k_iterations, np.float64)
        return float(np.dot(np.arange(counts.size), counts) / max(counts.sum(), 1.0))

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per policy forward of a live row, over all rows (1.0 for plain
        decoding). A row's view: the loop's pace is `tokens_per_slot_step`."""
        steps = float(np.sum(self.row_steps))
        return float(np.sum(self.tokens_generated)) / max(steps, 1.0)

    @property
    def total_slot_steps(self) -> float:
        """Loop iterations x slots (live or not)."""
        if self.slot_steps is not None:
            return float(self.slot_steps)
        return float(self.target_forwards) * float(np.shape(self.row_steps)[0])

    @property
    def tokens_per_slot_step(self) -> float:
        """Batch-level acceptance: tokens emitted per loop iteration per slot (sum of tokens /
        (iterations x slots)). Each iteration is one policy forward over every slot, so this,
        not `acceptance_length`, sets the wall time; it is acceptance_length x (1 - wasted)."""
        return float(np.sum(self.tokens_generated)) / max(self.total_slot_steps, 1.0)

    @property
    def wasted_row_steps(self) -> float:
        """Fraction of slot-iterations spent on finished or empty slots (the long tail of a
        static batch; what refilling slots removes)."""
        total = self.total_slot_steps
        return 1.0 - float(np.sum(self.row_steps)) / total if total else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts, all depths together (0.0 without drafts)."""
        proposed = float(np.sum(self.proposed_at))
        return float(np.sum(self.accepted_at)) / max(proposed, 1.0)

    @property
    def per_position_acceptance(self) -> np.ndarray:
        """[max_depth] fraction of proposals accepted at each draft depth 1..D."""
        proposed = np.asarray(self.proposed_at, np.float64)
        return np.asarray(self.accepted_at, np.float64) / np.maximum(proposed, 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Generated continuations (prompt excluded), right-padded with `pad_id`."""

    tokens: jax.Array  # [batch, max_new_tokens] int32
    lengths: jax.Array  # [batch] int32: generated tokens per row (stop token included)
    logprobs: jax.Array  # [batch, max_new_tokens] float32 log p(token) under the processed policy
    stats: RolloutStats
    # the drafter's own counters, from its optional `draft_stats(state)` ({} without one),
    # e.g. HybridDrafter's accepted drafts by source
    draft_stats: dict = dataclasses.field(default_factory=dict)
    # [] int32 adaptive k: loop iterations from the call's end to the probe it would have
    # run next (`AdaptiveK.after` carries it into the next call); None without adaptive k
    next_probe: jax.Array | None = None
    # an MoE policy: [batch, max_new_tokens, L, K] int32 the experts each generated token was
    # routed to in the forward that fed it (-1: never fed, i.e. a rollout's last token, and
    # padding; a dense layer of a mixed model: -1); None for a dense policy
    routes: jax.Array | None = None
