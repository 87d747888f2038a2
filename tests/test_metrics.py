"""Stage timers, the metrics sinks and the step line, against hand-computed values."""

import json
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.metrics import MetricsWriter, StageTimer, format_step_line


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_stage_timer_seconds_and_shares():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with timer.stage("generation"):
        clock.advance(3.0)
    clock.advance(1.0)  # untimed gap
    with timer.stage("training"):
        clock.advance(2.0)
    with timer.stage("generation"):  # a second visit adds up
        clock.advance(2.0)
    assert timer.seconds == {"generation": 5.0, "training": 2.0}
    assert timer.step_seconds == 8.0
    assert timer.shares() == {"generation": 5 / 8, "training": 2 / 8}
    assert timer.summary() == {"time/generation": 5.0, "time/training": 2.0, "time/other": 1.0,
                               "share/generation": 5 / 8, "share/training": 2 / 8,
                               "time/step": 8.0}
    timer.reset()
    assert timer.seconds == {} and timer.step_seconds == 0.0


def test_stage_timer_records_even_when_the_stage_raises():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with pytest.raises(RuntimeError):
        with timer.stage("data"):
            clock.advance(0.5)
            raise RuntimeError
    assert timer.seconds == {"data": 0.5}


def test_stage_timer_waits_for_device_results():
    timer = StageTimer()
    x = jnp.ones((256, 256))
    y = timer.timed("logprob", lambda a: a @ a, x)
    np.testing.assert_allclose(y[0, 0], 256.0)
    with timer.stage("training") as s:
        z = s.ready(y + 1)
    assert float(z[0, 0]) == 257.0
    assert set(timer.seconds) == {"logprob", "training"}
    assert all(v >= 0 for v in timer.seconds.values())


def test_metrics_writer_jsonl(tmp_path):
    with MetricsWriter(tmp_path / "run", tensorboard=False) as w:
        row = w.write(1, {"reward": jnp.float32(0.5), "acceptance_length": np.float64(2.25),
                          "time/generation": 1.5, "per_position": jnp.array([0.9, 0.5]),
                          "nan": float("nan"), "note": "ok"})
        w.write(2, {"reward": 0.75})
    assert row == {"step": 1, "reward": 0.5, "acceptance_length": 2.25, "time/generation": 1.5,
                   "per_position": [0.8999999761581421, 0.5], "nan": None, "note": "ok"}
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [row, {"step": 2, "reward": 0.75}]


def test_metrics_writer_resume_drops_steps_after_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 5):
            w.write(step, {"reward": step / 10})
    # the run stopped after step 4; its last checkpoint was step 2
    with MetricsWriter(tmp_path, resume_step=2, tensorboard=False) as w:
        w.write(3, {"reward": 0.33})
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.33)]
    # a fresh (non-resumed) run starts a new file
    MetricsWriter(tmp_path, tensorboard=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_metrics_writer_tensorboard_scalars(tmp_path, monkeypatch):
    calls = []

    class FakeSummaryWriter:
        def __init__(self, logdir):
            calls.append(("init", logdir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tensorboardX",
                        types.SimpleNamespace(SummaryWriter=FakeSummaryWriter))
    with MetricsWriter(tmp_path) as w:
        w.write(5, {"reward": 0.5, "per_position": [1.0], "note": "x", "flag": True})
    assert calls == [("init", str(tmp_path / "tb")), ("reward", 0.5, 5), ("close",)]


def test_format_step_line():
    metrics = {"reward": 0.4123, "acceptance_length": 2.3149, "time/generation": 0.93,
               "share/generation": 0.574, "time/training": 0.41, "share/training": 0.253,
               "time/step": 1.62}
    assert format_step_line(3, metrics, total_steps=40) == (
        "step 3/40 | reward 0.412 | acc_len 2.31 | step 1.62s | gen 0.93s 57% | "
        "train 0.41s 25%")
    assert format_step_line(7, {"reward": jnp.float32(1.0)}) == "step 7 | reward 1.000"
