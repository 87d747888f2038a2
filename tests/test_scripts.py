"""Script entry points refuse bad input with one clear message before compiling."""

import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _main(script):
    return runpy.run_path(str(ROOT / "scripts" / script), run_name="not_main")["main"]


def test_train_draft_needs_a_new_eagle3_head(capsys):
    code = _main("train_draft.py")([str(ROOT / "configs" / "tiny.yaml"), "draft.kind=ngram"])
    assert code == 2
    err = capsys.readouterr().err
    assert "config key 'draft.kind' = 'ngram'" in err and "valid: eagle3" in err


def test_bench_rollout_rejects_unknown_drafters(tmp_path):
    main = _main("bench_rollout.py")
    with pytest.raises(SystemExit, match=r"--drafters \['magic'\] unknown"):
        main(["--policy", str(tmp_path), "--drafters", "magic"])
    with pytest.raises(SystemExit, match="need --eagle3 DIR"):
        main(["--policy", str(tmp_path), "--drafters", "eagle3"])
    with pytest.raises(SystemExit, match=r"--ks must be >= 1"):
        main(["--policy", str(tmp_path), "--ks", "0,3"])


def test_bench_costs_rejects_bad_shapes_and_batches():
    main = _main("bench_costs.py")
    with pytest.raises(SystemExit, match=r"--shapes entry '4x100' is invalid"):
        main(["--shapes", "4x100"])
    with pytest.raises(SystemExit, match=r"--shapes entry 'big' is invalid"):
        main(["--shapes", "big"])
    with pytest.raises(SystemExit, match=r"--batches '4,0' is invalid"):
        main(["--shapes", "2x64", "--batches", "4,0"])


def test_gpu_session_refuses_an_unknown_phase(tmp_path):
    """scripts/gpu_session.sh (run on a lent GPU only) parses, and names its phases."""
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "nonsense"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown phase nonsense" in done.stdout and "rollout_invariant" in done.stdout
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stdout


def test_bench_fused_times_both_variants_and_refuses_bad_sizes(tmp_path):
    """scripts/bench_fused.py (a GPU measurement; here the fused kernels run interpreted):
    one tiny row with both variants timed, and one clear error for a bad size list."""
    import json

    main = _main("bench_fused.py")
    with pytest.raises(SystemExit, match=r"error: --tokens '4,0': want a comma list of positive ints"):
        main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--tokens", "4,0"])
    out = tmp_path / "fused.json"
    assert main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--batches", "2", "--tokens",
                 "8", "--context", "16", "--steps", "1", "--rounds", "1", "--json", str(out),
                 "model.head_dim=32"]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["tokens"] == 8 and row["xla_ms"] > 0 and row["pallas_ms"] > 0


def test_an_abbreviated_option_is_refused_not_taken_for_the_full_one(capsys):
    """`--resum` is not silently `--resume` (argparse's allow_abbrev): exit 2 naming it."""
    parse = runpy.run_path(str(ROOT / "scripts" / "train_grpo.py"), run_name="not_main")["_parse"]
    assert parse(["configs/tiny.yaml", "--resume"]).resume
    with pytest.raises(SystemExit) as info:
        parse(["configs/tiny.yaml", "--resum"])
    assert info.value.code == 2 and "unrecognized arguments: --resum" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # train_draft's --mtp-layout
        _main("train_draft.py")(["configs/tiny.yaml", "--mtp", "deepseek_v3"])


def test_every_script_parser_refuses_abbreviations():
    import ast

    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                kw = {k.arg: k.value for k in node.keywords}
                assert "allow_abbrev" in kw and kw["allow_abbrev"].value is False, path.name
