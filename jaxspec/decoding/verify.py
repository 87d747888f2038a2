"""Lossless verification of draft trees against the target's processed distribution.

Every rule walks from the root and emits, at depth d (absolute position positions + d), either
an accepted draft node or one final correction/bonus token, whose law given the emitted prefix
is the processed target distribution at that prefix.

- greedy: follow the child equal to the target argmax.
- replay: draw the token the plain sampler would draw at that slot (Gumbel-max with the
  position-keyed noise) and follow the child equal to it. Lossless for any draft; with the same
  key it emits exactly what `sample` emits at each position.
- rejection: recursive rejection over the children of the current node, in node order
  (Leviathan/Chen for a chain): accept child x with probability min(1, p(x)/q(x)); on rejection
  p <- norm(max(p - q, 0)) and the next sibling is tried; after the last sibling sample p.
  q is the distribution the child was drawn from given its prefix and its earlier siblings
  (for siblings drawn without replacement: the renormalised remainder). Without draft_probs,
  every draft is taken as a point mass: accept x with probability p(x), else zero p(x) and
  renormalise. That is exact for deterministic drafts (argmax, top-k trees, n-grams) and
  lossless, with lower acceptance, for any draft.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import (
    SamplingConfig,
    coin_flips,
    gumbel_noise,
    processed_logits,
)
from jaxspec.decoding.tree import Tree
from jaxspec.kernels.invariant import log_normalizer

METHODS = ("greedy", "replay", "rejection")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a verify step emits; entries past num_accepted + 1 are padding (0, 0.0, -1)."""

    num_accepted: jax.Array  # [B] int32 accepted draft nodes
    tokens: jax.Array  # [B, D+1] int32 accepted tokens, then the correction or bonus token
    logprobs: jax.Array  # [B, D+1] float32 log-probs under the processed target
    path: jax.Array  # [B, D+1] int32 fed-block indices of KV entries to keep (0 = the root)


def verify(
    key,
    target_logits,  # [B, N+1, V]: [:, 0] after the root, [:, i+1] after node i
    tree: Tree,
    cfg: SamplingConfig,
    *,
    method: str = "replay",
    positions,  # [B] int32: absolute position of the token emitted from the root
    draft_probs=None,  # [B, N, V] float: distribution node i was drawn from (rejection only)
    rows=None,  # [B] int32 rollout ids for the noise; default arange(B)
    noise=None,  # [B, D+1, V] replay only: replay_noise(key, positions, D, V, rows), if the caller has it
) -> Verdict:
    """Verify a batch of draft trees; pure and jit-able (method is static)."""
    batch, num_nodes = tree.tokens.shape
    if method not in METHODS:
        raise ValueError(f"verify: unknown method {method!r}; valid methods are {METHODS}")
    if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, num_nodes + 1):
        raise ValueError(
            f"verify: target_logits must be [B, N+1, V] = [{batch}, {num_nodes + 1}, V] for this "
            f"tree, got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[-1]
    if draft_probs is not None:
        if method != "rejection":
            raise ValueError(f"verify: draft_probs is used by method='rejection' only, not {method!r}")
        if tuple(draft_probs.shape) != (batch, num_nodes, vocab):
            raise ValueError(
                f"verify: draft_probs must be [B, N, V] = [{batch}, {num_nodes}, {vocab}], "
                f"got {tuple(draft_probs.shape)}"
            )
    if noise is not None and (method != "replay" or tuple(noise.shape) != (batch, tree.max_depth + 1, vocab)):
        raise ValueError(
            f"verify: noise is used by method='replay' only, as [B, D+1, V] = "
            f"[{batch}, {tree.max_depth + 1}, {vocab}]; got {tuple(noise.shape)} with method {method!r}"
        )
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch,))
    rows = jnp.arange(batch, dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)

    z = processed_logits(target_logits, cfg)  # [B, N+1, V], unnormalised
    logp = z - log_normalizer(z)  # one rounding for a row whatever the block's shape
    if method == "rejection":
        return _verify_rejection(key, logp, tree, positions, rows, draft_probs, z=z)
    if method == "greedy":
        choices = jnp.argmax(target_logits.astype(jnp.float32), axis=-1)
    else:  # replay: the plain sampler's draw at each node's slot (nodes of one depth share it)
        if noise is None:
            noise = replay_noise(key, positions, tree.max_depth, vocab, rows)
        fed_depths = jnp.clip(jnp.pad(tree.depths, ((0, 0), (1, 0))), 0, tree.max_depth)
        choices = jnp.argmax(z + jnp.take_along_axis(noise, fed_depths[..., None], axis=1), axis=-1)
    return _walk(tree, choices.astype(jnp.int32), logp)


