#!/usr/bin/env python
"""Plain vs speculative rollouts on the same prompts and key, per drafter and draft length.

    python scripts/bench_rollout.py --policy RUN/policy --eagle3 RUN/eagle3 --ks 1,2,3,4,5,6,7

The policy is a local HF directory (save_hf / any Qwen3 or Llama-3 checkpoint); the EAGLE-3
head a local directory in the vLLM/SGLang layout (save_eagle3). Prompts come from a built-in
task (held-out positions). Every configuration is compiled once, then timed `--repeats`
times (the minimum is kept); plain decoding is timed in the same run, so the table reports
ratios, not lone times. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import numpy as np

from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.drafters import DraftModelDrafter, Eagle3Drafter, MTPDrafter, NGramDrafter, TreeSpec
from jaxspec.decoding.engine import generate
from jaxspec.models import load_hf
from jaxspec.models.eagle3 import Eagle3Head, load_eagle3
from jaxspec.models.mtp import MTPHead
from jaxspec.rl.tasks import CharTokenizer, make_task

HELDOUT = 1_000_000  # task positions from here on are never used for training


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="local HF directory of the policy")
    p.add_argument("--eagle3", help="local EAGLE-3 head directory (vLLM/SGLang layout)")
    p.add_argument("--draft-model", help="local HF directory of a small draft model (same tokenizer)")
    p.add_argument("--drafters", default="eagle3,ngram", help="comma list of eagle3, eagle3_untrained (a fresh head over the same draft vocabulary: the control), eagle3_tree, ngram, draft_model, mtp_untrained")
    p.add_argument("--ks", default="1,2,3,4,5,6,7", help="draft lengths to sweep")
    p.add_argument("--tree", default="4,3,8", help="top_k,depth,budget for eagle3_tree")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--task-params", default="{}", help="JSON dict of task parameters")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--method", default="replay", choices=["replay", "greedy", "rejection"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_rollout.json", help="where to write the results")
    p.add_argument("--calibration-out", help="write the first drafter's k=3 acceptance as a "
                   "calibration file for scripts/simulate.py --calibration")
    return p.parse_args(argv)


def _time(fn, repeats):
    out = fn()  # compile + warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def main(argv=None) -> int:
    args = _parse(argv)
    ks = [int(k) for k in args.ks.split(",") if k]
    names = [d for d in args.drafters.split(",") if d]
    valid = {"eagle3", "eagle3_untrained", "eagle3_tree", "ngram", "draft_model", "mtp_untrained"}
    unknown = sorted(set(names) - valid)
    if unknown:
        raise SystemExit(f"--drafters {unknown} unknown; valid: {sorted(valid)}")
    if any(k < 1 for k in ks):
        raise SystemExit(f"--ks must be >= 1; got {ks}")
    if ({"eagle3", "eagle3_tree", "eagle3_untrained"} & set(names)) and not args.eagle3:
        raise SystemExit("--drafters eagle3/eagle3_tree/eagle3_untrained need --eagle3 DIR")
    if "draft_model" in names and not args.draft_model:
        raise SystemExit("--drafters draft_model needs --draft-model DIR")

    policy = load_hf(args.policy)
    tok = CharTokenizer()
    task = make_task(args.task, seed=args.seed, **json.loads(args.task_params))
    prompts = [tok.encode(ex.prompt, bos=True) for ex in task.batch(HELDOUT, args.num_prompts)]
    sampling = SamplingConfig(temperature=args.temperature)
    key = jax.random.key(args.seed)
    common = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, key=key,
                  stop_tokens=(tok.eos_id,), method=args.method)

    plain, plain_s = _time(lambda: generate(policy, prompts, **{**common, "method": "replay" if args.method == "rejection" else args.method}), args.repeats)
    tokens = int(np.sum(plain.lengths))
    rows = []
    head = load_eagle3(args.eagle3) if args.eagle3 else None
    small = load_hf(args.draft_model) if args.draft_model else None
    for name in names:
        for k in ks if name != "eagle3_tree" else [None]:
            if name == "eagle3":
                drafter = Eagle3Drafter(head, k=k)
            elif name == "eagle3_untrained":
                fresh = Eagle3Head.init_for(policy, head.config.draft_vocab_size, jax.random.key(7),
                                            capture_layers=head.capture_layers)
                drafter = Eagle3Drafter(fresh.with_vocab(np.asarray(head.draft_to_target())), k=k)
            elif name == "eagle3_tree":
                top_k, depth, budget = (int(x) for x in args.tree.split(","))
                drafter = Eagle3Drafter(head, tree=TreeSpec(top_k=top_k, depth=depth, budget=budget))
            elif name == "ngram":
                drafter = NGramDrafter(k=k, min_n=1, max_n=3)
            elif name == "draft_model":
                drafter = DraftModelDrafter(small, k=k)
            else:
                drafter = MTPDrafter(MTPHead.init_for(policy, jax.random.key(1)), k=k)
            spec, spec_s = _time(lambda: generate(policy, prompts, drafter=drafter, **common), args.repeats)
            same = bool(np.array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens)))
            rows.append(dict(
                drafter=name, k=k if k is not None else args.tree,
                acceptance_length=spec.stats.acceptance_length,
                per_position_acceptance=[round(x, 4) for x in spec.stats.per_position_acceptance.tolist()],
                target_forwards=int(spec.stats.target_forwards),
                spec_s=spec_s, plain_s=plain_s, speedup=plain_s / spec_s,
                tokens_equal_plain=same,
            ))
            r = rows[-1]
            print(f"{name:>14} k={str(r['k']):>6}  acc_len {r['acceptance_length']:.2f}  "
                  f"spec {spec_s * 1e3:8.1f} ms  plain {plain_s * 1e3:8.1f} ms  "
                  f"speedup {r['speedup']:.2f}x  same-as-plain {same}", flush=True)

    result = dict(
        machine=f"{platform.machine()} {platform.processor() or ''} / {jax.devices()[0].device_kind}",
        backend=jax.default_backend(), policy=args.policy, eagle3=args.eagle3,
        num_prompts=len(prompts), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        method=args.method, plain_tokens=tokens, plain_s=plain_s, rows=rows,
    )
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    if args.calibration_out:
        pick = [r for r in rows if r["drafter"] == names[0] and r["k"] == 3] or rows[:1]
        if pick:
            r = pick[0]
            calib = dict(k=r["k"], acceptance_length=r["acceptance_length"],
                         per_position_acceptance=r["per_position_acceptance"], source=args.json)
            with open(args.calibration_out, "w") as f:
                json.dump(calib, f, indent=2)
            print(f"wrote {args.calibration_out} ({names[0]} at k={r['k']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
