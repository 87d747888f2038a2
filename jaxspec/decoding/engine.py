"""One generation engine for plain and speculative rollouts.

`generate` pads the prompts, checks every argument on the host, and runs one jitted
`lax.while_loop`. Each iteration the drafter proposes a tree (an empty one for plain
decoding), the policy verifies it in a single forward, `verify` picks the emitted tokens,
the accepted path's KV entries are compacted, and the drafter observes what was kept.

Sequence bookkeeping: a row's "root" is its last committed token, whose KV is not in the
cache yet; it sits at position `lengths - 1` of the token buffer. The token emitted from
the root's distribution goes to position `lengths`.

Continuous batching (`slots` < prompts): the loop's rows are slots. At the end of each
iteration the rollouts that finished are copied out (in prompt order), and each free slot
takes the next waiting prompt: its buffer row, a one-row prefill forward written into the
slot's cache rows, and the drafter's row reset and prompt observation.

The host runs the loop in segments, each a call of one compiled program continuing the
state of the one before: a larger cache when a live row outgrows the current one
(`_capacity_tiers`), and, under adaptive k, alternating draft and plain phases
(`jaxspec.decoding.adaptive`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import parallel
from jaxspec.decoding import arguments as args
from jaxspec.decoding.adaptive import AdaptiveK, AdaptState, choose_k
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.drafters import NoDrafter
from jaxspec.decoding.protocols import DraftContext, Drafter, Finished, Observation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.verify import replay_noise, verify
from jaxspec.models import KVCache, Policy, compact


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
    # [] loop iterations x slots: every slot pays each iteration, live or not (None: a
    # RolloutStats built before slots existed; then target_forwards x batch, a static batch)
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
    slots: int | None = None,
    adaptive: AdaptiveK | None = None,
    grow_cache: bool | None = None,
    order=None,  # [B] permutation: the order in which prompts take slots (None: prompt order)
) -> Rollouts:
    """Sample continuations of `prompts` from `policy`, speculatively when `drafter` is set.

    With `method="replay"` (the default) and the same key, the tokens equal those of plain
    decoding (`drafter=None`) token for token, up to floating-point differences between a
    one-token and a multi-token forward (none with `ModelConfig.batch_invariant`: then
    tokens and log-probs are equal bit for bit); every method is lossless in distribution
    (`greedy` only at temperature 0). Every argument is checked on the host before anything
    compiles; a SamplingConfig holding traced values cannot be.

    `slots`: rows decoded at once (continuous batching). None, or at least the number of
    prompts: one slot per prompt (a static batch). Fewer: the first `slots` prompts start,
    and when a row finishes the next waiting prompt is prefilled into its slot inside the
    jitted loop. Results come back in prompt order, and since every draw is keyed by
    (key, rollout id, position), a rollout's tokens do not depend on its slot or start step.
    `order` (a permutation of the prompt indices) sets which prompts start first; e.g.
    one rollout per group first, so that its siblings, started later, can draft from it
    (`jaxspec.rl.rollouts.leaders_first`). It changes no token.

    `adaptive`: choose the draft length k (0 = plain decoding) before every iteration from
    the measured costs and acceptance (`jaxspec.decoding.adaptive`; build it with
    `measure_costs` on the same arguments). The drafter needs `with_k` (chain drafters).

    `grow_cache`: start with a small KV cache and move to a larger one (doubling, up to the
    full prompt + max_new_tokens) only when a live row needs it, so rows that stop early
    never pay for the capacity they did not use (each capacity compiles its own program).
    None (default): on CPU, where allocating and touching a large cache costs as much as
    the steps; False: one cache of the full length from the start (GPUs: one compile).
    With the reference attention the tokens do not depend on it; GPU kernels that plan
    their reduction by the capacity (pallas, triton) may differ in the last bits.
    """
    return _generate(policy, prompts, drafter=drafter, sampling=sampling,
                     max_new_tokens=max_new_tokens, key=key, stop_tokens=stop_tokens,
                     method=method, rows=rows, pad_id=pad_id, slots=slots, adaptive=adaptive,
                     grow_cache=grow_cache, order=order)


def _generate(
    policy, prompts, *, drafter=None, sampling=None, max_new_tokens, key, stop_tokens=(),
    method="replay", rows=None, pad_id=0, slots=None, adaptive=None, force_k: int = -1,
    max_iterations: int | None = None, grow_cache: bool | None = None, order=None,
) -> Rollouts:
    """`generate`, plus what `adaptive.measure_costs` needs: `force_k` (an index into
    adaptive.ks used at every iteration; -1: choose) and `max_iterations` (stop the loop
    after that many; None: run to the end). Both are traced: no recompile for new values."""
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
    nodes = drafter.num_nodes
    if adaptive is not None and isinstance(adaptive, AdaptiveK):
        nodes = max(nodes, adaptive.max_k)
    max_len = width + max_new_tokens + nodes + 1
    limit = policy.config.max_position_embeddings
    if max_len > limit:
        raise ValueError(
            f"prompt length {width} + max_new_tokens {max_new_tokens} + draft headroom "
            f"{nodes + 1} = {max_len} exceeds the policy's max_position_embeddings {limit}"
        )
    args.check_adaptive(adaptive, drafter, policy, method, max_len)
    rows = args.check_rows(rows, batch)
    slots = _check_slots(slots, batch)
    order = args.check_order(order, batch)
    check_prompts = getattr(drafter, "check_prompts", None)  # drafters built for a batch
    if check_prompts is not None:
        check_prompts(batch)

    policy = decoding_policy(policy)
    tiers = _capacity_tiers(policy, drafter, slots, width, nodes, max_len, grow_cache)
    iteration_cap = 2**31 - 1 if max_iterations is None else max_iterations
    start = time.perf_counter()
    inputs = (policy, drafter, jnp.asarray(tokens), jnp.asarray(prompt_lengths), sampling, key,
              jnp.asarray(stops or [-1], jnp.int32), jnp.asarray(rows, jnp.int32),
              jnp.asarray(order, jnp.int32), adaptive, jnp.asarray(force_k, jnp.int32),
              jnp.asarray(iteration_cap, jnp.int32))
    # Adaptive k with k = 0 among its choices alternates a draft phase and a plain phase
    # (one program each, both continuing the state) until the loop ends.
    phased = adaptive is not None and 0 in adaptive.ks
    state = None
    in_plain = False  # a plain phase that a capacity growth cut short goes on after it
    for i, capacity in enumerate(tiers):
        static = dict(max_new_tokens=max_new_tokens, max_len=capacity, method=method, pad_id=pad_id,
                      slots=slots)
        if state is not None:  # a live row outgrew the last capacity: continue in a larger one
            state = _grow_state(state, policy, drafter, capacity=capacity, pad_id=pad_id)
        if not phased:
            state, out, now = _generate_jit(*inputs, state, **static)
            ended = bool(np.asarray(now)[0]) if i + 1 < len(tiers) else True
        else:
            if state is None:  # a call that starts at k = 0 starts in the plain phase
                state, _, now = _generate_jit(*inputs, None, phase="init", **static)
                in_plain = bool(np.asarray(now)[2])
            while True:
                if not in_plain:
                    state, out, now = _generate_jit(*inputs, state, phase="draft", **static)
                    ended, outgrew, _ = (bool(x) for x in np.asarray(now))
                    if ended or outgrew:
                        break
                state, out, now = _generate_jit(*inputs, state, phase="plain", **static)
                ended, outgrew, in_plain = (bool(x) for x in np.asarray(now))
                if ended or outgrew:
                    break
                in_plain = False
        if ended:
            break
    jax.block_until_ready(out)
    wall = jnp.asarray(time.perf_counter() - start, jnp.float32)
    return dataclasses.replace(out, stats=dataclasses.replace(out.stats, wall_time_s=wall))


# The last params unstacked for decoding: (weak references to their leaves, the per-layer
# copies). One entry: a new params object replaces it, and it goes when its params die. The
# lock makes the check-and-replace one step for threads generating with different params.
_UNSTACKED: list = []
_UNSTACKED_LOCK = threading.RLock()  # reentrant: a finalizer may run inside the lock


@jax.jit
def _unstack(policy: Policy) -> tuple:
    return policy.unstack_layers().layer_params


def _forget(entry) -> None:  # a cached entry's params were freed: free its copies too
    with _UNSTACKED_LOCK:
        if _UNSTACKED and _UNSTACKED[0] is entry:
            _UNSTACKED.clear()


def decoding_policy(policy: Policy) -> Policy:
    """`policy` as `generate` decodes with it: with its per-layer weight copies attached
    when decoding unrolls the layers (CPU, `Policy.decodes_unrolled`), made once per params
    object and reused by every later call with the same arrays. Made inside each call's
    program instead, the copies cost every call one pass over the weights into fresh
    memory: ~125 ms at 75M parameters on a 2-core CPU, 30% of a one-rollout call
    (docs/BENCHMARKS.md). The cache holds one params object's copies (one more copy of the
    layer weights in host memory) and only weak references to the params: the copies go
    when the params do.

    Time a policy's forwards through it to measure what the engine pays: a bare policy's
    forward on CPU scans the stacked layers, which copies each layer's weights at every
    forward (c(1) of the 75M policy 11.2 ms bare, 9.1 ms through this)."""
    if policy.layer_params is not None or not policy.decodes_unrolled(0, 0):
        return policy
    leaves = jax.tree.leaves(policy.params)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):  # under a trace: nothing to keep
        return policy.unstack_layers()
    with _UNSTACKED_LOCK:
        entry = _UNSTACKED[0] if _UNSTACKED else None
        if entry is None or len(entry[0]) != len(leaves) or any(
                ref() is not x for ref, x in zip(entry[0], leaves)):
            _UNSTACKED.clear()  # the old copies go before the new ones are made
            entry = ([weakref.ref(x) for x in leaves], _unstack(policy))
            _UNSTACKED.append(entry)
            weakref.finalize(leaves[0], _forget, entry)
    return policy.replace(layer_params=entry[1])


_FIRST_CAPACITY = 64  # cache slots of the first segment when the cache grows


def _capacity_tiers(policy, drafter, batch: int, width: int, nodes: int, max_len: int,
                    grow_cache) -> list[int]:
    """The cache capacities generation runs through: [max_len], or, growing, the smallest
    power of two >= max(_FIRST_CAPACITY, 2 (width + nodes + 1)), doubled while the double
    still fits in max_len, then max_len (a max_len under twice the first: just [max_len])."""
    if grow_cache is None:
        grow_cache = jax.default_backend() == "cpu"
    elif not isinstance(grow_cache, bool):
        raise ValueError(f"grow_cache must be True, False or None (auto: CPU only); got "
                         f"{args.describe(grow_cache)}")
    first = max(_FIRST_CAPACITY, 1 << (2 * (width + nodes + 1) - 1).bit_length())
    if not grow_cache or 2 * first > max_len or _growth_axes(policy, drafter, batch, first) is None:
        return [max_len]
    tiers = []
    while 2 * first <= max_len:
        tiers.append(first)
        first *= 2
    return tiers + [max_len]


_GROWTH_AXES: dict = {}  # memo of _growth_axes (an eval_shape costs ~1 ms per call)


def _growth_axes(policy, drafter, batch: int, capacity: int):
    """Per leaf of (policy cache, drafter state): the axis that grows with the capacity, or
    None; None overall when some leaf grows along more than one axis (then no growing)."""
    leaves, treedef = jax.tree.flatten((policy, drafter))
    memo = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves),
            batch, capacity)
    if memo not in _GROWTH_AXES:
        _GROWTH_AXES[memo] = _find_growth_axes(policy, drafter, batch, capacity)
    return _GROWTH_AXES[memo]


def _find_growth_axes(policy, drafter, batch: int, capacity: int):
    return _varying_axes(lambda n: jax.eval_shape(
        lambda p, d: (p.init_cache(batch, n), d.init_state(p, batch, n)), policy, drafter), capacity)


def _varying_axes(make, n: int) -> list | None:
    """Per leaf of `make(size)` (shapes): the one axis that differs between sizes n and
    n + 1, or None (no axis); None overall when a leaf differs in more than one axis."""
    axes = []
    for a, b in zip(jax.tree.leaves(make(n)), jax.tree.leaves(make(n + 1))):
        diff = [i for i, (m, k) in enumerate(zip(a.shape, b.shape)) if m != k]
        if a.ndim != b.ndim or len(diff) > 1:
            return None
        axes.append(diff[0] if diff else None)
    return axes


@partial(jax.jit, static_argnames=("capacity", "pad_id"))  # (donating: no buffer has the new shape)
def _grow_state(state: _LoopState, policy, drafter, *, capacity: int, pad_id: int) -> _LoopState:
    """`state` moved into a cache of `capacity` slots: every capacity-sized leaf (the token
    buffer, log-probs, the policy's KV cache, the drafter's per-position state) copied into
    the front of a fresh one."""
    batch, old = state.buffer.shape
    fresh = (policy.init_cache(batch, capacity), drafter.init_state(policy, batch, capacity))
    axes = _growth_axes(policy, drafter, batch, old)
    leaves, treedef = jax.tree.flatten((state.cache, state.draft_state))
    grown = [
        x if ax is None else jax.lax.dynamic_update_slice(f, x.astype(f.dtype), (0,) * x.ndim)
        for x, f, ax in zip(leaves, jax.tree.leaves(fresh), axes)
    ]
    cache, draft_state = jax.tree.unflatten(treedef, grown)
    cache = KVCache(
        k=parallel.constrain(cache.k, parallel.KV_CACHE_AXES),
        v=parallel.constrain(cache.v, parallel.KV_CACHE_AXES),
        lengths=parallel.constrain(cache.lengths, ("batch",)),
    )
    pad = ((0, 0), (0, capacity - old))
    return dataclasses.replace(
        state,
        buffer=parallel.constrain(jnp.pad(state.buffer, pad, constant_values=pad_id), ("batch", "length")),
        logprobs=jnp.pad(state.logprobs, pad),
        cache=cache,
        draft_state=draft_state,
    )


def _check_slots(slots, batch: int) -> int:
    """`generate`'s slots as the static slot count in [1, batch]."""
    if slots is None:
        return batch
    if not isinstance(slots, (int, np.integer)) or isinstance(slots, (bool, np.bool_)) or slots < 1:
        raise ValueError(f"slots must be an int >= 1 (rows decoded at once) or None (one per "
                         f"prompt); got {args.describe(slots)}")
    return min(int(slots), batch)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LoopState:
    buffer: jax.Array  # [slots, max_len] prompt + generated tokens
    logprobs: jax.Array  # [slots, max_len] log-probs of generated tokens at their positions
    lengths: jax.Array  # [slots] committed tokens (the root is the last of them)
    done: jax.Array  # [slots] bool (finished, or empty: no prompt left to start)
    cache: KVCache
    draft_state: Any
    stats: RolloutStats
    prompt_of: jax.Array  # [slots] int32 the prompt each slot holds (or last held)
    next_prompt: jax.Array  # [] int32 the place in `order` of the first prompt not started yet
    out_tokens: jax.Array  # [prompts, max_new_tokens] finished rollouts, in prompt order
    out_logprobs: jax.Array  # [prompts, max_new_tokens]
    out_lengths: jax.Array  # [prompts]
    adapt: AdaptState | None = None  # adaptive k: acceptance counts and the probe clock
    pending: Observation | None = None  # adaptive k: entries [slots, window] not yet observed
    # adaptive k: prompts started during k = 0, [slots, width] prefill entries not yet observed
    pending_prompt: Observation | None = None
    # adaptive k: [slots] bool rows started during k = 0 whose drafter row is reset at the next
    # flush, not at the start (a drafter with its own `refill_state` is reset at the start)
    pending_reset: jax.Array | None = None


