"""Faults (issue 18): a diverged update never reaches the params, a checkpoint or an export;
SIGTERM / SIGINT checkpoint the last completed step and a resumed run equals an
uninterrupted one; a torn metrics line is dropped on resume; a read-only or full run.dir is
one `error:` line, no traceback."""

import contextlib
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec.rl.trainer as trainer_module
from jaxspec.checkpoint import CheckpointManager
from jaxspec.config import load_config
from jaxspec.metrics import MetricsWriter, read_metrics
from jaxspec.models import load_hf
from jaxspec.rl import faults
from jaxspec.rl.state import save_checkpoint
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.compile import subprocess_env
from jaxspec.testing.rl import SHORT, assert_same_tree, rows, warmed_base
from jaxspec.testing.scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def make_config(run_dir, *extra):
    return load_config(TINY, SHORT + [f"run.dir={run_dir}", *extra])


train_grpo = load_script("train_grpo")


@pytest.fixture(scope="module")
def base():
    return warmed_base()[:2]


def poison_advantages(monkeypatch, at_calls):
    """The advantages of the given steps (1-based calls) become NaN on the host: the jitted
    update then sees a NaN loss and NaN gradients, as a diverged run would."""
    real, calls = trainer_module.group_advantages, [0]

    def poisoned(*args, **kwargs):
        calls[0] += 1
        adv = real(*args, **kwargs)
        return np.full_like(np.asarray(adv), np.nan) if calls[0] in at_calls else adv

    monkeypatch.setattr(trainer_module, "group_advantages", poisoned)


def finite(tree):
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree)
               if jnp.issubdtype(x.dtype, jnp.inexact))


def test_divergence_stops_before_the_update_and_keeps_a_finite_resume_point(
        base, tmp_path, monkeypatch):
    """NaN at step 3 (of 4; checkpoints every 2): the run stops with Diverged naming the step
    and the metric, the params are those of step 2 bitwise, the newest checkpoint (2) and the
    export are finite, and resuming without the fault equals an uninterrupted run."""
    policy, head = base
    straight = GRPOTrainer(make_config(tmp_path / "straight", "run.steps=4"), policy=policy,
                           head=head)
    straight.run()

    poison_advantages(monkeypatch, {3})
    lines = []
    run = GRPOTrainer(make_config(tmp_path / "nan", "run.steps=4"), policy=policy, head=head,
                      log=lines.append)
    params_at = {}
    with pytest.raises(faults.Diverged, match=r"diverged at step 3: grpo/loss is nan; the "
                       r"update was not applied .*last finite state is step 2"):
        run.run(on_step=lambda step, row: params_at.setdefault(step, run.policy.params))
    assert run.completed == 2
    assert_same_tree(run.policy.params, params_at[2])  # the guard kept step 2's params
    assert any("step 2, is checkpointed" in line for line in lines)
    ckpt = tmp_path / "nan" / "checkpoints"
    assert CheckpointManager(ckpt, create=False).all_steps() == [2]
    saved, _ = CheckpointManager(ckpt, create=False).restore(2)
    assert finite(saved)
    exported = load_hf(tmp_path / "nan" / "policy")
    assert finite(exported.params)
    assert_same_tree(exported.params, jax.tree.map(np.asarray, params_at[2]))
    row3 = read_metrics(tmp_path / "nan")[-1]
    assert row3["step"] == 3 and row3["nonfinite"] == 1 and row3["grpo/loss"] is None
    assert np.isfinite(row3["acceptance_length"])  # drafts against the finite step-2 policy

    monkeypatch.undo()
    resumed = GRPOTrainer(make_config(tmp_path / "nan", "run.steps=4", "run.resume=true"))
    assert resumed.completed == 2
    resumed.run()
    assert_same_tree(resumed.policy.params, straight.policy.params)
    assert_same_tree(resumed.opt_state, straight.opt_state)
    assert_same_tree(resumed.head, straight.head)
    assert rows(tmp_path / "nan") == rows(tmp_path / "straight")


