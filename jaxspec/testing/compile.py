"""Cheap compiles for tests, through JAX's public `jax_disable_most_optimizations` flag and
XLA's documented `XLA_FLAGS` (`--xla_cpu_use_fusion_emitters=false`: XLA:CPU's older
elemental emitters for fused loops; jaxlib <= 0.10 only, `cheap_xla_flags`: later XLAs
retired those emitters and abort on the flag), and the environment that gives a subprocess the same
compiles (numbers compared across processes then come from the same kind of executable).

Cheap: XLA without its expensive optimisation passes (backend optimisation level 0, LLVM's
expensive passes off) and, up to jaxlib 0.10, without the MLIR fusion emitters: together
about half the compile CPU of a module (tests/decoding/test_engine.py: 93 s -> 47 s on 2
cores of an AMD EPYC).
Both are part of the persistent compilation cache's key, so a cheap executable is never
served to a full compile, nor the reverse.

AS_USERS: the test modules that assert bitwise equalities of the production numerics (and
test_joint_law, whose 2^20-rollout chi-square runs outweigh its compiles). They run compiled
as users compile (default XLA flags, full optimisation) in a pytest process of their own,
which tests/test_compiled_as_users.py starts with `JAXSPEC_TEST_COMPILES=users`; the
emitter flag is read once, when XLA's CPU backend starts, so one process cannot hold both.
"""

import importlib.metadata
import os
import re

import jax

AS_USERS = (
    "tests/decoding/test_batch_invariant.py",
    "tests/decoding/test_hybrid_invariant.py",
    "tests/decoding/test_joint_law.py",
    "tests/kernels/test_batch_invariant_dot.py",
    "tests/models/test_layer_loop.py",
    "tests/rl/test_batch_invariant_logprobs.py",
    "tests/rl/test_reuse_logprobs.py",
)
AS_USERS_ENV = "JAXSPEC_TEST_COMPILES"  # "users" in the process that runs AS_USERS
CHEAP_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"
# The last jaxlib whose XLA knows the flag: XLA retired its legacy CPU emitters in 2026-09
# (openxla/xla#48001) and aborts a process whose XLA_FLAGS name a flag it does not know
# (jaxlib 0.11.2: "Unknown flag in XLA_FLAGS").
_LAST_JAXLIB_WITH_FLAG = (0, 10)
_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"  # the flag's environment variable (read at import)
_cheap = [os.environ.get(_ENV, "").lower() in ("1", "true")]


def cheap_xla_flags() -> list[str]:
    """The XLA_FLAGS entries of a cheap compile that the installed jaxlib accepts: the
    emitter flag up to jaxlib 0.10, none after (there, cheap is the JAX flag alone)."""
    found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("jaxlib"))
    major_minor = (int(found[1]), int(found[2])) if found else (0, 0)
    return [CHEAP_XLA_FLAG] if major_minor <= _LAST_JAXLIB_WITH_FLAG else []


def use_cheap_compiles(cheap: bool) -> None:
    """Compile cheaply (True) or as users do (False) from now on in this process."""
    jax.config.update("jax_disable_most_optimizations", cheap)
    _cheap[0] = cheap


def cheap_compiles() -> bool:
    """Whether this process compiles cheaply now (as set by `use_cheap_compiles`, or by the
    environment variable at start)."""
    return _cheap[0]


def subprocess_env(env: dict) -> dict:
    """`env` (a subprocess's environment) plus what makes the subprocess compile as this
    process compiles now (JAX's flag, and XLA's emitter flag in `XLA_FLAGS`, which a caller
    may have replaced to set a device count), and share this process's persistent
    compilation cache (if it has one), so that a program the suite compiled is a cache read
    there."""
    out = {**env, _ENV: "true" if cheap_compiles() else "false"}
    flags = [f for f in out.get("XLA_FLAGS", "").split() if f != CHEAP_XLA_FLAG]
    out["XLA_FLAGS"] = " ".join(flags + (cheap_xla_flags() if cheap_compiles() else []))
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        out.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return out
