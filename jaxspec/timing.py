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


def median_ratio(num, den) -> float:
    """The median over rounds of num[i] / den[i] (two lists of interleaved timings)."""
    return float(statistics.median(a / b for a, b in zip(num, den, strict=True)))
