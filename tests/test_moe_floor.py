"""The inspector's MoE floor (jaxspec.gpu_targets.inspect.floor_bytes): dense weights once, of
the routed experts only those the batch's tokens route to (uniform-random routing), the
live KV once and the new KV written; the expected distinct experts against a simulation."""

import jax
import numpy as np
import pytest

from jaxspec.gpu_targets.inspect import experts_touched, floor_bytes
from jaxspec.models import ModelConfig, Policy


@pytest.mark.parametrize("tokens", [1, 4, 64, 256])
def test_experts_touched_matches_a_simulation_of_uniform_routing(tokens):
    """Each token picks a uniformly random set of 8 of 128 experts: the distinct count's
    mean over 4,000 draws against E (1 - (1 - K/E)^n)."""
    rng = np.random.default_rng(tokens)
    counts = [len(np.unique(np.argsort(rng.random((tokens, 128)), axis=1)[:, :8]))
              for _ in range(4000)]
    assert experts_touched(128, 8, tokens) == pytest.approx(np.mean(counts), abs=0.15)
    assert experts_touched(128, 8, 1) == 8.0


def test_moe_floor_parts_by_hand():
    cfg = ModelConfig.tiny("qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=16)
    params = Policy.abstract(cfg).params
    item = 4  # float32
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) * item
    expert = 3 * 32 * 16 * item
    parts = floor_bytes(cfg, batch=2, fed=3, context=10)
    touched = 8 * (1 - (1 - 2 / 8) ** 6)  # 6 tokens, 2 of 8 experts each
    embed = 0 if cfg.tie_embeddings else 64 * 32 * item
    assert parts["weights (dense)"] == total - embed - 2 * 8 * expert
    assert parts[f"routed experts ({touched:.1f} of 8 per layer)"] == pytest.approx(
        2 * touched * expert)
    kv_row = 2 * 2 * 1 * 16 * item  # K and V, 2 layers, 1 KV head of 16
    assert parts["KV read"] == 2 * 10 * kv_row
    assert parts["KV written"] == 2 * 3 * kv_row
    dense = floor_bytes(cfg.without_experts(), batch=2, fed=3, context=10)  # the same shape, no experts
    assert "weights" in dense and not any(k.startswith("routed") for k in dense)
