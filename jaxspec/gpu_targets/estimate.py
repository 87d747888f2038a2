"""Time per kernel and per loop iteration of a compiled GPU program, estimated from its HLO.

A roofline per kernel: each kernel-running instruction of a loop body (as
`jaxspec.gpu_targets.hlo` walks it, with its bytes) takes

    max(FLOPs / peak FLOP/s of its operand type, bytes / HBM bandwidth) + launch

and the loop's iteration takes the sum over its kernels, nested loops at their trip counts.

- **FLOPs** are the matrix units' work only: every `dot` and `convolution` in the kernel's
  computation (fusions searched through, nested fusions included), cuBLAS/cuDNN custom calls
  from the dot dimensions or convolution labels they carry, a cuDNN attention call as its
  two matmuls (q [batch, seq, heads, head_dim] layout assumed), and jaxspec's Pallas
  `tree_attention` call as the two matmuls over the whole stacked cache layer it reads.
  Elementwise work and reductions are not counted (memory-bound next to their bytes).
- **Peaks** (`jaxspec.gpu_targets`): bf16/f16 dots at the dense bf16 tensor-core peak, f32
  dots at the dense TF32 peak (XLA's default precision on these GPUs), 8-bit at twice bf16.
- **Launch**: `LAUNCH_GRAPH_S` (1 us) per kernel inside a command buffer (a CUDA graph
  replays kernels back to back, ~1 us apart) and `LAUNCH_STREAM_S` (4 us) outside one (a
  kernel launch from the host costs a few us; with kernels shorter than that the GPU
  waits on the host). Assumptions, not measurements: a profile
  (`scripts/gpu_profile.py`) measures them.

`compare(kernels, profile)` sets a profile's measured time per kernel beside the estimate,
the kernels with the most time over their estimate first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from jaxspec.gpu_targets import hlo

__all__ = ["LAUNCH_GRAPH_S", "LAUNCH_STREAM_S", "KernelTime", "compare", "estimate_loop",
           "instruction_flops", "kernel_key", "load_profile", "peak_flops"]

LAUNCH_GRAPH_S = 1e-6  # per kernel replayed inside a CUDA graph (command buffer)
LAUNCH_STREAM_S = 4e-6  # per kernel launched from the host
_LOW = {"bf16", "f16"}
_EIGHT = {"s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3", "f8e3m4"}
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


def peak_flops(target, dtype: str) -> float:
    """FLOP/s of `target`'s matrix units for dots whose operands are `dtype` (an HLO type)."""
    if dtype in _EIGHT:
        return 2 * target.bf16_flops
    if dtype in _LOW:
        return target.bf16_flops
    return target.f32_flops


def _elements(shape: str) -> int:
    found = hlo._ARRAY.findall(shape)
    if not found:
        return 0
    n = 1
    for d in filter(None, found[0][1].split(",")):
        n *= int(d)
    return n


def _dims(shape: str) -> list[int]:
    found = hlo._ARRAY.findall(shape)
    return [int(d) for d in filter(None, found[0][1].split(","))] if found else []


def _dtype(shape: str) -> str:
    found = hlo._ARRAY.findall(shape)
    return found[0][0] if found else ""


def _index_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _dot(result: str, lhs: str, contracting: list[int]) -> tuple[float, str]:
    dims = _dims(lhs)
    k = math.prod(dims[i] for i in contracting) if contracting else 1
    return 2.0 * _elements(result) * k, _dtype(lhs)


def _convolution(result: str, kernel: str, attrs: str) -> tuple[float, str]:
    """2 x output elements x multiply-adds per output (the kernel's elements over its
    output-feature dimension, read from dim_labels, e.g. b01f_01io->b01f)."""
    m = re.search(r"dim_labels=[^_]*_([^-]*)->", attrs)
    dims = _dims(kernel)
    out_dim = m.group(1).index("o") if m and "o" in m.group(1) else len(dims) - 1
    per_output = math.prod(dims) / max(dims[out_dim], 1) if dims else 0
    return 2.0 * _elements(result) * per_output, _dtype(kernel)


