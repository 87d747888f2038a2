"""Where a run's arrays live: the generation and training meshes (disjoint device groups in
async mode, the same devices otherwise), placement on them, and the weight sync between."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec import parallel
from jaxspec.decoding.costs import measure_costs
from jaxspec.decoding.engine import generate
from jaxspec.rl.steps import routing_mismatch_of, score_rollouts

__all__ = ["Cluster", "host_arrays", "is_primary", "mesh_sizes"]

_SCORED_INPUTS = ("prompts", "prompt_lengths", "tokens", "lengths", "gen_logprobs")


def is_primary() -> bool:
    """Whether this process writes the run's files (metrics, config, exports): process 0 of
    a multi-process run, the only process otherwise. Checkpoints are written by all."""
    return jax.process_index() == 0


def host_arrays(tree):
    """`tree` with every array leaf as a numpy array of its global value (a typed PRNG key
    as its key data). An array spread over several processes is all-gathered, so in a
    multi-process run every process must call this on the same tree, and gets the same
    result; other leaves stay as they are."""
    def leaf(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x) if isinstance(x, np.generic) else x
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.random.key_data(x)) if _is_key(x) else np.asarray(x)
        from jax.experimental import multihost_utils

        data = jax.random.key_data(x) if _is_key(x) else x
        return np.asarray(multihost_utils.process_allgather(data, tiled=True))

    return jax.tree.map(leaf, tree)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def mesh_sizes(mesh_cfg, n_generation: int, n_training: int) -> dict[str, tuple[int, int, int]]:
    """(data, fsdp, tensor) of the generation and training meshes, for `make_mesh`.

    Training takes the config's sizes as they are (one may be -1). Generation keeps the
    training mesh's fsdp and tensor sizes, resolved to numbers, and gives `data` the rest:
    every generation device splits the rollout rows, and the parameters keep the layout
    that made them fit in training (with fsdp=-1 a model too large for one device stays
    sharded, and in a synchronous run the weight sync is the identity). When the generation
    group is too small for that (async runs), fsdp shrinks to what the group holds."""
    expert = getattr(mesh_cfg, "expert", 1)  # both meshes keep it (see Cluster)
    sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
    fill = [axis for axis, size in sizes.items() if size == -1]
    if fill:  # (more than one -1 is make_mesh's error on the training sizes)
        fixed = math.prod(size for size in sizes.values() if size != -1) * max(expert, 1)
        sizes[fill[0]] = max(n_training // fixed, 1)
    fsdp = math.gcd(sizes["fsdp"], max(n_generation // (sizes["tensor"] * max(expert, 1)), 1))
    return {"generation": (-1, fsdp, sizes["tensor"]),
            "training": (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)}


class Cluster:
    """The two roles' meshes over the devices a `RunPlan` assigned them (sizes from
    `mesh_sizes`: generation splits the rollout rows over every device it has, training
    uses the config's mesh shape). `rules` maps logical parameter axes to mesh axes."""

    def __init__(self, mesh_cfg, generation_devices: Sequence, training_devices: Sequence,
                 *, score_options: dict | None = None):
        self.rules = mesh_cfg.rules
        self.score_options = dict(score_options or {})  # score_rollouts' chunk, micro_batch
        sizes = mesh_sizes(mesh_cfg, len(generation_devices), len(training_devices))
        expert = getattr(mesh_cfg, "expert", 1)  # the expert axis: the same in both roles
        self.gen_mesh = parallel.make_mesh(*sizes["generation"], list(generation_devices),
                                           expert=expert)
        self.train_mesh = parallel.make_mesh(*sizes["training"], list(training_devices),
                                             expert=expert)

    @classmethod
    def from_plan(cls, cfg, plan) -> Cluster:
        return cls(cfg.mesh, plan.generation_devices, plan.training_devices,
                   score_options=dict(chunk=cfg.grpo.logprob_chunk,
                                      micro_batch=cfg.grpo.micro_batch))

    # ------------------------------------------------------------------ training side
    @contextlib.contextmanager
    def training(self):
        """Context in which jitted training updates run (`with cluster.training(): ...`):
        the training mesh, and the run's rules for the activations' constraints
        (`parallel.use_rules`)."""
        with jax.set_mesh(self.train_mesh), parallel.use_rules(self.rules):
            yield

    def place_policy(self, policy):
        """A Policy (or draft model) on its rule shardings over the training devices."""
        return parallel.shard_policy(policy, self.train_mesh, self.rules)

    def place_head(self, head):
        return parallel.shard_head(head, self.train_mesh, self.rules)

    def place_tree(self, tree):
        """Params-shaped pytrees (optimizer states, reference params) onto the training
        devices, on the shardings their parameter names give."""
        return parallel.place(tree, parallel.param_shardings(tree, self.train_mesh, self.rules))

    def replicate(self, tree):
        """Arrays (PRNG keys included) replicated over the training devices: each process
        places its own copy (they must be equal), so a checkpoint or a jitted step can
        take them in a multi-process run."""
        return parallel.place(tree, NamedSharding(self.train_mesh, PartitionSpec()))

    def restore_target(self, tree: dict) -> dict:
        """An abstract checkpoint tree (`RunState.tree()` shapes) with the training shardings
        on its model and optimizer arrays (and the replicated ones on the run key, a head's
        buffers and the history store), so a restore lands there whatever devices saved it."""
        mesh, rules = self.train_mesh, self.rules
        replicated = NamedSharding(mesh, PartitionSpec())

        def on_rules(x):
            return parallel.restore_target(x, parallel.param_shardings(x, mesh, rules))

        out = dict(tree)
        for name in ("policy", "opt", "ref", "draft_opt", "draft_model"):
            if name in out:
                out[name] = on_rules(out[name])
        out["key"] = parallel.restore_target(out["key"], replicated)
        if "history" in out:
            out["history"] = parallel.restore_target(out["history"], replicated)
        if "head" in out:
            head = out["head"]
            out["head"] = dataclasses.replace(
                head, params=parallel.restore_target(head.params, parallel.param_shardings(
                    head, mesh, rules)), buffers=parallel.restore_target(head.buffers, replicated))
        return out

    def shard_batch(self, x):
        """Host arrays (leading axis = rollout rows) split over the training batch shards."""
        return parallel.shard_batch(x, self.train_mesh, self.rules)

    def score(self, policy, ref_params, batch: Sequence, *, sampling, capture=(),
              filtered: bool = False, **options) -> dict:
        """The logprob stage (`score_rollouts`) on the training devices; `batch` is (prompts,
        prompt lengths, rollout tokens, lengths, generation log-probs), host arrays;
        `options` (micro_batch, recompute) override score_rollouts' defaults of the run."""
        arrays = self.shard_batch(dict(zip(_SCORED_INPUTS, batch, strict=True)))
        with self.training():
            return score_rollouts(policy, ref_params, **arrays, sampling=sampling,
                                  capture=capture, filtered=filtered,
                                  **{**self.score_options, **options})

    # ------------------------------------------------------------------ generation side
    def sync_weights(self, policy, head=None, draft_model=None):
        """The weight sync: the policy, EAGLE-3 head and draft model (each may be None but
        the policy) resharded onto the generation devices. Returns them in that order."""
        mesh, rules = self.gen_mesh, self.rules
        params, _ = parallel.sync_weights(policy.params,
                                          parallel.param_shardings(policy, mesh, rules))
        policy = policy.replace(params=params)
        if head is not None:
            params, _ = parallel.sync_weights(head.params,
                                              parallel.param_shardings(head, mesh, rules))
            buffers, _ = parallel.sync_weights(head.buffers, NamedSharding(mesh, PartitionSpec()))
            head = dataclasses.replace(head, params=params, buffers=buffers)
        if draft_model is not None:
            params, _ = parallel.sync_weights(
                draft_model.params, parallel.param_shardings(draft_model, mesh, rules))
            draft_model = draft_model.replace(params=params)
        return policy, head, draft_model

    def place_for_generation(self, policy):
        """A Policy on its rule shardings over the generation devices (no timing)."""
        return parallel.shard_policy(policy, self.gen_mesh, self.rules)

    def _placed(self, rows, key):
        rows = parallel.shard_batch(np.asarray(rows, np.int32), self.gen_mesh, self.rules)
        return rows, parallel.place(key, NamedSharding(self.gen_mesh, PartitionSpec()))

    def measure_costs(self, policy, drafter, prompts, *, rows, key, **kwargs):
        """`jaxspec.decoding.measure_costs` on the generation devices, as `generate` runs."""
        rows, key = self._placed(rows, key)
        with jax.set_mesh(self.gen_mesh):
            return measure_costs(policy, drafter, prompts, rows=rows, key=key, **kwargs)

    def routing_mismatch(self, policy, batch: Sequence) -> float:
        """`steps.routing_mismatch_of` on the generation devices (the params that generated):
        `batch` is (prompts, prompt lengths, tokens, lengths, Rollouts.routes), host arrays."""
        arrays = parallel.shard_batch(tuple(np.asarray(x) for x in batch), self.gen_mesh,
                                      self.rules)
        with jax.set_mesh(self.gen_mesh):
            return float(routing_mismatch_of(policy, *arrays)[0])

    def generate(self, policy, prompts, *, rows, key, **kwargs):
        """`jaxspec.decoding.generate` on the generation devices: `rows` (global rollout ids,
        [B] int) on the batch sharding, so GSPMD splits the rollouts over the generation
        mesh; every other argument is generate's."""
        rows, key = self._placed(rows, key)
        with jax.set_mesh(self.gen_mesh):
            out = generate(policy, prompts, rows=rows, key=key, **kwargs)
        # multi-process: every process gets all rows (rewards, the queue and the logprob
        # stage's inputs are host arrays, the same on every process)
        return out if jax.process_count() == 1 else host_arrays(out)