def test_skip_mode_skips_a_nonfinite_update_up_to_the_limit(base, tmp_path, monkeypatch):
    """run.on_nonfinite=skip: step 2's NaN update is skipped (params stay step 1's bitwise,
    the run goes on); two in a row with max_nonfinite_skips=1 stop the run."""
    policy, head = base
    poison_advantages(monkeypatch, {2, 4, 5})
    t = GRPOTrainer(make_config(tmp_path / "skip", "run.steps=5", "run.on_nonfinite=skip",
                                "run.max_nonfinite_skips=1", "run.save_every=0"),
                    policy=policy, head=head, log=lambda line: None)
    t.step()
    after_1 = t.policy.params
    m2 = t.step()
    assert m2["nonfinite_skipped"] == 1 and t.completed == 2 and t.skipped_steps == 1
    assert_same_tree(t.policy.params, after_1)
    m3 = t.step()
    assert "nonfinite" not in m3 and t.skipped_steps == 0 and np.isfinite(m3["grpo/loss"])
    t.step()  # step 4: skipped (1 in a row)
    with pytest.raises(faults.Diverged, match=r"diverged at step 5: grpo/loss is nan.*2 "
                       r"non-finite steps in a row"):
        t.step()
    assert t.completed == 4


def test_nonfinite_policy_is_never_generated_from_nor_saved(base, tmp_path):
    """A poisoned parameter: run() refuses before generating (no acceptance is reported
    against it) and save_checkpoint refuses to write it."""
    policy, head = base
    leaves, treedef = jax.tree.flatten(policy.params)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    poisoned = policy.replace(params=jax.tree.unflatten(treedef, leaves))
    t = GRPOTrainer(make_config(tmp_path / "p", "run.steps=1"), policy=poisoned, head=head)
    with pytest.raises(faults.Diverged, match="1 non-finite tensors: not generating"):
        t.run()
    assert not (tmp_path / "p" / "metrics.jsonl").exists()
    with pytest.raises(faults.Diverged, match="non-finite values"):
        save_checkpoint(str(tmp_path / "p" / "checkpoints"), t.state, prompts_per_step=4,
                        keep=3)
    assert not (tmp_path / "p" / "checkpoints").exists() or not CheckpointManager(
        tmp_path / "p" / "checkpoints", create=False).all_steps()


