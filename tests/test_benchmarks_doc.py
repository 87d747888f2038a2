"""docs/BENCHMARKS.md is what scripts/benchmarks_doc.py makes of docs/results/*.json, and the
script refuses results that do not follow the format with one `error:` line."""

import json
import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = runpy.run_path(str(ROOT / "scripts" / "benchmarks_doc.py"), run_name="not_main")
main = DOC["main"]


def _section(title, order, figures, rows=(("1", "2.00x"),)):
    return {"title": title, "order": order, "intro": f"About {title}.",
            "summary": [{"figure": f, "value": v, "baseline": "plain", "machine": "CPU: test",
                         "commit": "abc1234", "command": "python scripts/x.py --a | b"}
                        for f, v in figures],
            "tables": [{"caption": f"{title} table", "command": "python scripts/x.py",
                        "machine": "CPU: test", "commit": "abc1234", "columns": ["batch", "speedup"],
                        "rows": [list(r) for r in rows], "notes": "A note."}]}


def _write(directory, name, doc):
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(json.dumps(doc), encoding="utf-8")


def test_the_committed_page_is_up_to_date(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_every_committed_summary_figure_is_on_the_page():
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    summary = page.split("## Summary", 1)[1].split("\n## ", 1)[0]
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert f"\n## {doc['title']}\n" in page, path.name
        for row in doc["summary"]:
            assert row["figure"].replace("|", "\\|") in summary, (path.name, row["figure"])


def test_page_layout_and_check(tmp_path, capsys):
    results, out = tmp_path / "results", tmp_path / "BENCH.md"
    _write(results, "b.json", _section("Second", 20, [("fig B", "3.0x")]))
    _write(results, "a.json", _section("First", 10, [("fig A1", "1.5x"), ("fig A2", "0.9x")],
                                       rows=[(1, "2.41x"), (4, 2.07)]))
    assert main(["--results", str(results), "--output", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    lines = text.splitlines()
    # the summary table comes first, its rows in section order, then the sections in order
    assert text.index("## Summary") < text.index("## First") < text.index("## Second")
    head = lines.index("| figure | value | baseline | machine | commit | command | section |")
    assert lines[head + 2] == ("| fig A1 | 1.5x | plain | CPU: test | abc1234 | "
                               "`python scripts/x.py --a \\| b` | [First](#first) |")
    assert lines[head + 3].startswith("| fig A2 | 0.9x |")
    assert lines[head + 4].startswith("| fig B | 3.0x |")
    assert "| batch | speedup |\n| --- | --- |\n| 1 | 2.41x |\n| 4 | 2.07 |" in text
    assert "`python scripts/x.py` (CPU: test, commit abc1234)" in text
    assert main(["--check", "--results", str(results), "--output", str(out)]) == 0
    # a stale page fails the check (the negative control), and names the fix
    _write(results, "b.json", _section("Second", 20, [("fig B", "3.1x")]))
    capsys.readouterr()
    assert main(["--check", "--results", str(results), "--output", str(out)]) == 1
    assert "is stale: run python scripts/benchmarks_doc.py" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(titel="x"), "a.json: unknown key 'titel'; valid keys: title, order"),
    (lambda d: d.pop("intro"), "a.json: missing key 'intro'"),
    (lambda d: d.update(order="10"), "a.json: order is '10': expected int"),
    (lambda d: d["summary"][0].pop("commit"), "a.json: summary[0]: missing key 'commit'"),
    (lambda d: d["tables"][0]["rows"].append(["1"]),
     "a.json: tables[0].rows[1] has 1 cells, the table 2 columns"),
    (lambda d: d["tables"][0]["rows"].append([True, "x"]), "cells are strings or numbers"),
    (lambda d: d["tables"][0].update(caption=3), "a.json: tables[0].caption is 3: expected str"),
])
def test_bad_results_give_one_error_line(tmp_path, capsys, edit, message):
    doc = _section("First", 10, [("fig A", "1.5x")])
    edit(doc)
    _write(tmp_path / "results", "a.json", doc)
    assert main(["--results", str(tmp_path / "results"), "--output", str(tmp_path / "o.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "o.md").exists()


def _rollout_json():
    """The shape scripts/bench_rollout.py writes (its `rows` and `argv` keys)."""
    row = dict(drafter="eagle3", k=3, batch=1, calls=4, tau=3.8214, verify_cost=1.1712,
               draft_cost=0.1934, bound=3.2628, bound_with_draft=2.8079, speedup=2.4131,
               efficiency=0.7396, efficiency_with_draft=0.8594, plain_s=1.7412,
               plain_tokens=191, tokens_equal_plain=True)
    return {"machine": "x86_64 AMD EPYC cpus=2 device=cpu", "argv": ["--ks", "3"], "rows": [row]}


def test_import_replaces_a_table_from_a_bench_json(tmp_path, capsys):
    into = _section("First", 10, [("fig A", "1.5x")])
    bench, target = tmp_path / "bench.json", tmp_path / "first.json"
    bench.write_text(json.dumps(_rollout_json()), encoding="utf-8")
    target.write_text(json.dumps(into), encoding="utf-8")
    assert main(["import", str(bench), "--bench", "rollout", "--into", str(target),
                 "--caption", "First table", "--commit", "def5678"]) == 0
    doc = json.loads(target.read_text(encoding="utf-8"))
    assert len(doc["tables"]) == 1 and doc["summary"] == into["summary"]
    table = doc["tables"][0]
    assert table["command"] == "python scripts/bench_rollout.py --ks 3"
    assert (table["machine"], table["commit"], table["notes"]) == (
        "x86_64 AMD EPYC cpus=2 device=cpu", "def5678", "A note.")
    assert table["rows"] == [["eagle3", 1, 4, "3", "3.82", "1.17", "0.19", "3.26x", "2.81x", "2.41x",
                              "74% (86%)", "1.74 s (191)", "yes"]]
    # a new caption appends a table; the wrong --bench is one error line, the file untouched
    assert main(["import", str(bench), "--bench", "rollout", "--into", str(target),
                 "--caption", "Another", "--commit", "def5678"]) == 0
    captions = [t["caption"] for t in json.loads(target.read_text())["tables"]]
    assert captions == ["First table", "Another"]
    before = target.read_text()
    capsys.readouterr()
    assert main(["import", str(bench), "--bench", "longtail", "--into", str(target),
                 "--caption", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this is not scripts/bench_longtail.py's JSON")
    assert target.read_text() == before


def test_import_of_an_adaptive_longtail_run():
    """scripts/bench_longtail.py --adaptive writes `args` (no argv) and per-run `results`."""
    args = {"adaptive": True, "rollouts": 256, "skip_static_all": False, "json": "x.json"}
    result = {"machine": "x86_64 cpus=2", "costs_ms": [0.67, 1.26], "args": args,
              "results": {"plain": dict(iterations=769, acceptance_length=1.0, mean_k=0.0,
                                        wall_s_median=0.6512, speedup_vs_plain=1.0,
                                        speedup_p10_p90=[0.97, 1.04], k_iterations=None),
                          "adaptive": dict(iterations=769, acceptance_length=1.0, mean_k=0.0123,
                                           wall_s_median=0.6541, speedup_vs_plain=0.9951,
                                           speedup_p10_p90=[0.96, 1.03],
                                           k_iterations=[766, 3, 0, 0])}}
    into = _section("First", 10, [("f", "v")])
    doc = DOC["import_bench"]("longtail", result, into, "new", "c0ffee1")
    table = doc["tables"][-1]
    assert table["command"] == "python scripts/bench_longtail.py --adaptive --rollouts=256"
    assert table["rows"] == [["plain", 769, "1.00", "0.00", "0.651 s", "1.000x", "0.97-1.04", ""],
                             ["adaptive", 769, "1.00", "0.01", "0.654 s", "0.995x", "0.96-1.03",
                              "[766, 3, 0, 0]"]]
