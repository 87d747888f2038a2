"""Sharded policy forward (ragged prefill, decode, tree verify, KV compaction) on three
meshes equals the one-device forward, with activations and the KV cache kept sharded
over batch and kv_heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxspec import parallel
from jaxspec.decoding.tree import Tree
from jaxspec.models import compact
from jaxspec.testing.meshes import MESHES

BATCH, WIDTH, MAX_LEN = 8, 6, 16
CAPTURE = (0, 2)


@jax.jit
def prefill_decode_verify(policy, inputs):
    """The engine's three forward shapes in sequence on one cache, then a path compaction."""
    cache = policy.init_cache(BATCH, MAX_LEN)
    pre_logits, pre_captured, cache = policy.forward(
        inputs["prompt"], inputs["prompt_pos"], cache, capture=CAPTURE)
    dec_logits, _, cache = policy.forward(inputs["step"], inputs["step_pos"], cache)
    ver_logits, ver_captured, cache = policy.forward(
        inputs["fed"], inputs["fed_pos"], cache, mask=inputs["mask"], capture=CAPTURE)
    cache = compact(cache, inputs["path"], num_fed=inputs["fed"].shape[1])
    return {"prefill": pre_logits, "pre_captured": pre_captured, "decode": dec_logits,
            "verify": ver_logits, "ver_captured": ver_captured, "cache": cache}


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    lengths = np.array([6, 3, 5, 1, 4, 6, 2, 5])
    prompt = rng.integers(0, 128, (BATCH, WIDTH)).astype(np.int32)
    prompt_pos = np.where(np.arange(WIDTH) < lengths[:, None], np.arange(WIDTH), -1).astype(np.int32)
    step = rng.integers(0, 128, (BATCH, 1)).astype(np.int32)
    step_pos = lengths[:, None].astype(np.int32)
    # A branching draft tree: node 1 extends 0, node 2 is a sibling of 0, node 3 extends 1.
    parents = np.broadcast_to(np.array([-1, 0, -1, 1], np.int32), (BATCH, 4))
    tree = Tree.from_parents(rng.integers(0, 128, (BATCH, 4)), parents, max_depth=3)
    root = rng.integers(0, 128, (BATCH, 1)).astype(np.int32)
    fed = np.concatenate([root, np.asarray(tree.tokens)], axis=1)
    fed_pos = np.asarray(tree.positions(lengths + 1))
    mask = np.asarray(tree.attention_mask())
    # accepted paths of different lengths: root only, root->0, root->0->1->3, root->2
    paths = np.array([[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 4], [0, 3, -1, -1]], np.int32)
    path = paths[np.arange(BATCH) % 4]
    return {"prompt": prompt, "prompt_pos": prompt_pos, "step": step, "step_pos": step_pos,
            "fed": fed, "fed_pos": fed_pos, "mask": mask, "path": path}


@pytest.fixture(scope="module")
def reference(policy, inputs):
    return jax.device_get(prefill_decode_verify(policy, {k: jnp.asarray(v) for k, v in inputs.items()}))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_forward_matches_one_device(policy, inputs, reference, mesh_name):
    mesh = parallel.make_mesh(*MESHES[mesh_name])
    sharded_policy = parallel.shard_policy(policy, mesh)
    sharded_inputs = parallel.shard_batch(inputs, mesh)
    with jax.set_mesh(mesh):
        out = prefill_decode_verify(sharded_policy, sharded_inputs)
    # the cache stayed sharded over batch and kv heads
    expected = NamedSharding(mesh, parallel.logical_to_mesh(parallel.KV_CACHE_AXES))
    assert out["cache"].k.sharding.is_equivalent_to(expected, 5)
    per_device = out["cache"].k.addressable_shards[0].data.shape
    data, fsdp, tensor = MESHES[mesh_name]
    assert per_device == (3, BATCH // (data * fsdp), MAX_LEN, 2 // tensor, 16)
    got = jax.device_get(out)
    for key in ("prefill", "decode", "verify"):
        np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=1e-5, err_msg=key)
    for key in ("pre_captured", "ver_captured"):
        for layer in CAPTURE:
            np.testing.assert_allclose(got[key][layer], reference[key][layer], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["cache"].lengths, reference["cache"].lengths)
    np.testing.assert_allclose(got["cache"].k, reference["cache"].k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["cache"].v, reference["cache"].v, rtol=1e-5, atol=1e-5)
