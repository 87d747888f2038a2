"""Benchmark tree-attention backends against the memory-bandwidth floor.

For every (batch, max_len, nodes) of the grid and every backend it times the
jitted call (warm-up, then back-to-back calls ended by block_until_ready) and
reports:
  - achieved GB/s over the bytes-moved floor (the valid K/V prefix read once,
    plus q, k_new, v_new, mask, lengths read and the output written once);
  - that rate as a fraction of a measured device copy ceiling (a large array
    copy: read + write per element);
  - the verify/decode cost ratio: time with N tree nodes over time with N=1.
Defaults are Qwen3-8B head shapes (32 q heads, 8 kv heads, head_dim 128), bf16.

  python scripts/bench_kernels.py                 # full grid, every backend that runs here
  python scripts/bench_kernels.py --quick         # small CPU grid, reference only on CPU
  python scripts/bench_kernels.py --quick --interpret   # also Pallas in interpret mode

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import platform as pyplatform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxspec.kernels import jax_triton_available, tree_attention
from jaxspec.kernels.reference import tree_attention_reference


def _ints(text: str) -> list[int]:
    """'1,32,128' or '1k,8k' (k = 1024)."""
    return [
        int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v)
        for v in (t.strip() for t in text.split(","))
        if v
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--quick", action="store_true", help="small grid that runs on a CPU in seconds")
    p.add_argument(
        "--backends",
        default=None,
        help="comma list of reference,pallas,triton (default: all that run here; "
        "on CPU only reference)",
    )
    p.add_argument(
        "--interpret",
        action="store_true",
        help="on CPU, also time the Pallas kernel in interpret mode (slow)",
    )
    p.add_argument("--batch", default=None, help="batch sizes (default 1,32,128; quick 1,4)")
    p.add_argument(
        "--max-len", default=None, help="cache slots S, k = 1024 (default 1k,8k; quick 256,1k)"
    )
    p.add_argument(
        "--nodes",
        default=None,
        help="tree sizes N (default 4,16,64; quick 4,16); N=1 (decode) is always added",
    )
    p.add_argument("--q-heads", type=int, default=None, help="default 32 (quick 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="default 8 (quick 2)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (quick 64)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--fill",
        type=float,
        default=1.0,
        help="cache lengths as a fraction of max_len (1.0: full caches)",
    )
    p.add_argument(
        "--ragged",
        action="store_true",
        help="cache lengths uniform in [0, fill*max_len] instead of all equal",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="back-to-back calls per measurement (default 20; quick 5)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="measurements, the median is reported (default 5; quick 3)",
    )
    p.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="size of the copy-ceiling array (default 2048 on GPU, 64 on CPU)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the error check against reference")
    for knob in ("block_k", "block_r", "block_n", "kv_splits", "num_warps", "num_stages"):
        p.add_argument(
            "--" + knob.replace("_", "-"),
            type=int,
            default=None,
            help=f"kernel knob {knob} (default: the backend's)",
        )
    p.add_argument("--out", default="runs/bench_kernels.json")
    args = p.parse_args(argv)
    defaults = dict(
        batch="1,32,128",
        max_len="1k,8k",
        nodes="4,16,64",
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        iters=20,
        reps=5,
    )
    if args.quick:
        defaults.update(
            batch="1,4",
            max_len="256,1k",
            nodes="4,16",
            q_heads=8,
            kv_heads=2,
            head_dim=64,
            iters=5,
            reps=3,
        )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def time_call(fn, inputs, *, iters: int, reps: int) -> float:
    """Median seconds per call: warm-up (compile), then `reps` x (`iters` calls, one block)."""
    jax.block_until_ready(fn(*inputs))
    jax.block_until_ready(fn(*inputs))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*inputs)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def copy_ceiling_gbps(mib: int, *, iters: int, reps: int) -> float:
    """GB/s of a device array copy (x + 1 reads and writes every byte once)."""
    n = mib * 2**20 // 4
    x = jnp.zeros((n,), jnp.float32)
    seconds = time_call(jax.jit(lambda a: a + 1.0), (x,), iters=iters, reps=reps)
    return 2 * n * 4 / seconds / 1e9


@functools.partial(jax.jit, static_argnums=range(9))
def _pseudo_random_arrays(b, s, n, hq, hkv, d, dtype, top, ragged):
    """Inputs from a sine hash of the element index, in one program that compiles fast
    (threefry's is slow to compile on CPU) and keeps big caches on the device."""

    def values(shape, salt):
        i = lax.iota(jnp.float32, math.prod(shape)).reshape(shape)
        frac = jnp.sin(i * 12.9898 + 78.233 * salt) * 43758.5453
        return (4.0 * (frac - jnp.floor(frac)) - 2.0).astype(dtype)  # in [-2, 2)

    if ragged:
        salt = jnp.sin(lax.iota(jnp.float32, b) * 91.7) * 43758.5453
        lengths = ((salt - jnp.floor(salt)) * (top + 1)).astype(jnp.int32)
    else:
        lengths = jnp.full((b,), top, jnp.int32)
    return (
        values((b, n, hq, d), 1),
        values((b, s, hkv, d), 2),
        values((b, s, hkv, d), 3),
        lengths,
        values((b, n, hkv, d), 4),
        values((b, n, hkv, d), 5),
    )


def make_inputs(b, s, n, hq, hkv, d, dtype, fill, ragged):
    q, k_cache, v_cache, lengths, k_new, v_new = _pseudo_random_arrays(
        b, s, n, hq, hkv, d, jnp.dtype(dtype), int(round(fill * s)), bool(ragged)
    )
    # A random tree (each parent drawn among the root and earlier nodes) and its ancestor mask.
    rng = np.random.default_rng(n)
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    anc = np.eye(n, dtype=bool)
    for i in range(n):
        if parents[i] >= 0:
            anc[i] |= anc[parents[i]]
    mask = jnp.asarray(np.broadcast_to(anc, (b, n, n)))
    return q, k_cache, v_cache, lengths, k_new, v_new, mask


def floor_bytes(inputs) -> int:
    """Bytes every implementation must move: valid K/V once, small inputs once, output once."""
    q, k_cache, _, lengths, k_new, _, mask = inputs
    item = q.dtype.itemsize
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    kv = 2 * int(jnp.sum(lengths)) * hkv * d * item
    small = 2 * q.size * item + 2 * k_new.size * item + mask.size + lengths.size * 4
    return kv + small


def main(argv=None):
    args = parse_args(argv)
    platform = jax.default_backend()
    dtype = jnp.dtype(args.dtype)
    if args.backends:
        backends = [b for b in args.backends.split(",") if b]
    elif platform == "gpu":
        backends = ["reference", "pallas"] + (["triton"] if jax_triton_available() else [])
    else:
        backends = ["reference"] + (["pallas"] if args.interpret else [])
    knobs = {
        k: getattr(args, k)
        for k in ("block_k", "block_r", "block_n", "kv_splits", "num_warps", "num_stages")
        if getattr(args, k) is not None
    }
    copy_mib = args.copy_mib or (2048 if platform == "gpu" else 64)
    ceiling = copy_ceiling_gbps(copy_mib, iters=args.iters, reps=args.reps)
    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({platform}); copy ceiling {ceiling:.1f} GB/s "
        f"({copy_mib} MiB); backends: {', '.join(backends)}"
    )

    nodes = sorted(set([1] + _ints(args.nodes)))
    rows = []
    header = (
        f"{'backend':<10}{'B':>5}{'S':>7}{'N':>5}{'ms':>10}{'GB/s':>9}{'%ceil':>7}"
        f"{'verify/decode':>15}{'rel.err':>10}"
    )
    print(header)
    print("-" * len(header))
    for b in _ints(args.batch):
        for s in _ints(args.max_len):
            decode_ms = {}
            for n in nodes:
                inputs = make_inputs(
                    b,
                    s,
                    n,
                    args.q_heads,
                    args.kv_heads,
                    args.head_dim,
                    dtype,
                    args.fill,
                    args.ragged,
                )
                nbytes = floor_bytes(inputs)
                ref_out = None
                for backend in backends:
                    extra = dict(knobs) if backend != "reference" else {}
                    fn = jax.jit(functools.partial(tree_attention, backend=backend, **extra))
                    row = dict(
                        backend=backend,
                        batch=b,
                        max_len=s,
                        nodes=n,
                        q_heads=args.q_heads,
                        kv_heads=args.kv_heads,
                        head_dim=args.head_dim,
                        dtype=args.dtype,
                        fill=args.fill,
                        ragged=args.ragged,
                        floor_bytes=nbytes,
                        knobs=extra,
                    )
                    try:
                        sec = time_call(fn, inputs, iters=args.iters, reps=args.reps)
                    except Exception as e:  # report and go on (e.g. out of memory)
                        row["error"] = repr(e)[:300]
                        rows.append(row)
                        print(f"{backend:<10}{b:>5}{s:>7}{n:>5}  failed: {repr(e)[:80]}")
                        continue
                    err = None
                    if not args.no_check:
                        if ref_out is None:
                            with jax.default_matmul_precision("highest"):
                                ref_out = jax.jit(tree_attention_reference)(*inputs)
                        out = fn(*inputs).astype(jnp.float32)
                        ref32 = ref_out.astype(jnp.float32)
                        err = float(jnp.max(jnp.abs(out - ref32)) / jnp.max(jnp.abs(ref32)))
                    ms = sec * 1e3
                    if n == 1:
                        decode_ms[backend] = ms
                    gbps = nbytes / sec / 1e9
                    ratio = ms / decode_ms[backend] if backend in decode_ms else math.nan
                    row.update(
                        ms=ms,
                        gbps=gbps,
                        frac_of_copy=gbps / ceiling,
                        verify_over_decode=ratio,
                        rel_err=err,
                    )
                    rows.append(row)
                    err_s = "-" if err is None else f"{err:.1e}"
                    print(
                        f"{backend:<10}{b:>5}{s:>7}{n:>5}{ms:>10.3f}{gbps:>9.1f}"
                        f"{100 * gbps / ceiling:>6.0f}%{ratio:>15.2f}{err_s:>10}"
                    )
                del inputs, ref_out
    result = dict(
        device=str(device.device_kind),
        platform=platform,
        jax=jax.__version__,
        host=pyplatform.node(),
        copy_ceiling_gbps=ceiling,
        copy_mib=copy_mib,
        iters=args.iters,
        reps=args.reps,
        argv=sys.argv[1:] if argv is None else list(argv),
        rows=rows,
    )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
