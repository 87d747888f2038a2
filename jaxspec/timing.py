"""Interleaved timing for the benchmark scripts (scripts/bench_*.py).

The machines are shared and noisy, so variants are timed alternately (A, B, A, B, ...) in
one process after compiling, and a comparison is the median of the per-round ratios: load
that changes between rounds cancels out of each ratio.
"""

from __future__ import annotations

import statistics
import time

import jax


def interleaved(fns: dict, rounds: int, *, warmup: bool = False, rotate: bool = True) -> dict:
    """{name: [seconds of round 1, round 2, ...]}: each fn called once per round.

    rotate=True starts round r at the (r mod n)-th fn, so that no fn always runs first (or
    right after the same one): on this CPU a fixed order alone moved the ratio of two calls
    of one program by 2-3%. warmup=True calls every fn once first (compiles); otherwise the
    caller has."""
    if warmup:
        for fn in fns.values():
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return times


def machine() -> str:
    """The machine a benchmark ran on, for its JSON: architecture, CPU model (from
    /proc/cpuinfo where there is one), CPU count and JAX's device kind. The same command
    measured 1.50x on one 2-core machine and 0.77x on another (docs/BENCHMARKS.md, "The main
    job on a faster CPU"), so a figure without its CPU model cannot be compared."""
    import os
    import platform

    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return (f"{platform.machine()} {model} cpus={os.cpu_count()} "
            f"device={jax.devices()[0].device_kind}").replace("  ", " ")


def median_ratio(num, den) -> float:
    """The median over rounds of num[i] / den[i] (two lists of interleaved timings)."""
    return float(statistics.median(a / b for a, b in zip(num, den, strict=True)))


def positive_ints(text: str, flag: str) -> list[int]:
    """A benchmark script's comma list of positive ints (--batches 1,64), or a ValueError
    naming the flag and the value."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--{flag} {text!r}: want a comma list of positive ints, e.g. 1,64")
    return values


def write_result(path: str, argv, **fields) -> None:
    """A benchmark's JSON: `fields` plus the machine, JAX's backend and the script's argv
    (`argv` as main() got it; None: the command line), written to `path`."""
    import json
    import sys

    result = dict(machine=machine(), backend=jax.default_backend(), **fields,
                  argv=sys.argv[1:] if argv is None else list(argv))
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {path}")
