"""kernels.flash: causal attention over real tokens without [heads, T, T] arrays.

Forward and gradients against a plain-NumPy float64 attention with the dense mask (and
against `tree_attention_reference`, the project's oracle), with padding at both ends of a
row, GQA and T not a multiple of the block; the compiled CPU program holds no [.., T, T]
array; the policy's training forward with the chunked path equals the dense-mask one."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.flash import CausalMask, causal_attention, resolve
from jaxspec.kernels.reference import tree_attention_reference
from jaxspec.models.transformer import random_policy
from jaxspec.models.config import ModelConfig

B, T, HQ, HKV, D = 3, 37, 4, 2, 8
BLOCK = 8  # 37 = 4 * 8 + 5: the last block is partial


def _valid():  # row 0 right-padded, row 1 padded at both ends, row 2 full
    valid = np.ones((B, T), bool)
    valid[0, 30:] = False
    valid[1, :5] = False
    valid[1, 33:] = False
    return valid


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, T, HKV, D)).astype(np.float32)
    return q, k, v


def _numpy_attention(q, k, v, valid):  # float64, loops over heads: the definition
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    allowed = np.tril(np.ones((t, t), bool))[None] & valid[:, None, :]
    for h in range(hq):
        s = np.einsum("btd,bsd->bts", q[:, :, h].astype(np.float64),
                      k[:, :, h // group].astype(np.float64)) / np.sqrt(d)
        s = np.where(allowed, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        w = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
        den = w.sum(-1, keepdims=True)
        out[:, :, h] = np.einsum("bts,bsd->btd", w / np.where(den > 0, den, 1),
                                 v[:, :, h // group])
    return out


def _chunked(q, k, v, valid, block=BLOCK):
    return causal_attention(q, k, v, valid, implementation="chunked", block=block)


@pytest.mark.parametrize("block", [BLOCK, 128])  # several blocks with a partial one; one block
def test_forward_matches_numpy_and_the_oracle(block):
    q, k, v = _inputs()
    valid = _valid()
    got = np.asarray(jax.jit(_chunked, static_argnames="block")(q, k, v, valid, block=block))
    want = _numpy_attention(q, k, v, valid)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert np.all(got[1, :5] == 0)  # left padding sees no real key: zeros, as the oracle's
    empty = jnp.zeros((B, 0, HKV, D))
    oracle = tree_attention_reference(q, empty, empty, jnp.zeros((B,), jnp.int32), k, v,
                                      CausalMask(jnp.asarray(valid)).dense())
    np.testing.assert_allclose(got, np.asarray(oracle), atol=2e-6, rtol=2e-6)


def test_gradients_match_the_dense_reference_in_float32():
    q, k, v = _inputs(1)
    valid = _valid()
    # cotangents only on real queries (a padding query's output is never read)
    w = np.random.default_rng(2).standard_normal((B, T, HQ, D)).astype(np.float32)
    w *= valid[:, :, None, None]
    empty = jnp.zeros((B, 0, HKV, D))

    def dense(q, k, v):
        return tree_attention_reference(q, empty, empty, jnp.zeros((B,), jnp.int32), k, v,
                                        CausalMask(jnp.asarray(valid)).dense())

    def loss(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))

    got = loss(lambda q, k, v: _chunked(q, k, v, valid))(q, k, v)
    want = loss(dense)(q, k, v)
    for name, a, b in zip("qkv", got, want):
        scale = np.abs(np.asarray(b)).max()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6 * scale,
                                   err_msg=f"d{name}")
    # negative control: a gradient that ignored the padding mask would differ by far more
    wrong = loss(lambda q, k, v: _chunked(q, k, v, np.ones((B, T), bool)))(q, k, v)
    assert np.abs(np.asarray(wrong[1]) - np.asarray(want[1])).max() > 1e-2


def test_gradients_match_numpy_finite_differences_in_float64_terms():
    """d out / d q along a random direction, against NumPy's float64 central difference."""
    q, k, v = _inputs(3)
    valid = _valid()
    w = np.random.default_rng(4).standard_normal((B, T, HQ, D)) * valid[:, :, None, None]
    direction = np.random.default_rng(5).standard_normal(q.shape)
    grad_q = jax.grad(lambda q: jnp.sum(_chunked(q, k, v, valid) * w))(q)
    eps = 1e-4
    plus = _numpy_attention(q + eps * direction, k, v, valid)
    minus = _numpy_attention(q - eps * direction, k, v, valid)
    want = np.sum((plus - minus) * w) / (2 * eps)
    assert float(np.sum(np.asarray(grad_q, np.float64) * direction)) == pytest.approx(
        want, rel=1e-4)


