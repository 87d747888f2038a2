"""The jitted steps of a GRPO step, as pure functions of their inputs: the logprob stage
(`score_rollouts`), the GRPO policy update and the EAGLE-3 draft update, and the one
optimizer factory they (and the supervised warm-up) take as a static argument."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxspec import parallel
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import Policy
from jaxspec.models.moe import load_balancing_loss, router_z_loss, routing_mismatch
from jaxspec.rl import chunked
from jaxspec.rl.chunked import lm_head, token_logprobs
from jaxspec.rl.draft import TargetHead, draft_train_step, mtp_train_step
from jaxspec.rl.grpo import grpo_loss

__all__ = [
    "FINITE_KEYS",
    "POLICY_INPUTS",
    "draft_update",
    "make_optimizer",
    "mtp_update",
    "policy_update",
    "routing_mismatch_of",
    "sampling_of",
    "score_rollouts",
]


@functools.cache
def make_optimizer(spec) -> optax.GradientTransformation:
    """AdamW with linear warm-up and (its own) global-norm clip, from a hashable spec with
    lr, b1, b2, eps, weight_decay, warmup_steps and clip_norm (None: no clip), e.g. the
    config's `optim` / `draft_optim`. One object per spec, so the jitted updates that take
    it as a static argument compile once per process."""
    lr = spec.lr if spec.warmup_steps == 0 else optax.linear_schedule(
        0.0, spec.lr, spec.warmup_steps)
    adamw = optax.adamw(lr, b1=spec.b1, b2=spec.b2, eps=spec.eps, weight_decay=spec.weight_decay)
    if spec.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(spec.clip_norm), adamw)


def sampling_of(spec) -> tuple[SamplingConfig, bool]:
    """The rollout distribution of the config's `sampling` section, and whether top-k or
    top-p filters it (the static `filtered` of the jitted steps)."""
    return (SamplingConfig(spec.temperature, spec.top_k, spec.top_p),
            spec.top_k > 0 or spec.top_p < 1.0)


def _token_logprobs(policy: Policy, hidden, tokens, sampling, filtered: bool, chunk: int):
    """log p(token t+1) under the processed sampling distribution (what the generator
    reports), and that distribution's entropy, at every position t, from the final hidden
    states fused with the policy's LM head in vocabulary chunks: [B,T,H], [B,T] -> [B,T] x2."""
    weight, axis = lm_head(policy)
    return token_logprobs(hidden, weight, jnp.roll(tokens, -1, axis=1), sampling,
                          vocab_axis=axis, filtered=filtered, chunk=chunk,
                          invariant=policy.config.batch_invariant)


def _micro(rows: int, micro_batch: int) -> int:
    """The micro-batch size for `rows` rows (0: all of them), checked."""
    if micro_batch == 0 or micro_batch >= rows:
        return 0
    if rows % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} does not divide the {rows} rows of a "
                         f"forward; valid: 0 or a divisor of {rows}")
    return micro_batch


@functools.partial(jax.jit, static_argnames=("capture", "filtered", "chunk", "micro_batch",
                                             "recompute"))
