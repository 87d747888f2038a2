"""The calibration hook: measured numbers replace the assumed ones."""

import json

import pytest

from jaxspec.sim import calibrate, compare, simulate_step
from jaxspec.sim.paper import rl_8b


def test_measured_verify_ratio_replaces_the_roofline():
    s, used = calibrate(rl_8b("rl-zero"), {"verify_decode_cost_ratio": 1.0, "k": 3})
    assert used == ["k", "verify_decode_cost_ratio"]
    cost = s.step_cost()
    assert cost.verify(64, 64e3) == pytest.approx(cost.decode(64, 64e3))
    slow, _ = calibrate(rl_8b("rl-zero"), {"verify_decode_cost_ratio": 2.0})
    assert compare(slow).generation_speedup < compare(s).generation_speedup


def test_measured_acceptance_length_and_per_position_rates():
    s, used = calibrate(rl_8b("rl-think"), {"acceptance_length": 2.8})
    assert used == ["acceptance_length"]
    assert s.acceptance_length == pytest.approx(2.8)
    assert s.with_k(5).acceptance_length > 2.8
    s, used = calibrate(rl_8b("rl-think"), {"per_position_acceptance": [0.8, 0.55, 0.35], "acceptance_length": 9})
    assert used == ["per_position_acceptance"]  # per-position rates win over a length
    assert s.acceptance_length == pytest.approx(1 + 0.8 + 0.55 + 0.35)


def test_json_file_unknown_keys_and_assumption_overrides(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"acceptance_length": 2.5, "draft_length": 2, "device": "H200",
                                "step_overhead_s": 0.002}))
    base = rl_8b("rl-zero")
    s, used = calibrate(base, str(path))
    assert used == ["draft_length", "acceptance_length", "step_overhead_s"]
    assert s.with_k(2).acceptance_length == pytest.approx(2.5)
    assert s.assumptions.step_overhead_s == 0.002
    assert simulate_step(s.plain()).generation_s > simulate_step(base.plain()).generation_s
    with pytest.raises(FileNotFoundError, match="does not exist"):
        calibrate(base, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="non-increasing"):
        calibrate(base, {"per_position_acceptance": [0.3, 0.6]})
