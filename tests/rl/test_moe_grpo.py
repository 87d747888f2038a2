"""GRPO on a mixture-of-experts policy: the router losses (grpo.router_aux_coef /
router_z_coef) enter the update's loss exactly as a NumPy computation from the forward's
router logits says, and their gradients reach the router."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.config import ConfigError, load_config
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.steps import POLICY_INPUTS, policy_update, score_rollouts

SGD = optax.sgd(0.1)  # params move by the gradient itself


def _np_router_losses(logits, tokens, top_k):  # [L, B, T, E], [B, T] -> (aux, z) in float64
    rows = np.asarray(logits, np.float64).reshape(logits.shape[0], -1, logits.shape[-1])
    m = np.asarray(tokens, np.float64).reshape(-1)
    z = rows - rows.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[..., :top_k]
    counts = (chosen[..., None] == np.arange(rows.shape[-1])).sum(-2)
    n = m.sum() * rows.shape[0]
    f = (counts * m[None, :, None]).sum((0, 1)) / n
    p = (probs * m[None, :, None]).sum((0, 1)) / n
    lse = np.log(np.exp(rows).sum(-1))
    return rows.shape[-1] * np.sum(f * p), (lse**2 * m[None]).sum() / n


def test_router_losses_enter_the_grpo_update():
    cfg = ModelConfig.tiny("qwen3_moe", vocab_size=48, hidden_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16, moe_intermediate_size=16)
    policy = random_policy(cfg, seed=1)
    rng = np.random.default_rng(0)
    batch = (jnp.asarray(rng.integers(1, 48, (4, 3)), jnp.int32), jnp.array([3, 2, 3, 1], jnp.int32),
             jnp.asarray(rng.integers(1, 48, (4, 6)), jnp.int32), jnp.array([6, 4, 1, 5], jnp.int32),
             jnp.zeros((4, 6), jnp.float32))
    sampling = SamplingConfig(1.0)
    scored = score_rollouts(policy, None, *batch, sampling, chunk=0)
    scored = {k: scored[k] for k in POLICY_INPUTS if k in scored}
    adv = jnp.array([1.0, -0.5, 0.3, -0.8])
    _, _, _, routing = policy.forward(scored["tokens"], scored["positions"], routing=True)
    aux, z = _np_router_losses(routing["router_logits"], scored["positions"] >= 0, 2)
    out = {}
    for name, (a, zc) in {"off": (0.0, 0.0), "on": (0.5, 0.25)}.items():
        grpo = GRPOConfig(kl_coef=0.0, logprob_chunk=0, router_aux_coef=a, router_z_coef=zc)
        out[name] = policy_update(policy, SGD.init(policy.params), scored, adv, sampling,
                                  optimizer=SGD, grpo_cfg=grpo, minibatches=1, filtered=False)
    on, off = out["on"][2], out["off"][2]
    np.testing.assert_allclose(float(on["router_aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(on["router_z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(on["loss"]) - float(off["loss"]), 0.5 * aux + 0.25 * z,
                               rtol=1e-4)
    router = lambda p: np.asarray(p.params["layers"]["moe"]["router"][...])  # noqa: E731
    moved = np.abs(router(out["on"][0]) - router(out["off"][0])).max()
    assert moved > 1e-4  # the router losses' gradients reach the router


def test_bad_router_coefficient_is_one_config_error():
    with pytest.raises(ConfigError, match=r"grpo.router_aux_coef.*-0.1.*>= 0"):
        load_config(None, ["grpo.router_aux_coef=-0.1"])
