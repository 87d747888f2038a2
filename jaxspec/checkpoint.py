"""Save and restore everything a run needs to continue, with orbax.

One checkpoint per step under <directory>/<step>/: the state pytree (params, optimizer
states, PRNG keys, python ints...) and a JSON `meta` (data position, config, ...). orbax
writes each step into a temporary directory and renames it when complete, so a save
killed half-way leaves only an unfinalised temporary directory, which is never listed,
and the previous step restores.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["CheckpointManager", "CheckpointNotFoundError"]

_STATE, _META, _LAYOUT = "state", "meta", "jaxspec"
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


class CheckpointNotFoundError(FileNotFoundError):
    """No usable checkpoint where one was asked for (e.g. resuming a run)."""


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl_name(x) -> str:
    """Name of the PRNG implementation of a typed key array or its ShapeDtypeStruct."""
    for name in _KEY_IMPLS:
        if jax.eval_shape(lambda n=name: jax.random.key(0, impl=n)).dtype == x.dtype:
            return name
    raise ValueError(f"unsupported PRNG key type {x.dtype}")


def _path_str(path) -> str:
    """A key path spelled the same whether a node was a dataclass, a namedtuple or the dict
    orbax restores it as when no target is given: 'opt/0/mu/w'."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _to_savable(tree):
    """Typed PRNG keys -> their uint32 key data (orbax stores plain arrays); numpy scalars ->
    0-d arrays. Returns the tree and {path: impl name} of the keys."""
    keys = {}

    def leaf(path, x):
        if _is_key(x):
            keys[_path_str(path)] = _key_impl_name(x)
            return jax.random.key_data(x)
        if isinstance(x, np.generic):
            return np.asarray(x)
        return x

    return jax.tree_util.tree_map_with_path(leaf, tree), keys


def _abstract(x):
    """The restore target of one leaf: arrays become ShapeDtypeStructs that keep their
    sharding (so the restored array lands in it); python scalars stay as they are."""
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        sharding = getattr(x, "sharding", None)
        if sharding is not None and hasattr(sharding, "spec"):
            # key data has one trailing axis more than the key array
            sharding = jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, None))
        elif sharding is not None and not isinstance(sharding, jax.sharding.SingleDeviceSharding):
            sharding = None
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return x


class CheckpointManager:
    """Numbered checkpoints of (state pytree, JSON meta) in one directory, keeping the last
    `max_to_keep`. `create=False` refuses a missing directory (resuming)."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 create: bool = True, async_save: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        if not create and not os.path.isdir(self.directory):
            raise CheckpointNotFoundError(
                f"checkpoint directory {self.directory!r} does not exist; nothing to resume "
                f"from (start without resume, or point run.dir at an earlier run)")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=create,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # remove what a killed save left behind
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(_STATE, _META, _LAYOUT))

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Finalised steps, ascending (a save still in progress or killed is not one), read
        from disk (`reload`: orbax's `all_steps(read=True)` does the same with a deprecation
        warning on every call)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save / restore
    def save(self, step: int, state: Any, meta: dict | None = None) -> None:
        """Save `state` (any pytree of arrays, PRNG keys and python scalars) and the
        JSON-serialisable `meta` as `step`. Returns once written unless async_save, in
        which case `wait()` blocks until it is final."""
        savable, keys = _to_savable(state)
        args = ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(savable),
            _META: ocp.args.JsonSave(dict(meta or {})),
            _LAYOUT: ocp.args.JsonSave({"version": 1, "prng_keys": keys}),
        })
        if not self._manager.save(int(step), args=args, force=True):
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")

    def wait(self) -> None:
        """Block until an asynchronous save is final."""
        self._manager.wait_until_finished()

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """(state, meta) of `step` (default: the latest).

        `target` is a pytree like the saved state whose array leaves are arrays or
        jax.ShapeDtypeStructs (e.g. from jax.eval_shape); arrays are restored with its
        dtypes and shardings, and the tree takes its structure. Without a target, the
        saved structure comes back as nested dicts/lists with arrays on their saved
        shardings where this process has those devices, else on one device.
        Typed PRNG keys come back as typed keys either way."""
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(
                    f"no finalised checkpoint in {self.directory!r} "
                    f"(found: {sorted(os.listdir(self.directory)) or 'nothing'})")
            step = steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self.directory!r}; saved steps: {steps}")
        if target is None:  # saved on devices this process lacks (other hosts): one device
            state_args = ocp.args.StandardRestore(
                fallback_sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        else:
            state_args = ocp.args.StandardRestore(jax.tree.map(_abstract, target))
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: state_args, _META: ocp.args.JsonRestore(), _LAYOUT: ocp.args.JsonRestore()}))
        layout = restored[_LAYOUT] or {}
        state = restored[_STATE]
        if target is not None:  # orbax returns the target's structure
            state = jax.tree.map(
                lambda t, x: jax.random.wrap_key_data(x, impl=_key_impl_name(t))
                if _is_key(t) else x, target, state)
        elif keys := layout.get("prng_keys", {}):
            state = jax.tree_util.tree_map_with_path(
                lambda p, x: (jax.random.wrap_key_data(x, impl=keys[_path_str(p)])
                              if _path_str(p) in keys else x), state)
        return state, dict(restored[_META] or {})

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
