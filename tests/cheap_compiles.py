"""Cheap compiles for the suite (switched per module by tests/conftest.py), and the
environment that gives a subprocess the same ones, so that numbers compared across
processes come from the same executables.

Cheap: without XLA's expensive optimisation passes (jax_disable_most_optimizations), and
with XLA:CPU's older elemental emitters for fused loops instead of the MLIR fusion emitters
(XLA_OPTIONS). Measured on 2 cores, the backend compile of one generation loop (EAGLE-3
tree, tiny policy) takes ~8 s with the defaults, ~4 s without the optimisation passes and
~1.6 s with both.
"""

import jax
from jax._src import compiler

XLA_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_cheap = [False]


def use(cheap: bool) -> None:
    """Compile cheaply (True) or as users do (False) from now on in this process."""
    jax.config.update("jax_disable_most_optimizations", cheap)
    _cheap[0] = cheap


def install() -> None:
    """Make every compile in this process take XLA_OPTIONS while `use(True)` holds (through
    jax's private compiler.get_compile_options, the hook that `jit(compiler_options=)` feeds).
    They are part of the persistent cache key: a cheap executable is never served to a full
    compile."""
    get_compile_options = compiler.get_compile_options

    def with_options(*args, env_options_overrides=None, **kwargs):
        # XLA_OPTIONS are XLA:CPU's; a GPU compile rejects them ("No such compile option").
        backend = kwargs.get("backend")
        platform = backend.platform if backend is not None else jax.default_backend()
        if _cheap[0] and platform == "cpu":
            env_options_overrides = {**XLA_OPTIONS, **(env_options_overrides or {})}
        return get_compile_options(*args, env_options_overrides=env_options_overrides, **kwargs)

    compiler.get_compile_options = with_options


def subprocess_env(env: dict) -> dict:
    """`env` (a subprocess's environment, XLA_FLAGS included) plus what makes the subprocess
    compile as this process compiles now."""
    if not _cheap[0]:
        return env
    if jax.default_backend() != "cpu":
        return {**env, "JAX_DISABLE_MOST_OPTIMIZATIONS": "true"}
    flags = " ".join(f"--{name}={str(value).lower()}" for name, value in XLA_OPTIONS.items())
    return {**env, "JAX_DISABLE_MOST_OPTIMIZATIONS": "true",
            "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {flags}".strip()}
