"""The inspector's collectives: a hand-written HLO module counted by hand (every replica
group spelling, loop trip counts, async overlap and XLA's synchronous mark), and (where
jax's CUDA plugin is installed) an all-gather, a reduce-scatter and an all-reduce of known
arrays compiled for 8 H100s, their bytes, groups, mesh axes and times in closed form."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import gpu_targets
from jaxspec.gpu_targets import collectives as C
from jaxspec.gpu_targets import hlo

needs_plugin = pytest.mark.skipif(
    not gpu_targets.plugin_installed(),
    reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-aot]'): nothing can be "
           "compiled for a GPU here")

MESH = {"data": 2, "fsdp": 4}  # flat device index = 4 * data + fsdp
BW = 100e9  # bytes/s, a round figure for the closed forms

# A loop of 5 trips whose body (1) all-gathers f32[256,256] -> f32[1024,256] over fsdp
# asynchronously with one kernel scheduled before its done, (2) reduce-scatters that back
# (sync; iota groups [2,4]<=[8] = {0..3},{4..7}: fsdp), (3) all-reduces f32[256,256] over
# data (iota [4,2]<=[2,4]T(1,0) = {0,4},{1,5},...) as an async pair with a kernel between
# that XLA marked synchronous; after it, the entry all-to-alls f32[64] over all 8 devices
# (explicit groups) and collective-permutes f32[64] in rings inside each fsdp group.
FIXTURE = """HloModule fixture, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_square (p: f32[256,256]) -> f32[256,256] {
  %p = f32[256,256]{1,0} parameter(0)
  ROOT %m = f32[256,256]{1,0} multiply(%p, %p)
}

%body (a: (s32[], f32[256,256])) -> (s32[], f32[256,256]) {
  %a = (s32[], f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%a), index=0
  %v = f32[256,256]{1,0} get-tuple-element(%a), index=1
  %ag = (f32[256,256]{1,0}, f32[1024,256]{1,0}) all-gather-start(%v), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/all_gather"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %sq = f32[256,256]{1,0} fusion(%v), kind=kLoop, calls=%fused_square
  %agd = f32[1024,256]{1,0} all-gather-done(%ag)
  %rs = f32[256,256]{1,0} reduce-scatter(%agd), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
  %ar = f32[256,256]{1,0} all-reduce-start(%rs), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %sq2 = f32[256,256]{1,0} fusion(%sq), kind=kLoop, calls=%fused_square
  %ard = f32[256,256]{1,0} all-reduce-done(%ar)
  ROOT %t = (s32[], f32[256,256]{1,0}) tuple(%i, %ard)
}

