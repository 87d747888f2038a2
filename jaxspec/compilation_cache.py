"""JAX's persistent compilation cache for the scripts and the test suite.

A run compiles its programs (warm-up, draft init, generation, the GRPO step) in the order
of a minute or more on a CPU; with the cache on, a re-run or a `--resume` with the same
shapes, flags and JAX version reads them from disk instead. The cache lives in a per-user
directory, `$JAXSPEC_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/jaxspec/jax`, else
`~/.cache/jaxspec/jax`. `JAXSPEC_COMPILATION_CACHE=0` (or `off`) turns it off; a
`JAX_COMPILATION_CACHE_DIR` the user set is left as it is, with JAX's own thresholds.

Only programs whose compile took at least `MIN_COMPILE_SECONDS` are written: a cache write
costs about twice a small program's compile (docs/BENCHMARKS.md, the test suite), so caching
the many one-operation programs would slow a first run down for nothing.
"""

from __future__ import annotations

import os
import pathlib

ENV = "JAXSPEC_COMPILATION_CACHE"
MIN_COMPILE_SECONDS = 0.2  # programs that compiled faster are not written
MAX_BYTES = 4 << 30  # the directory's size limit (least recently used entries go first)
_OFF = {"0", "off", "false", "no", "none"}


def default_dir() -> pathlib.Path:
    """`$XDG_CACHE_HOME/jaxspec/jax`, else `~/.cache/jaxspec/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxspec" / "jax"


def cache_dir() -> pathlib.Path | None:
    """The directory `enable` uses by default: `$JAXSPEC_COMPILATION_CACHE` (None when it
    says off), else `default_dir()`."""
    value = os.environ.get(ENV)
    if value is None or not value.strip():
        return default_dir()
    if value.strip().lower() in _OFF:
        return None
    return pathlib.Path(value).expanduser()


def enable(directory: str | os.PathLike | None = None, *,
           min_compile_seconds: float = MIN_COMPILE_SECONDS) -> str | None:
    """Turn JAX's persistent compilation cache on in `directory` (default: `cache_dir()`),
    before the first compile. Returns the directory in use, or None when the cache is off
    (JAXSPEC_COMPILATION_CACHE=0, or the directory cannot be created). A
    JAX_COMPILATION_CACHE_DIR set in the environment wins and is returned as it is."""
    import jax

    preset = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if preset:
        return preset
    path = pathlib.Path(directory).expanduser() if directory is not None else cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    # A size limit also makes JAX lock each entry while it reads or writes it, so that
    # processes sharing the directory (pytest-xdist workers, a multi-process run) never read
    # another's half-written entry.
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)