def test_torn_metrics_line_is_dropped_and_reported(tmp_path):
    lines = []
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in (1, 2, 3):
            w.write(step, {"reward": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "rew')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    with MetricsWriter(tmp_path, resume_step=2, tensorboard=False, log=lines.append) as w:
        w.write(3, {"reward": 0.5})
    assert len(lines) == 1 and "dropped 1 torn line(s)" in lines[0] and "line 4" in lines[0]
    with open(tmp_path / "metrics.jsonl") as fh:
        assert [json.loads(line) for line in fh] == [
            {"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 3, "reward": 0.5}]


# ----------------------------------------------------------------------------- signals

def _subprocess_env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    # JAX_PLATFORMS and XLA_FLAGS (8 CPU devices) as in this process, its compile options and
    # its compilation cache
    return subprocess_env(env)


SIGNAL_RUN = ["run.steps=5", "run.save_every=0"]  # save_every 0: only the last step saves


def train_grpo_process(run_dir, *extra):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "train_grpo.py"), str(TINY), *SHORT, *extra,
         f"run.dir={run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_subprocess_env(), cwd=ROOT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """scripts/train_grpo.py run to the end (its warm-up and draft init are the ones the
    interrupted runs make, in a process of their own)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = train_grpo_process(run_dir, *SIGNAL_RUN)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    return run_dir


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_the_last_step_and_resume_is_bitwise(uninterrupted, tmp_path, sig):
    """scripts/train_grpo.py gets the signal after its first step line: it exits 75 with one
    line, having checkpointed the last completed step (save_every is 0: no other
    checkpoint); with a torn metrics line added, the resumed run's final checkpoint and
    metrics equal those of an uninterrupted run bitwise."""
    run_dir = tmp_path / "run"
    proc = train_grpo_process(run_dir, *SIGNAL_RUN)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step 1/5"):
            proc.send_signal(sig)
            break
    out.append(proc.stdout.read())
    assert proc.wait(timeout=120) == faults.EXIT_PREEMPTED, "".join(out)
    text = "".join(out)
    assert "Traceback" not in text
    name = signal.Signals(sig).name
    stopped = [line for line in text.splitlines() if line.startswith(f"stopped by {name}")]
    assert len(stopped) == 1, text
    last = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 1 <= last < 5
    assert CheckpointManager(run_dir / "checkpoints", create=False).all_steps() == [last]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, last + 1))
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"step": %d, "reward": 0.' % (last + 1))  # and a torn line on top

    lines = []
    resumed = GRPOTrainer(make_config(run_dir, *SIGNAL_RUN, "run.resume=true"),
                          log=lines.append)
    assert resumed.completed == last
    resumed.run()
    assert any("dropped 1 torn line(s)" in line for line in lines)
    final = [CheckpointManager(d / "checkpoints", create=False).restore(5)
             for d in (run_dir, uninterrupted)]
    assert_same_tree(final[0][0], final[1][0])  # params, optimizer states, head, key
    assert final[0][1] == final[1][1]
    got, want = rows(run_dir), rows(uninterrupted)
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    # bitwise when this file runs alone; in the full suite a host-side metric such as
    # grpo/advantage_mean (~1e-9) can round differently in this process than in the
    # subprocess (global state left by another test module), params stay bitwise above
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-6)


def test_second_signal_exits_at_once(tmp_path):
    """Two SIGTERMs in a row after the first step: the second exits now with 128 + 15."""
    proc = train_grpo_process(tmp_path / "run", "run.steps=50")
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step 1/50"):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            break
    code = proc.wait(timeout=60)
    text = "".join(out) + proc.stdout.read()
    assert code == 128 + signal.SIGTERM, text
    assert "SIGTERM again: exiting now without saving" in text and "Traceback" not in text


# ----------------------------------------------------------------------------- run.dir

@contextlib.contextmanager
def tmpfs(size: str, *options: str):
    """A small tmpfs mounted at a fresh directory (skips where this user cannot mount)."""
    where = tempfile.mkdtemp(prefix="jaxspec-tmpfs-")
    opts = ",".join((f"size={size}", *options))
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", where],
                          capture_output=True, text=True)
    if made.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield pathlib.Path(where)
    finally:
        subprocess.run(["umount", where], check=False)
        os.rmdir(where)


def one_error(capsys) -> str:
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    return errors[0]


