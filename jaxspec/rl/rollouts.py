"""The generation role: a step's prompts, the weight sync, speculative generation (and the
plain comparison) on the generation devices, and the rewards — one `RolloutBatch`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec import parallel
from jaxspec.decoding import drafters as drafters_lib
from jaxspec.decoding import history as history_lib
from jaxspec.decoding.engine import RolloutStats
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.metrics import StageTimer
from jaxspec.rl.cluster import Cluster, host_arrays
from jaxspec.rl.kinds import KINDS
from jaxspec.rl.state import RunState

__all__ = ["RolloutBatch", "RolloutWorker", "abstract_batch", "completions_ended",
           "encode_prompts", "make_drafter", "prompt_keys", "score_completions"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One step's rollouts as the generation side hands them to training (a queue entry)."""

    prompts: Any  # [B, P] int32 right-padded prompt tokens (each prompt repeated G times)
    prompt_lengths: Any  # [B] int32
    tokens: Any  # [B, N] int32 generated tokens, right-padded
    lengths: Any  # [B] int32
    gen_logprobs: Any  # [B, N] float32 log-probs the generator reported
    rewards: Any  # [B] float32
    ended: Any  # [B] bool: the completion stopped at an EOS (else it hit max_new_tokens)
    version: Any  # [] int32 policy version (updates applied) that generated it
    step: Any  # [] int32 the step it was generated for (data position = step * prompts)
    stats: RolloutStats  # the generation's speculation counters
    plain_time_s: Any  # [] float32 plain generation of the same batch, NaN if not compared
    replay_identical: Any  # [] float32 fraction of rows equal to plain decoding, NaN if not
    # [] float32 an MoE policy: fraction of fed rollout tokens whose experts differ between
    # the generation forward and the training forward (same params); NaN for a dense policy
    routing_mismatch: Any = np.float32(np.nan)
    # [] float32 an MoE policy: fed rollout tokens (all but each row's last) the generation
    # left without a complete route record, which routing_mismatch cannot count (0 expected;
    # NaN for a dense policy)
    routing_gaps: Any = np.float32(np.nan)

    def host(self) -> RolloutBatch:
        return jax.tree.map(np.asarray, self)


def abstract_batch(batch: int, prompt_len: int, new: int, depth: int,
                   max_k: int | None = None) -> RolloutBatch:
    """The shapes of a RolloutBatch (a checkpoint restore target for the queue); max_k: the
    adaptive draft length's largest k (None: not adaptive)."""
    s = jax.ShapeDtypeStruct
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    stats = RolloutStats(target_forwards=s((), i32), draft_forwards=s((), i32),
                         row_steps=s((batch,), i32), tokens_generated=s((batch,), i32),
                         accepted_at=s((depth,), i32), proposed_at=s((depth,), i32),
                         wall_time_s=s((), f32), slot_steps=s((), i32),
                         prefill_forwards=s((), i32),
                         k_iterations=None if max_k is None else s((max_k + 1,), i32))
    return RolloutBatch(prompts=s((batch, prompt_len), i32), prompt_lengths=s((batch,), i32),
                        tokens=s((batch, new), i32), lengths=s((batch,), i32),
                        gen_logprobs=s((batch, new), f32), rewards=s((batch,), f32),
                        ended=s((batch,), np.dtype(np.bool_)),
                        version=s((), i32), step=s((), i32), stats=stats,
                        plain_time_s=s((), f32), replay_identical=s((), f32),
                        routing_mismatch=s((), f32), routing_gaps=s((), f32))


