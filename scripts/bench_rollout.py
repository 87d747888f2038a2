#!/usr/bin/env python
"""Plain vs speculative rollouts on the same prompts and key, per drafter and draft length,
against the bound tau * c(1) / c(k+1).

    python scripts/bench_rollout.py --policy RUN/policy --eagle3 RUN/eagle3 --ks 1,3,5
    python scripts/bench_rollout.py --config configs/small.yaml --oracle 1.0 --ks 1,3,5 --batches 1,4,16
    python scripts/bench_rollout.py --policy HF_DIR --tokenizer HF_DIR --prompts p.jsonl --oracle 0.8

The policy is a local HF directory (save_hf / any Qwen3 or Llama-3 checkpoint), or the
tiny model of a config file with random weights (`--config`). Prompts come from a built-in
task at held-out positions (character tokenizer), or from a JSONL file of {"prompt": ...}
lines with the policy's HF tokenizer (`--tokenizer`, `--prompts`).

Timing: every configuration is compiled first, then plain and speculative generation are
timed alternately (A/B/A/B, `--rounds` rounds) and the row reports the median of the
per-round plain/spec ratios, so load on a shared machine cancels. The verify cost ratio
c(k+1)/c(1) is measured the same way, timing one policy forward of k+1 tokens against one
of 1 token on a cache holding the prompt and half of the longest completion; for a drafter
with forwards (EAGLE-3, MTP, a draft model) so is c_draft/c(1), one iteration's drafter work
(its proposal and its observation of k+1 entries), and the row adds the bound with the draft
tau * c(1) / (c(k+1) + c_draft) and the efficiency against it. Forwards are timed as the
engine runs them (`jaxspec.decoding.decoding_policy`). `--calls N` times N generate calls
of `batch` prompts each (the next prompts every call): a batch-1 row over N rollouts.

`--oracle A` replaces the drafters by the oracle drafter (jaxspec.decoding.oracle): drafts
are the plain rollout's own tokens, the one at depth j corrupted with probability 1 - A_j
(A: one rate for every depth, or a comma list per depth). It measures the engine, not the
draft: efficiency = speedup / bound, with tau the measured tokens per policy forward.
`--oracle-reference verify` (the default) takes the drafts from what the verify forward
itself emits (`jaxspec.decoding.oracle.verify_reference`, one untimed run per k), so that in
bf16 on a GPU, where a (k+1)-token verify rounds differently from a decode step, tau is
k + 1 at 1.0; `plain` replays the plain rollout (tau below k + 1 where rounding flips a pick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.host import keep_freed_memory
from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.block import BlockDrafter
from jaxspec.decoding.drafters import DraftModelDrafter, Eagle3Drafter, MTPDrafter, NGramDrafter, TreeSpec
from jaxspec.decoding.protocols import DraftContext, Observation
from jaxspec.decoding.verify import replay_noise
from jaxspec.decoding.engine import decoding_policy, generate, pad_prompts
from jaxspec.decoding.oracle import oracle_drafter, verify_reference
from jaxspec.models import Policy, load_hf
from jaxspec.models.block_formats import load_dflash
from jaxspec.models.eagle3 import Eagle3Head, load_eagle3
from jaxspec.models.mtp import MTPHead
from jaxspec.rl.tasks import CharTokenizer, make_task
from jaxspec.timing import interleaved, machine, median_ratio

HELDOUT = 1_000_000  # task positions from here on are never used for training
DRAFTERS = ("eagle3", "eagle3_argmax", "eagle3_untrained", "eagle3_tree", "ngram", "draft_model",
            "draft_model_argmax", "mtp_untrained", "block", "block_argmax")


def _parse(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--policy", help="local HF directory of the policy")
    src.add_argument("--config", help="a config file whose tiny model (random weights) is the policy")
    p.add_argument("--eagle3", help="local EAGLE-3 head directory (vLLM/SGLang layout)")
    p.add_argument("--draft-model", help="local HF directory of a small draft model (same tokenizer)")
    p.add_argument("--block", action="append", default=[],
                   help="local block draft model directory (DFlash layout; train_draft.py "
                        "draft.kind=block writes one); repeat for several (drafters block*: one "
                        "row each, a k past a block's size - 1 skipped)")
    p.add_argument("--drafters", default="eagle3,ngram", help="comma list of " + ", ".join(DRAFTERS)
                   + " (eagle3_untrained: a fresh head over the same draft vocabulary, the control; "
                   "eagle3_argmax, draft_model_argmax: argmax drafts instead of draws coupled with "
                   "the verifier's noise)")
    p.add_argument("--oracle", help="oracle drafter instead of --drafters: an acceptance rate for "
                   "every depth, or a comma list of per-depth rates")
    p.add_argument("--oracle-reference", choices=("verify", "plain"), default="verify",
                   help="the oracle's drafts: what the verify forward emits (tau = k + 1 at 1.0 "
                        "in bf16) or the plain rollout's tokens")
    p.add_argument("--ks", default="1,3,5", help="draft lengths to sweep")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (default: --num-prompts)")
    p.add_argument("--tree", default="4,3,8", help="top_k,depth,budget for eagle3_tree")
    p.add_argument("--task", default="worked_addition")
    p.add_argument("--task-params", default="{}", help="JSON dict of task parameters")
    p.add_argument("--tokenizer", help="local HF tokenizer directory (with --prompts)")
    p.add_argument("--prompts", help="JSONL file of {\"prompt\": str} lines (needs --tokenizer)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--calls", type=int, default=1,
                   help="generate calls per timed run, each on the next `batch` prompts (batch x calls "
                   "prompts in all): e.g. a batch-1 row over several rollouts instead of one")
    p.add_argument("--max-new-tokens", type=int, default=168)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--method", default="replay", choices=["replay", "greedy", "rejection"])
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_rollout.json", help="where to write the results")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: an override such as model.attention_backend=pallas (repeatable)")
    p.add_argument("--bandwidth", action="store_true",
                   help="also measure the device's read bandwidth and report plain decoding against "
                   "its memory bound (weights + live KV bytes read per step)")
    p.add_argument("--calibration-out", help="write the first drafter's k=3 acceptance as a "
                   "calibration file for scripts/simulate.py --calibration")
    return p.parse_args(argv)


def _policy(args):
    if args.policy:
        return load_hf(args.policy)
    from jaxspec.config import load_config
    from jaxspec.rl.trainer import prepare_run

    plan = prepare_run(load_config(args.config, args.set))
    return Policy.init(plan.model_config, jax.random.key(args.seed))


def _prompts(args, vocab: int):
    """(token-id lists, tokenizer) for the benchmark prompts."""
    if args.prompts or args.tokenizer:
        if not (args.prompts and args.tokenizer):
            raise SystemExit("--prompts and --tokenizer go together (a JSONL file and its tokenizer)")
        from jaxspec.rl.tokenizer import HFTokenizer

        tok = HFTokenizer(args.tokenizer)
        with open(args.prompts, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        bad = [i for i, r in enumerate(rows, 1) if not isinstance(r, dict) or not isinstance(r.get("prompt"), str)]
        if bad or not rows:
            raise SystemExit(f"--prompts {args.prompts}: lines {bad[:5]} lack a string \"prompt\"" if bad
                             else f"--prompts {args.prompts} is empty")
        texts = [r["prompt"] for r in rows]
    else:
        tok = CharTokenizer()
        task = make_task(args.task, seed=args.seed, **json.loads(args.task_params))
        texts = [ex.prompt for ex in task.batch(HELDOUT, args.num_prompts)]
    ids = [tok.encode_prompt(t) for t in texts]  # the chat template where the tokenizer has one
    if tok.vocab_size > vocab:
        raise SystemExit(f"the tokenizer has {tok.vocab_size} ids; the policy's vocabulary {vocab}")
    return ids, tok


def _forward_loops(policy, batch: int, context: int, widths, reps: int = 20) -> dict:
    """{t: a compiled call running `reps` policy forwards of t tokens per row}, on a cache
    holding `context` tokens, in one loop (as inside the engine, so per-call dispatch is not
    counted); each compiled here. The policy decodes as `generate` does (`decoding_policy`:
    on CPU its per-layer weight copies, not the stacked scan that copies them every forward)."""
    policy = decoding_policy(policy)
    cache = policy.init_cache(batch, context + max(widths) + 1)
    pre = jnp.zeros((batch, context), jnp.int32)
    _, _, cache = policy.forward(pre, jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), pre.shape), cache)

    @jax.jit
    def loop(p, toks, pos, c):
        def body(i, acc):  # feed what the last forward chose, so no forward is skipped
            logits, _, _ = p.forward((toks + acc) % p.config.vocab_size, pos, c)
            return jnp.argmax(logits[:, :1, :], axis=-1).astype(jnp.int32)
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((batch, 1), jnp.int32))

    fns = {}
    for t in widths:
        toks = jnp.zeros((batch, t), jnp.int32)
        pos = jnp.broadcast_to(context + jnp.arange(t, dtype=jnp.int32), (batch, t))
        fns[t] = (lambda toks=toks, pos=pos: loop(policy, toks, pos, cache))
        jax.block_until_ready(fns[t]())  # compile
    return fns


def _verify_cost(policy, batch: int, context: int, ks, rounds: int) -> dict:
    """{k: median over rounds of c(k+1)/c(1)}: policy forwards of k+1 tokens vs 1 token per
    row on a cache holding `context` tokens (`_forward_loops`), timed interleaved."""
    fns = _forward_loops(policy, batch, context, sorted({1} | {k + 1 for k in ks}))
    times = interleaved(fns, rounds)
    return {k: median_ratio(times[k + 1], times[1]) for k in ks}


def _draft_cost(policy, drafter, batch: int, context: int, rounds: int, key, reps: int = 20) -> float:
    """c_draft / c(1): one loop iteration's drafter work (its proposal, with the replay
    noise a coupled drafter draws with, and its observation of k + 1 committed entries)
    against one policy forward of 1 token, both on a cache holding `context` tokens, `reps`
    of each in one compiled loop, timed interleaved. 0.0 for a drafter without forwards
    (model-free: its lookups are counted in the engine's bookkeeping, not here)."""
    if drafter.forwards_per_propose + drafter.forwards_per_observe == 0:
        return 0.0
    policy = decoding_policy(policy)  # as the engine runs the drafter (its captured features)
    span = drafter.max_depth + 1
    max_len = context + reps * span + span + 2
    vocab = policy.config.vocab_size
    pre = jnp.zeros((batch, context), jnp.int32)
    pre_pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), pre.shape)
    _, captured, cache = policy.forward(pre, pre_pos, policy.init_cache(batch, max_len),
                                        capture=drafter.capture_layers)
    state = drafter.init_state(policy, batch, max_len)
    state = drafter.observe(state, policy, Observation(pre, pre, pre_pos, captured))
    new_pos = jnp.broadcast_to(context + jnp.arange(span, dtype=jnp.int32), (batch, span))
    _, fed_captured, _ = policy.forward(jnp.zeros((batch, span), jnp.int32), new_pos, cache,
                                        capture=drafter.capture_layers)
    rows = jnp.arange(batch, dtype=jnp.int32)
    sampling = SamplingConfig()

    @jax.jit
    def drafting(d, st):
        def body(i, carry):
            st, acc = carry
            lengths = jnp.full((batch,), context + 1, jnp.int32) + i * span
            noise = (replay_noise(key, lengths, d.max_depth, vocab, rows)
                     if getattr(d, "uses_verifier_noise", False) else None)
            ctx = DraftContext(buffer=jnp.zeros((batch, max_len), jnp.int32), lengths=lengths,
                               key=key, sampling=sampling, sampled=False, rows=rows,
                               verifier_noise=noise)
            tree, _, st = d.propose(st, policy, ctx)
            toks = jnp.maximum(jnp.pad(tree.tokens[:, :span - 1], ((0, 0), (1, 0))), 0)
            st = d.observe(st, policy, Observation(toks, toks, new_pos + i * span, fed_captured))
            return st, acc + jnp.sum(toks)
        return jax.lax.fori_loop(0, reps, body, (st, jnp.zeros((), jnp.int32)))[1]

    fns = {"draft": lambda: drafting(drafter, state),
           "one": _forward_loops(policy, batch, context, [1], reps)[1]}
    jax.block_until_ready(fns["draft"]())  # compile
    times = interleaved(fns, rounds)
    return median_ratio(times["draft"], times["one"])


