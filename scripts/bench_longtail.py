#!/usr/bin/env python
"""Long-tailed rollouts: a static batch vs continuous batching (refilled slots), plain and
speculative, on the same prompts and key.

    python scripts/bench_longtail.py --rollouts 256 --slots 64 --rounds 3

The policy is a random tiny transformer with near-uniform logits (Policy.init's 0.02 init)
and `--stops` stop tokens, so each token stops a row with probability ~ stops / vocab: the
lengths are geometric, long-tailed (median ~0.7 x mean, max several times the mean), like
RL completions. Prompts are random tokens of ragged length. Three schedules decode the
same rollouts (global rollout ids 0..R-1, so every schedule gives the same tokens, asserted):

- static_all: one batch of all R rollouts (slots = R, today's default);
- static_S: R / S fixed batches of S, one `generate` call each (today's way at concurrency S);
- refill_S: one `generate(slots=S)` call: a finished row's slot takes the next prompt.

Speculative decoding uses the oracle drafter (drafts are the plain rollout's own tokens, kept
with probability `--oracle` per depth), which measures the engine independent of draft
quality. Wasted row-steps: slot-iterations spent on finished or empty slots, as a fraction.
Timing: every configuration is compiled first, then all are timed alternately (A/B/C/...,
`--rounds` rounds); ratios are medians of per-round ratios against static_S.

`--adaptive`: instead, compare draft lengths on refill_S: plain, every fixed k = 1..K, and
adaptive k (`jaxspec.decoding.adaptive`: costs measured once by `measure_costs` before the
timing, then k chosen per iteration; "adapt carry": each call starts from the last one's
probe clock and acceptance, `AdaptiveK.after`, as the trainer runs it) and plain again
(plain timed against itself: the noise floor); ratios against plain refill_S. `--drafter eagle3`
drafts with a random EAGLE-3 head (real draft forwards, acceptance near chance) instead of
the oracle.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import jax
import numpy as np

from jaxspec.host import keep_freed_memory
from jaxspec.timing import interleaved
from jaxspec.decoding import SamplingConfig, measure_costs
from jaxspec.decoding.drafters import Eagle3Drafter
from jaxspec.decoding.engine import generate, pad_prompts
from jaxspec.decoding.oracle import oracle_drafter
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head


def _parse(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stops", type=int, default=3, help="stop tokens (stop probability ~ stops / vocab)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", default="4,24", help="min,max prompt length (uniform)")
    p.add_argument("--oracle", default="0.8,0.7,0.6", help="per-depth oracle acceptance (k = count)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-static-all", action="store_true", help="leave out static_all (slow at large R)")
    p.add_argument("--adaptive", action="store_true", help="plain vs fixed k vs adaptive k on refill_S")
    p.add_argument("--drafter", choices=("oracle", "eagle3"), default="oracle")
    p.add_argument("--cost-iterations", type=int, default=32, help="--adaptive: iterations per k timed by measure_costs")
    p.add_argument("--json", default="bench_longtail.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call (jaxspec.host)
    r, s = args.rollouts, args.slots
    if r % s:
        raise SystemExit(f"--rollouts {r} must be a multiple of --slots {s} (static batches of S)")
    cfg = ModelConfig.tiny("qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=2 * args.hidden, num_layers=args.layers,
                           head_dim=args.hidden // 4, max_position_embeddings=1024)
    policy = Policy.init(cfg, jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    stops = tuple(range(args.vocab - args.stops, args.vocab))
    prompts = [rng.integers(3, args.vocab - args.stops, size=rng.integers(lo, hi + 1)).tolist()
               for _ in range(r)]
    tokens, lengths = pad_prompts(prompts)
    rows = np.arange(r, dtype=np.int32)
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=args.max_new_tokens,
                  key=jax.random.key(args.seed + 1), stop_tokens=stops)
    acceptance = [float(a) for a in args.oracle.split(",")]

    def chunk(i):  # the i-th static batch of S
        return slice(i * s, (i + 1) * s)

    plain_ref = generate(policy, (tokens, lengths), rows=rows, **common)
    completions = np.asarray(plain_ref.tokens)
    oracle_all = oracle_drafter(tokens, lengths, completions, acceptance, vocab_size=args.vocab)
    oracle_chunks = [oracle_drafter(tokens[chunk(i)], lengths[chunk(i)], completions[chunk(i)],
                                    acceptance, vocab_size=args.vocab) for i in range(r // s)]

    if args.adaptive:
        if args.drafter == "eagle3":
            # argmax drafts: a random head on a random (near-uniform) policy is a poor drafter
            # only then; coupled draws from its near-uniform q would often match
            drafter = Eagle3Drafter(Eagle3Head.init_for(policy, args.vocab, jax.random.key(args.seed + 2)),
                                    k=len(acceptance), coupled=False)
        else:
            drafter = oracle_all
        return _adaptive(args, policy, (tokens, lengths), rows, common, drafter, completions)

    def static_all(spec):
        return [generate(policy, (tokens, lengths), rows=rows, drafter=oracle_all if spec else None, **common)]

    def static_s(spec):
        return [generate(policy, (tokens[chunk(i)], lengths[chunk(i)]), rows=rows[chunk(i)],
                         drafter=oracle_chunks[i] if spec else None, **common) for i in range(r // s)]

    def refill_s(spec):
        return [generate(policy, (tokens, lengths), rows=rows, slots=s,
                         drafter=oracle_all if spec else None, **common)]

    runs = {f"{name}/{mode}": (lambda f=f, spec=mode == "spec": f(spec))
            for name, f in (("static_all", static_all), (f"static_{s}", static_s), (f"refill_{s}", refill_s))
            for mode in ("plain", "spec") if not (args.skip_static_all and name == "static_all")}
    gen = np.asarray(plain_ref.lengths)
    stats = {}
    for name, fn in runs.items():  # compile, check the tokens, collect the counters
        outs = fn()
        toks = np.concatenate([np.asarray(o.tokens) for o in outs])
        assert np.array_equal(toks, completions), f"{name}: tokens differ from plain static_all"
        tokens_out = sum(float(np.sum(o.stats.tokens_generated)) for o in outs)
        slot_steps = sum(o.stats.total_slot_steps for o in outs)
        live = sum(float(np.sum(o.stats.row_steps)) for o in outs)
        stats[name] = dict(
            iterations=int(sum(int(o.stats.target_forwards) for o in outs)),
            prefill_forwards=int(sum(int(o.stats.prefill_forwards) for o in outs)),
            wasted_row_steps=1.0 - live / slot_steps,
            acceptance_length=tokens_out / live,
            tokens_per_slot_step=tokens_out / slot_steps,
        )
    times = interleaved(runs, args.rounds)
    base = {mode: times[f"static_{s}/{mode}"] for mode in ("plain", "spec")}
    for name in runs:
        mode = name.split("/")[1]
        stats[name]["wall_s_median"] = float(statistics.median(times[name]))
        stats[name]["speedup_vs_static_S"] = float(statistics.median(
            b / t for b, t in zip(base[mode], times[name])))
        stats[name]["speedup_vs_static_S_plain"] = float(statistics.median(
            b / t for b, t in zip(base["plain"], times[name])))
    summary = dict(
        machine=f"{platform.machine()} {platform.processor() or ''} cpus={len(jax.devices())} "
                f"backend={jax.default_backend()}",
        args=vars(args), params=int(sum(x.size for x in jax.tree.leaves(policy.params))),
        lengths=dict(mean=float(gen.mean()), median=float(np.median(gen)),
                     p90=float(np.percentile(gen, 90)), max=int(gen.max()),
                     at_budget=int(np.sum(gen >= args.max_new_tokens))),
        results=stats, times=times,
    )
    print(f"lengths: mean {gen.mean():.1f}, median {np.median(gen):.0f}, p90 "
          f"{np.percentile(gen, 90):.0f}, max {gen.max()}; {summary['params']} params")
    print(f"{'schedule':<20} {'iters':>6} {'prefills':>8} {'wasted':>7} {'tau':>5} {'tok/slot-step':>13} "
          f"{'wall s':>7} {'x static_S':>10} {'x static_S plain':>16}")
    for name, st in stats.items():
        print(f"{name:<20} {st['iterations']:>6} {st['prefill_forwards']:>8} {st['wasted_row_steps']:>7.1%} "
              f"{st['acceptance_length']:>5.2f} {st['tokens_per_slot_step']:>13.2f} {st['wall_s_median']:>7.2f} "
              f"{st['speedup_vs_static_S']:>10.2f} {st['speedup_vs_static_S_plain']:>16.2f}")
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


def _adaptive(args, policy, prompts, rows, common, drafter, completions) -> int:
    """Plain vs every fixed k vs adaptive k, all on refill_S, timed interleaved."""
    s = args.slots
    kw = dict(rows=rows, slots=s, **common)
    adaptive = measure_costs(policy, drafter, prompts, iterations=args.cost_iterations, verbose=True, **kw)
    runs = {"plain": lambda: generate(policy, prompts, **kw)}
    runs.update({f"k={k}": (lambda d=drafter.with_k(k): generate(policy, prompts, drafter=d, **kw))
                 for k in range(1, drafter.k + 1)})
    runs["adaptive"] = lambda: generate(policy, prompts, drafter=drafter, adaptive=adaptive, **kw)
    carried = [adaptive]

    def carry():  # as the trainer runs it: each call's probe clock and acceptance carried on
        out = generate(policy, prompts, drafter=drafter, adaptive=carried[0], **kw)
        carried[0] = carried[0].after(out)
        return out

    runs["adapt carry"] = carry
    runs["plain again"] = runs["plain"]  # plain against itself: the timing noise floor
    stats = {}

    def collect(name, out):  # check the tokens, keep the counters
        assert np.array_equal(np.asarray(out.tokens), completions), f"{name}: tokens differ from plain"
        st = out.stats
        stats[name] = dict(iterations=int(st.target_forwards), acceptance_length=st.acceptance_length,
                           tokens_per_slot_step=st.tokens_per_slot_step,
                           mean_k=st.mean_k if st.k_iterations is not None else
                           (0.0 if name.startswith("plain") else float(name[2:])),
                           k_iterations=None if st.k_iterations is None else
                           np.asarray(st.k_iterations).tolist())

    for name, fn in runs.items():  # compile, check the tokens, collect the counters
        collect(name, fn())
    times = interleaved(runs, args.rounds)
    collect("adapt carry", carry())  # a call of the carried run's steady state, not its first
    for name in runs:
        stats[name]["wall_s_median"] = float(statistics.median(times[name]))
        ratios = sorted(p / t for p, t in zip(times["plain"], times[name]))
        stats[name]["speedup_vs_plain"] = float(statistics.median(ratios))
        # the spread of the per-round ratios (10th-90th percentile): the noise of this run
        stats[name]["speedup_p10_p90"] = [float(ratios[len(ratios) // 10]),
                                          float(ratios[-1 - len(ratios) // 10])]
    best = max((n for n in runs if n.startswith("k=")), key=lambda n: stats[n]["speedup_vs_plain"])
    adaptive_vs_best = float(statistics.median(b / a for a, b in zip(times["adaptive"], times[best])))
    summary = dict(
        machine=f"{platform.machine()} {platform.processor() or ''} cpus={len(jax.devices())} "
                f"backend={jax.default_backend()}",
        args=vars(args), params=int(sum(x.size for x in jax.tree.leaves(policy.params))),
        costs_ms=(np.asarray(adaptive.costs) * 1e3).tolist(),
        probe_cost_ms=float(adaptive.probe_cost) * 1e3, results=stats, times=times,
        best_fixed=best, adaptive_vs_best_fixed=adaptive_vs_best,
    )
    print(f"{summary['params']} params; costs per iteration (ms) at k = {list(adaptive.ks)}: "
          + ", ".join(f"{c:.2f}" for c in summary["costs_ms"])
          + f"; a probe {summary['probe_cost_ms']:.2f} ms beyond k = 0")
    print(f"{'run':<11} {'iters':>6} {'tau':>5} {'tok/slot-step':>13} {'mean k':>6} {'wall s':>7} "
          f"{'x plain':>8} {'p10-p90':>11}  k iterations")
    for name, st in stats.items():
        lo, hi = st["speedup_p10_p90"]
        print(f"{name:<11} {st['iterations']:>6} {st['acceptance_length']:>5.2f} "
              f"{st['tokens_per_slot_step']:>13.2f} {st['mean_k']:>6.2f} {st['wall_s_median']:>7.2f} "
              f"{st['speedup_vs_plain']:>8.3f} {lo:>5.2f}-{hi:<5.2f}  {st['k_iterations'] or ''}")
    print(f"adaptive vs the best fixed k ({best}): {adaptive_vs_best:.2f}x (median of per-round ratios)")
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
