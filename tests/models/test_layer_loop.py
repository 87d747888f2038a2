"""The unrolled forward over per-layer weights without the stacked ones
(`Policy.without_stacked_layers`, what decoding passes its programs) equals the scanned
forward bit for bit, and refuses to scan; the Pallas kernel reading the stacked cache in
place gives a decode step the reference backend's numbers."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.testing.compile import use_cheap_compiles


@pytest.fixture(autouse=True, scope="module")
def _compile_as_users_do():
    """Bitwise equalities hold for the programs users run (full XLA optimisation), not for
    the suite's cheap compiles (tests/conftest.py lists such modules in
    _FULL_OPTIMISATION; this module sets it here, after conftest's fixture)."""
    use_cheap_compiles(False)
    yield


def _step(policy, cache, tokens, positions):
    logits, _, cache = policy.forward(tokens, positions, cache)
    return np.asarray(logits), cache


def test_dropped_stack_unrolled_equals_scan_bitwise():
    """float32, as the engine's tests compare them (in bfloat16 the unrolled and scanned
    programs round differently with or without the stacked weights: XLA fuses them apart)."""
    cfg = ModelConfig.tiny(dtype="float32", layer_loop="scan")
    scanned = random_policy(cfg, seed=3)
    unrolled = scanned.unstack_layers().without_stacked_layers()
    assert unrolled.stacked_layers_dropped and not scanned.stacked_layers_dropped
    prompt = jnp.array([[5, 9, 17, 3], [7, 1, 2, 0]], jnp.int32)
    pos = jnp.array([[0, 1, 2, 3], [0, 1, 2, -1]], jnp.int32)
    a, ca = _step(scanned, scanned.init_cache(2, 16), prompt, pos)
    b, cb = _step(unrolled, unrolled.init_cache(2, 16), prompt, pos)
    np.testing.assert_array_equal(a, b)
    nxt = jnp.array([[11], [4]], jnp.int32)
    a2, _ = _step(scanned, ca, nxt, ca.lengths[:, None])
    b2, _ = _step(unrolled, cb, nxt, cb.lengths[:, None])
    np.testing.assert_array_equal(a2, b2)


def test_dropped_stack_cannot_scan():
    policy = random_policy(ModelConfig.tiny(), seed=0).unstack_layers().without_stacked_layers()
    bare = policy.replace(layer_params=None)
    with pytest.raises(ValueError, match="stacked layer weights were dropped"):
        bare.forward(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="unstack_layers"):
        random_policy(ModelConfig.tiny(), seed=0).without_stacked_layers()


def test_pallas_in_place_stacked_cache_decode_matches_reference():
    """A prefill and two decode steps through the Pallas kernel (interpreted here), which
    reads each layer of the stacked cache in place, against the reference backend."""
    cfg = ModelConfig.tiny(layer_loop="unroll")
    ref = random_policy(cfg, seed=1).unstack_layers()
    pal = random_policy(cfg.replace(attention_backend="pallas"), seed=1).unstack_layers()
    tokens = jnp.array([[3, 8, 1], [9, 2, 6]], jnp.int32)
    pos = jnp.array([[0, 1, 2], [0, 1, 2]], jnp.int32)
    ca, cb = ref.init_cache(2, 16), pal.init_cache(2, 16)
    for step in range(3):
        a, ca = _step(ref, ca, tokens, pos)
        b, cb = _step(pal, cb, tokens, pos)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(cb.k), np.asarray(ca.k), rtol=1e-5, atol=1e-5)
        tokens = jnp.argmax(jnp.asarray(a)[:, -1], -1).astype(jnp.int32)[:, None]
        pos = ca.lengths[:, None]
