"""What stops a run early, and how it stops: a stop signal (preemption), a non-finite
update (divergence), a run directory that cannot take a checkpoint. Each ends in one line
and an exit code of its own (scripts/train_grpo.py, docs/scaling.md):

    0   the run finished
    2   bad config or input, or run.dir not writable / too small (before anything compiles)
    3   diverged: a non-finite loss, gradient norm or parameter (the update was not applied)
    74  a save or export failed (disk full, read-only, ...); the previous checkpoint is the
        resume point
    75  stopped by SIGTERM / SIGINT after checkpointing the last completed step: requeue
        and resume (`--resume`)
    128 + signal number: a second signal, exit at once (the last checkpoint is the resume point)
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_PREEMPTED",
    "EXIT_SAVE_FAILED",
    "Diverged",
    "Preempted",
    "RunDirError",
    "SaveFailed",
    "StopSignals",
    "all_finite",
    "check_run_dir",
]

EXIT_DIVERGED = 3
EXIT_SAVE_FAILED = 74  # sysexits EX_IOERR
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: try again (requeue)


class SetupInterrupted(BaseException):
    """A stop signal arrived before the first training step: nothing to checkpoint. A
    BaseException, like KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signame: str):
        self.signame = signame
        super().__init__(f"stopped by {signame} during set-up (before step 1; nothing "
                         f"was trained, nothing to save; exit code {EXIT_PREEMPTED})")


class Preempted(Exception):
    """A stop signal arrived; the last completed step is checkpointed."""

    def __init__(self, signame: str, step: int, checkpoint: str):
        self.signame, self.step, self.checkpoint = signame, step, checkpoint
        super().__init__(f"stopped by {signame} after step {step}: checkpoint {checkpoint} "
                         f"(resume with --resume; exit code {EXIT_PREEMPTED})")


class Diverged(Exception):
    """A non-finite metric or parameter: the update was not applied."""

    def __init__(self, message: str, *, step: int | None = None, metrics: dict | None = None):
        self.step, self.metrics = step, metrics or {}
        super().__init__(message)


class SaveFailed(Exception):
    """A checkpoint or export could not be written: `path` and the cause."""

    def __init__(self, what: str, path: str, cause: BaseException, resume_step: int | None):
        self.path, self.cause = path, cause
        text = _cause_text(cause)
        where = (f"the resume point stays step {resume_step}" if resume_step is not None
                 else "no checkpoint was saved yet")
        super().__init__(f"could not write {what} to {path}: {text}; {where}")


class RunDirError(Exception):
    """run.dir cannot take the run's files (checked before anything compiles)."""


def _cause_text(cause: BaseException) -> str:
    if isinstance(cause, OSError) and cause.strerror:
        return f"{cause.strerror} ({errno.errorcode.get(cause.errno, cause.errno)})"
    text = " ".join(str(cause).split())
    if "RESOURCE_EXHAUSTED" in text or "No space left" in text:
        return f"no space left on the device ({type(cause).__name__})"
    if "Read-only file system" in text:
        return f"read-only file system ({type(cause).__name__})"
    return f"{type(cause).__name__}: {text[:300]}"


# ----------------------------------------------------------------------------- finiteness

@jax.jit
def _finite_leaves(tree) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(flags) if flags else jnp.ones((0,), bool)


def _inexact(tree):
    return [x for x in jax.tree.leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]


def all_finite(tree) -> tuple[bool, int]:
    """(every float leaf of `tree` is finite, how many leaves are not)."""
    leaves = _inexact(tree)
    if not leaves:
        return True, 0
    bad = int(np.sum(~np.asarray(_finite_leaves(leaves))))
    return bad == 0, bad


# ----------------------------------------------------------------------------- run.dir

def check_run_dir(path: str, needed_bytes: int) -> None:
    """run.dir exists or can be made, takes a file, and has `needed_bytes` free (one
    checkpoint). Raises RunDirError with the cause."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".jaxspec-write-test-{uuid.uuid4().hex}")
        with open(probe, "wb") as fh:
            fh.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise RunDirError(f"not writable: {_cause_text(e)}") from None
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise RunDirError(
            f"{free / 2**20:.1f} MiB free on its file system, less than one checkpoint "
            f"(params + optimizer states: about {needed_bytes / 2**20:.1f} MiB)")


# ----------------------------------------------------------------------------- signals

_setup_signal: str | None = None  # a signal taken during set-up (StopSignals.setting_up)


def check_setup_stop() -> None:
    """Raise SetupInterrupted if a stop signal arrived during set-up: called between the
    steps of long set-up loops (the draft init), so the stop holds even where the handler's
    own raise landed inside code that caught it."""
    if _setup_signal is not None:
        raise SetupInterrupted(_setup_signal)


def setup_interruption(exc: BaseException) -> SetupInterrupted | None:
    """The SetupInterrupted behind `exc`, or None: `exc` itself, one in its chain of causes
    (a library that wrapped the handler's raise: JAX re-raises an exception from a pytree's
    metadata comparison as a ValueError), or a new one where a stop signal arrived during
    this set-up (the raise was swallowed on the way)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, SetupInterrupted):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None if _setup_signal is None else SetupInterrupted(_setup_signal)


class StopSignals:
    """SIGTERM / SIGINT ask the run to stop after the current step (it checkpoints it); a
    second signal exits at once with 128 + its number. A context manager; installs its
    handlers only in the main thread (elsewhere `requested` stays None unless set).

    Multi-process: `agreed()` is true on every process when any process got a signal
    (one all-gather of the flag per call), so all of them save the same step together."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log=None):
        self.requested: str | None = None
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._previous: dict = {}
        # Before the first step (loading, warm-up, draft init: minutes) there is nothing to
        # checkpoint, so a signal interrupts at once (`SetupInterrupted`, raised in the main
        # thread as soon as the current compiled call returns) instead of waiting for step 1.
        self.setting_up = False

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        # (multi-process runs stop together at a step, agreed; never one process alone)
        if self.setting_up and jax.process_count() == 1:
            self.setting_up = False  # raised once; a second signal during the unwind exits
            self.requested = name
            global _setup_signal
            _setup_signal = name  # for check_setup_stop, should the raise be swallowed
            raise SetupInterrupted(name)
        if self.requested is not None:
            print(f"{name} again: exiting now without saving (exit code {128 + signum})",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = name
        self._log(f"{name}: finishing the current step, then checkpointing and stopping "
                  f"(send it again to exit at once)")

    def agreed(self, step: int) -> str | None:
        """The signal that stops the run at `step`, agreed by all processes (None: go on).
        Multi-process, a preemption notice from JAX's coordination service (orbax's
        `reached_preemption`, where `jax.distributed` runs one) counts too."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        mine = np.int32(0 if self.requested is None else 1)
        if int(np.max(multihost_utils.process_allgather(mine))) == 1:
            return self.requested or "a stop signal (on another process)"
        try:
            from orbax.checkpoint import multihost

            if multihost.reached_preemption(step):
                return "a preemption notice"
        except Exception:  # no preemption sync manager in this jax.distributed set-up
            pass
        return None

    def __enter__(self):
        global _setup_signal
        _setup_signal = None  # a stop of an earlier run in this process is not this one's
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        global _setup_signal
        _setup_signal = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
