"""Expert parallelism: an MoE policy's experts split over the `expert` mesh axis (composed
with data, fsdp and tensor) give one device's forward, generation and GRPO update.

The experts' stacked weights [layers, E, H, I] shard E over `expert` (rule experts ->
expert), H over fsdp and I over tensor; GSPMD inserts the collectives. Tolerances as the
other parallel tests: 1e-5 (float32; the sharded sums run in another order)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec import parallel
from jaxspec.decoding.drafters import Eagle3Drafter
from jaxspec.decoding.engine import generate
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.transformer import random_policy
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.steps import POLICY_INPUTS, policy_update, score_rollouts

# (data, fsdp, tensor, expert) splits of the 8 simulated devices
MESHES = {"d2t2e2": (2, 1, 2, 2), "f2e4": (1, 2, 1, 4)}
PROMPTS = [[5, 9, 5, 9, 5, 9, 5], [7, 8, 9], [10, 11, 12, 13, 10, 11], [3, 3, 3, 3]]
ROWS = np.arange(4, dtype=np.int32)
SGD = optax.sgd(0.1)


@pytest.fixture(scope="module")
def moe():
    cfg = ModelConfig.tiny("qwen3_moe", num_layers=2, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=16)
    return random_policy(cfg, seed=6)


def _mesh(name):
    data, fsdp, tensor, expert = MESHES[name]
    return parallel.make_mesh(data, fsdp, tensor, expert=expert)


def test_expert_weights_split_over_the_expert_axis(moe):
    mesh = _mesh("d2t2e2")
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    shardings = parallel.param_shardings(moe, mesh)["layers"]["moe"]
    assert shardings["gate_proj"].spec == P(None, "expert", "fsdp", "tensor")
    assert shardings["down_proj"].spec == P(None, "expert", "tensor", "fsdp")
    assert shardings["router"].spec == P(None, "fsdp", None)
    placed = parallel.shard_policy(moe, mesh).params["layers"]["moe"]["gate_proj"][...]
    assert {s.data.shape for s in placed.addressable_shards} == {(2, 4, 64, 16)}
    six = Policy.abstract(moe.config.replace(num_experts=6))  # 6 experts over 4: refused
    with pytest.raises(ValueError, match=r"'experts', size 6\) is not divisible by mesh axes "
                                         r"'expert' of size 4"):
        parallel.param_shardings(six, parallel.make_mesh(2, 1, 1, expert=4))


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_forward_and_generation_equal_one_device(moe, name):
    mesh = _mesh(name)
    sharded = parallel.shard_policy(moe, mesh)
    head = Eagle3Head.init_for(moe, 64, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), tokens.shape)
    ref_logits, _, _, ref_routing = moe.forward(tokens, positions, routing=True)
    kwargs = dict(drafter=Eagle3Drafter(head, k=2), sampling=SamplingConfig(1.0),
                  max_new_tokens=8, key=jax.random.key(3))
    ref = generate(moe, PROMPTS, rows=ROWS, **kwargs)
    with jax.set_mesh(mesh):
        logits, _, _, routing = sharded.forward(parallel.shard_batch(tokens, mesh),
                                                parallel.shard_batch(positions, mesh),
                                                routing=True)
        kwargs["drafter"] = Eagle3Drafter(parallel.shard_head(head, mesh), k=2)
        got = generate(sharded, PROMPTS, rows=parallel.shard_batch(ROWS, mesh), **kwargs)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(routing["experts"]), np.asarray(ref_routing["experts"]))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(ref.routes))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)


def _update(policy, batch, mesh=None):
    sampling = SamplingConfig(1.0)
    grpo = GRPOConfig(kl_coef=0.0, logprob_chunk=0, router_aux_coef=0.01, router_z_coef=0.001)
    adv = jnp.array([1.0, -0.5, 0.3, -0.8])
    if mesh is not None:
        policy = parallel.shard_policy(policy, mesh)
        batch = parallel.shard_batch(batch, mesh)
        adv = parallel.shard_batch(adv, mesh)
    scored = score_rollouts(policy, None, *batch, sampling, chunk=0)
    scored = {k: scored[k] for k in POLICY_INPUTS if k in scored}
    new, _, metrics = policy_update(policy, SGD.init(policy.params), scored, adv, sampling,
                                    optimizer=SGD, grpo_cfg=grpo, minibatches=1, filtered=False)
    return jax.tree.map(np.asarray, new.params), jax.tree.map(np.asarray, metrics)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_grpo_update_equals_one_device(moe, name):
    """score_rollouts + policy_update (with both router losses on) over the expert mesh."""
    rng = np.random.default_rng(1)
    batch = (rng.integers(1, 128, (4, 3)).astype(np.int32), np.array([3, 2, 3, 1], np.int32),
             rng.integers(1, 128, (4, 6)).astype(np.int32), np.array([6, 4, 1, 5], np.int32),
             np.full((4, 6), -2.0, np.float32))
    ref_params, ref_metrics = _update(moe, batch)
    mesh = _mesh(name)
    with jax.set_mesh(mesh):
        params, metrics = _update(moe, batch, mesh)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert float(ref_metrics["router_aux_loss"]) > 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