def replay_noise(
    key,
    positions,  # [B] int32: absolute position of the token emitted from the root
    max_depth: int,
    vocab: int,
    rows,  # [B] int32 rollout ids
):  # -> [B, max_depth + 1, V] float32
    """The replay verifier's Gumbel noise for the tokens at positions + 0..max_depth."""
    depth_range = jnp.arange(max_depth + 1, dtype=jnp.int32)
    return gumbel_noise(key, rows, positions[:, None] + depth_range, vocab)


def _walk(
    tree: Tree,
    choices,  # [B, N+1] int32: the token the rule emits after each fed node
    logp,  # [B, N+1, V] float32 processed target log-probs
) -> Verdict:
    """Follow, from the root, the child whose token equals the rule's choice; stop at a miss."""
    batch = tree.tokens.shape[0]
    chosen_logp = jnp.take_along_axis(logp, choices[..., None], axis=-1)[..., 0]  # [B, N+1]
    parent_fed = tree.parents + 1  # fed index of each node's parent
    current = jnp.zeros((batch,), jnp.int32)
    active = jnp.ones((batch,), bool)
    num_accepted = jnp.zeros((batch,), jnp.int32)
    tokens, logprobs, path = [], [], []
    for depth in range(tree.max_depth + 1):
        token = jnp.take_along_axis(choices, current[:, None], axis=1)[:, 0]
        tokens.append(jnp.where(active, token, 0))
        logprobs.append(
            jnp.where(active, jnp.take_along_axis(chosen_logp, current[:, None], axis=1)[:, 0], 0.0)
        )
        path.append(jnp.where(active, current, -1))
        if depth == tree.max_depth:
            break
        match = (parent_fed == current[:, None]) & (tree.tokens == token[:, None])  # [B, N]
        active = active & jnp.any(match, axis=1)
        current = jnp.where(active, jnp.argmax(match, axis=1).astype(jnp.int32) + 1, current)
        num_accepted = num_accepted + active
    return Verdict(num_accepted, jnp.stack(tokens, 1), jnp.stack(logprobs, 1), jnp.stack(path, 1))


def _rejection_step(
    p,  # [B, V] float32 current target distribution (normalised)
    q,  # [B, V] float32 the draft's distribution, or None for a point mass at x
    x,  # [B] int32 drafted token, in [0, V)
):  # -> (acceptance probability [B], distribution to continue from after a rejection [B, V])
    """One candidate of the rejection rule: min(1, p(x)/q(x)) (0 if q(x) = 0), norm(max(p-q, 0))."""
    p_x = jnp.take_along_axis(p, x[:, None], axis=1)[:, 0]
    if q is None:
        q_x = jnp.ones_like(p_x)
        leftover = jnp.where(jnp.arange(p.shape[1]) == x[:, None], 0.0, p)
    else:
        q_x = jnp.take_along_axis(q, x[:, None], axis=1)[:, 0]
        leftover = jnp.maximum(p - q, 0.0)
    accept_prob = jnp.where(q_x > 0, jnp.minimum(1.0, p_x / jnp.where(q_x > 0, q_x, 1.0)), 0.0)
    mass = jnp.sum(leftover, axis=1, keepdims=True)
    # A zero residual (p == q) is only reached if the draft could not have produced x; keep p.
    residual = jnp.where(mass > 0, leftover / jnp.where(mass > 0, mass, 1.0), p)
    return accept_prob, residual


