"""The fused attention-input kernel (jaxspec.kernels.qkv), interpreted on CPU, against the
model's own unfused layer (layers.RMSNorm, the projections, QK-norm, layers.apply_rope) and
float64 NumPy."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.kernels import qkv as qkv_kernel
from jaxspec.kernels import target_platform
from jaxspec.models.config import ModelConfig
from jaxspec.models.layers import DecoderLayer, apply_rope

EPS = 1e-6


def _config(dtype="float32", qk_norm=True, fused="xla"):
    return ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=qk_norm, dtype=dtype,
                       fused_kernels=fused, rms_norm_eps=EPS)


def _layer(cfg, seed=0):
    layer = DecoderLayer(cfg, rngs=nnx.Rngs(seed))
    # non-trivial norm scales (they start at ones)
    rng = np.random.default_rng(seed)
    for norm in (layer.input_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
        if norm is not None:
            shape = norm.scale[...].shape
            norm.scale[...] = jnp.asarray(1 + 0.3 * rng.normal(size=shape), cfg.param_dtype)
    return layer


def _unfused(layer, x, positions):  # what the layer computes without the kernel
    return layer.self_attn.project(layer.attention_input(x), positions)


def _inputs(cfg, b=2, t=24, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, t, cfg.hidden_size)), cfg.param_dtype)
    positions = jnp.asarray(rng.integers(0, 500, size=(b, t)), jnp.int32)
    return x, positions


@pytest.mark.parametrize("qk_norm", [True, False])
def test_float32_equals_the_unfused_layer(qk_norm):
    cfg = _config(qk_norm=qk_norm)
    layer = _layer(cfg)
    x, pos = _inputs(cfg)
    fused = layer.self_attn.project_normed(x, layer.input_layernorm, pos)
    for a, b, name in zip(fused, _unfused(layer, x, pos), "qkv"):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5,
                                   err_msg=name)


def test_float32_matches_float64_numpy():
    """An independent reference: the layer's math in float64 NumPy."""
    cfg = _config()
    layer = _layer(cfg, seed=3)
    x, pos = _inputs(cfg, seed=4)
    q, k, v = layer.self_attn.project_normed(x, layer.input_layernorm, pos)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    att = layer.self_attn
    x64 = f64(x)
    h = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + EPS) * f64(layer.input_layernorm.scale[...])

    def heads(w, norm):
        y = np.einsum("btf,fnd->btnd", h, f64(w[...]))
        y = y / np.sqrt(np.mean(y**2, -1, keepdims=True) + EPS) * f64(norm.scale[...])
        d = y.shape[-1]
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2) / d))
        ang = f64(pos)[..., None] * inv
        ang = np.concatenate([ang, ang], -1)[:, :, None, :]
        rot = np.concatenate([-y[..., d // 2:], y[..., :d // 2]], -1)
        return y * np.cos(ang) + rot * np.sin(ang)

    np.testing.assert_allclose(f64(q), heads(att.q_proj, att.q_norm), rtol=0, atol=5e-5)
    np.testing.assert_allclose(f64(k), heads(att.k_proj, att.k_norm), rtol=0, atol=5e-5)
    np.testing.assert_allclose(f64(v), np.einsum("btf,fnd->btnd", h, f64(att.v_proj[...])),
                               rtol=0, atol=5e-5)


def _exact_layer_and_inputs():
    """bfloat16 inputs whose projections are exact in float32 in any summation order: inputs
    of small integers (so the input norm's two roundings, of x / rms and of the scaled value,
    are exercised), norm scales of multiples of 1/8 and weights of multiples of 1/64: every
    product and partial sum fits float32's mantissa, so only the roundings of the norm, the
    QK-norm and RoPE can differ from XLA's."""
    cfg = _config(dtype="bfloat16")
    layer = _layer(cfg, seed=5)
    rng = np.random.default_rng(6)
    for w in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        w[...] = jnp.asarray(rng.integers(-8, 9, size=w[...].shape) / 64.0, jnp.bfloat16)
    layer.input_layernorm.scale[...] = jnp.asarray(
        rng.integers(4, 13, size=cfg.hidden_size) / 8.0, jnp.bfloat16)
    x = rng.integers(1, 4, size=(2, 16, cfg.hidden_size)) * rng.choice([-1, 1], size=(2, 16, cfg.hidden_size))
    pos = jnp.asarray(rng.integers(0, 500, size=(2, 16)), jnp.int32)
    return layer, jnp.asarray(x, jnp.bfloat16), pos


def test_bfloat16_rounds_as_the_unfused_layer():
    layer, x, pos = _exact_layer_and_inputs()
    fused = layer.self_attn.project_normed(x, layer.input_layernorm, pos)
    ref = jax.jit(_unfused)(layer, x, pos)
    for a, b, name in zip(fused, ref, "qkv"):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)


def test_rope_rounded_once_is_caught():
    """Negative control for the test above: RoPE computed in float32 and rounded once (XLA
    rounds each product and the sum to bfloat16) differs from the unfused layer."""
    layer, x, pos = _exact_layer_and_inputs()
    att = layer.self_attn
    q_normed = att.q_norm(jnp.einsum("btf,fnd->btnd", layer.input_layernorm(x), att.q_proj[...]))
    once = apply_rope(q_normed.astype(jnp.float32), pos, att.config).astype(jnp.bfloat16)
    ref = jax.jit(_unfused)(layer, x, pos)[0]
    assert np.mean(np.asarray(once, np.float32) != np.asarray(ref, np.float32)) > 0.05


def test_an_input_norm_rounded_once_is_caught():
    """Negative control for the input norm's part of the bitwise test: the scaled input
    computed in float32 and rounded once (XLA rounds x / rms, then the scaled value) gives
    other projections on these inputs."""
    layer, x, pos = _exact_layer_and_inputs()
    att = layer.self_attn
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + EPS)
    once = (x32 * inv * layer.input_layernorm.scale[...].astype(jnp.float32)).astype(jnp.bfloat16)
    v_once = jnp.einsum("btf,fnd->btnd", once, att.v_proj[...])
    v_ref = jax.jit(_unfused)(layer, x, pos)[2]
    assert np.mean(np.asarray(v_once, np.float32) != np.asarray(v_ref, np.float32)) > 0.05


@pytest.mark.parametrize("qk_norm", [True, False])
def test_gradient_is_the_reference_gradient(qk_norm):
    cfg = _config(qk_norm=qk_norm)
    layer = _layer(cfg, seed=7)
    x, pos = _inputs(cfg, t=16, seed=8)
    w = [jnp.asarray(np.random.default_rng(9 + i).normal(size=s), jnp.float32)
         for i, s in enumerate([(2, 16, 4, 32), (2, 16, 2, 32), (2, 16, 2, 32)])]

    def loss(project):
        def f(layer, x):
            return sum(jnp.sum(a * b) for a, b in zip(project(layer, x), w))
        return f

    fused = nnx.grad(loss(lambda l, x: l.self_attn.project_normed(x, l.input_layernorm, pos)),
                     argnums=(0, 1))(layer, x)
    ref = nnx.grad(loss(lambda l, x: _unfused(l, x, pos)), argnums=(0, 1))(layer, x)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_the_layer_uses_the_kernel_as_configured():
    """DecoderLayer with fused_kernels='pallas' (interpreted here) against 'xla': the same
    outputs, so the switch is the kernel alone."""
    x, pos = _inputs(_config(), t=16)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((16, 16), bool)), (2, 16, 16))
    cache = jnp.zeros((2, 0, 2, 32), jnp.float32)
    outs = {}
    for fused in ("xla", "pallas"):
        layer = _layer(_config(fused=fused), seed=10)
        outs[fused] = layer(x, pos, cache, cache, jnp.zeros((2,), jnp.int32), mask)
    for a, b in zip(outs["pallas"], outs["xla"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-5, atol=5e-5)


def test_which_forwards_use_the_kernel():
    assert not qkv_kernel.use_fused("xla", 1024, 4096, 128)
    assert qkv_kernel.use_fused("pallas", 1024, 4096, 128)
    assert not qkv_kernel.use_fused("pallas", 1000, 4096, 128)  # not whole tiles
    assert not qkv_kernel.use_fused("pallas", 1024, 4096, 24)  # half a head is no tile
    assert not qkv_kernel.use_fused("auto", 1024, 4096, 128)  # CPU
    with target_platform("gpu"):  # timed slower than XLA at 256 and 1,024 rows (docs/kernels.md)
        for tokens in (64, 256, 1024, 8192):
            assert not qkv_kernel.use_fused("auto", tokens, 4096, 128)
        assert qkv_kernel.use_fused("pallas", 1024, 4096, 128)


def _dot_precisions(jaxpr):
    """The precision of every dot_general in a jaxpr, sub-jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _dot_precisions(sub)
    return out


@pytest.mark.parametrize("kernel", ["qkv", "swiglu"])
def test_float32_backward_runs_at_full_precision(kernel):
    """A float32 policy's products are never TF32 (models.config.matmul_precision); a custom
    VJP's backward is traced outside the forward's precision context, so the kernels set it
    for their XLA backward themselves. Every dot of the gradient's program is HIGHEST."""
    from jaxspec.kernels import swiglu

    rng = np.random.default_rng(11)
    if kernel == "qkv":
        cfg = _config()
        layer = _layer(cfg, seed=12)
        x, pos = _inputs(cfg, t=16, seed=13)
        fn = lambda x: sum(jnp.sum(a) for a in layer.self_attn.project_normed(  # noqa: E731
            x, layer.input_layernorm, pos))
    else:
        wg, wu = (jnp.asarray(rng.normal(size=(64, 64)), jnp.float32) for _ in range(2))
        x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
        fn = lambda x: jnp.sum(swiglu.swiglu(x, wg, wu, True))  # noqa: E731
    precisions = _dot_precisions(jax.make_jaxpr(jax.grad(fn))(x).jaxpr)
    assert precisions and all(p is not None and jax.lax.Precision.HIGHEST in tuple(p)
                              for p in precisions), precisions