def _state_row_axes(drafter: Drafter, policy: Policy, batch: int, max_len: int) -> list:
    """Per leaf of the drafter's state: the axis that grows with `init_state`'s batch (a
    per-row leaf), or None (shared by all rows, e.g. a counter)."""
    axes = _varying_axes(lambda n: jax.eval_shape(
        lambda d, p: d.init_state(p, n, max_len), drafter, policy), batch)
    if axes is None:
        raise ValueError(
            f"{type(drafter).__name__}.init_state: a state leaf changes in more than one axis "
            f"between batch {batch} and {batch + 1}; per-row leaves need one batch axis "
            f"(or give the drafter a refill_state method)"
        )
    return axes


def _refill_draft_state(drafter, policy, state, axes, slot, obs: Observation, max_len: int):
    """The drafter's state with row `slot` started afresh on a new prompt (`obs`: its one-row
    prefill). A drafter's own `refill_state(state, policy, slot, obs, max_len)` wins; the
    default replaces the slot's rows of every per-row leaf by those of a fresh one-row state
    that has observed the prompt, and takes shared leaves (counters) from it."""
    hook = getattr(drafter, "refill_state", None)
    if hook is not None:
        return hook(state, policy, slot, obs, max_len)
    leaves, treedef = jax.tree.flatten(state)
    fresh = jax.tree.leaves(drafter.init_state(policy, 1, max_len))
    sub = [old if ax is None else new for old, new, ax in zip(leaves, fresh, axes)]
    sub = jax.tree.leaves(drafter.observe(treedef.unflatten(sub), policy, obs))
    out = [
        new if ax is None else jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), slot, ax)
        for old, new, ax in zip(leaves, sub, axes)
    ]
    return treedef.unflatten(out)


