"""The GRPO tests' shared set-up: the short tiny config, one warmed-up base per process, an
independent logprob computation, and comparisons of runs (tests/rl, tests/parallel)."""

import functools
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import load_config
from jaxspec.testing import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
# tiny.yaml shortened: a smaller batch and warm-up (the full run is scripts/train_grpo.py)
SHORT = ["rollout.prompts_per_step=4", "rollout.group_size=4", "warmup.steps=100",
         "warmup.batch_size=32", "warmup.draft_rollouts=64", "warmup.draft_steps=30",
         "run.compare_plain=2", "run.save_every=2"]
# metrics that are wall-clock times (they differ between equal runs)
TIMING = ("time/", "share/", "generation_time_s", "generation_plain_time_s", "generation_speedup")


def make_config(run_dir, *extra):
    """The short tiny config with run.dir = `run_dir` and `extra` overrides (key=value)."""
    return load_config(TINY, SHORT + [f"run.dir={run_dir}", *extra])


@functools.cache
def warmed_base():
    """A warmed-up policy and its in-domain EAGLE-3 head, built by the trainer's parts as a
    run of the short config would build them (once per process; no GRPO trainer, and
    nothing is written to run.dir).

    Returns:
        (policy, head, warm-up history), placed as the run's cluster places them.
    """
    from jaxspec.rl.build import build_policy
    from jaxspec.rl.cluster import Cluster
    from jaxspec.rl.drafting import DraftLearner
    from jaxspec.rl.plan import prepare_run
    from jaxspec.rl.steps import sampling_of

    run_dir = os.path.join(tempfile.gettempdir(), f"jaxspec-test-base-{os.getpid()}")
    cfg = make_config(run_dir, "run.steps=1")
    plan = prepare_run(cfg)
    cluster = Cluster.from_plan(cfg, plan)
    history = {}
    policy = build_policy(cfg, plan, cluster, resuming=False, history=history)
    sampling, filtered = sampling_of(cfg.sampling)
    learner = DraftLearner(cfg, plan, cluster, sampling, filtered=filtered)
    # the reference makes the scoring program the RL step's own: compiled once for both
    head, _ = learner.build_head(policy, resuming=False, ref_params=policy.params,
                                 history=history)
    return cluster.place_policy(policy), cluster.place_head(head), history


def packed(batch):
    """Prompt + rollout per row, right-padded (numpy, written independently of the trainer).

    Returns:
        (tokens [B, P + N] int32, positions [B, P + N] int32, -1 past the row's end).
    """
    b, p = batch.prompts.shape
    n = batch.tokens.shape[1]
    seq = np.zeros((b, p + n), np.int32)
    pos = np.full((b, p + n), -1, np.int32)
    for i in range(b):
        pl, gl = int(batch.prompt_lengths[i]), int(batch.lengths[i])
        seq[i, :pl] = batch.prompts[i, :pl]
        seq[i, pl:pl + gl] = batch.tokens[i, :gl]
        pos[i, :pl + gl] = np.arange(pl + gl)
    return seq, pos


def rollout_logprobs(policy, params, batch):  # -> [B, N] log p(generated token) at temperature 1
    """log p(token) of every generated token of `batch` under `policy` with `params`, from one
    plain forward of the packed rows (0 past each row's length)."""
    seq, pos = packed(batch)
    logits, _, _ = policy.replace(params=params).forward(jnp.asarray(seq), jnp.asarray(pos))
    logp = jax.nn.log_softmax(logits, axis=-1)
    pl = jnp.asarray(batch.prompt_lengths)[:, None]
    j = jnp.arange(batch.tokens.shape[1])[None, :]
    at = jnp.clip(pl + j - 1, 0, seq.shape[1] - 1)
    logp_at = logp[jnp.arange(seq.shape[0])[:, None], at]  # [B, N, V]
    lp = jnp.take_along_axis(logp_at, jnp.asarray(batch.tokens)[..., None], axis=-1)[..., 0]
    return jnp.where(j < jnp.asarray(batch.lengths)[:, None], lp, 0.0)


class Killed(Exception):
    """Raised from a run's on_step callback: the run stops there, as a SIGKILL would leave it."""


def kill_after(trainer, step: int) -> None:
    """Run `trainer` and stop it right after `step` (its checkpoint of that step written),
    as a SIGKILL would leave it."""
    import pytest

    def kill(done, row):
        if done == step:
            raise Killed

    with pytest.raises(Killed):
        trainer.run(on_step=kill)


def rows(run_dir):
    """The rows of run_dir/metrics.jsonl without their wall-clock entries (TIMING)."""
    with open(run_dir / "metrics.jsonl") as fh:
        out = [json.loads(line) for line in fh]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in out]


def assert_same_tree(a, b):
    """Asserts two pytrees have equal leaves, bit for bit (PRNG keys by their key data)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