def test_bfloat16_inputs_round_once():
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(6))
    valid = _valid()
    got = _chunked(q, k, v, valid)
    assert got.dtype == jnp.bfloat16
    want = _numpy_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), valid)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2, rtol=1e-2)


def test_compiled_program_holds_no_t_by_t_array():
    """Forward and backward at T = 1000 (block 128): no array with two dims of >= T / 2."""
    b, t = 1, 1000
    q = jax.ShapeDtypeStruct((b, t, HQ, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, HKV, D), jnp.float32)
    valid = jax.ShapeDtypeStruct((b, t), jnp.bool_)

    def step(q, k, v, valid):
        return jax.grad(lambda q, k, v: jnp.sum(causal_attention(
            q, k, v, valid, implementation="chunked") ** 2), argnums=(0, 1, 2))(q, k, v)

    def big_square(text):
        shapes = re.findall(r"\[([0-9,]+)\]", text)
        return [s for s in shapes if sum(int(n) >= t // 2 for n in s.split(",")) >= 2]

    text = jax.jit(step).lower(q, kv, kv, valid).compile().as_text()
    assert big_square(text) == []
    # negative control: the dense reference's program has them
    empty = jnp.zeros((b, 0, HKV, D))

    def dense(q, k, v, valid):
        return jax.grad(lambda q, k, v: jnp.sum(tree_attention_reference(
            q, empty, empty, jnp.zeros((b,), jnp.int32), k, v, CausalMask(valid).dense()) ** 2),
            argnums=(0, 1, 2))(q, k, v)

    assert big_square(jax.jit(dense).lower(q, kv, kv, valid).compile().as_text())


def test_policy_training_forward_and_gradient_match_the_dense_mask():
    """Policy.forward(cache=None): train_attention chunked (the CPU default) against
    "reference" (the dense mask through tree_attention), logits and a loss's gradient, on
    right-padded rows as the logprob stage packs them."""
    cfg = ModelConfig.tiny("qwen3", num_layers=2)
    chunked = random_policy(cfg.replace(train_attention="chunked"), seed=1)
    dense = chunked.with_config(train_attention="reference")
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
    positions = np.tile(np.arange(21, dtype=np.int32), (2, 1))
    positions[0, 15:] = -1

    def loss(policy, params):
        logits = policy.replace(params=params).forward(tokens, positions)[0]
        return jnp.sum(jnp.where(positions[..., None] >= 0, jax.nn.log_softmax(logits), 0.0))

    a, b = chunked.forward(tokens, positions)[0], dense.forward(tokens, positions)[0]
    real = positions >= 0
    np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], atol=2e-5, rtol=2e-5)
    ga = jax.grad(lambda p: loss(chunked, p))(chunked.params)
    gb = jax.grad(lambda p: loss(dense, p))(dense.params)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-4 * np.abs(y).max() + 1e-6)


def test_bad_choices_raise_one_clear_error():
    with pytest.raises(ValueError, match="train_attention='flash' is unknown; valid"):
        ModelConfig.tiny("qwen3", train_attention="flash")
    with pytest.raises(ValueError, match="needs a GPU and bfloat16"):
        resolve("cudnn", jnp.bfloat16, "cpu")
    with pytest.raises(ValueError, match="needs a GPU and bfloat16"):
        resolve("cudnn", jnp.float32, "gpu")
    assert resolve("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve("auto", jnp.float32, "gpu") == "chunked"
    assert resolve("auto", jnp.bfloat16, "cpu") == "chunked"
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="valid has shape"):
        causal_attention(q, k, v, np.ones((B, T + 1), bool))
    with pytest.raises(ValueError, match="block=0"):
        causal_attention(q, k, v, _valid(), block=0)