def score_rollouts(
    policy: Policy,
    ref_params,  # the reference policy's params, or None (no KL)
    prompts,  # [B, P] int32 right-padded
    prompt_lengths,  # [B] int32
    tokens,  # [B, N] int32 generated, right-padded
    lengths,  # [B] int32
    gen_logprobs,  # [B, N] float32
    sampling: SamplingConfig,
    *,
    capture: tuple[int, ...] = (),
    filtered: bool = False,
    chunk: int = 8192,
    micro_batch: int = 0,
    recompute: bool = True,
) -> dict[str, jax.Array]:
    """The logprob stage: pack prompt + rollout into [B, T = P + N] sequences (right-padded,
    positions -1 on padding) and run the policy (and reference) over them, `micro_batch`
    rows per forward (0: all), the LM head fused with the log-probs in vocabulary chunks of
    `chunk` (jaxspec.rl.chunked; 0: whole logits).

    Values at position t are about token t+1 ("next-token" layout): logprobs, entropy,
    ref_logprobs, gen_logprobs, mask (t+1 is a rollout token). Draft supervision:
    features [B,T,3H] (captured layers), target_hidden [B,T,H] (the policy's final-normed
    hidden states: its logits are target_hidden @ LM head), response [B,T] (token t is a
    rollout token).

    `recompute=False` (grpo.reuse_generation_logprobs, once a check found them exact): the
    old-policy log-probs are the generator's, no entropy is returned (the training forward
    logs it), and the policy forward runs only when `capture` needs its features."""
    n = tokens.shape[1]
    seq, positions, response, off = _pack(prompts, prompt_lengths, tokens, lengths)
    mask = jnp.roll(response, -1, axis=1).at[:, -1].set(False)
    gen_lp = jnp.where(mask, jnp.take_along_axis(gen_logprobs, jnp.clip(off + 1, 0, n - 1), axis=1), 0.0)

    def forward(rows):  # one micro-batch of (seq, positions, mask)
        seq, positions, mask = rows
        out = {}
        if recompute or capture:
            hidden, captured, _ = policy.forward(seq, positions, capture=capture, head=False,
                                                 shard_rows=True)
        if recompute:
            lp, entropy = _token_logprobs(policy, hidden, seq, sampling, filtered, chunk)
            out = {"logprobs": jnp.where(mask, lp, 0.0), "entropy": entropy}
        if ref_params is not None:
            ref = policy.replace(params=ref_params)
            ref_hidden, _, _ = ref.forward(seq, positions, head=False, shard_rows=True)
            ref_lp = _token_logprobs(ref, ref_hidden, seq, sampling, filtered, chunk)[0]
            out["ref_logprobs"] = jnp.where(mask, ref_lp, 0.0)
        if capture:
            out["features"] = jnp.concatenate([captured[i] for i in capture], axis=-1)
            out["target_hidden"] = hidden
        return out

    micro = _micro(seq.shape[0], micro_batch)
    if micro:
        parts = chunked.split_rows((seq, positions, mask), micro)
        out = chunked.join_rows(jax.lax.map(forward, parts))
    else:
        out = forward((seq, positions, mask))
    if not recompute:
        out["logprobs"] = gen_lp
    return {"tokens": seq, "positions": positions, "mask": mask, "response": response,
            "gen_logprobs": gen_lp, **out}


def _pack(prompts, prompt_lengths, tokens, lengths):
    """Prompt + rollout as [B, T = P + N] sequences, right-padded: (tokens, positions (-1 on
    padding), response (token t is a rollout token), offset of t into the rollout)."""
    p, n = prompts.shape[1], tokens.shape[1]
    idx = jnp.arange(p + n, dtype=jnp.int32)[None, :]
    off = idx - prompt_lengths[:, None]  # offset into the rollout
    in_prompt = idx < prompt_lengths[:, None]
    response = (off >= 0) & (off < lengths[:, None])
    prompt_wide = jnp.pad(prompts, ((0, 0), (0, n)))
    rollout_tok = jnp.take_along_axis(tokens, jnp.clip(off, 0, n - 1), axis=1)
    seq = jnp.where(in_prompt, prompt_wide, jnp.where(response, rollout_tok, 0))
    return seq, jnp.where(in_prompt | response, idx, -1), response, off


@jax.jit
def routing_mismatch_of(
    policy: Policy,  # an MoE policy
    prompts,  # [B, P] int32 right-padded
    prompt_lengths,  # [B] int32
    tokens,  # [B, N] int32 generated
    lengths,  # [B] int32
    routes,  # [B, N, L, K] int32 the generation's experts per token (Rollouts.routes; -1: not fed)
):  # -> (fraction of counted tokens whose experts differ, counted tokens)
    """Routing consistency: the training forward (the logprob stage's packing and forward)
    over the rollouts, against the experts each rollout token was routed to in the
    generation forward that fed it; a token counts when it was fed (every rollout token but
    the last) and differs when its expert set differs in any sparse layer."""
    n = tokens.shape[1]
    seq, positions, response, off = _pack(prompts, prompt_lengths, tokens, lengths)
    _, _, _, routing = policy.forward(seq, positions, head=False, routing=True)
    gen = jnp.take_along_axis(routes, jnp.clip(off, 0, n - 1)[:, :, None, None], axis=1)
    gen = jnp.transpose(gen, (2, 0, 1, 3))  # [L, B, T, K]
    fed = response & jnp.any(gen >= 0, axis=(0, 3))
    mismatch = routing_mismatch(routing["experts"], gen, policy.config.sparse_layers, fed)
    return mismatch, jnp.sum(fed)


POLICY_INPUTS = ("tokens", "positions", "mask", "logprobs", "gen_logprobs", "entropy",
                 "ref_logprobs")  # what the policy update reads of the logprob stage
