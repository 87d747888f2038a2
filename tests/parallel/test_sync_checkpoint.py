"""Weight sync between disjoint generation / training meshes, and orbax checkpoints saved
on one mesh restored onto another mesh shape (and onto one device)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxspec import parallel
from jaxspec.checkpoint import CheckpointManager


def assert_values_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_on(tree, shardings):
    flat = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    for x, s in zip(jax.tree.leaves(tree), flat, strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)


def test_weight_sync_between_disjoint_meshes(policy, head):
    gen_devices, train_devices = parallel.split_devices(4, 4)
    train_mesh = parallel.make_mesh(data=1, fsdp=2, tensor=2, devices=train_devices)
    gen_mesh = parallel.make_mesh(data=-1, fsdp=1, tensor=2, devices=gen_devices)
    trained = parallel.shard_policy(policy, train_mesh)
    trained_head = parallel.shard_head(head, train_mesh)
    assert {d for x in jax.tree.leaves(trained.params) for d in x.devices()} == set(train_devices)

    targets = parallel.param_shardings(policy, gen_mesh)
    params, seconds = parallel.sync_weights(trained.params, targets)
    head_params, head_seconds = parallel.sync_weights(
        trained_head.params, parallel.param_shardings(head, gen_mesh))
    assert seconds > 0 and head_seconds > 0
    assert_on(params, targets)
    assert {d for x in jax.tree.leaves(params) for d in x.devices()} == set(gen_devices)
    # the embedding is split over tensor (vocab) on the generation mesh, not over fsdp
    embed = params["embed_tokens"][...]
    assert embed.sharding.spec == P("tensor", "fsdp") and embed.addressable_shards[0].data.shape == (64, 64)
    assert_values_equal(params, policy.params)
    assert_values_equal(head_params, head.params)


def test_checkpoint_restores_onto_a_different_mesh(tmp_path, policy):
    mesh = parallel.make_mesh(2, 2, 2)
    sharded = parallel.shard_policy(policy, mesh)
    optimizer = optax.adamw(1e-3)

    @jax.jit
    def updated_opt_state(params):  # a non-trivial state: one update with a fixed pseudo-gradient
        grads = jax.tree.map(lambda x: 0.01 * x + 0.001, params)
        return optimizer.update(grads, optimizer.init(params), params)[1]

    opt_state = updated_opt_state(sharded.params)
    state = {"params": sharded.params, "opt": opt_state, "key": jax.random.key(3), "step": 7}

    with CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(7, state, {"mesh": dict(mesh.shape)})
        other = parallel.make_mesh(1, 4, 2)
        shardings = {"params": parallel.param_shardings(policy, other),
                     "opt": parallel.param_shardings(opt_state, other)}
        target = {
            "params": parallel.restore_target(state["params"], shardings["params"]),
            "opt": parallel.restore_target(state["opt"], shardings["opt"]),
            "key": state["key"], "step": 0,
        }
        restored, meta = manager.restore(7, target)
        assert meta == {"mesh": {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}}
        assert restored["step"] == 7
        assert_on(restored["params"], shardings["params"])
        assert_on(restored["opt"], shardings["opt"])
        assert_values_equal(restored["params"], state["params"])
        assert_values_equal(restored["opt"], state["opt"])
        np.testing.assert_array_equal(
            jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
        # onto one device: a plain single-device sharding is a target too
        one = SingleDeviceSharding(jax.devices()[0])
        restored, _ = manager.restore(7, {"params": parallel.restore_target(state["params"], one),
                                          "opt": parallel.restore_target(state["opt"], one),
                                          "key": state["key"], "step": 0})
        assert all(x.sharding == one for x in jax.tree.leaves(restored["params"]))
        assert_values_equal(restored["params"], policy.params)


def test_sync_weights_rejects_mismatched_targets(policy):
    mesh = parallel.make_mesh(2, 2, 2)
    with pytest.raises(ValueError, match=r"target_shardings \(1 leaves\) do not match the params \(13 leaves\)"):
        parallel.sync_weights(policy.params, {"embed_tokens": NamedSharding(mesh, P())})
    # one Sharding for every leaf is fine
    params, _ = parallel.sync_weights(policy.params, NamedSharding(mesh, P()))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
