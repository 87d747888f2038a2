"""scripts/gpu_profile.py on CPU (XLA:CPU's profiler, a 2-layer tiny policy): the JSON the
GPU run writes, its kernels' times against the wall time, and the inspector's estimate
reading it (jaxspec.gpu_targets.estimate.load_profile)."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "scripts" / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_on_cpu_writes_per_kernel_times(tmp_path, monkeypatch):
    from jaxspec.gpu_targets import estimate

    out = tmp_path / "profile.json"
    hlo_dir = tmp_path / "hlo"
    script = _script()
    # The estimate beside the measured kernels runs on a known GPU only: here it reads the
    # CPU program's HLO as if it ran on an H200 (the code path, not the figures).
    monkeypatch.setattr(script, "_device_target", lambda: "h200")
    assert script.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--set",
                        "model.num_layers=2", "--batches", "2", "--context", "64",
                        "--calls", "1", "--new-tokens", "8", "--programs", "decode,engine",
                        "--json", str(out), "--hlo-dir", str(hlo_dir),
                        "--trace-dir", str(tmp_path / "trace")]) == 0
    result = json.loads(out.read_text())
    assert result["platform"] == "cpu" and result["read_bandwidth_gbps"] > 0
    assert result["skipped"] == []
    cases = {c["program"]: c for c in result["cases"]}
    assert sorted(cases) == ["decode", "engine_k3", "engine_plain"]
    decode = cases["decode"]
    assert decode["iterations"] == 4 and decode["batch"] == 2
    # The kernels' times add up to the total and lie inside the wall time of the calls
    # (XLA:CPU runs one op at a time per thread here; the rest is the host's).
    total_ms = sum(k["total_us"] for k in decode["kernels"]) / 1e3
    assert total_ms == pytest.approx(decode["kernel_ms"])
    assert 0 < decode["busy_ms"] <= decode["kernel_ms"] + 1e-9
    assert decode["busy_ms"] <= decode["span_ms"] + 1e-9 <= decode["wall_ms"] * 1.01
    assert decode["busy_ms"] + decode["gaps"]["total_ms"] == pytest.approx(decode["span_ms"])
    for k in decode["kernels"]:
        assert k["calls"] >= 1 and k["us_per_call"] == pytest.approx(k["total_us"] / k["calls"])
    # Named as the optimized HLO names its instructions (what the estimate matches on).
    text = (hlo_dir / "decode_b2.hlo.txt").read_text()
    named = [k for k in decode["kernels"] if f"%{k['name']} " in text]
    assert sum(k["total_us"] for k in named) >= 0.9 * sum(k["total_us"] for k in decode["kernels"])
    # The raw profile is kept and reads back to the same kernels.
    again = script.kernel_events(str(tmp_path / "trace" / "decode_b2.xplane.pb"))
    assert len(again) == decode["kernel_launches"]
    # The estimate of the program's own HLO, with every measured kernel matched to it.
    assert "estimate_error" not in decode and decode["estimate_per"] == "iteration"
    versus = decode["measured_vs_estimated"]
    assert versus["matched"] >= 1 and versus["measured_us"] > 0
    assert versus["matched"] <= versus["estimated_kernels"] <= decode["estimate"]["kernels"]
    # The engine: plain, then perfect oracle drafts (k = 3) in fewer forwards.
    plain, spec = cases["engine_plain"], cases["engine_k3"]
    assert plain["new_tokens"] == spec["new_tokens"] == 2 * 8
    assert spec["acceptance_length"] == 4.0  # k + 1: drafts from what the verify emits
    assert plain["modules"] and plain["module_handovers"]["count"] >= 0
    assert plain["kernel_ms"] <= plain["wall_ms"] * 1.01
    # The inspector's --profile reader: per kernel, its time and executions per iteration.
    measured = estimate.load_profile(str(out), "decode", 2)
    top = decode["kernels"][0]
    got = measured[estimate.kernel_key(top["name"])]
    assert got["us"] == pytest.approx(top["us_per_call"]) and got["count"] == top["calls"] / 4


def test_profile_rejects_bad_arguments(tmp_path):
    script = _script()
    with pytest.raises(SystemExit, match="--programs prefill"):
        script.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--programs", "prefill",
                     "--json", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit, match="--calls 0"):
        script.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--calls", "0",
                     "--json", str(tmp_path / "p.json")])
