"""Meshes, logical-axis sharding rules, weight sync between meshes, multi-host start-up.

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`,
`mlp`, `layers`, and `experts` for an MoE policy's stacked experts) as nnx metadata;
activations use `batch` and `length`. One table of rules maps each logical axis to a mesh
axis of the ("data", "fsdp", "expert", "tensor") mesh, a tuple of them, or None
(replicated), so changing the parallelism is a config change. Expert parallelism: the
`expert` axis holds a slice of every MoE layer's experts (rule `experts -> expert`); a dense
model ignores it (size 1 by default). Tokens are not split over it unless the `batch` rule
names it (`rules.batch: [data, fsdp, expert]`, data parallel over the expert groups, as
MaxText's expert parallelism does).

Everything runs under GSPMD: put the params and the batch on their shardings, enter
`jax.set_mesh(mesh)`, and call the ordinary functions (`Policy.forward`, `generate`, a
jitted train step); XLA propagates the shardings through the program. A mesh's axes are
`AxisType.Auto` for that reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.models import KVCache, Policy
from jaxspec.models.hf import config_from_hf
from jaxspec.errors import FieldError

__all__ = [
    "DEFAULT_RULES",
    "KV_CACHE_AXES",
    "LOGICAL_AXES",
    "MESH_AXES",
    "batch_sharding",
    "cache_shardings",
    "check_mesh_sizes",
    "constrain",
    "constrain_params",
    "constrain_rows",
    "gather_weight",
    "hf_shardings",
    "initialize_distributed",
    "local_batch_rows",
    "logical_to_mesh",
    "make_mesh",
    "param_shardings",
    "place",
    "resolve_rules",
    "row_shards",
    "restore_target",
    "shard_batch",
    "shard_cache",
    "shard_head",
    "shard_policy",
    "split_devices",
    "sync_weights",
    "use_rules",
]

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis -> mesh axis (or a tuple of mesh axes, or None = replicated).
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # activations, rollouts, KV cache rows
    "length": None,  # sequence / KV cache slots
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "experts": "expert",  # an MoE layer's expert index (jaxspec.models.moe)
}
LOGICAL_AXES = tuple(DEFAULT_RULES)

# The KV cache's k / v: [layers, batch, max_len, kv_heads, head_dim].
KV_CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


# --------------------------------------------------------------------------- meshes


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None, *,
              expert: int = 1) -> Mesh:
    """A ("data", "fsdp", "expert", "tensor") mesh over `devices` (default: all, every
    process's).

    One size may be -1: it takes the devices the others leave. Devices are laid out in
    the given order with `tensor` innermost and `expert` next, so with the default order
    (process-major) tensor and expert groups stay inside a host (their all-to-all and
    all-reduce traffic on the fast links) and `data` spans hosts.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    check_mesh_sizes(sizes)
    fill = [name for name, size in sizes.items() if size == -1]
    n = len(devices)
    if n == 0:
        raise ValueError("make_mesh: no devices given")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    shown = " x ".join(f"{k}={v}" for k, v in sizes.items() if k != "expert" or v != 1)
    if fill:
        if n % fixed:
            raise ValueError(
                f"mesh {shown}: the fixed axes need a multiple of {fixed} devices, but there are "
                f"{n}; choose sizes whose product divides {n}"
            )
        sizes[fill[0]] = n // fixed
    elif fixed != n:
        raise ValueError(
            f"mesh {shown} = {fixed} devices, but there are {n}; make the product {n} or set one "
            f"axis to -1 (or pass devices=)"
        )
    shape = tuple(int(sizes[a]) for a in MESH_AXES)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_mesh_sizes(sizes: Mapping[str, int]) -> None:
    """Each mesh axis size an int >= 1 or -1 (the remaining devices), at most one -1."""
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
            raise FieldError("mesh", name, size, "out of range",
                             "an int >= 1, or -1 for the remaining devices",
                             message=f"mesh {name}={size!r}; valid: an int >= 1, or -1 for the "
                                     f"remaining devices")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise FieldError("mesh", fill[-1], -1, f"at most one axis may be -1; got -1 for {fill}",
                         "an int >= 1 (one axis only may be -1)",
                         message=f"mesh sizes {dict(sizes)}: at most one axis may be -1; got -1 "
                                 f"for {fill}")


def split_devices(n_gen: int, n_train: int, devices=None) -> tuple[list, list]:
    """Disjoint device groups (generation, training): the first n_gen devices and the next n_train."""
    devices = list(jax.devices() if devices is None else devices)
    for name, n in (("n_gen", n_gen), ("n_train", n_train)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"split_devices {name}={n!r}; must be an int >= 1")
    if n_gen + n_train > len(devices):
        raise ValueError(
            f"split_devices: n_gen={n_gen} + n_train={n_train} = {n_gen + n_train} devices, "
            f"but only {len(devices)} are available"
        )
    return devices[:n_gen], devices[n_gen:n_gen + n_train]


# --------------------------------------------------------------------------- rules

_ACTIVE_RULES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "jaxspec_sharding_rules", default=None)



