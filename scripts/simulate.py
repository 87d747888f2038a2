#!/usr/bin/env python
"""Plan speculative rollouts before buying GPU time: a k sweep for a model, cluster and drafter.

    python scripts/simulate.py --model Qwen3-8B --gpu GB200 --num-gpus 32 --workload rl-think
    python scripts/simulate.py --model Qwen3-235B-A22B --num-gpus 2048 --workload rl-235b \\
        --acceptance 3.0 --async-lag 2 --graph-capture-max-tokens none
    python scripts/simulate.py --calibration bench.json ...   # measured costs / acceptance
    python scripts/simulate.py --paper                        # every paper figure vs ours
    python scripts/simulate.py --assumptions                  # what the simulator assumes

Prints the speedup at each draft length, the best k, and why longer drafts backfire.
Pure Python + numpy: no JAX, no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxspec.sim import (
    DRAFTER_KINDS,
    GPUS,
    MODELS,
    WORKLOADS,
    Acceptance,
    Cluster,
    Drafter,
    Scenario,
    calibrate,
    describe,
    get_gpu,
    get_model,
    get_workload,
    k_sweep,
    simulate_step,
)
from jaxspec.sim.report import describe_setup, explain_sweep, sweep_table


def _acceptance(text: str | None, k_ref: int) -> Acceptance | None:
    """'2.5' = acceptance length at k_ref; '0.8,0.6,0.45' = per-position (marginal) rates."""
    if text is None:
        return None
    parts = [float(x) for x in text.split(",") if x.strip()]
    if len(parts) == 1 and parts[0] >= 1.0:
        return Acceptance.from_length(parts[0], k_ref)
    return Acceptance.from_marginal(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen3-8B", choices=sorted(MODELS))
    p.add_argument("--gpu", default="GB200", type=str.upper, choices=sorted(GPUS))
    p.add_argument("--num-gpus", type=int, default=32)
    p.add_argument("--workload", default="rl-think", choices=sorted(WORKLOADS))
    p.add_argument("--prompts-per-step", type=int, help="override the workload's batch (prompts; x its samples)")
    p.add_argument("--drafter", default="eagle3", choices=[d for d in DRAFTER_KINDS if d != "none"])
    p.add_argument("--draft-model", default="Qwen3-0.6B", help="preset for --drafter draft_model")
    p.add_argument("--tree-tokens", type=int, default=0,
                   help="draft a tree of N nodes (k = its depth) instead of a chain; give its measured --acceptance")
    p.add_argument("--acceptance", help="acceptance length at --acceptance-k (e.g. 3.0), or per-position "
                   "marginal rates (e.g. 0.8,0.6,0.45); default: the workload's profile for the drafter")
    p.add_argument("--acceptance-k", type=int, default=3, help="draft length the --acceptance length refers to")
    p.add_argument("--async-lag", type=int, default=0, help="policy lag; 0 = synchronous RL")
    p.add_argument("--generation-gpus", type=int, help="async: GPUs that generate (default: best split)")
    p.add_argument("--baseline", choices=["same", "sync"], default="same",
                   help="speedups against the same pipeline without speculation (same), or against synchronous "
                   "plain decoding on all GPUs (sync: how the paper states its async projection)")
    p.add_argument("--tp", type=int, help="GPUs per generation engine (default: smallest that fits)")
    p.add_argument("--k-max", type=int, default=7)
    p.add_argument("--graph-capture-max-tokens", default=None,
                   help="largest captured CUDA-graph step in tokens, or 'none' for no limit (default: the assumption)")
    p.add_argument("--calibration", help="JSON with measured verify_decode_cost_ratio / acceptance_length / "
                   "per_position_acceptance (and optionally any assumption name)")
    p.add_argument("--paper", action="store_true", help="print every paper figure next to the simulator's")
    p.add_argument("--assumptions", action="store_true", help="print the named assumptions and exit")
    return p


def print_paper() -> None:
    from jaxspec.sim.paper import reproduce

    print(f"{'figure':62s} {'paper':>8s} {'sim':>8s} {'error':>7s}")
    for fig, value in reproduce():
        tag = "" if fig.measured else "  (authors' projection)"
        error = 100 * (value / fig.paper - 1)
        print(f"{fig.what:62s} {fig.paper:7.2f}{fig.unit} {value:7.2f}{fig.unit} {error:+6.1f}%{tag}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.assumptions:
        for item in describe():
            fit = f"  [fit: {item['fit']}]" if item["fit"] else ""
            print(f"{item['name']} = {item['value']}: {item['why']}{fit}")
        return 0
    if args.paper:
        print_paper()
        return 0

    workload = get_workload(args.workload)
    if args.prompts_per_step:
        workload = dataclasses.replace(workload, prompts_per_step=args.prompts_per_step)
    scenario = Scenario(
        get_model(args.model), Cluster(get_gpu(args.gpu), args.num_gpus), workload,
        Drafter(args.drafter, 1, args.draft_model, tree_tokens=args.tree_tokens),
        acceptance=_acceptance(args.acceptance, args.acceptance_k), tp=args.tp, policy_lag=args.async_lag,
        generation_gpus=args.generation_gpus,
    )
    if args.graph_capture_max_tokens is not None:
        limit = None if args.graph_capture_max_tokens.lower() == "none" else int(args.graph_capture_max_tokens)
        assumptions = scenario.assumptions.replace(graph_capture_max_tokens=limit)
        scenario = dataclasses.replace(scenario, assumptions=assumptions)
    if args.calibration:
        scenario, used = calibrate(scenario, args.calibration)
        print(f"calibrated from {args.calibration}: {', '.join(used) if used else 'no known fields'}")
    if scenario.acceptance is None and args.drafter not in workload.acceptance:
        print(f"workload {workload.name} has no {args.drafter} acceptance profile: pass --acceptance", file=sys.stderr)
        return 2

    plain = simulate_step(scenario.plain())
    for line in describe_setup(scenario, plain):
        print(line)
    print(f"drafter {args.drafter}; conditional acceptance per position: "
          + " ".join(f"{scenario.acceptance_profile.rate(i):.2f}" for i in range(1, args.k_max + 1))
          + (f"; tree of {args.tree_tokens} nodes, k = its depth" if args.tree_tokens else ""))
    print()
    baseline = None
    if args.baseline == "sync":
        baseline = dataclasses.replace(scenario.plain(), policy_lag=0, generation_gpus=None)
    k_max = min(args.k_max, args.tree_tokens) if args.tree_tokens else args.k_max
    rows = k_sweep(scenario.with_k(1), range(1, k_max + 1), baseline)
    for line in sweep_table(rows, show_split=scenario.policy_lag >= 1):
        print(line)
    print("(verify/decode, draft/decode: cost at the engine's typical batch; step_cost = their sum in decode steps)")
    if scenario.policy_lag >= 1:
        print("(async: each k on its own best generation/training split unless --generation-gpus; gen_x compares "
              "plain and speculative generation on that split)")
    if baseline is not None:
        print("(step_x against synchronous plain decoding on all GPUs)")
    print()
    for line in explain_sweep(scenario, rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
