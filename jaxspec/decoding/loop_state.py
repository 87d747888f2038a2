"""The rollout loop's data: its static spec, its per-call inputs and its state.

`LoopSpec` holds everything that sizes the compiled loop (hashable: a `jax.jit` static
argument); `LoopInputs` the call's arrays and pytrees (traced); `LoopState` what one loop
iteration carries to the next (gemma's `SamplingState`). The parts of the loop (`loop`,
`slots`, `schedule`, `phases`) are module-level functions of these three.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.decoding.adaptive import AdaptiveK, AdaptState
from jaxspec.decoding.protocols import Drafter, Observation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.stats import RolloutStats
from jaxspec.models import HybridCache, HybridPolicy, KVCache, Policy


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The static shape of one segment's loop (one compiled program per distinct spec)."""

    max_new_tokens: int
    max_len: int  # this segment's cache capacity
    method: str  # verify method (`jaxspec.decoding.METHODS`)
    pad_id: int
    slots: int  # rows decoded at once
    num_prompts: int
    width: int  # prompt width P
    need: int  # cache slots one verify writes past the root (num_nodes + 1, or max_k + 1)
    max_depth: int  # the deepest draft any iteration proposes (RolloutStats' depth counters)
    capture: tuple[int, ...]  # policy layers the drafter observes
    # adaptive k with a drafter whose `observe` runs a network: k = 0 iterations keep the
    # committed entries for a later observation instead (`schedule.AdaptiveDepth`)
    defer: bool = False
    window: int = 0  # adaptive k: deferred entries kept per row
    # the drafter starts a refilled row itself (`protocols.RefillsRows`)
    refill_hook: bool = False
    # per flattened drafter-state leaf: its row axis, None: shared by the rows (the default
    # refill's; None overall: not needed, or the drafter has a refill hook)
    row_axes: tuple | None = None
    # the classes of the dataclass nodes in the call's inputs (`node_classes`): jax (0.10)
    # compares two `register_dataclass` tree structures equal when only their classes differ
    # (an EAGLE-3 drafter and a subclass, SamplingConfig and its unfiltered form), so a
    # cached program could be taken for the other class's; here they are static and distinct
    classes: tuple = ()

    @property
    def refill(self) -> bool:
        """Whether finished slots take waiting prompts (continuous batching)."""
        return self.slots < self.num_prompts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopInputs:
    """The call's arguments as the loop reads them (traced: new values do not recompile)."""

    policy: Policy | HybridPolicy
    drafter: Drafter
    prompt_tokens: jax.Array  # [prompts, P] int32 right-padded
    prompt_lengths: jax.Array  # [prompts] int32
    sampling: SamplingConfig
    key: jax.Array  # the verifier's PRNG key
    stops: jax.Array  # [num_stops] int32 (-1: none)
    rows: jax.Array  # [prompts] int32 global rollout ids
    order: jax.Array  # [prompts] int32 permutation: prompts take slots in this order
    adaptive: AdaptiveK | None
    variants: dict | None  # adaptive k: {k: the drafter drafting k deep} (`check_adaptive`)
    force_k: jax.Array  # [] int32 index into adaptive.ks used at every iteration; -1: choose
    max_iterations: jax.Array  # [] int32 stop after this many iterations
    # [prompts, max_len] int32 the prompts as buffer rows (refills); set by `driver.run_segment`
    padded_prompts: jax.Array | None = None

    @property
    def draft_key(self) -> jax.Array:
        """The drafts' key: sampled drafts (rejection) never share the verifier's noise."""
        return jax.random.split(self.key)[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """What one iteration hands the next."""

    buffer: jax.Array  # [slots, max_len] prompt + generated tokens
    logprobs: jax.Array  # [slots, max_len] log-probs of generated tokens at their positions
    lengths: jax.Array  # [slots] committed tokens (the root is the last of them)
    done: jax.Array  # [slots] bool (finished, or empty: no prompt left to start)
    cache: KVCache | HybridCache  # the policy's (`policy_cache`)
    draft_state: Any
    stats: RolloutStats
    prompt_of: jax.Array  # [slots] int32 the prompt each slot holds (or last held)
    next_prompt: jax.Array  # [] int32 the place in `order` of the first prompt not started yet
    out_tokens: jax.Array  # [prompts, max_new_tokens] finished rollouts, in prompt order
    out_logprobs: jax.Array  # [prompts, max_new_tokens]
    out_lengths: jax.Array  # [prompts]
    adapt: AdaptState | None = None  # adaptive k: acceptance counts and the probe clock
    pending: Observation | None = None  # deferred entries [slots, window] not yet observed
    # prompts started during k = 0: [slots, P] prefill entries not yet observed
    pending_prompt: Observation | None = None
    # [slots] bool rows started during k = 0 whose drafter row is reset at the next flush
    # (a drafter with a refill hook resets it when the rollout starts)
    pending_reset: jax.Array | None = None
    # an MoE policy: [slots, max_len, L, K] int32 the experts each token was routed to when
    # it was fed (-1: not yet fed), and [prompts, max_new_tokens, L, K] those of the
    # finished rollouts (Rollouts.routes); None for a dense policy
    routes: jax.Array | None = None
    out_routes: jax.Array | None = None


def empty_observation(batch: int, n: int, captured: dict) -> Observation:
    """[batch, n] entries, all padding; captured {layer: [batch, M, H]} gives the layers' H
    and dtypes."""
    return Observation(
        fed_tokens=jnp.zeros((batch, n), jnp.int32),
        next_tokens=jnp.zeros((batch, n), jnp.int32),
        positions=jnp.full((batch, n), -1, jnp.int32),
        captured={layer: jnp.zeros((batch, n) + h.shape[2:], h.dtype) for layer, h in captured.items()},
    )


def node_classes(tree) -> tuple[type, ...]:
    """The classes of the dataclass instances in `tree` (depth first, through dataclass
    fields, lists, tuples and dicts; arrays and other leaves are not classes here)."""
    found, path = [], set()  # path: the dataclasses being visited (a cycle stops there)

    def visit(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if id(x) in path:
                return
            path.add(id(x))
            found.append(type(x))
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name, None))
            path.discard(id(x))
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(tree)
    return tuple(found)
