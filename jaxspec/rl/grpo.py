"""GRPO: group-normalised advantages and the clipped policy-gradient loss (NeMo RL's
ClippedPGLossFn), with k3 KL to a reference, token- or sequence-level aggregation and
truncated importance weights between generation-time and training-time log-probs.

Loss variants and advantage estimators are chosen by name (`GRPOConfig.loss`,
`GRPOConfig.advantage`) from the registries below, so a new variant is one function.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Callable, Literal, Optional

import jax
import jax.numpy as jnp

from jaxspec.errors import FieldError

__all__ = ["ADVANTAGES", "GRPOConfig", "LOSSES", "group_advantages", "grpo_loss", "k3_kl",
           "register_advantage", "register_loss"]

# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """The GRPO loss (static, hashable: `grpo_loss` is jitted with it as a static argument).
    This is the `grpo:` section of a run config; each field checks itself here."""

    loss: str = "clipped_pg"  # name in LOSSES
    advantage: str = "grpo"  # name in ADVANTAGES
    normalize_std: bool = True  # divide advantages by the group's reward std
    eps_low: float = 0.2  # ratio clip 1 - eps_low, in [0, 1)
    eps_high: float = 0.2  # ratio clip 1 + eps_high, >= 0
    clip_c: Optional[float] = None  # dual clip for A < 0 (> 1); None = off
    kl_coef: float = 0.01  # k3 KL to the reference; 0 = no reference
    loss_agg: Literal["token", "sequence"] = "token"
    tis: Literal["none", "token", "sequence"] = "none"  # truncated importance weights
    tis_cap: float = 2.0  # > 0
    minibatches: int = 1  # optimizer updates per step, on disjoint minibatches
    # Vocabulary entries per chunk of the LM head fused with the log-prob / entropy / draft
    # losses (jaxspec.rl.chunked): the [B, T, V] logits are never materialised; 0 = unchunked.
    logprob_chunk: int = 8192
    # Rollout rows per forward of the logprob and training stages (gradients accumulate over
    # the micro-batches of a minibatch); 0 = the whole batch / minibatch in one forward.
    micro_batch: int = 0
    # Sync GRPO: use the generator's log-probs as the old-policy log-probs instead of
    # recomputing them in the logprob stage, when a measured check finds them exact: every
    # step recomputes `reuse_check_rows` rows (all rows at a run's first step) and compares.
    reuse_generation_logprobs: bool = False
    reuse_check_rows: int = 8  # >= 1; rounded up to a multiple of the training batch shards
    # max |generation - training| log-prob allowed (0 = bitwise). With model.batch_invariant
    # both use one log-normaliser: bitwise at any vocabulary, logprob_chunk and micro_batch
    # (0 holds); measured on this CPU: float32 default <= 2.3e-6 (a few ulps); plain bf16 up
    # to 1.1e-2, refused (docs/BENCHMARKS.md, docs/training.md)
    reuse_tolerance: float = 1e-5
    reuse_on_mismatch: Literal["error", "recompute"] = "error"  # over tolerance: stop, or
    #                                                 recompute this step (and log it)
    # MoE policies (model.family qwen3_moe; jaxspec.models.moe): coefficients of the router's
    # load-balancing loss (transformers' definition, over every token of the training forward;
    # its floor is num_experts_per_tok) and of the router z-loss, added to the GRPO loss.
    # 0 = off (the usual choice in RL: the routing is the pretrained one).
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0

    def __post_init__(self):
        for name, registry in (("loss", LOSSES), ("advantage", ADVANTAGES)):
            value = getattr(self, name)
            if value not in registry:
                close = difflib.get_close_matches(str(value), list(registry), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                valid = "one of " + ", ".join(repr(n) for n in registry)
                raise FieldError("GRPOConfig", name, value, f"is unknown{hint}", valid,
                                 message=f"GRPOConfig.{name}={value!r} is unknown{hint}; "
                                 f"valid: {valid}")
        for name, choices in (("loss_agg", ("token", "sequence")),
                              ("tis", ("none", "token", "sequence")),
                              ("reuse_on_mismatch", ("error", "recompute"))):
            if getattr(self, name) not in choices:
                valid = "one of " + ", ".join(repr(c) for c in choices)
                raise FieldError("GRPOConfig", name, getattr(self, name), "not a valid choice",
                                 valid, message=f"GRPOConfig.{name}={getattr(self, name)!r}; "
                                 f"valid: {valid}")
        ranges = {
            "eps_low": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
            "eps_high": (lambda v: v >= 0, ">= 0"),
            "clip_c": (lambda v: v is None or v > 1, "null or > 1"),
            "kl_coef": (lambda v: v >= 0, ">= 0"),
            "tis_cap": (lambda v: v > 0, "> 0"),
            "reuse_tolerance": (lambda v: v >= 0, ">= 0 (0: bitwise)"),
            "router_aux_coef": (lambda v: v >= 0, ">= 0 (0: off)"),
            "router_z_coef": (lambda v: v >= 0, ">= 0 (0: off)"),
        }
        for name, (ok, valid) in ranges.items():
            value = getattr(self, name)
            number = value is None or (isinstance(value, (int, float))
                                       and not isinstance(value, bool) and math.isfinite(value))
            if not number or not ok(value):
                raise FieldError("GRPOConfig", name, value, "is out of range", valid,
                                 message=f"GRPOConfig.{name}={value!r} is out of range; valid: "
                                 f"{valid}")
        if not isinstance(self.minibatches, int) or self.minibatches < 1:
            raise FieldError("GRPOConfig", "minibatches", self.minibatches, "is out of range",
                             "an int >= 1", message=f"GRPOConfig.minibatches="
                             f"{self.minibatches!r} is out of range; valid: an int >= 1")
        if not isinstance(self.reuse_generation_logprobs, bool):
            raise FieldError("GRPOConfig", "reuse_generation_logprobs",
                             self.reuse_generation_logprobs, "wrong type", "true or false",
                             message=f"GRPOConfig.reuse_generation_logprobs="
                             f"{self.reuse_generation_logprobs!r}; valid: true or false")
        if (not isinstance(self.reuse_check_rows, int) or isinstance(self.reuse_check_rows, bool)
                or self.reuse_check_rows < 1):
            valid = "an int >= 1 (the check is never skipped)"
            raise FieldError("GRPOConfig", "reuse_check_rows", self.reuse_check_rows,
                             "is out of range", valid, message=f"GRPOConfig.reuse_check_rows="
                             f"{self.reuse_check_rows!r} is out of range; valid: {valid}")
        for name in ("logprob_chunk", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FieldError("GRPOConfig", name, value, "is out of range",
                                 "an int >= 0 (0: off)", message=f"GRPOConfig.{name}={value!r} "
                                 "is out of range; valid: an int >= 0 (0: off)")


# ----------------------------------------------------------------------------- advantages

ADVANTAGES: dict[str, Callable] = {}


def register_advantage(name: str):
    """Register `fn(rewards[P, G], *, normalize_std, eps) -> advantages[P, G]`."""
    def wrap(fn):
        ADVANTAGES[name] = fn
        return fn
    return wrap


def _group_std(rewards):  # [P, G] -> [P, 1], unbiased (ddof=1, as torch.std)
    return jnp.std(rewards, axis=1, keepdims=True, ddof=1)


@register_advantage("grpo")
def _grpo_advantages(rewards, *, normalize_std, eps):
    """(r - mean of the group) / (std of the group + eps)."""
    adv = rewards - rewards.mean(axis=1, keepdims=True)
    return adv / (_group_std(rewards) + eps) if normalize_std else adv


@register_advantage("rloo")
def _rloo_advantages(rewards, *, normalize_std, eps):
    """r - mean of the *other* samples of the group (leave-one-out baseline, NeMo RL's
    default), optionally divided by the group's std."""
    g = rewards.shape[1]
    baseline = (rewards.sum(axis=1, keepdims=True) - rewards) / (g - 1)
    adv = rewards - baseline
    return adv / (_group_std(rewards) + eps) if normalize_std else adv


