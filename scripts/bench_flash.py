"""Training attention on this machine: kernels.flash's chunked path against the dense mask.

The causal attention of a forward with no cache, forward plus backward (what a training step
runs per layer), timed interleaved for `chunked` (blocked online softmax, custom VJP) and the
dense reference (`tree_attention_reference` over the [B, T, T] mask, as train_attention
"reference" runs it), with each compiled program's temporary memory (XLA's analysis).

    python scripts/bench_flash.py --lengths 1024,4096 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.flash import CausalMask, causal_attention
from jaxspec.kernels.reference import tree_attention_reference


def _programs(b, t, hq, hkv, d, dtype):
    def chunked(q, k, v, valid):
        return causal_attention(q, k, v, valid, implementation="chunked")

    def dense(q, k, v, valid):
        empty = jnp.zeros((b, 0, hkv, d), q.dtype)
        return tree_attention_reference(q, empty, empty, jnp.zeros((b,), jnp.int32), k, v,
                                        CausalMask(valid).dense())

    def step(fn):
        def run(q, k, v, valid):
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, valid), q, k, v)
            return out, vjp(out)
        return jax.jit(run)

    return {"chunked": step(chunked), "dense": step(dense)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--lengths", default="1024,4096", help="comma list of T")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="8,2", help="q heads,kv heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        hq, hkv = (int(x) for x in args.heads.split(","))
    except ValueError:
        parser.error(f"--lengths {args.lengths!r} / --heads {args.heads!r}: want comma lists of "
                     "ints, e.g. --lengths 1024,4096 --heads 8,2")
    if min(lengths) < 1 or hkv < 1 or hq % hkv or args.rounds < 1 or args.batch < 1:
        parser.error(f"--lengths {args.lengths}, --heads {args.heads}, --batch {args.batch}, "
                     f"--rounds {args.rounds}: lengths, batch and rounds >= 1, kv heads dividing "
                     "q heads")
    if args.dtype not in ("float32", "bfloat16"):
        parser.error(f"--dtype {args.dtype!r}; valid: float32, bfloat16")
    b, d, dtype = args.batch, args.head_dim, jnp.dtype(args.dtype)
    rows = []
    for t in lengths:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
        k = jnp.asarray(rng.standard_normal((b, t, hkv, d)), dtype)
        v = jnp.asarray(rng.standard_normal((b, t, hkv, d)), dtype)
        valid = jnp.asarray(np.arange(t)[None, :] < t - t // 8).repeat(b, 0)  # a padded tail
        programs = _programs(b, t, hq, hkv, d, dtype)
        compiled = {name: fn.lower(q, k, v, valid).compile() for name, fn in programs.items()}
        times = {name: [] for name in programs}
        for name, fn in compiled.items():  # warm up
            jax.block_until_ready(fn(q, k, v, valid))
        for _ in range(args.rounds):  # interleaved
            for name, fn in compiled.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, valid))
                times[name].append(time.perf_counter() - start)
        for name in programs:
            row = {"T": t, "impl": name, "median_s": statistics.median(times[name]),
                   "temp_mib": compiled[name].memory_analysis().temp_size_in_bytes / 2**20}
            rows.append(row)
            print(f"T={t:6d} {name:8s} fwd+bwd {row['median_s'] * 1e3:9.1f} ms  "
                  f"temp {row['temp_mib']:9.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": b, "heads": [hq, hkv], "head_dim": d, "dtype": dtype.name,
                       "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