def _verify_rejection(
    key,
    logp,  # [B, N+1, V] float32 processed target log-probs
    tree: Tree,
    positions,  # [B] int32
    rows,  # [B] int32
    draft_probs,  # [B, N, V] or None (point-mass drafts)
    step=_rejection_step,  # tests swap in known-broken rules here (negative controls)
    z=None,  # [B, N+1, V] the unnormalised logp, if at hand: bonus tokens then match `sample`
) -> Verdict:
    """Recursive rejection in one pass over the nodes: candidates are visited in node order.

    The children of the current node are its candidates, tried in node order; an accepted child
    becomes the current node (its children all come later in topological order), so a single
    pass sees every candidate the rule examines. The final token is drawn from the remaining
    distribution with the sampler's noise at its slot.
    """
    batch, _, vocab = logp.shape
    max_depth = tree.max_depth
    row_ids = jnp.arange(batch)
    in_vocab = (tree.tokens >= 0) & (tree.tokens < vocab) & (tree.depths >= 1) & (tree.depths <= max_depth)
    drafts = jnp.clip(tree.tokens, 0, vocab - 1)
    node_ids = jnp.broadcast_to(jnp.arange(tree.num_nodes, dtype=jnp.int32), tree.tokens.shape)
    coins = coin_flips(key, rows, positions[:, None] + tree.depths - 1, node_ids)  # [B, N]
    slots = jnp.arange(max_depth + 1)

    def visit(i, carry):
        current, p, fresh, num_accepted, tokens, logprobs, path = carry
        x = drafts[:, i]
        q = None if draft_probs is None else draft_probs[:, i].astype(jnp.float32)
        accept_prob, residual = step(p, q, x)
        candidate = in_vocab[:, i] & (tree.parents[:, i] + 1 == current)
        accept = candidate & (coins[:, i] < accept_prob)
        reject = candidate & ~accept
        depth = tree.depths[:, i]
        write_token = accept[:, None] & (slots == depth[:, None] - 1)
        tokens = jnp.where(write_token, x[:, None], tokens)
        logprobs = jnp.where(write_token, logp[row_ids, current, x][:, None], logprobs)
        path = jnp.where(accept[:, None] & (slots == depth[:, None]), i + 1, path)
        p_next = jnp.exp(jax.lax.dynamic_index_in_dim(logp, i + 1, axis=1, keepdims=False))
        p = jnp.where(accept[:, None], p_next, jnp.where(reject[:, None], residual, p))
        fresh = (fresh & ~reject) | accept
        current = jnp.where(accept, i + 1, current)
        return current, p, fresh, num_accepted + accept, tokens, logprobs, path

    init = (
        jnp.zeros((batch,), jnp.int32),
        jnp.exp(logp[:, 0]),
        jnp.ones((batch,), bool),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch, max_depth + 1), jnp.int32),
        jnp.zeros((batch, max_depth + 1), jnp.float32),
        jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0),
    )
    carry = init
    if tree.num_nodes:  # an empty tree (plain decoding) has nothing to visit
        carry = jax.lax.fori_loop(0, tree.num_nodes, visit, init)
    current, p, fresh, num_accepted, tokens, logprobs, path = carry
    # Untouched p (a bonus token) is sampled exactly as the plain sampler would sample it.
    current_logp = logp[row_ids, current]  # [B, V]
    untouched = current_logp if z is None else z[row_ids, current]
    final_logits = jnp.where(fresh[:, None], untouched, jnp.log(p))
    noise = gumbel_noise(key, rows, positions + num_accepted, vocab)
    final = jnp.argmax(final_logits + noise, axis=-1).astype(jnp.int32)
    write_final = slots == num_accepted[:, None]
    tokens = jnp.where(write_final, final[:, None], tokens)
    logprobs = jnp.where(write_final, current_logp[row_ids, final][:, None], logprobs)
    return Verdict(num_accepted, tokens, logprobs, path)
