"""Tiny policies and EAGLE-3 heads with O(1) logits for the parallel tests."""

import dataclasses

import jax
import pytest

from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.testing.meshes import rescaled


@pytest.fixture(scope="session")
def policy():
    cfg = ModelConfig.tiny("qwen3")
    base = Policy.abstract(cfg)
    return base.replace(params=jax.device_put(rescaled(base.params, seed=0)))


@pytest.fixture(scope="session")
def head(policy):
    head = Eagle3Head.init_for(policy, 64, jax.random.key(1))
    return dataclasses.replace(head, params=jax.device_put(rescaled(head.params, seed=1)))
