"""Fixtures for the policy tests: tiny random policies with O(1) activations and logits."""

import pytest

from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy


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
