"""scripts/simulate.py: the k sweep, the best k and the explanation."""

import importlib.util
import json
import pathlib

import pytest

from jaxspec.sim import describe

_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "simulate.py"


@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("simulate_cli", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cli, capsys, *argv):
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_k_sweep_names_best_k_and_explains(cli, capsys):
    out = _run(cli, capsys, "--model", "Qwen3-8B", "--gpu", "GB200", "--num-gpus", "32", "--workload", "rl-think")
    lines = out.splitlines()
    table = [ln for ln in lines if ln[:2].strip().isdigit()]
    assert [int(ln.split()[0]) for ln in table] == list(range(1, 8))
    assert "best k = 3" in out
    assert "1/(1-a)" in out and "stops paying" in out
    assert "largest captured CUDA graph" in out


def test_low_acceptance_and_async_flags(cli, capsys):
    out = _run(cli, capsys, "--workload", "rl-zero", "--acceptance", "0.5,0.2,0.05", "--k-max", "5",
               "--async-lag", "1", "--num-gpus", "64")
    assert "async RL, policy lag 1" in out and "best k =" in out
    out = _run(cli, capsys, "--model", "Qwen3-235B-A22B", "--num-gpus", "512", "--workload", "rl-235b",
               "--acceptance", "3.0", "--graph-capture-max-tokens", "none", "--k-max", "4")
    assert "tp=8" in out


def test_calibration_file(cli, capsys, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"verify_decode_cost_ratio": 1.1, "acceptance_length": 2.6, "k": 3}))
    out = _run(cli, capsys, "--calibration", str(path), "--k-max", "4")
    assert "calibrated from" in out and "verify_decode_cost_ratio" in out and "acceptance_length" in out


def test_paper_and_assumptions(cli, capsys):
    out = _run(cli, capsys, "--paper")
    assert "1.77" in out and "2.72" in out and "authors' projection" in out
    out = _run(cli, capsys, "--assumptions")
    for item in describe():
        assert item["name"] in out


def test_docs_list_every_assumption():
    doc = (_PATH.parents[1] / "docs" / "simulator.md").read_text()
    for item in describe():
        assert f"`{item['name']}`" in doc, f"docs/simulator.md does not list {item['name']}"
