"""Backend selection and input errors of `tree_attention` (no kernel runs here)."""

import numpy as np
import pytest

from jaxspec import kernels
from jaxspec.kernels import BACKENDS, resolve_backend, tree_attention


def _inputs(b=2, n=3, hq=4, hkv=2, d=8, s=5):
    z = np.zeros
    return [
        z((b, n, hq, d), np.float32),
        z((b, s, hkv, d), np.float32),
        z((b, s, hkv, d), np.float32),
        np.array([0, s][:b], np.int32),
        z((b, n, hkv, d), np.float32),
        z((b, n, hkv, d), np.float32),
        np.ones((b, n, n), bool),
    ]


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(ValueError, match="'cuda'.*" + ", ".join(BACKENDS)):
        tree_attention(*_inputs(), backend="cuda")


def test_triton_off_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="'triton' needs a CUDA GPU.*'cpu'"):
        tree_attention(*_inputs(), backend="triton")


def test_auto_picks_per_platform(monkeypatch):
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("auto", "tpu") == "reference"
    # pallas on a GPU whether or not jax-triton imports: the kernel that reads a stacked
    # cache's layer in place (the triton backend slices it: a copy per layer per step)
    for available in (True, False):
        monkeypatch.setattr(kernels, "jax_triton_available", lambda: available)
        assert resolve_backend("auto", "gpu") == "pallas"
    for name in ("reference", "pallas", "triton"):
        assert resolve_backend(name, "gpu") == name


def test_jax_triton_is_unavailable_on_a_cpu_jaxlib():
    assert kernels.jax_triton_available() is False


@pytest.mark.parametrize(
    "index, bad, message",
    [
        (1, np.zeros((2, 5, 2, 4), np.float32), "k_cache has shape"),
        (3, np.zeros((3,), np.int32), "cache_lengths has shape"),
        (4, np.zeros((2, 2, 2, 8), np.float32), "k_new has shape"),
        (6, np.ones((2, 3, 4), bool), "tree_mask has shape"),
        (0, np.zeros((2, 3, 3, 8), np.float32), "multiple of kv heads"),
    ],
)
def test_malformed_inputs_are_named(index, bad, message):
    args = _inputs()
    args[index] = bad
    with pytest.raises(ValueError, match=message):
        tree_attention(*args, backend="reference")


def test_kernel_backends_need_one_dtype():
    args = _inputs()
    args[0] = args[0].astype(np.float16)
    with pytest.raises(ValueError, match="one dtype"):
        tree_attention(*args, backend="pallas")