def resolve_rules(rules: Mapping[str, Any] | None = None) -> dict[str, tuple[str, ...] | None]:
    """DEFAULT_RULES overridden by `rules` (None: those of an enclosing `use_rules`), every
    target normalised to a tuple of mesh axes or None.

    Unknown logical axes and unknown mesh axes are errors (a typo would silently replicate).
    """
    rules = _ACTIVE_RULES.get() if rules is None else rules
    merged: dict[str, Any] = dict(DEFAULT_RULES)
    for logical, target in (rules or {}).items():
        if logical not in DEFAULT_RULES:
            raise ValueError(f"sharding rule for unknown logical axis {logical!r}; known: {list(LOGICAL_AXES)}")
        merged[logical] = target
    out: dict[str, tuple[str, ...] | None] = {}
    for logical, target in merged.items():
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        bad = [a for a in axes if a not in MESH_AXES]
        if bad or not all(isinstance(a, str) for a in axes):
            raise ValueError(
                f"sharding rule {logical} -> {target!r}: unknown mesh axis {bad or target!r}; "
                f"valid: None, one of {MESH_AXES}, or a list of them"
            )
        if len(set(axes)) != len(axes):
            raise ValueError(f"sharding rule {logical} -> {target!r} names a mesh axis twice")
        out[logical] = axes or None
    return out


def logical_to_mesh(logical_axes: Sequence[str | None], rules: Mapping[str, Any] | None = None) -> P:
    """PartitionSpec of mesh axes for one array's logical axes (None entries stay None).

    A mesh axis already used by an earlier dimension is not used again (that dimension is
    replicated instead), e.g. ("batch", "length", "embed") -> P(("data", "fsdp"), None, None).
    """
    rules = resolve_rules(rules)
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {list(LOGICAL_AXES)}")
        axes = tuple(a for a in (rules[name] or ()) if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def _spec_size(spec: P, mesh: Mesh, dim: int) -> int:
    entry = spec[dim] if dim < len(spec) else None
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return math.prod(mesh.shape[a] for a in axes)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _params_of(tree):
    """The params of a Policy / Eagle3Head (anything with an nnx.State `params`), else the tree."""
    if dataclasses.is_dataclass(tree) and hasattr(tree, "params"):
        return tree.params
    return tree


def param_shardings(tree, mesh: Mesh, rules: Mapping[str, Any] | None = None):
    """NamedShardings for params tagged with logical axes (nnx metadata), by the rules.

    `tree`: a Policy or Eagle3Head (-> shardings for its `.params`), any pytree of nnx
    Variables (params, an optax state of them; arrays or ShapeDtypeStructs), or a tree of
    PartitionSpecs of logical names (`policy.logical_axes`; no shapes to check). Untagged
    leaves (a head's d2t, an optimizer's step count) are replicated. A dimension that the
    mesh axes do not divide is an error naming the parameter.
    """
    rules = resolve_rules(rules)
    tree = _params_of(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0]
    given = all(_is_spec(leaf) for _, leaf in leaves)  # e.g. policy.logical_axes
    logical = tree if given else nnx.get_partition_spec(tree)
    specs, treedef = jax.tree_util.tree_flatten(logical, is_leaf=_is_spec)
    if len(specs) != len(leaves):
        raise ValueError(f"param_shardings: {len(specs)} logical specs for {len(leaves)} leaves")
    out = []
    for (path, leaf), names in zip(leaves, specs):
        names = tuple(names) if isinstance(names, P) else ()
        shape = (None,) * len(names) if given else np.shape(leaf)
        if names and len(names) != len(shape):
            raise ValueError(
                f"param {jax.tree_util.keystr(path)}: logical axes {names} do not match its shape {shape}"
            )
        unknown = [name for name in names if name is not None and name not in rules]
        if unknown:
            raise ValueError(
                f"param {jax.tree_util.keystr(path)}: logical axes {unknown} have no sharding rule; "
                f"known: {list(LOGICAL_AXES)}"
            )
        spec = logical_to_mesh(names, rules)
        for dim, size in enumerate(shape):
            parts = _spec_size(spec, mesh, dim)
            if size is not None and size % parts:
                raise ValueError(
                    f"param {jax.tree_util.keystr(path)} {shape}: dimension {dim} ({names[dim]!r}, "
                    f"size {size}) is not divisible by mesh axes {spec[dim]!r} of size {parts}; "
                    f"change the mesh or the rule for {names[dim]!r}"
                )
        out.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(treedef, out)


def _place(x, sharding):
    """`x` on `sharding`. A host value (numpy, or an array on this process's devices only)
    going to a multi-process sharding is sliced into this process's shards: no
    cross-process traffic (jax.device_put would all-gather it to check it is the same
    everywhere)."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _place(jax.random.key_data(x), sharding)  # key data: one trailing axis, whole
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _place_tree(tree, shardings):
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: _place(x, shardings), tree)
    return jax.tree.map(_place, tree, shardings)


def place(tree, shardings):
    """`tree` (host values, or arrays of this process) on `shardings` (a matching tree, or one
    Sharding for every leaf). A multi-process sharding takes each process's own shards from
    its copy of the value, with no cross-process traffic: every process must hold the same
    value."""
    return _place_tree(tree, shardings)


def shard_policy(policy, mesh: Mesh, rules: Mapping[str, Any] | None = None):
    """The policy with its params placed on their rule shardings (a copy; config unchanged)."""
    return policy.replace(params=_place_tree(policy.params, param_shardings(policy, mesh, rules)))


def shard_head(head, mesh: Mesh, rules: Mapping[str, Any] | None = None):
    """An Eagle3Head with params on their rule shardings and buffers (d2t) replicated."""
    params = _place_tree(head.params, param_shardings(head, mesh, rules))
    buffers = _place_tree(head.buffers, NamedSharding(mesh, P()))
    return dataclasses.replace(head, params=params, buffers=buffers)


def hf_shardings(path, mesh: Mesh, rules: Mapping[str, Any] | None = None):
    """Shardings for `load_hf(path, shardings=...)`, built from the checkpoint's config.json."""
    config_file = pathlib.Path(os.fspath(path)).expanduser() / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: a HF checkpoint needs config.json")
    config = config_from_hf(json.loads(config_file.read_text()))
    return param_shardings(Policy.abstract(config), mesh, rules)


def restore_target(
    tree,  # pytree of arrays / ShapeDtypeStructs (python scalars pass through)
    shardings,  # the same tree of Shardings, or one Sharding
):
    """ShapeDtypeStructs carrying `shardings` (a matching tree or one Sharding): the target that
    makes an orbax / `CheckpointManager.restore` land each array on its sharding."""
    def leaf(x, sharding):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
        return x

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: leaf(x, shardings), tree)
    return jax.tree.map(leaf, tree, shardings)


