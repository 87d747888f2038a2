"""One generation engine for plain and speculative rollouts.

`generate` pads the prompts, checks every argument on the host, and runs one jitted
`lax.while_loop`. Each iteration the drafter proposes a tree (an empty one for plain
decoding), the policy verifies it in a single forward, `verify` picks the emitted tokens,
the accepted path's KV entries are compacted, and the drafter observes what was kept.

Sequence bookkeeping: a row's "root" is its last committed token, whose KV is not in the
cache yet; it sits at position `lengths - 1` of the token buffer. The token emitted from
the root's distribution goes to position `lengths`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import parallel
from jaxspec.decoding import arguments as args
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.drafters import NoDrafter
from jaxspec.decoding.protocols import DraftContext, Drafter, Observation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.verify import verify
from jaxspec.models import KVCache, Policy, compact


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Counters of one `generate` call; derived rates are properties."""

    target_forwards: jax.Array  # [] policy forwards in the loop (prefill excluded)
    draft_forwards: jax.Array  # [] drafter forwards (0 for model-free drafters)
    row_steps: jax.Array  # [batch] policy forwards while the row was still generating
    tokens_generated: jax.Array  # [batch]
    accepted_at: jax.Array  # [max_depth] row-steps whose draft at depth j+1 was accepted
    proposed_at: jax.Array  # [max_depth] row-steps that proposed a draft at depth j+1
    wall_time_s: jax.Array  # [] host wall time of the call, compilation included

    @classmethod
    def zeros(cls, batch: int, max_depth: int) -> RolloutStats:
        """Counters before the first step (`jax.eval_shape(RolloutStats.zeros, ...)` for shapes)."""
        i32 = jnp.int32
        return cls(
            target_forwards=jnp.zeros((), i32),
            draft_forwards=jnp.zeros((), i32),
            row_steps=jnp.zeros((batch,), i32),
            tokens_generated=jnp.zeros((batch,), i32),
            accepted_at=jnp.zeros((max_depth,), i32),
            proposed_at=jnp.zeros((max_depth,), i32),
            wall_time_s=jnp.zeros((), jnp.float32),
        )

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per policy forward, over all rows (1.0 for plain decoding)."""
        steps = float(np.sum(self.row_steps))
        return float(np.sum(self.tokens_generated)) / max(steps, 1.0)

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


def generate(
    policy: Policy,
    prompts,  # list of token-id lists, or (tokens [B, P] int, lengths [B] int)
    *,
    drafter: Drafter | None = None,
    sampling: SamplingConfig | None = None,
    max_new_tokens: int,
    key: jax.Array,
    stop_tokens: Sequence[int] = (),
    method: str = "replay",
    rows: jax.Array | None = None,  # [B] global rollout ids (position-keyed noise)
    pad_id: int = 0,
) -> Rollouts:
    """Sample continuations of `prompts` from `policy`, speculatively when `drafter` is set.

    With `method="replay"` (the default) and the same key, the tokens equal those of plain
    decoding (`drafter=None`) token for token, up to floating-point differences between a
    one-token and a multi-token forward (none with `ModelConfig.batch_invariant`: then
    tokens and log-probs are equal bit for bit); every method is lossless in distribution
    (`greedy` only at temperature 0). Every argument is checked on the host before anything
    compiles; a SamplingConfig holding traced values cannot be.
    """
    args.check_policy(policy)
    args.check_method(method)
    sampling = args.check_sampling(sampling, method)
    drafter = NoDrafter() if drafter is None else drafter
    args.check_drafter(drafter, policy, method)
    key = args.check_key(key)
    max_new_tokens = args.check_positive_int("max_new_tokens", max_new_tokens)
    vocab = policy.config.vocab_size
    pad_id = args.check_token("pad_id", pad_id, vocab)
    stops = args.check_stop_tokens(stop_tokens, vocab)
    tokens, prompt_lengths = pad_prompts(prompts, pad_id)
    batch, width = tokens.shape
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(
            f"prompt token ids must be in [0, {vocab}); got min {tokens.min()}, max {tokens.max()}"
        )
    # Headroom: a verify step writes num_nodes + 1 cache slots past the root (k+1 for chains).
    max_len = width + max_new_tokens + drafter.num_nodes + 1
    limit = policy.config.max_position_embeddings
    if max_len > limit:
        raise ValueError(
            f"prompt length {width} + max_new_tokens {max_new_tokens} + draft headroom "
            f"{drafter.num_nodes + 1} = {max_len} exceeds the policy's max_position_embeddings {limit}"
        )
    rows = args.check_rows(rows, batch)

    start = time.perf_counter()
    out = _generate_jit(
        policy,
        drafter,
        jnp.asarray(tokens),
        jnp.asarray(prompt_lengths),
        sampling,
        key,
        jnp.asarray(stops or [-1], jnp.int32),
        jnp.asarray(rows, jnp.int32),
        max_new_tokens=max_new_tokens,
        max_len=max_len,
        method=method,
        pad_id=pad_id,
    )
    jax.block_until_ready(out)
    wall = jnp.asarray(time.perf_counter() - start, jnp.float32)
    return dataclasses.replace(out, stats=dataclasses.replace(out.stats, wall_time_s=wall))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LoopState:
    buffer: jax.Array  # [batch, max_len] prompt + generated tokens
    logprobs: jax.Array  # [batch, max_len] log-probs of generated tokens at their positions
    lengths: jax.Array  # [batch] committed tokens (the root is the last of them)
    done: jax.Array  # [batch] bool
    cache: KVCache
    draft_state: Any
    stats: RolloutStats


@partial(jax.jit, static_argnames=("max_new_tokens", "max_len", "method", "pad_id"))
def _generate_jit(
    policy: Policy,
    drafter: Drafter,
    prompt_tokens,  # [batch, width]
    prompt_lengths,  # [batch]
    sampling,
    key,
    stops,  # [num_stops]
    rows,  # [batch]
    *,
    max_new_tokens: int,
    max_len: int,
    method: str,
    pad_id: int,
):
    batch, width = prompt_tokens.shape
    num_nodes, max_depth, capture = drafter.num_nodes, drafter.max_depth, drafter.capture_layers
    if policy.decodes_unrolled(max_len, batch):  # per-layer weights, sliced once here, not per step
        policy = policy.unstack_layers()

    buffer = jnp.full((batch, max_len), pad_id, jnp.int32).at[:, :width].set(prompt_tokens)
    # Rows over the batch mesh axes, KV heads over tensor (no-ops outside jax.set_mesh).
    buffer = parallel.constrain(buffer, ("batch", "length"))
    # Prefill every prompt token but the last: the last is the first root.
    pre_positions = jnp.arange(width, dtype=jnp.int32)[None, :]
    pre_positions = jnp.where(pre_positions < prompt_lengths[:, None] - 1, pre_positions, -1)
    cache = policy.init_cache(batch, max_len)
    cache = KVCache(
        k=parallel.constrain(cache.k, parallel.KV_CACHE_AXES),
        v=parallel.constrain(cache.v, parallel.KV_CACHE_AXES),
        lengths=parallel.constrain(cache.lengths, ("batch",)),
    )
    _, captured, cache = policy.forward(
        prompt_tokens, pre_positions, cache, capture=capture
    )
    draft_state = drafter.init_state(policy, batch, max_len)
    draft_state = drafter.observe(draft_state, policy, Observation(
        fed_tokens=prompt_tokens,
        next_tokens=jnp.roll(prompt_tokens, -1, axis=1),
        positions=pre_positions,
        captured=captured,
    ))
    state = _LoopState(
        buffer=buffer,
        logprobs=jnp.zeros((batch, max_len), jnp.float32),
        lengths=prompt_lengths.astype(jnp.int32),
        done=jnp.zeros((batch,), bool),
        cache=cache,
        draft_state=draft_state,
        stats=RolloutStats.zeros(batch, max_depth),
    )
    budget_end = prompt_lengths + max_new_tokens  # [batch] exclusive end of generation
    draft_key = jax.random.split(key)[1]  # drafts never share the verifier's noise
    # Forwards the drafter declares per step: one proposal, one observation.
    draft_forwards_per_step = drafter.forwards_per_propose + drafter.forwards_per_observe

    def cond(s: _LoopState):
        return jnp.any(~s.done)

    def body(s: _LoopState):
        active = ~s.done
        root_pos = s.lengths - 1
        root = jnp.take_along_axis(s.buffer, root_pos[:, None], axis=1)  # [batch, 1]
        ctx = DraftContext(
            buffer=s.buffer,
            lengths=s.lengths,
            key=draft_key,  # drafts key on (rollout id, position), never the loop step
            sampling=sampling,
            sampled=method == "rejection",
            rows=rows,
        )
        tree, draft_probs, draft_state = drafter.propose(s.draft_state, policy, ctx)
        fed = jnp.concatenate([root, tree.tokens], axis=1)  # [batch, N+1]
        positions = tree.positions(root_pos)
        positions = jnp.where(active[:, None], positions, -1)
        mask = tree.attention_mask()
        logits, captured, cache = policy.forward(fed, positions, s.cache, mask=mask, capture=capture)
        # Plain decoding is verification of an empty tree: one code path for both.
        verdict = verify(
            key, logits, tree, sampling, method=method, positions=s.lengths,
            draft_probs=draft_probs, rows=rows,
        )
        num_accepted, emitted, emitted_logp, path = (
            verdict.num_accepted, verdict.tokens, verdict.logprobs, verdict.path,
        )
        span = emitted.shape[1]  # D + 1
        offs = jnp.arange(span, dtype=jnp.int32)[None, :]
        n_emit = num_accepted + 1
        # Cut at the first stop token and at the row's token budget.
        is_stop = jnp.any(emitted[..., None] == stops[None, None, :], axis=-1) & (offs < n_emit[:, None])
        first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, span + 1)
        n_emit = jnp.minimum(n_emit, first_stop)
        n_emit = jnp.minimum(n_emit, budget_end - s.lengths)
        n_emit = jnp.where(active, n_emit, 0)
        hit_stop = (first_stop <= n_emit) & active
        new_lengths = s.lengths + n_emit
        done = s.done | hit_stop | (new_lengths >= budget_end)

        write_at = jnp.where(offs < n_emit[:, None], s.lengths[:, None] + offs, max_len)
        b_idx = jnp.arange(batch)[:, None]
        buffer = s.buffer.at[b_idx, write_at].set(emitted, mode="drop")
        logprobs = s.logprobs.at[b_idx, write_at].set(emitted_logp, mode="drop")

        kept = jnp.where((offs < (num_accepted + 1)[:, None]) & active[:, None], path, -1)
        cache = compact(cache, kept, num_fed=num_nodes + 1, fed_mask=active)
        kept_idx = jnp.maximum(kept, 0)
        # The drafter observes what was emitted: entries past a stop token or the budget
        # (the row is done) are padding, so its counters match `accepted_at`.
        draft_state = drafter.observe(draft_state, policy, Observation(
            fed_tokens=jnp.take_along_axis(fed, kept_idx, axis=1),
            next_tokens=emitted,
            positions=jnp.where((kept >= 0) & (offs < n_emit[:, None]), root_pos[:, None] + offs, -1),
            captured={
                layer: jnp.take_along_axis(h, kept_idx[..., None], axis=1)
                for layer, h in captured.items()
            },
        ))

        depth_ids = jnp.arange(max_depth, dtype=jnp.int32)[None, :]
        st = s.stats
        stats = RolloutStats(
            target_forwards=st.target_forwards + 1,
            draft_forwards=st.draft_forwards + draft_forwards_per_step,
            row_steps=st.row_steps + active.astype(jnp.int32),
            tokens_generated=st.tokens_generated + n_emit,
            # Drafts count as accepted only when emitted (not cut by a stop token or the budget).
            accepted_at=st.accepted_at
            + jnp.sum((depth_ids < jnp.minimum(num_accepted, n_emit - 1)[:, None]) & active[:, None], axis=0),
            proposed_at=st.proposed_at + jnp.sum(active) * jnp.ones((max_depth,), jnp.int32),
            wall_time_s=st.wall_time_s,
        )
        return _LoopState(buffer, logprobs, new_lengths, done, cache, draft_state, stats)

    final = jax.lax.while_loop(cond, body, state)
    gen_idx = prompt_lengths[:, None] + jnp.arange(max_new_tokens, dtype=jnp.int32)[None, :]
    n_gen = final.lengths - prompt_lengths
    valid = jnp.arange(max_new_tokens)[None, :] < n_gen[:, None]
    out_tokens = jnp.where(valid, jnp.take_along_axis(final.buffer, gen_idx, axis=1), pad_id)
    out_logp = jnp.where(valid, jnp.take_along_axis(final.logprobs, gen_idx, axis=1), 0.0)
    summary = getattr(drafter, "draft_stats", None)
    draft_stats = summary(final.draft_state) if summary is not None else {}
    return Rollouts(out_tokens, n_gen, out_logp, final.stats, draft_stats)
