"""Shared pieces of jaxspec's test suite: independent references, input builders and helpers.

The suite under `tests/` imports these instead of importing other test modules. Each module
is imported on its own (`from jaxspec.testing.laws import law_test`); this package imports
nothing heavy itself. Several helpers read files of a source checkout (`configs/`,
`scripts/`) through `ROOT`, so they work where the repository is checked out, as the suite
runs.

Modules:
    compile: cheap compiles for tests through public JAX flags, and a subprocess's environment
        that compiles the same way.
    laws: float64 NumPy sampling laws (temperature / top-k / top-p) and the chi-square law
        test every statistical test uses, with the suite's significance level.
    toy_law: the toy prefix-dependent target and draft tables and their exact joint law.
    history_trees: brute-force references for the history drafter's trees.
    tree_attention: random tree-attention inputs and a float64 NumPy reference.
    meshes: mesh splits of 8 simulated CPU devices and O(1)-logit random weights.
    scripts: `scripts/*.py` loaded as modules for in-process runs.
    rl: the short tiny GRPO config, the session's warmed-up base, and run comparisons.
    torch_mtp: an independent PyTorch MTP layer (needs torch).
    hf_models: O(1) random weights for tiny transformers models (needs torch).
    suite_profile: per-test wall / CPU / subprocess CPU and JAX compile seconds
        (JAXSPEC_TEST_PROFILE=DIR), summarised by file (`python -m jaxspec.testing.suite_profile DIR`).
    multiprocess_sharding, multiprocess_grpo: worker processes of the multi-process tests
        (`python -m jaxspec.testing.<name> ...`); multiprocess_grpo also launches its runs
        and compares them (tests/rl/test_multiprocess_grpo.py).
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository checkout
