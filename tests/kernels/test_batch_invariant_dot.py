"""`kernels.invariant.invariant_dot`, the batch-invariant mode's matmul: a row's result has
the same bits whatever other rows share the call and wherever it sits among them, and a
column's whatever COL_TILE-aligned slice of the columns is asked for (the trainer's
vocabulary chunks); the values agree with a float64 NumPy product. (The module name holds
"test_batch_invariant": tests/conftest.py compiles it as users do.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.invariant import COL_TILE, ROW_TILE, invariant_dot


@pytest.mark.parametrize("k, o", [(24, 40), (64, 2 * COL_TILE + 300)])
def test_rows_and_column_tiles_do_not_change_the_bits(k, o):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((2 * ROW_TILE + 5, k)).astype(np.float32)
    w = rng.standard_normal((k, o)).astype(np.float32)
    f = jax.jit(invariant_dot)
    full = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for start, stop in [(0, 1), (3, 4), (5, 9), (ROW_TILE - 1, ROW_TILE + 3), (2, 2 * ROW_TILE + 5)]:
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[start:stop]), jnp.asarray(w))),
                                      full[start:stop])
    # leading axes are rows too ([B, T, K] as the model calls it)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:36].reshape(4, 9, k)), jnp.asarray(w))),
                                  full[:36].reshape(4, 9, o))
    if o > COL_TILE:  # a chunk of whole tiles from a tile boundary: the same columns' bits
        for start, width in [(0, COL_TILE), (COL_TILE, COL_TILE + 300), (0, 2 * COL_TILE)]:
            part = np.asarray(f(jnp.asarray(x[4:11]), jnp.asarray(w[:, start:start + width])))
            np.testing.assert_array_equal(part, full[4:11, start:start + width])


def test_gradient_matches_float64():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 12)).astype(np.float32)
    w = rng.standard_normal((12, 5)).astype(np.float32)
    g = rng.standard_normal((7, 5))
    dx, dw = jax.grad(lambda x, w: jnp.sum(jnp.asarray(g, jnp.float32) * invariant_dot(x, w)),
                      argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(dx, g @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x.T.astype(np.float64) @ g, rtol=1e-5, atol=1e-5)
