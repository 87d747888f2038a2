"""The GRPO trainer over two JAX processes (jax.distributed over 127.0.0.1, 2 CPU devices
of each) equals the same trainer in one process with 4 CPU devices, on the same mesh
(data=2, fsdp=1, tensor=2: the rollout rows split across the processes, the parameters'
tensor shards inside each, as docs/scaling.md lays a run out over GPU nodes).

Both runs are the real trainer from the short tiny config in `jaxspec.testing.multiprocess_grpo`:
warm-up, in-domain EAGLE-3 initialisation, speculative generation (plus the plain replay
check), the logprob stage, the GRPO and online draft updates, a checkpoint every step and
the export. In the two-process run process 1 alone gets a SIGTERM after step 2: both stop
there, and a new trainer in each resumes from the checkpoint they wrote; the one-process
run goes straight through, then resumes the two processes' checkpoint of step 2 itself. Tolerances are the sharded
single-process tests' (tests/parallel/test_train_step.py): tokens, lengths and accepted
drafts identical, generation log-probs within 1e-5, non-timing metrics within 1e-5
(relative above 1), parameters and optimizer states within 1e-5.

The suite runs it once, with `draft.kind: hybrid` (the EAGLE-3 head trained online and
drafting chains, plus history drafts from the store of earlier rollouts, replicated on every
process: each adds the same all-gathered rows, places them on its generation devices, and
both save it in the checkpoint) over a dataset of 2 prompts, so that every step sees the
same 2 prompts and the drafts of steps 2 and 3 come from the store. JAXSPEC_FULL_EXACTNESS=1
adds the kinds eagle3 (the head alone), history (the store alone) and hybrid_block (the
block model trained online).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxspec.checkpoint import CheckpointManager
from jaxspec.models import load_hf
from jaxspec.testing import multiprocess_grpo as worker
from jaxspec.testing.multiprocess_grpo import metric_rows


FULL = os.environ.get("JAXSPEC_FULL_EXACTNESS", "") not in ("", "0")
KINDS = ["hybrid", "eagle3", "history", "hybrid_block"] if FULL else ["hybrid"]
REPEAT = "task.params.dataset_size=2"  # = rollout.prompts_per_step: the same prompts every step
PER_PROMPT = 4  # draft.history.per_prompt's default = rollout.group_size of the worker
HEADS = {"hybrid": "head", "eagle3": "head", "hybrid_block": "head", "history": None}


@pytest.fixture(scope="module", params=KINDS)
def runs(request, tmp_path_factory):
    """(kind, workdir, the two-process results, the one-process results); the runs
    overlap."""
    workdir = tmp_path_factory.mktemp(f"multiprocess_{request.param}")
    return request.param, workdir, *worker.run_both(workdir, f"draft.kind={request.param}", REPEAT)


def test_two_processes_equal_one_process(runs):
    _, _, two, one = runs
    worker.assert_two_equal_one(two, one)  # the stores (s*_history_*) included


@pytest.mark.slow
def test_two_processes_equal_one_process_on_an_moe_policy(tmp_path):
    """An MoE policy with its experts split over an expert axis inside each process, rollout
    rows over the processes: two processes equal one (the same comparison as above, fewer
    steps, no preemption); routing is measured and speculation replays plain decoding."""
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    procs = [(f"two processes, process {i}", p) for i, p in
             enumerate(worker.launch(tmp_path / "two", 2, "moe"))]
    procs.append(("one process", worker.launch(tmp_path / "one", 1, "moe")[0]))
    worker.wait(procs)
    with np.load(tmp_path / "two" / "moe.npz") as two, np.load(tmp_path / "one" / "moe.npz") as one:
        two, one = dict(two), dict(one)
    np.testing.assert_array_equal(two["mesh_shape"], [2, 1, 2, 1])
    np.testing.assert_array_equal(two["mesh_processes"], [[[[0], [0]]], [[[1], [1]]]])
    worker.assert_same_runs(two, one, worker.MOE_STEPS)
    rows = metric_rows(one)
    assert all(r["moe/routing_mismatch"] <= 0.05 and r["grpo/router_aux_loss"] > 1.5 for r in rows)
    assert all(r["replay_identical"] == 1.0 for r in rows if "replay_identical" in r)


def test_the_runs_train_and_speculate(runs):
    """The comparison is not vacuous: drafts were accepted, speculative decoding replayed
    plain decoding, and the policy and the head moved at every step."""
    kind, _, _, one = runs
    rows = metric_rows(one)
    assert sum(r["acceptance_length"] > 1.0 for r in rows) >= 2
    assert all(r["replay_identical"] == 1.0 for r in rows if "replay_identical" in r)
    assert all(r["grpo/grad_norm"] > 0 for r in rows)
    if HEADS[kind]:
        assert all(r["draft/loss"] > 0 for r in rows)
    for name in ("policy", HEADS[kind]) if HEADS[kind] else ("policy",):
        for step in range(2, worker.STEPS + 1):
            moved = max(np.abs(one[f"s{step}_{k[3:]}"] - one[f"s{step - 1}_{k[3:]}"]).max()
                        for k in one if k.startswith(f"s{step}_{name}_"))
            assert moved > 1e-4, (name, step)


def test_two_process_checkpoint_and_export(runs):
    """The two processes wrote one checkpoint per step (the resume read step 2's), and
    process 0 the metrics, the config and the export; they hold the state they saw."""
    kind, workdir, two, _ = runs
    run_dir = workdir / "resume"
    with CheckpointManager(run_dir / "checkpoints", create=False) as manager:
        assert manager.all_steps() == [1, 2, 3]
        state, meta = manager.restore(2)  # here, one process, no target: host arrays
    assert meta["step"] == 2
    trees = [("policy", state["policy"])] + ([("head", state["head"]["params"])] if HEADS[kind] else [])
    for name, tree in trees:
        leaves = jax.tree.leaves(tree)
        assert len(leaves) == sum(k.startswith(f"s2_{name}_") for k in two)
        for i, x in enumerate(leaves):
            np.testing.assert_array_equal(np.asarray(x), two[f"s2_{name}_{i}"], err_msg=(name, i))
    exported = load_hf(run_dir / "policy")
    for i, x in enumerate(jax.tree.leaves(exported.params)):
        np.testing.assert_array_equal(np.asarray(x), two[f"s3_policy_{i}"])
    history = [json.loads(line) for line in open(run_dir / "config_history.jsonl")]
    assert history[0]["resumed_at_step"] == 2 and history[0]["changes"] == {}


def test_a_signal_to_one_process_stops_both_at_the_same_step(runs):
    _, _, two, _ = runs
    # process 0 got no signal: it stopped on the agreed flag of process 1 (faults.StopSignals)
    assert str(two["preempted"]) == "2 a stop signal (on another process)"
    assert "SIGTERM" not in str(two["log"])  # (process 0's log; process 1 logged the signal)


def test_the_script_joins_the_processes_of_a_launch(tmp_path):
    """scripts/train_grpo.py joins a run through the JAXSPEC_* variables (as srun's SLURM_*
    would) before anything touches a device: two processes of 2 CPU devices see the run's
    4, which a mesh of 6 devices names in its error (exit 2, before any compilation)."""
    port = worker.free_port()
    env = worker.child_env(2)
    env.update(JAXSPEC_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAXSPEC_NUM_PROCESSES="2")
    script = worker.ROOT / "scripts" / "train_grpo.py"
    procs = [(f"process {i}", subprocess.Popen(
        [sys.executable, str(script), str(worker.TINY), f"run.dir={tmp_path}", "mesh.data=6"],
        env={**env, "JAXSPEC_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)) for i in range(2)]
    for output in worker.wait(procs, returncode=2).values():
        assert "error: config key 'mesh'" in output and "but there are 4" in output, output


def test_one_process_resumes_the_two_process_checkpoint(runs):
    """The checkpoint of step 2 that two processes wrote resumes in one process (a topology
    it was not saved on: `jaxspec.testing.multiprocess_grpo.resume_here`), and its step 3 equals the
    one-process run's."""
    worker.assert_resumed_here(runs[3])


def test_the_store_holds_the_last_rollouts(runs):
    """After step 3 each of the 2 prompts' rings holds that step's 4 rollouts (prompt +
    completion), on every process alike (the comparison above)."""
    kind, _, _, one = runs
    if kind == "eagle3":  # no store: none saved, none counted
        assert not any(k.startswith("s3_history_") for k in one)
        assert not any("history/rollouts" in r for r in metric_rows(one))
        return
    tokens, lengths = one["s3_history_0"], one["s3_history_1"]  # HistoryStore's field order
    stored = sorted(tuple(t[:n]) for t, n in zip(tokens.reshape(-1, tokens.shape[-1]),
                                                lengths.reshape(-1)) if n)
    b = {k: one[f"b3_{k}"] for k in ("prompts", "prompt_lengths", "tokens", "lengths")}
    want = sorted(tuple(p[:n]) + tuple(t[:m]) for p, n, t, m in
                  zip(b["prompts"], b["prompt_lengths"], b["tokens"], b["lengths"]))
    assert len(want) == 2 * PER_PROMPT and stored == want
    assert [r["history/rollouts"] for r in metric_rows(one)] == [2 * PER_PROMPT] * worker.STEPS


def test_the_store_drafts(runs):
    """The comparison is not vacuous for the store: from step 2 the prompts' stored rollouts
    are drafted and accepted (hybrid: drafts the history proposed)."""
    kind, _, _, one = runs
    rows = metric_rows(one)
    if kind == "eagle3":  # the head alone drafts: no history counters
        assert not any(k.startswith("spec/accepted_history") for r in rows for k in r)
        return
    if kind == "history":  # step 1: an empty store, and siblings decoding in step accept nothing
        assert rows[0]["acceptance_length"] == 1.0
    for r in rows[1:]:
        if kind != "history":
            assert r["spec/accepted_history_only"] + r["spec/accepted_both"] > 0, r
        else:
            assert r["acceptance_length"] > 1.0, r
