"""The test modules that assert bitwise equalities of the production numerics
(`jaxspec.testing.compile.AS_USERS`: batch invariance, log-prob reuse, the unrolled layer
loop, and the joint-law chi-square tests), run compiled as users compile: default XLA flags
and full optimisation, in one pytest process of their own. The rest of the suite compiles
cheaply (tests/conftest.py), with an XLA flag (jaxlib <= 0.10) that is read once per process."""

import os
import pathlib
import subprocess
import sys

from jaxspec.testing.compile import AS_USERS, AS_USERS_ENV, CHEAP_XLA_FLAG

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bitwise_modules_pass_compiled_as_users_compile():
    env = {**os.environ, AS_USERS_ENV: "users",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(CHEAP_XLA_FLAG, "").strip()}
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           *AS_USERS], cwd=ROOT, env=env, capture_output=True, text=True)
    report = done.stdout[-20000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert " passed" in report, report
