"""orbax checkpoints: round-trip, shardings, keep-last-N, a save killed half-way."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.checkpoint import CheckpointManager, CheckpointNotFoundError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def make_state(scale=1.0):
    params = {"w": jnp.arange(12.0).reshape(3, 4) * scale,
              "b": (jnp.ones(4) * scale).astype(jnp.bfloat16),
              "emb": jnp.full((2, 3), scale, jnp.float16)}
    return {
        "params": params,
        "opt": optax.adamw(1e-3).init(params),  # namedtuples, an int32 count
        "rng": jax.random.key(7),  # a typed PRNG key
        "rng_data": jax.random.key_data(jax.random.key(8)),  # raw uint32 key data
        "tokens": jnp.array([[1, 2, 3]], jnp.int8),
        "flags": jnp.array([True, False]),
        "step": 41,  # python scalars
        "lr": 0.25,
    }


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, (int, float)):
            assert type(x) is type(y) and x == y
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert x.dtype == y.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_nested_pytree(tmp_path):
    state = make_state()
    meta = {"data_position": 96, "config": {"draft": {"k": 3}}, "note": "hi"}
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, state, meta)
        assert mgr.latest_step() == 3
        restored, got_meta = mgr.restore(target=state)
    assert_same(restored, state)
    assert got_meta == meta
    # the restored key still draws the same numbers
    np.testing.assert_array_equal(jax.random.normal(restored["rng"], (3,)),
                                  jax.random.normal(state["rng"], (3,)))


def test_restore_into_abstract_target_and_without_target(tmp_path):
    state = make_state()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x, state)
    restored, meta = mgr.restore(1, target=abstract)
    assert_same(restored, state)
    assert meta == {}
    # no target: the saved structure as dicts/lists, keys still typed
    raw, _ = mgr.restore()
    assert jax.dtypes.issubdtype(raw["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(raw["rng"]),
                                  jax.random.key_data(state["rng"]))
    np.testing.assert_array_equal(raw["params"]["w"], state["params"]["w"])
    assert raw["step"] == 41


def test_keeps_last_n_and_restores_any_kept_step(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in range(1, 6):
        mgr.save(step, make_state(step), {"step": step})
    assert mgr.all_steps() == [4, 5]
    state, meta = mgr.restore(4, target=make_state())
    assert meta == {"step": 4}
    np.testing.assert_array_equal(state["params"]["w"], make_state(4)["params"]["w"])
    with pytest.raises(CheckpointNotFoundError, match=r"step 2 .* saved steps: \[4, 5\]"):
        mgr.restore(2)


def test_restores_into_the_target_sharding(tmp_path):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x", "y")))
    mgr = CheckpointManager(tmp_path)
    mgr.save(0, {"w": w})
    want = NamedSharding(mesh, P("y", None))
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=want)}
    restored, _ = mgr.restore(target=target)
    assert restored["w"].sharding == want
    np.testing.assert_array_equal(restored["w"], np.arange(64.0).reshape(8, 8))
    # a target given as arrays keeps their shardings too
    restored, _ = mgr.restore(target={"w": w})
    assert restored["w"].sharding == w.sharding


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import jax.numpy as jnp
    from jaxspec.checkpoint import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], async_save=True)
    mgr.save(1, {"w": jnp.ones((512, 1024))}, {"step": 1})
    mgr.wait()
    mgr.save(2, {"w": jnp.full((512, 1024), 2.0)}, {"step": 2})
    # killed while step 2 is being written: once its temporary directory exists (the save
    # writes in a background thread, so right after save() returns it may not yet)
    deadline = time.monotonic() + 60
    while (not any(n.startswith("2.") for n in os.listdir(sys.argv[1]))
           and time.monotonic() < deadline):
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_save_killed_midway_leaves_previous_checkpoint_usable(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    leftovers = sorted(os.listdir(tmp_path))
    assert "1" in leftovers and "2" not in leftovers, leftovers
    assert any(name.startswith("2.") for name in leftovers), leftovers  # unfinalised step 2

    mgr = CheckpointManager(tmp_path)
    assert mgr.all_steps() == [1]
    state, meta = mgr.restore(target={"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32)})
    assert meta == {"step": 1}
    assert float(state["w"].min()) == float(state["w"].max()) == 1.0
    # the run goes on: step 2 saves cleanly over what the killed save left
    mgr.save(2, {"w": jnp.zeros((512, 1024))}, {"step": 2})
    assert mgr.all_steps() == [1, 2]
    assert not any(name.startswith("2.") for name in os.listdir(tmp_path))


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist; nothing to resume"):
        CheckpointManager(tmp_path / "no_such_run", create=False)
    assert not (tmp_path / "no_such_run").exists()
    with pytest.raises(CheckpointNotFoundError, match="no finalised checkpoint"):
        CheckpointManager(tmp_path / "empty").restore()


def test_steps_are_read_from_disk_without_orbax_deprecation_warnings(tmp_path, caplog):
    """A resume's step queries (latest_step, all_steps) see a step another manager saved
    meanwhile, and log none of orbax's "`read` option is deprecated" warnings (three per
    resume before)."""
    state = {"w": jnp.arange(3.0)}
    reader = CheckpointManager(tmp_path)
    with CheckpointManager(tmp_path) as writer:
        writer.save(1, state)
        writer.wait()
    with caplog.at_level("WARNING"):
        assert reader.latest_step() == 1 and reader.all_steps() == [1]
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