_MIN_KEYS = ("ratio_min",)
FINITE_KEYS = ("finite_loss", "finite_grad_norm", "finite_params")  # 1.0 / 0.0 flags
_MAX_KEYS = ("ratio_max", "logprob_mismatch_max")


@functools.partial(jax.jit, static_argnames=("optimizer", "grpo_cfg", "minibatches", "filtered"))
def policy_update(
    policy: Policy,
    opt_state,
    scored: dict,  # the POLICY_INPUTS of score_rollouts' output, each [B, T]
    advantages,  # [B] float32
    sampling: SamplingConfig,
    *,
    optimizer: optax.GradientTransformation,
    grpo_cfg,
    minibatches: int,
    filtered: bool,
):
    """GRPO updates of the policy over `minibatches` disjoint slices of the batch (a scan);
    metrics are averaged over them (min / max for the ratio extremes). Each minibatch's
    gradient accumulates over forwards of `grpo_cfg.micro_batch` rows (0: one forward), the
    log-probs fused with the LM head in chunks of `grpo_cfg.logprob_chunk`."""
    data = dict(scored, advantages=advantages)
    data = jax.tree.map(lambda x: x.reshape((minibatches, -1) + x.shape[1:]), data)
    micro = _micro(data["tokens"].shape[1], grpo_cfg.micro_batch)

    moe = policy.config.is_moe
    route = {"routing": True} if moe else {}  # (a hybrid policy's forward takes no routing)

    def loss_fn(params, mb, denominator=None):
        current = policy.replace(params=params)
        hidden, _, _, *routing = current.forward(mb["tokens"], mb["positions"], head=False,
                                                 shard_rows=True, **route)
        lp, entropy = _token_logprobs(current, hidden, mb["tokens"], sampling, filtered,
                                      grpo_cfg.logprob_chunk)
        # without a scoring forward (reused generation log-probs) the training forward's
        # entropy is logged: at the first minibatch the same params, so the same values
        loss, metrics = grpo_loss(lp, mb["logprobs"], mb.get("ref_logprobs"), mb["advantages"],
                                  mb["mask"], grpo_cfg, gen_logprobs=mb["gen_logprobs"],
                                  entropy=mb.get("entropy", entropy), denominator=denominator)
        if moe:  # each micro-batch adds its share (rows) of the router losses
            share = 1.0 if denominator is None else micro / data["tokens"].shape[1]
            loss, metrics = _router_losses(loss, metrics, routing[0], mb["positions"] >= 0,
                                           policy.config, grpo_cfg, share)
        return loss, metrics

    def grad_fn(params, mb):
        if not micro:
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            return parallel.constrain_params(grads), metrics
        if grpo_cfg.loss_agg == "token":
            denominator = jnp.sum(mb["mask"])
        else:
            denominator = jnp.sum(jnp.any(mb["mask"], axis=1))

        def part_grad(part):
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, part, denominator)
            return parallel.constrain_params(grads), metrics

        grads, metrics = chunked.accumulate_gradients(part_grad, params,
                                                      chunked.split_rows(mb, micro))
        return grads, _combine_micro(metrics)

    def body(carry, mb):
        params, opt_state = carry
        grads, metrics = grad_fn(params, mb)
        metrics["grad_norm"] = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    (params, new_opt_state), metrics = jax.lax.scan(body, (policy.params, opt_state), data)
    out = {}
    for k, v in metrics.items():
        out[k] = v.min() if k in _MIN_KEYS else v.max() if k in _MAX_KEYS else v.mean()
    # the divergence guard: a non-finite loss, gradient norm or new parameter keeps the old
    # params and optimizer state (a select: finite steps are bitwise what they were)
    flags = (jnp.all(jnp.isfinite(metrics["loss"])), jnp.all(jnp.isfinite(metrics["grad_norm"])),
             _tree_finite(params))
    params, opt_state = _keep_if_finite(flags, (params, new_opt_state), (policy.params, opt_state))
    out.update({k: f for k, f in zip(FINITE_KEYS, flags, strict=True)})
    return policy.replace(params=params), opt_state, out


