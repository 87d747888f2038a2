"""An MoE layer's tokens routed per batch shard (jaxspec.models.moe._per_shard) on 8 simulated
devices equal the dense reference on one device (every expert over every token, the unchosen
weighted 0), outputs and gradients in float32: the XLA blocked path under vmap, and the
grouped Pallas kernel (interpreted) in a shard_map whose expert weights are all-gathered
inside it. Meshes split the rows over data and fsdp together, or over fsdp alone with the
weights' embed split too; a tensor split keeps the XLA path."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxspec import parallel
from jaxspec.kernels import target_platform
from jaxspec.models import ModelConfig
from jaxspec.models import moe as moe_module
from jaxspec.models.moe import MoE

E, TOPK, H, I, B, T = 8, 2, 32, 16, 8, 8


def _moe(backend):
    cfg = ModelConfig.tiny("qwen3_moe", vocab_size=64, hidden_size=H, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=16, num_experts=E,
                           num_experts_per_tok=TOPK, moe_intermediate_size=I,
                           expert_backend=backend)
    return MoE(cfg, rngs=nnx.Rngs(3))


def _loss_and_grads(module, x, c):
    graphdef, state = nnx.split(module)

    def loss(state, x):
        out, _, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(out * c)

    value, (g_state, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    return float(value), jax.tree.map(np.asarray, g_state), np.asarray(g_x)


def _placed(module, mesh):
    graphdef, state = nnx.split(module)
    specs = nnx.get_partition_spec(state)
    state = jax.tree.map(
        lambda v, names: jax.device_put(v, NamedSharding(mesh, parallel.logical_to_mesh(tuple(names))))
        if names else v, state, specs, is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
@pytest.mark.parametrize("mesh_sizes", [(2, 4, 1), (1, 8, 1), (1, 4, 2)],
                         ids=["data2-fsdp4", "fsdp8", "fsdp4-tensor2"])
def test_per_shard_routing_equals_the_dense_reference(kernel, mesh_sizes, monkeypatch):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    want_value, want_state, want_x = _loss_and_grads(_moe("dense"), x, c)

    used = []
    if kernel:  # the Pallas kernel interpreted on this CPU, in a forward built for a GPU
        orig = MoE._grouped
        monkeypatch.setattr(MoE, "_grouped", lambda self, *a, **kw: used.append(1) or
                            orig(self, *a, **{**kw, "interpret": True}))
    data, fsdp, tensor = mesh_sizes
    mesh = parallel.make_mesh(data, fsdp, tensor)
    shards = []
    real = moe_module._per_shard
    monkeypatch.setattr(moe_module, "_per_shard", lambda *a, **kw: shards.append(
        parallel.row_shards(a[2])) or real(*a, **kw))
    platform = target_platform("gpu" if kernel else "cpu")
    with jax.set_mesh(mesh), platform:
        value, state, gx = _loss_and_grads(_placed(_moe("blocked"), mesh), x, c)
    assert shards and set(shards) == {data * fsdp}
    assert bool(used) == (kernel and tensor == 1)  # a tensor split keeps the XLA path
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    np.testing.assert_allclose(gx, want_x, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.clear_caches()