def test_read_only_run_dir_is_one_error_before_compiling(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes into a 0o555 directory (root): see the tmpfs test")
        assert train_grpo.main([str(TINY), *SHORT, f"run.dir={locked}"]) == 2
    finally:
        locked.chmod(0o755)
    line = one_error(capsys)
    assert "run.dir" in line and "not writable: Permission denied (EACCES)" in line


def test_read_only_file_system_is_one_error_before_compiling(capsys):
    with tmpfs("1m", "ro") as ro:
        assert train_grpo.main([str(TINY), *SHORT, f"run.dir={ro / 'run'}"]) == 2
    line = one_error(capsys)
    assert f"run.dir' = '{ro / 'run'}'" in line
    assert "not writable: Read-only file system (EROFS)" in line


def test_run_dir_without_room_for_a_checkpoint_is_one_error_before_compiling(capsys):
    with tmpfs("64k") as small:
        assert train_grpo.main([str(TINY), *SHORT, f"run.dir={small / 'run'}"]) == 2
    line = one_error(capsys)
    assert "MiB free on its file system, less than one checkpoint" in line


def test_full_disk_mid_run_is_one_error_and_keeps_the_resume_point(tmp_path, capsys,
                                                                   monkeypatch):
    """The checkpoint of step 4 fails with ENOSPC (the save raises as a full disk makes it):
    one error line naming the directory and the cause, exit 74, step 2 stays the resume
    point and restores."""
    from jaxspec.rl import state as state_module

    real, calls = state_module.CheckpointManager.save, [0]

    def save(self, step, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", self.directory)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(state_module.CheckpointManager, "save", save)
    run_dir = tmp_path / "full"
    assert train_grpo.main([str(TINY), *SHORT, f"run.dir={run_dir}", "run.steps=4"]) == 74
    line = one_error(capsys)
    assert line == (f"error: could not write the checkpoint of step 4 to {run_dir}/checkpoints: "
                    f"No space left on device (ENOSPC); the resume point stays step 2")
    monkeypatch.undo()
    assert CheckpointManager(run_dir / "checkpoints", create=False).all_steps() == [2]
    resumed = GRPOTrainer(make_config(run_dir, "run.steps=4", "run.resume=true"))
    assert resumed.completed == 2 and finite(resumed.policy.params)


_AGREE = """
import sys
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jaxspec.rl.faults import StopSignals
stop = StopSignals()
first = stop.agreed(0)
if jax.process_index() == 1:
    stop.requested = "SIGTERM"  # as the handler sets it
print("agreed", first, "|", stop.agreed(1), flush=True)
"""


def test_all_processes_agree_on_a_stop_signal_of_one():
    """Two jax.distributed processes: only process 1 got the signal; both stop at the same
    step (so they save the same checkpoint together)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(_subprocess_env(), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE, f"127.0.0.1:{port}", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=ROOT) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = [next(line for line in out.splitlines() if line.startswith("agreed")) for out in outs]
    assert got == ["agreed None | a stop signal (on another process)", "agreed None | SIGTERM"]


@pytest.mark.parametrize("swallowed", [False, True])
def test_a_setup_signal_wrapped_or_swallowed_by_a_library_still_exits_75(tmp_path, monkeypatch, capsys, swallowed):
    """The handler's SetupInterrupted can land inside a library that re-raises it as another
    exception (JAX's pytree metadata comparison: a ValueError `from` it; seen in a suite
    run) or swallows it: the run still stops as preempted, with the one line, not a
    traceback or exit 1."""
    import jaxspec.rl.trainer as trainer_module

    class Trainer:  # stands in for GRPOTrainer: the signal arrives inside a wrapping library call
        def __init__(self, cfg, log=None):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here
            except BaseException as e:
                if not swallowed:
                    raise ValueError("Exception raised while checking equality of metadata fields") from e
            raise RuntimeError("set-up went on after the signal")

    monkeypatch.setattr(trainer_module, "GRPOTrainer", Trainer)
    assert train_grpo.main([str(TINY), *SHORT, f"run.dir={tmp_path / 'run'}"]) == faults.EXIT_PREEMPTED
    err = capsys.readouterr().err
    assert "stopped by SIGTERM during set-up" in err and "Traceback" not in err, err


def test_signal_during_setup_stops_at_once(tmp_path):
    """A SIGTERM during the draft init (before step 1, nothing to save) stops the run as soon
    as the current draft step returns: exit 75, one line, no traceback, no checkpoint;
    without the set-up rule it would train the remaining 99,990 init steps first."""
    run_dir = tmp_path / "run"
    proc = train_grpo_process(run_dir, "warmup.draft_steps=100000", "warmup.draft_rollouts=8")
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("draft init: rollouts generated"):
                time.sleep(0.5)  # inside the init's training steps
                proc.send_signal(signal.SIGTERM)
                break
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # a failed stop must not leave 100,000 init steps running
            proc.kill()
    text = "".join(out) + proc.stdout.read()
    assert code == faults.EXIT_PREEMPTED, text
    assert "stopped by SIGTERM during set-up" in text and "Traceback" not in text, text
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
