"""The whole GRPO train step sharded over 8 simulated devices equals the same step on one
device. The step covers EAGLE-3 chain generation, the logprob stage, the GRPO policy
update and the online draft update. After each of 2 steps the tokens and lengths must be
identical, the non-timing metrics must agree within 1e-5 (relative for those above 1, such
as gradient norms near 20, where 1e-5 absolute is a few float32 ulps), and the policy and
head params within 1e-5 (fp32).

The reference is the same trainer given `devices=[one device]`, so both of its meshes
(generation and training; async is off) hold that single device. All runs start from the
warmed-up base that tests/rl shares (`warmed_base`, built once per session).

Two config choices the comparison needs:
- `mesh.rules.vocab=null`: the task's vocabulary (25 tokens) does not split over
  tensor=2, so vocab rows are replicated. heads, kv_heads and mlp still split over
  `tensor` and embed over `fsdp`.
- AdamW eps 1e-5 instead of 1e-8: Adam's first update is lr * g / (|g| + eps). For a
  gradient entry near 1e-8 that update swings with fp32 rounding (summation order
  changes with the sharding). At the default eps, head gradients that agree to 6e-10
  still gave params that differ by 7e-5. With eps 1e-5 a change in g moves the update by
  at most lr / eps = 300 times that change, so rounding noise (~1e-9) stays far below 1e-5.
"""

import jax
import numpy as np
import pytest

from jaxspec import parallel
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.meshes import MESHES
from jaxspec.testing.rl import make_config, warmed_base  # tests/rl's short config and base

STEPS = 2
EXTRA = [f"run.steps={STEPS}", "run.compare_plain=0", "async.enabled=false",
         "mesh.rules.vocab=null", "optim.eps=1.0e-5", "draft_optim.eps=1.0e-5"]
TIMING = ("generation_time_s", "generation_plain_time_s", "generation_speedup")


def devices_of(tree):
    return set().union(*(x.sharding.device_set for x in jax.tree.leaves(tree)))


def host(tree):
    return jax.tree.map(np.asarray, tree)


def train(run_dir, mesh, devices):
    """STEPS steps from the shared base: (trainer, per-step metrics, per-step batches,
    policy and head params on the host after the last step)."""
    policy, head, _ = warmed_base()
    data, fsdp, tensor = mesh
    cfg = make_config(run_dir, *EXTRA, f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                      f"mesh.tensor={tensor}")
    metrics, batches = [], []
    trainer = GRPOTrainer(cfg, policy=policy, head=head, devices=devices)
    for _ in range(STEPS):
        metrics.append(trainer.step())
        batches.append(trainer.last_batch)
    return trainer, metrics, batches, host(trainer.policy.params), host(trainer.head.params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-device run, checked to be on that device only."""
    one = jax.devices()[0]
    out = train(tmp_path_factory.mktemp("one"), (-1, 1, 1), [one])
    trainer = out[0]
    assert set(trainer.gen_mesh.devices.flat) == set(trainer.train_mesh.devices.flat) == {one}
    assert devices_of((trainer.policy.params, trainer.opt_state, trainer.head.params,
                       trainer.draft_opt_state, trainer.last_scored)) == {one}
    return out


def test_reference_run_trains_and_speculates(reference):
    """The comparison is not vacuous: drafts were accepted, and the policy and the head both
    moved away from the base."""
    _, metrics, batches, policy, head = reference
    base_policy, base_head, _ = warmed_base()
    for m, batch in zip(metrics, batches):
        assert m["acceptance_length"] > 1.2 and np.sum(batch.stats.accepted_at) > 0
        assert m["grpo/grad_norm"] > 0 and "draft/loss" in m
    for new, old in ((policy, base_policy.params), (head, base_head.params)):
        moved = max(float(np.max(np.abs(a - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True))
        assert moved > 1e-3


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_train_step_matches_one_device(reference, tmp_path, mesh_name):
    data, fsdp, tensor = MESHES[mesh_name]
    trainer, metrics, batches, policy, head = train(tmp_path, (data, fsdp, tensor), None)
    _, ref_metrics, ref_batches, ref_policy, ref_head = reference

    # really sharded: 8 devices, rollout rows over data x fsdp, every param (after the
    # updates) on its rule sharding, and the attention weights split over fsdp x tensor
    assert trainer.train_mesh.shape == {"data": data, "fsdp": fsdp, "expert": 1, "tensor": tensor}
    assert trainer.gen_mesh.devices.size == 8
    tokens = trainer.last_scored["tokens"]  # [B, T] the logprob stage's packed rollouts
    assert tokens.sharding.is_equivalent_to(parallel.batch_sharding(trainer.train_mesh, 2), 2)
    assert tokens.addressable_shards[0].data.shape[0] == tokens.shape[0] // (data * fsdp)
    for model in (trainer.policy, trainer.head):
        rules = parallel.param_shardings(model, trainer.train_mesh, trainer.rules)
        for x, rule in zip(jax.tree.leaves(model.params), jax.tree.leaves(rules), strict=True):
            assert len(x.sharding.device_set) == 8 and x.sharding.is_equivalent_to(rule, x.ndim)
    for q in (trainer.policy.params["layers"]["self_attn"]["q_proj"][...],  # [L, E, H, D]
              trainer.head.params["self_attn"]["q_proj"][...]):  # [2E, H, D]
        local = q.addressable_shards[0].data.shape
        assert local[-3:] == (q.shape[-3] // fsdp, q.shape[-2] // tensor, q.shape[-1])

    for step in range(STEPS):
        got, want = batches[step], ref_batches[step]
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_allclose(got.gen_logprobs, want.gen_logprobs, atol=1e-5)
        np.testing.assert_array_equal(got.stats.accepted_at, want.stats.accepted_at)
        m, ref = metrics[step], ref_metrics[step]
        assert m.keys() == ref.keys()
        for key, value in ref.items():
            if key.startswith(("time/", "share/")) or key in TIMING:
                continue
            assert abs(m[key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, m[key], value)
    for got, want, what in ((policy, ref_policy, "policy"), (head, ref_head, "head")):
        paths = jax.tree_util.tree_flatten_with_path(want)[0]
        for (path, w), g in zip(paths, jax.tree.leaves(got), strict=True):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5,
                                       err_msg=f"{what}{jax.tree_util.keystr(path)}")
