"""What a GRPO run carries from step to step, and its checkpoint: the state pytree saved
with orbax and the JSON meta beside it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxspec.checkpoint import CheckpointManager
from jaxspec.rl.faults import Diverged, all_finite

__all__ = ["RunState", "config_changes", "restore_checkpoint", "save_checkpoint"]


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
    # HistoryStore: earlier rollouts per prompt (draft.kind history, hybrid), replicated on
    # the training devices (the same on every process)
    history: Any = None
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
        if self.history is not None:
            tree["history"] = self.history
        return tree

    def meta(self, prompts_per_step: int) -> dict:
        return {"step": self.completed, "data_position": self.completed * prompts_per_step,
                "collapsed_steps": self.collapsed_steps, "skipped_steps": self.skipped_steps,
                "queue": [int(b.step) for b in self.queue]}


def _changed(a, b) -> bool:
    return a != b


def _none_vs_value(a, b) -> bool:  # e.g. clip_norm null vs a number: another optax chain
    return (a is None) != (b is None)


def _zero_vs_positive(a, b) -> bool:  # e.g. kl_coef 0: no reference; warmup_steps 0: no schedule
    return (not a) != (not b)


# What shapes the checkpoint tree (RunState.tree): the policy and reference params (model),
# the optimizer states' structure (optim / draft_optim), the head and its optimizer state
# (draft), the small draft model, and the async queue's RolloutBatch shapes (rollout, draft
# depth, async). A change to any of these cannot be restored into; every other key (lr,
# steps, log_every, sampling, the task, the mesh: orbax restores onto the current
# shardings, ...) may change on resume. The longest matching prefix decides.
_STATE_RULES: dict[str, Callable[[Any, Any], bool]] = {
    "model": _changed,
    "model.attention_backend": lambda a, b: False,  # how it computes, not what it holds
    "model.batch_invariant": lambda a, b: False,
    "model.layer_loop": lambda a, b: False,
    "draft.kind": _changed,
    "draft.k": _changed,
    "draft.tree": _changed,
    "draft.draft_vocab_size": _changed,
    "draft.hf_path": _changed,
    "draft.layers": _changed,
    "draft.online": _changed,
    "draft.model": _changed,
    "draft.history.prompts": _changed,  # the HistoryStore's shape
    "draft.history.per_prompt": _changed,
    "draft.history.depth": _changed,  # the queue's per-depth counters (async)
    "rollout.prompts_per_step": _changed,
    "rollout.group_size": _changed,
    "rollout.max_prompt_len": _changed,
    "rollout.max_new_tokens": _changed,
    "async.enabled": _changed,
    "async.max_policy_lag": _changed,
    "grpo.kl_coef": _zero_vs_positive,
    "optim.clip_norm": _none_vs_value,
    "optim.warmup_steps": _zero_vs_positive,
    "draft_optim.clip_norm": _none_vs_value,
    "draft_optim.warmup_steps": _zero_vs_positive,
}
_IGNORED = ("run.resume", "run.dir")  # how this process was started, not the run


def _differences(a: dict, b: dict, prefix: str = ""):
    """(dotted key, a's value, b's value) wherever they differ; a section present on one
    side only (a tree vs null) is one difference."""
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            yield from _differences(va, vb, f"{prefix}{k}.")
        elif va != vb:
            yield f"{prefix}{k}", va, vb


def config_changes(saved: dict, now: dict) -> tuple[dict, dict]:
    """Two configs (the nested `config.to_dict` layout) compared key by key: (changes that
    shape the checkpointed state, the other changes), each {dotted key: (saved, now)}."""
    # a saved model.hf_path run checkpoints the reference only after a warm-up
    hf = (now.get("model") or {}).get("hf_path") is not None
    shaping, other = {}, {}
    for key, old, new in _differences(saved, now):
        if key in _IGNORED:
            continue
        parts = key.split(".")
        rule = next((_STATE_RULES[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                     if ".".join(parts[:n]) in _STATE_RULES), None)
        if key == "warmup.steps" and hf:
            rule = _zero_vs_positive
        (shaping if rule is not None and rule(old, new) else other)[key] = (old, new)
    return shaping, other


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
                       queue_entry: Callable[[], Any],
                       shardings: Callable[[dict], dict] | None = None) -> None:
    """Fill `state` (whose models may be abstract) from the checkpoint of `step`, onto the
    shardings its arrays have, or those `shardings(target)` gives the abstract checkpoint
    tree (the training devices: needed where the checkpoint was saved on other devices,
    e.g. by another number of processes); `queue_entry()` is an abstract RolloutBatch."""
    with CheckpointManager(directory, create=False) as mgr:
        _, meta = mgr.restore(step)  # the meta says how long the queue is
    state.queue = [queue_entry() for _ in meta["queue"]]
    if state.ref_params is not None and state.ref_saved:
        state.ref_params = jax.eval_shape(lambda p: p, state.policy.params)
    target = jax.eval_shape(lambda s: s, state.tree())
    if shardings is not None:
        target = shardings(target)
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
    if "history" in tree:
        state.history = tree["history"]
    state.completed = int(meta["step"])
    state.collapsed_steps = int(meta["collapsed_steps"])
    state.skipped_steps = int(meta.get("skipped_steps", 0))
