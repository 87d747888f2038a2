"""A verify step with a decoder layer's fused kernels against XLA's unfused layer, timed.

    python scripts/bench_fused.py --config configs/qwen3_8b_shape.yaml --batches 1,64 \\
        --tokens 4,16 --context 2048 --rounds 5

The fused Pallas kernels (`model.fused_kernels`, docs/kernels.md) cut the bytes a
verify-sized forward moves (docs/BENCHMARKS.md, "GPU programs compiled without a GPU"), but
they are matmuls with untuned tiles where XLA's are autotuned on the device, so their speed
is a GPU measurement. Per (batch, tokens fed per row): a compiled loop of forwards over a
cache holding `context` tokens per row, the layers unrolled as decoding runs them, with
`fused_kernels` "xla" and "pallas" (the kernels wherever the sizes are whole tiles), timed
interleaved in one process after compiling; each row gives the median over rounds of
xla-time / pallas-time and both against the HBM floor (weights + live KV read once) at
--bandwidth GB/s. On a CPU "pallas" runs interpreted: only a check that the script works.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp


def _parse(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a config whose model (random weights) is timed")
    p.add_argument("--batches", default="1,64", help="comma list of batch sizes")
    p.add_argument("--tokens", default="4,16", help="comma list of tokens fed per row per step")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per row")
    p.add_argument("--steps", type=int, default=8, help="forwards per timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=3350.0,
                   help="HBM GB/s for the floor (H100 SXM: 3350; nominal, not measured)")
    p.add_argument("--json", default="bench_fused.json")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=c")
    return p.parse_args(argv)


def _cache(policy, batch: int, tokens: int, context: int):
    """A cache holding `context` tokens per row with room for `tokens` more."""
    cache = policy.init_cache(batch, context + tokens)
    return dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))


def _loop(policy, cache, batch: int, tokens: int, context: int, steps: int):
    """A compiled loop of `steps` forwards of `tokens` causal tokens per row after `context`
    cached ones (the cache is not advanced: every step is the same verify)."""
    pos = context + jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((tokens, tokens), bool)), (batch, tokens, tokens))

    @jax.jit
    def run(p, c):
        def body(i, tok):
            logits, _, _ = p.forward(tok, pos, c, mask=mask)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((batch, tokens), jnp.int32))

    return lambda: run(policy, cache)


def main(argv=None) -> int:
    args = _parse(argv)
    from jaxspec.timing import interleaved, median_ratio, positive_ints, write_result

    try:
        batches, tokens = positive_ints(args.batches, "batches"), positive_ints(args.tokens, "tokens")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    from jaxspec.config import load_config
    from jaxspec.gpu_targets.inspect import floor_bytes
    from jaxspec.models import Policy
    from jaxspec.rl.trainer import prepare_run

    model = prepare_run(load_config(args.config, args.overrides)).model_config
    base = Policy.init(model, jax.random.key(0))
    print(f"{args.config}: {base.num_params / 1e9:.2f}B parameters ({model.dtype}), backend "
          f"{jax.default_backend()}, attention {model.attention_backend}", flush=True)
    rows = []
    policies = {kind: base.with_config(fused_kernels=kind) for kind in ("xla", "pallas")}
    if base.decodes_unrolled(args.context, 1):  # per-layer weights made once, shared by both
        unrolled = base.unstack_layers().without_stacked_layers()
        policies = {kind: p.replace(params=unrolled.params, layer_params=unrolled.layer_params)
                    for kind, p in policies.items()}
        del unrolled
    del base
    for batch in batches:
        for fed in tokens:  # one cache, read by both (at 8B, batch 64 over 2k: 19 GB)
            cache = _cache(policies["xla"], batch, fed, args.context)
            fns = {kind: _loop(p, cache, batch, fed, args.context, args.steps)
                   for kind, p in policies.items()}
            times = interleaved(fns, args.rounds, warmup=True)
            del fns, cache  # freed before the next size's cache is made
            floor_ms = sum(floor_bytes(model, batch, fed, args.context).values()) / (
                args.bandwidth * 1e9) * 1e3
            step = {k: statistics.median(v) / args.steps * 1e3 for k, v in times.items()}
            row = dict(batch=batch, tokens=fed, xla_ms=step["xla"], pallas_ms=step["pallas"],
                       speedup=median_ratio(times["xla"], times["pallas"]), floor_ms=floor_ms)
            rows.append(row)
            print(f"batch {batch:4d} x {fed:3d} tokens: xla {step['xla']:8.3f} ms, fused "
                  f"{step['pallas']:8.3f} ms, fused speedup {row['speedup']:.3f}x (median of "
                  f"rounds); HBM floor {floor_ms:.3f} ms at {args.bandwidth:.0f} GB/s", flush=True)
    write_result(args.json, argv, config=args.config, context=args.context, steps=args.steps,
                 rounds=args.rounds, bandwidth_gbs=args.bandwidth, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