def group_advantages(
    rewards,  # [num_prompts * G] (prompt-major: the G samples of a prompt are adjacent) or [P, G]
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    estimator: str = "grpo",
) -> jax.Array:  # same shape as rewards
    """Group-normalised advantages. A group whose rewards are all equal gets 0."""
    rewards = jnp.asarray(rewards)
    rewards = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32))
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (advantages compare samples of one "
                         f"prompt), got {group_size}")
    if rewards.size % group_size:
        raise ValueError(f"{rewards.size} rewards do not split into groups of {group_size}")
    if rewards.ndim == 2 and rewards.shape[1] != group_size:
        raise ValueError(f"rewards of shape {rewards.shape} do not have groups of {group_size} "
                         f"on axis 1")
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}; registered: "
                         f"{', '.join(ADVANTAGES)}")
    grouped = rewards.reshape(-1, group_size)
    adv = ADVANTAGES[estimator](grouped, normalize_std=normalize_std, eps=eps)
    return adv.reshape(rewards.shape)


# ----------------------------------------------------------------------------- losses

LOSSES: dict[str, Callable] = {}


def register_loss(name: str):
    """Register `fn(logprobs, old_logprobs, advantages[B, 1], cfg) -> (loss[B, T], aux)`:
    the per-token policy-gradient loss (before importance weights, KL and aggregation) and
    a dict of per-token float/bool arrays [B, T] that grpo_loss reports as masked means."""
    def wrap(fn):
        LOSSES[name] = fn
        return fn
    return wrap