# --------------------------------------------------------------------------- activations


def batch_sharding(mesh: Mesh, ndim: int = 1, rules: Mapping[str, Any] | None = None) -> NamedSharding:
    """Sharding of an array whose leading axis is the batch ([B, ...] with `ndim` dims)."""
    return NamedSharding(mesh, logical_to_mesh(("batch",) + (None,) * (ndim - 1), rules))


def shard_batch(
    batch,  # pytree of [B, ...] (global) or [B_local, ...] (process_local) arrays
    mesh: Mesh,
    rules: Mapping[str, Any] | None = None,
    *,
    process_local: bool = False,
):
    """Put a pytree of [B, ...] arrays (prompts, rollouts, rollout ids) on the batch sharding.

    process_local=False: every process passes the whole global batch (the same values; each
    keeps only its shards).
    process_local=True: each process passes only its own rows (the rows its devices hold,
    in order); the global batch is their concatenation over processes.
    """
    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0:
            raise ValueError("shard_batch: scalars have no batch axis")
        sharding = batch_sharding(mesh, x.ndim, rules)
        parts = _spec_size(sharding.spec, mesh, 0)
        if process_local:
            global_rows = x.shape[0] * jax.process_count()
            if global_rows % parts:
                raise ValueError(
                    f"shard_batch: global batch {global_rows} ({x.shape[0]} rows x "
                    f"{jax.process_count()} processes) is not divisible by the {parts} batch shards "
                    f"({sharding.spec[0]!r})"
                )
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        if x.shape[0] % parts:
            raise ValueError(
                f"shard_batch: batch {x.shape[0]} is not divisible by the {parts} batch shards "
                f"({sharding.spec[0]!r} of mesh {dict(mesh.shape)})"
            )
        return _place(x, sharding)

    return jax.tree.map(put, batch)


