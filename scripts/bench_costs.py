#!/usr/bin/env python
"""What one speculative iteration costs next to a plain one, by policy shape (issue 12).

    python scripts/bench_costs.py --shapes 4x128,4x256,8x256,6x384 --batches 4,8

For each policy shape (layers x hidden; intermediate 2 x hidden, head_dim 32, random
weights, a character-sized vocabulary) and batch: c(1), the time of a one-token policy
forward on a cache holding `--context` tokens; c(k+1)/c(1), a forward of k+1 tokens
against it; and c_head/c(1), one EAGLE-3 head step (its layer and LM head over the same
vocabulary) against it. With acceptance tau at draft length k, speculation's bound is
tau * c(1) / (c(k+1) + k * c_head): these three numbers decide whether a shape can win.

Timing: `--reps` forwards per compiled loop, every variant compiled first, then timed
alternately (A/B/A/B, `--rounds` rounds); each ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.host import keep_freed_memory
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.timing import interleaved, median_ratio


def _parse(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4x128,4x256,8x256", help="comma list of LAYERSxHIDDEN")
    p.add_argument("--batches", default="4,8", help="comma list of batch sizes")
    p.add_argument("--k", type=int, default=3, help="draft length: times a (k+1)-token forward")
    p.add_argument("--vocab", type=int, default=25)
    p.add_argument("--context", type=int, default=50, help="cached tokens per row")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    return p.parse_args(argv)


def _shape(text: str) -> tuple[int, int]:
    try:
        layers, hidden = (int(v) for v in text.lower().split("x"))
    except ValueError:
        layers = hidden = 0
    if layers < 1 or hidden < 64 or hidden % 64:
        raise SystemExit(f"error: --shapes entry {text!r} is invalid: it must be LAYERSxHIDDEN, "
                         f"layers >= 1 and hidden a multiple of 64 (e.g. 4x256)")
    return layers, hidden


def measure(layers: int, hidden: int, batch: int, args) -> dict:
    cfg = ModelConfig.tiny("qwen3", vocab_size=args.vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_layers=layers, num_heads=hidden // 32, num_kv_heads=max(1, hidden // 64),
                           head_dim=32, max_position_embeddings=args.context + args.k + 8)
    policy = Policy.init(cfg, jax.random.key(0))
    head = Eagle3Head.init_for(policy, args.vocab, jax.random.key(1))
    max_len = args.context + args.k + 2
    prefix = jnp.zeros((batch, args.context), jnp.int32)
    pos0 = jnp.broadcast_to(jnp.arange(args.context, dtype=jnp.int32), prefix.shape)
    _, captured, cache = policy.forward(prefix, pos0, policy.init_cache(batch, max_len),
                                        capture=head.capture_layers)
    features = jnp.concatenate([captured[i] for i in head.capture_layers], axis=-1)
    head_cache = head.init_cache(batch, max_len)
    _, head_cache = head.forward(policy.embed(prefix), features, pos0, head_cache, fuse=True)
    reps, ctx = args.reps, args.context

    def policy_loop(p, c, t: int):
        def body(i, acc):  # feed what the last forward chose, so no forward is skipped
            tokens = (jnp.zeros((batch, t), jnp.int32) + acc) % p.config.vocab_size
            positions = jnp.broadcast_to(ctx + jnp.arange(t, dtype=jnp.int32), (batch, t))
            logits, _, _ = p.forward(tokens, positions, c)
            return jnp.argmax(logits[:, :1, :], axis=-1).astype(jnp.int32)
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((batch, 1), jnp.int32))

    def head_loop(h, p, c):
        def body(i, acc):
            hidden_in = jnp.zeros((batch, 1, h.hidden_size), jnp.float32) + acc[..., None]
            out, _ = h.forward(p.embed(acc), hidden_in, jnp.full((batch, 1), ctx, jnp.int32), c, fuse=False)
            logits, _ = h.draft_logits(out[:, 0].astype(jnp.float32), p)
            return jnp.argmax(logits, -1)[:, None].astype(jnp.int32)
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((batch, 1), jnp.int32))

    run_policy = jax.jit(policy_loop, static_argnums=2)
    run_head = jax.jit(head_loop)
    fns = {"c1": lambda: run_policy(policy, cache, 1), "ck": lambda: run_policy(policy, cache, args.k + 1),
           "head": lambda: run_head(head, policy, head_cache)}
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile
    times = interleaved(fns, args.rounds)
    return dict(params=sum(x.size for x in jax.tree.leaves(policy.params)),
                c1_ms=1e3 * float(np.median(times["c1"])) / reps,
                verify=median_ratio(times["ck"], times["c1"]), head=median_ratio(times["head"], times["c1"]))


def main(argv=None) -> int:
    args = _parse(argv)
    keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call (jaxspec.host)
    shapes = [_shape(s) for s in args.shapes.split(",") if s]
    entries = [b.strip() for b in args.batches.split(",") if b.strip()]
    if not entries or not all(b.isdigit() and int(b) > 0 for b in entries):
        raise SystemExit(f"error: --batches {args.batches!r} is invalid: a comma list of ints >= 1")
    batches = [int(b) for b in entries]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; vocab {args.vocab}, context {args.context}")
    k = args.k
    print(f"| policy | params | batch | c(1) | c({k + 1})/c(1) | c_head/c(1) | "
          f"bound at tau = {k + 1} (all accepted) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layers, hidden in shapes:
        for batch in batches:
            r = measure(layers, hidden, batch, args)
            bound = (k + 1) / (r["verify"] + k * r["head"])
            print(f"| {layers} x {hidden} | {r['params'] / 1e6:.2f}M | {batch} | {r['c1_ms']:.2f} ms | "
                  f"{r['verify']:.2f} | {r['head']:.2f} | {bound:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
