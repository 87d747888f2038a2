"""One drafter of every kind for a policy: what the engine's equality tests run."""

from __future__ import annotations

import jax

from jaxspec.decoding.drafters import (
    DraftModelDrafter,
    Eagle3Drafter,
    MTPDrafter,
    NGramDrafter,
    TreeSpec,
)
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.mtp import MTPHead

PROMPTS = [[5, 9, 13, 5, 9, 13, 5], [77, 3], [40, 41, 42, 43, 40, 41]]


def every_drafter(policy: Policy, *, draft_vocab: int = 96) -> dict:
    """name -> drafter: n-gram, a small dense draft model, EAGLE-3 chain and tree, MTP chain
    (random heads shaped for `policy`; fixed keys)."""
    small = Policy.init(ModelConfig.tiny("qwen3", vocab_size=policy.config.vocab_size,
                                         num_layers=1, hidden_size=32, num_heads=2,
                                         num_kv_heads=1), jax.random.key(2))
    head = Eagle3Head.init_for(policy, draft_vocab, jax.random.key(1))
    return {
        "ngram": NGramDrafter(k=3, min_n=1, max_n=2),
        "draft_model": DraftModelDrafter(small, k=2),
        "eagle3_chain": Eagle3Drafter(head, k=3),
        "eagle3_tree": Eagle3Drafter(head, tree=TreeSpec(top_k=3, depth=3, budget=7)),
        "mtp_chain": MTPDrafter(MTPHead.init_for(policy, jax.random.key(3)), k=2),
    }


def with_params(head, values: dict):
    """`head` (a dataclass with `params`, e.g. a BlockHead) with every param whose path
    contains a key of `values` replaced by value(x), cast to x's dtype: hand-set heads for
    tests."""
    import dataclasses

    import jax.numpy as jnp

    def set_param(path, x):
        name = jax.tree_util.keystr(path)
        for key, value in values.items():
            if key in name:
                return jnp.asarray(value(x), x.dtype)
        return x
    return dataclasses.replace(head, params=jax.tree_util.tree_map_with_path(set_param, head.params))
