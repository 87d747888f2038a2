"""Runs the @triton.jit tree-attention kernel in Triton's CPU interpreter.

Started by test_kernels_triton.py in a fresh process with TRITON_INTERPRET=1
(the variable must be set before triton is imported). Prints one JSON line:
{case name: relative error against the reference} (its vectorised numpy copy,
tested against the jnp one in test_kernels_reference.py, so this process compiles nothing).
"""

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from jaxspec.kernels.triton_kernel import launch_config, tree_attention_kernel  # noqa: E402
from jaxspec.testing.tree_attention import ARG_ORDER, FLOAT_ARGS, make_inputs, numpy_reference, rel_err  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def combine_splits(o, m, l):
    """numpy twin of split_kv.combine_splits(axis=0) (that one is tested with the Pallas kernel)."""
    top = m.max(0, keepdims=True)
    w = np.exp(m - np.where(np.isfinite(top), top, 0.0))
    denom = (w * l).sum(0)
    return (w[..., None] * o).sum(0) / np.where(denom > 0, denom, 1.0)[..., None]


def run_triton(x, dtype, **knobs):
    """The kernel on torch CPU tensors, launched exactly as triton_backend launches it."""
    grid, constexprs, shapes = launch_config(x["q"].shape, x["k_cache"].shape, upcast=True, **knobs)
    args = []
    for k in ARG_ORDER:
        t = torch.from_numpy(np.ascontiguousarray(x[k]))
        if k in FLOAT_ARGS:
            t = t.to(TORCH[dtype])
        elif k == "tree_mask":
            t = t.to(torch.int8)
        args.append(t)
    outs = [torch.empty(shape, dtype=torch.float32) for shape in shapes]
    tree_attention_kernel[grid](*args, *outs, **constexprs)
    return combine_splits(*(t.numpy().astype(np.float64) for t in outs))


def main():
    results = {}
    cases = []
    for group in (1, 4, 8):
        shape = dict(batch=6, max_len=40, nodes=6, q_heads=2 * group, kv_heads=2, head_dim=16)
        # bf16 runs the same upcast arithmetic as fp32 in the interpreter: one case suffices.
        for dtype in ("float32", "bfloat16") if group == 8 else ("float32",):
            cases.append((f"group{group}-{dtype}", 20 + group, shape, dtype, dict(block_k=16)))
    odd = dict(batch=3, max_len=8, nodes=5, q_heads=4, kv_heads=2, head_dim=24)
    cases.append(("odd-shapes-float32", 30, odd, "float32", {}))
    split = dict(batch=4, max_len=72, nodes=4, q_heads=8, kv_heads=2, head_dim=16)
    cases.append(("splits3-float32", 31, split, "float32", dict(block_k=16, kv_splits=3)))
    prefill = dict(batch=2, max_len=24, nodes=40, q_heads=4, kv_heads=2, head_dim=16)
    cases.append(("nodeblocks-float32", 32, prefill, "float32", dict(block_n=16, block_r=32)))
    for name, seed, shape, dtype, knobs in cases:
        x = make_inputs(seed, **shape)
        if name.startswith("nodeblocks"):  # causal, like a prefill
            n = shape["nodes"]
            x["tree_mask"] = np.broadcast_to(np.tril(np.ones((n, n), bool)), (shape["batch"], n, n))
        # The reference on the same (rounded) inputs; compare after the backend's final cast.
        rounded = {
            k: x[k].astype(NUMPY[dtype]).astype(np.float64) if k in FLOAT_ARGS else x[k]
            for k in ARG_ORDER
        }
        ref = numpy_reference(*[rounded[k] for k in ARG_ORDER]).astype(NUMPY[dtype])
        out = run_triton(x, dtype, **knobs).astype(NUMPY[dtype])
        results[name] = rel_err(out, ref)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
