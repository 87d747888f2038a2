"""draft.kind history / hybrid in the GRPO trainer: the history store fills from each step's
rollouts, is checkpointed, and a resumed run continues with the same store (and so the same
drafts, acceptance and parameters) as an uninterrupted run."""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from jaxspec.config import ConfigError, load_config
from jaxspec.decoding.history import HistoryDrafter, HistoryStore, HybridDrafter
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.rl import cluster
from jaxspec.rl.rollouts import make_drafter, prompt_keys
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.rl import Killed, assert_same_tree

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
# A random policy (no warm-up) keeps this fast; the store does not care what it stores.
FAST = ["rollout.prompts_per_step=2", "rollout.group_size=4", "warmup.steps=0",
        "warmup.draft_rollouts=8", "warmup.draft_steps=1", "run.compare_plain=1",
        "run.save_every=2", "run.steps=3", "draft.k=2", "draft.history.budget=3",
        "draft.history.prompts=4", "draft.history.per_prompt=2"]
TIMING = ("time/", "share/", "generation_time_s", "generation_plain_time_s", "generation_speedup")


def make_config(run_dir, *extra):
    return load_config(TINY, FAST + [f"run.dir={run_dir}", *extra])


def rows(run_dir):
    with open(run_dir / "metrics.jsonl") as fh:
        out = [json.loads(line) for line in fh]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in out]


def test_history_run_resumes_with_its_store(tmp_path):
    straight = GRPOTrainer(make_config(tmp_path / "straight", "draft.kind=history"))
    straight.run()
    store = straight.state.history
    # 3 steps of 2 prompts: the 4 slots hold the last 4 prompts, 2 rollouts each (a ring)
    assert store.size() == 8 and straight.last_batch is not None
    batch = straight.last_batch
    keys = prompt_keys(batch.prompts, batch.prompt_lengths)
    assert set(store.slots_of(keys).tolist()) - {-1}  # the last step's prompts are stored
    last = rows(tmp_path / "straight")[-1]
    assert last["history/rollouts"] == 8 and last["replay_identical"] == 1.0

    killed = GRPOTrainer(make_config(tmp_path / "killed", "draft.kind=history"))

    def kill(step, row):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        killed.run(on_step=kill)
    saved = killed.state.history
    resumed = GRPOTrainer(make_config(tmp_path / "killed", "draft.kind=history", "run.resume=true"))
    assert resumed.completed == 2
    assert_same_tree(resumed.state.history, saved)  # the store came back from the checkpoint
    resumed.run()
    assert_same_tree(resumed.state.history, store)
    assert_same_tree(resumed.policy.params, straight.policy.params)
    assert rows(tmp_path / "killed") == rows(tmp_path / "straight")


def test_make_drafter_for_the_history_kinds():
    """Each row's group is its prompt's G contiguous rows; a stored prompt finds its slot."""
    cfg = make_config("unused")
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    head = Eagle3Head.init_for(policy, 32, jax.random.key(1))
    prompts = np.array([[1, 5, 6, 0], [1, 5, 6, 0], [1, 7, 0, 0], [1, 7, 0, 0]], np.int32)
    lengths = np.array([3, 3, 2, 2], np.int32)
    store = HistoryStore.empty(4, 2, 8).add(prompt_keys(prompts[2:3], lengths[2:3]),
                                            [[1, 7, 3]], [3])
    for kind, cls in (("history", HistoryDrafter), ("hybrid", HybridDrafter)):
        d = dataclasses.replace(cfg.draft, kind=kind)
        drafter = make_drafter(d, None, head, history=store, groups=[0, 0, 1, 1],
                               prompt_keys=prompt_keys(prompts, lengths))
        assert isinstance(drafter, cls) and drafter.num_nodes == 3 and drafter.max_depth == 2
        history = drafter if kind == "history" else drafter.history
        np.testing.assert_array_equal(history.siblings, [[0, 1], [0, 1], [2, 3], [2, 3]])
        np.testing.assert_array_equal(history.slots, [-1, -1, 0, 0])


@pytest.mark.parametrize("overrides,key,message", [
    (["draft.kind=history", "draft.history.budget=2"], "draft.history.budget", "must be >= k=3"),
    (["draft.kind=hybrid", "draft.history.depth=6", "draft.history.budget=5"],
     "draft.history.budget", "must be >= k=6"),
    (["draft.kind=history", "draft.history.min_n=3", "draft.history.max_n=2"],
     "draft.history.max_n", "must be an int >= 3"),
    (["draft.kind=hybrid", "draft.tree={top_k: 2, depth: 2, budget: 3}"], "draft.tree",
     "does not take draft.tree"),
    (["draft.kind=history", "draft.history.depth=2", "draft.collapse_threshold=3.5"],
     "draft.collapse_threshold", "in [1, 3]"),
    (["draft.history.prompts=0"], "draft.history.prompts", ">= 1"),
])
def test_config_errors(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["draft.k=3", *overrides])
    assert e.value.key == key and message in str(e.value)


def test_history_depth_apart_from_the_head_chain():
    cfg = load_config(TINY, ["draft.kind=hybrid", "draft.k=3", "draft.history.depth=6",
                             "draft.history.budget=7"])
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    head = Eagle3Head.init_for(policy, 32, jax.random.key(1))
    drafter = make_drafter(cfg.draft, None, head, groups=[0, 0])
    assert (drafter.head.k, drafter.history.k, drafter.max_depth, drafter.num_nodes) == (3, 6, 6, 7)


def test_history_run_with_fewer_slots_than_rollouts(tmp_path, monkeypatch):
    """rollout.slots < the step's 8 rollouts with draft.kind history: generate gets the
    leaders first (each prompt's first sample, then its second, ...) and the rollouts equal
    plain decoding at every step (replay_identical), the store filling as without slots."""
    calls = []

    def spy(policy, prompts, **kwargs):
        if isinstance(kwargs.get("drafter"), HistoryDrafter):
            calls.append((kwargs["slots"], np.asarray(kwargs["order"]).tolist()))
        return generate(policy, prompts, **kwargs)

    generate = cluster.generate
    monkeypatch.setattr(cluster, "generate", spy)  # the name Cluster.generate calls
    trainer = GRPOTrainer(make_config(tmp_path, "draft.kind=history", "rollout.slots=3",
                                      "run.steps=2"))
    trainer.run()
    # the compile call, then the 2 steps' (prompts 0 and 1, 4 samples each)
    assert calls == [(3, [0, 4, 1, 5, 2, 6, 3, 7])] * 3
    out = rows(tmp_path)
    assert [r["replay_identical"] for r in out] == [1.0, 1.0]
    assert out[-1]["history/rollouts"] == 8 and trainer.state.history.size() == 8


def test_hybrid_run_logs_sources_and_head_calls(tmp_path):
    """draft.kind hybrid in the trainer: every step equals plain decoding, logs accepted
    drafts by source under spec/accepted_* and the loop iterations the head drafted in
    (spec/head_drafted, at most one per iteration; a random policy's first step has no
    history deep enough to skip it every time)."""
    GRPOTrainer(make_config(tmp_path, "draft.kind=hybrid", "run.steps=2")).run()
    for r in rows(tmp_path):
        assert r["replay_identical"] == 1.0
        assert {"spec/accepted_history_only", "spec/accepted_head_only",
                "spec/accepted_both"} <= set(r)
        assert 0 <= r["spec/head_drafted"] <= r["spec/target_forwards"]
    assert rows(tmp_path)[0]["spec/head_drafted"] > 0
