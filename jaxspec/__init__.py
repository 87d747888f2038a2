"""jaxspec: GRPO post-training in JAX with rollouts from lossless speculative decoding."""

import os as _os
import re as _re

__version__ = "0.1.0"


def _cpu_pool_room() -> None:
    """Room in XLA:CPU's thread pool for collectives between simulated host devices.

    With several CPU devices in one process (`--xla_force_host_platform_device_count=N` or
    JAX_NUM_CPU_DEVICES), XLA runs every device's part of a sharded program on one pool of
    max(cores, N) threads, and a collective waiting for its peers holds a thread. A program
    with two independent collectives per device (a layer scan's tensor-axis all-reduce and a
    data-axis reduction beside it) can have 2N waiting at once; on a 2-core machine the pool
    of N then runs out, the peers never start, and XLA aborts the process after 40 s
    ("Termination timeout for `all reduce RendezvousKey{...}`", seen in CI). XLA sizes the
    pool from PJRT_NPROC when it is set: give it 4 threads per device (idle threads cost
    nothing), unless the user chose. It must be set before the CPU backend starts, which
    importing jaxspec precedes."""
    if "PJRT_NPROC" in _os.environ or "NPROC" in _os.environ:
        return
    found = _re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                        _os.environ.get("XLA_FLAGS", ""))
    devices = max([int(n) for n in found] + [int(_os.environ.get("JAX_NUM_CPU_DEVICES") or 1)])
    if devices > 1:
        _os.environ["PJRT_NPROC"] = str(max(4 * devices, _os.cpu_count() or 1))


_cpu_pool_room()
