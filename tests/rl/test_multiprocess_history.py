"""draft.kind history, hybrid and hybrid_block over two JAX processes (jax.distributed
over 127.0.0.1) equal one process on the same mesh, as tests/rl/test_multiprocess_grpo.py
checks for EAGLE-3 (hybrid_block: with the block model trained online across processes): the store of earlier rollouts is replicated on every process (each adds the same
all-gathered rows), placed on the generation devices from each process's copy, saved by
both processes in the checkpoint and restored by two processes and by one.

The runs are `jaxspec.testing.multiprocess_grpo`'s (the short tiny config, data=2 across the
processes; a SIGTERM to process 1 after step 2 and a resume in the two-process run, the
one-process run straight through, then resuming the two processes' checkpoint of step 2)
with a dataset of 2 prompts, so that every step sees the same 2 prompts and the drafts of
steps 2 and 3 come from the store.
"""

import os

import numpy as np
import pytest

from jaxspec.testing import multiprocess_grpo as worker
from jaxspec.testing.multiprocess_grpo import metric_rows

REPEAT = "task.params.dataset_size=2"  # = rollout.prompts_per_step: the same prompts every step
PER_PROMPT = 4  # draft.history.per_prompt's default = rollout.group_size of the worker
# The suite runs the hybrid (history drafts from the replicated store and the head's chain;
# ~85 CPU-s a kind); JAXSPEC_FULL_EXACTNESS=1 adds history alone and hybrid_block.
FULL = os.environ.get("JAXSPEC_FULL_EXACTNESS", "") not in ("", "0")


@pytest.fixture(scope="module", params=["history", "hybrid", "hybrid_block"] if FULL else ["hybrid"])
def runs(request, tmp_path_factory):
    """(kind, the two-process results, the one-process results)."""
    workdir = tmp_path_factory.mktemp(f"multiprocess_{request.param}")
    return request.param, *worker.run_both(workdir, f"draft.kind={request.param}", REPEAT)


def test_two_processes_equal_one_process(runs):
    _, two, one = runs
    worker.assert_two_equal_one(two, one)  # the stores (s*_history_*) included
    worker.assert_resumed_here(one)


def test_the_store_holds_the_last_rollouts(runs):
    """After step 3 each of the 2 prompts' rings holds that step's 4 rollouts (prompt +
    completion), on every process alike (the comparison above)."""
    _, _, one = runs
    tokens, lengths = one["s3_history_0"], one["s3_history_1"]  # HistoryStore's field order
    stored = sorted(tuple(t[:n]) for t, n in zip(tokens.reshape(-1, tokens.shape[-1]),
                                                lengths.reshape(-1)) if n)
    b = {k: one[f"b3_{k}"] for k in ("prompts", "prompt_lengths", "tokens", "lengths")}
    want = sorted(tuple(p[:n]) + tuple(t[:m]) for p, n, t, m in
                  zip(b["prompts"], b["prompt_lengths"], b["tokens"], b["lengths"]))
    assert len(want) == 2 * PER_PROMPT and stored == want
    assert [r["history/rollouts"] for r in metric_rows(one)] == [2 * PER_PROMPT] * worker.STEPS


def test_the_store_drafts(runs):
    """The comparison is not vacuous: from step 2 the prompts' stored rollouts are drafted
    and accepted (hybrid: drafts the history proposed), and the runs replayed plain decoding."""
    kind, _, one = runs
    rows = metric_rows(one)
    if kind == "history":  # step 1: an empty store, and siblings decoding in step accept nothing
        assert rows[0]["acceptance_length"] == 1.0
    assert all(r["replay_identical"] == 1.0 for r in rows if "replay_identical" in r)
    for r in rows[1:]:
        if kind != "history":
            assert r["spec/accepted_history_only"] + r["spec/accepted_both"] > 0, r
        else:
            assert r["acceptance_length"] > 1.0, r
