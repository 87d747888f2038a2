"""Plug measurements into the simulator in place of its assumptions.

`calibrate(scenario, measurements)` takes a dict (or the path of a JSON file, e.g. the
output of scripts/bench_kernels.py or scripts/bench_rollout.py) and returns the scenario
with these fields overridden:

- `verify_decode_cost_ratio`: measured time of a verify forward over k+1 tokens divided
  by a decode forward at the same batch; replaces the roofline's ratio (scaled linearly
  in k from the draft length it was measured at, `k` / `draft_length`, default 3);
- `per_position_acceptance`: measured per-position acceptance rates, *marginal* (rate
  of drafts whose first i tokens were all accepted, as vLLM and NeMo RL log them);
  becomes the scenario's acceptance profile;
- `acceptance_length`: measured tokens per target forward at draft length `k` (used
  when no per-position rates are given): the constant rate with that expected length;
- any field name of `jaxspec.sim.assumptions.Assumptions` (e.g. `step_overhead_s`).

Other keys (timings, device names, ...) are ignored; the keys that were used are
returned so a caller can report them.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxspec.sim.acceptance import Acceptance
from jaxspec.sim.assumptions import Assumptions
from jaxspec.sim.pipeline import Scenario

__all__ = ["calibrate", "load_measurements", "MEASUREMENT_FIELDS"]

MEASUREMENT_FIELDS = ("verify_decode_cost_ratio", "acceptance_length", "per_position_acceptance")
_K_FIELDS = ("k", "draft_length", "num_speculative_tokens")


def load_measurements(source) -> dict:
    """A measurements dict from a dict, or from the path of a JSON object."""
    if isinstance(source, dict):
        return dict(source)
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"calibration file {path!r} does not exist")
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def calibrate(scenario: Scenario, measurements) -> tuple[Scenario, list[str]]:
    """(scenario with the measured values in place of the assumed ones, keys used)."""
    m = load_measurements(measurements)
    used: list[str] = []
    k_meas = None
    for key in _K_FIELDS:
        if key in m:
            k_meas = int(m[key])
            used.append(key)
            break
    changes: dict = {}

    if "verify_decode_cost_ratio" in m:
        ratio = float(m["verify_decode_cost_ratio"])
        if ratio <= 0:
            raise ValueError(f"verify_decode_cost_ratio must be > 0, got {ratio}")
        changes["verify_decode_cost_ratio"] = ratio
        changes["measured_k"] = k_meas or 3
        used.append("verify_decode_cost_ratio")

    if m.get("per_position_acceptance") is not None:
        changes["acceptance"] = Acceptance.from_marginal(m["per_position_acceptance"])
        used.append("per_position_acceptance")
    elif m.get("acceptance_length") is not None:
        k_ref = k_meas or scenario.drafter.k or 3
        changes["acceptance"] = Acceptance.from_length(float(m["acceptance_length"]), k_ref)
        used.append("acceptance_length")

    names = {f.name for f in dataclasses.fields(Assumptions)}
    overrides = {key: m[key] for key in m if key in names}
    if overrides:
        changes["assumptions"] = scenario.assumptions.replace(**overrides)
        used.extend(sorted(overrides))

    return dataclasses.replace(scenario, **changes), used