def _router_losses(loss, metrics, routing, tokens, config, grpo_cfg, share):
    """The GRPO loss plus router_aux_coef x the load-balancing loss and router_z_coef x the
    z-loss over the forward's real tokens (`tokens` [B, T] bool); both logged."""
    aux = load_balancing_loss(routing["router_logits"], config.num_experts_per_tok,
                              config.sparse_layers, tokens)
    z = router_z_loss(routing["router_logits"], config.sparse_layers, tokens)
    if grpo_cfg.router_aux_coef > 0:
        loss = loss + share * grpo_cfg.router_aux_coef * aux
    if grpo_cfg.router_z_coef > 0:
        loss = loss + share * grpo_cfg.router_z_coef * z
    metrics = dict(metrics, loss=jax.lax.stop_gradient(loss), router_aux_loss=
                   jax.lax.stop_gradient(aux), router_z_loss=jax.lax.stop_gradient(z))
    return loss, metrics


def _combine_micro(metrics: dict) -> dict:
    """One minibatch's metrics from its micro-batches' [n] values: the loss (each a part of
    the sum over the same denominator) and valid_tokens add up, extremes take min / max,
    advantage_mean averages, and the masked means are weighted by their valid tokens."""
    tokens = metrics["valid_tokens"]
    out = {}
    for k, v in metrics.items():
        if k in ("loss", "valid_tokens"):
            out[k] = v.sum()
        elif k in _MIN_KEYS:
            out[k] = v.min()
        elif k in _MAX_KEYS:
            out[k] = v.max()
        elif k == "advantage_mean":
            out[k] = v.mean()
        else:
            out[k] = jnp.sum(v * tokens) / jnp.maximum(jnp.sum(tokens), 1)
    return out


def _tree_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _keep_if_finite(flags, new, old):
    """`new` when every flag holds, else `old` (leaf by leaf, same structure)."""
    ok = functools.reduce(jnp.logical_and, flags)
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


@functools.partial(jax.jit, static_argnames=("optimizer", "loss_cfg"))
def draft_update(head, opt_state, policy: Policy, scored: dict, *, optimizer, loss_cfg):
    """One TTT update of the EAGLE-3 head on the logprob stage's (stop-gradient) features:
    `scored` is score_rollouts' output with capture on; `policy` gives the frozen embedding.
    Returns (head, opt_state, metrics); a non-finite loss, gradient norm or new parameter
    keeps the old head and optimizer state (the FINITE_KEYS flags say which)."""
    weight, axis = lm_head(policy)
    target = TargetHead(scored["target_hidden"], weight, vocab_axis=axis,
                        invariant=policy.config.batch_invariant)
    new_head, new_opt_state, metrics = draft_train_step(
        head, opt_state, optimizer, policy.embed, scored["features"], scored["tokens"],
        target, scored["response"], loss_cfg)
    flags = (jnp.isfinite(metrics["draft_loss"]), jnp.isfinite(metrics["draft_grad_norm"]),
             _tree_finite(new_head.params))
    head, opt_state = _keep_if_finite(flags, (new_head, new_opt_state), (head, opt_state))
    metrics.update({k: f for k, f in zip(FINITE_KEYS, flags, strict=True)})
    return head, opt_state, metrics


@functools.partial(jax.jit, static_argnames=("optimizer", "loss_cfg"))
def mtp_update(head, opt_state, policy: Policy, scored: dict, *, optimizer, loss_cfg):
    """One update of an MTP head (jaxspec.models.mtp) with its own optimizer on the logprob
    stage's stop-gradient features (capture = the policy's last layer), unrolled
    loss_cfg.steps draft steps (a DraftLossConfig: draft.ttt_steps / ttt_decay); the policy
    gives the frozen embedding and LM head. Returns (head, opt_state, metrics), guarded as
    draft_update."""
    weight, axis = lm_head(policy)
    target = TargetHead(scored["target_hidden"], weight, vocab_axis=axis,
                        invariant=policy.config.batch_invariant)
    new_head, new_opt_state, metrics = mtp_train_step(
        head, opt_state, optimizer, policy.embed, scored["features"], scored["tokens"],
        scored["positions"], scored["response"], target, steps=loss_cfg.steps,
        decay=loss_cfg.decay, chunk=loss_cfg.chunk)
    flags = (jnp.isfinite(metrics["draft_loss"]), jnp.isfinite(metrics["draft_grad_norm"]),
             _tree_finite(new_head.params))
    head, opt_state = _keep_if_finite(flags, (new_head, new_opt_state), (head, opt_state))
    metrics.update({k: f for k, f in zip(FINITE_KEYS, flags, strict=True)})
    return head, opt_state, metrics

