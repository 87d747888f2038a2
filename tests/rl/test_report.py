"""scripts/report.py's stage plot: its stacked bars against the step times in metrics.jsonl."""

import json
import random

import matplotlib
import matplotlib.image
import pytest

from jaxspec.metrics import MetricsWriter, StageTimer, read_metrics
from jaxspec.testing.scripts import load_script

report = load_script("report")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _write_run(run_dir, steps=6, seed=0):
    """metrics.jsonl of a run shaped like the main job's: the trainer's stages in its order,
    an untimed gap (the plain comparison), on some steps no draft stage, and on the last a
    stage report.py has never heard of; every duration random."""
    rng, clock = random.Random(seed), FakeClock()
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        for step in range(1, steps + 1):
            timer = StageTimer(clock=clock)
            stages = ["data", "setup", "generation", "history", "reward", "logprob", "training"]
            stages += ["draft"] if step % 3 else []
            stages += ["export"] if step == steps else []
            for name in stages:
                with timer.stage(name):
                    clock.now += rng.uniform(0.01, 2.0)
                if name == "history" and step % 2:  # untimed: plain generation compared
                    clock.now += rng.uniform(0.5, 1.5)
            writer.write(step, {"reward": 0.5, **timer.summary()})


def test_stage_bars_add_up_to_the_step_times(tmp_path):
    _write_run(tmp_path)
    rows = read_metrics(str(tmp_path))
    with open(tmp_path / "metrics.jsonl") as fh:  # the step times as written, independently
        step_time = {r["step"]: r["time/step"] for r in map(json.loads, fh)}
    fig = report.stages_figure(rows)
    ax = fig.axes[0]
    labels = [c.get_label() for c in ax.containers]
    assert labels == ["data", "setup", "generation", "history", "reward", "logprob",
                      "training", "draft", "export", "other"]
    tops = {}
    for container in ax.containers:
        for bar in container.patches:
            step = round(bar.get_x() + bar.get_width() / 2)
            assert bar.get_y() == pytest.approx(tops.get(step, 0.0))  # stacked, no gaps
            tops[step] = bar.get_y() + bar.get_height()
    assert tops.keys() == step_time.keys()
    for step, seconds in step_time.items():
        assert tops[step] == pytest.approx(seconds, rel=1e-9)
    # the old plot's seven stages (no history, draft, ...) fall short by more than 5%
    old = ("data", "setup", "generation", "reward", "logprob", "training", "other")
    short = [sum(r.get(f"time/{s}") or 0.0 for s in old) / r["time/step"] for r in rows]
    assert max(short) < 0.95


def test_report_writes_every_plot(tmp_path, capsys):
    _write_run(tmp_path)
    assert report.main([str(tmp_path)]) == 0
    for name in ("reward", "acceptance", "stages", "generation"):
        image = matplotlib.image.imread(tmp_path / f"{name}.png")
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


# ----------------------------------------------------------------------------- the drawn values

def _write_resumed_run(run_dir):
    """Ten steps of ~1 s; step 1 compiled (50 s), and step 6, the first after a resume at
    step 5 (40 s); plain generation compared at steps 5 and 10; acceptance at 3 depths."""
    seconds = {1: 50.0, 6: 40.0}
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for step in range(1, 11):
            t = seconds.get(step, 1.0 + 0.01 * step)
            row = {"step": step, "reward": 0.5, "time/generation": 0.4 * t,
                   "time/training": 0.6 * t, "time/step": t, "acceptance_length": 1.5 + 0.05 * step,
                   **{f"spec/acceptance_at_{d}": 0.9 - 0.2 * d for d in range(3)},
                   "generation_time_s": 0.4 * t}
            if step % 5 == 0:
                row["generation_plain_time_s"] = 0.4 * t * (1.5 if step == 5 else 2.0)
            fh.write(json.dumps(row) + "\n")
    with open(run_dir / "config_history.jsonl", "w") as fh:  # as the trainer appends it
        fh.write(json.dumps({"resumed_at_step": 5, "time": "2026-11-28T00:00:00+0000",
                             "changes": {}}) + "\n")


@pytest.fixture
def drawn(tmp_path, monkeypatch):
    """{title: figure} of every plot report.plot_run draws (figures kept open)."""
    import matplotlib.pyplot as plt

    _write_resumed_run(tmp_path)
    plt.close("all")
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    report.plot_run(str(tmp_path))
    figures = {plt.figure(n).axes[0].get_title(): plt.figure(n) for n in plt.get_fignums()}
    yield figures
    monkeypatch.undo()
    plt.close("all")


def _figure(drawn, title_start):
    return next(f for t, f in drawn.items() if t.startswith(title_start))


def test_stages_are_scaled_to_the_steps_that_did_not_compile(drawn):
    ax = _figure(drawn, "Step time by stage").axes[0]
    steady = max(1.0 + 0.01 * s for s in range(1, 11) if s not in (1, 6))
    assert ax.get_ylim()[1] == pytest.approx(1.15 * steady)  # not the resumed step's 40 s
    cut = sorted(t.get_text() for t in ax.texts)
    assert cut == ["40.0s", "50.0s"]
    assert "steps 1, 6 compiled" in ax.get_title()


def test_acceptance_legend_names_each_lines_axis_and_the_one_line(drawn):
    fig = _figure(drawn, "Speculation")
    left, right = fig.axes
    legend = [t.get_text() for t in left.get_legend().get_texts()]
    assert legend[0] == "acceptance length (left axis)"
    assert [t for t in legend if "depth" in t] == [f"accepted at depth {d} (right axis)"
                                                   for d in range(3)]
    assert all(t.endswith(("(left axis)", "(right axis)")) for t in legend)
    one = [line for line in left.get_lines() if line.get_label().startswith("1.0")]
    assert len(one) == 1 and list(one[0].get_ydata()) == [1.0, 1.0]
    assert one[0].get_label() in legend
    assert [t.get_text() for t in left.texts if t.xy[1] == 1.0] == ["1.0: no draft token accepted"]
    xs, ys = left.get_lines()[0].get_data()
    assert list(ys) == [1.5 + 0.05 * s for s in range(1, 11)]
    for d, line in enumerate(right.get_lines()):
        assert list(line.get_ydata()) == [pytest.approx(0.9 - 0.2 * d)] * 10


def test_generation_ticks_at_the_compared_steps_with_their_ratios(drawn):
    ax = _figure(drawn, "Generation time").axes[0]
    assert list(ax.get_xticks()) == [5.0, 10.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["5", "10"]
    assert [t.get_text() for t in ax.texts] == ["1.50x", "2.00x"]
    spec, plain = ax.containers
    assert [b.get_height() for b in spec] == pytest.approx([0.4 * 1.05, 0.4 * 1.1])
    assert [b.get_height() for b in plain] == pytest.approx([0.4 * 1.05 * 1.5, 0.4 * 1.1 * 2.0])
