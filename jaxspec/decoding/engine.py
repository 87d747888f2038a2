"""One generation engine for plain and speculative rollouts: `generate`.

`generate` checks every argument on the host (`arguments`), reads the drafter's declared
capabilities once (`protocols`), and hands the loop to the host driver (`driver`), which
runs it in segments of compiled programs: the loop step and stop condition (`loop`), slots
(`slots`), the draft depth of each iteration (`schedule`, `phases`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxspec.decoding import arguments as args
from jaxspec.decoding.adaptive import AdaptiveK
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.drafters import NoDrafter
from jaxspec.decoding.driver import capacity_tiers, drive, growth_axes
from jaxspec.decoding.loop_state import LoopInputs, LoopSpec, node_classes
from jaxspec.decoding.policy_cache import with_verify_buffer
from jaxspec.decoding.protocols import ChecksPrompts, Drafter, HasStateAxes, RefillsRows
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.slots import row_axes
from jaxspec.decoding.stats import Rollouts, RolloutStats
from jaxspec.decoding.unstack import decoding_policy
from jaxspec.models import Policy

__all__ = ["Rollouts", "RolloutStats", "decoding_policy", "generate", "pad_prompts"]


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
    max_iterations: int | None = None,
) -> Rollouts:
    """Sample continuations of `prompts` from `policy`, speculatively when `drafter` is set.

    With `method="replay"` (the default) and the same key, the tokens equal those of plain
    decoding (`drafter=None`) token for token, up to floating-point differences between a
    one-token and a multi-token forward (none with `ModelConfig.batch_invariant`: then
    tokens and log-probs are equal bit for bit); every method is lossless in distribution
    (`greedy` only at temperature 0). Every argument is checked on the host before anything
    compiles; a SamplingConfig holding traced values cannot be.

    Args:
      policy: the policy sampled from: a `Policy`, or a `HybridPolicy` (Gated DeltaNet
        layers: chain drafts only, its recurrent states committed after each verify's
        accepted drafts; `policy_cache`).
      prompts: token-id lists, or a (tokens [B, P], lengths [B]) pair.
      drafter: proposes the drafts (None: plain decoding).
      sampling: temperature, top-k, top-p (None: temperature 1).
      max_new_tokens: tokens generated per prompt at most.
      key: the PRNG key; every draw is keyed by (key, rollout id, position).
      stop_tokens: a row ends after emitting one of these.
      method: "replay", "rejection" or "greedy" (`jaxspec.decoding.METHODS`).
      rows: global rollout ids (None: 0..B-1).
      pad_id: fills the outputs past each row's length.
      slots: rows decoded at once (continuous batching). None, or at least the number of
        prompts: one slot per prompt. Fewer: when a row finishes, the next waiting prompt
        is prefilled into its slot inside the jitted loop; results come back in prompt
        order, and no token depends on the slot or the start step.
      adaptive: choose the draft length k (0 = plain decoding) before every iteration from
        the measured costs and the acceptance (`jaxspec.decoding.adaptive`; build it with
        `measure_costs` on the same arguments). The drafter needs `with_k`
        (`protocols.AdaptiveLength`); method "replay" or "greedy" (one k for the batch:
        under "rejection" a row's tokens would depend on the rows beside it).
      grow_cache: start with a small KV cache and move to a larger one (doubling, up to the
        full length) only when a live row needs it (each capacity compiles its own
        program). None: on CPU only; False: one full-length cache. With the reference
        attention the tokens do not depend on it; GPU kernels that plan their reduction by
        the capacity (pallas, triton) may differ in the last bits.
      order: a permutation of the prompt indices, the order in which prompts take slots
        (e.g. one rollout per group first: `jaxspec.rl.rollouts.leaders_first`); it
        changes no token.
      max_iterations: stop after this many loop iterations (None: run to the end; traced,
        so new values do not recompile).

    Returns:
      Rollouts: tokens [B, max_new_tokens], lengths [B], log-probs [B, max_new_tokens],
      the call's counters, and the drafter's own (`protocols.ReportsStats`).
    """
    checked = _checked(policy, prompts, drafter, sampling, max_new_tokens, key, stop_tokens,
                       method, rows, pad_id, slots, adaptive, order, max_iterations)
    inp, spec, nodes, total = checked
    if grow_cache is not None and not isinstance(grow_cache, bool):
        raise ValueError(f"grow_cache must be True, False or None (auto: CPU only); got "
                         f"{args.describe(grow_cache)}")
    tiers = capacity_tiers(inp.policy, inp.drafter, spec.width, nodes, total, grow_cache)
    start = time.perf_counter()
    out = drive(inp, spec, tiers, growth_axes(inp.policy, inp.drafter))
    jax.block_until_ready(out)
    wall = jnp.asarray(time.perf_counter() - start, jnp.float32)
    return dataclasses.replace(out, stats=dataclasses.replace(out.stats, wall_time_s=wall))


def _checked(policy, prompts, drafter, sampling, max_new_tokens, key, stop_tokens, method,
             rows, pad_id, slots, adaptive, order, max_iterations):
    """Every argument checked on the host -> (LoopInputs, LoopSpec at the full length, the
    draft headroom in nodes, the full length)."""
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
    args.check_prompt_ids(tokens, vocab)
    # Headroom: a verify step writes num_nodes + 1 cache slots past the root (k+1 for chains).
    nodes = drafter.num_nodes
    if isinstance(adaptive, AdaptiveK):
        nodes = max(nodes, adaptive.max_k)
    total = args.check_length(width, max_new_tokens, nodes, policy.config.max_position_embeddings)
    variants = args.check_adaptive(adaptive, drafter, policy, method, total)
    rows = args.check_rows(rows, batch)
    slots = args.check_slots(slots, batch)
    order = args.check_order(order, batch)
    iteration_cap = 2**31 - 1 if max_iterations is None else args.check_positive_int(
        "max_iterations", max_iterations, low=0)
    if isinstance(drafter, ChecksPrompts):  # drafters built for one call's prompts
        drafter.check_prompts(batch)
    hook = isinstance(drafter, RefillsRows)
    refill_axes = None
    if slots < batch and not hook:
        if not isinstance(drafter, HasStateAxes):
            raise ValueError(f"slots={slots} (< {batch} prompts) refills rows: "
                             f"{type(drafter).__name__} must declare its state's row axes "
                             f"(state_axes) or start rows itself (refill_state)")
        refill_axes = row_axes(drafter, policy)
    defer = adaptive is not None and drafter.forwards_per_observe > 0
    spec = LoopSpec(
        max_new_tokens=max_new_tokens, max_len=total, method=method, pad_id=pad_id, slots=slots,
        num_prompts=batch, width=width, need=nodes + 1,
        max_depth=adaptive.max_k if adaptive is not None else drafter.max_depth,
        capture=tuple(drafter.capture_layers), defer=defer,
        window=adaptive.window if adaptive is not None else 0, refill_hook=hook, row_axes=refill_axes)
    inp = LoopInputs(
        policy=with_verify_buffer(decoding_policy(policy), nodes), drafter=drafter,
        prompt_tokens=jnp.asarray(tokens),
        prompt_lengths=jnp.asarray(prompt_lengths), sampling=sampling, key=key,
        stops=jnp.asarray(stops or [-1], jnp.int32), rows=jnp.asarray(rows, jnp.int32),
        order=jnp.asarray(order, jnp.int32), adaptive=adaptive, variants=variants,
        force_k=jnp.asarray(-1 if adaptive is None else adaptive.force, jnp.int32),
        max_iterations=jnp.asarray(iteration_cap, jnp.int32))
    return inp, dataclasses.replace(spec, classes=node_classes(inp)), nodes, total
