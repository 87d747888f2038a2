"""The GPU expert paths of jaxspec.models.moe against the dense reference (every expert over
every token, the unchosen weighted 0) in float32, forward and gradients (in the tokens, the
routing weights and all three expert projections): the grouped Pallas kernel (interpreted
here) and the decode-sized gather-in-the-reduction form, on random routings, routings that
leave experts empty and routings that send every token to one expert. And which path a
forward built for a GPU takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.kernels import target_platform
from jaxspec.models import ModelConfig
from jaxspec.models.moe import MoE

E, TOPK, H, I = 8, 2, 32, 16


def _moe(**kw):
    cfg = ModelConfig.tiny("qwen3_moe", vocab_size=64, hidden_size=H, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=16, num_experts=E,
                           moe_intermediate_size=I,
                           **{"num_experts_per_tok": TOPK, "norm_topk_prob": True, **kw})
    return MoE(cfg, rngs=nnx.Rngs(0))


def _routing(kind, n, rng):
    """(weights [n, K] float32, experts [n, K] int32): distinct experts per token."""
    if kind == "random":
        experts = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(n)])
    elif kind == "skewed":  # experts 1, 4 and 6 get nothing, expert 3 every token
        experts = np.stack([[3, rng.choice([0, 2, 5, 7])] for _ in range(n)])
    else:  # "one": every assignment to expert 5 (top-1 routing)
        experts = np.full((n, 1), 5)
    weights = rng.random(experts.shape) + 0.1
    return jnp.asarray(weights, jnp.float32), jnp.asarray(experts, jnp.int32)


def _value_and_grads(moe, method, x, weights, experts):
    gdef, state = nnx.split(moe)

    def f(state, x, weights):
        out = getattr(nnx.merge(gdef, state), method)(x, weights, experts)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))

    return jax.value_and_grad(f, argnums=(0, 1, 2))(state, x, weights)


def _assert_match(moe, method, x, weights, experts):
    (v, grads), (vd, gd) = (_value_and_grads(moe, m, x, weights, experts)
                            for m in (method, "_dense"))
    np.testing.assert_allclose(float(v), float(vd), rtol=1e-5, atol=1e-5)
    leaves, ref = jax.tree.leaves(grads), jax.tree.leaves(gd)
    assert len(leaves) == len(ref)
    for a, b in zip(leaves, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    gate = np.asarray(grads[0]["gate_proj"][...])
    used = set(np.asarray(experts).ravel().tolist())
    for e in range(E):  # experts no token routes to get exactly no gradient
        assert np.any(gate[e]) == (e in used)


@pytest.mark.parametrize("kind", ["random", "skewed", "one"])
def test_grouped_kernel_equals_dense_with_gradients(kind):
    """_grouped (Pallas grouped matmul, interpreted) == _dense, forward and gradients; 12
    tokens x top-2 = 24 rows > E, so several experts straddle row blocks."""
    moe = _moe(num_experts_per_tok=1 if kind == "one" else TOPK)
    rng = np.random.default_rng({"random": 0, "skewed": 1, "one": 2}[kind])
    n = 24 if kind == "one" else 12
    x = jnp.asarray(rng.standard_normal((n, H)), jnp.float32)
    weights, experts = _routing(kind, n, rng)

    class Interpreted(MoE):
        def _grouped(self, x, weights, experts):
            return super()._grouped(x, weights, experts, interpret=True)

    moe.__class__ = Interpreted
    _assert_match(moe, "_grouped", x, weights, experts)


@pytest.mark.parametrize("kind", ["random", "skewed", "one"])
def test_gathered_reduce_equals_dense_with_gradients(kind):
    """_gathered_reduce (each chosen expert's weights gathered into the reduction) ==
    _dense, forward and gradients, at a decode-sized 3 tokens."""
    moe = _moe(num_experts_per_tok=1 if kind == "one" else TOPK)
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((3, H)), jnp.float32)
    weights, experts = _routing(kind, 3, rng)
    _assert_match(moe, "_gathered_reduce", x, weights, experts)


def test_grouped_kernel_negative_control():
    """The comparison can fail: one assignment sent to another expert changes the output."""
    moe = _moe()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((12, H)), jnp.float32)
    weights, experts = _routing("random", 12, rng)
    wrong = experts.at[0, 0].set((experts[0, 0] + 1) % E)
    wrong = jnp.where(wrong[:, :1] == wrong[:, 1:], experts, wrong)
    out = moe._grouped(x, weights, wrong, interpret=True)
    ref = moe._dense(x, weights, experts)
    assert np.abs(np.asarray(out - ref))[0].max() > 1e-3


@pytest.mark.parametrize("tokens,backend,path", [
    (12, "blocked", "_grouped"),  # 24 assignments > 8 experts: the grouped kernel
    (3, "blocked", "_gathered_reduce"),  # 6 <= 8: decode-sized
    (12, "dense", "_dense"),  # an explicit backend other than blocked stays
    (12, "ragged", "_ragged"),
])
def test_a_gpu_forward_takes_the_gpu_paths(monkeypatch, tokens, backend, path):
    """Built for a GPU (kernels.target_platform, one device), "blocked" runs the grouped
    kernel and a decode-sized forward the gather-in-the-reduction form; on CPU neither."""
    moe = _moe(expert_backend=backend)
    called = []
    for name in ("_grouped", "_gathered_reduce", "_gathered", "_blocked", "_dense", "_ragged"):
        original = getattr(MoE, name)
        monkeypatch.setattr(MoE, name, lambda self, *a, _n=name, _o=original, **k: (
            called.append(_n), _o(self, *a, **k))[1])
    x = jax.ShapeDtypeStruct((1, tokens, H), jnp.float32)
    with target_platform("gpu"):
        jax.eval_shape(lambda x: moe(x), x)
    assert called == [path]
    called.clear()
    jax.eval_shape(lambda x: moe(x), x)  # on this CPU: the XLA paths
    assert called == [{"_grouped": "_blocked", "_gathered_reduce": "_gathered"}.get(path, path)]
