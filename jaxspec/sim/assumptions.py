"""Every number the simulator needs that the paper does not give, in one place.

Each field carries a one-line justification (`why`) and, for the constants fitted to
the paper's own figures, the figures that determine it (`fit`). `describe()` lists them; the
same list is in docs/simulator.md. Change one with `dataclasses.replace(DEFAULT, ...)`,
or plug in measurements with `jaxspec.sim.calibrate`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Assumptions", "DEFAULT", "describe"]


def _a(value, why: str, fit: str = ""):
    return dataclasses.field(default=value, metadata={"why": why, "fit": fit})


@dataclasses.dataclass(frozen=True)
class Assumptions:
    # ---- how close kernels get to the datasheet -----------------------------------------
    hbm_efficiency: float = _a(
        0.85, "decode GEMV and paged-attention kernels stream weights/KV at ~80-90% of peak HBM bandwidth")
    gemm_efficiency: float = _a(
        0.60, "inference GEMMs at decode/verify sizes (M = a few hundred tokens) reach ~50-70% of BF16 peak")
    link_efficiency: float = _a(
        0.70, "NCCL bus bandwidth is ~70% of the NVLink / NIC line rate for MB-sized messages")
    collective_latency_s: float = _a(
        8e-6, "small-message all-reduce latency inside an NVLink domain (~5-10 us)")

    # ---- the inference engine (vLLM-like) ------------------------------------------------
    generation_memory_fraction: float = _a(
        0.80, "share of HBM the generation engine may use for weights + KV (vLLM gpu_memory_utilization)")
    max_num_seqs: int = _a(
        1024, "vLLM's default cap on concurrently running sequences per engine on H100-class GPUs")
    step_overhead_s: float = _a(
        0.65e-3, "host work per engine step under CUDA graphs: scheduling, input prep, sampling launch, detokenize",
        fit="plain generation times 100 s / 133.6 s (with the workloads' response lengths)")
    draft_step_overhead_s: float = _a(
        0.40e-3, "launch + argmax per draft forward (graph replay, no scheduler): a fraction of the target's",
        fit="EAGLE-3 k=3 speedups 1.77x / 1.54x and the 235B rollout speedups 2.72x / 3.5x")
    sampling_passes: float = _a(
        4.0, "fp32 logits per emitted/verified position are written and re-read ~4x (softmax, top-p, sample, logprob)")
    graph_capture_max_tokens: int | None = _a(
        512, "vLLM's default CUDA-graph capture limit min(2*max_num_seqs, 512) tokens; larger steps run eager "
        "(None: no limit, used for the 235B projections)")
    eager_overhead_per_layer_s: float = _a(
        0.70e-3, "CPU launch cost per layer when a step exceeds the captured graph sizes (eager / piecewise)",
        fit="the k-sweep: 1.44x / 1.21x (RL-Zero) and 0.84x / 0.71x (RL-Think) at k = 5 / 7")
    ngram_fixed_s: float = _a(
        1.1e-3, "n-gram proposer: per-step device->host sync of new tokens plus the CPU proposer call",
        fit="n-gram generation speedups 0.7x / 0.5x at acceptance 2.47 / 2.05")
    ngram_s_per_context_token: float = _a(
        100e-9, "n-gram proposer: CPU suffix match scans each running sequence's context every step",
        fit="n-gram generation speedups 0.7x / 0.5x at acceptance 2.47 / 2.05")

    # ---- the training side -----------------------------------------------------------------
    train_mfu_dense: float = _a(
        0.43, "Megatron GRPO training/logprob MFU for a dense 8B model on GB200 (sequence packing, bf16)",
        fit="8B step speedups 1.41x / 1.35x (generation 65-72% of a step) and the async 75 s / 60.5 s steps")
    train_mfu_moe: float = _a(
        0.114, "MoE training MFU is far lower (all-to-all, grouped GEMMs, small expert batches)",
        fit="235B end-to-end speedups 1.70x (512 GPUs, sync) and 2.5x (2048 GPUs, async)")
    train_flops_per_token_factor: float = _a(
        4.0, "forward + backward (3x) plus activation recomputation (1x) per trained token")
    logprob_forwards: int = _a(
        1, "the logprob stage recomputes the policy's log-probs; DAPO-style recipes drop the KL reference")
    setup_fixed_s: float = _a(
        4.0, "per-step weight refit into the generation engine: wake-up, KV re-allocation, cache reset")
    data_s: float = _a(
        1.0, "per-step prompt loading, tokenisation and reward computation (CPU, small)")

    def replace(self, **changes) -> "Assumptions":
        known = [f.name for f in dataclasses.fields(self)]
        unknown = set(changes) - set(known)
        if unknown:
            raise ValueError(f"unknown assumption(s) {sorted(unknown)}; known: {known}")
        return dataclasses.replace(self, **changes)


DEFAULT = Assumptions()


def describe(assumptions: Assumptions = DEFAULT) -> list[dict]:
    """[{name, value, why, fit}] for every assumption, in declaration order."""
    return [
        {"name": f.name, "value": getattr(assumptions, f.name), "why": f.metadata["why"], "fit": f.metadata["fit"]}
        for f in dataclasses.fields(assumptions)
    ]
