"""Sharded `generate` (plain, n-gram, EAGLE-3 chain) equals one-device `generate`: the same
tokens, log-probs within 1e-5, the same speculation counters.

Sharded generation is the ordinary `generate` called under `jax.set_mesh(mesh)` with the
policy / head on their rule shardings and the rollout ids on the batch sharding: GSPMD
propagates the batch sharding from the ids to the token buffer and the KV cache."""

import jax
import numpy as np
import pytest

from jaxspec import parallel
from jaxspec.decoding.drafters import Eagle3Drafter, NGramDrafter
from jaxspec.decoding.engine import generate
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.testing.meshes import MESHES

PROMPTS = [[5, 9, 5, 9, 5, 9, 5], [7, 8, 9], [10, 11, 12, 13, 10, 11], [3, 3, 3, 3],
           [5, 6], [1, 1, 2, 2, 3, 3], [9, 8, 7, 6, 5], [4]]
ROWS = np.arange(100, 108, dtype=np.int32)  # global rollout ids: the noise is keyed on them
SETTINGS = {
    "plain": {"sampling": SamplingConfig(temperature=1.0), "stop_tokens": (39,)},
    "ngram": {"sampling": SamplingConfig(temperature=0.0)},  # greedy loops: many acceptances
    "eagle": {"sampling": SamplingConfig(temperature=0.8, top_p=0.9)},
}
# every drafter on the 2x2x2 mesh; one drafter on each other split (each case is a compile)
CASES = [("d2f2t2", "plain"), ("d2f2t2", "ngram"), ("d2f2t2", "eagle"), ("d8", "ngram"), ("f4t2", "eagle")]


def drafter_for(name, head):
    return {"plain": None, "ngram": NGramDrafter(k=3, max_n=2), "eagle": Eagle3Drafter(head, k=2)}[name]


def run(policy, drafter, name, rows):
    return generate(policy, PROMPTS, drafter=drafter, max_new_tokens=10, key=jax.random.key(42),
                    rows=rows, **SETTINGS[name])


@pytest.fixture(scope="module")
def references(policy, head):
    return {name: run(policy, drafter_for(name, head), name, ROWS) for name in SETTINGS}


def assert_same_rollouts(got, ref):
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-5)
    for field in ("target_forwards", "draft_forwards", "row_steps", "tokens_generated",
                  "accepted_at", "proposed_at"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got.stats, field)), np.asarray(getattr(ref.stats, field)), err_msg=field)


@pytest.mark.parametrize("mesh_name, drafter_name", CASES)
def test_sharded_generate_matches_one_device(policy, head, references, mesh_name, drafter_name):
    mesh = parallel.make_mesh(*MESHES[mesh_name])
    sharded_policy = parallel.shard_policy(policy, mesh)
    drafter = drafter_for(drafter_name, parallel.shard_head(head, mesh))
    rows = parallel.shard_batch(ROWS, mesh)
    with jax.set_mesh(mesh):
        got = run(sharded_policy, drafter, drafter_name, rows)
    assert got.tokens.sharding.is_equivalent_to(parallel.batch_sharding(mesh, 2), 2)
    assert_same_rollouts(got, references[drafter_name])


def test_references_exercise_speculation(references):
    """The cases above are only meaningful if drafts get accepted and rows stop early."""
    assert references["ngram"].stats.acceptance_length > 1.5
    lengths = np.asarray(references["plain"].lengths)
    assert np.any(lengths < 10) and np.any(lengths == 10)  # some rows stopped at token 39
    assert references["eagle"].stats.draft_forwards > 0
