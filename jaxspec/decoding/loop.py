"""The rollout loop's step and stop condition, as functions of a static `LoopSpec`.

`start` prefills the first prompts; `step` runs one iteration: the drafter proposes a tree
(an empty one for plain decoding), the policy verifies it in one forward, `verify` picks the
emitted tokens, the accepted path's KV entries are compacted, and the drafter observes what
was kept (or, under adaptive k = 0, the entries wait: `schedule`); `running` says whether
another iteration runs in this segment. A row's "root" is its last committed token, whose
KV is not in the cache yet, at position `lengths - 1` of the token buffer.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec import parallel
from jaxspec.decoding.adaptive import AdaptState
from jaxspec.decoding.loop_state import (
    LoopInputs,
    LoopSpec,
    LoopState,
    empty_observation,
)
from jaxspec.decoding.protocols import (
    CouplesVerifierNoise,
    DraftContext,
    Finished,
    Observation,
)
from jaxspec.decoding.policy_cache import is_recurrent, keep_accepted, sharded, verify_forward
from jaxspec.decoding.slots import harvest, refill
from jaxspec.decoding.stats import RolloutStats
from jaxspec.decoding.verify import replay_noise, verify


def running(spec: LoopSpec, inp: LoopInputs, s: LoopState):
    """[] bool: a live row remains, the iteration cap is not reached, and no live row could
    outgrow this segment's capacity at the next verify."""
    return (jnp.any(~s.done) & (s.stats.target_forwards < inp.max_iterations)
            & jnp.all(s.done | (s.lengths + spec.need <= spec.max_len)))


def where_now(spec: LoopSpec, inp: LoopInputs, s: LoopState, plain_index: int | None):
    """[3] bool, replicated (a host reads it whatever the mesh): the loop has ended (every row
    done, or the iteration cap); a live row outgrew this capacity (`running` failed for no
    other reason); k = 0 goes on (adaptive k, index `plain_index` of ks: before the next
    probe, or k = 0 forced), so a plain phase cut short by the capacity continues."""
    ended = ~jnp.any(~s.done) | (s.stats.target_forwards >= inp.max_iterations)
    plain_goes_on = ((s.stats.target_forwards < s.adapt.next_probe) | (inp.force_k == plain_index)
                     if plain_index is not None else jnp.asarray(False))
    return jnp.stack([ended, ~ended & ~running(spec, inp, s), plain_goes_on])


def start(spec: LoopSpec, inp: LoopInputs) -> LoopState:
    """The state before the first iteration: the first `slots` prompts (in `order`) in the
    buffer, every prompt token but the last (the first root) prefilled and observed."""
    batch, width, policy, drafter = spec.slots, spec.width, inp.policy, inp.drafter
    first = inp.order[:batch]
    first_tokens, first_lengths = inp.prompt_tokens[first], inp.prompt_lengths[first]
    buffer = jnp.full((batch, spec.max_len), spec.pad_id, jnp.int32).at[:, :width].set(first_tokens)
    buffer = parallel.constrain(buffer, ("batch", "length"))  # no-ops outside jax.set_mesh
    positions = jnp.arange(width, dtype=jnp.int32)[None, :]
    positions = jnp.where(positions < first_lengths[:, None] - 1, positions, -1)
    cache = sharded(policy.init_cache(batch, spec.max_len))
    _, captured, cache = policy.forward(first_tokens, positions, cache, capture=spec.capture)
    draft_state = drafter.observe(drafter.init_state(policy, batch, spec.max_len), policy, Observation(
        fed_tokens=first_tokens, next_tokens=jnp.roll(first_tokens, -1, axis=1),
        positions=positions, captured=captured))
    adaptive = inp.adaptive
    deferred = {}
    if spec.defer:
        deferred = dict(
            pending=empty_observation(batch, spec.window, captured),
            pending_prompt=empty_observation(batch, width, captured) if spec.refill else None,
            pending_reset=jnp.zeros((batch,), bool) if spec.refill and not spec.refill_hook else None)
    out = lambda shape, fill, dtype, axes: parallel.constrain(jnp.full(shape, fill, dtype), axes)  # noqa: E731
    n, new = spec.num_prompts, spec.max_new_tokens
    return LoopState(
        buffer=buffer, logprobs=jnp.zeros((batch, spec.max_len), jnp.float32),
        lengths=first_lengths.astype(jnp.int32), done=jnp.zeros((batch,), bool),
        cache=cache, draft_state=draft_state,
        stats=RolloutStats.zeros(n, spec.max_depth, None if adaptive is None else adaptive.max_k),
        prompt_of=first, next_prompt=jnp.asarray(batch, jnp.int32),
        out_tokens=out((n, new), spec.pad_id, jnp.int32, ("batch", "length")),
        out_logprobs=out((n, new), 0.0, jnp.float32, ("batch", "length")),
        out_lengths=out((n,), 0, jnp.int32, ("batch",)),
        adapt=None if adaptive is None else AdaptState.zeros(adaptive), **deferred,
        **_route_buffers(policy, batch, spec),
    )


