"""The time estimate per kernel and per loop iteration (jaxspec.gpu_targets.estimate), on a
hand-written optimized-HLO module whose dots, bytes and nesting are known: no CUDA plugin."""

import json

import pytest

from jaxspec.gpu_targets import TARGETS, estimate, hlo

# A loop body with: a Triton GEMM fusion (bf16 [64,4096] x [4096,12288]), a cuBLAS f32 GEMM
# custom call ([256,512] x [512,1024], its workspace in the result tuple), an elementwise
# fusion, a nested loop of 3 trips around one convolution (1-D, 8 -> 16 features, width 3),
# and a command buffer (CUDA graph) holding one elementwise kernel.
MODULE = """HloModule jit_fn, is_scheduled=true

%gemm_computation (p0: bf16[64,4096], p1: bf16[4096,12288]) -> bf16[64,12288] {
  %p0 = bf16[64,4096]{1,0} parameter(0)
  %p1 = bf16[4096,12288]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,12288]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (q0: f32[256,1024], q1: f32[256,1024]) -> f32[256,1024] {
  %q0 = f32[256,1024]{1,0} parameter(0)
  %q1 = f32[256,1024]{1,0} parameter(1)
  ROOT %add.1 = f32[256,1024]{1,0} add(%q0, %q1)
}

%inner_body (t: (s32[], f32[4,32,8])) -> (s32[], f32[4,32,8]) {
  %t = (s32[], f32[4,32,8]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,32,8]{2,1,0} get-tuple-element(%t), index=1
  %w = f32[3,8,16]{2,1,0} constant({...})
  %conv.1 = f32[4,32,16]{2,1,0} convolution(%x, %w), window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f
  %slice.1 = f32[4,32,8]{2,1,0} slice(%conv.1), slice={[0:4], [0:32], [0:8]}
  ROOT %tuple.1 = (s32[], f32[4,32,8]{2,1,0}) tuple(%i, %slice.1)
}

%inner_cond (c: (s32[], f32[4,32,8])) -> pred[] {
  %c = (s32[], f32[4,32,8]{2,1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%command_buffer (r0: f32[256,1024]) -> f32[256,1024] {
  %r0 = f32[256,1024]{1,0} parameter(0)
  ROOT %fusion.9 = f32[256,1024]{1,0} fusion(%r0, %r0), kind=kLoop, calls=%fused_add
}

%body (s: (s32[], bf16[64,4096], bf16[4096,12288], f32[256,512], f32[512,1024], f32[4,32,8])) -> (s32[], bf16[64,4096], bf16[4096,12288], f32[256,512], f32[512,1024], f32[4,32,8]) {
  %s = (s32[], bf16[64,4096]{1,0}, bf16[4096,12288]{1,0}, f32[256,512]{1,0}, f32[512,1024]{1,0}, f32[4,32,8]{2,1,0}) parameter(0)
  %n = s32[] get-tuple-element(%s), index=0
  %a = bf16[64,4096]{1,0} get-tuple-element(%s), index=1
  %b = bf16[4096,12288]{1,0} get-tuple-element(%s), index=2
  %c = f32[256,512]{1,0} get-tuple-element(%s), index=3
  %d = f32[512,1024]{1,0} get-tuple-element(%s), index=4
  %e = f32[4,32,8]{2,1,0} get-tuple-element(%s), index=5
  %gemm_fusion_dot.7 = bf16[64,12288]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation, metadata={op_name="jit(fn)/dot_general"}
  %cublas-gemm.3 = (f32[256,1024]{1,0}, s8[4194304]{0}) custom-call(%c, %d), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %g = f32[256,1024]{1,0} get-tuple-element(%cublas-gemm.3), index=0
  %loop_add_fusion = f32[256,1024]{1,0} fusion(%g, %g), kind=kLoop, calls=%fused_add
  %init = (s32[], f32[4,32,8]{2,1,0}) tuple(%n, %e)
  %while.2 = (s32[], f32[4,32,8]{2,1,0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %cb = f32[256,1024]{1,0} call(%loop_add_fusion), to_apply=%command_buffer
  ROOT %out = (s32[], bf16[64,4096]{1,0}, bf16[4096,12288]{1,0}, f32[256,512]{1,0}, f32[512,1024]{1,0}, f32[4,32,8]{2,1,0}) tuple(%n, %a, %b, %c, %d, %e)
}

%cond (s: (s32[], bf16[64,4096], bf16[4096,12288], f32[256,512], f32[512,1024], f32[4,32,8])) -> pred[] {
  %s = (s32[], bf16[64,4096]{1,0}, bf16[4096,12288]{1,0}, f32[256,512]{1,0}, f32[512,1024]{1,0}, f32[4,32,8]{2,1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: (s32[], bf16[64,4096], bf16[4096,12288], f32[256,512], f32[512,1024], f32[4,32,8])) -> (s32[], bf16[64,4096], bf16[4096,12288], f32[256,512], f32[512,1024], f32[4,32,8]) {
  %x = (s32[], bf16[64,4096]{1,0}, bf16[4096,12288]{1,0}, f32[256,512]{1,0}, f32[512,1024]{1,0}, f32[4,32,8]{2,1,0}) parameter(0)
  ROOT %while.1 = (s32[], bf16[64,4096]{1,0}, bf16[4096,12288]{1,0}, f32[256,512]{1,0}, f32[512,1024]{1,0}, f32[4,32,8]{2,1,0}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
"""

