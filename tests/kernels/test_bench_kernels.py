"""scripts/bench_kernels.py on a CPU: its byte floor, its table rows, its JSON."""

import importlib.util
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_kernels", ROOT / "scripts/bench_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floor_bytes_counts_the_valid_prefix_once():
    bench = _bench()
    b, s, n, hq, hkv, d = 2, 64, 4, 8, 2, 16
    z = np.zeros
    inputs = (
        z((b, n, hq, d), np.float32),
        z((b, s, hkv, d), np.float32),
        z((b, s, hkv, d), np.float32),
        np.array([10, 64], np.int32),
        z((b, n, hkv, d), np.float32),
        z((b, n, hkv, d), np.float32),
        np.ones((b, n, n), bool),
    )
    kv = 2 * (10 + 64) * hkv * d * 4  # K and V of the valid slots
    small = 2 * b * n * hq * d * 4 + 2 * b * n * hkv * d * 4 + b * n * n + b * 4
    assert bench.floor_bytes(inputs) == kv + small
    assert bench._ints("1,32, 128") == [1, 32, 128]
    assert bench._ints("1k,8k") == [1024, 8192]


def test_quick_run_writes_one_row_per_backend_and_size(tmp_path):
    bench = _bench()
    out = tmp_path / "bench.json"
    result = bench.main(
        [
            "--quick",
            "--batch",
            "2",
            "--max-len",
            "64",
            "--nodes",
            "4",
            "--iters",
            "1",
            "--reps",
            "1",
            "--copy-mib",
            "1",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["platform"] == "cpu" and saved["copy_ceiling_gbps"] > 0
    rows = saved["rows"]
    assert [(r["backend"], r["nodes"]) for r in rows] == [("reference", 1), ("reference", 4)]
    assert all(r["ms"] > 0 for r in rows)
    assert result["rows"] == rows
