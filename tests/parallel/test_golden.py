"""Golden PartitionSpecs: every parameter of a tiny policy (tied and untied) and of an
EAGLE-3 head under DEFAULT_RULES, so that a silent layout change fails loudly."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import parallel
from jaxspec.models import ModelConfig, Policy, load_hf, save_hf
from jaxspec.models.transformer import param_path

_LAYER = {
    "layers/input_layernorm/scale": P(None, "fsdp"),
    "layers/mlp/down_proj": P(None, "tensor", "fsdp"),
    "layers/mlp/gate_proj": P(None, "fsdp", "tensor"),
    "layers/mlp/up_proj": P(None, "fsdp", "tensor"),
    "layers/post_attention_layernorm/scale": P(None, "fsdp"),
    "layers/self_attn/k_proj": P(None, "fsdp", "tensor", None),
    "layers/self_attn/o_proj": P(None, "tensor", None, "fsdp"),
    "layers/self_attn/q_proj": P(None, "fsdp", "tensor", None),
    "layers/self_attn/v_proj": P(None, "fsdp", "tensor", None),
}
GOLDEN = {
    "qwen3": {
        "embed_tokens": P("tensor", "fsdp"),
        **_LAYER,
        "layers/self_attn/k_norm/scale": P(None, None),
        "layers/self_attn/q_norm/scale": P(None, None),
        "norm/scale": P("fsdp"),
    },
    "llama": {
        "embed_tokens": P("tensor", "fsdp"),
        **_LAYER,
        "lm_head": P("fsdp", "tensor"),
        "norm/scale": P("fsdp"),
    },
    "eagle3": {
        "fc": P("tensor", "fsdp"),
        "hidden_norm/scale": P("fsdp"),
        "input_layernorm/scale": P("fsdp"),
        "lm_head": P("fsdp", "tensor"),
        "mlp/down_proj": P("tensor", "fsdp"),
        "mlp/gate_proj": P("fsdp", "tensor"),
        "mlp/up_proj": P("fsdp", "tensor"),
        "norm/scale": P("fsdp"),
        "post_attention_layernorm/scale": P("fsdp"),
        "self_attn/k_proj": P("fsdp", "tensor", None),
        "self_attn/o_proj": P("tensor", None, "fsdp"),
        "self_attn/q_proj": P("fsdp", "tensor", None),
        "self_attn/v_proj": P("fsdp", "tensor", None),
    },
}


def specs_by_name(shardings) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return {"/".join(param_path(path)): s.spec for path, s in flat}


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_policy_golden_specs(mesh, family):
    policy = Policy.abstract(ModelConfig.tiny(family))
    got = specs_by_name(parallel.param_shardings(policy, mesh))
    assert got == GOLDEN[family]
    # the logical-axes tree alone gives the same shardings
    assert specs_by_name(parallel.param_shardings(policy.logical_axes, mesh)) == GOLDEN[family]


def test_eagle3_head_golden_specs(mesh, policy, head):
    assert specs_by_name(parallel.param_shardings(head, mesh)) == GOLDEN["eagle3"]
    sharded = parallel.shard_head(head, mesh)
    for name, x in zip(specs_by_name(parallel.param_shardings(head, mesh)), jax.tree.leaves(sharded.params)):
        assert x.sharding.spec == GOLDEN["eagle3"][name], name
    d2t = jax.tree.leaves(sharded.buffers)[0]
    assert d2t.sharding.is_fully_replicated and set(d2t.sharding.device_set) == set(mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(sharded.d2t), np.asarray(head.d2t))


def test_rules_override_changes_only_their_axes(mesh):
    policy = Policy.abstract(ModelConfig.tiny("llama"))
    rules = {"embed": None, "vocab": ["fsdp", "tensor"], "mlp": "fsdp"}  # a YAML list is fine
    got = specs_by_name(parallel.param_shardings(policy, mesh, rules))
    assert got["embed_tokens"] == P(("fsdp", "tensor"), None)
    assert got["lm_head"] == P(None, ("fsdp", "tensor"))
    assert got["layers/mlp/up_proj"] == P(None, None, "fsdp")
    assert got["layers/self_attn/o_proj"] == P(None, "tensor", None, None)
    assert got["norm/scale"] == P(None)


def test_optimizer_state_follows_its_params(mesh, policy):
    state = optax.adamw(1e-3).init(policy.params)
    got = parallel.param_shardings(state, mesh)
    mu = specs_by_name(got[0].mu)
    assert mu == GOLDEN["qwen3"]
    assert got[0].count.spec == P()  # untagged leaves are replicated


def test_hf_load_straight_into_shardings(tmp_path, mesh, policy):
    save_hf(policy, tmp_path / "hf")
    shardings = parallel.hf_shardings(tmp_path / "hf", mesh)
    loaded = load_hf(tmp_path / "hf", shardings=shardings)
    names = specs_by_name(shardings)
    for name, x, ref in zip(names, jax.tree.leaves(loaded.params), jax.tree.leaves(policy.params), strict=True):
        assert isinstance(x.sharding, NamedSharding) and x.sharding.spec == GOLDEN["qwen3"][name]
        np.testing.assert_array_equal(np.asarray(x), np.asarray(ref))
    with pytest.raises(FileNotFoundError, match="config.json"):
        parallel.hf_shardings(tmp_path / "nowhere", mesh)


def test_indivisible_param_is_a_clear_error():
    mesh = parallel.make_mesh(data=1, fsdp=2, tensor=4)  # tiny qwen3 has 2 kv heads
    with pytest.raises(ValueError, match=r"k_proj.*'kv_heads', size 2.*'tensor' of size 4"):
        parallel.param_shardings(Policy.abstract(ModelConfig.tiny("qwen3")), mesh)
    # replicating kv heads is one rule away
    shardings = parallel.param_shardings(
        Policy.abstract(ModelConfig.tiny("qwen3")), mesh, {"kv_heads": None})
    assert specs_by_name(shardings)["layers/self_attn/k_proj"] == P(None, "fsdp", None, None)