def encode_prompts(tokenizer, texts: Sequence[str], prompt_len: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompt tokens as the policy sees them (`tokenizer.encode_prompt`: the
    chat template, else BOS + text), [len(texts), prompt_len] int32, and their lengths,
    [len(texts)] int32."""
    out = np.full((len(texts), prompt_len), tokenizer.pad_id, np.int32)
    lengths = np.zeros((len(texts),), np.int32)
    for i, text in enumerate(texts):
        ids = tokenizer.encode_prompt(text)
        if len(ids) > prompt_len:
            raise ValueError(f"prompt {text[:40]!r} has {len(ids)} tokens; "
                             f"rollout.max_prompt_len is {prompt_len}")
        out[i, :len(ids)] = ids
        lengths[i] = len(ids)
    return out, lengths


def completions_ended(
    tokens,  # [B, N] int generated tokens, right-padded
    lengths,  # [B] int generated tokens per row (a stop token included)
    eos_ids,  # the stop tokens
) -> np.ndarray:  # [B] bool
    """Whether each completion's last token is an EOS (not cut at max_new_tokens)."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    last = tokens[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    return (lengths > 0) & np.isin(last, np.asarray(list(eos_ids)))


def score_completions(
    task,
    tokenizer,
    examples,  # the step's prompts (Example), each repeated group_size times in the rows
    tokens,  # [B, N] int generated tokens, right-padded
    lengths,  # [B] int
    *,
    group_size: int,
    truncated_reward: str = "zero",
) -> np.ndarray:  # [B] float32
    """The task's reward of each completion's text up to its first EOS. A truncated
    completion (no EOS within max_new_tokens) is unfinished: reward 0 under
    truncated_reward 'zero' (rollout.truncated_reward's default), its text's score under
    'score'."""
    ended = completions_ended(tokens, lengths, tokenizer.eos_ids)
    out = np.zeros((len(lengths),), np.float32)
    for i in range(len(lengths)):
        if ended[i] or truncated_reward == "score":
            completion = tokenizer.decode(tokens[i, :lengths[i]])
            out[i] = task.reward(examples[i // group_size], completion)
    return out


def make_drafter(draft_cfg, tree, head=None, draft_model=None, *, history=None, groups=None,
                 prompt_keys=None):
    """The drafter of `draft.kind` (its `rl.kinds.DraftKind.make_drafter`) for one generate
    call; `NoDrafter` (the empty tree) for plain decoding.

    Args:
        draft_cfg: the `draft:` section.
        tree: the run plan's TreeSpec, or None for chains.
        head: the generation-side draft head of kinds with one.
        draft_model: the generation-side draft model of kind draft_model.
        history: the HistoryStore of kinds that keep one.
        groups: [B] each row's group id (rows of one prompt share one); None: a one-row
            drafter (for its static sizes).
        prompt_keys: [B] each row's `history.prompt_key`.
    """
    return KINDS[draft_cfg.kind].make_drafter(
        draft_cfg, tree, head=head, draft_model=draft_model, history=history, groups=groups,
        prompt_keys=prompt_keys)


def prompt_keys(prompts, lengths) -> np.ndarray:  # [B, P], [B] -> [B] int64
    """Each row's prompt identity in the HistoryStore (a hash of its tokens)."""
    return np.array([history_lib.prompt_key(p[:n]) for p, n in
                     zip(np.asarray(prompts), np.asarray(lengths))], np.int64)


def leaders_first(num_groups: int, group_size: int) -> np.ndarray:  # -> [num_groups * group_size]
    """The order in which a step's rollouts (group-major: prompt i's samples at rows
    i*G .. i*G+G-1) take the decoding slots: the first sample of every prompt, then the
    second of every prompt, and so on. With fewer slots than rollouts, the later samples of
    a prompt start after its first one has gone ahead (or finished), so group-aware drafts
    (draft.kind history / hybrid) have a sibling to draft from. It changes no token:
    every draw is keyed by rollout id and position."""
    return np.arange(num_groups * group_size, dtype=np.int32).reshape(
        num_groups, group_size).T.reshape(-1)


def route_gaps(
    routes,  # [B, N, L, K] int32 Rollouts.routes: the experts per generated token, -1: none
    lengths,  # [B] int32 generated tokens per row
) -> int:
    """Generated tokens that a forward fed (every one but each row's last) whose route record
    is missing in any layer (-1): the routing mismatch leaves them out, so each is a gap in
    the record, not a match."""
    routes, lengths = np.asarray(routes), np.asarray(lengths)
    fed = np.arange(routes.shape[1])[None, :] < (lengths[:, None] - 1)
    return int(np.sum(fed & np.any(routes < 0, axis=(2, 3))))


def _speculates(drafter) -> bool:
    return drafter.num_nodes > 0


class RolloutWorker:
    """Makes the RolloutBatch of a step from the current training-side models."""

    def __init__(self, cfg, plan, cluster: Cluster, sampling: SamplingConfig):
        self.cfg, self.plan, self.cluster, self.sampling = cfg, plan, cluster, sampling
        self.task, self.tokenizer = plan.task, plan.tokenizer
        r = cfg.rollout
        self.batch_size = r.prompts_per_step * r.group_size
        self._compiled = False
        # draft.adaptive_k: the per-k iteration costs, measured once (compile()); the
        # previous step's first-depth acceptance as the next call's prior and its probe
        # clock carried on (`AdaptiveK.after`)
        self.adaptive = None
        # {step: the drafter's Rollouts.draft_stats} until the trainer logs them (hybrid:
        # accepted drafts by source); host ints, not checkpointed
        self.draft_stats: dict[int, dict[str, int]] = {}

    def sync_weights(self, policy, head=None, draft_model=None, *, history=None, prompts=None,
                     lengths=None):
        """The setup stage: (policy, drafter) on the generation devices, for `generate`.
        History kinds draft for the batch `prompts` [B, P] / `lengths` [B] (each prompt
        repeated group_size times, as `prompts()` makes them) from the store `history`."""
        policy, head, draft_model = self.cluster.sync_weights(policy, head, draft_model)
        groups = keys = None
        if history is not None:  # replicated on the generation devices, from each host's copy
            history = parallel.place(host_arrays(history),
                                     NamedSharding(self.cluster.gen_mesh, PartitionSpec()))
        if prompts is not None:
            groups = np.arange(len(prompts)) // self.cfg.rollout.group_size
            keys = prompt_keys(prompts, lengths)
        return policy, make_drafter(self.cfg.draft, self.plan.tree, head, draft_model,
                                    history=history, groups=groups, prompt_keys=keys)

    def remember(self, history, prompts, lengths, tokens, gen_lengths):
        """The store with this batch's rollouts (prompt + completion) added (history kinds),
        replicated over the training devices as the run's state is (every process adds the
        same rows: the batch is all-gathered); None stays None."""
        if history is None:
            return None
        prompts, lengths = np.asarray(prompts), np.asarray(lengths)
        tokens, gen_lengths = np.asarray(tokens), np.asarray(gen_lengths)
        seqs = np.zeros((len(prompts), prompts.shape[1] + tokens.shape[1]), np.int32)
        for i, (n, m) in enumerate(zip(lengths, gen_lengths)):
            seqs[i, :n] = prompts[i, :n]
            seqs[i, n:n + m] = tokens[i, :m]
        return self.cluster.replicate(
            history.add(prompt_keys(prompts, lengths), seqs, lengths + gen_lengths))

    def prompts(self, step: int):
        """The examples of `step` and their prompts, each repeated group_size times."""
        n, g = self.cfg.rollout.prompts_per_step, self.cfg.rollout.group_size
        examples = self.task.batch(step * n, n)
        prompts, lengths = encode_prompts(self.tokenizer, [ex.prompt for ex in examples],
                                          self.cfg.rollout.max_prompt_len)
        return examples, np.repeat(prompts, g, axis=0), np.repeat(lengths, g, axis=0)

    def _generate_kwargs(self, key, step: int) -> dict:
        r = self.cfg.rollout
        return dict(rows=np.arange(self.batch_size, dtype=np.int32) + step * self.batch_size,
                    key=jax.random.fold_in(key, step), sampling=self.sampling,
                    max_new_tokens=r.max_new_tokens, stop_tokens=tuple(self.tokenizer.eos_ids),
                    method=r.method, pad_id=self.tokenizer.pad_id, slots=r.slots,
                    order=(leaders_first(r.prompts_per_step, r.group_size)
                           if r.slots is not None and r.slots < self.batch_size else None))

    def generate(self, policy, drafter, key, step: int, prompts, lengths):
        """The rollouts of `step`: rollout ids step*B .. step*B + B-1, key fold_in(key, step)."""
        kwargs = self._generate_kwargs(key, step)
        if self.cfg.draft.adaptive_k and _speculates(drafter):
            if self.adaptive is None:  # once, on the real shapes (compiles generation too)
                self.adaptive = self.cluster.measure_costs(
                    policy, drafter, (prompts, lengths), verbose=True, **kwargs)
            kwargs["adaptive"] = self.adaptive
        out = self.cluster.generate(policy, (prompts, lengths), drafter=drafter, **kwargs)
        if "adaptive" in kwargs:  # the acceptance as the next call's prior, the probe clock
            self.adaptive = self.adaptive.after(out)
        return out

    def ended(self, tokens, lengths) -> np.ndarray:  # [B] bool
        """Which completions stopped at an EOS (generation includes the stop token)."""
        return completions_ended(tokens, lengths, self.tokenizer.eos_ids)

    def rewards(self, examples, tokens, lengths) -> np.ndarray:  # [B] float32
        r = self.cfg.rollout
        return score_completions(self.task, self.tokenizer, examples, tokens, lengths,
                                 group_size=r.group_size, truncated_reward=r.truncated_reward)

    def produce(self, state: RunState, step: int, timer: StageTimer,
                compare: bool) -> RolloutBatch:
        """Data, setup, generation and reward of the batch of `step`, generated by the
        state's current models (policy version `state.completed`)."""
        with timer.stage("data"):
            examples, prompts, lengths = self.prompts(step)
        with timer.stage("setup") as s:
            policy, drafter = s.ready(self.sync_weights(*state.models, history=state.history,
                                                        prompts=prompts, lengths=lengths))
        with timer.stage("generation") as s:
            out = s.ready(self.generate(policy, drafter, state.key, step, prompts, lengths))
        if out.draft_stats:
            self.draft_stats[step] = {k: int(v) for k, v in out.draft_stats.items()}
        if state.history is not None:  # the store learns this step's rollouts (own stage)
            with timer.stage("history"):
                state.history = self.remember(state.history, prompts, lengths, out.tokens,
                                              out.lengths)
        plain_time, identical = math.nan, math.nan
        if compare and _speculates(drafter):
            plain = self.generate(policy, drafters_lib.NoDrafter(), state.key, step, prompts, lengths)
            plain_time = float(plain.stats.wall_time_s)
            identical = float(np.mean(np.all(
                (np.asarray(plain.tokens) == np.asarray(out.tokens)), axis=1)
                & (np.asarray(plain.lengths) == np.asarray(out.lengths))))
        routing, gaps = math.nan, math.nan
        if out.routes is not None:  # generation's routing against the training forward's
            routing = self.cluster.routing_mismatch(policy, (prompts, lengths, out.tokens,
                                                             out.lengths, out.routes))
            gaps = route_gaps(out.routes, out.lengths)
        with timer.stage("reward"):
            tokens, gen_lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            rewards = self.rewards(examples, tokens, gen_lengths)
        return RolloutBatch(
            prompts=prompts, prompt_lengths=lengths, tokens=tokens, lengths=gen_lengths,
            gen_logprobs=np.asarray(out.logprobs), rewards=rewards,
            ended=self.ended(tokens, gen_lengths),
            version=np.int32(state.completed), step=np.int32(step), stats=out.stats,
            plain_time_s=np.float32(plain_time), replay_identical=np.float32(identical),
            routing_mismatch=np.float32(routing), routing_gaps=np.float32(gaps)).host()

    def compile(self, state: RunState) -> None:
        """Compile speculative (and, when compared, plain) generation on the real shapes, so
        step times and the speculative/plain ratio measure steady-state decoding."""
        if self._compiled:
            return
        _, prompts, lengths = self.prompts(state.completed)
        policy, drafter = self.sync_weights(*state.models, history=state.history,
                                            prompts=prompts, lengths=lengths)
        self.generate(policy, drafter, state.key, 0, prompts, lengths)
        if _speculates(drafter) and self.cfg.run.compare_plain:
            self.generate(policy, drafters_lib.NoDrafter(), state.key, 0, prompts, lengths)
        self._compiled = True