def _reset_draft_rows(drafter, policy, state, axes, mask, max_len: int):
    """The drafter's state with the rows where `mask` [slots] is True started afresh (every
    per-row leaf's rows from a fresh one-row state, as `_refill_draft_state` does without
    observing; shared leaves kept). One select per leaf, however many rows."""
    leaves, treedef = jax.tree.flatten(state)
    fresh = jax.tree.leaves(drafter.init_state(policy, 1, max_len))
    out = []
    for old, new, ax in zip(leaves, fresh, axes):
        if ax is None:
            out.append(old)
            continue
        shape = [1] * old.ndim
        shape[ax] = old.shape[ax]
        out.append(jnp.where(mask.reshape(shape), new.astype(old.dtype), old))
    return treedef.unflatten(out)


# state_in is donated: a later segment's loop takes over the grown state's buffers.
@partial(jax.jit, static_argnames=("max_new_tokens", "max_len", "method", "pad_id", "slots", "phase"),
         donate_argnames=("state_in",))
def _generate_jit(
    policy: Policy,
    drafter: Drafter,
    prompt_tokens,  # [prompts, width]
    prompt_lengths,  # [prompts]
    sampling,
    key,
    stops,  # [num_stops]
    rows,  # [prompts]
    order,  # [prompts] permutation: prompts take slots in this order
    adaptive,  # AdaptiveK | None
    force_k,  # [] int32 index into adaptive.ks used at every iteration; -1: choose
    max_iterations,  # [] int32 stop after this many iterations
    state_in,  # _LoopState | None: continue this (grown) state instead of starting
    *,
    max_new_tokens: int,
    max_len: int,  # this segment's cache capacity (`_capacity_tiers`)
    method: str,
    pad_id: int,
    slots: int,
    phase: str = "all",  # adaptive k: "init" (the prefill), "draft" (k > 0), "plain" (k = 0)
):
    num_prompts, width = prompt_tokens.shape
    batch = slots
    refill = slots < num_prompts
    capture = drafter.capture_layers
    # The drafter of each branch: {k: proposing chains of k} (adaptive), else the one drafter.
    variants = {k: (NoDrafter() if k == 0 else drafter.with_k(k)) for k in adaptive.ks} \
        if adaptive is not None else None
    max_depth = adaptive.max_k if adaptive is not None else drafter.max_depth
    # Adaptive k = 0 skips a network drafter's observation; the entries wait in a window, and
    # a prompt started during k = 0 waits whole (observed with the window before the next draft).
    defer = adaptive is not None and drafter.forwards_per_observe > 0
    # A row started during k = 0 has its drafter row reset at the next flush, with every other
    # such row in one select (`_reset_draft_rows`); a drafter with its own refill hook resets
    # it when the rollout starts.
    reset_at_start = getattr(drafter, "refill_state", None) is not None
    # (on CPU `_generate` has attached the per-layer weight copies: `decoding_policy`)

    if state_in is not None:  # a segment after the first: the grown state of the one before
        state = state_in
    else:
        first_tokens, first_lengths = prompt_tokens[order[:batch]], prompt_lengths[order[:batch]]
        buffer = jnp.full((batch, max_len), pad_id, jnp.int32).at[:, :width].set(first_tokens)
        # Rows over the batch mesh axes, KV heads over tensor (no-ops outside jax.set_mesh).
        buffer = parallel.constrain(buffer, ("batch", "length"))
        # Prefill every prompt token but the last: the last is the first root.
        pre_positions = jnp.arange(width, dtype=jnp.int32)[None, :]
        pre_positions = jnp.where(pre_positions < first_lengths[:, None] - 1, pre_positions, -1)
        cache = policy.init_cache(batch, max_len)
        cache = KVCache(
            k=parallel.constrain(cache.k, parallel.KV_CACHE_AXES),
            v=parallel.constrain(cache.v, parallel.KV_CACHE_AXES),
            lengths=parallel.constrain(cache.lengths, ("batch",)),
        )
        _, captured, cache = policy.forward(
            first_tokens, pre_positions, cache, capture=capture
        )
        draft_state = drafter.init_state(policy, batch, max_len)
        draft_state = drafter.observe(draft_state, policy, Observation(
            fed_tokens=first_tokens,
            next_tokens=jnp.roll(first_tokens, -1, axis=1),
            positions=pre_positions,
            captured=captured,
        ))
        pending = pending_prompt = pending_reset = None
        if defer:
            def empty(n):
                return Observation(
                    fed_tokens=jnp.zeros((batch, n), jnp.int32),
                    next_tokens=jnp.zeros((batch, n), jnp.int32),
                    positions=jnp.full((batch, n), -1, jnp.int32),
                    captured={layer: jnp.zeros((batch, n) + h.shape[2:], h.dtype) for layer, h in captured.items()},
                )
            pending = empty(adaptive.window)
            pending_prompt = empty(width) if refill else None
            pending_reset = jnp.zeros((batch,), bool) if refill and not reset_at_start else None
        state = _LoopState(
            buffer=buffer,
            logprobs=jnp.zeros((batch, max_len), jnp.float32),
            lengths=first_lengths.astype(jnp.int32),
            done=jnp.zeros((batch,), bool),
            cache=cache,
            draft_state=draft_state,
            stats=RolloutStats.zeros(num_prompts, max_depth,
                                     None if adaptive is None else adaptive.max_k),
            prompt_of=order[:batch],
            next_prompt=jnp.asarray(batch, jnp.int32),
            out_tokens=parallel.constrain(
                jnp.full((num_prompts, max_new_tokens), pad_id, jnp.int32), ("batch", "length")),
            out_logprobs=parallel.constrain(
                jnp.zeros((num_prompts, max_new_tokens), jnp.float32), ("batch", "length")),
            out_lengths=parallel.constrain(jnp.zeros((num_prompts,), jnp.int32), ("batch",)),
            adapt=None if adaptive is None else AdaptState.zeros(adaptive),
            pending=pending,
            pending_prompt=pending_prompt,
            pending_reset=pending_reset,
        )
    draft_key = jax.random.split(key)[1]  # sampled drafts (rejection) never share the verifier's noise
    gen_offsets = jnp.arange(max_new_tokens, dtype=jnp.int32)[None, :]

    def harvest(s: _LoopState, mask):  # mask [slots] bool: copy these slots' rollouts out
        plen = prompt_lengths[s.prompt_of]
        n_gen = s.lengths - plen
        valid = gen_offsets < n_gen[:, None]
        idx = plen[:, None] + gen_offsets
        tok = jnp.where(valid, jnp.take_along_axis(s.buffer, idx, axis=1), pad_id)
        logp = jnp.where(valid, jnp.take_along_axis(s.logprobs, idx, axis=1), 0.0)
        target = jnp.where(mask, s.prompt_of, num_prompts)  # out of range: dropped
        return dataclasses.replace(
            s,
            out_tokens=s.out_tokens.at[target].set(tok, mode="drop"),
            out_logprobs=s.out_logprobs.at[target].set(logp, mode="drop"),
            out_lengths=s.out_lengths.at[target].set(n_gen, mode="drop"),
        )

    need = max(drafter.num_nodes, 0 if adaptive is None else adaptive.max_k) + 1  # slots a verify writes

    def cond(s: _LoopState):  # a live row that could outgrow this capacity ends the segment
        return (jnp.any(~s.done) & (s.stats.target_forwards < max_iterations)
                & jnp.all(s.done | (s.lengths + need <= max_len)))

    def flush(draft_state, pending, pending_prompt, pending_reset):
        """Reset the drafter rows of rollouts started during k = 0 (if any) and observe the
        deferred entries (if any: their prompts, then the window) in one forward; -> (state,
        window, prompts, resets, forwards). The window is a ring: the entries go in position
        order, padding last."""
        both = pending if pending_prompt is None else jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], axis=1), pending_prompt, pending)
        has = jnp.any(both.positions >= 0)
        resets = jnp.asarray(False) if pending_reset is None else jnp.any(pending_reset)

        def reset(st):
            return _reset_draft_rows(drafter, policy, st, row_axes, pending_reset, max_len)

        def observe(st):
            return drafter.observe(st, policy, both.in_position_order(limit=max_len))

        def catch_up(st):  # the inner conditionals run only where there is something to do
            if pending_reset is not None:
                st = jax.lax.cond(resets, reset, lambda t: t, st)
            return jax.lax.cond(has, observe, lambda t: t, st)

        def cleared(obs):
            return None if obs is None else obs.cleared()

        draft_state = jax.lax.cond(has | resets, catch_up, lambda st: st, draft_state)
        return (draft_state, cleared(pending), cleared(pending_prompt),
                None if pending_reset is None else jnp.zeros_like(pending_reset),
                has.astype(jnp.int32) * drafter.forwards_per_observe)

    def step(s: _LoopState, d: Drafter, k: int | None, record: bool = True):
        """One iteration with drafter `d` (k: its chain length under adaptive, else None).
        Adaptive k = 0 runs only in a plain phase: it leaves the acceptance counts alone
        (k = 0 drafts nothing; the phase ends before the next probe), its iterations are
        counted when the phase ends, and `record` keeps its entries for the drafter's next
        observation (the phase's last `window` iterations)."""
        active = ~s.done
        slot_rows = rows[s.prompt_of]  # [slots] global rollout ids
        budget_end = prompt_lengths[s.prompt_of] + max_new_tokens  # [slots] exclusive end
        root_pos = s.lengths - 1
        root = jnp.take_along_axis(s.buffer, root_pos[:, None], axis=1)  # [batch, 1]
        # replay with a drafter that draws with it (coupled chains): the verifier's noise, drawn
        # once for the drafter and verify (otherwise verify draws it after the forward, so no
        # [B, D+1, V] array is held across the forward)
        noise = (replay_noise(key, s.lengths, d.max_depth, policy.config.vocab_size, slot_rows)
                 if method == "replay" and getattr(d, "uses_verifier_noise", False) else None)
        ctx = DraftContext(
            buffer=s.buffer,
            lengths=s.lengths,
            key=draft_key,  # drafts key on (rollout id, position), never the loop step
            sampling=sampling,
            sampled=method == "rejection",
            rows=slot_rows,
            sequences=s.prompt_of,
            verifier_noise=noise,
            finished=Finished(prompt_tokens, prompt_lengths, s.out_tokens, s.out_lengths)
            if refill else None,
            live=active,
        )
        draft_state, pending, pending_prompt, pending_reset, flushed = (
            s.draft_state, s.pending, s.pending_prompt, s.pending_reset, 0)
        st_iter = s.stats.target_forwards
        if defer and k:
            draft_state, pending, pending_prompt, pending_reset, flushed = flush(
                draft_state, pending, pending_prompt, pending_reset)
        tree, draft_probs, draft_state = d.propose(draft_state, policy, ctx)
        num_nodes = d.num_nodes
        fed = jnp.concatenate([root, tree.tokens], axis=1)  # [batch, N+1]
        positions = tree.positions(root_pos)
        positions = jnp.where(active[:, None], positions, -1)
        mask = tree.attention_mask()
        logits, captured, cache = policy.forward(fed, positions, s.cache, mask=mask, capture=capture)
        # Plain decoding is verification of an empty tree: one code path for both.
        verdict = verify(
            key, logits, tree, sampling, method=method, positions=s.lengths,
            draft_probs=draft_probs, rows=slot_rows, noise=noise,
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
        cache = compact(cache, kept, num_fed=num_nodes + 1, fed_mask=active, prefix=tree.is_chain)
        kept_idx = jnp.maximum(kept, 0)
        # The drafter observes what was emitted: entries past a stop token or the budget
        # (the row is done) are padding, so its counters match `accepted_at`.
        obs = Observation(
            fed_tokens=jnp.take_along_axis(fed, kept_idx, axis=1),
            next_tokens=emitted,
            positions=jnp.where((kept >= 0) & (offs < n_emit[:, None]), root_pos[:, None] + offs, -1),
            captured={
                layer: jnp.take_along_axis(h, kept_idx[..., None], axis=1)
                for layer, h in captured.items()
            },
        )
        if defer and k == 0:
            if record:  # one entry per row, written over the window's oldest
                at = st_iter % adaptive.window
                pending = jax.tree.map(lambda w, e: jax.lax.dynamic_update_slice_in_dim(w, e, at, axis=1),
                                       pending, obs)
        else:
            draft_state = drafter.observe(draft_state, policy, obs)

        depth_ids = jnp.arange(max_depth, dtype=jnp.int32)[None, :]
        drafted = max_depth if k is None else k  # depths proposed this iteration
        st = s.stats
        stats = RolloutStats(
            target_forwards=st.target_forwards + 1,
            draft_forwards=st.draft_forwards + flushed + d.forwards_per_propose
            + (0 if defer and k == 0 else drafter.forwards_per_observe),
            row_steps=st.row_steps.at[s.prompt_of].add(active.astype(jnp.int32)),
            tokens_generated=st.tokens_generated.at[s.prompt_of].add(n_emit),
            # Drafts count as accepted only when emitted (not cut by a stop token or the budget).
            accepted_at=st.accepted_at if drafted == 0 else st.accepted_at
            + jnp.sum((depth_ids < jnp.minimum(num_accepted, n_emit - 1)[:, None]) & active[:, None], axis=0),
            proposed_at=st.proposed_at if drafted == 0
            else st.proposed_at + jnp.sum(active) * (depth_ids[0] < drafted).astype(jnp.int32),
            wall_time_s=st.wall_time_s,
            slot_steps=st.slot_steps + batch,
            prefill_forwards=st.prefill_forwards,
            k_iterations=None if k is None else st.k_iterations if k == 0 else st.k_iterations.at[k].add(1),
        )
        out = dataclasses.replace(
            s, buffer=buffer, logprobs=logprobs, lengths=new_lengths, done=done, cache=cache,
            draft_state=draft_state, stats=stats, pending=pending, pending_prompt=pending_prompt,
            pending_reset=pending_reset,
            adapt=s.adapt if k is None or k == 0 else s.adapt.update(adaptive, k, num_accepted, active, st_iter),
        )
        if refill:
            # the window holds entries only in a plain phase's recording iterations (a draft
            # iteration has flushed it before its refill; k = 0 records nothing before those)
            out = _refill(harvest(out, done & ~s.done), defer_prompts=defer and k == 0,
                          window_live=defer and k == 0 and record)
        return out

    def pick(s):
        return jnp.where(force_k >= 0, force_k, choose_k(s.adapt, adaptive, s.stats.target_forwards))

    plain_index = adaptive.ks.index(0) if adaptive is not None and 0 in adaptive.ks else None

    def body(s: _LoopState):
        if adaptive is None:
            return step(s, drafter, None)
        # The draft phase: one inner loop per drafted k, each running while k is the choice.
        # Not a lax.switch: XLA copies the loop state (the KV cache) into a conditional's
        # branch every iteration, while loops update it in place. Every pass runs at least
        # one iteration. k = 0 ends the phase (`plain_phase`).
        for i, k in enumerate(adaptive.ks):
            if k:
                s = jax.lax.while_loop(lambda s, i=i: cond(s) & (pick(s) == i),
                                       partial(step, d=variants[k], k=k), s)
        return s

    def plain_phase(s: _LoopState) -> _LoopState:
        """Adaptive k = 0 until the next probe, in a loop of its own at the program's top
        level. Between probes the choice cannot change (k = 0 adds no counts), so this runs
        exactly the iterations the draft phase would have run at k = 0; nested in the draft
        phase's loop and keeping the per-iteration books, they cost 3% more than plain
        decoding on CPU. Entries are recorded for the drafter only in the last `window`
        iterations (the deferred observation keeps no more)."""
        forced = force_k == plain_index  # `measure_costs`: k = 0 to the iteration cap
        start = s.stats.target_forwards
        end = jnp.where(forced, max_iterations, s.adapt.next_probe)
        s = jax.lax.while_loop(
            lambda s: cond(s) & (forced | (s.stats.target_forwards < end - adaptive.window)),
            partial(step, d=variants[0], k=0, record=False), s)
        s = jax.lax.while_loop(lambda s: cond(s) & (s.stats.target_forwards < end),
                               partial(step, d=variants[0], k=0), s)
        st = s.stats
        return dataclasses.replace(s, stats=dataclasses.replace(
            st, k_iterations=st.k_iterations.at[0].add(st.target_forwards - start)))

    # the default refill and reset need each state leaf's row axis; a refill hook does not
    row_axes = _state_row_axes(drafter, policy, batch, max_len) if refill and not reset_at_start else None
    padded_prompts = jnp.full((num_prompts, max_len), pad_id, jnp.int32).at[:, :width].set(prompt_tokens)

    def _refill(s: _LoopState, defer_prompts: bool = False, window_live: bool = False) -> _LoopState:
        """Start the next waiting prompts in the free slots (in slot order): their buffer
        rows, then one prefill forward and drafter observation per started slot
        (defer_prompts, adaptive k = 0: the prompt's entries wait in `pending_prompt`, and
        the drafter's row is reset at the next draft's flush, so k = 0 pays no drafter work).
        window_live: the deferred window may hold entries of the rows started (their old
        rollouts'), which go. Nothing else is cleared per iteration: a deferred prompt's row
        of `pending_prompt` is rewritten whole by its prefill, and outside k = 0 the
        iteration's flush has emptied it."""
        free = s.done
        nth = s.next_prompt + jnp.cumsum(free, dtype=jnp.int32) - 1  # places in `order`
        start = free & (nth < num_prompts)
        n_start = jnp.sum(start, dtype=jnp.int32)
        prompt_of = jnp.where(start, order[jnp.minimum(nth, num_prompts - 1)], s.prompt_of)
        started_first = jnp.argsort(~start, stable=True).astype(jnp.int32)

        def prefill_one(i, carry):
            cache, draft_state, pending_prompt, pending_reset = carry
            slot = started_first[i]
            p = prompt_of[slot]
            toks = jax.lax.dynamic_slice_in_dim(prompt_tokens, p, 1, axis=0)  # [1, width]
            pos = jnp.arange(width, dtype=jnp.int32)[None, :]
            pos = jnp.where(pos < prompt_lengths[p] - 1, pos, -1)
            _, captured, sub = policy.forward(toks, pos, policy.init_cache(1, width), capture=capture)
            cache = dataclasses.replace(  # the slot's first `width` entries; the rest is stale
                cache,  # and never read (a row holds slots [0, lengths))
                k=jax.lax.dynamic_update_slice_in_dim(cache.k, sub.k, slot, axis=1),
                v=jax.lax.dynamic_update_slice_in_dim(cache.v, sub.v, slot, axis=1),
                lengths=cache.lengths.at[slot].set(sub.lengths[0]),
            )
            obs = Observation(fed_tokens=toks, next_tokens=jnp.roll(toks, -1, axis=1),
                              positions=pos, captured=captured)
            if not defer_prompts:
                draft_state = _refill_draft_state(drafter, policy, draft_state, row_axes, slot, obs,
                                                  max_len)
            elif reset_at_start:  # a hook's row starts empty now; its prompt waits for the flush
                draft_state = drafter.refill_state(draft_state, policy, slot, obs.cleared(), max_len)
            if defer_prompts:  # the slot's whole row: the old rollout's deferred prompt goes
                pending_prompt = jax.tree.map(
                    lambda w, e: jax.lax.dynamic_update_slice_in_dim(w, e.astype(w.dtype), slot, axis=0),
                    pending_prompt, obs)
                if pending_reset is not None:
                    pending_reset = pending_reset.at[slot].set(True)
            return cache, draft_state, pending_prompt, pending_reset

        cache, draft_state, pending_prompt, pending_reset = jax.lax.fori_loop(
            0, n_start, prefill_one, (s.cache, s.draft_state, s.pending_prompt, s.pending_reset))
        st = s.stats
        stats = dataclasses.replace(
            st,
            prefill_forwards=st.prefill_forwards + n_start,
            draft_forwards=st.draft_forwards + (0 if defer_prompts else n_start * drafter.forwards_per_observe),
        )
        pending = s.pending
        if window_live:  # a new rollout's row: the old one's deferred entries go
            pending = dataclasses.replace(
                pending, positions=jnp.where(start[:, None], -1, pending.positions))
        return dataclasses.replace(
            s,
            pending=pending,
            pending_prompt=pending_prompt,
            pending_reset=pending_reset,
            buffer=jnp.where(start[:, None], padded_prompts[prompt_of], s.buffer),
            logprobs=jnp.where(start[:, None], 0.0, s.logprobs),
            lengths=jnp.where(start, prompt_lengths[prompt_of], s.lengths),
            done=s.done & ~start,
            cache=cache,
            draft_state=draft_state,
            stats=stats,
            prompt_of=prompt_of,
            next_prompt=s.next_prompt + n_start,
        )

    def where_now(s: _LoopState):
        """[3] bool, replicated (a host reads it whatever the mesh): the loop has ended (every
        row done, or the iteration cap); a live row outgrew this capacity (`cond` failed for
        no other reason); k = 0 goes on (adaptive: before the next probe, or k = 0 forced),
        so a plain phase cut short by the capacity continues in the next one."""
        ended = ~jnp.any(~s.done) | (s.stats.target_forwards >= max_iterations)
        plain_goes_on = ((s.stats.target_forwards < s.adapt.next_probe) | (force_k == plain_index)
                         if plain_index is not None else jnp.asarray(False))
        return jnp.stack([ended, ~ended & ~cond(s), plain_goes_on])

    if phase == "init":  # k = 0 goes on only where it is also the choice (a carried clock
        now = where_now(state)  # can put the first probe later while a drafted k is best)
        if plain_index is not None:
            now = now.at[2].set(now[2] & (pick(state) == plain_index))
        return state, None, now
    if phase == "plain":
        final = plain_phase(state)
    elif plain_index is None:
        final = jax.lax.while_loop(cond, body, state)
    else:  # the draft phase ends where k = 0 is chosen
        final = jax.lax.while_loop(lambda s: cond(s) & (pick(s) != plain_index), body, state)
    # Every slot's rollout so far (a later segment harvests unfinished ones again).
    final = harvest(final, jnp.ones((batch,), bool))
    summary = getattr(drafter, "draft_stats", None)
    draft_stats = summary(final.draft_state) if summary is not None else {}
    # Rows over the batch mesh axes, as the inputs were (the harvest scatter loses it).
    return final, Rollouts(
        parallel.constrain(final.out_tokens, ("batch", "length")),
        parallel.constrain(final.out_lengths, ("batch",)),
        parallel.constrain(final.out_logprobs, ("batch", "length")),
        final.stats, draft_stats,
        None if final.adapt is None
        else jnp.maximum(final.adapt.next_probe - final.stats.target_forwards, 0),
    ), where_now(final)
