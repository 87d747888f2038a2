"""Meshes, device splits, rules, batch/cache shardings, `constrain`, multi-host start-up
arguments: shapes and errors checked against hand-written expectations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec import parallel
from jaxspec.models import KVCache


@pytest.mark.parametrize(
    "sizes, shape",
    [((-1, 1, 1), (8, 1, 1)), ((2, 2, 2), (2, 2, 2)), ((1, -1, 2), (1, 4, 2)), ((2, 1, -1), (2, 1, 4))],
)
def test_make_mesh_shapes(sizes, shape):
    mesh = parallel.make_mesh(*sizes)
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert tuple(mesh.shape.values()) == shape[:2] + (1,) + shape[2:]  # expert 1 by default
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 4
    # devices in the given order, tensor innermost
    np.testing.assert_array_equal(
        np.vectorize(lambda d: d.id)(mesh.devices).ravel(), [d.id for d in jax.devices()])


@pytest.mark.parametrize(
    "sizes, match",
    [
        ((3, 1, -1), "fixed axes need a multiple of 3 devices, but there are 8"),
        ((2, 2, 1), r"data=2 x fsdp=2 x tensor=1 = 4 devices, but there are 8"),
        ((-1, -1, 1), "at most one axis may be -1"),
        ((0, 1, 1), r"mesh data=0; valid: an int >= 1, or -1"),
    ],
)
def test_make_mesh_errors_name_the_numbers(sizes, match):
    with pytest.raises(ValueError, match=match):
        parallel.make_mesh(*sizes)


def test_split_devices_gives_disjoint_meshes():
    gen, train = parallel.split_devices(4, 4)
    assert not set(gen) & set(train) and len(gen) == len(train) == 4
    gen_mesh = parallel.make_mesh(data=-1, tensor=2, devices=gen)
    train_mesh = parallel.make_mesh(data=1, fsdp=2, tensor=2, devices=train)
    assert set(gen_mesh.devices.flat) == set(jax.devices()[:4])
    assert set(train_mesh.devices.flat) == set(jax.devices()[4:])
    assert len(parallel.split_devices(2, 3)[1]) == 3
    with pytest.raises(ValueError, match="n_gen=6 \\+ n_train=4 = 10 devices, but only 8"):
        parallel.split_devices(6, 4)
    with pytest.raises(ValueError, match="n_train=0"):
        parallel.split_devices(4, 0)


def test_rules_resolution_and_errors():
    rules = parallel.resolve_rules({"embed": None, "batch": ["data"]})
    assert rules["embed"] is None and rules["batch"] == ("data",) and rules["vocab"] == ("tensor",)
    assert parallel.resolve_rules() == {
        k: ((v,) if isinstance(v, str) else v) for k, v in parallel.DEFAULT_RULES.items()}
    with pytest.raises(ValueError, match="unknown logical axis 'kv_head'"):
        parallel.resolve_rules({"kv_head": "tensor"})
    with pytest.raises(ValueError, match="unknown mesh axis.*'model'"):
        parallel.resolve_rules({"mlp": "model"})
    with pytest.raises(ValueError, match="names a mesh axis twice"):
        parallel.resolve_rules({"batch": ["data", "data"]})


def test_logical_to_mesh_uses_each_mesh_axis_once():
    assert parallel.logical_to_mesh(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    assert parallel.logical_to_mesh(parallel.KV_CACHE_AXES) == P(None, ("data", "fsdp"), None, "tensor", None)
    assert parallel.logical_to_mesh(("embed", "mlp")) == P("fsdp", "tensor")
    assert parallel.logical_to_mesh(("batch", None), {"batch": "data"}) == P("data", None)
    assert parallel.logical_to_mesh(("experts", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    with pytest.raises(ValueError, match="'routers' has no sharding rule"):
        parallel.logical_to_mesh(("routers", "embed"))


def test_shard_batch_global_and_errors():
    mesh = parallel.make_mesh(2, 2, 2)
    tokens = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    out = parallel.shard_batch({"tokens": tokens, "rows": np.arange(8)}, mesh)
    assert out["tokens"].sharding.spec == P(("data", "fsdp"), None)
    assert out["rows"].sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(out["tokens"]), tokens)
    # each device holds a quarter of the rows, replicated over tensor
    shard = out["tokens"].addressable_shards[0]
    assert shard.data.shape == (2, 5)
    with pytest.raises(ValueError, match="batch 6 is not divisible by the 4 batch shards"):
        parallel.shard_batch(np.zeros((6, 3)), mesh)
    local = parallel.shard_batch(tokens, mesh, process_local=True)  # one process: local == global
    np.testing.assert_array_equal(np.asarray(local), tokens)


def test_shard_cache_and_constrain():
    mesh = parallel.make_mesh(2, 2, 2)
    cache = KVCache.create(num_layers=2, batch=4, max_len=6, num_kv_heads=2, head_dim=4, dtype=jnp.float32)
    cache = KVCache(k=cache.k + jnp.arange(4.0)[None, :, None, None, None], v=cache.v, lengths=cache.lengths + 1)
    sharded = parallel.shard_cache(cache, mesh)
    assert sharded.k.sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    assert sharded.k.addressable_shards[0].data.shape == (2, 1, 6, 1, 4)
    assert sharded.lengths.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(sharded.k), np.asarray(cache.k))
    with pytest.raises(ValueError, match="cache kv_heads 2 is not divisible by its 4 shards"):
        parallel.shard_cache(cache, parallel.make_mesh(1, 2, 4))

    @jax.jit
    def double(x):  # [B, T, H]
        return parallel.constrain(2 * x, ("batch", "length", "embed"))

    x = jnp.arange(8 * 3 * 4, dtype=jnp.float32).reshape(8, 3, 4)
    np.testing.assert_array_equal(np.asarray(double(x)), 2 * np.asarray(x))  # no mesh: no-op
    with jax.set_mesh(mesh):
        y = double(x)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))), 3)
    assert y.addressable_shards[0].data.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
    with pytest.raises(ValueError, match="logical axes \\('batch',\\) for an array of shape \\(8, 3, 4\\)"):
        parallel.constrain(x, ("batch",))


def test_initialize_distributed_single_process_is_a_no_op(monkeypatch):
    for name in ("JAXSPEC_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS", "JAXSPEC_NUM_PROCESSES",
                 "JAXSPEC_PROCESS_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert parallel.initialize_distributed() is False
    assert parallel.initialize_distributed(num_processes=1) is False
    monkeypatch.setenv("JAXSPEC_NUM_PROCESSES", "1")
    assert parallel.initialize_distributed() is False
    assert not jax.distributed.is_initialized() and jax.process_count() == 1


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"num_processes": 2, "process_id": 0}, {}, r"missing coordinator_address \(\$JAXSPEC_COORDINATOR_ADDRESS\)"),
        ({"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 2}, {},
         r"process_id=2; valid: 0 \.\. 1"),
        ({"num_processes": 2, "process_id": 1}, {"JAX_COORDINATOR_ADDRESS": "nohostport"},
         "coordinator_address='nohostport'; expected 'host:port'"),
        ({}, {"JAXSPEC_NUM_PROCESSES": "two"}, r"\$JAXSPEC_NUM_PROCESSES = 'two' is not an int"),
    ],
)
def test_initialize_distributed_errors(monkeypatch, kwargs, env, match):
    for name in ("JAXSPEC_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS", "JAXSPEC_NUM_PROCESSES",
                 "JAXSPEC_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        parallel.initialize_distributed(**kwargs)