def _route_buffers(policy, batch: int, spec: LoopSpec) -> dict:
    """An MoE policy's routing buffers (LoopState.routes / out_routes), all -1; {} if dense
    (or hybrid: its forward reports no routing)."""
    cfg = policy.config
    if not cfg.is_moe or is_recurrent(policy):
        return {}
    tail = (cfg.num_layers, cfg.num_experts_per_tok)
    return dict(routes=jnp.full((batch, spec.max_len) + tail, -1, jnp.int32),
                out_routes=jnp.full((spec.num_prompts, spec.max_new_tokens) + tail, -1, jnp.int32))


def _routed(routes, routing, kept, n_emit, root_pos, max_len: int):
    """`routes` [slots, S, L, K] with the kept fed entries' experts written at their positions:
    kept[:, j] (fed index, -1 none) sits at root_pos + j; only j < n_emit (the emitted ones).
    routing["experts"]: [L, slots, N+1, K] of the forward that fed them."""
    offs = jnp.arange(kept.shape[1], dtype=jnp.int32)[None, :]
    experts = jnp.transpose(routing["experts"], (1, 2, 0, 3))  # [slots, N+1, L, K]
    picked = jnp.take_along_axis(experts, jnp.maximum(kept, 0)[:, :, None, None], axis=1)
    at = jnp.where((kept >= 0) & (offs < n_emit[:, None]), root_pos[:, None] + offs, max_len)
    rows = jnp.arange(kept.shape[0])[:, None]
    return routes.at[rows, at].set(picked, mode="drop")


def _context(spec: LoopSpec, inp: LoopInputs, s: LoopState, d, slot_rows, active):
    """The drafter's view of the iteration, with the verifier's noise when `d` draws with it
    (coupled chains under replay): drawn once for the drafter and verify; otherwise verify
    draws it after the forward, so no [B, D+1, V] array is held across the forward."""
    takes_noise = (spec.method == "replay" and isinstance(d, CouplesVerifierNoise)
                   and d.uses_verifier_noise)
    noise = (replay_noise(inp.key, s.lengths, d.max_depth, inp.policy.config.vocab_size, slot_rows)
             if takes_noise else None)
    return DraftContext(
        buffer=s.buffer, lengths=s.lengths,
        key=inp.draft_key,  # drafts key on (rollout id, position), never the loop step
        sampling=inp.sampling, sampled=spec.method == "rejection", rows=slot_rows,
        sequences=s.prompt_of, verifier_noise=noise,
        finished=Finished(inp.prompt_tokens, inp.prompt_lengths, s.out_tokens, s.out_lengths)
        if spec.refill else None,
        live=active,
    )


def _emitted(spec: LoopSpec, inp: LoopInputs, s: LoopState, verdict, active):
    """-> (n_emit [slots] tokens kept: cut at the first stop token and the row's budget, done
    [slots] after this iteration)."""
    span = verdict.tokens.shape[1]  # D + 1
    offs = jnp.arange(span, dtype=jnp.int32)[None, :]
    n_emit = verdict.num_accepted + 1
    is_stop = jnp.any(verdict.tokens[..., None] == inp.stops[None, None, :], axis=-1) & (offs < n_emit[:, None])
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, span + 1)
    budget_end = inp.prompt_lengths[s.prompt_of] + spec.max_new_tokens  # [slots] exclusive end
    n_emit = jnp.minimum(jnp.minimum(n_emit, first_stop), budget_end - s.lengths)
    n_emit = jnp.where(active, n_emit, 0)
    hit_stop = (first_stop <= n_emit) & active
    return n_emit, s.done | hit_stop | (s.lengths + n_emit >= budget_end)


def _observation(fed, captured, verdict, kept, n_emit, root_pos) -> Observation:
    """What the drafter observes: the kept path's entries; those past a stop token or the
    budget are padding, so its counters match `accepted_at`."""
    offs = jnp.arange(verdict.tokens.shape[1], dtype=jnp.int32)[None, :]
    kept_idx = jnp.maximum(kept, 0)
    return Observation(
        fed_tokens=jnp.take_along_axis(fed, kept_idx, axis=1),
        next_tokens=verdict.tokens,
        positions=jnp.where((kept >= 0) & (offs < n_emit[:, None]), root_pos[:, None] + offs, -1),
        captured={layer: jnp.take_along_axis(h, kept_idx[..., None], axis=1)
                  for layer, h in captured.items()},
    )