def _first_array(shape: str) -> str:
    found = hlo._ARRAY.findall(shape)
    return f"{found[0][0]}[{found[0][1]}]" if found else shape


def _tree_attention(operands) -> tuple[float, str]:
    """jaxspec's Pallas tree attention: q against one layer of the stacked cache (rank 5,
    [layers, batch, slots, kv_heads, head_dim], the largest operand), two matmuls."""
    rank5 = [op for op in operands if len(_dims(op.shape)) == 5]
    if not rank5:
        return 0.0, ""
    stack = max(rank5, key=lambda op: op.bytes)
    sdims = _dims(stack.shape)
    queries = [op for op in rank5 if _dims(op.shape) != sdims and _dims(op.shape)[0] == sdims[1]
               and _dims(op.shape)[-1] == sdims[-1]]
    if not queries:
        return 0.0, ""
    q = queries[0]
    return 4.0 * _elements(q.shape) * sdims[2], _dtype(q.shape)


def instruction_flops(module: hlo.Module, inst: hlo.Instruction,
                      comp: hlo.Computation) -> tuple[float, str]:
    """(matrix-unit FLOPs of one execution of `inst`, the dtype they run in) where `inst`
    lives in `comp`: dots and convolutions, in fused computations too (see the module
    docstring); (0, "") for a kernel without any."""
    ops = [comp.instructions[o] for o in inst.operands if o in comp.instructions]
    if inst.opcode == "dot" and ops:
        return _dot(inst.shape, ops[0].shape, _index_list(inst.attrs, "lhs_contracting_dims"))
    if inst.opcode == "convolution" and len(ops) > 1:
        return _convolution(inst.shape, ops[1].shape, inst.attrs)
    if inst.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        target = target.group(1) if target else ""
        if target in _GEMM_TARGETS and ops:
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
            contracting = [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip()] if m else []
            return _dot(_first_array(inst.shape), ops[0].shape, contracting)
        if target.startswith("__cudnn$conv") and len(ops) > 1:
            return _convolution(_first_array(inst.shape), ops[1].shape, inst.attrs)
        if target.startswith("__cudnn$fmha") and len(ops) > 1:
            q, k = _dims(ops[0].shape), _dims(ops[1].shape)
            return 4.0 * math.prod(q) * (k[1] if len(k) > 1 else 0), _dtype(ops[0].shape)
        if "tree_attention" in inst.op_name:
            return _tree_attention(ops)
        return 0.0, ""
    if inst.opcode in ("fusion", "call", "async-start"):
        total, dtype = 0.0, ""
        for name in inst.called("calls") + inst.called("to_apply"):
            inner = module.computations.get(name)
            if inner is None:
                continue
            for i in inner.instructions.values():
                f, t = instruction_flops(module, i, inner)
                if f:
                    total, dtype = total + f, dtype or t
        return total, dtype
    return 0.0, ""


@dataclasses.dataclass
class KernelTime:
    """One kernel's estimate, per execution, and its executions per loop iteration."""

    name: str
    opcode: str
    op_name: str
    count: int
    bytes: int
    flops: float
    dtype: str
    in_command_buffer: bool
    seconds: float  # per execution: max(compute, memory) + launch
    bound: str  # "compute" or "memory"
    launch: float  # seconds of it

    @property
    def total_seconds(self) -> float:
        return self.count * self.seconds