def read_bandwidth_gbps(rounds: int = 5) -> float:
    """GB/s of reading one large array once (a float32-accumulated sum of bf16 values): the
    rate a memory-bound decode step can read its weights and KV at. 4 GiB on a GPU,
    256 MiB elsewhere."""
    n = (2 << 30) if jax.default_backend() == "gpu" else (128 << 20)
    x = jnp.ones((n,), jnp.bfloat16)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    jax.block_until_ready(read(x))
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(read(x))
        seconds.append(time.perf_counter() - start)
    del x
    return 2 * n / statistics.median(seconds) / 1e9


def decode_bytes(policy, batch: int, live_tokens: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) one plain decode step must read: every weight but the input
    embedding table (only `batch` rows of it are read; a tied table is read as the LM head),
    and the keys and values of `live_tokens` cached tokens per row."""
    c = policy.config
    itemsize = jnp.dtype(c.dtype).itemsize
    params = sum(x.size for x in jax.tree.leaves(policy.params))
    embed = 0 if c.tie_embeddings else c.vocab_size * c.hidden_size
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize
    return (params - embed) * itemsize, int(batch * live_tokens * kv_per_token)


def _drafter(name, k, args, policy, head, small):
    if name == "eagle3":
        return Eagle3Drafter(head, k=k)
    if name == "eagle3_argmax":  # the head's argmax instead of the coupled draw (replay)
        return Eagle3Drafter(head, k=k, coupled=False)
    if name == "eagle3_untrained":
        fresh = Eagle3Head.init_for(policy, head.config.draft_vocab_size, jax.random.key(7),
                                    capture_layers=head.capture_layers)
        return Eagle3Drafter(fresh.with_vocab(np.asarray(head.draft_to_target())), k=k)
    if name == "eagle3_tree":
        top_k, depth, budget = (int(x) for x in args.tree.split(","))
        return Eagle3Drafter(head, tree=TreeSpec(top_k=top_k, depth=depth, budget=budget))
    if name == "ngram":
        return NGramDrafter(k=k, min_n=1, max_n=3)
    if name in ("block", "block_argmax"):  # `head`: the block model (see main)
        return BlockDrafter(head, k=k, coupled=name == "block")
    if name in ("draft_model", "draft_model_argmax"):
        return DraftModelDrafter(small, k=k, coupled=name == "draft_model")
    return MTPDrafter(MTPHead.init_for(policy, jax.random.key(1)), k=k)


def main(argv=None) -> int:
    args = _parse(argv)
    keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call (jaxspec.host)
    if args.set and not args.config:
        raise SystemExit(f"--set {args.set}: overrides a --config file's values; give --config")
    ks = [int(k) for k in args.ks.split(",") if k]
    if any(k < 1 for k in ks):
        raise SystemExit(f"--ks must be >= 1; got {ks}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1; got {args.rounds}")
    if args.calls < 1:
        raise SystemExit(f"--calls must be >= 1; got {args.calls}")
    oracle = None
    if args.oracle is not None:
        try:
            oracle = [float(a) for a in args.oracle.split(",")]
        except ValueError:
            raise SystemExit(f"--oracle {args.oracle!r}: rates in [0, 1], one or one per depth") from None
        if not oracle or any(not 0 <= a <= 1 for a in oracle):
            raise SystemExit(f"--oracle {args.oracle!r}: rates must lie in [0, 1]")
        if len(oracle) > 1 and len(oracle) < max(ks):
            raise SystemExit(f"--oracle gives {len(oracle)} per-depth rates; --ks needs {max(ks)}")
        names = ["oracle"]
    else:
        names = [d for d in args.drafters.split(",") if d]
        unknown = sorted(set(names) - set(DRAFTERS))
        if unknown:
            raise SystemExit(f"--drafters {unknown} unknown; valid: {list(DRAFTERS)}")
        if ({"eagle3", "eagle3_argmax", "eagle3_tree", "eagle3_untrained"} & set(names)) and not args.eagle3:
            raise SystemExit("--drafters eagle3/eagle3_tree/eagle3_untrained need --eagle3 DIR")
        if {"block", "block_argmax"} & set(names) and not args.block:
            raise SystemExit("--drafters block/block_argmax need --block DIR")
        if {"draft_model", "draft_model_argmax"} & set(names) and not args.draft_model:
            raise SystemExit("--drafters draft_model needs --draft-model DIR")

    policy = _policy(args)
    vocab = policy.config.vocab_size
    bandwidth = read_bandwidth_gbps() if args.bandwidth else None
    if bandwidth:
        print(f"read bandwidth {bandwidth:.0f} GB/s ({jax.devices()[0].device_kind})", flush=True)
    ids, tok = _prompts(args, vocab)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [len(ids)]
    head = (load_eagle3(args.eagle3, target_num_layers=policy.config.num_layers)
            if args.eagle3 else None)
    small = load_hf(args.draft_model) if args.draft_model else None
    blocks = [load_dflash(path) for path in args.block]
    sampling = SamplingConfig(temperature=args.temperature)
    key = jax.random.key(args.seed)
    plain_method = "replay" if args.method == "rejection" else args.method
    rows = []
    for batch in batches:
        # `calls` groups of `batch` prompts, padded to one width (one program for all)
        every, every_len = pad_prompts([ids[i % len(ids)] for i in range(batch * args.calls)], tok.pad_id)
        groups = [(every[c * batch:(c + 1) * batch], every_len[c * batch:(c + 1) * batch])
                  for c in range(args.calls)]
        width = int(every.shape[1])
        common = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, key=key,
                      stop_tokens=tuple(tok.eos_ids), pad_id=tok.pad_id)

        def run_plain(groups=groups, common=common):
            return [generate(policy, g, **common, method=plain_method) for g in groups]

        plains = run_plain()  # compile
        plain_lengths = np.concatenate([np.asarray(p.lengths) for p in plains])
        longest = int(np.max(plain_lengths))
        plain_bound = None
        if bandwidth:  # each call decodes its longest row's steps over caches of prompt + t tokens
            plain_bound = 0.0
            for p in plains:
                steps = int(np.max(p.lengths))
                w, kv = decode_bytes(policy, batch, width + steps / 2)
                plain_bound += steps * (w + kv) / (bandwidth * 1e9)
        cost = _verify_cost(policy, batch, width + longest // 2, ks, args.rounds)
        runs = [(n, None) for n in names if not n.startswith("block")] + [
            (n, b) for n in names if n.startswith("block") for b in blocks]
        for name, block in runs:
            for k in ks if name != "eagle3_tree" else [None]:
                if block is not None and k > block.config.block_size - 1:
                    continue
                if name == "oracle":
                    acc = oracle * k if len(oracle) == 1 else oracle[:k]
                    refs = ([p.tokens for p in plains] if args.oracle_reference == "plain" else
                            [verify_reference(policy, g, k, **common, method=plain_method).tokens
                             for g in groups])
                    ds = [oracle_drafter(*g, r, acc, vocab_size=vocab, seed=args.seed)
                          for g, r in zip(groups, refs)]
                else:
                    ds = [_drafter(name, k, args, policy, block or head, small)] * len(groups)
                drafter = ds[0]

                def run_spec(ds=ds, groups=groups, common=common):
                    return [generate(policy, g, drafter=d, **common, method=args.method)
                            for g, d in zip(groups, ds)]

                specs = run_spec()  # compile
                times = interleaved({"plain": run_plain, "spec": run_spec}, args.rounds)
                speedup = median_ratio(times["plain"], times["spec"])
                # the calls' counters summed (same shapes): the rates over all of them
                total = jax.tree.map(lambda *xs: np.sum([np.asarray(x) for x in xs], axis=0),
                                     *[x.stats for x in specs])
                tau = total.acceptance_length
                c = cost.get(drafter.num_nodes)  # verify width num_nodes + 1 (k + 1 for chains)
                if c is None:  # a tree: measure its own verify width
                    c = _verify_cost(policy, batch, width + longest // 2,
                                     [drafter.num_nodes], args.rounds)[drafter.num_nodes]
                bound = tau / c
                draft = _draft_cost(policy, drafter, batch, width + longest // 2,
                                    args.rounds, key) if name != "oracle" else 0.0
                full_bound = tau / (c + draft)  # tau c(1) / (c(k+1) + c_draft), per iteration
                plain_tokens = int(np.sum(plain_lengths))
                rows.append(dict(
                    drafter=name if block is None else f"{name}{block.config.block_size}",
                    k=k if k is not None else args.tree, batch=batch, calls=args.calls,
                    acceptance=(acc if name == "oracle" else None),
                    oracle_reference=(args.oracle_reference if name == "oracle" else None),
                    tau=tau, acceptance_length=tau,
                    per_position_acceptance=[round(x, 4) for x in total.per_position_acceptance.tolist()],
                    target_forwards=int(total.target_forwards),
                    plain_s=statistics.median(times["plain"]), spec_s=statistics.median(times["spec"]),
                    speedup=speedup, verify_cost=c, bound=bound, efficiency=speedup / bound,
                    draft_cost=draft, bound_with_draft=full_bound,
                    efficiency_with_draft=speedup / full_bound,
                    tokens_equal_plain=all(np.array_equal(np.asarray(x.tokens), np.asarray(p.tokens))
                                           for x, p in zip(specs, plains)),
                    plain_tokens=plain_tokens, longest=longest,
                    plain_tokens_per_s=plain_tokens / statistics.median(times["plain"]),
                    plain_of_memory_bound=(plain_bound / statistics.median(times["plain"])
                                           if plain_bound else None),
                ))
                r = rows[-1]
                print(f"{name:>14} B={batch:<4d} k={str(r['k']):>6}  speedup {speedup:5.2f}x  tau {tau:5.2f}  "
                      f"c(k+1)/c(1) {c:5.2f}  bound {bound:5.2f}x  efficiency {r['efficiency']:5.1%}  "
                      + (f"c_draft/c(1) {draft:4.2f}  bound with the draft {full_bound:5.2f}x  "
                         f"efficiency {r['efficiency_with_draft']:5.1%}  " if draft else "")
                      + f"plain {r['plain_s'] * 1e3:8.1f} ms"
                      + (f" ({r['plain_tokens_per_s']:.0f} tok/s, {r['plain_of_memory_bound']:.0%} of the "
                         "memory bound)" if plain_bound else "")
                      + f"  same-as-plain {r['tokens_equal_plain']}", flush=True)

    result = dict(
        machine=machine(),
        backend=jax.default_backend(), policy=args.policy or args.config, eagle3=args.eagle3,
        params=int(sum(x.size for x in jax.tree.leaves(policy.params))),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, method=args.method,
        rounds=args.rounds, calls=args.calls, read_bandwidth_gbps=bandwidth, rows=rows,
        argv=sys.argv[1:] if argv is None else list(argv),
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
