"""The host process: memory for XLA's CPU runtime, and Python's garbage collector.

XLA's CPU runtime allocates a call's temporaries (a rollout's KV cache, its outputs) afresh
on every call. glibc maps each large block (over 128 KiB to 32 MiB, adaptively) straight
from the OS and unmaps it when freed, so every call page-faults its buffers in again: at
batch 16 with a 2048-token budget that was half of a one-step `generate` call
(docs/BENCHMARKS.md, "Attention over live KV"). `keep_freed_memory` makes malloc serve large
blocks from its heap and keep what is freed for the next call.

Tracing and lowering a JAX program allocate millions of short-lived Python objects, and
Python's cyclic garbage collector starts a pass every 700 net allocations, scanning every
object it tracks, the imported modules' included. `collect_garbage_rarely` makes its passes
rarer and leaves the start-up objects out of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Process-wide, once: large allocations come from malloc's heap (no per-block mmap) and
    freed memory stays in the process (no trimming). The process's resident memory then
    follows its peak instead of shrinking after each call. Returns whether it applied: only
    with glibc (Linux), and not when the environment sets JAXSPEC_KEEP_FREED_MEMORY=0."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("JAXSPEC_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied


GC_THRESHOLD = 10_000  # net allocations between young collections (Python's default: 700)
_gc_tuned: bool | None = None


def collect_garbage_rarely() -> bool:
    """Process-wide, once: Python's cyclic garbage collector starts a young-generation pass
    after GC_THRESHOLD net allocations instead of 700 (the older generations keep their
    ratios), and every object alive now (call it after the imports) is frozen out of its
    scans (`gc.freeze`). Garbage is still freed: by reference counting at once, reference
    cycles at the next pass. It shows where a process compiles (docs/design.md, "Python's
    garbage collector while compiling").

    Returns:
        Whether it applied: not when the environment sets JAXSPEC_COLLECT_GARBAGE_RARELY=0.
    """
    global _gc_tuned
    if _gc_tuned is None:
        _gc_tuned = os.environ.get("JAXSPEC_COLLECT_GARBAGE_RARELY", "1") != "0"
        if _gc_tuned:
            gc.collect()  # what is garbage now is not frozen
            gc.freeze()
            _, older, oldest = gc.get_threshold()
            gc.set_threshold(GC_THRESHOLD, older, oldest)
    return _gc_tuned
