"""Text for scripts/simulate.py: the k-sweep table and why long drafts stop paying."""

from __future__ import annotations

from jaxspec.sim.acceptance import Acceptance
from jaxspec.sim.pipeline import Scenario, StepResult, SweepRow

__all__ = ["best_row", "sweep_table", "explain_sweep", "describe_setup"]


def best_row(rows: list[SweepRow]) -> SweepRow:
    """The row with the best step speedup (what an RL run pays for)."""
    return max(rows, key=lambda r: r.step_speedup)


def describe_setup(s: Scenario, plain: StepResult) -> list[str]:
    mode = "sync RL" if s.policy_lag == 0 else f"async RL, policy lag {s.policy_lag}"
    lines = [
        f"{s.model.name} on {s.cluster.num_gpus} x {s.cluster.gpu.name}, workload {s.workload.name} "
        f"({s.workload.rollouts} rollouts/step), {mode}",
        f"generation: {plain.generation_gpus} GPUs = {plain.engines} engines of tp={s.engine_tp}, "
        f"{plain.rollouts_per_engine} rollouts each, {plain.concurrency} running at once",
        f"plain decoding: generation {plain.generation_s:.1f} s, step {plain.step_s:.1f} s "
        f"(generation on the critical path {100 * plain.generation_share:.0f}%)",
    ]
    if s.policy_lag >= 1:
        lines.append(f"training side: {s.cluster.num_gpus - plain.generation_gpus} GPUs, "
                     f"logprob {plain.logprob_s:.1f} s + training {plain.training_s:.1f} s")
    return lines


def sweep_table(rows: list[SweepRow], *, show_split: bool = False) -> list[str]:
    """One line per k; `show_split` adds the generation GPUs (async: each k's own split)."""
    head = " k  accept_len  verify/decode  draft/decode  step_cost  tokens/cost" + ("  gen_gpus" if show_split else "")
    lines = [head + "   gen_s   gen_x  step_x"]
    for r in rows:
        split = f"  {r.generation_gpus:8d}" if show_split else ""
        lines.append(
            f"{r.k:2d}  {r.acceptance_length:10.2f}  {r.verify_over_decode:13.2f}  {r.draft_over_decode:12.2f}  "
            f"{r.step_cost_over_decode:9.2f}  {r.acceptance_length / r.step_cost_over_decode:11.2f}{split}  "
            f"{r.generation_s:6.1f}  {r.generation_speedup:5.2f}x  {r.step_speedup:5.2f}x"
        )
    return lines


def explain_sweep(s: Scenario, rows: list[SweepRow]) -> list[str]:
    """Why the best k is where it is, from the sweep's own numbers.

    A chain of k drafts emits L(k) = 1 + m_1 + ... + m_k tokens per verify (m_i: chance
    the first i drafts are all accepted), which saturates; a speculative step costs
    c(k) decode steps (k draft forwards + a verify of k+1 tokens), which keeps growing.
    Going from k to k+1 pays only if m_{k+1} / L(k) > (c(k+1) - c(k)) / c(k).
    """
    profile = s.acceptance_profile
    if profile is None:
        raise ValueError("explain_sweep needs a speculative scenario")
    best = best_row(rows)
    last = rows[-1]
    k_max = last.k
    marginal = profile.marginal(k_max)
    lines = [f"best k = {best.k}: generation {best.generation_speedup:.2f}x, step {best.step_speedup:.2f}x "
             f"(acceptance length {best.acceptance_length:.2f})"]
    if best.step_speedup < 1.0:
        lines.append(
            f"no draft length pays: even at k={best.k} a speculative step costs {best.step_cost_over_decode:.2f} "
            f"decode steps for {best.acceptance_length:.2f} tokens; plain decoding is faster"
        )

    # saturation: the constant rate with the same length at the best k, and its ceiling
    a = Acceptance.from_length(best.acceptance_length, best.k).rates[0] if best.k >= 1 else 0.0
    ceiling = 1.0 / (1.0 - a) if a < 1 else float("inf")
    lines.append(
        f"accepted tokens saturate: with a constant per-position rate a = {a:.2f} (same length at k={best.k}) "
        f"L(k) = (1 - a^(k+1)) / (1 - a) can never exceed 1/(1-a) = {ceiling:.2f}; this draft's "
        f"per-position acceptance m_i = " + ", ".join(f"{x:.2f}" for x in marginal)
    )
    if last.k > best.k:
        dl = last.acceptance_length / best.acceptance_length - 1.0
        dc = last.step_cost_over_decode / best.step_cost_over_decode - 1.0
        verify_growth = last.verify_over_decode - best.verify_over_decode
        draft_growth = last.draft_over_decode - best.draft_over_decode
        lines.append(
            f"k={best.k} -> k={k_max}: tokens per verify +{100 * dl:.0f}% "
            f"({best.acceptance_length:.2f} -> {last.acceptance_length:.2f}) but the cost of a speculative step "
            f"+{100 * dc:.0f}% ({best.step_cost_over_decode:.2f} -> {last.step_cost_over_decode:.2f} decode steps: "
            f"draft +{draft_growth:.2f}, verify +{verify_growth:.2f})"
        )
        limit = s.assumptions.graph_capture_max_tokens
        over = [r for r in rows if limit is not None and r.verify_tokens > limit]
        if over:
            lines.append(
                f"from k={over[0].k} a verify feeds {over[0].verify_tokens} tokens (> {limit}, the largest captured "
                f"CUDA graph): those steps run eager and pay the launch overhead on every layer"
            )
    for prev, nxt in zip(rows, rows[1:]):
        gain = marginal[nxt.k - 1] / prev.acceptance_length
        cost = nxt.step_cost_over_decode / prev.step_cost_over_decode - 1.0
        if gain <= cost:
            lines.append(
                f"draft {nxt.k} stops paying: it is accepted {100 * marginal[nxt.k - 1]:.0f}% of the time, "
                f"+{100 * gain:.1f}% tokens per verify, for +{100 * cost:.1f}% cost per step "
                f"(at the engine's typical batch)"
            )
            break
    else:
        lines.append(f"every extra draft up to k={k_max} still pays at the engine's typical batch")
    return lines
