"""Roofline step costs and batch generation against hand-computed values."""

import dataclasses

import pytest

from jaxspec.sim import DEFAULT, Drafter, EngineLayout, StepCost, forward_time, generation_time, get_gpu, get_model

GB200 = get_gpu("GB200")
Q8 = get_model("Qwen3-8B")
# no overheads, perfect efficiency: the roofline alone
IDEAL = DEFAULT.replace(step_overhead_s=0.0, draft_step_overhead_s=0.0, hbm_efficiency=1.0, gemm_efficiency=1.0,
                        graph_capture_max_tokens=None)


def test_memory_bound_decode_is_bytes_over_bandwidth():
    n, ctx = 8, 8 * 4000
    t = forward_time(Q8, EngineLayout(GB200, 1), IDEAL, num_seqs=n, tokens_per_seq=1, context_sum=ctx, overhead_s=0.0)
    weights = Q8.total_params * 2 - Q8.embedding_params * 2  # the embedding is a gather
    kv = ctx * 36 * 8 * 128 * 2 * 2
    logits = n * 151936 * 4 * IDEAL.sampling_passes
    assert t == pytest.approx((weights + kv + logits) / 8e12, rel=1e-9)


def test_verify_is_nearly_free_when_memory_bound_and_linear_when_compute_bound():
    cost = StepCost(Q8, EngineLayout(GB200, 1), Drafter("eagle3", 3), IDEAL)
    assert cost.verify(16, 16 * 8000) / cost.decode(16, 16 * 8000) < 1.05
    huge = 8192  # tokens far past the ridge point: cost ~ tokens
    assert cost.verify(huge, huge * 100) / cost.decode(huge, huge * 100) == pytest.approx(4.0, rel=0.1)


def test_steps_past_the_captured_graph_size_pay_the_eager_launch_cost():
    a = DEFAULT.replace(graph_capture_max_tokens=512, eager_overhead_per_layer_s=1e-3)
    kw = dict(context_sum=128 * 1000, overhead_s=0.0)
    lay = EngineLayout(GB200, 1)
    inside = forward_time(Q8, lay, a, num_seqs=128, tokens_per_seq=4, **kw)  # 512 tokens: captured
    outside = forward_time(Q8, lay, a, num_seqs=128, tokens_per_seq=5, **kw)  # 640 tokens: eager
    no_limit = forward_time(Q8, lay, a.replace(graph_capture_max_tokens=None), num_seqs=128, tokens_per_seq=5, **kw)
    assert outside - no_limit == pytest.approx(36 * 1e-3)
    assert outside - inside > 36 * 1e-3


def test_draft_and_verify_add_up_and_ngram_scales_with_context():
    cost = StepCost(Q8, EngineLayout(GB200, 1), Drafter("eagle3", 3), DEFAULT)
    assert cost.step(64, 64e3) == pytest.approx(cost.draft(64, 64e3) + cost.verify(64, 64e3))
    ngram = StepCost(Q8, EngineLayout(GB200, 1), Drafter("ngram", 3), DEFAULT)
    grow = ngram.draft(64, 2e6) - ngram.draft(64, 1e6)
    assert grow == pytest.approx(1e6 * DEFAULT.ngram_s_per_context_token)
    assert StepCost(Q8, EngineLayout(GB200, 1), Drafter(), DEFAULT).step(64, 64e3) == cost.decode(64, 64e3)


def test_measured_verify_ratio_overrides_the_roofline():
    cost = StepCost(Q8, EngineLayout(GB200, 1), Drafter("eagle3", 3), DEFAULT, verify_decode_cost_ratio=1.3,
                    measured_k=3)
    assert cost.verify(32, 32e3) == pytest.approx(1.3 * cost.decode(32, 32e3))
    at_k6 = dataclasses.replace(cost, drafter=Drafter("eagle3", 6))
    assert at_k6.verify(32, 32e3) == pytest.approx(1.6 * cost.decode(32, 32e3))


class _ConstantCost:
    """A step costs `c` seconds whatever the batch; prefill is free."""

    def __init__(self, c):
        self.c = c

    def step(self, n, ctx):
        return self.c

    def prefill(self, n, prompt):
        return 0.0


def test_generation_time_all_running_is_longest_over_tokens_per_step():
    lengths = [100.0, 400.0, 1000.0]
    t = generation_time(_ConstantCost(0.01), lengths, prompt_tokens=10, tokens_per_step=2.5, concurrency=8)
    assert t == pytest.approx(1000 / 2.5 * 0.01)


def test_generation_time_one_at_a_time_is_sum():
    lengths = [100.0, 400.0, 1000.0]
    t = generation_time(_ConstantCost(0.01), lengths, prompt_tokens=10, tokens_per_step=1.0, concurrency=1)
    assert t == pytest.approx(sum(lengths) * 0.01)


def test_generation_time_integrates_a_context_dependent_step_exactly_for_linear_costs():
    class Linear(_ConstantCost):
        def step(self, n, ctx):
            return 1e-3 + 1e-9 * ctx

    # two sequences of 100 and 300 tokens from empty prompts, one token per step:
    # 100 steps with 2 running (ctx 2t), then 200 steps with 1 running (ctx 100 + t)
    t = generation_time(Linear(0), [100.0, 300.0], prompt_tokens=0, tokens_per_step=1.0, concurrency=2)
    phase1 = 100 * 1e-3 + 1e-9 * 2 * (100**2 / 2)
    phase2 = 200 * 1e-3 + 1e-9 * (100 * 200 + 200**2 / 2)
    assert t == pytest.approx(phase1 + phase2, rel=1e-9)


def test_engine_layout_defaults_and_capacity():
    a = DEFAULT
    assert EngineLayout.default_tp(Q8, GB200, a) == 1
    assert EngineLayout.default_tp(get_model("Qwen3-235B-A22B"), GB200, a) == 8
    assert EngineLayout.default_tp(get_model("Qwen3-235B-A22B"), get_gpu("H100"), a) == 16
    with pytest.raises(ValueError, match="does not fit"):
        EngineLayout(get_gpu("H100"), 1).kv_capacity_tokens(get_model("Qwen3-235B-A22B"), None, a)


def test_drafter_validation():
    with pytest.raises(ValueError, match="unknown drafter"):
        Drafter("medusa", 3)
    with pytest.raises(ValueError, match="k >= 1"):
        Drafter("eagle3", 0)
    with pytest.raises(ValueError, match="k=0"):
        Drafter("none", 3)


def test_tree_verify_feeds_n_plus_one_tokens():
    lay = EngineLayout(GB200, 1)
    tree = StepCost(Q8, lay, Drafter("eagle3", 5, tree_tokens=60), IDEAL)
    chain = StepCost(Q8, lay, Drafter("eagle3", 5), IDEAL)
    # small batch, long contexts: memory-bound, 61 tokens cost about what 6 do
    assert tree.verify(2, 2 * 16000) / chain.verify(2, 2 * 16000) < 1.1
    # large batch: compute-bound, cost follows the token count
    assert tree.verify(512, 512 * 100) / chain.verify(512, 512 * 100) == pytest.approx(61 / 6, rel=0.15)
    assert tree.draft(64, 64e3) > chain.draft(64, 64e3)  # each pass expands the frontier
    with pytest.raises(ValueError, match="tree_tokens >= k"):
        Drafter("eagle3", 5, tree_tokens=3)
    with pytest.raises(ValueError, match="model drafter"):
        Drafter("ngram", 3, tree_tokens=10)