H200 = TARGETS["h200"]  # 989e12 bf16, 494.7e12 TF32, 4.8e12 B/s
G, S = estimate.LAUNCH_GRAPH_S, estimate.LAUNCH_STREAM_S


def _kernels():
    module = hlo.parse(MODULE)
    (cost,) = hlo.loop_costs(module)
    return {k.name: k for k in estimate.estimate_loop(module, cost, H200)}


def test_flops_bytes_and_time_per_kernel():
    k = _kernels()
    assert sorted(k) == ["conv.1", "cublas-gemm.3", "fusion.9", "gemm_fusion_dot.7",
                         "loop_add_fusion", "slice.1"]
    # Triton GEMM fusion: 2*M*N*K at the bf16 peak; reads both operands, writes the result.
    gemm = k["gemm_fusion_dot.7"]
    assert gemm.flops == 2 * 64 * 12288 * 4096 and gemm.dtype == "bf16"
    assert gemm.bytes == 2 * (64 * 4096 + 4096 * 12288 + 64 * 12288)
    # 6.44 GFLOP / 989 TF = 6.5 us; 102.8 MB / 4.8 TB/s = 21.2 us: memory-bound
    assert gemm.bound == "memory"
    assert gemm.seconds == pytest.approx(102_760_448 / 4.8e12 + S)
    # cuBLAS f32 GEMM: at the TF32 peak; the 4 MiB workspace counted as written (HLO says so)
    gemm32 = k["cublas-gemm.3"]
    assert gemm32.flops == 2 * 256 * 1024 * 512 and gemm32.dtype == "f32"
    assert gemm32.bytes == 4 * (256 * 512 + 512 * 1024 + 256 * 1024) + 4_194_304
    assert gemm32.bound == "memory"  # 268 MFLOP / 494.7 TF = 0.54 us < 6.3 MB / 4.8 TB/s
    # Convolution: output 4*32*16, 3*8 multiply-adds each; 3 executions per iteration.
    conv = k["conv.1"]
    assert conv.flops == 2 * 4 * 32 * 16 * 3 * 8 and conv.count == 3
    # Elementwise kernels: no FLOPs counted, launch inside vs outside the command buffer.
    add, graphed = k["loop_add_fusion"], k["fusion.9"]
    assert add.flops == graphed.flops == 0 and graphed.in_command_buffer and not add.in_command_buffer
    assert add.seconds - graphed.seconds == pytest.approx(S - G)
    assert graphed.seconds == pytest.approx(3 * 4 * 256 * 1024 / 4.8e12 + G)


def test_iteration_sums_kernels_at_their_counts():
    k = _kernels()
    per_iteration = sum(x.count * x.seconds for x in k.values())
    s = estimate.summary(list(k.values()))
    assert s["time_ms"] == pytest.approx(1e3 * per_iteration)
    assert s["kernels"] == 1 + 1 + 1 + 3 + 3 + 1 == 10
    assert s["launch_ms"] == pytest.approx(1e3 * (9 * S + G))
    assert s["flops"] == 2 * 64 * 12288 * 4096 + 2 * 256 * 1024 * 512 + 3 * 2 * 4 * 32 * 16 * 24
    assert s["largest"][0]["name"] == "gemm_fusion_dot.7"


def test_compute_bound_kernel_and_peaks():
    # At 4,096 rows the same GEMM does 64x the FLOPs over 2.3x the bytes: compute-bound.
    text = MODULE.replace("bf16[64,4096]", "bf16[4096,4096]").replace("bf16[64,12288]",
                                                                      "bf16[4096,12288]")
    module = hlo.parse(text)
    (cost,) = hlo.loop_costs(module)
    gemm = next(k for k in estimate.estimate_loop(module, cost, H200)
                if k.name == "gemm_fusion_dot.7")
    assert gemm.bound == "compute"
    assert gemm.seconds == pytest.approx(2 * 4096 * 12288 * 4096 / 989e12 + S)
    assert estimate.peak_flops(TARGETS["gb200"], "f32") == 1.25e15
    assert estimate.peak_flops(H200, "f8e4m3fn") == 2 * 989e12


def test_tree_attention_flops():
    """jaxspec's Pallas attention: q [B, T, kv, group, D] against one layer of the stacked
    cache [L, B, S, kv, D]: 2 matmuls of 2 * B*T*H*D*S each."""
    inst = hlo.parse("""HloModule m
ENTRY %e (q: bf16[2,4,2,4,128], k: bf16[36,2,1024,2,128], v: bf16[36,2,1024,2,128]) -> f32[2,4,2,4,128] {
  %q = bf16[2,4,2,4,128]{4,3,2,1,0} parameter(0)
  %k = bf16[36,2,1024,2,128]{4,3,2,1,0} parameter(1)
  %v = bf16[36,2,1024,2,128]{4,3,2,1,0} parameter(2)
  ROOT %pallas_call.1 = f32[2,4,2,4,128]{4,3,2,1,0} custom-call(%q, %k, %v), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/tree_attention/pallas_call"}
}
""")
    comp = inst.entry
    flops, dtype = estimate.instruction_flops(inst, comp.instructions["pallas_call.1"], comp)
    assert flops == 4 * (2 * 4 * 8 * 128) * 1024 and dtype == "bf16"