def estimate_loop(module: hlo.Module, cost: hlo.LoopCost, target,
                  graph_share: float | None = None) -> list[KernelTime]:
    """The estimate of every kernel that `cost` (a walked loop body or program) walked, on
    `target` (a `jaxspec.gpu_targets.GpuTarget`). `graph_share`: the share of the loop's
    kernels XLA's thunks run inside a command buffer (newer XLA forms them after the HLO,
    `inspect.thunk_kernels`), each kernel's launch weighted by it; None: the HLO's own
    command-buffer calls say which kernels are inside."""
    if graph_share is not None and not 0.0 <= graph_share <= 1.0:
        raise ValueError(f"graph_share={graph_share!r}; must lie in [0, 1]")
    out = []
    for k in cost.kernel_list:
        flops, dtype = instruction_flops(module, k.inst, k.computation)
        compute = flops / peak_flops(target, dtype) if flops else 0.0
        memory = k.bytes / target.hbm_bandwidth
        if graph_share is None:
            launch = LAUNCH_GRAPH_S if k.in_command_buffer else LAUNCH_STREAM_S
        else:
            launch = graph_share * LAUNCH_GRAPH_S + (1 - graph_share) * LAUNCH_STREAM_S
        out.append(KernelTime(k.inst.name, k.inst.opcode, k.inst.op_name, k.count, k.bytes,
                              flops, dtype, k.in_command_buffer, max(compute, memory) + launch,
                              "compute" if compute > memory else "memory", launch))
    return out


def summary(kernels: list[KernelTime], top: int = 10) -> dict:
    """Per-iteration totals of an estimate (JSON-able) and its `top` costliest kernels."""
    launch = sum(k.count * k.launch for k in kernels)
    compute = sum(k.total_seconds for k in kernels if k.bound == "compute")
    return {
        "time_ms": 1e3 * sum(k.total_seconds for k in kernels),
        "launch_ms": 1e3 * launch,
        "compute_bound_ms": 1e3 * compute,
        "flops": sum(k.count * k.flops for k in kernels),
        "kernels": sum(k.count for k in kernels),
        "launch_graph_us": 1e6 * LAUNCH_GRAPH_S, "launch_stream_us": 1e6 * LAUNCH_STREAM_S,
        "largest": [{"name": k.name, "count": k.count, "us": 1e6 * k.seconds,
                     "bound": k.bound, "op_name": k.op_name}
                    for k in sorted(kernels, key=lambda k: -k.total_seconds)[:top]],
    }


def kernel_key(name: str) -> str:
    """A kernel's name as both the HLO and a profile spell it: XLA names a GPU kernel after
    its instruction with '.' and '-' made '_' (a profile event's `hlo_op` keeps the dots)."""
    return re.sub(r"[.\-]", "_", name)


def load_profile(path: str, program: str, batch: int | None = None) -> dict | None:
    """The measured kernels {kernel_key: {"us": mean per execution, "count": per
    iteration}} of `program` at `batch` in a profile JSON (scripts/gpu_profile.py), else
    None."""
    with open(path) as fh:
        data = json.load(fh)
    for case in data["cases"]:
        if case["program"] == program and (batch is None or case["batch"] == batch):
            iterations = max(case.get("iterations", 1), 1)
            return {kernel_key(k["name"]): {"us": k["us_per_call"],
                                            "count": k["calls"] / iterations}
                    for k in case["kernels"]}
    return None


def compare(kernels: list[KernelTime], measured: dict, top: int = 20) -> dict:
    """Measured beside estimated per kernel (`measured` as `load_profile` gives it), the
    kernels with the most time per iteration over their estimate first; and the totals of
    the kernels that matched, and of the measured ones the HLO does not name."""
    rows, matched = [], set()
    for k in kernels:
        m = measured.get(kernel_key(k.name))
        if m is None:
            continue
        matched.add(kernel_key(k.name))
        est, got = k.total_seconds * 1e6, m["us"] * m["count"]
        rows.append({"name": k.name, "op_name": k.op_name, "bound": k.bound,
                     "estimated_us": est, "measured_us": got, "over_us": got - est,
                     "ratio": got / est if est else None})
    rows.sort(key=lambda r: -r["over_us"])
    unmatched = {k: v for k, v in measured.items() if k not in matched}
    return {
        "matched": len(rows), "estimated_kernels": len(kernels),
        "estimated_us": sum(r["estimated_us"] for r in rows),
        "measured_us": sum(r["measured_us"] for r in rows),
        "unmatched_measured_us": sum(v["us"] * v["count"] for v in unmatched.values()),
        "unmatched": sorted(unmatched, key=lambda n: -unmatched[n]["us"] * unmatched[n]["count"])[:10],
        "furthest": rows[:top],
    }
