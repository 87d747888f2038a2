"""Decode speed against the memory bound: one decode step vs reading the policy's weights.

    python scripts/bench_decode.py --config configs/small.yaml --batches 1,4 --rounds 7

A decode step at small batch must read every weight once, so its floor is
weight bytes / read bandwidth. The read bandwidth is measured here, on the same arrays:
a compiled loop that streams every weight array through a vector-matrix product (all of
the policy's bytes per repetition).
Timed in one process after compiling, interleaved (read, then each variant, every round),
and each row reports the median over rounds of read-time / step-time ("of bound").

Variants: `model.layer_loop` scan (one lax.scan over stacked weights) and unroll (the
per-layer copies that `generate` makes on CPU), each as a bare forward loop (T = 1, the
next token fed back so no step is skipped) and as `generate` (sampling and cache updates
included; the per-call cost of the copies and the prefill is amortised over the steps).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from jaxspec.host import keep_freed_memory
from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.engine import generate
from jaxspec.models import Policy
from jaxspec.timing import interleaved, median_ratio, write_result


def _parse(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a config file whose model (random weights) is timed")
    p.add_argument("--batches", default="1", help="comma list of batch sizes")
    p.add_argument("--context", type=int, default=64, help="cached tokens per row before the timed steps")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timing")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default="bench_decode.json")
    return p.parse_args(argv)


def _forward_loop(policy, batch: int, context: int, steps: int):
    """A compiled loop of `steps` one-token forwards on a cache holding `context` tokens."""
    cache = policy.init_cache(batch, context + 2)
    pre = jnp.zeros((batch, context), jnp.int32)
    _, _, cache = policy.forward(pre, jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), pre.shape), cache)
    pos = jnp.full((batch, 1), context, jnp.int32)

    @jax.jit
    def run(p, c):
        if p.decodes_unrolled(context + 2, batch):
            p = p.unstack_layers()

        def body(i, tok):
            logits, _, _ = p.forward(tok, pos, c)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((batch, 1), jnp.int32))

    return lambda: run(policy, cache)


def _read_loop(policy, steps: int):
    """A compiled loop that streams every weight array through a vector-matrix product
    `steps` times: the fastest way we found to read the bytes on CPU (a plain sum reads at
    about 70% of its rate), so the bound it gives is the one a batch-1 decode can reach."""
    mats = [w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w[None] for w in jax.tree.leaves(policy.params)]

    @jax.jit
    def run(ws):
        def body(i, acc):  # each product depends on the last, so none is hoisted
            return acc + sum(jnp.sum(jnp.full((1, w.shape[0]), 1.0 + acc * 0, w.dtype) @ w) for w in ws) * 1e-9
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

    return lambda: run(mats)


def main(argv=None) -> int:
    args = _parse(argv)
    keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call (jaxspec.host)
    from jaxspec.config import load_config
    from jaxspec.rl.trainer import prepare_run

    plan = prepare_run(load_config(args.config))
    base = Policy.init(plan.model_config, jax.random.key(0))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(base.params))
    print(f"policy {args.config}: {base.num_params / 1e6:.1f}M parameters, {weight_bytes / 1e6:.1f} MB "
          f"({base.config.dtype}), backend {jax.default_backend()}", flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        fns = {"read": _read_loop(base, args.steps)}
        prompts = [[1] * args.context for _ in range(batch)]
        for loop in ("scan", "unroll"):
            policy = base.with_config(layer_loop=loop)
            fns[f"forward/{loop}"] = _forward_loop(policy, batch, args.context, args.steps)
            fns[f"generate/{loop}"] = (lambda p=policy: generate(
                p, prompts, sampling=SamplingConfig(temperature=1.0), max_new_tokens=args.steps,
                key=jax.random.key(0)))
        times = interleaved(fns, args.rounds, warmup=True)
        read = statistics.median(times["read"]) / args.steps
        print(f"batch {batch}: weight read {read * 1e3:.2f} ms ({weight_bytes / read / 1e9:.1f} GB/s)")
        for name in fns:
            if name == "read":
                continue
            of_bound = median_ratio(times["read"], times[name])
            step = statistics.median(times[name]) / args.steps
            rows.append(dict(batch=batch, variant=name, step_ms=step * 1e3, of_bound=of_bound,
                             read_ms=read * 1e3, read_gbs=weight_bytes / read / 1e9))
            print(f"  {name:<16} step {step * 1e3:8.2f} ms   {of_bound:6.1%} of the read bound "
                  f"({weight_bytes / step / 1e9:.1f} GB/s effective)", flush=True)
    write_result(args.json, argv, config=args.config, params=base.num_params,
                 weight_bytes=weight_bytes, steps=args.steps, context=args.context,
                 rounds=args.rounds, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
