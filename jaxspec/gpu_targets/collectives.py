"""Every collective of an optimized HLO module: what it moves, over which mesh axis, how
often, how long at the target's link bandwidth, and whether XLA's schedule hides it.

`collectives(module, mesh_shape)` reads the module a compiled program prints
(`compiled.as_text()`, parsed by `jaxspec.gpu_targets.hlo`) and lists each all-gather,
reduce-scatter, all-reduce, all-to-all and collective-permute (sync, or an async
`-start`/`-done` pair counted once at its start):

- **bytes**: the per-device buffer the collective spans, the larger of what goes in and
  what comes out (an all-gather's gathered result, a reduce-scatter's unscattered input, an
  all-reduce's array); a combined collective (several arrays in one) sums them.
- **group size** and **mesh axes**: the replica groups (every HLO spelling: explicit
  `{{0,1},{2,3}}`, iota `[2,4]<=[8]`, and the mesh form `mesh['axis_0'=8] {'axis_0'}`)
  expanded to device indices (the flat index into the jax mesh's devices) and matched
  against the named mesh: the set of axes whose groups they are.
- **count**: executions per program run, nested while loops at their known trip counts
  (`unknown_trip` for the rest), a called computation once, every branch of a conditional
  once (an upper bound).
- **seconds** per execution at `link_bandwidth` (bytes/s per direction per GPU) with the
  ring algorithm's traffic per device: all-gather, reduce-scatter and all-to-all
  (n-1)/n x bytes, all-reduce 2(n-1)/n x bytes, collective-permute bytes.
- **overlapped**: an async pair that XLA did not mark synchronous (`"is_sync":true` in its
  backend config) with at least one kernel scheduled between its start and its done (a
  scheduled module prints each computation in execution order). Whether the kernels
  between are long enough to hide it is not known from the text: `exposed_seconds` of the
  summary counts the collectives that are not overlapped, `seconds` all of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Mapping

import numpy as np

from jaxspec.gpu_targets import hlo

__all__ = ["KINDS", "Collective", "bus_factor", "collectives", "mesh_axes_of",
           "replica_groups", "summarize"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_STARTS = {f"{k}-start": k for k in KINDS}
_DONES = {f"{k}-done" for k in KINDS}
# Instructions that run no kernel (for the count of work between an async start and done).
_NO_KERNEL = hlo._FREE | {f"{k}-start" for k in KINDS} | _DONES


@dataclasses.dataclass
class Collective:
    """One collective instruction of the module (an async pair counted once)."""

    name: str
    kind: str  # one of KINDS
    asynchronous: bool  # a -start/-done pair
    bytes: int  # per device: the larger of the buffers in and out (module docstring)
    shape: str  # the result's HLO shape (an async pair's done)
    group_size: int
    groups: int  # number of replica groups
    axes: str  # the mesh axes the groups span ("fsdp", "data+fsdp"), "" for one device,
    #            "?" when the groups match no set of mesh axes
    count: int  # executions per program run
    seconds: float  # one execution at the link bandwidth (ring algorithm)
    overlapped: bool
    kernels_between: int  # kernels XLA scheduled between start and done
    op_name: str
    computation: str

    @property
    def total_seconds(self) -> float:
        return self.count * self.seconds

    @property
    def total_bytes(self) -> int:
        return self.count * self.bytes


def bus_factor(kind: str, n: int) -> float:
    """Bytes each device sends per byte of the collective's buffer, ring algorithm over n."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


# --------------------------------------------------------------------------- replica groups