def test_compare_lists_the_kernels_furthest_over_their_estimate_first(tmp_path):
    k = _kernels()
    # A profile in scripts/gpu_profile.py's form: 2 iterations, names as the profiler's
    # hlo_op gives them (dots kept; the estimate matches on '.'/'-' -> '_').
    profile = {"cases": [{"program": "verify_k3", "batch": 64, "iterations": 2, "kernels": [
        {"name": "gemm_fusion_dot.7", "calls": 2, "us_per_call": 100.0},
        {"name": "loop_add_fusion", "calls": 2, "us_per_call": 5.0},
        {"name": "conv.1", "calls": 6, "us_per_call": 2.0},
        {"name": "sm90_xmma_gemm_f32", "calls": 2, "us_per_call": 9.0}]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert estimate.load_profile(str(path), "decode") is None
    measured = estimate.load_profile(str(path), "verify_k3", 64)
    out = estimate.compare(list(k.values()), measured)
    assert [r["name"] for r in out["furthest"]][0] == "gemm_fusion_dot.7"
    first = out["furthest"][0]
    assert first["measured_us"] == 100.0
    assert first["estimated_us"] == pytest.approx(1e6 * (102_760_448 / 4.8e12 + S))
    assert out["matched"] == 3 and out["unmatched"] == ["sm90_xmma_gemm_f32"]
    assert out["unmatched_measured_us"] == 9.0


def test_graph_share_from_the_thunks_weights_every_launch():
    """Newer XLA forms command buffers after the HLO: the thunks' share sets the launches."""
    module = hlo.parse(MODULE)
    (cost,) = hlo.loop_costs(module)
    inside = estimate.summary(estimate.estimate_loop(module, cost, H200, graph_share=1.0))
    outside = estimate.summary(estimate.estimate_loop(module, cost, H200, graph_share=0.0))
    assert inside["launch_ms"] == pytest.approx(1e3 * 10 * G)
    assert outside["launch_ms"] == pytest.approx(1e3 * 10 * S)
    assert outside["time_ms"] - inside["time_ms"] == pytest.approx(1e3 * 10 * (S - G))
    with pytest.raises(ValueError, match="graph_share=1.5"):
        estimate.estimate_loop(module, cost, H200, graph_share=1.5)


@pytest.mark.skipif(not __import__("jaxspec.gpu_targets", fromlist=["x"]).plugin_installed(),
                    reason="jax's CUDA plugin is not installed: nothing can be compiled for a GPU")
def test_inspector_reports_the_estimate_of_a_compiled_decode_loop():
    """A small decode loop compiled for an H100: the estimate per iteration covers its bytes
    at the bandwidth and its launches, one per kernel the HLO walk counts."""
    from jaxspec import gpu_targets
    from jaxspec.gpu_targets.inspect import build_program, inspect_program
    from jaxspec.models import ModelConfig

    cfg = ModelConfig.tiny("qwen3").replace(hidden_size=512, intermediate_size=2048,
                                            num_layers=2, vocab_size=4096, dtype="bfloat16",
                                            attention_backend="auto")
    mesh = gpu_targets.mesh("h100", {"data": 1, "fsdp": 1, "tensor": 1})
    program = build_program("decode", cfg, batch=2, context=256, mesh=mesh)
    probe = inspect_program(program, "h100", mesh)["estimate"]["largest"][0]
    measured = {estimate.kernel_key(probe["name"]): {"us": 50.0, "count": probe["count"]}}
    report = inspect_program(program, "h100", mesh, measured=measured)
    assert report["measured"]["matched"] == 1
    assert report["measured"]["furthest"][0]["measured_us"] == 50.0 * probe["count"]
    est = report["estimate"]
    assert est["kernels"] == report["kernels_hlo"]
    assert est["time_ms"] >= report["time_at_bandwidth_ms"] + est["launch_ms"] - 1e-9
    share = report["thunks"]["in_command_buffer"] / report["thunks"]["kernels"]
    assert est["launch_ms"] == pytest.approx(
        1e3 * est["kernels"] * (share * G + (1 - share) * S))


def test_inspector_refuses_a_profile_it_cannot_read(tmp_path, capsys):
    """--profile is checked before anything compiles: a missing file, or JSON that is not
    a scripts/gpu_profile.py profile, is one error line (exit 2)."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("inspect_gpu", root / "scripts" / "inspect_gpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    base = ["--config", str(root / "configs" / "qwen3_8b_shape.yaml"), "--target", "h200"]
    assert script.main(base + ["--profile", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"rows": []}')
    assert script.main(base + ["--profile", str(tmp_path / "other.json")]) == 2
    assert "no 'cases'" in capsys.readouterr().err
