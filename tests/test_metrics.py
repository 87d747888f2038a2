"""Stage timers, the metrics sinks and the step line, against hand-computed values."""

import json
import sys
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.metrics import MetricsWriter, Progress, StageTimer, format_step_line


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
    head = {"reward": 0.5, "acceptance_length": 4.0, "draft/acc_0": 0.912, "time/step": 2.0}
    assert format_step_line(2, head) == "step 2 | reward 0.500 | acc_len 4.00 | head_acc 0.91 | step 2.00s"


# --------------------------------------------------------------------------- GRPO step rows

def _batch(**stats):
    from jaxspec.decoding.engine import RolloutStats

    return types.SimpleNamespace(
        rewards=np.array([1.0, 0.0, 1.0, 0.5], np.float32), lengths=np.array([3, 5, 2, 6]),
        version=np.int32(2), plain_time_s=np.float32(stats.pop("plain", np.nan)),
        replay_identical=np.float32(1.0),
        stats=RolloutStats(target_forwards=np.int32(7), draft_forwards=np.int32(21),
                           wall_time_s=np.float32(0.5), **stats))


def test_step_metrics_row_from_rollout_stats_and_losses():
    from jaxspec.rl.metrics import step_metrics

    batch = _batch(row_steps=np.array([2, 3, 1, 4]), tokens_generated=np.array([3, 5, 2, 6]),
                   accepted_at=np.array([4, 1]), proposed_at=np.array([5, 4]), plain=1.5)
    m = step_metrics(batch, {"loss": jnp.float32(0.25)}, {"draft_loss": 2.0, "draft_acc_0": 0.5},
                     completed=4)
    assert m["reward"] == pytest.approx(0.625) and m["accuracy"] == 0.5
    assert m["completion_length"] == 4.0
    assert m["acceptance_length"] == pytest.approx(16 / 10)  # tokens per policy forward
    assert m["acceptance_rate"] == pytest.approx(5 / 9)
    assert m["spec/acceptance_at_1"] == pytest.approx(0.8)
    assert m["spec/acceptance_at_2"] == pytest.approx(0.25)
    assert (m["spec/target_forwards"], m["spec/draft_forwards"]) == (7, 21)
    assert (m["policy_version"], m["policy_lag"]) == (2, 1)
    assert m["generation_speedup"] == pytest.approx(3.0) and m["replay_identical"] == 1.0
    assert m["grpo/loss"] == 0.25 and m["draft/loss"] == 2.0 and m["draft/acc_0"] == 0.5
    # plain decoding: no depths, no comparison
    plain = _batch(row_steps=np.array([3, 5, 2, 6]), tokens_generated=np.array([3, 5, 2, 6]),
                   accepted_at=np.zeros((0,), np.int32), proposed_at=np.zeros((0,), np.int32))
    m = step_metrics(plain, {}, {}, completed=3)
    assert m["acceptance_length"] == 1.0 and m["policy_lag"] == 0
    assert not any(k.startswith(("spec/acceptance_at", "acceptance_rate", "generation_plain"))
                   for k in m)


def test_collapse_alarm_counts_consecutive_steps_below_the_threshold():
    from jaxspec.rl.metrics import collapse_alarm

    count, alarms = 0, []
    for length in (1.0, 1.0, 1.2, 1.0, 1.0, 1.0):
        count, warning = collapse_alarm(length, count, threshold=1.05, patience=2)
        alarms.append((count, warning is not None))
    assert alarms == [(1, False), (2, True), (0, False), (1, False), (2, True), (3, True)]
    assert "1.000 < 1.05 for 3 steps" in warning


def test_run_summary_of_a_linear_reward_curve(tmp_path):
    from jaxspec.metrics import read_metrics, run_summary

    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for step in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10):
            row = {"reward": 0.1 * (step - 1), "acceptance_length": 2.0 if step > 5 else 1.0,
                   "generation_time_s": 1.0, "time/step": 4.0 if step == 1 else 2.0,
                   "share/generation": 0.5}
            if step % 2:  # compared steps' ratios 3, 3, 3, 1, 10: median 3, of the means 4
                plain = {1: 3.0, 3: 3.0, 5: 3.0, 7: 1.0, 9: 10.0}[step]
                row.update(generation_plain_time_s=plain, replay_identical=1.0)
            writer.write(step, row)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    s = run_summary(rows)
    assert s["steps"] == 10
    assert s["reward_first_fifth"] == pytest.approx(0.05)  # steps 1-2
    assert s["reward_last_fifth"] == pytest.approx(0.85)  # steps 9-10
    assert s["reward_noise"] == pytest.approx(0.0, abs=1e-12)  # constant differences
    assert s["acceptance_length_mean"] == 1.5 and s["acceptance_length_last_fifth"] == 2.0
    assert s["generation_speedup"] == pytest.approx(3.0) and s["replay_identical"] == 1.0
    assert s["generation_speedup_of_means"] == pytest.approx(4.0)
    assert s["step_time_mean"] == 2.0  # the first (compiling) step left out
    assert s["stage_shares"] == {"generation": 0.5}
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        read_metrics(tmp_path / "missing")


# ----------------------------------------------------------------------------- Progress

def test_progress_lines_at_most_every_interval_and_always_the_last():
    clock, lines = FakeClock(), []
    p = Progress(lines.append, "warm-up (policy)", 20, every=8.0, clock=clock)
    p.line("20 supervised steps: compiling")
    for done in range(1, 21):
        clock.advance(3.0 if done > 1 else 10.0)  # the first chunk compiles
        p.update(done, lambda d=done: f"loss {1 / d:.3f}")
    assert lines == ["warm-up (policy): 20 supervised steps: compiling",
                     "warm-up (policy): step 1/20, loss 1.000 (10s)",
                     "warm-up (policy): step 4/20, loss 0.250 (19s)",
                     "warm-up (policy): step 7/20, loss 0.143 (28s)",
                     "warm-up (policy): step 10/20, loss 0.100 (37s)",
                     "warm-up (policy): step 13/20, loss 0.077 (46s)",
                     "warm-up (policy): step 16/20, loss 0.062 (55s)",
                     "warm-up (policy): step 19/20, loss 0.053 (64s)",
                     "warm-up (policy): step 20/20, loss 0.050 (67s)"]
    # the detail of a line not printed is never computed (a device read); a printed one's
    # time is taken after it (it waits for the device)
    p.update(5, lambda: pytest.fail("computed for a throttled update"))

    def slow_detail():
        clock.advance(30.0)
        return "loss 0.010"

    clock.advance(8.0)
    p.update(6, slow_detail)
    assert lines[-1] == "warm-up (policy): step 6/20, loss 0.010 (105s)"


def test_progress_watchdog_prints_while_one_call_runs_long():
    lines = []
    with Progress(lines.append, "generation", every=0.2, grace=0.1) as p:
        p.line("compiling it")
        time.sleep(1.2)  # one long call (a compile): no update can print
        p.news("compiled, opening the files")
        time.sleep(1.0)
    assert lines[0] == "generation: compiling it"
    beats = lines[1:]
    assert len(beats) >= 3 and all(", still running (" in b for b in beats), lines
    assert beats[0].startswith("generation: compiling it, still running")
    assert beats[-1].startswith("generation: compiled, opening the files, still running")
    n = len(lines)
    time.sleep(0.5)
    assert len(lines) == n  # the watchdog stopped with the block
    with Progress(lines.append, "quick", every=0.2, grace=0.1) as p:
        p.line("start")
    assert lines[n:] == ["quick: start"]  # a short block prints no watchdog line
