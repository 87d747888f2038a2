#!/usr/bin/env python
"""Group-aware drafting over epochs of the same prompts: acceptance length and generation
speedup per step for history, EAGLE-3, hybrid and n-gram drafts (issue 15).

    python scripts/bench_history.py --policy RUN/policy --eagle3 RUN/eagle3 --epochs 3

A fixed set of `--dataset` prompts of the long task (held-out positions) is visited in
steps of `--prompts` prompts x `--group` samples, as GRPO visits its data; every epoch sees
the same prompts with a new key (new rollouts). The policy is fixed (no GRPO update in
between: this isolates drafting). After each step the plain rollouts go into the history
store, as the trainer does, so the history drafter sees the earlier epochs' rollouts of its
prompt plus its in-flight siblings. Every generation uses replay, so all drafters emit the
plain rollout token for token (checked). Timing: per step, plain and each drafter are timed
alternately for `--rounds` rounds (order rotated per round); speedup = median of the
same-round plain/drafter ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from jaxspec.host import keep_freed_memory
from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.drafters import Eagle3Drafter, NGramDrafter
from jaxspec.decoding import engine
from jaxspec.decoding.engine import pad_prompts
from jaxspec.decoding.history import HistoryDrafter, HistoryStore, HybridDrafter, prompt_key
from jaxspec.models import load_hf
from jaxspec.models.eagle3 import load_eagle3
from jaxspec.rl.rollouts import leaders_first
from jaxspec.rl.tasks import make_task
from jaxspec.timing import interleaved, machine

HELDOUT = 1_000_000
NAMES = ("history", "eagle3", "hybrid", "ngram")


def _parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="local HF directory of the policy")
    p.add_argument("--eagle3", required=True, help="local EAGLE-3 head directory")
    p.add_argument("--task", default="worked_addition")
    p.add_argument("--task-params", default='{"max_digits": 8}')
    p.add_argument("--dataset", type=int, default=8, help="distinct prompts (one epoch)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=88)
    p.add_argument("--k", type=int, default=3, help="draft length of every drafter")
    p.add_argument("--history-k", type=int, default=None,
                   help="draft depth of the history trie (default: --k)")
    p.add_argument("--history-budget", type=int, default=4, help="history tree nodes")
    p.add_argument("--hybrid-budget", type=int, default=5, help="hybrid tree nodes")
    p.add_argument("--per-prompt", type=int, default=4, help="stored rollouts per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=None,
                   help="rows decoded at once (continuous batching; the rollouts start "
                        "leaders first, as the trainer starts them); default: all")
    p.add_argument("--argmax", action="store_true",
                   help="EAGLE-3 drafts its argmax (draft.coupled: false) instead of drawing "
                        "with the verifier's noise")
    p.add_argument("--iteration-costs", action="store_true",
                   help="instead of the epochs: the time of one loop iteration of each drafter "
                        "(and plain) on the first step's prompts, without stored history: "
                        "(time of 60 iterations - time of 20) / 40, rounds interleaved")
    p.add_argument("--ungated", action="store_true",
                   help="also time the hybrid without its head gate (HybridDrafter(gate=False): "
                        "the head drafts at every iteration), as 'hybrid_ungated'")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_history.json")
    return p.parse_args(argv)


def main(argv=None):
    args = _parse(argv)
    keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call (jaxspec.host)
    policy = load_hf(args.policy)
    head = load_eagle3(args.eagle3, target_num_layers=policy.config.num_layers)
    task = make_task(args.task, seed=args.seed, **json.loads(args.task_params))
    tok = task.tokenizer
    texts = [ex.prompt for ex in task.batch(HELDOUT, args.dataset)]
    encoded = [tok.encode_prompt(t) for t in texts]
    width = max(len(e) for e in encoded)
    g, n = args.group, args.prompts
    steps_per_epoch = args.dataset // n
    store = HistoryStore.empty(args.dataset, args.per_prompt, width + args.max_new_tokens)
    sampling = SamplingConfig(temperature=args.temperature)
    key = jax.random.key(args.seed)
    stops = tuple(tok.eos_ids)
    settings = dict(k=args.history_k or args.k, min_n=1, max_n=4, max_matches=8)

    def drafters(batch_prompts):
        keys = [prompt_key(p) for p in batch_prompts]
        groups = np.arange(len(batch_prompts)) // g
        hist = HistoryDrafter.for_batch(groups, store=store, prompt_keys=keys,
                                        budget=args.history_budget, **settings)
        hist_h = HistoryDrafter.for_batch(groups, store=store, prompt_keys=keys,
                                          budget=args.hybrid_budget, **settings)
        chain = Eagle3Drafter(head, k=args.k, coupled=not args.argmax)
        out = {"history": hist, "eagle3": chain,
               "hybrid": HybridDrafter(hist_h, chain, budget=args.hybrid_budget),
               "ngram": NGramDrafter(k=args.k, min_n=1, max_n=3), "plain": None}
        if args.ungated:
            out["hybrid_ungated"] = HybridDrafter(hist_h, chain, budget=args.hybrid_budget,
                                                  gate=False)
        return out

    refill = args.slots is not None and args.slots < n * g
    start_order = leaders_first(n, g) if refill else None

    def run(drafter, batch_prompts, step_key, rows, iterations=None):
        return engine.generate(policy, pad_prompts(batch_prompts, tok.pad_id), drafter=drafter,
                                sampling=sampling, max_new_tokens=args.max_new_tokens,
                                key=step_key, stop_tokens=stops, rows=rows, pad_id=tok.pad_id,
                                slots=args.slots, order=start_order, max_iterations=iterations)

    if args.iteration_costs:
        _iteration_costs(args, run, drafters, [e for e in encoded[:n] for _ in range(g)], key)
        return

    # compile every drafter on the real shapes (a key never used below)
    first = [e for e in encoded[:n] for _ in range(g)]
    for d in drafters(first).values():
        run(d, first, jax.random.key(10**6), np.arange(len(first), dtype=np.int32))

    names = NAMES + (("hybrid_ungated",) if args.ungated else ())
    out = []
    print(f"{'epoch':>5} {'step':>4} {'len':>5} " + " ".join(f"{x + ' tau':>11} {x + ' x':>9}"
                                                          for x in names))
    for epoch in range(args.epochs):
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            batch_prompts = [e for e in encoded[s * n:(s + 1) * n] for _ in range(g)]
            rows = (np.arange(len(batch_prompts)) + step * len(batch_prompts)).astype(np.int32)
            step_key = jax.random.fold_in(key, step)
            ds = drafters(batch_prompts)
            order = list(ds)
            times = {name: [] for name in order}
            results = {}
            for r in range(args.rounds):
                rot = order[r % len(order):] + order[:r % len(order)]
                for name in rot:
                    start = time.perf_counter()
                    res = run(ds[name], batch_prompts, step_key, rows)
                    jax.block_until_ready(res)
                    times[name].append(time.perf_counter() - start)
                    results[name] = res
            plain = results["plain"]
            row = {"epoch": epoch, "step": step,
                   "mean_length": float(np.mean(np.asarray(plain.lengths)))}
            for name in names:
                res = results[name]
                same = bool(np.array_equal(np.asarray(res.tokens), np.asarray(plain.tokens)))
                row[name] = {
                    "acceptance_length": res.stats.acceptance_length,
                    "speedup": float(statistics.median(
                        a / b for a, b in zip(times["plain"], times[name]))),
                    "time_s": float(statistics.median(times[name])),
                    "equals_plain": same,
                }
            src = {k: int(v) for k, v in results["hybrid"].draft_stats.items()}
            src["head_skipped"] = int(results["hybrid"].stats.target_forwards) - src["head_drafted"]
            # drafts by source (history only, head only, both); proposals with/without the head
            row["hybrid"]["accepted_by_source"] = src
            row["plain_time_s"] = float(statistics.median(times["plain"]))
            row["history_rollouts"] = store.size()
            out.append(row)
            print(f"{epoch:>5} {step:>4} {row['mean_length']:>5.1f} " + " ".join(
                f"{row[x]['acceptance_length']:>11.2f} {row[x]['speedup']:>8.2f}x" for x in names),
                flush=True)
            # the trainer's update after the step: prompt + completion of every rollout
            lens = np.asarray(plain.lengths)
            seqs = np.zeros((len(batch_prompts), store.width), np.int32)
            for i, p in enumerate(batch_prompts):
                seqs[i, :len(p)] = p
                seqs[i, len(p):len(p) + lens[i]] = np.asarray(plain.tokens[i, :lens[i]])
            store = store.add([prompt_key(p) for p in batch_prompts], seqs,
                              [len(p) + int(m) for p, m in zip(batch_prompts, lens)])
    summary = {}
    for epoch in range(args.epochs):
        rows_e = [r for r in out if r["epoch"] == epoch]
        src = {k: sum(r["hybrid"]["accepted_by_source"][k] for r in rows_e)
               for k in ("accepted_history_only", "accepted_head_only", "accepted_both",
                         "head_drafted", "head_skipped")}
        summary[epoch] = {x: {"acceptance_length": float(np.mean([r[x]["acceptance_length"]
                                                                  for r in rows_e])),
                              "speedup": float(statistics.median([r[x]["speedup"]
                                                                  for r in rows_e]))}
                          for x in names}
        summary[epoch]["hybrid"]["accepted_by_source"] = src
        print(f"epoch {epoch}: " + ", ".join(
            f"{x} tau {summary[epoch][x]['acceptance_length']:.2f} "
            f"{summary[epoch][x]['speedup']:.2f}x" for x in names)
            + f"; hybrid accepted drafts by source and head calls {src}")
    with open(args.json, "w") as fh:
        json.dump({"args": vars(args), "machine": machine(),
                   "cpus": jax.local_device_count(), "steps": out, "epochs": summary}, fh,
                  indent=1)


def _iteration_costs(args, run, drafters, batch_prompts, key):
    """ms per loop iteration of each drafter and of plain decoding, and its ratio to plain
    (median of the per-round ratios); tokens per policy forward over the whole call."""
    rows = np.arange(len(batch_prompts), dtype=np.int32)
    ds = drafters(batch_prompts)
    whole = {name: run(d, batch_prompts, key, rows) for name, d in ds.items()}  # compiles too
    fns = {}
    for name, d in ds.items():
        for n in (20, 60):
            fns[(name, n)] = lambda d=d, n=n: run(d, batch_prompts, key, rows, n).tokens
    times = interleaved(fns, args.rounds, warmup=True)
    per = {name: [(b - a) / 40 for a, b in zip(times[(name, 20)], times[(name, 60)])] for name in ds}
    print(f"{'drafter':>8} {'ms/iter':>8} {'x plain':>8} {'tau':>6}")
    out = {}
    for name in ds:
        ratio = statistics.median(x / p for x, p in zip(per[name], per["plain"]))
        ms = 1e3 * statistics.median(per[name])
        tau = whole[name].stats.acceptance_length
        out[name] = {"ms_per_iteration": ms, "x_plain": ratio, "tau": tau}
        print(f"{name:>8} {ms:8.3f} {ratio:8.2f} {tau:6.2f}", flush=True)
    with open(args.json, "w") as fh:
        json.dump({"args": vars(args), "machine": machine(), "iteration_costs": out},
                  fh, indent=1)


if __name__ == "__main__":
    main()
