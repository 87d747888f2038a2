"""`jaxspec.host`: glibc's malloc settings, read back from a subprocess's malloc_info (an
independent view of the allocator), and the garbage collector's, read back from Python's `gc`
in a subprocess."""

import ast
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


GC_PROBE = """
import gc, weakref
from jaxspec.host import collect_garbage_rarely
before = gc.get_threshold()
applied = collect_garbage_rarely()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after the call
freed = []
weakref.finalize(a, freed.append, True)
del a, b
gc.collect()
print((applied, collect_garbage_rarely(), before, gc.get_threshold(), gc.get_freeze_count() > 0,
       freed == [True]))
"""


@pytest.mark.parametrize("env", ["1", "0"])
def test_the_collector_runs_rarely_and_still_frees_cycles_unless_opted_out(env):
    out = subprocess.run([sys.executable, "-c", GC_PROBE], capture_output=True, text=True,
                         check=True, env={"JAXSPEC_COLLECT_GARBAGE_RARELY": env, "PATH": ""})
    applied, again, before, after, frozen, freed = ast.literal_eval(out.stdout)
    assert before == (700, 10, 10)  # Python's defaults
    if env == "1":
        assert (applied, again, after, frozen) == (True, True, (10_000, 10, 10), True)
    else:
        assert (applied, again, after, frozen) == (False, False, before, False)
    assert freed  # the cycle was collected either way
