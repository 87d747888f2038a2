"""Stage timers, metric sinks (JSONL, TensorBoard, Weights & Biases) and the progress text.

Key names shared with the trainer and scripts/report.py: `step`, `reward`,
`acceptance_length`, `time/<stage>` (seconds), `share/<stage>` (fraction of the step),
`time/step`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np  # no JAX at import: Progress covers the start of a run, JAX's import

__all__ = [
    "Console",
    "MetricsWriter",
    "Progress",
    "StageTimer",
    "WandbSink",
    "fit_lines",
    "format_step_line",
    "read_metrics",
    "run_summary",
    "scalar_metrics",
]

_log = logging.getLogger(__name__)


class _Stage:
    """Handle yielded by StageTimer.stage: `ready(x)` waits for x's device work, so the
    stage's time includes the computation it dispatched, and returns x."""

    @staticmethod
    def ready(x):
        import jax

        return jax.block_until_ready(x)


class StageTimer:
    """Wall-clock seconds per named stage of one step.

        timer = StageTimer()
        with timer.stage("generation") as s:
            rollouts = s.ready(generate(...))
        timer.summary()  # {"time/generation": .., "share/generation": .., "time/step": ..}

    A stage entered twice in a step adds up. The step lasts from `reset()` (or the timer's
    creation) to the end of the last stage; time outside every stage is `time/other`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Start a new step."""
        self.seconds: dict[str, float] = {}
        self._start: float = self._clock()
        self._end: float | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[_Stage]:
        t0 = self._clock()
        try:
            yield _Stage()
        finally:
            t1 = self._clock()
            self.seconds[name] = self.seconds.get(name, 0.0) + (t1 - t0)
            self._end = t1

    def timed(self, name: str, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs) timed as stage `name`, waiting for its device results."""
        with self.stage(name) as s:
            return s.ready(fn(*args, **kwargs))

    @property
    def step_seconds(self) -> float:
        if self._end is None:
            return 0.0
        return self._end - self._start

    def shares(self) -> dict[str, float]:
        """Each stage's fraction of the step."""
        total = self.step_seconds
        return {k: (v / total if total > 0 else 0.0) for k, v in self.seconds.items()}

    def summary(self) -> dict[str, float]:
        total = self.step_seconds
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        other = total - sum(self.seconds.values())
        if other > 1e-9:
            out["time/other"] = other
        out.update({f"share/{k}": v for k, v in self.shares().items()})
        out["time/step"] = total
        return out


def _to_python(value: Any):
    """A JSON-able python scalar (or list) from a python/numpy/jax value; NaN/inf -> None."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    import jax

    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        arr = np.asarray(value)
        value = arr.item() if arr.ndim == 0 else arr.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as plain python values (one device-to-host transfer per leaf)."""
    return {k: _to_python(v) for k, v in metrics.items()}


