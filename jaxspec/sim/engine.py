"""One generation engine: roofline step times and batch generation with a long tail.

A forward over `tokens` tokens (n sequences x q tokens each) on a TP group costs

    max(bytes / (HBM BW * eff), FLOPs / (peak * eff)) + collectives + host overhead
    (+ eager launch cost when the step is larger than the captured CUDA graphs)

with bytes = weights touched + KV cache read once + fp32 logits traffic. Decode is
q = 1; verifying a chain of k drafts is q = k + 1 over the *same* weights and KV, so
while memory-bound it costs barely more than a decode step. Draft cost is the draft's
own forward(s) (EAGLE-3 / MTP / draft model) or the CPU proposer (n-gram).

Generation of a batch is simulated event by event: sequences start at their prompt,
advance `acceptance_length` tokens per step, and leave when done; each step's cost
depends on how many are still running and how long their contexts are. The engine
that holds the batch's longest rollout finishes last (the straggler tail).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxspec.sim.assumptions import Assumptions
from jaxspec.sim.hardware import GPU
from jaxspec.sim.models import ModelShape, eagle3_head, get_model, mtp_head

__all__ = [
    "Drafter", "DRAFTER_KINDS", "EngineLayout", "forward_time", "StepCost", "generation_time", "engine_concurrency",
]

DRAFTER_KINDS = ("none", "eagle3", "mtp", "draft_model", "ngram")


@dataclasses.dataclass(frozen=True)
class Drafter:
    """How drafts are made: `kind` in DRAFTER_KINDS, draft depth `k`, and for a
    `draft_model` the small model's preset name.

    `tree_tokens` = N > 0 drafts a tree of N nodes (depth k, each draft pass expanding
    `tree_width` frontier nodes) verified in one forward of N + 1 tokens; 0 is a chain
    (N = k). A tree's acceptance must be given as a measured acceptance length.
    """

    kind: str = "none"
    k: int = 0
    draft_model: str = "Qwen3-0.6B"
    tree_tokens: int = 0
    tree_width: int = 10

    def __post_init__(self):
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"unknown drafter {self.kind!r}; known: {DRAFTER_KINDS}")
        if self.kind == "none" and self.k != 0:
            raise ValueError("plain decoding has no draft length: use k=0 with kind='none'")
        if self.kind != "none" and self.k < 1:
            raise ValueError(f"drafter {self.kind!r} needs k >= 1, got {self.k}")
        if self.tree_tokens and (self.tree_tokens < self.k or self.kind in ("none", "ngram")):
            raise ValueError(f"a draft tree needs a model drafter and tree_tokens >= k; got {self.kind!r}, "
                             f"tree_tokens={self.tree_tokens}, k={self.k}")

    @property
    def verified_tokens(self) -> int:
        """Draft tokens fed to one verify forward (besides the root): N for a tree, k for a chain."""
        return self.tree_tokens or self.k

    @property
    def speculative(self) -> bool:
        return self.kind != "none"

    def shape(self, target: ModelShape) -> ModelShape | None:
        """The draft network's shape, or None (plain decoding, n-gram lookup)."""
        if self.kind == "eagle3":
            return eagle3_head(target)
        if self.kind == "mtp":
            return mtp_head(target)
        if self.kind == "draft_model":
            return get_model(self.draft_model)
        return None


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """A generation engine: `tp` GPUs holding one copy of the weights (tensor parallel for
    dense layers; experts spread over the same GPUs, i.e. expert parallel = tp)."""

    gpu: GPU
    tp: int

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    @staticmethod
    def default_tp(model: ModelShape, gpu: GPU, a: Assumptions) -> int:
        """Smallest power-of-two TP at which the weights use at most half the engine's memory."""
        tp = 1
        while model.total_params * model.bytes_per_param / tp > 0.5 * gpu.hbm_bytes * a.generation_memory_fraction:
            tp *= 2
        return tp

    def kv_capacity_tokens(self, model: ModelShape, draft: ModelShape | None, a: Assumptions) -> float:
        """Tokens of context the engine's KV cache holds after weights (target + draft)."""
        weights = model.total_params * model.bytes_per_param
        kv_per_token = model.kv_bytes_per_token / min(self.tp, model.num_kv_heads) * self.tp
        if draft is not None:
            weights += draft.total_params * draft.bytes_per_param
            kv_per_token += draft.kv_bytes_per_token / min(self.tp, draft.num_kv_heads) * self.tp
        free = self.tp * self.gpu.hbm_bytes * a.generation_memory_fraction - weights
        if free <= 0:
            raise ValueError(
                f"{model.name} does not fit on {self.tp} x {self.gpu.name} "
                f"({weights / 1e9:.0f} GB of weights); use a larger tp"
            )
        return free / kv_per_token