_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*"
                          r"\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def _mesh_groups(axes_text: str, ids_text: str | None, groups_text: str) -> list[list[int]]:
    """Groups of the mesh form: devices laid out over named axes (iota, or device_ids),
    each group the devices that differ only along the listed axes (or sub-axes
    'name':(pre)size: the middle factor of the axis split as [pre, size, rest])."""
    names, sizes = [], []
    for item in filter(None, (s.strip() for s in axes_text.split(","))):
        name, _, size = item.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    ids = np.asarray(_ints(ids_text), np.int64) if ids_text else np.arange(n)
    # Each axis as [pre, size, rest]: a whole axis is (1, size, 1).
    split = {name: (1, size, 1) for name, size in zip(names, sizes)}
    chosen = []
    for ref in filter(None, (s.strip() for s in groups_text.split(","))):
        m = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", ref)
        if m is None or m.group(1) not in split:
            raise ValueError(f"replica group axis {ref!r} names no axis of mesh[{axes_text}]")
        name = m.group(1)
        if m.group(2):
            pre, size = int(m.group(2)), int(m.group(3))
            total = sizes[names.index(name)]
            split[name] = (pre, size, total // (pre * size))
        chosen.append(name)
    dims = [d for name in names for d in split[name]]
    grid = ids.reshape(dims)
    keep = [3 * names.index(name) + 1 for name in chosen]
    rest = [d for d in range(len(dims)) if d not in keep]
    grid = np.transpose(grid, rest + keep)
    size = math.prod(dims[d] for d in keep)
    return grid.reshape(-1, size).tolist()


def replica_groups(inst: hlo.Instruction, devices: int) -> list[list[int]]:
    """The device groups of a collective (device index = flat index into the mesh); no
    groups given (`{}`) is one group of all `devices`."""
    attrs = inst.attrs
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = _IOTA_GROUPS.search(attrs)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(dims)))
        return np.transpose(np.arange(math.prod(dims)).reshape(dims), perm).reshape(
            shape).tolist()
    m = _PAIRS.search(attrs)
    if m:  # a collective-permute: each (source, target) pair is a group of 2
        pairs = _ints(m.group(1))
        return [pairs[i:i + 2] for i in range(0, len(pairs), 2)]
    m = _LIST_GROUPS.search(attrs)
    if m and m.group(1):
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(devices))]


def mesh_axes_of(groups: list[list[int]], mesh_shape: Mapping[str, int], *,
                 pairs: bool = False) -> str:
    """The mesh axes (joined by '+', in mesh order) whose groups `groups` are, as sets of
    flat device indices of a mesh of `mesh_shape` ({axis: size}, in order); "" when every
    group holds one device. Groups inside the groups of some axes but smaller are
    "axes/n" (n devices of them, e.g. "fsdp/4" on a 32-device fsdp axis), or just the axes
    for a collective-permute's source-target pairs (pairs=True); "?" when none hold them."""
    if all(len(g) <= 1 for g in groups):
        return ""
    names = [a for a, s in mesh_shape.items() if s > 1]
    want = {frozenset(g) for g in groups}
    sizes = list(mesh_shape.values())
    grid = np.arange(math.prod(sizes)).reshape(sizes)
    order = list(mesh_shape)
    inside = None  # the fewest axes whose groups hold every group
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            keep = [order.index(a) for a in subset]
            rest = [d for d in range(len(sizes)) if d not in keep]
            flat = np.transpose(grid, rest + keep).reshape(
                -1, math.prod(sizes[d] for d in keep))
            theirs = {frozenset(row.tolist()) for row in flat}
            if theirs == want:
                return "+".join(subset)
            if inside is None and all(any(g <= t for t in theirs) for g in want):
                inside = "+".join(subset)
    if inside is None:
        return "?"
    return inside if pairs else f"{inside}/{max(len(g) for g in groups)}"


# --------------------------------------------------------------------------- the walk


def _kind(inst: hlo.Instruction) -> tuple[str | None, bool]:
    op = inst.opcode
    if op in KINDS:
        return op, False
    if op in _STARTS:
        return _STARTS[op], True
    return None, False


def _is_sync(inst: hlo.Instruction) -> bool:
    return '"is_sync":true' in inst.attrs


def _buffer_bytes(inst: hlo.Instruction, comp: hlo.Computation, done) -> int:
    """The larger of the bytes in (operands) and out (the result; an async start's done)."""
    given = sum(comp.instructions[o].bytes for o in inst.operands if o in comp.instructions)
    if done is not None:
        out = done.bytes
    elif inst.opcode.endswith("-start") and inst.shape.startswith("("):
        out = inst.bytes - given  # (operands..., results...) tuple: the result part
        if inst.opcode == "collective-permute-start":
            out = given  # (operand, result, context...): the result is the operand's size
    else:
        out = inst.bytes
    return max(given, out)


def _between(comp: hlo.Computation, start: str, done: str | None) -> int:
    """Kernel-running instructions scheduled between `start` and `done`."""
    if done is None:
        return 0
    names = list(comp.instructions)
    i, j = names.index(start), names.index(done)
    return sum(1 for name in names[i + 1:j]
               if comp.instructions[name].opcode not in _NO_KERNEL)


