"""Parameter, KV and byte counts against hand arithmetic from the published configs."""

import pytest

from jaxspec.sim import eagle3_head, get_model


def test_qwen3_8b_counts():
    m = get_model("Qwen3-8B")
    h, v = 4096, 151936
    attn = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h
    mlp = 3 * h * 12288
    assert m.total_params == 36 * (attn + mlp) + 2 * h * v
    assert m.total_params == pytest.approx(8.19e9, rel=0.005)  # model card: 8.2B
    assert m.total_params - 2 * h * v == pytest.approx(6.95e9, rel=0.005)  # model card: 6.95B non-embedding
    assert m.kv_bytes_per_token == 36 * 8 * 128 * 2 * 2


def test_qwen3_235b_total_and_active():
    m = get_model("Qwen3-235B-A22B")
    assert m.is_moe
    assert m.total_params == pytest.approx(235e9, rel=0.01)
    assert m.active_params == pytest.approx(22e9, rel=0.03)
    assert m.kv_bytes_per_token == 94 * 4 * 128 * 2 * 2


def test_moe_weight_bytes_follow_expert_coverage():
    m = get_model("Qwen3-235B-A22B")
    # one token reads the dense part and its 8 experts: exactly the active parameters
    assert m.weight_bytes_read(1) == pytest.approx(m.active_params * 2)
    # a large batch touches every expert: all parameters but the embedding table (a gather)
    assert m.weight_bytes_read(10_000) == pytest.approx((m.total_params - m.embedding_params) * 2, rel=1e-6)
    coverage = 1 - (1 - 8 / 128) ** 16
    expected = m.active_params - 94 * 8 * m.expert_params + 94 * 128 * coverage * m.expert_params
    assert m.weight_bytes_read(16) == pytest.approx(expected * 2)
    dense = get_model("Qwen3-8B")
    assert dense.weight_bytes_read(1) == dense.weight_bytes_read(512)


def test_eagle3_head_shape():
    head = eagle3_head(get_model("Qwen3-8B"))
    h = 4096
    fc = 3 * h * h
    attn = 2 * h * 32 * 128 + 2 * (2 * h) * 8 * 128 + 32 * 128 * h
    mlp = 3 * h * 12288
    lm_head = h * 32000
    assert head.total_params == fc + attn + mlp + lm_head  # embedding is the target's
    assert head.kv_bytes_per_token == 1 * 8 * 128 * 2 * 2
