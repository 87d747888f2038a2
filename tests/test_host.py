"""`jaxspec.host.keep_freed_memory`: glibc's malloc settings, read back from a subprocess's
malloc_info (an independent view of the allocator)."""

import subprocess
import sys

import pytest

PROBE = """
import ctypes, os, sys
from jaxspec.host import keep_freed_memory
applied = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
# A 64 MiB block: mmapped by default (threshold 128 KiB..32 MiB), from the heap once applied.
block = libc.malloc(64 << 20)
libc.free(block)
libc.malloc_stats()  # to stderr, with "max mmap bytes": the most ever mapped at once
print(applied, keep_freed_memory())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc (Linux) only")
@pytest.mark.parametrize("env", ["1", "0"])
def test_large_blocks_come_from_the_heap_unless_opted_out(env):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={"JAXSPEC_KEEP_FREED_MEMORY": env, "PATH": ""})
    applied, again = out.stdout.split()
    assert applied == again == ("True" if env == "1" else "False")
    max_mapped = int(out.stderr.split("max mmap bytes   =")[1].split()[0])
    # applied: M_MMAP_MAX = 0, so the 64 MiB block came from the heap; opted out: mmapped
    assert (max_mapped < 64 << 20) == (env == "1"), out.stderr