def _walk(module, comp, times, mesh_shape, bandwidth, unknown_trip, out, seen):
    devices = math.prod(mesh_shape.values())
    for inst in comp.instructions.values():
        op = inst.opcode
        if op == "while":
            trips = inst.known_trip_count
            if trips is None:
                trips = unknown_trip(inst)
            _walk(module, module.computations[inst.called("body")[0]], times * trips,
                  mesh_shape, bandwidth, unknown_trip, out, seen)
            continue
        if op in ("call", "conditional", "async-start"):
            names = (inst.called("to_apply") + inst.called("calls")
                     + inst.called("branch_computations") + inst.called("true_computation")
                     + inst.called("false_computation"))
            for name in names:
                if name in module.computations:
                    _walk(module, module.computations[name], times, mesh_shape, bandwidth,
                          unknown_trip, out, seen)
            continue
        kind, started = _kind(inst)
        if kind is None:
            continue
        key = (comp.name, inst.name)
        if key in seen:  # a computation reached twice: count its executions together
            seen[key].count += times
            continue
        done = None
        if started:
            done = next((u for u in comp.users(inst.name) if u.opcode == f"{kind}-done"), None)
        groups = replica_groups(inst, devices)
        n = max(len(g) for g in groups)
        size = _buffer_bytes(inst, comp, done)
        between = _between(comp, inst.name, done.name if done is not None else None)
        entry = Collective(
            name=inst.name, kind=kind, asynchronous=started, bytes=size,
            shape=(done if done is not None else inst).shape, group_size=n,
            groups=len(groups), count=times,
            axes=mesh_axes_of(groups, mesh_shape, pairs=kind == "collective-permute"),
            seconds=bus_factor(kind, n) * size / bandwidth,
            overlapped=started and not _is_sync(inst) and between > 0,
            kernels_between=between, op_name=inst.op_name, computation=comp.name)
        seen[key] = entry
        out.append(entry)


def collectives(module: hlo.Module, mesh_shape: Mapping[str, int], link_bandwidth: float,
                unknown_trip: Callable[[hlo.Instruction], int] = lambda inst: 1
                ) -> list[Collective]:
    """Every collective reachable from the entry computation (module docstring), in
    program order. `mesh_shape`: the jax mesh's {axis: size} in its order;
    `link_bandwidth`: bytes/s per direction per GPU."""
    if link_bandwidth <= 0:
        raise ValueError(f"link_bandwidth={link_bandwidth!r}; must be > 0 bytes/s")
    out: list[Collective] = []
    _walk(module, module.entry, 1, dict(mesh_shape), link_bandwidth, unknown_trip, out, {})
    return out


def summarize(found: list[Collective], flops_seconds: float | None = None, top: int = 12
              ) -> dict:
    """Totals per program (JSON-able): bytes and seconds at the link bandwidth, all of them
    and the exposed ones (not overlapped), per kind and per mesh axis, the `top`
    collectives by total time, and the ratio to the model-FLOPs time when given."""
    total = sum(c.total_seconds for c in found)
    exposed = sum(c.total_seconds for c in found if not c.overlapped)
    by_kind: dict[str, dict] = {}
    for c in found:
        row = by_kind.setdefault(f"{c.kind} [{c.axes or '-'}]", {
            "kind": c.kind, "axes": c.axes, "instructions": 0, "executions": 0, "bytes": 0,
            "seconds": 0.0, "exposed_seconds": 0.0})
        row["instructions"] += 1
        row["executions"] += c.count
        row["bytes"] += c.total_bytes
        row["seconds"] += c.total_seconds
        row["exposed_seconds"] += 0.0 if c.overlapped else c.total_seconds
    largest = sorted(found, key=lambda c: c.total_seconds, reverse=True)[:top]
    out = {
        "instructions": len(found),
        "executions": sum(c.count for c in found),
        "bytes": sum(c.total_bytes for c in found),
        "seconds": total,
        "exposed_seconds": exposed,
        "by_kind": sorted(by_kind.values(), key=lambda r: -r["seconds"]),
        "largest": [dict(dataclasses.asdict(c), total_seconds=c.total_seconds)
                    for c in largest],
    }
    if flops_seconds:
        out["flops_seconds"] = flops_seconds
        out["ratio_to_flops"] = total / flops_seconds
        out["exposed_ratio_to_flops"] = exposed / flops_seconds
    return out
