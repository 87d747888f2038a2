"""docs/guide.md's example runs as written (its own asserts check replay == plain)."""

import pathlib
import re


def test_guide_example_runs(capsys):
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/guide.md", "exec"), {})
    out = capsys.readouterr().out
    assert "acceptance_length" in out
