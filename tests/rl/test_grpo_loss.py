"""grpo_loss and group_advantages against an independent NumPy implementation."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import GRPOConfig
from jaxspec.rl import grpo

B, T = 6, 7
loss_fn = jax.jit(grpo.grpo_loss, static_argnames="cfg")


# ----------------------------------------------------------------------------- NumPy reference

def np_reference(lp, old, ref, adv, mask, cfg, gen=None, entropy=None):
    """The GRPO loss and metrics, written out from the formulas (float64)."""
    lp, old, adv, mask = (np.asarray(x, np.float64) for x in (lp, old, adv, mask))
    a = adv[:, None]
    r = np.exp(lp - old)
    unclipped = -a * r
    clipped = -a * np.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = np.maximum(unclipped, clipped)
    out = {"clip_fraction": (clipped > unclipped)}
    if cfg.clip_c is not None:
        out["dual_clip_fraction"] = (a < 0) & (pg > -cfg.clip_c * a)
        pg = np.where(a < 0, np.minimum(pg, -cfg.clip_c * a), pg)
    if cfg.tis == "token":
        w = np.minimum(np.exp(old - gen), cfg.tis_cap)
    elif cfg.tis == "sequence":
        seq_ratio = np.exp(((old - gen) * mask).sum(1, keepdims=True))
        w = np.broadcast_to(np.minimum(seq_ratio, cfg.tis_cap), lp.shape)
    else:
        w = np.ones_like(lp)
    per_token = w * pg
    if ref is not None:
        d = np.clip(np.asarray(ref, np.float64) - lp, -20, 20)
        kl = np.minimum(np.exp(d) - d - 1, 10)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if cfg.loss_agg == "token":
        loss = (per_token * mask).sum() / mask.sum()
    else:
        n = mask.sum(1)
        loss = ((per_token * mask).sum(1)[n > 0] / n[n > 0]).mean()

    def mean(x):
        return (x * mask).sum() / mask.sum()

    valid = mask > 0
    metrics = {"loss": loss, "ratio_mean": mean(r), "ratio_min": r[valid].min(),
               "ratio_max": r[valid].max(), **{k: mean(v) for k, v in out.items()}}
    if ref is not None:
        metrics["kl"] = mean(kl)
    if cfg.tis != "none":
        metrics["importance_weight_mean"] = mean(w)
    if gen is not None:
        metrics["logprob_mismatch_mean"] = mean(np.abs(old - gen))
        metrics["logprob_mismatch_max"] = np.abs(old - gen)[valid].max()
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
    return loss, metrics


def random_batch(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, (B, T))
    lp = old + rng.normal(0, 0.3, (B, T))  # ratios from ~0.4 to ~2.5: all clip regions
    adv = rng.normal(0, 1, B)
    adv[0] = -abs(adv[0])
    lp[0, :2] = old[0, :2] + 1.5  # ratio e^1.5 > clip_c with A < 0: the dual clip acts
    ref = lp + rng.normal(0, 0.5, (B, T))
    gen = old + rng.normal(0, 0.4, (B, T))
    lengths = np.array([T, 3, 0, 5, 1, 6])  # ragged, one empty sequence
    mask = np.arange(T)[None] < lengths[:, None]
    entropy = rng.uniform(0, 3, (B, T))
    cast = lambda x: np.asarray(x, dtype)  # noqa: E731
    return cast(lp), cast(old), cast(ref), cast(adv), mask, cast(gen), cast(entropy)


OPTIONS = list(itertools.product(("token", "sequence"), (0.0, 0.05), ("none", "token", "sequence"),
                                 (None, 3.0)))


@pytest.mark.parametrize("loss_agg,kl_coef,tis,clip_c", OPTIONS)
def test_loss_and_metrics_match_numpy(loss_agg, kl_coef, tis, clip_c):
    cfg = GRPOConfig(eps_low=0.2, eps_high=0.28, clip_c=clip_c, kl_coef=kl_coef,
                     loss_agg=loss_agg, tis=tis, tis_cap=1.5)
    lp, old, ref, adv, mask, gen, ent = random_batch(1)
    ref_arg = ref if kl_coef > 0 else None
    loss, metrics = loss_fn(
        lp, old, ref_arg, adv, mask, cfg, gen_logprobs=gen, entropy=ent)
    want, want_metrics = np_reference(lp, old, ref_arg, adv, mask, cfg, gen=gen, entropy=ent)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, atol=1e-6, err_msg=name)
    # the reference batch really exercises the options
    assert 0 < float(metrics["clip_fraction"]) < 1
    if clip_c is not None:
        assert float(metrics["dual_clip_fraction"]) > 0
    if tis != "none":
        assert 0 < float(metrics["importance_weight_truncated_fraction"]) < 1


@pytest.mark.parametrize("loss_agg,tis,clip_c", [("token", "token", 3.0),
                                                 ("sequence", "sequence", 2.0),
                                                 ("token", "none", None)])
def test_gradient_matches_finite_differences_float64(loss_agg, tis, clip_c):
    cfg = GRPOConfig(eps_low=0.2, eps_high=0.28, clip_c=clip_c, kl_coef=0.05,
                     loss_agg=loss_agg, tis=tis, tis_cap=1.5)
    lp, old, ref, adv, mask, gen, _ = random_batch(2, np.float64)
    with jax.enable_x64(True):
        grad = jax.jit(jax.grad(lambda x: grpo.grpo_loss(x, old, ref, adv, mask, cfg,
                                                         gen_logprobs=gen)[0]))(jnp.asarray(lp))
        assert grad.dtype == jnp.float64
    fd = np.zeros_like(lp)
    h = 1e-6
    for idx in np.ndindex(lp.shape):
        up, down = lp.copy(), lp.copy()
        up[idx] += h
        down[idx] -= h
        fd[idx] = (np_reference(up, old, ref, adv, mask, cfg, gen)[0]
                   - np_reference(down, old, ref, adv, mask, cfg, gen)[0]) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)
    assert np.all(np.asarray(grad)[~mask] == 0)  # padding never gets gradient


def test_no_gradient_through_old_ref_or_gen():
    cfg = GRPOConfig(kl_coef=0.1, tis="token")
    lp, old, ref, adv, mask, gen, _ = random_batch(3)
    grads = jax.jit(jax.grad(lambda o, r, g: grpo.grpo_loss(lp, o, r, adv, mask, cfg,
                                                            gen_logprobs=g)[0],
                             argnums=(0, 1, 2)))(old, ref, gen)
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    # With logp == old, no KL and no clipping active, d loss / d logp = -A / #valid tokens.
    cfg = GRPOConfig(kl_coef=0.0)
    _, old, _, adv, mask, _, _ = random_batch(4)
    grad = jax.jit(jax.grad(lambda x: grpo.grpo_loss(x, old, None, adv, mask, cfg)[0]))(old)
    want = np.where(mask, -adv[:, None] / mask.sum(), 0)
    np.testing.assert_allclose(grad, want, rtol=1e-6)


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_microbatches_with_global_denominator_add_up(loss_agg):
    cfg = GRPOConfig(loss_agg=loss_agg, kl_coef=0.05, tis="token")
    lp, old, ref, adv, mask, gen, _ = random_batch(5)
    full, _ = loss_fn(lp, old, ref, adv, mask, cfg, gen_logprobs=gen)
    denom = mask.sum() if loss_agg == "token" else (mask.sum(1) > 0).sum()
    parts = [loss_fn(lp[s], old[s], ref[s], adv[s], mask[s], cfg, gen_logprobs=gen[s],
                     denominator=denom)[0] for s in (slice(0, 3), slice(3, None))]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)


def test_k3_kl_clamps():
    cur = jnp.zeros(5)
    ref = jnp.array([0.0, 1.0, -1.0, 30.0, -30.0])
    kl = np.asarray(grpo.k3_kl(cur, ref))
    d = np.array([0.0, 1.0, -1.0, 20.0, -20.0])  # inputs clamped to +-20
    want = np.minimum(np.exp(d) - d - 1, 10)  # output clamped at 10
    np.testing.assert_allclose(kl, want, rtol=1e-6)
    assert kl[0] == 0 and kl[3] == 10 and kl[4] == 10  # e^-20 + 20 - 1 > 10 too


def test_missing_inputs_for_options_are_clear_errors():
    lp, old, ref, adv, mask, gen, _ = random_batch(6)
    with pytest.raises(ValueError, match="gen_logprobs"):
        grpo.grpo_loss(lp, old, ref, adv, mask, GRPOConfig(tis="token"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo.grpo_loss(lp, old, None, adv, mask, GRPOConfig(kl_coef=0.1))


def test_config_is_hashable_and_names_are_checked():
    assert hash(GRPOConfig()) == hash(GRPOConfig())
    with pytest.raises(ValueError, match="GRPOConfig.loss='ppo'.*clipped_pg"):
        GRPOConfig(loss="ppo")


def test_registered_loss_variant_is_one_function():
    @grpo.register_loss("test_unclipped")
    def unclipped(logprobs, old_logprobs, advantages, cfg):
        return -advantages * jnp.exp(logprobs - old_logprobs), {}

    try:
        cfg = GRPOConfig(loss="test_unclipped", kl_coef=0.0)
        lp, old, _, adv, mask, _, _ = random_batch(7)
        loss, _ = loss_fn(lp, old, None, adv, mask, cfg)
        want = (-adv[:, None] * np.exp(lp.astype(np.float64) - old) * mask).sum() / mask.sum()
        np.testing.assert_allclose(loss, want, rtol=1e-5)
    finally:
        del grpo.LOSSES["test_unclipped"]


# ----------------------------------------------------------------------------- advantages

def test_group_advantages_hand_computed():
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = grpo.group_advantages(rewards, 4)
    s = np.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    want = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0, 0, 0]
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    assert np.all(np.asarray(adv[4:]) == 0)  # all-equal group: exactly zero

    np.testing.assert_allclose(grpo.group_advantages(rewards, 4, normalize_std=False),
                               [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    two_d = grpo.group_advantages(rewards.reshape(2, 4), 4)
    assert two_d.shape == (2, 4)
    np.testing.assert_allclose(two_d.reshape(-1), adv)


def test_rloo_advantages_hand_computed():
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
    adv = grpo.group_advantages(rewards, 4, normalize_std=False, estimator="rloo")
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)


def test_group_advantages_bad_shapes():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo.group_advantages(jnp.ones(4), 1)
    with pytest.raises(ValueError, match="do not split"):
        grpo.group_advantages(jnp.ones(6), 4)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        grpo.group_advantages(jnp.ones(4), 2, estimator="nope")
