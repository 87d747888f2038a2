"""Console output: a progress bar only on a terminal; in a log or a pipe plain lines with no
carriage-return frames, every line at most 120 columns."""

import io
import sys

from jaxspec.metrics import WIDTH, Console, fit_lines, format_step_line
from jaxspec.testing import ROOT
from jaxspec.testing.scripts import load_script

train_grpo = load_script("train_grpo")

STAGES = ("data", "setup", "generation", "reward", "logprob", "training", "other")


def _row(seconds):
    total = sum(seconds)
    row = {"reward": -0.123456, "acceptance_length": 2.345678, "time/step": total}
    for name, s in zip(STAGES, seconds, strict=True):
        row[f"time/{name}"], row[f"share/{name}"] = s, s / total
    return row


def test_step_lines_fit_and_keep_the_largest_stages():
    # seconds of every magnitude: the line never passes 120 columns, the biggest stages stay
    for seconds, steps, largest in [((0.01, 0.02, 0.93, 0.05, 0.12, 0.41, 0.01), (3, 40),
                                     ("gen", "train")),
                                    ((1234.5, 999.9, 8888.8, 777.7, 6666.6, 5555.5, 444.4),
                                     (123456, 999999), ("gen",))]:
        line = format_step_line(steps[0], _row(seconds), total_steps=steps[1])
        assert len(line) <= WIDTH, line
        assert all(f" | {name} " in line for name in largest), line
        shown = sum(float(p.split()[1][:-1]) for p in line.split(" | ")[4:])
        assert abs(shown - sum(seconds)) < 0.01 * len(STAGES)  # 'rest' holds the others


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_the_bar_is_drawn_only_on_a_terminal(monkeypatch):
    for tty in (False, True):
        err, out = _Stream(tty), _Stream(False)
        monkeypatch.setattr(sys, "stderr", err)
        with Console(stream=out) as console:
            console.start(3)
            for step in (1, 2, 3):
                console.step(step, _row((0.1,) * 7), total=3, show=True)
        assert ("\r" in err.getvalue()) == tty  # tqdm's frames
        assert "\r" not in out.getvalue()
        assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == [
            "step 1/3", "step 2/3", "step 3/3"]


def test_long_lines_break_between_parts():
    text = " | ".join(f"part {i} " + "x" * 30 for i in range(10)) + " | " + "y" * 300
    lines = fit_lines(text)
    assert all(len(line) <= WIDTH for line in lines)
    assert "".join(line.strip() for line in lines).replace("|", "").replace(" ", "") == \
        text.replace("|", "").replace(" ", "")


def test_main_in_a_pipe_writes_plain_lines_that_fit(tmp_path, capsys):
    """scripts/train_grpo.py with stdout and stderr not terminals (as in a log file)."""
    code = train_grpo.main([str(ROOT / "configs" / "tiny.yaml"), f"run.dir={tmp_path / 'run'}",
                            "warmup.steps=0", "draft.kind=ngram", "rollout.prompts_per_step=4",
                            "rollout.group_size=2", "run.steps=2", "run.compare_plain=0",
                            "grpo.kl_coef=0"])
    assert code == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "\r" not in text
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == [
        "step 1/2", "step 2/2"]
    assert any(line.startswith("done in") for line in lines)


def test_a_compiling_stage_is_named_not_filed_under_rest():
    """The first step after a resume as the tiny run printed it: the draft's compile (56% of
    the step) is named with its seconds; 'rest' holds only what is left."""
    row = {"reward": 0.77, "acceptance_length": 2.05, "draft/acc_0": 0.92, "time/step": 18.61,
           "time/data": 0.01, "share/data": 0.01 / 18.61, "time/generation": 0.03,
           "share/generation": 0.03 / 18.61, "time/training": 7.99, "share/training": 7.99 / 18.61,
           "time/draft": 10.45, "share/draft": 10.45 / 18.61, "time/other": 0.13}
    line = format_step_line(11, row, total_steps=12)
    assert len(line) <= WIDTH, line
    parts = dict(p.split(" ", 1) for p in line.split(" | ")[5:])
    assert parts["draft"].startswith("10.45s") and parts["train"].startswith("7.99s"), line
    assert float(parts["rest"].split("s")[0]) < 0.25, line
