"""Sync and async step composition, comparisons and sweeps."""

import dataclasses

import pytest

from jaxspec.sim import (
    Acceptance,
    Cluster,
    Drafter,
    Scenario,
    compare,
    get_gpu,
    get_model,
    get_workload,
    k_sweep,
    simulate_step,
)
from jaxspec.sim.paper import rl_8b


def _small(**kw):
    w = dataclasses.replace(get_workload("rl-zero"), prompts_per_step=32)
    return Scenario(get_model("Qwen3-8B"), Cluster(get_gpu("H100"), 8), w, Drafter("eagle3", 3), **kw)


def test_sync_step_is_the_sum_of_its_stages():
    r = simulate_step(_small())
    assert r.step_s == pytest.approx(r.data_s + r.setup_s + r.generation_s + r.logprob_s + r.training_s)
    assert r.exposed_generation_s == r.generation_s
    assert r.engines == 8 and r.rollouts_per_engine == 32 * 16 // 8


def test_async_period_is_the_slower_side():
    r = simulate_step(_small(policy_lag=1, generation_gpus=4))
    train_side = r.data_s + r.logprob_s + r.training_s
    assert r.step_s == pytest.approx(max(r.generation_s + r.setup_s, train_side))
    assert r.exposed_generation_s == pytest.approx(max(0.0, r.generation_s + r.setup_s - train_side))
    with pytest.raises(ValueError, match="cannot be split"):
        simulate_step(_small(policy_lag=1))  # one 8-GPU node: no whole-node split
    big = dataclasses.replace(_small(policy_lag=1), cluster=Cluster(get_gpu("H100"), 32))
    best = simulate_step(big)  # the split is searched in whole nodes
    assert best.generation_gpus in (8, 16, 24)
    for g in (8, 16, 24):
        assert best.step_s <= simulate_step(dataclasses.replace(big, generation_gpus=g)).step_s + 1e-9


def test_speculation_only_changes_generation_in_sync_rl():
    c = compare(_small())
    assert c.spec.logprob_s == c.baseline.logprob_s and c.spec.training_s == c.baseline.training_s
    b, sp = c.baseline, c.spec
    assert sp.setup_s > b.setup_s  # the draft's weights are refit too
    spec_step = b.step_s - b.generation_s - b.setup_s + sp.generation_s + sp.setup_s
    assert c.step_speedup == pytest.approx(b.step_s / spec_step)
    assert compare(_small().plain()).generation_speedup == 1.0


def test_better_acceptance_is_faster_and_more_gpus_are_not_slower():
    lo = compare(_small(acceptance=Acceptance.constant(0.5))).generation_speedup
    hi = compare(_small(acceptance=Acceptance.constant(0.9))).generation_speedup
    assert hi > lo
    s = rl_8b("rl-zero")
    assert simulate_step(dataclasses.replace(s, cluster=Cluster(s.cluster.gpu, 64))).step_s < simulate_step(s).step_s


def test_k_sweep_rows():
    rows = k_sweep(rl_8b("rl-zero"), range(1, 6))
    assert [r.k for r in rows] == [1, 2, 3, 4, 5]
    lengths = [r.acceptance_length for r in rows]
    assert all(b > a for a, b in zip(lengths, lengths[1:]))
    drafts = [r.draft_over_decode for r in rows]
    assert all(b > a for a, b in zip(drafts, drafts[1:]))  # k draft forwards
    running = rows[0].verify_tokens // 2  # k=1 verifies 2 tokens per running sequence
    assert [r.verify_tokens for r in rows] == [running * (r.k + 1) for r in rows]


def test_scenario_validation():
    with pytest.raises(ValueError, match="policy_lag"):
        _small(policy_lag=-1)
    with pytest.raises(ValueError, match="async"):
        _small(generation_gpus=4)
    with pytest.raises(ValueError, match="no acceptance profile"):
        simulate_step(dataclasses.replace(_small(), drafter=Drafter("mtp", 3)))
    with pytest.raises(ValueError, match="speculative drafter"):
        k_sweep(_small().plain())
