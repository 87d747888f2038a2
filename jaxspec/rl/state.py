"""What a GRPO run carries from step to step, and its checkpoint: the state pytree saved
with orbax and the JSON meta beside it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxspec.checkpoint import CheckpointManager
from jaxspec.rl.faults import Diverged, all_finite

__all__ = ["RunState", "restore_checkpoint", "save_checkpoint"]


@dataclasses.dataclass
class RunState:
    """Everything a run needs to continue as step `completed` (= the policy version)."""

    policy: Any  # Policy on the training devices
    opt_state: Any
    key: jax.Array  # the run's PRNG key; step s generates with fold_in(key, s)
    ref_params: Any = None  # the reference policy's params (KL), None when kl_coef == 0
    ref_saved: bool = True  # False: the reference is model.hf_path on disk, not checkpointed
    head: Any = None  # Eagle3Head (draft.kind eagle3)
    draft_opt_state: Any = None  # the head's optimizer state (online draft training)
    draft_model: Any = None  # Policy (draft.kind draft_model)
    queue: list = dataclasses.field(default_factory=list)  # RolloutBatch of later steps (async)
    completed: int = 0
    collapsed_steps: int = 0  # consecutive steps below the acceptance-collapse threshold
    skipped_steps: int = 0  # consecutive non-finite updates skipped (run.on_nonfinite skip)

    @property
    def models(self) -> tuple:
        """(policy, head, draft_model): what the generation side needs."""
        return self.policy, self.head, self.draft_model

    def tree(self) -> dict:
        """The pytree a checkpoint holds."""
        tree = {"policy": self.policy.params, "opt": self.opt_state, "key": self.key,
                "queue": list(self.queue)}
        if self.ref_params is not None and self.ref_saved:
            tree["ref"] = self.ref_params
        if self.head is not None:
            tree["head"] = self.head
        if self.draft_opt_state is not None:
            tree["draft_opt"] = self.draft_opt_state
        if self.draft_model is not None:
            tree["draft_model"] = self.draft_model.params
        return tree

    def meta(self, prompts_per_step: int) -> dict:
        return {"step": self.completed, "data_position": self.completed * prompts_per_step,
                "collapsed_steps": self.collapsed_steps, "skipped_steps": self.skipped_steps,
                "queue": [int(b.step) for b in self.queue]}


def save_checkpoint(directory: str, state: RunState, *, prompts_per_step: int,
                    keep: int | None) -> None:
    """Checkpoint `state` as step `state.completed`, keeping the last `keep`. A state with a
    non-finite model or optimizer value is refused (Diverged) before anything is written, so a checkpoint is
    always finite and pruning never drops the last finite one for a later, diverged one."""
    tree = state.tree()
    finite, bad = all_finite({k: v for k, v in tree.items() if k not in ("queue", "key")})
    if not finite:
        raise Diverged(f"diverged: the state of step {state.completed} holds non-finite values "
                       f"({bad} tensors); not checkpointed")
    with CheckpointManager(directory, max_to_keep=keep) as mgr:
        mgr.save(state.completed, tree, state.meta(prompts_per_step))


def restore_checkpoint(directory: str, step: int, state: RunState,
                       queue_entry: Callable[[], Any]) -> None:
    """Fill `state` (whose models may be abstract) from the checkpoint of `step`, onto the
    shardings its arrays have; `queue_entry()` is an abstract RolloutBatch."""
    with CheckpointManager(directory, create=False) as mgr:
        _, meta = mgr.restore(step)  # the meta says how long the queue is
    state.queue = [queue_entry() for _ in meta["queue"]]
    if state.ref_params is not None and state.ref_saved:
        state.ref_params = jax.eval_shape(lambda p: p, state.policy.params)
    target = jax.eval_shape(lambda s: s, state.tree())
    with CheckpointManager(directory, create=False) as mgr:
        tree, meta = mgr.restore(step, target=target)
    state.policy = state.policy.replace(params=tree["policy"])
    state.opt_state, state.key = tree["opt"], tree["key"]
    state.queue = [b.host() for b in tree["queue"]]
    if "ref" in tree:
        state.ref_params = tree["ref"]
    if "head" in tree:
        state.head = tree["head"]
    if "draft_opt" in tree:
        state.draft_opt_state = tree["draft_opt"]
    if "draft_model" in tree:
        state.draft_model = state.draft_model.replace(params=tree["draft_model"])
    state.completed = int(meta["step"])
    state.collapsed_steps = int(meta["collapsed_steps"])
    state.skipped_steps = int(meta.get("skipped_steps", 0))
