"""Every backend against the reference on a GPU (skipped without one; see tests/conftest.py).

Run on a GPU machine with: JAXSPEC_TEST_PLATFORMS=cuda python -m pytest -q tests/kernels -m gpu
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import jax_triton_available, resolve_backend, tree_attention
from jaxspec.kernels.reference import tree_attention_reference
from jaxspec.testing.tree_attention import ARG_ORDER, FLOAT_ARGS, TOL, make_inputs, rel_err

pytestmark = pytest.mark.gpu


def _backends():
    return ["pallas", "triton"] if jax_triton_available() else ["pallas"]


def _args(x, dtype):
    return [jnp.asarray(x[k], dtype) if k in FLOAT_ARGS else jnp.asarray(x[k]) for k in ARG_ORDER]


def _reference(args):
    with jax.default_matmul_precision("highest"):  # no TF32 in the oracle
        return jax.jit(tree_attention_reference)(*args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_backends_agree_on_gpu(group, dtype):
    # Qwen3-8B head_dim; a 1000-slot cache (not a multiple of any block); 16-node trees of
    # every depth, lengths 0, full and random.
    x = make_inputs(
        100 + group,
        batch=20,
        max_len=1000,
        nodes=16,
        q_heads=4 * group,
        kv_heads=4,
        head_dim=128,
    )
    args = _args(x, dtype)
    ref = _reference(args)
    for backend in _backends():
        for knobs in ({}, dict(kv_splits=1), dict(kv_splits=7, block_k=32)):
            out = jax.jit(functools.partial(tree_attention, backend=backend, **knobs))(*args)
            assert out.dtype == ref.dtype
            assert rel_err(out, ref) <= TOL[dtype], (backend, knobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backends_agree_on_a_prefill_block(dtype):
    """300 causal tokens over a ragged prefix: the tree loop runs over many node blocks."""
    x = make_inputs(7, batch=3, max_len=256, nodes=300, q_heads=8, kv_heads=2, head_dim=64)
    x["tree_mask"] = np.broadcast_to(np.tril(np.ones((300, 300), bool)), (3, 300, 300))
    args = _args(x, dtype)
    ref = _reference(args)
    for backend in _backends():
        out = jax.jit(functools.partial(tree_attention, backend=backend))(*args)
        assert rel_err(out, ref) <= TOL[dtype], backend


def test_auto_picks_a_kernel_on_gpu():
    assert resolve_backend("auto") == "pallas"


def test_kernel_backends_differentiate_through_the_reference_vjp_on_gpu():
    """Wiring only: a kernel backend's VJP is the reference's backward (no kernel backward)."""
    x = make_inputs(8, batch=3, max_len=64, nodes=8, q_heads=8, kv_heads=2, head_dim=64)
    args = _args(x, "float32")

    def loss(backend, q, kc, vc, kn, vn):
        out = tree_attention(q, kc, vc, args[3], kn, vn, args[6], backend=backend)
        return jnp.sum(jnp.sin(out))

    floats = [args[i] for i in (0, 1, 2, 4, 5)]
    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums=range(5)))(*floats)
        for backend in _backends():
            got = jax.jit(jax.grad(functools.partial(loss, backend), argnums=range(5)))(*floats)
            for g, w in zip(got, want, strict=True):
                assert rel_err(g, w) <= 1e-4, backend