def _allreduce_time(layout: EngineLayout, a: Assumptions, nbytes: float) -> float:
    """One all-reduce of `nbytes` per GPU inside the engine.

    Inside an NVLink domain NCCL's NVLS algorithm reduces in the switch, so each GPU sends
    and receives its buffer about once; across the network a ring moves 2(tp-1)/tp of it.
    """
    tp = layout.tp
    if tp == 1:
        return 0.0
    if tp <= layout.gpu.nvlink_domain:
        return a.collective_latency_s + nbytes / (layout.gpu.nvlink_bandwidth * a.link_efficiency)
    return a.collective_latency_s + 2.0 * (tp - 1) / tp * nbytes / (layout.gpu.scaleout_bandwidth * a.link_efficiency)


def forward_time(
    model: ModelShape,
    layout: EngineLayout,
    a: Assumptions,
    *,
    num_seqs: float,
    tokens_per_seq: float,
    context_sum: float,
    overhead_s: float,
) -> float:
    """Seconds for one forward of `num_seqs` sequences x `tokens_per_seq` new tokens whose
    cached contexts sum to `context_sum` tokens (roofline + collectives + host overhead).

    Steps of more than `graph_capture_max_tokens` tokens have no captured CUDA graph and
    pay the eager launch cost.
    """
    tp = layout.tp
    gpu = layout.gpu
    tokens = num_seqs * tokens_per_seq
    kv_shards = min(tp, model.num_kv_heads)
    vocab = model.lm_head_vocab or model.vocab_size
    weight_bytes = model.weight_bytes_read(tokens) / tp
    kv_bytes = context_sum * model.kv_bytes_per_token / kv_shards
    logits_bytes = tokens * vocab * 4.0 * a.sampling_passes if model.has_lm_head else 0.0
    memory_s = (weight_bytes + kv_bytes + logits_bytes) / (gpu.hbm_bandwidth * a.hbm_efficiency)
    # each new token attends to its sequence's cached context (plus the few new tokens)
    flops = model.forward_flops(tokens, tokens_per_seq * context_sum) / tp
    compute_s = flops / (gpu.peak_bf16_flops * a.gemm_efficiency)
    # tensor parallel: all-reduce after attention and after the MLP / MoE block (experts
    # are spread over the same GPUs, each computes its local experts for every token)
    comm_s = model.num_layers * 2 * _allreduce_time(layout, a, tokens * model.hidden_size * 2.0)
    graphed = a.graph_capture_max_tokens is None or tokens <= a.graph_capture_max_tokens
    eager_s = 0.0 if graphed else model.num_layers * a.eager_overhead_per_layer_s
    return max(memory_s, compute_s) + comm_s + overhead_s + eager_s


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Cost of one engine step as a function of the running batch.

    `verify_decode_cost_ratio` (measured with `measured_k` draft tokens) replaces the
    roofline's verify/decode ratio when given: verify = decode * (1 + (r - 1) n / k_meas)
    for n verified draft tokens.
    """

    model: ModelShape
    layout: EngineLayout
    drafter: Drafter
    a: Assumptions
    verify_decode_cost_ratio: float | None = None
    measured_k: int = 3

    def decode(self, num_seqs: float, context_sum: float) -> float:
        return forward_time(self.model, self.layout, self.a, num_seqs=num_seqs, tokens_per_seq=1,
                            context_sum=context_sum, overhead_s=self.a.step_overhead_s)

    def verify(self, num_seqs: float, context_sum: float) -> float:
        n = self.drafter.verified_tokens
        if self.verify_decode_cost_ratio is not None:
            scale = 1.0 + (self.verify_decode_cost_ratio - 1.0) * n / self.measured_k
            return self.decode(num_seqs, context_sum) * scale
        return forward_time(self.model, self.layout, self.a, num_seqs=num_seqs, tokens_per_seq=n + 1,
                            context_sum=context_sum, overhead_s=self.a.step_overhead_s)

    def draft(self, num_seqs: float, context_sum: float) -> float:
        """Proposing k tokens for every running sequence."""
        k = self.drafter.k
        if self.drafter.kind == "ngram":
            return self.a.ngram_fixed_s + self.a.ngram_s_per_context_token * context_sum
        shape = self.drafter.shape(self.model)
        if shape is None:
            return 0.0
        # pass 1 consumes the verified tokens (up to k+1 per sequence) and proposes depth 1;
        # passes 2..k feed back one token each (chain) or the tree's frontier
        width = min(self.drafter.tree_width, self.drafter.tree_tokens) if self.drafter.tree_tokens else 1
        kw = dict(context_sum=context_sum, overhead_s=self.a.draft_step_overhead_s)
        first = forward_time(shape, self.layout, self.a, num_seqs=num_seqs, tokens_per_seq=k + 1, **kw)
        rest = forward_time(shape, self.layout, self.a, num_seqs=num_seqs, tokens_per_seq=width, **kw)
        return first + (k - 1) * rest

    def step(self, num_seqs: float, context_sum: float) -> float:
        """One engine step: a decode, or draft + verify."""
        if not self.drafter.speculative:
            return self.decode(num_seqs, context_sum)
        return self.draft(num_seqs, context_sum) + self.verify(num_seqs, context_sum)

    def prefill(self, num_seqs: float, prompt_tokens: float) -> float:
        if num_seqs <= 0:
            return 0.0
        return forward_time(self.model, self.layout, self.a, num_seqs=num_seqs, tokens_per_seq=prompt_tokens,
                            context_sum=num_seqs * prompt_tokens / 2, overhead_s=self.a.step_overhead_s)


def generation_time(
    cost: StepCost,
    lengths,  # [n] response tokens of the rollouts this engine generates
    *,
    prompt_tokens: float,
    tokens_per_step: float,
    concurrency: int,
) -> float:
    """Seconds until the engine has generated every rollout in `lengths`.

    Continuous batching: up to `concurrency` sequences run; a finished one is replaced
    by the next waiting one (after its prefill). Every running sequence advances
    `tokens_per_step` tokens per step (1 for plain decoding, the acceptance length for
    speculative decoding). Between completions the batch is fixed and its context grows
    linearly, so each such phase is integrated with Simpson's rule.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # Submission order: the longest rollout first (a straggler that also waited for a free
    # slot would make the result jump with the concurrency), then the rest in a
    # low-discrepancy interleaving, so any set left waiting spans the whole distribution.
    ranked = np.sort(lengths)
    rest = ranked[:-1][np.argsort((np.arange(len(ranked) - 1) * 0.6180339887498949) % 1.0)]
    waiting = list(np.concatenate([ranked[-1:], rest])[::-1])  # pop() takes from the end
    remaining = np.empty(0)  # [running]
    context = np.empty(0)  # [running]
    t = 0.0
    while waiting or remaining.size:
        admit = min(concurrency - remaining.size, len(waiting))
        if admit > 0:
            new = np.array([waiting.pop() for _ in range(admit)])
            remaining = np.concatenate([remaining, new])
            context = np.concatenate([context, np.full(admit, float(prompt_tokens))])
            t += cost.prefill(admit, prompt_tokens)
        n = remaining.size
        steps = remaining.min() / tokens_per_step
        c0 = context.sum()
        c1 = c0 + n * tokens_per_step * steps
        t += steps * (cost.step(n, c0) + 4.0 * cost.step(n, 0.5 * (c0 + c1)) + cost.step(n, c1)) / 6.0
        remaining = remaining - tokens_per_step * steps
        context = context + tokens_per_step * steps
        keep = remaining > 1e-9
        remaining, context = remaining[keep], context[keep]
    return t


def engine_concurrency(layout: EngineLayout, model: ModelShape, draft: ModelShape | None, a: Assumptions,
                       *, rollouts: int, mean_sequence_tokens: float) -> int:
    """Sequences an engine runs at once: all its rollouts, capped by max_num_seqs and by
    how many average-length sequences its KV cache holds."""
    by_kv = math.floor(layout.kv_capacity_tokens(model, draft, a) / mean_sequence_tokens)
    return max(1, min(rollouts, a.max_num_seqs, by_kv))