@register_loss("clipped_pg")
def _clipped_pg(logprobs, old_logprobs, advantages, cfg: GRPOConfig):
    """max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = exp(logp - logp_old); with clip_c,
    the loss of a token with A < 0 is also capped at -c A (dual clip)."""
    ratio = jnp.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = jnp.maximum(unclipped, clipped)
    aux = {"clip_fraction": clipped > unclipped}
    if cfg.clip_c is not None:
        cap = -cfg.clip_c * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = jnp.where(advantages < 0, jnp.minimum(loss, cap), loss)
        aux["dual_clip_fraction"] = dual
    return loss, aux


def k3_kl(
    logprobs,  # [B, T] current policy
    ref_logprobs,  # [B, T] reference policy
) -> jax.Array:  # [B, T]
    """k3 estimator of KL(current || reference): e^d - d - 1, d = ref - cur clamped to
    [-20, 20]; the result is clamped at 10 (NeMo RL)."""
    d = jnp.clip(ref_logprobs - logprobs, -20.0, 20.0)
    return jnp.minimum(jnp.exp(d) - d - 1.0, 10.0)


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0)) / jnp.maximum(jnp.sum(mask), 1)


def grpo_loss(
    logprobs,  # [B, T] training-time log-probs of the rollout tokens (differentiated)
    old_logprobs,  # [B, T] log-probs under the params that the ratio is taken against
    ref_logprobs,  # [B, T] or None: reference policy (needed when cfg.kl_coef > 0)
    advantages,  # [B]
    mask,  # [B, T] bool/0-1: response tokens that count
    cfg: GRPOConfig,
    *,
    gen_logprobs=None,  # [B, T] or None: log-probs the generator reported for these tokens
    entropy=None,  # [B, T] or None: policy entropy per position, for logging only
    denominator=None,  # scalar or None: valid tokens (token agg) / sequences (sequence agg) of
    #                    the whole batch when this call sees one micro-batch of it
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO loss (scalar) and metrics. Jit with `cfg` static.

    per token: w * pg + kl_coef * k3, where pg is the registered loss `cfg.loss` and w the
    truncated importance weight min(exp(old - gen), tis_cap) (per token), or the product of
    the token ratios of the sequence truncated at tis_cap (per sequence); w is a constant
    (stop-gradient). Aggregation: 'token' = mean over all valid tokens of the batch;
    'sequence' = mean over valid tokens of each sequence, then over sequences with any."""
    dtype = jnp.promote_types(jnp.result_type(logprobs), jnp.float32)
    logprobs = logprobs.astype(dtype)
    old_logprobs = jax.lax.stop_gradient(old_logprobs.astype(dtype))
    mask = mask.astype(bool)
    maskf = mask.astype(dtype)
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, dtype))[:, None]  # [B, 1]

    if cfg.loss not in LOSSES:
        raise ValueError(f"unknown GRPO loss {cfg.loss!r}; registered: {', '.join(LOSSES)}")
    per_token, aux = LOSSES[cfg.loss](logprobs, old_logprobs, adv, cfg)

    metrics = {}
    if cfg.tis != "none":
        if gen_logprobs is None:
            raise ValueError(f"cfg.tis = {cfg.tis!r} needs gen_logprobs (the generator's "
                             f"log-probs of the rollout tokens)")
        log_w = old_logprobs - jax.lax.stop_gradient(gen_logprobs.astype(dtype))
        cap = jnp.log(jnp.asarray(cfg.tis_cap, dtype))
        if cfg.tis == "sequence":
            log_w = jnp.sum(jnp.where(mask, log_w, 0), axis=1, keepdims=True)
            log_w = jnp.broadcast_to(log_w, per_token.shape)
        weight = jnp.exp(jnp.minimum(log_w, cap))  # min(ratio, cap) without overflow
        per_token = per_token * weight
        metrics["importance_weight_mean"] = _masked_mean(weight, mask)
        metrics["importance_weight_truncated_fraction"] = _masked_mean(log_w > cap, mask)

    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"cfg.kl_coef = {cfg.kl_coef} needs ref_logprobs")
        kl = k3_kl(logprobs, jax.lax.stop_gradient(ref_logprobs.astype(dtype)))
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl"] = _masked_mean(kl, mask)
    elif ref_logprobs is not None:
        metrics["kl"] = _masked_mean(
            k3_kl(logprobs, ref_logprobs.astype(dtype)), mask)

    if cfg.loss_agg == "token":
        denom = jnp.sum(maskf) if denominator is None else denominator
        loss = jnp.sum(per_token * maskf) / jnp.maximum(denom, 1)
    else:
        lengths = jnp.sum(maskf, axis=1)
        per_seq = jnp.sum(per_token * maskf, axis=1) / jnp.maximum(lengths, 1)
        denom = jnp.sum(lengths > 0) if denominator is None else denominator
        loss = jnp.sum(per_seq) / jnp.maximum(denom, 1)

    ratio = jax.lax.stop_gradient(jnp.exp(logprobs - old_logprobs))
    big = jnp.finfo(dtype).max
    metrics.update({
        "loss": jax.lax.stop_gradient(loss),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_min": jnp.min(jnp.where(mask, ratio, big)),
        "ratio_max": jnp.max(jnp.where(mask, ratio, -big)),
        "advantage_mean": jnp.mean(adv),
        "valid_tokens": jnp.sum(maskf),
    })
    for name, value in aux.items():
        metrics[name] = _masked_mean(value, mask)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.astype(dtype), mask)
    if gen_logprobs is not None:
        diff = jnp.abs(old_logprobs - gen_logprobs.astype(dtype))
        metrics["logprob_mismatch_mean"] = _masked_mean(diff, mask)
        metrics["logprob_mismatch_max"] = jnp.max(jnp.where(mask, diff, 0))
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