def local_batch_rows(mesh: Mesh, global_batch: int, rules: Mapping[str, Any] | None = None) -> np.ndarray:
    """The global row indices this process's devices hold under the batch sharding, in order:
    the rows a multi-host data loader should read here (then `shard_batch(..., process_local=True)`)."""
    sharding = batch_sharding(mesh, 1, rules)
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((global_batch,)).values():
        rows.update(range(*index[0].indices(global_batch)))
    return np.asarray(sorted(rows), np.int64)


def cache_shardings(mesh: Mesh, rules: Mapping[str, Any] | None = None) -> KVCache:
    """A KVCache of NamedShardings: k, v over batch and kv_heads, lengths over batch."""
    kv = NamedSharding(mesh, logical_to_mesh(KV_CACHE_AXES, rules))
    return KVCache(k=kv, v=kv, lengths=batch_sharding(mesh, 1, rules))


def shard_cache(
    cache: KVCache,  # k, v [layers, B, max_len, kv_heads, head_dim], lengths [B]
    mesh: Mesh,
    rules: Mapping[str, Any] | None = None,
) -> KVCache:
    """The cache placed on `cache_shardings` (batch and kv_heads must divide their mesh axes)."""
    shardings = cache_shardings(mesh, rules)
    for dim, name in ((1, "batch"), (3, "kv_heads")):
        parts = _spec_size(shardings.k.spec, mesh, dim)
        if cache.k.shape[dim] % parts:
            raise ValueError(
                f"shard_cache: cache {name} {cache.k.shape[dim]} is not divisible by its "
                f"{parts} shards ({shardings.k.spec[dim]!r})"
            )
    return _place_tree(cache, shardings)


