"""Host memory for XLA's CPU runtime.

XLA's CPU runtime allocates a call's temporaries (a rollout's KV cache, its outputs) afresh
on every call. glibc maps each large block (over 128 KiB to 32 MiB, adaptively) straight
from the OS and unmaps it when freed, so every call page-faults its buffers in again: at
batch 16 with a 2048-token budget that was half of a one-step `generate` call
(docs/BENCHMARKS.md, "Attention over live KV"). `keep_freed_memory` makes malloc serve large
blocks from its heap and keep what is freed for the next call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
