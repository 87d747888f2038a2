"""jaxspec.testing.suite_profile: per-test CPU and compile records, and their summary by file."""

import json

import jax
import jax.numpy as jnp
import pytest

from jaxspec.testing import suite_profile


def test_a_record_counts_this_tests_compile_and_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(suite_profile._PARENT, raising=False)
    recorder = suite_profile.Recorder(str(tmp_path))
    x, y = jnp.arange(7.0).block_until_ready(), jnp.ones(3).block_until_ready()
    recorder.begin()
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.25)(x).block_until_ready()
    sum(range(200_000))
    recorder.end("tests/x.py::t")
    jax.jit(lambda x: x - 1.5)(y).block_until_ready()  # after end: not counted
    recorder.out.close()
    (path,) = tmp_path.glob("*.jsonl")  # main.jsonl, or the xdist worker's name
    (line,) = path.read_text().splitlines()
    row = json.loads(line)
    assert row["test"] == "tests/x.py::t" and row["nested"] is False
    assert row["compiles"] == 1 and row["xla"] > 0 and row["trace"] > 0 and row["lower"] > 0
    assert 0 < row["cpu"] and row["wall"] > 0 and row["subprocess_cpu"] >= 0
    ((name, (compiles, seconds)),) = row["programs"].items()
    assert name == "jit(<lambda>)" and compiles == 1 and seconds == pytest.approx(row["xla"], abs=1e-3)


def test_the_summary_adds_by_file_and_leaves_nested_runs_out_of_all(tmp_path):
    lines = [dict(test="tests/a.py::one", wall=2, cpu=1, subprocess_cpu=5, nested=False, xla=0.5, compiles=2),
             dict(test="tests/a.py::two", wall=3, cpu=2, subprocess_cpu=0, nested=False, xla=1.0, compiles=1),
             dict(test="tests/b.py::t", wall=9, cpu=4, subprocess_cpu=0, nested=True, xla=3, compiles=7)]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    (tmp_path / "main_nested.jsonl").write_text(json.dumps(lines[2]) + "\n")
    table = suite_profile.summarize(str(tmp_path)).splitlines()
    assert table[2] == "| all | 2 | 5 | 3 | 5 | 2 | 3 | 0 | 0 |"
    assert table[3] == "| tests/a.py | 2 | 5 | 3 | 5 | 2 | 3 | 0 | 0 |"  # 1 + 5 > 4: first
    assert table[4] == "| tests/b.py (nested) | 1 | 9 | 4 | 0 | 3 | 7 | 0 | 0 |"


def test_the_program_table_adds_each_function_over_tests_and_files(tmp_path):
    rows = [dict(test="tests/a.py::one", nested=False, programs={"jit(segment)": [2, 3.0], "jit(add)": [5, 0.1]}),
            dict(test="tests/a.py::two", nested=False, programs={"jit(segment)": [1, 1.5]}),
            dict(test="tests/b.py::t", nested=True, programs={"jit(add)": [4, 0.08], "jit(f)": [1, 2.0]})]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = suite_profile.programs(str(tmp_path)).splitlines()
    assert table[2:] == ["| jit(segment) | 3 | 1 | 4 |", "| jit(f) | 1 | 1 | 2 |", "| jit(add) | 9 | 2 | 0 |"]
    assert suite_profile.main([str(tmp_path), "--programs", "--top", "1"]) == 0


def test_an_empty_directory_is_one_error(tmp_path):
    with pytest.raises(SystemExit, match="error: no profile lines"):
        suite_profile.summarize(str(tmp_path))
    (tmp_path / "gw0.jsonl").write_text(json.dumps(dict(test="tests/a.py::t", cpu=1)) + "\n")
    with pytest.raises(SystemExit, match="error: no compiled functions"):
        suite_profile.programs(str(tmp_path))
