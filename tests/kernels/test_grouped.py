"""The grouped expert matmul (jaxspec.kernels.grouped, Pallas in interpret mode) against
NumPy, row by row: forward, the transposed-weight form, and the gradients in x and w, on
routings with empty groups, all rows in one group, groups of more rows than a block, and
groups straddling row blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.grouped import group_bounds, grouped_matmul, grouped_matmul_pallas, row_block

E, K, N = 4, 32, 48


def _groups(kind, m, rng):
    if kind == "random":  # group 1 empty, the others random
        g = rng.choice([0, 2, 3], m)
    else:  # "one": every row in the last group: 3 empty groups, one over several blocks
        g = np.full(m, E - 1)
    return np.sort(g).astype(np.int32)


def _numpy(x, w, g, dy):  # float64 row-by-row reference: y, dx, dw
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y = np.stack([x[r] @ w[g[r]] for r in range(len(g))])
    dx = np.stack([dy[r] @ w[g[r]].T for r in range(len(g))])
    dw = np.zeros_like(w)
    for r in range(len(g)):
        dw[g[r]] += np.outer(x[r], dy[r])
    return y, dx, dw


@pytest.mark.parametrize("kind,m", [("random", 24), ("one", 40), ("random", 37)])
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_matmul_and_gradients_equal_numpy(kind, m, transpose):
    rng = np.random.default_rng(m)
    g = _groups(kind, m, rng)
    x = rng.standard_normal((m, K)).astype(np.float32)
    w = rng.standard_normal((E, K, N)).astype(np.float32)
    dy = rng.standard_normal((m, N)).astype(np.float32)
    starts, ends = group_bounds(jnp.asarray(g), E)
    wk = np.swapaxes(w, 1, 2) if transpose else w  # [E, N, K] when transposed

    def f(x, w):
        return grouped_matmul(x, w, starts, ends, transpose, True)

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(wk))
    dx, dw = vjp(jnp.asarray(dy))
    ry, rdx, rdw = _numpy(x, w, g, dy)
    np.testing.assert_allclose(np.asarray(y), ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), rdx, rtol=1e-5, atol=1e-5)
    got_dw = np.swapaxes(np.asarray(dw), 1, 2) if transpose else np.asarray(dw)
    np.testing.assert_allclose(got_dw, rdw, rtol=1e-5, atol=1e-5)
    empty = [e for e in range(E) if e not in set(g.tolist())]
    assert empty or kind == "random"
    for e in empty:  # an empty group's weight gradient is exactly zero
        assert not np.any(got_dw[e])


def test_a_wrong_group_changes_the_result():
    """Negative control: the kernel reads each row's own group's weights."""
    rng = np.random.default_rng(0)
    g = _groups("random", 24, rng)
    x = jnp.asarray(rng.standard_normal((24, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, K, N)), jnp.float32)
    y = grouped_matmul_pallas(x, w, *group_bounds(jnp.asarray(g), E), interpret=True)
    shifted = np.where(g == 2, 3, g).astype(np.int32)  # group 2's rows read as group 3's
    y2 = grouped_matmul_pallas(x, w, *group_bounds(jnp.asarray(shifted), E), interpret=True)
    rows = g == 2
    assert np.abs(np.asarray(y - y2))[rows].min() > 0
    np.testing.assert_array_equal(np.asarray(y)[~rows], np.asarray(y2)[~rows])


def test_row_block():
    assert row_block(8 * 64, 128) == 16  # decode at batch 64: 4 rows per expert
    assert row_block(8 * 256, 128) == 32  # verify k = 3 at batch 64: 16 per expert
    assert row_block(100_000, 128) == 128
    assert row_block(20, 2) == 16  # never more than the rows


@pytest.mark.parametrize("shape,w_shape,msg", [
    ((24, K), (E, K + 1, N), "do not chain"),
    ((8, K), (E, K, N), "rows 8"),
    ((24, 24), (E, 24, N), "K 24"),
])
def test_bad_shapes_name_the_values(shape, w_shape, msg):
    starts = ends = jnp.zeros((E,), jnp.int32)
    with pytest.raises(ValueError, match=msg):
        grouped_matmul_pallas(jnp.zeros(shape), jnp.zeros(w_shape), starts, ends, interpret=True)


def test_forward_and_backward_lower_to_triton_for_cuda():
    """Lowered for CUDA on this machine (no GPU needed): the forward is one Triton call, the
    backward two more (dx, dW); Pallas' Triton lowering accepts every kernel."""
    m, e = 64, 4
    starts, ends = group_bounds(jnp.repeat(jnp.arange(e, dtype=jnp.int32), m // e), e)

    def loss(x, w):
        return jnp.sum(grouped_matmul(x, w, starts, ends).astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((m, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((e, 64, 128), jnp.bfloat16)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