@contextlib.contextmanager
def use_rules(rules: Mapping[str, Any] | None):
    """The rules every function here uses when given none (`rules=None`), inside the block
    (a run's `mesh.rules`; None: DEFAULT_RULES). Traced functions are
    cached without them: a constraint only places values, so a stale one costs
    communication, never a wrong number."""
    token = _ACTIVE_RULES.set(None if rules is None else dict(rules))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def constrain(
    x,  # [d0, d1, ...] one logical axis name per dimension
    logical_axes: Sequence[str | None],
    rules: Mapping[str, Any] | None = None,
):
    """Inside jit: pin `x` to the rules' sharding on the mesh set by `jax.set_mesh`; without
    a mesh it returns x unchanged (so library code can call it unconditionally)."""
    if len(logical_axes) != np.ndim(x):
        raise ValueError(f"constrain: logical axes {tuple(logical_axes)} for an array of shape {np.shape(x)}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(logical_axes, rules))


def constrain_rows(
    x,  # [..., B, ...] activations with the batch at `dim`
    dim: int = 0,
    rules: Mapping[str, Any] | None = None,
):
    """Inside jit: pin an activation to the batch sharding at `dim` (the `batch` rule's
    mesh axes), every other dimension replicated; unchanged without a mesh or when those
    axes do not divide its batch (a small micro-batch).

    What FSDP needs at a layer boundary: with the activations' rows split over the fsdp
    devices, XLA all-gathers each layer's weights (sharded over `embed`) for its matmuls
    and reduce-scatters their gradients, instead of splitting the matmuls along the hidden
    dimension and all-reducing [B, T, mlp] partial sums (docs/scaling.md)."""
    axes = _row_axes(np.shape(x)[dim], rules)
    if not axes:
        return x
    spec = [None] * np.ndim(x)
    spec[dim] = axes[0] if len(axes) == 1 else axes
    return jax.lax.with_sharding_constraint(x, P(*spec))


def _row_axes(rows: int, rules: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The mesh axes (size > 1) the `batch` rule splits `rows` over inside jit; () without a
    mesh or when their product does not divide `rows`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(a for a in (resolve_rules(rules)["batch"] or ()) if mesh.shape[a] > 1)
    if not axes or rows % math.prod(mesh.shape[a] for a in axes):
        return ()
    return axes


def row_shards(rows: int, rules: Mapping[str, Any] | None = None) -> int:
    """Inside jit: how many batch shards `constrain_rows` splits `rows` into (1 without a
    mesh, or when the batch axes do not divide `rows`). An MoE layer routes and blocks
    each shard's tokens on their own (jaxspec.models.moe), so its expert matmuls keep the
    rows split and FSDP gathers the expert weights."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in _row_axes(rows, rules)) if not mesh.empty else 1


def gather_weight(
    w,  # a layer's weight, one logical axis name per dimension
    logical_axes: Sequence[str | None],
    rules: Mapping[str, Any] | None = None,
):
    """Inside jit: pin a weight to its rule sharding with the batch mesh axes left out (the
    dimensions they split made whole; expert and tensor splits kept): FSDP's all-gather of
    a layer's weight before a computation that XLA would otherwise feed from the sharded
    weight (an MoE layer gathers per-block copies of its experts' weights: without this,
    XLA gathers them from the embed shards and exchanges the copies, many times the
    weight's bytes). Its gradient is reduce-scattered back by `constrain_params`.
    Unchanged without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return w
    batch = set(resolve_rules(rules)["batch"] or ())
    spec = []
    for entry in logical_to_mesh(logical_axes, rules):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ())
                     if a not in batch)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return jax.lax.with_sharding_constraint(w, P(*spec))


def constrain_params(tree, rules: Mapping[str, Any] | None = None):
    """Inside jit: pin a params-shaped tree (gradients, an accumulator; nnx Variables with
    logical axes) to the params' rule shardings; unchanged without a mesh. Gradients
    pinned so are reduce-scattered onto each device's shard, not all-reduced whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    specs = nnx.get_partition_spec(tree)
    return jax.tree.map(
        lambda x, names: jax.lax.with_sharding_constraint(
            x, logical_to_mesh(tuple(names), rules)) if names else x,
        tree, specs, is_leaf=lambda x: isinstance(x, P))


# --------------------------------------------------------------------------- weight sync


def sync_weights(
    params,  # pytree of arrays (e.g. policy.params on the training mesh)
    target_shardings,  # the same tree of Shardings, or one Sharding for every leaf
) -> tuple[Any, float]:
    """Reshard `params` onto `target_shardings` (e.g. onto the generation mesh): returns
    (params on the targets, seconds until the transfer completed)."""
    if not isinstance(target_shardings, jax.sharding.Sharding):
        ours = jax.tree.structure(params)
        theirs = jax.tree.structure(
            target_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if ours != theirs:
            raise ValueError(
                f"sync_weights: target_shardings ({theirs.num_leaves} leaves) do not match the "
                f"params ({ours.num_leaves} leaves); build them with param_shardings(...) for the "
                f"same model"
            )
    start = time.perf_counter()
    out = _place_tree(params, target_shardings)
    jax.block_until_ready(out)
    return out, time.perf_counter() - start


# --------------------------------------------------------------------------- multi-host


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return None


def _env_int(what: str, *names: str) -> int | None:
    value = _env(*names)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{what} from ${'/$'.join(names)} = {value!r} is not an int") from None


def _scheduler_launched() -> bool:
    """SLURM (srun) or Open MPI started several tasks: jax.distributed can detect the rest."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in os.environ for v in slurm) and int(os.environ["SLURM_NTASKS"]) > 1:
        return True
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    bind_address: str | None = None,
    timeout_s: int = 300,
) -> bool:
    """Join a multi-process JAX run (`jax.distributed.initialize`); call before any JAX work.

    Arguments default to $JAXSPEC_COORDINATOR_ADDRESS (or $JAX_COORDINATOR_ADDRESS),
    $JAXSPEC_NUM_PROCESSES and $JAXSPEC_PROCESS_ID. With none of them set, a SLURM (srun)
    or Open MPI launch of several tasks is detected by JAX; otherwise, and for one
    process, nothing is done. Returns True when this process is part of a multi-process run.
    """
    if jax.distributed.is_initialized():
        return True
    address = coordinator_address or _env("JAXSPEC_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
    count = num_processes if num_processes is not None else _env_int(
        "num_processes", "JAXSPEC_NUM_PROCESSES")
    index = process_id if process_id is not None else _env_int("process_id", "JAXSPEC_PROCESS_ID")
    if address is None and count is None and index is None:
        if not _scheduler_launched():
            return False
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return True
    if count is not None and (not isinstance(count, (int, np.integer)) or count < 1):
        raise ValueError(f"num_processes={count!r}; must be an int >= 1")
    if count == 1:
        return False
    missing = [name for name, value in (
        ("coordinator_address ($JAXSPEC_COORDINATOR_ADDRESS)", address),
        ("num_processes ($JAXSPEC_NUM_PROCESSES)", count),
        ("process_id ($JAXSPEC_PROCESS_ID)", index)) if value is None]
    if missing:
        raise ValueError(f"initialize_distributed: missing {', '.join(missing)}; give all three or none")
    if not isinstance(index, (int, np.integer)) or not 0 <= index < count:
        raise ValueError(f"process_id={index!r}; valid: 0 .. {count - 1} (num_processes={count})")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address={address!r}; expected 'host:port'")
    jax.distributed.initialize(
        coordinator_address=address, num_processes=int(count), process_id=int(index),
        coordinator_bind_address=bind_address, initialization_timeout=timeout_s,
    )
    return True