def test_bench_script_times_both_and_refuses_bad_input(tmp_path):
    import json
    import pathlib
    import runpy

    main = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "scripts" /
                              "bench_flash.py"), run_name="not_main")["main"]
    with pytest.raises(SystemExit):
        main(["--heads", "8,3"])
    with pytest.raises(SystemExit):
        main(["--lengths", "12,x"])
    out = tmp_path / "flash.json"
    main(["--lengths", "24", "--heads", "2,1", "--head-dim", "8", "--rounds", "1",
          "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["chunked", "dense"] and all(r["median_s"] > 0 for r in rows)


@pytest.mark.skipif(not __import__("jaxspec.gpu_targets").gpu_targets.plugin_installed(),
                    reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-aot]'): "
                           "nothing can be compiled for a GPU here")
def test_gpu_target_compiles_to_cudnn_kernels_without_t_by_t_arrays():
    """On an H100 target (no GPU needed), "auto" for bfloat16 is cuDNN's fused attention:
    forward and backward custom calls, no [T, T]-sized array in the optimized HLO."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec import gpu_targets
    from jaxspec.kernels.platform import target_platform

    t = 1024
    mesh = gpu_targets.mesh("h100", {"data": 1})
    spec = NamedSharding(mesh, PartitionSpec())
    q = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16, sharding=spec)
    valid = jax.ShapeDtypeStruct((1, t), jnp.bool_, sharding=spec)

    def step(q, k, v, valid):
        return jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, valid).astype(
            jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)

    with target_platform("gpu"):
        text = jax.jit(step).trace(q, kv, kv, valid).lower(
            lowering_platforms=("cuda",)).compile().as_text()
    calls = set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls
    assert not [s for s in re.findall(r"\[([0-9,]+)\]", text)
                if sum(int(n) >= t // 2 for n in s.split(",")) >= 2]


@pytest.mark.gpu
@pytest.mark.parametrize("left_pad", [0, 5])
def test_cudnn_matches_chunked_on_a_gpu(left_pad):
    """cuDNN against the chunked path (float32 inputs rounded to bfloat16 once), forward and
    gradients on the real queries, right-padded rows and rows padded at both ends."""
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(8))
    valid = np.ones((B, T), bool)
    valid[:, T - 6:] = False
    valid[1, :left_pad] = False
    real = jnp.asarray(valid)[:, :, None, None]
    w = jnp.asarray(np.random.default_rng(9).standard_normal((B, T, HQ, D)), jnp.float32) * real

    def run(impl):
        f = lambda q, k, v: causal_attention(q, k, v, valid, implementation=impl)
        out = f(q, k, v)
        grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w),
                         argnums=(0, 1, 2))(q, k, v)
        return out, grads

    (out_a, grads_a), (out_b, grads_b) = run("cudnn"), run("chunked")
    f32 = lambda x: np.asarray(x, np.float32)
    np.testing.assert_allclose(f32(out_a * real), f32(out_b * real), atol=3e-2)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(f32(a), f32(b), atol=5e-2 * np.abs(f32(b)).max())


@pytest.mark.skipif(not __import__("jaxspec.gpu_targets").gpu_targets.plugin_installed(),
                    reason="jax's CUDA plugin is not installed: nothing can be compiled for a GPU")
def test_gpu_target_under_fsdp_attends_each_devices_rows_without_gathers():
    """8 H100s, rows split over fsdp: the layer's cuDNN attention runs on each device's rows
    (layers._per_row_shards); its backward gathers no q/k/v-sized array. (Left to cuDNN's
    partitioner, the whole GRPO update gathered every row's q, k, v and softmax statistics;
    this small program alone does not show it, so the inspector's figure is the control:
    docs/BENCHMARKS.md.)"""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec import gpu_targets
    from jaxspec.kernels.platform import target_platform
    from jaxspec.models.layers import _per_row_shards

    mesh = gpu_targets.mesh("h100", {"data": 1, "fsdp": 8})
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    b, t = 8, 512
    q = jax.ShapeDtypeStruct((b, t, 8, 128), jnp.bfloat16, sharding=rows)
    kv = jax.ShapeDtypeStruct((b, t, 2, 128), jnp.bfloat16, sharding=rows)
    valid = jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=rows)
    attention = functools.partial(causal_attention, implementation="auto")

    def gathers(wrap):
        def step(q, k, v, valid):
            def loss(q, k, v):  # heads re-split by a matmul, as a layer's projections do
                out = wrap(attention, q * 1.5, k, v, valid)
                return jnp.sum(out.astype(jnp.float32) ** 2)
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        with target_platform("gpu"), jax.set_mesh(mesh):
            text = jax.jit(step).trace(q, kv, kv, valid).lower(
                lowering_platforms=("cuda",)).compile().as_text()
        return [line for line in text.splitlines() if "all-gather-start(" in line
                and f"[{b},{t}," in line.split("all-gather-start(")[0]]

    assert gathers(_per_row_shards) == []