def _scalars(row: dict[str, Any]) -> dict[str, int | float]:
    """The numeric entries of a written row but `step` (what TensorBoard and W&B plot)."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool)}


class WandbSink:
    """A Weights & Biases run fed the rows MetricsWriter writes: each row's numbers under
    the same names, at its step, and the run's config. Files go under <run_dir>/wandb (with
    mode "offline" only there; `wandb sync` uploads them later). The run's id is kept in
    <run_dir>/wandb_run_id, so a resumed run (`resume=True`) continues the same W&B run
    (W&B drops re-logged steps at or below its last one).

    Open it on process 0 only (the trainer does); `wandb.init`'s failure (no login, no
    network) is a ConfigError naming run.wandb, raised before the run computes anything."""

    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: str | os.PathLike, *, project: str, name: str | None = None,
                 mode: str = "online", entity: str | None = None,
                 config: dict[str, Any] | None = None, resume: bool = False):
        """Starts the W&B run (`wandb.init`).

        Args:
            run_dir: the run's directory (W&B's files go under <run_dir>/wandb).
            project, entity: where the run goes (entity None: the login's default).
            name: the run's display name; None: run_dir's last part.
            mode: "online" or "offline".
            config: the run's config (nested plain data), shown and searchable in W&B.
            resume: continue the W&B run whose id <run_dir>/wandb_run_id holds, if any.
        """
        import wandb

        from jaxspec.config import ConfigError

        run_dir = os.fspath(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        id_path = os.path.join(run_dir, self.ID_FILE)
        run_id = None
        if resume and os.path.isfile(id_path):
            with open(id_path) as fh:
                run_id = fh.read().strip() or None
        try:
            self.run = wandb.init(
                project=project, entity=entity, mode=mode, dir=run_dir, config=config,
                name=name or os.path.basename(os.path.abspath(run_dir)), id=run_id,
                resume="allow" if run_id else None)
        except wandb.errors.Error as e:
            raise ConfigError("run.wandb.mode", mode, f"W&B could not start a run ({e})",
                              "`wandb login` (or WANDB_API_KEY) for online, or "
                              "run.wandb.mode=offline") from None
        with open(id_path, "w") as fh:
            fh.write(self.run.id + "\n")

    @classmethod
    def for_run(cls, cfg, *, resume: bool = False) -> "WandbSink | None":
        """The sink of a `Config`'s run.wandb (None when it is off), logging the resolved
        config."""
        from jaxspec.config import to_dict

        w = cfg.run.wandb
        if w is None:
            return None
        return cls(cfg.run.dir, project=w.project, name=w.name, mode=w.mode, entity=w.entity,
                   config=to_dict(cfg), resume=resume)

    def write(self, row: dict[str, Any]) -> None:
        """A MetricsWriter row ({"step": s, name: value, ...}): its numbers at step s."""
        self.run.log(_scalars(row), step=int(row["step"]))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MetricsWriter:
    """One JSON object per step appended to <run_dir>/metrics.jsonl, and the scalar ones to
    TensorBoard (<run_dir>/tb) when tensorboardX is installed and to `wandb` (a WandbSink,
    closed with the writer) when given.

    `resume_step`: the step a resumed run restarts after; lines of later steps (written
    before the run stopped, after its last checkpoint) are dropped, so the file ends up as
    if the run had never stopped."""

    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int | None = None,
                 tensorboard: bool = True, log: Callable[[str], None] | None = None,
                 wandb: WandbSink | None = None):
        self.run_dir = os.fspath(run_dir)
        self._wandb = wandb
        self._log = log or _log.warning
        os.makedirs(self.run_dir, exist_ok=True)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        if resume_step is None:
            open(self.path, "w").close()
        else:
            self._truncate_after(resume_step)
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                _log.info("tensorboardX is not installed: metrics go to %s only", self.path)
            else:
                self._tb = SummaryWriter(os.path.join(self.run_dir, "tb"))

    def _truncate_after(self, step: int) -> None:
        """Keep the rows up to `step`; a torn line (a run killed mid-write) is dropped and
        reported. Rewritten atomically."""
        if not os.path.exists(self.path):
            return
        rows, torn = _read_rows(self.path)
        if torn:
            self._log(f"{self.path}: dropped {len(torn)} torn line(s) left by an interrupted "
                      f"run (line {', '.join(str(i) for i, _ in torn)}: "
                      f"{torn[0][1][:60]!r}...)")
        keep = [json.dumps(r) + "\n" for r in rows if r.get("step", -1) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            fh.writelines(keep)
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record `metrics` for `step`; returns the plain-python row that was written."""
        row = {"step": int(step), **scalar_metrics(metrics)}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in _scalars(row).items():
                self._tb.add_scalar(k, v, int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.write(row)
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_STAGE_ABBREV = {"generation": "gen", "training": "train", "logprob": "logp"}
WIDTH = 120  # console lines fit this many columns


def format_step_line(step: int, metrics: dict[str, Any], *, total_steps: int | None = None,
                     width: int = WIDTH) -> str:
    """One line for the progress log, at most `width` columns, e.g.
    'step 3/40 | reward 0.412 | acc_len 2.31 | step 1.62s | gen 0.93s 57% | train 0.41s 25%'
    (with an online draft head, its next-token accuracy on the step's rollouts after acc_len:
    'head_acc 0.91'; with an MoE policy moe/routing_mismatch, 'route_diff 0.000', and any
    moe/routing_gaps, 'route_gaps 3').
    The stages that take a quarter of the step or more (a compile: the draft's on the first
    step after a resume), then generation and training, then the others by time are shown (in
    pipeline order) as far as the width allows (the percentages, then generation and
    training, left out when the big stages would not fit otherwise); the time of those that
    do not fit is summed as 'rest' (metrics.jsonl has them all)."""
    m = scalar_metrics(metrics)
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    if m.get("reward") is not None:
        parts.append(f"reward {m['reward']:.3f}")
    if m.get("acceptance_length") is not None:
        parts.append(f"acc_len {m['acceptance_length']:.2f}")
    if m.get("draft/acc_0") is not None:  # the online head's next-token accuracy this step
        parts.append(f"head_acc {m['draft/acc_0']:.2f}")
    if m.get("moe/routing_mismatch") is not None:  # an MoE policy: generation vs training
        parts.append(f"route_diff {m['moe/routing_mismatch']:.3f}")
    if m.get("moe/routing_gaps"):  # fed tokens without a route record (0 expected)
        parts.append(f"route_gaps {m['moe/routing_gaps']}")
    if m.get("time/step") is not None:
        parts.append(f"step {m['time/step']:.2f}s")
    stages = [k[len("time/"):] for k in m
              if k.startswith("time/") and k != "time/step" and m[k] is not None]
    step_seconds = m.get("time/step") or sum(m[f"time/{n}"] for n in stages)
    big = {n for n in stages if m[f"time/{n}"] >= 0.25 * step_seconds > 0}

    def text(names, label, shares):
        seconds = sum(m[f"time/{n}"] for n in names)
        pct = [m.get(f"share/{n}") for n in names]
        out = f"{label or _STAGE_ABBREV.get(names[0], names[0])} {seconds:.2f}s"
        return out + (f" {100 * sum(pct):.0f}%" if shares and None not in pct else "")

    def line_of(shown, shares):
        rest = [n for n in stages if n not in shown]
        return " | ".join(parts + [text([n], None, shares) for n in stages if n in shown]
                          + ([text(rest, "rest", shares)] if rest else []))

    order = sorted(stages, key=lambda n: (n not in big, n not in ("generation", "training"),
                                          -m[f"time/{n}"]))
    main = big | ({"generation", "training"} & set(stages))
    for needed, shares in ((main, True), (main, False), (big, True), (big, False)):
        shown: list[str] = []
        for name in order:
            if len(line_of(shown + [name], shares)) > width:
                break
            shown.append(name)
        if needed <= set(shown):
            break
    line = line_of(shown, shares)
    return line if len(line) <= width else line[:width]


def fit_lines(text: str, width: int = WIDTH) -> list[str]:
    """`text` as lines of at most `width` columns, broken between its ' | ' parts (then
    between words); continuation lines are indented by two spaces."""
    lines: list[str] = []
    for raw in text.splitlines() or [""]:
        current = ""
        for part in raw.split(" | "):
            joined = f"{current} | {part}" if current else part
            if len(joined) <= width or not current:
                current = joined
            else:
                lines.append(current)
                current = "  " + part
            while len(current) > width:  # one part wider than a line: break between words
                cut = current.rfind(" ", 3, width + 1)
                cut = cut if cut > 2 else width
                lines.append(current[:cut])
                current = "  " + current[cut:].lstrip()
        lines.append(current)
    return lines


class Console:
    """A run's progress for people: a tqdm bar (on stderr) only when stderr is a terminal,
    plain lines on stdout otherwise (a log file or a pipe gets no '\\r' frames); every line
    at most `width` columns. `line` may be used before `start` (warm-up messages)."""

    def __init__(self, *, bar: bool | None = None, width: int = WIDTH, stream=None):
        import sys

        self.out = stream if stream is not None else sys.stdout
        self._err = sys.stderr
        self.width = width
        self.use_bar = self._err.isatty() if bar is None else bar
        self._bar = None

    def line(self, text: str) -> None:
        for line in fit_lines(text, self.width):
            if self._bar is not None:
                self._bar.write(line, file=self.out)
            else:
                print(line, file=self.out, flush=True)

    def start(self, total: int, initial: int = 0) -> None:
        """The bar (on a terminal) from `initial` of `total` steps."""
        if self.use_bar:
            import shutil

            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", file=self._err,
                             ncols=min(shutil.get_terminal_size().columns, self.width))

    def step(self, step: int, row: dict, *, total: int, show: bool) -> None:
        """After a step: its line (when `show`) and the bar's advance."""
        if show:
            self.line(format_step_line(step, row, total_steps=total, width=self.width))
        if self._bar is not None:
            acc = row.get("acceptance_length")
            self._bar.set_postfix(reward=f"{row['reward']:.3f}",
                                  acc_len=f"{acc if acc is not None else float('nan'):.2f}")
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Progress:
    """Progress lines of a long stretch outside the GRPO steps (warm-up, draft init, a
    compile), so that a slow machine is told from a hang.

    `update(done)` logs '<what>: <unit> <done>/<total>[, <detail>] (<seconds>s)' when
    `every` seconds have passed since the last line, and always on the last; `line(text)`
    logs '<what>: <text>' at once (a phase starting, e.g. a compile). Used as a context
    manager, a watchdog thread also logs '<what>: <news>, still running (<seconds>s)'
    whenever `every` + `grace` seconds pass without a line (news: the last line's, or
    `news()`'s; the grace lets a due update come first):
    one call that runs long (a compile, a chunk of steps on a loaded machine) still prints
    a line that often."""

    def __init__(self, log: Callable[[str], None], what: str, total: int | None = None, *,
                 unit: str = "step", every: float = 8.0, grace: float = 3.0,
                 start: float | None = None, clock: Callable[[], float] = time.perf_counter):
        """Args:
            log: where lines go (the run's console).
            what: the stretch's name, each line's prefix, e.g. "warm-up (policy)".
            total, unit: how many `unit`s the stretch has (update's 'step 5/180').
            every: seconds between update lines; the watchdog waits `every` + `grace`.
            start: the clock reading the lines' seconds count from (default: now).
            clock: seconds, monotonic (tests pass a fake one; the watchdog uses it too).
        """
        self._log, self.what, self.total, self.every = log, what, total, every
        self.grace = grace
        self.unit = unit
        self._clock = clock
        self.start = clock() if start is None else start  # the clock reading of "0s"
        self._last = self.start  # when the last line was logged
        self._news = "started"  # what the watchdog repeats
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None

    @property
    def elapsed(self) -> float:
        return self._clock() - self.start

    def _emit(self, text: str, news: str) -> None:
        with self._lock:
            self._log(text)
            self._last, self._news = self._clock(), news

    def line(self, text: str) -> None:
        self._emit(f"{self.what}: {text}", text)

    def news(self, text: str) -> None:
        """What the watchdog's next line says is going on (nothing is logged now)."""
        self._news = text

    def update(self, done: int, detail: str | Callable[[], str] = "") -> None:
        """`done` of `total` finished; `detail` may be a function, called only when the line
        is printed (a device value read only then)."""
        now = self._clock()
        if done != self.total and now - self._last < self.every:
            self._news = f"{self.unit} {done}/{self.total} done"
            return
        detail = detail() if callable(detail) else detail  # may wait for the device
        count = f"{self.unit} {done}/{self.total}"
        self._emit(f"{self.what}: {count}{f', {detail}' if detail else ''} "
                   f"({self.elapsed:.0f}s)", f"{count} done")

    def _watch(self) -> None:
        while not self._stop.wait(min(self.every / 4, 1.0)):
            with self._lock:
                quiet = self._clock() - self._last >= self.every + self.grace
            if quiet:
                self._emit(f"{self.what}: {self._news}, still running ({self.elapsed:.0f}s)",
                           self._news)

    def __enter__(self) -> "Progress":
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"progress {self.what}",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------- run summaries

def read_metrics(run_dir: str) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl, in step order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a run directory of "
                                f"scripts/train_grpo.py")
    rows, torn = _read_rows(path)
    if torn:
        _log.warning("%s: skipped %d torn line(s) (line %s) left by an interrupted run", path,
                     len(torn), ", ".join(str(i) for i, _ in torn))
    return sorted(rows, key=lambda r: r["step"])


