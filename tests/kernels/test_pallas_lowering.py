"""The Pallas kernel's Triton module is valid MLIR, checked on any machine.

On a GPU, XLA parses the Triton module that Pallas lowers the kernel to, and the MLIR
verifier rejects malformed ops there, at the first call. An H100 session (jax 0.11.2) found
every Pallas call failing that way: "'scf.for' op failed to verify that all of {lowerBound,
upperBound, step} have same type" (an i1 upper bound). JAX can lower for CUDA on a CPU-only
machine, so this test lowers the kernel for CUDA here and runs the same verifier on the
module, over the shapes and knobs the GPU tests use. It reads the module out of the
lowered program through JAX's private MLIR bindings (jax._src), which may move between
JAX versions.
"""

import jax
import jax.numpy as jnp
import pytest

# JAX's private MLIR bindings (every jaxlib this project supports, >= 0.10, has them): if a
# future one moves them, this import fails loudly and the test needs updating.
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect

from jaxspec.kernels.pallas import tree_attention_pallas


def _ops(op):
    yield op
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield from _ops(child.operation)


def _triton_modules(fn, *avals):
    """The serialized Triton modules of the Pallas calls in `fn` lowered for CUDA."""
    lowered = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
    out = []
    for op in _ops(lowered.compiler_ir("stablehlo").operation):
        if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            if "ir" in config:
                out.append(ir.StringAttr(config["ir"]).value_bytes)
    return out


def _verify(module: bytes):
    """Parse (which verifies) the module in a context that knows the Triton dialect;
    raises on an invalid module, as XLA does on a GPU."""
    ctx = mlir.JaxIrContext()
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    with ctx:
        parsed = ir.Module.parse(module)
        assert parsed.operation.verify()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "batch, max_len, nodes, q_heads, kv_heads, head_dim, knobs",
    [
        (20, 1000, 16, 16, 4, 128, {}),  # the GPU test's shapes (group 4)
        (20, 1000, 16, 32, 4, 128, dict(kv_splits=1)),
        (20, 1000, 16, 4, 4, 128, dict(kv_splits=7, block_k=32)),
        (3, 256, 300, 8, 2, 64, {}),  # a prefill block: many tree-node blocks
    ],
)
def test_pallas_triton_module_verifies(dtype, batch, max_len, nodes, q_heads, kv_heads,
                                       head_dim, knobs):
    avals = [
        jax.ShapeDtypeStruct((batch, nodes, q_heads, head_dim), dtype),  # q
        jax.ShapeDtypeStruct((batch, max_len, kv_heads, head_dim), dtype),  # k_cache
        jax.ShapeDtypeStruct((batch, max_len, kv_heads, head_dim), dtype),  # v_cache
        jax.ShapeDtypeStruct((batch,), jnp.int32),  # cache_lengths
        jax.ShapeDtypeStruct((batch, nodes, kv_heads, head_dim), dtype),  # k_new
        jax.ShapeDtypeStruct((batch, nodes, kv_heads, head_dim), dtype),  # v_new
        jax.ShapeDtypeStruct((batch, nodes, nodes), jnp.bool_),  # tree_mask
    ]
    modules = _triton_modules(lambda *a: tree_attention_pallas(*a, **knobs), *avals)
    assert modules, "no Pallas Triton call in the lowered program"
    for module in modules:
        _verify(module)


def _aliases(fn, *avals):
    """The output-operand aliases of each Pallas call in `fn` lowered for CUDA (the stacked
    caches a call passes on in place)."""
    from jaxspec.kernels import target_platform

    with target_platform("gpu"):
        lowered = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
    calls = [op for op in _ops(lowered.compiler_ir("stablehlo").operation)
             if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes]
    assert calls, "no Pallas call in the lowered program"
    return [len(op.attributes["output_operand_aliases"])
            if "output_operand_aliases" in op.attributes else 0 for op in calls]


@pytest.mark.parametrize("kv_splits", [1, 2])  # one split writes o alone; several o, m, l
@pytest.mark.parametrize("thread", [True, False])
def test_a_stacked_cache_is_aliased_only_when_the_caller_threads_it(thread, kv_splits):
    """A layer loop threads its stacked cache through the kernel (aliased outputs: one buffer,
    no copy); a caller that only reads the stack (the block drafter's body, which reads the
    same stack again in its next layer and keeps it) must get no aliased outputs, since XLA
    copies an aliased input that is still live: the whole cache at every draft step."""
    from jaxspec.kernels import CacheLayer, tree_attention

    b, s, n, hq, hkv, d, layers = 2, 64, 4, 4, 2, 64, 3
    dtype = jnp.bfloat16
    stack = jax.ShapeDtypeStruct((layers, b, s, hkv, d), dtype)
    avals = [
        jax.ShapeDtypeStruct((b, n, hq, d), dtype), stack, stack,
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, n, hkv, d), dtype), jax.ShapeDtypeStruct((b, n, hkv, d), dtype),
        jax.ShapeDtypeStruct((b, n, n), jnp.bool_),
    ]

    def fn(q, k_stack, v_stack, lengths, k_new, v_new, mask):
        layer = jnp.int32(1)
        return tree_attention(q, CacheLayer(k_stack, layer), CacheLayer(v_stack, layer), lengths,
                              k_new, v_new, mask, backend="pallas", thread=thread, block_k=16,
                              kv_splits=kv_splits)

    assert _aliases(fn, *avals) == [2 if thread else 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens, hidden, mlp", [(1024, 4096, 12288), (48, 128, 192)])
def test_swiglu_triton_module_verifies(dtype, tokens, hidden, mlp):
    from jaxspec.kernels.swiglu import swiglu_pallas

    avals = [jax.ShapeDtypeStruct((tokens, hidden), dtype),
             jax.ShapeDtypeStruct((hidden, mlp), dtype), jax.ShapeDtypeStruct((hidden, mlp), dtype)]
    modules = _triton_modules(swiglu_pallas, *avals)
    assert len(modules) == 1
    _verify(modules[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens, hidden, q_heads, kv_heads, head_dim, qk_norm", [
    (1024, 4096, 32, 8, 128, True),  # Qwen3-8B, a 64-row tree verify
    (48, 128, 6, 2, 64, False),  # the token block shrinks to 16; no QK-norm (Llama)
])
def test_qkv_triton_module_verifies(dtype, tokens, hidden, q_heads, kv_heads, head_dim, qk_norm):
    from jaxspec.kernels.qkv import qkv_pallas

    f = jax.ShapeDtypeStruct
    scale = f((head_dim,), dtype) if qk_norm else None
    avals = [f((tokens, hidden), dtype), f((tokens,), jnp.float32), f((hidden,), dtype),
             f((hidden, q_heads, head_dim), dtype), f((hidden, kv_heads, head_dim), dtype),
             f((hidden, kv_heads, head_dim), dtype), scale, scale,
             f((tokens, head_dim), dtype), f((tokens, head_dim), dtype)]
    modules = _triton_modules(qkv_pallas, *avals)
    assert len(modules) == 1
    _verify(modules[0])
