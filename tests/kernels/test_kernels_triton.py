"""The Triton kernel on CPU: its logic in Triton's interpreter, its sm_90 compile, lazy imports."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxspec.testing.tree_attention import TOL

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _child_env():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@needs_triton
def test_triton_kernel_matches_reference_in_interpreter():
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_interpret_child.py")],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 7
    for name, err in errors.items():
        tol = TOL["bfloat16" if "bfloat16" in name else "float32"]
        assert err <= tol, (name, err)


def test_cpu_use_never_imports_triton():
    code = (  # trace (no compile) the default backend and the Pallas one
        "import sys, jax, numpy as np\n"
        "from jaxspec.kernels import tree_attention\n"
        "z = np.zeros((1, 2, 2, 16), np.float32)\n"
        "args = (z, z, z, np.array([2]), z, z, np.eye(2, dtype=bool)[None])\n"
        "jax.eval_shape(tree_attention, *args)\n"
        "jax.eval_shape(lambda *a: tree_attention(*a, backend='pallas'), *args)\n"
        "bad = [m for m in ('triton', 'jax_triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@needs_triton
def test_triton_kernel_compiles_for_hopper_without_spills(tmp_path):
    """Ahead-of-time compile for sm_90 (H100/H200), pointers 16-byte aligned as jax-triton
    specialises them: Qwen3-8B heads, a 16-node tree, bf16, default knobs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jaxspec.kernels.triton_kernel import launch_config, tree_attention_kernel

    _, constexprs, _ = launch_config((32, 16, 32, 128), (32, 8192, 8, 128))
    sig = dict(
        q_ptr="*bf16",
        k_cache_ptr="*bf16",
        v_cache_ptr="*bf16",
        lengths_ptr="*i32",
        k_new_ptr="*bf16",
        v_new_ptr="*bf16",
        mask_ptr="*i8",
        o_ptr="*fp32",
        m_ptr="*fp32",
        l_ptr="*fp32",
        **{name: "constexpr" for name in constexprs},
    )
    sig = {name: sig[name] for name in tree_attention_kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    source = ASTSource(tree_attention_kernel, sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3)
    )
    assert "mma" in kernel.asm["ttgir"]  # tensor-core dots
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.exists():
        return
    path = tmp_path / "tree_attention_sm90.cubin"
    path.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run(
        [str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True, text=True
    ).stdout
    assert "STACK:0 " in usage, usage  # no register spills


@needs_triton
@pytest.mark.parametrize("api", ["out_type", "out_shape"])
def test_jax_triton_call_wiring(monkeypatch, api):
    """tree_attention_triton hands triton_call the launch_config the interpreter test ran,
    with either jax-triton API (out_type=/name= now, out_shape= before)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.kernels import triton_backend
    from jaxspec.kernels.triton_kernel import launch_config, tree_attention_kernel
    from jaxspec.testing.tree_attention import ARG_ORDER, make_inputs

    calls = []

    def new_api(
        *args, kernel, out_type=None, grid, name="", num_warps=None, num_stages=None, **kwargs
    ):
        calls.append(
            dict(
                args=args,
                kernel=kernel,
                out=out_type,
                grid=grid,
                name=name,
                num_warps=num_warps,
                num_stages=num_stages,
                meta=kwargs,
            )
        )
        # Partials of one split that saw nothing but one key with value 1 -> output 1.
        o, m, l = out_type
        return (jnp.ones(o.shape, o.dtype), jnp.zeros(m.shape, m.dtype), jnp.ones(l.shape, l.dtype))

    def old_api(*args, kernel, out_shape, grid, num_warps=4, num_stages=2, **metaparams):
        return new_api(
            *args,
            kernel=kernel,
            out_type=out_shape,
            grid=grid,
            num_warps=num_warps,
            num_stages=num_stages,
            **metaparams,
        )

    call_fn = new_api if api == "out_type" else old_api
    fake = type("jax_triton", (), {"triton_call": staticmethod(call_fn)})
    monkeypatch.setattr(triton_backend, "import_jax_triton", lambda: fake)
    x = make_inputs(0, batch=2, max_len=40, nodes=5, q_heads=8, kv_heads=2, head_dim=16)
    args = [jnp.asarray(x[k]) for k in ARG_ORDER]
    unjitted = triton_backend.tree_attention_triton.__wrapped__  # trace with this fake
    out = unjitted(*args, block_k=16, kv_splits=2, num_warps=8)
    np.testing.assert_array_equal(np.asarray(out), 1.0)
    [call] = calls
    grid, constexprs, shapes = launch_config(
        x["q"].shape, x["k_cache"].shape, block_k=16, kv_splits=2
    )
    assert call["kernel"] is tree_attention_kernel
    assert call["grid"] == grid == (4, 1, 2)
    assert call["meta"] == constexprs
    assert [tuple(s.shape) for s in call["out"]] == list(shapes)
    assert call["num_warps"] == 8 and call["num_stages"] == 3
    assert call["name"] == ("tree_attention" if api == "out_type" else "")
    dtypes = [a.dtype for a in call["args"]]
    assert dtypes == [jnp.float32] * 3 + [jnp.int32] + [jnp.float32] * 2 + [jnp.int8]
    assert [a.shape for a in call["args"]] == [a.shape for a in args]