%cond (c: (s32[], f32[256,256])) -> pred[] {
  %c = (s32[], f32[256,256]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (e: f32[256,256], f: f32[64]) -> (f32[256,256], f32[64]) {
  %e = f32[256,256]{1,0} parameter(0)
  %f = f32[64]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256,256]{1,0}) tuple(%zero, %e)
  %loop = (s32[], f32[256,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %out = f32[256,256]{1,0} get-tuple-element(%loop), index=1
  %a2a = f32[64]{0} all-to-all(%f), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %cp = f32[64]{0} collective-permute(%a2a), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  ROOT %r = (f32[256,256]{1,0}, f32[64]{0}) tuple(%out, %cp)
}
"""


def _found(text=FIXTURE):
    return {c.kind: c for c in C.collectives(hlo.parse(text), MESH, BW)}


def test_fixture_collectives_by_hand():
    found = _found()
    assert set(found) == set(C.KINDS)
    mib = 1024 * 256 * 4  # the gathered f32[1024,256]
    ag, rs, ar = found["all-gather"], found["reduce-scatter"], found["all-reduce"]
    assert (ag.bytes, ag.group_size, ag.groups, ag.axes, ag.count) == (mib, 4, 2, "fsdp", 5)
    assert ag.asynchronous and ag.overlapped and ag.kernels_between == 1
    assert ag.seconds == pytest.approx(0.75 * mib / BW)  # (n-1)/n of the gathered array
    assert (rs.bytes, rs.group_size, rs.axes, rs.count) == (mib, 4, "fsdp", 5)
    assert not rs.asynchronous and not rs.overlapped
    assert rs.seconds == pytest.approx(0.75 * mib / BW)
    quarter = 256 * 256 * 4
    assert (ar.bytes, ar.group_size, ar.groups, ar.axes, ar.count) == (quarter, 2, 4, "data", 5)
    assert ar.seconds == pytest.approx(2 * 0.5 * quarter / BW)  # 2(n-1)/n
    assert ar.kernels_between == 1 and not ar.overlapped  # XLA marked it synchronous
    a2a, cp = found["all-to-all"], found["collective-permute"]
    assert (a2a.bytes, a2a.group_size, a2a.axes, a2a.count) == (256, 8, "data+fsdp", 1)
    assert a2a.seconds == pytest.approx(7 / 8 * 256 / BW)
    assert (cp.bytes, cp.axes, cp.seconds) == (256, "fsdp", pytest.approx(256 / BW))
    summary = C.summarize(list(found.values()), flops_seconds=1e-3)
    total = 5 * (0.75 * mib + 0.75 * mib + quarter) / BW + (7 / 8 * 256 + 256) / BW
    assert summary["seconds"] == pytest.approx(total)
    assert summary["exposed_seconds"] == pytest.approx(total - 5 * 0.75 * mib / BW)
    assert summary["bytes"] == 5 * (2 * mib + quarter) + 2 * 256
    assert summary["ratio_to_flops"] == pytest.approx(total / 1e-3)


def test_negative_controls_sync_mark_and_nothing_between():
    """The overlap flag follows XLA's mark and the schedule: unmarked, the all-reduce with a
    kernel between counts as overlapped; the all-gather with its kernel moved after its
    done does not."""
    text = FIXTURE.replace('"is_sync":true', '"is_sync":false')
    assert _found(text)["all-reduce"].overlapped
    lines = FIXTURE.splitlines()
    i = next(k for k, line in enumerate(lines) if "%sq = " in line)
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    ag = _found("\n".join(lines))["all-gather"]
    assert ag.kernels_between == 0 and not ag.overlapped


def test_mesh_groups_with_sub_axes_and_device_ids():
    """A sub-axis 'axis_0':(1)2 of one 8-device axis is its major factor of 2: groups
    {c, 4 + c}, the data axis of MESH; an explicit device order permutes the groups."""
    def groups(attrs):
        return C.replica_groups(hlo.Instruction("x", "f32[8]", "all-gather", [], attrs), 8)

    sub = groups(", replica_groups=mesh['axis_0'=8] {'axis_0':(1)2}, dimensions={0}")
    assert sorted(map(sorted, sub)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert C.mesh_axes_of(sub, MESH) == "data"
    ids = groups(", replica_groups=mesh['a'=2,'b'=4], device_ids=(0,4,1,5,2,6,3,7) {'a'}")
    assert sorted(map(sorted, ids)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert C.mesh_axes_of(ids, MESH) == "fsdp/2"  # pairs inside fsdp, not all of it
    assert C.mesh_axes_of([[0, 5], [1, 4]], {"data": 2, "fsdp": 4}) == "data+fsdp/2"
    assert C.mesh_axes_of([[0, 5], [1, 4]], {"data": 8}) == "data/2"
    assert C.mesh_axes_of([[0, 9]], {"data": 2, "fsdp": 4}) == "?"  # no such device
    assert C.mesh_axes_of(ids, MESH, pairs=True) == "fsdp"  # as a permute's pairs
    assert groups(", replica_groups={}") == [list(range(8))]


def test_bus_factors_and_bad_input():
    assert C.bus_factor("all-reduce", 8) == pytest.approx(1.75)
    assert C.bus_factor("all-gather", 8) == C.bus_factor("reduce-scatter", 8) == 0.875
    assert C.bus_factor("all-gather", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        C.bus_factor("gather", 8)
    with pytest.raises(ValueError, match="link_bandwidth=0"):
        C.collectives(hlo.parse(FIXTURE), MESH, 0)


def test_targets_carry_their_nvlink_figures():
    """Half of NVIDIA's bidirectional NVLink figures: 900 GB/s (NVLink 4), 1.8 TB/s (5)."""
    assert gpu_targets.target("h100").link_bandwidth == gpu_targets.target("h200").link_bandwidth == 450e9
    assert gpu_targets.target("gb200").link_bandwidth == 900e9


# --------------------------------------------------------------------------- compiled


def _compiled_collectives(body, out_spec):
    """`body` (per-device, under shard_map over data x fsdp) on x = f32[2, 1024, 512]
    sharded P('data', 'fsdp'): each device holds f32[1, 256, 512] (512 KiB)."""
    gpu_targets.check_plugin()
    mesh = gpu_targets.mesh("h100", {"data": 2, "fsdp": 4})
    x = jax.ShapeDtypeStruct((2, 1024, 512), jnp.float32,
                             sharding=NamedSharding(mesh, P("data", "fsdp")))
    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data", "fsdp"), out_specs=out_spec,
                       check_vma=False)
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).compile().as_text()
    bw = gpu_targets.target("h100").link_bandwidth
    return C.collectives(hlo.parse(text), dict(mesh.shape), bw), bw


LOCAL = 256 * 512 * 4  # bytes of one device's block


@needs_plugin
@pytest.mark.parametrize("kind, body, out_spec, size, n, axis", [
    ("all-gather", lambda a: jax.lax.all_gather(a, "fsdp", axis=1, tiled=True),
     P("data", None), 4 * LOCAL, 4, "fsdp"),
    ("reduce-scatter", lambda a: jax.lax.psum_scatter(a, "fsdp", scatter_dimension=1, tiled=True),
     P("data", "fsdp"), LOCAL, 4, "fsdp"),
    ("all-reduce", lambda a: jax.lax.psum(a, "data"), P(None, "fsdp"), LOCAL, 2, "data"),
])
def test_compiled_for_8_h100s(kind, body, out_spec, size, n, axis):
    found, bw = _compiled_collectives(body, out_spec)
    assert [c.kind for c in found] == [kind], found
    c = found[0]
    assert (c.bytes, c.group_size, c.groups, c.axes, c.count) == (size, n, 8 // n, axis, 1)
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    assert c.seconds == pytest.approx(factor * size / bw)