def _read_rows(path: str) -> tuple[list[dict], list[tuple[int, str]]]:
    """(the parsed rows of a JSONL file, [(line number, text)] of lines that are not a
    JSON object: torn by a crash mid-write)."""
    rows, torn = [], []
    with open(path, errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
            else:
                torn.append((i, line.strip()))
    return rows, torn


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def run_summary(rows: list[dict]) -> dict[str, Any]:
    """The headline numbers of a run: reward over its first and last fifth and the
    step-to-step noise (std of successive differences / sqrt 2), acceptance length,
    speculative vs plain generation time at the compared steps, mean stage shares
    (the first step, which compiles, left out when there are others)."""
    if not rows:
        raise ValueError("no metrics rows: the run has not finished a step")
    reward = np.array([r["reward"] for r in rows], np.float64)
    n = max(len(rows) // 5, 1)
    out: dict[str, Any] = {
        "steps": len(rows),
        "reward_first_fifth": float(reward[:n].mean()),
        "reward_last_fifth": float(reward[-n:].mean()),
        "reward_noise": float(np.std(np.diff(reward)) / np.sqrt(2)) if len(rows) > 2 else 0.0,
        "acceptance_length_mean": _mean(r.get("acceptance_length") for r in rows),
        "acceptance_length_last_fifth": _mean(r.get("acceptance_length") for r in rows[-n:]),
    }
    compared = [r for r in rows if r.get("generation_plain_time_s") is not None]
    if compared:
        spec = _mean(r["generation_time_s"] for r in compared)
        plain = _mean(r["generation_plain_time_s"] for r in compared)
        # the headline: the median of the compared steps' own ratios (robust to one slow
        # step on a shared machine); the ratio of the mean times next to it
        ratios = [r["generation_plain_time_s"] / r["generation_time_s"] for r in compared
                  if r["generation_time_s"] > 0]
        out.update(generation_time_mean=spec, generation_plain_time_mean=plain,
                   generation_speedup=float(np.median(ratios)) if ratios else None,
                   generation_speedup_of_means=plain / spec if spec else None,
                   replay_identical=_mean(r.get("replay_identical") for r in compared))
    steady = rows[1:] if len(rows) > 1 else rows
    out["step_time_mean"] = _mean(r.get("time/step") for r in steady)
    stages = sorted({k[len("share/"):] for r in steady for k in r if k.startswith("share/")})
    out["stage_shares"] = {k: _mean(r.get(f"share/{k}") for r in steady) for k in stages}
    return out
