"""Shared test set-up: persistent compilation cache, CPU determinism, the gpu marker."""

import gc
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", os.environ.get("JAXSPEC_TEST_PLATFORMS", "cpu"))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402  (reads JAX_PLATFORMS; starts no backend yet)
import pytest  # noqa: E402

from jaxspec import compilation_cache  # noqa: E402
from jaxspec.testing.compile import AS_USERS, cheap_xla_flags, use_cheap_compiles  # noqa: E402

# The suite's processes compile cheaply (jaxspec.testing.compile): with jaxlib <= 0.10 also
# XLA:CPU's older fusion emitters, a flag XLA reads when its backend starts, so before
# anything runs on it. The modules listed in AS_USERS run compiled as users compile, in a
# process of their own (tests/test_compiled_as_users.py sets JAXSPEC_TEST_COMPILES=users).
_AS_USERS_RUN = os.environ.get("JAXSPEC_TEST_COMPILES") == "users"
if not _AS_USERS_RUN and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = " ".join([os.environ["XLA_FLAGS"], *cheap_xla_flags()])

# One cache shared by the pytest-xdist workers (`-n 2`) and the subprocesses tests launch (they
# inherit the environment): a program one worker compiled is a cache read for the other. JAX
# writes cache entries in place; a size limit turns on its file lock around every read and
# write, so no process reads another's half-written entry. The limit itself (4 GiB) is far
# above the suite's ~100 MiB.
# The scripts' mechanism (jaxspec.compilation_cache), in the checkout's .jax_cache; the
# scripts a test runs in-process or as a subprocess use it too (JAXSPEC_COMPILATION_CACHE).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".jax_cache" / "shared"
os.environ.setdefault(compilation_cache.ENV, str(_CACHE))
compilation_cache.enable(os.environ[compilation_cache.ENV])


# Compile time dominates the suite, so test programs compile cheaply
# (jaxspec.testing.compile: JAX's public jax_disable_most_optimizations and, where jaxlib
# has it, the emitter flag above), except the AS_USERS modules, which assert bitwise
# equalities of the production numerics (and test_joint_law, whose 2^20-rollout chi-square runs outweigh its compiles).
# Subprocesses that tests compare against compile as the test does
# (jaxspec.testing.compile.subprocess_env; XLA_FLAGS is inherited).


def _as_users(module_path: str) -> bool:
    return any(pathlib.Path(module_path).as_posix().endswith(m) for m in AS_USERS)


@pytest.fixture(autouse=True, scope="session")
def _collect_garbage_rarely():
    """As the scripts do (jaxspec.host.collect_garbage_rarely; docs/design.md), after
    importing the package's heavy modules, so that they are frozen out of the collector's
    scans. Session-scoped and autouse: it runs before any module's fixtures."""
    import jaxspec.decoding  # noqa: F401
    import jaxspec.rl.trainer  # noqa: F401
    from jaxspec.host import collect_garbage_rarely

    collect_garbage_rarely()


@pytest.fixture(autouse=True, scope="module")
def _release_executables(request):
    """Cheap compiles (above) unless the module is listed; then drop every compiled
    executable after the module. Each XLA CPU executable keeps tens to hundreds of memory
    mappings; one pytest process that keeps all of the suite's
    (~600 tests) passed Linux's default vm.max_map_count (65,530) and crashed inside XLA
    (SIGSEGV writing the compilation cache, SIGABRT compiling). The persistent cache makes
    a later module's recompile of a shared function a cache read."""
    use_cheap_compiles(not _as_users(str(request.path)))
    yield
    jax.clear_caches()
    gc.collect()


if os.environ.get("JAXSPEC_TEST_PROFILE"):  # per-test CPU and compile seconds (suite_profile)
    from jaxspec.testing.suite_profile import Recorder

    _RECORDER = Recorder(os.environ["JAXSPEC_TEST_PROFILE"])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _RECORDER.begin()
        yield
        _RECORDER.end(item.nodeid)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


# The files that take longest, longest first (their tests' summed times in `--durations=40`
# of a `-n 2` run). With `--dist loadfile --no-loadscope-reorder` xdist hands files to the
# workers in collection order, so a long file never starts last while the other worker runs
# out of work (xdist's default order, by number of tests, put most of these at the end).
LONGEST_FIRST = (
    "tests/rl/test_multiprocess_grpo.py",  # two multi-process comparisons (3 processes each)
    "tests/rl/test_faults.py",
    "tests/test_compiled_as_users.py",  # the AS_USERS modules, one process beside the suite
    "tests/rl/test_trainer.py",
    "tests/decoding/test_adaptive.py",
    "tests/decoding/test_oracle.py",
    "tests/rl/test_main_job.py",
    "tests/decoding/test_cache_growth.py",
    "tests/decoding/test_block.py",
    "tests/decoding/test_split_invariance.py",
    "tests/rl/test_real_config.py",
    "tests/rl/test_adaptive_k_run.py",
    "tests/rl/test_mtp_training.py",
    "tests/decoding/test_continuous_batching.py",
)


# The quick tier (`python -m pytest -m quick -n 2`, README "Tests"): the files that guard the
# promises (exactness: speculative == plain, lossless verification, HF parity; bad inputs:
# one clear error before compiling; resume: bitwise, the config check, the finished run),
# marked here whole, besides the tests marked `quick` one by one. The whole suite (CI's)
# still runs every test.
QUICK = (
    "tests/decoding/test_engine.py",
    "tests/decoding/test_verify.py",
    "tests/decoding/test_sampling.py",
    "tests/models/test_hf.py",
    "tests/decoding/test_generate_errors.py",
    "tests/rl/test_bad_inputs.py",
    "tests/rl/test_prompt_lengths.py",
    "tests/test_config.py",
    "tests/test_draft_kinds.py",
    "tests/rl/test_resume.py",
    "tests/rl/test_resume_config.py",
    "tests/test_checkpoint.py",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    quick = pytest.mark.quick
    for item in items:
        if item.nodeid.split("::")[0] in QUICK:
            item.add_marker(quick)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
    if not _AS_USERS_RUN:
        here = pytest.mark.skip(reason="compiled as users compile, in tests/test_compiled_as_users.py's "
                                       "process (run here with JAXSPEC_TEST_COMPILES=users)")
        for item in items:
            if _as_users(str(item.path)):
                item.add_marker(here)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run with JAXSPEC_TEST_PLATFORMS=cuda on one")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not a folder named gpu
            item.add_marker(skip)