def _counted(spec: LoopSpec, s: LoopState, depth, num_accepted, n_emit, active, forwards):
    """The counters after one iteration that drafted `depth.drafted(spec)` depths."""
    st = s.stats
    depth_ids = jnp.arange(spec.max_depth, dtype=jnp.int32)[None, :]
    drafted = depth.drafted(spec)
    # Drafts count as accepted only when emitted (not cut by a stop token or the budget).
    accepted = jnp.sum((depth_ids < jnp.minimum(num_accepted, n_emit - 1)[:, None]) & active[:, None], axis=0)
    proposed = jnp.sum(active) * (depth_ids[0] < drafted).astype(jnp.int32)
    return dataclasses.replace(
        st, target_forwards=st.target_forwards + 1, draft_forwards=st.draft_forwards + forwards,
        row_steps=st.row_steps.at[s.prompt_of].add(active.astype(jnp.int32)),
        tokens_generated=st.tokens_generated.at[s.prompt_of].add(n_emit),
        accepted_at=st.accepted_at if drafted == 0 else st.accepted_at + accepted,
        proposed_at=st.proposed_at if drafted == 0 else st.proposed_at + proposed,
        slot_steps=st.slot_steps + spec.slots,
    )


def step(spec: LoopSpec, inp: LoopInputs, s: LoopState, depth) -> LoopState:
    """One iteration at draft depth `depth` (`schedule.FullDepth` or `AdaptiveDepth`)."""
    policy, d = inp.policy, depth.drafter(inp)
    active = ~s.done
    slot_rows = inp.rows[s.prompt_of]  # [slots] global rollout ids
    root_pos = s.lengths - 1
    root = jnp.take_along_axis(s.buffer, root_pos[:, None], axis=1)  # [slots, 1]
    iteration = s.stats.target_forwards
    ctx = _context(spec, inp, s, d, slot_rows, active)
    tree, draft_probs, draft_state = d.propose(s.draft_state, policy, ctx)
    fed = jnp.concatenate([root, tree.tokens], axis=1)  # [slots, N+1]
    positions = jnp.where(active[:, None], tree.positions(root_pos), -1)
    logits, captured, cache, routing, steps = verify_forward(
        policy, fed, positions, s.cache, tree, capture=spec.capture, routing=s.routes is not None)
    # Plain decoding is verification of an empty tree: one code path for both.
    verdict = verify(inp.key, logits, tree, inp.sampling, method=spec.method, positions=s.lengths,
                     draft_probs=draft_probs, rows=slot_rows, noise=ctx.verifier_noise)
    n_emit, done = _emitted(spec, inp, s, verdict, active)
    offs = jnp.arange(verdict.tokens.shape[1], dtype=jnp.int32)[None, :]
    write_at = jnp.where(offs < n_emit[:, None], s.lengths[:, None] + offs, spec.max_len)
    b_idx = jnp.arange(spec.slots)[:, None]
    kept = jnp.where((offs < (verdict.num_accepted + 1)[:, None]) & active[:, None], verdict.path, -1)
    cache = keep_accepted(cache, steps, kept, num_fed=d.num_nodes + 1, fed_mask=active,
                          prefix=tree.is_chain)
    obs = _observation(fed, captured, verdict, kept, n_emit, root_pos)
    draft_state, pending, observed = depth.absorb(spec, inp, s, draft_state, obs)
    stats = _counted(spec, s, depth, verdict.num_accepted, n_emit, active,
                     d.forwards_per_propose + observed)
    out = dataclasses.replace(
        s, buffer=s.buffer.at[b_idx, write_at].set(verdict.tokens, mode="drop"),
        logprobs=s.logprobs.at[b_idx, write_at].set(verdict.logprobs, mode="drop"),
        lengths=s.lengths + n_emit, done=done, cache=cache, draft_state=draft_state,
        stats=stats, pending=pending,
        routes=None if s.routes is None else _routed(s.routes, routing, kept, n_emit,
                                                      root_pos, spec.max_len))
    out = depth.after(inp, out, verdict.num_accepted, active, iteration)
    if spec.refill:
        out = refill(spec, inp, harvest(spec, inp, out, done & ~s.done), **depth.refill_options(spec))
    return out
