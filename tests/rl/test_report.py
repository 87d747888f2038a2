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
