"""The Pallas kernel (interpret mode on CPU) against the jnp reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_attention, tree_attention_reference
from jaxspec.kernels.pallas import tree_attention_pallas
from jaxspec.testing.tree_attention import ARG_ORDER, FLOAT_ARGS, TOL, make_inputs, rel_err

reference = jax.jit(tree_attention_reference)


def _args(x, dtype):
    return [jnp.asarray(x[k], dtype) if k in FLOAT_ARGS else jnp.asarray(x[k]) for k in ARG_ORDER]


# Knobs vary across the cases: they must never change the math.
KNOBS = {
    (1, "float32"): dict(block_k=16),
    (1, "bfloat16"): dict(block_k=16, kv_splits=3),
    (4, "float32"): dict(block_k=32, block_r=16, kv_splits=2),
    (4, "bfloat16"): dict(block_k=16, block_r=16),
    (8, "float32"): dict(block_k=16, kv_splits=3),
    (8, "bfloat16"): dict(block_k=32),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_pallas_matches_reference(group, dtype):
    # 8 rows: trees of every depth 1..6 (depth 6 = the chain) and two more random ones;
    # cache lengths 0, full (40) and random; 40 is not a multiple of block_k, so the last
    # prefix block is the shifted, masked one.
    x = make_inputs(
        10 + group, batch=8, max_len=40, nodes=6, q_heads=2 * group, kv_heads=2, head_dim=16
    )
    args = _args(x, dtype)
    out = tree_attention_pallas(*args, interpret=True, **KNOBS[group, dtype])
    ref = reference(*args)
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    assert rel_err(out, ref) <= TOL[dtype]


def test_pallas_node_blocks_and_odd_shapes():
    """A prefill-like block: 40 causal tokens (3 node blocks of 16, the last padded),
    head_dim 24 and an 8-slot cache (both zero-padded to Triton-friendly sizes)."""
    x = make_inputs(7, batch=3, max_len=8, nodes=40, q_heads=4, kv_heads=2, head_dim=24)
    x["tree_mask"] = np.broadcast_to(np.tril(np.ones((40, 40), bool)), (3, 40, 40))
    args = _args(x, "float32")
    out = tree_attention_pallas(*args, block_n=16, block_r=32, interpret=True)
    assert out.shape == (3, 40, 4, 24)
    assert rel_err(out, reference(*args)) <= TOL["float32"]


def test_pallas_backend_differentiates_through_the_reference_vjp():
    """backend='pallas' interprets off-GPU. Kernel backends have no backward of their own: their
    custom VJP recomputes the reference's (jaxspec/kernels/__init__.py). So this checks the
    wiring (pallas forward, reference backward, argument order), not a kernel backward; the
    reference's gradient itself is checked against finite differences in
    test_kernels_reference.py."""
    x = make_inputs(5, batch=2, max_len=16, nodes=3, q_heads=4, kv_heads=2, head_dim=16)
    args = _args(x, "float32")

    def loss(backend, q, kc, vc, kn, vn):
        out = tree_attention(q, kc, vc, args[3], kn, vn, args[6], backend=backend)
        return jnp.sum(jnp.sin(out)), out

    def value_and_grads(backend):
        fn = jax.value_and_grad(functools.partial(loss, backend), argnums=range(5), has_aux=True)
        return jax.jit(fn)(*[args[i] for i in (0, 1, 2, 4, 5)])

    (_, out), grads = value_and_grads("pallas")
    (_, ref), want = value_and_grads("reference")
    assert rel_err(out, ref) <= TOL["float32"]
    for g, w in zip(grads, want, strict=True):
        assert rel_err(g, w) <= 1e-5


@pytest.mark.parametrize("dtype, s", [("float32", 1000), ("bfloat16", 1024)])
def test_pallas_lowers_to_triton_for_cuda(dtype, s):
    """Qwen3-8B head shapes lower through the Pallas Triton lowering (no GPU needed), with
    the shifted last KV block (1000 slots) and without (1024)."""
    b, n, hq, hkv, d = 2, 16, 32, 8, 128
    sds = jax.ShapeDtypeStruct
    args = (
        sds((b, n, hq, d), dtype),
        sds((b, s, hkv, d), dtype),
        sds((b, s, hkv, d), dtype),
        sds((b,), jnp.int32),
        sds((b, n, hkv, d), dtype),
        sds((b, n, hkv, d), dtype),
        sds((b, n, n), jnp.bool_),
    )
    fn = functools.partial(tree_attention_pallas, interpret=False)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


def test_bad_block_size_is_a_clear_error():
    x = make_inputs(6, batch=1, max_len=16, nodes=2, q_heads=2, kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="block_k=24"):
        tree_attention_pallas(*_args(x, "float32"), block_k=24, interpret=True)
    with pytest.raises(ValueError, match="kv_splits"):
        tree_attention_pallas(*_args(x, "float32"), kv_splits=0, interpret=True)
