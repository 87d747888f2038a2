#!/usr/bin/env python
"""Does attention cost follow the live KV or the cache's capacity? (issue 13)

    python scripts/bench_attention.py rollout   # same rollouts, max_new_tokens 2048 vs 64
    python scripts/bench_attention.py decode    # decode step, 2048-slot vs 128-slot cache
    python scripts/bench_attention.py tree      # EAGLE-3 dynamic-tree proposal, depth 2-6
    python scripts/bench_attention.py chain     # EAGLE-3 chain proposal, 128- vs 2048-slot head cache

rollout: a random policy (ModelConfig.tiny shape, `--hidden`) samples from the same
prompts and key with a large set of stop tokens, so every row stops within a few tokens;
the rollouts must be identical at both budgets (checked), only the cache capacity differs.
decode: one-token forwards in a compiled loop that carries the cache (as the engine does),
each on a cache holding the same `--live` tokens, at two capacities.
tree: `Eagle3Drafter.propose` with a dynamic tree (top_k 4, budget = depth) on a cache
holding `--live` tokens; `--refeed` also times the re-feed-every-depth proposal (the one
before issue 13) and checks both propose the same tree.
chain: `Eagle3Drafter.propose` with a chain of `--k` drafts on head caches of each of
`--capacities` slots holding the same `--live` entries, `--steps` proposals in a compiled
loop carrying the head's state (as the engine does); ms per proposal.

Timing: everything is compiled first, then the variants run alternately (A/B/A/B,
`--rounds` rounds); a ratio is the median of the per-round ratios, so load on a shared
machine cancels.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.host import keep_freed_memory
from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig
from jaxspec.timing import interleaved, median_ratio
from jaxspec.models.transformer import random_policy


def _parse(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["rollout", "decode", "tree", "chain"])
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny policy")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=128, help="vocabulary (and tree: draft vocabulary)")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    p.add_argument("--live", type=int, default=64, help="decode/tree: tokens held in the cache")
    p.add_argument("--capacities", default="128,2048", help="decode: cache slots, small first")
    p.add_argument("--budgets", default="64,2048", help="rollout: max_new_tokens, small first")
    p.add_argument("--prompt-len", type=int, default=16, help="rollout: prompt tokens")
    p.add_argument("--stops", type=int, default=24, help="rollout: stop tokens (ids 0..n-1)")
    p.add_argument("--steps", type=int, default=32, help="decode: forwards (chain: proposals) per timed call")
    p.add_argument("--depths", default="2,3,4,5,6", help="tree: draft depths")
    p.add_argument("--refeed", action="store_true", help="tree: also time the re-feed proposal")
    p.add_argument("--k", type=int, default=3, help="chain: drafts per proposal")
    p.add_argument("--layer-loop", choices=("auto", "scan", "unroll"), default="auto",
                   help="model.layer_loop (auto may pick differently at the two capacities)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _ms(times) -> float:
    return 1e3 * float(statistics.median(times))


def _policy(args, max_len: int):
    config = ModelConfig.tiny(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_layers=args.layers, num_heads=max(4, args.hidden // 64), head_dim=min(64, args.hidden // 4),
        max_position_embeddings=max_len, layer_loop=args.layer_loop,
    )
    return random_policy(config, seed=args.seed)


def bench_rollout(args) -> None:
    small, large = (int(v) for v in args.budgets.split(","))
    policy = _policy(args, args.prompt_len + large + 8)
    rng = np.random.default_rng(args.seed)
    vocab = policy.config.vocab_size
    stops = list(range(args.stops))
    print(f"rollout: tiny policy hidden {args.hidden}, {args.layers} layers, prompt {args.prompt_len}, "
          f"{args.stops} stop tokens of {vocab}; max_new_tokens {large} vs {small}")
    print("| batch | longest rollout | ms at {0} | ms at {1} | ratio {1}/{0} | 1-step call ms at {0} "
          "| 1-step call ms at {1} |".format(small, large))
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [list(rng.integers(args.stops, vocab, args.prompt_len)) for _ in range(batch)]
        key = jax.random.key(args.seed)
        run = {
            n: (lambda n=n: generate(policy, prompts, sampling=SamplingConfig(temperature=1.0),
                                     max_new_tokens=n, key=key, stop_tokens=stops))
            for n in (small, large)
        }
        a, b = run[small](), run[large]()
        longest = int(jnp.max(a.lengths))
        if longest >= small or not (np.array_equal(a.lengths, b.lengths)
                                    and np.array_equal(a.tokens, b.tokens[:, :small])):
            raise SystemExit(f"batch {batch}: the rollouts differ or reach the budget (longest {longest})")
        # The same calls with every token a stop token: one step, so what is left is the
        # per-call cost outside the loop (allocating the cache, the outputs).
        for n in (small, large):
            run[f"1 step {n}"] = (lambda n=n: generate(
                policy, prompts, sampling=SamplingConfig(temperature=1.0), max_new_tokens=n,
                key=key, stop_tokens=list(range(vocab))))
        times = interleaved(run, args.rounds, warmup=True)
        print(f"| {batch} | {longest} | {_ms(times[small]):.1f} | {_ms(times[large]):.1f} | "
              f"{median_ratio(times[large], times[small]):.2f} | {_ms(times[f'1 step {small}']):.1f} | "
              f"{_ms(times[f'1 step {large}']):.1f} |")


def bench_decode(args) -> None:
    capacities = [int(v) for v in args.capacities.split(",")]
    policy = _policy(args, max(capacities))

    @jax.jit
    def decode(p, cache, token):  # `steps` one-token forwards, the cache carried in place
        live = cache.lengths

        def body(i, carry):
            cache, token = carry
            logits, _, cache = p.forward(token, live[:, None], cache)
            cache = dataclasses.replace(cache, lengths=live)  # always the same live tokens
            return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, args.steps, body, (cache, token))[1]

    print(f"decode: tiny policy hidden {args.hidden}, {args.layers} layers, {args.live} live tokens, "
          f"{args.steps} one-token forwards per call")
    head = " | ".join(f"ms/step at {c}" for c in capacities)
    print(f"| batch | {head} | ratio {capacities[-1]}/{capacities[0]} |")
    print("| --- |" + " --- |" * (len(capacities) + 1))
    for batch in (int(b) for b in args.batches.split(",")):
        fns = {}
        for cap in capacities:
            cache = policy.init_cache(batch, cap)
            pre = jnp.ones((batch, args.live), jnp.int32)
            pos = jnp.broadcast_to(jnp.arange(args.live, dtype=jnp.int32), pre.shape)
            _, _, cache = policy.forward(pre, pos, cache)
            token = jnp.ones((batch, 1), jnp.int32)
            fns[cap] = (lambda cache=cache, token=token: decode(policy, cache, token))
        times = interleaved(fns, args.rounds, warmup=True)
        cells = " | ".join(f"{_ms(times[c]) / args.steps:.3f}" for c in capacities)
        print(f"| {batch} | {cells} | {median_ratio(times[capacities[-1]], times[capacities[0]]):.2f} |")


def bench_tree(args) -> None:
    from jaxspec.decoding.drafters import Eagle3Drafter, TreeSpec
    from jaxspec.decoding.protocols import DraftContext
    from jaxspec.models.eagle3 import Eagle3Head

    depths = [int(v) for v in args.depths.split(",")]
    policy = _policy(args, args.live + 64)
    head = Eagle3Head.init_for(policy, policy.config.vocab_size, jax.random.key(args.seed + 1))
    variants = {"carry": "_propose_tree"}
    if args.refeed:
        variants["refeed"] = "_propose_tree_refeed"
    print(f"tree: tiny policy hidden {args.hidden}, EAGLE-3 head, top_k 4, budget = depth, "
          f"{args.live} cached tokens; ms per proposal")
    cols = [f"{v} b{b}" for b in args.batches.split(",") for v in variants]
    print("| depth | " + " | ".join(cols) + (" | refeed/carry |" if args.refeed else " |"))
    print("| --- |" + " --- |" * (len(cols) + bool(args.refeed)))
    for depth in depths:
        drafter = Eagle3Drafter(head, tree=TreeSpec(top_k=4, depth=depth, budget=depth))
        cells, ratios = [], []
        for batch in (int(b) for b in args.batches.split(",")):
            state = drafter.init_state(policy, batch, args.live + 64)
            state = dataclasses.replace(state, cache=dataclasses.replace(
                state.cache, lengths=jnp.full((batch,), args.live, jnp.int32)))
            state = dataclasses.replace(state, last_hidden=jax.random.normal(
                jax.random.key(args.seed), state.last_hidden.shape))
            lengths = jnp.full((batch,), args.live, jnp.int32)

            def make(method):
                def propose(state, lengths):
                    ctx = DraftContext(
                        buffer=jnp.zeros((batch, args.live + 64), jnp.int32), lengths=lengths,
                        key=jax.random.key(0), sampling=SamplingConfig(), sampled=False,
                        rows=jnp.arange(batch, dtype=jnp.int32),
                    )
                    return getattr(drafter, method)(state, policy, ctx)[0]
                return jax.jit(propose)

            fns = {name: make(method) for name, method in variants.items()}
            if args.refeed:
                a, b = fns["carry"](state, lengths), fns["refeed"](state, lengths)
                if not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
                    raise SystemExit(f"depth {depth} batch {batch}: the two proposals differ")
            times = interleaved({n: (lambda f=f: f(state, lengths)) for n, f in fns.items()}, args.rounds, warmup=True)
            cells += [f"{_ms(times[n]):.2f}" for n in variants]
            if args.refeed:
                ratios.append(f"{median_ratio(times['refeed'], times['carry']):.2f}")
        print(f"| {depth} | " + " | ".join(cells) + (f" | {' / '.join(ratios)} |" if args.refeed else " |"))


def bench_chain(args) -> None:
    from jaxspec.decoding.drafters import Eagle3Drafter
    from jaxspec.decoding.protocols import DraftContext
    from jaxspec.models.eagle3 import Eagle3Head

    caps = [int(c) for c in args.capacities.split(",")]
    policy = _policy(args, max(caps))
    head = Eagle3Head.init_for(policy, policy.config.vocab_size, jax.random.key(args.seed + 1))
    drafter = Eagle3Drafter(head, k=args.k, coupled=False)
    print(f"chain: tiny policy hidden {args.hidden}, EAGLE-3 head, k = {args.k}, {args.live} "
          f"cached entries; ms per proposal at head-cache capacities {caps}")
    print("| batch | " + " | ".join(f"{c} slots" for c in caps) + f" | {caps[-1]} / {caps[0]} |")
    print("| --- |" + " --- |" * (len(caps) + 1))
    for batch in (int(b) for b in args.batches.split(",")):
        fns = {}
        for cap in caps:
            state = drafter.init_state(policy, batch, cap)
            state = dataclasses.replace(state, cache=dataclasses.replace(
                state.cache, lengths=jnp.full((batch,), args.live, jnp.int32)))
            lengths = jnp.full((batch,), args.live + 1, jnp.int32)
            buffer = jnp.zeros((batch, cap), jnp.int32)

            @jax.jit
            def proposals(state, lengths, buffer):  # `--steps` proposals, the state carried
                ctx = DraftContext(buffer=buffer, lengths=lengths, key=jax.random.key(0),
                                   sampling=SamplingConfig(), sampled=False)

                def body(i, carry):  # as the engine's loop: the head's cache is loop state
                    state, total = carry
                    tree, _, state = drafter.propose(state, policy, ctx)
                    return state, total + jnp.sum(tree.tokens)
                return jax.lax.fori_loop(0, args.steps, body, (state, jnp.int32(0)))[1]

            fns[cap] = lambda f=proposals, a=(state, lengths, buffer): f(*a)
        times = interleaved(fns, args.rounds, warmup=True)
        print(f"| {batch} | " + " | ".join(f"{_ms(times[c]) / args.steps:.2f}" for c in caps)
              + f" | {median_ratio(times[caps[-1]], times[caps[0]]):.2f} |")


def main(argv=None) -> int:
    args = _parse(argv)
    keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call (jaxspec.host)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    {"rollout": bench_rollout, "decode": bench_decode, "tree": bench_tree,
     "chain": bench_chain}[args.mode](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
