"""docs/guide.md's example and the README's short tour run as pasted (their own asserts
check replay == plain) and print what the text around them says they print."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_guide_example_runs(capsys):
    blocks = _blocks((ROOT / "docs" / "guide.md").read_text())
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/guide.md", "exec"), {})
    out = capsys.readouterr().out
    assert "acceptance_length" in out
    # a line as each call finishes, not minutes of silence
    for what in ("plain decoding", "EAGLE-3 chains", "EAGLE-3 trees", "n-gram lookup",
                 "measuring the costs", "adaptive k"):
        assert re.search(rf"^{what}.* done at \d+ s$", out, flags=re.M), (what, out)


def test_readme_tour_runs_as_pasted(capsys):
    """The tour's first block (its second needs a local Qwen3-8B) defines everything it
    uses and prints the lengths, the acceptance length and the first row's tokens."""
    readme = (ROOT / "README.md").read_text()
    tour = readme[readme.index("## A short tour"):readme.index("\n## ", readme.index("## A short tour") + 3)]
    runnable, real = _blocks(tour)
    assert "/local/Qwen3-8B" in real and "/local/" not in runnable
    exec(compile(runnable, "README.md", "exec"), {})
    out = capsys.readouterr().out
    lengths = re.search(r"^lengths \[(\d+), (\d+)\] acceptance_length ([\d.]+)$", out, re.M)
    assert lengths, out
    assert all(1 <= int(n) <= 16 for n in lengths.groups()[:2]) and float(lengths[3]) >= 1.0
    assert re.search(r"^tokens \[\d+(, \d+)*\]$", out, flags=re.M), out
