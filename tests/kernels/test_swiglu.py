"""The fused SwiGLU kernel (jaxspec.kernels.swiglu), interpreted on CPU, against independent
references: float64 NumPy for the function, and XLA's unfused bfloat16 MLP for the epilogue's
roundings (inputs whose products are exact, so only the roundings can differ)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import swiglu, target_platform
from jaxspec.kernels.swiglu import swiglu_pallas
from jaxspec.models.config import ModelConfig
from jaxspec.errors import FieldError
from jaxspec.models.layers import MLP


def _numpy_swiglu(x, wg, wu):
    x, wg, wu = (np.asarray(a, np.float64) for a in (x, wg, wu))
    g, u = x @ wg, x @ wu
    return g / (1.0 + np.exp(-g)) * u


def _inputs(seed, tokens, hidden, mlp, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), dtype)
    wg = jnp.asarray(rng.normal(size=(hidden, mlp)) / np.sqrt(hidden), dtype)
    wu = jnp.asarray(rng.normal(size=(hidden, mlp)) / np.sqrt(hidden), dtype)
    return x, wg, wu


@pytest.mark.parametrize("tokens, hidden, mlp, blocks", [
    (48, 128, 192, dict(block_m=32, block_n=64, block_k=32)),  # token block shrinks to 16
    (128, 64, 64, dict(block_m=128, block_n=64, block_k=64)),  # one hidden step
    (16, 256, 128, dict(block_m=16, block_n=16, block_k=16)),  # many small tiles
])
def test_float32_matches_float64_numpy(tokens, hidden, mlp, blocks):
    x, wg, wu = _inputs(0, tokens, hidden, mlp, jnp.float32)
    out = swiglu_pallas(x, wg, wu, interpret=True, **blocks)
    assert out.shape == (tokens, mlp) and out.dtype == jnp.float32
    exact = _numpy_swiglu(x, wg, wu)
    err = np.max(np.abs(np.asarray(out, np.float64) - exact)) / np.max(np.abs(exact))
    assert err < 2e-6, err


def test_bfloat16_within_its_rounding_of_float64_numpy():
    x, wg, wu = _inputs(1, 64, 128, 128, jnp.bfloat16)
    out = swiglu_pallas(x, wg, wu, block_m=32, block_n=32, block_k=32, interpret=True)
    assert out.dtype == jnp.bfloat16
    exact = _numpy_swiglu(x, wg, wu)
    # bfloat16 roundings (gate, up, silu's steps, the product): each <= 2^-8 relative
    rel = np.abs(np.asarray(out, np.float64) - exact) / np.maximum(np.abs(exact), 1e-3)
    assert np.quantile(rel, 0.99) < 4 * 2.0**-8, np.quantile(rel, 0.99)


def _exact_inputs(dtype=jnp.bfloat16):
    """Multiples of 1/8 in [-1, 1] over a hidden size of 64: every product and partial sum is
    exact in float32 whatever the order, so the kernel's and XLA's projections agree to the
    bit and only the epilogue's roundings can differ."""
    rng = np.random.default_rng(2)
    x = rng.integers(-8, 9, size=(32, 64)) / 8.0
    wg = rng.integers(-8, 9, size=(64, 64)) / 64.0
    wu = rng.integers(-8, 9, size=(64, 64)) / 64.0
    return tuple(jnp.asarray(a, dtype) for a in (x, wg, wu))


def _xla_mlp_first_half(x, wg, wu):  # what layers.MLP computes without the kernel
    return jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu)


def test_bfloat16_epilogue_rounds_as_the_unfused_mlp():
    x, wg, wu = _exact_inputs()
    out = swiglu_pallas(x, wg, wu, block_m=16, block_n=32, block_k=16, interpret=True)
    ref = jax.jit(_xla_mlp_first_half)(x, wg, wu)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_an_epilogue_rounding_once_is_caught():
    """Negative control for the test above: silu and the product computed in float32 and
    rounded once (not in the parameter dtype, as the unfused MLP computes them) differ from
    XLA's unfused MLP on these inputs."""
    x, wg, wu = _exact_inputs()
    g = jnp.dot(x, wg, preferred_element_type=jnp.float32)
    u = jnp.dot(x, wu, preferred_element_type=jnp.float32)
    g32, u32 = g.astype(jnp.bfloat16).astype(jnp.float32), u.astype(jnp.bfloat16).astype(jnp.float32)
    once = (jax.nn.silu(g32) * u32).astype(jnp.bfloat16)
    ref = jax.jit(_xla_mlp_first_half)(x, wg, wu)
    assert np.mean(np.asarray(once, np.float32) != np.asarray(ref, np.float32)) > 0.1


def test_gradient_is_the_reference_gradient():
    x, wg, wu = _inputs(3, 32, 64, 64, jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(32, 64)), jnp.float32)

    def loss(f):
        return lambda x, wg, wu: jnp.sum(f(x, wg, wu) * w)

    fused = jax.grad(loss(lambda *a: swiglu.swiglu(*a, True)), argnums=(0, 1, 2))(x, wg, wu)
    ref = jax.grad(loss(swiglu.swiglu_reference), argnums=(0, 1, 2))(x, wg, wu)
    for a, b in zip(fused, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_the_mlp_with_the_kernel_equals_the_mlp_without():
    from flax import nnx

    rngs = nnx.Rngs(0)
    xla = MLP(64, 128, dtype=jnp.float32, rngs=rngs, kernel="xla")
    fused = MLP(64, 128, dtype=jnp.float32, rngs=nnx.Rngs(0), kernel="pallas")
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 8, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(fused(x)), np.asarray(xla(x)), rtol=2e-5, atol=2e-6)


def test_which_forwards_use_the_kernel():
    assert not swiglu.use_fused("xla", 1024, 4096, 12288)
    assert swiglu.use_fused("pallas", 1024, 4096, 12288)
    assert not swiglu.use_fused("pallas", 1000, 4096, 12288)  # not whole tiles: XLA
    assert not swiglu.use_fused("auto", 1024, 4096, 12288)  # CPU: XLA
    with target_platform("gpu"):  # timed slower than XLA at 256 and 1,024 rows (docs/kernels.md)
        for tokens in (64, 256, 1024, 8192):
            assert not swiglu.use_fused("auto", tokens, 4096, 12288)
        assert swiglu.use_fused("pallas", 1024, 4096, 12288)


def test_bad_kernel_name_is_one_clear_error():
    with pytest.raises(FieldError, match="fused_kernels.*'auto', 'xla', 'pallas'"):
        ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, fused_kernels="fast")


def test_sizes_that_are_not_whole_tiles_are_refused():
    x, wg, wu = _inputs(6, 40, 64, 64, jnp.float32)
    with pytest.raises(ValueError, match="not whole tiles"):
        swiglu_pallas(x, wg, wu, interpret=True)
