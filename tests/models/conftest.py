"""Fixtures for the policy tests: tiny random policies with O(1) activations and logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, Policy


def random_policy(config: ModelConfig, seed: int = 0) -> Policy:
    """Random weights like Policy.init's, but rescaled to ~1/sqrt(fan_in) and norm scales 1 + 0.3 N(0,1).

    The HF-style init (std 0.02, unit norms) gives near-uniform logits, against which any
    tolerance is meaningless; these give logits of order 1-10 and non-trivial norms.
    """
    policy = Policy.abstract(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(policy.params)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = "/".join(str(getattr(k, "key", "")) for k in path)
        noise = rng.standard_normal(leaf.shape, np.float32)
        if name.endswith("scale"):
            value = 1.0 + 0.3 * noise
        elif "embed_tokens" in name:
            value = noise
        elif "down_proj" in name:
            value = noise / np.sqrt(config.intermediate_size)
        elif "o_proj" in name:
            value = noise / np.sqrt(config.num_heads * config.head_dim)
        else:
            value = noise / np.sqrt(config.hidden_size)
        out.append(jnp.asarray(value, config.param_dtype))
    return policy.replace(params=jax.tree_util.tree_unflatten(treedef, out))


@pytest.fixture(scope="session")
def make_policy():
    """The random_policy builder, for tests that need more than the shared policies."""
    return random_policy


@pytest.fixture(scope="session")
def qwen3_policies():
    """The same random tiny Qwen3 weights in float32 and (rounded) bfloat16."""
    cfg = ModelConfig.tiny("qwen3")
    return {
        "float32": random_policy(cfg, seed=0),
        "bfloat16": random_policy(cfg.replace(dtype="bfloat16"), seed=0),
    }
