"""Where the test suite's time goes: per test, its wall time, this process's CPU seconds,
its subprocesses' CPU seconds, and JAX's compile events (XLA compiles, tracing, lowering to
MLIR), through JAX's public `jax.monitoring` listeners.

Recording (tests/conftest.py turns it on when the variable names a directory):

    JAXSPEC_TEST_PROFILE=/tmp/suite python -m pytest -q -n 2

writes one JSON line per test to DIR/<worker>-<pid>.jsonl. Summary, by test file, largest first:

    python -m jaxspec.testing.suite_profile /tmp/suite [--top 30]

and by compiled function (XLA seconds, how many compiles, in how many files):

    python -m jaxspec.testing.suite_profile /tmp/suite --programs

Subprocess CPU is what a test's subprocesses used while it ran (`RUSAGE_CHILDREN`); their
compiles are in that figure, not in the compile columns, which count this process only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import resource
import time

EVENTS = {  # jax.monitoring event -> column
    "/jax/core/compile/backend_compile_duration": "xla",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
}
_PARENT = "JAXSPEC_TEST_PROFILE_PARENT"


class Recorder:
    """Per-test records: tests/conftest.py calls `begin` and `end` around each test's
    protocol (set-up, call, tear-down); the listener adds the running test's compile events."""

    def __init__(self, directory: str):
        import jax.monitoring

        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events: collections.Counter = collections.Counter()
        self.programs: dict = {}  # XLA-compiled function name -> [compiles, seconds]
        self.running = False
        self.start = None  # (monotonic time, own rusage, children's rusage) at `begin`
        self.out = None
        # A pytest run that a test starts (tests/test_compiled_as_users.py) records too; its
        # lines are marked nested, as their CPU is the parent test's subprocess CPU. `begin`
        # sets the variable, so pytest-xdist's controller (which runs no test) does not.
        self.nested = os.environ.get(_PARENT) == "1"
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
        column = EVENTS.get(event)
        if column and self.running:
            self.events[column] += duration
            if column == "xla":
                self.events["compiles"] += 1
                program = self.programs.setdefault(str(fun_name), [0, 0.0])
                program[0] += 1
                program[1] += duration

    def _file(self):
        if self.out is None:
            name = os.environ.get("PYTEST_XDIST_WORKER", "main")  # (a nested run inherits it)
            self.out = open(self.dir / f"{name}-{os.getpid()}.jsonl", "a", buffering=1)
        return self.out

    def begin(self) -> None:
        """A test starts: its clocks from now."""
        os.environ[_PARENT] = "1"  # a pytest run that this test starts is nested
        self.start = (time.monotonic(), resource.getrusage(resource.RUSAGE_SELF),
                      resource.getrusage(resource.RUSAGE_CHILDREN))
        self.events.clear()
        self.programs = {}
        self.running = True

    def end(self, nodeid: str) -> None:
        """The test ended: write its line."""
        self.running = False
        t0, own0, kids0 = self.start
        own1, kids1 = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

        def cpu(a, b):
            return round((b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime), 3)

        self._file().write(json.dumps({
            "test": nodeid, "wall": round(time.monotonic() - t0, 3), "cpu": cpu(own0, own1),
            "subprocess_cpu": cpu(kids0, kids1), "nested": self.nested,
            **{k: round(v, 3) for k, v in self.events.items()},
            "programs": {k: [n, round(t, 3)] for k, (n, t) in self.programs.items()}}) + "\n")


def summarize(directory: str, top: int = 30) -> str:
    """A table by test file of the recorded lines, largest CPU (own + subprocesses) first;
    "all" leaves out nested runs' lines (counted in their parent's subprocess CPU)."""
    files: dict = collections.defaultdict(collections.Counter)
    for path in sorted(pathlib.Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            name = row.pop("test").split("::")[0] + (" (nested)" if row.pop("nested", False) else "")
            total = files[name]
            total["tests"] += 1
            total.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
    if not files:
        raise SystemExit(f"error: no profile lines (*.jsonl) in {directory}")
    columns = ("tests", "wall", "cpu", "subprocess_cpu", "xla", "compiles", "trace", "lower")
    everything = collections.Counter()
    for name, total in files.items():
        if not name.endswith("(nested)"):
            everything.update(total)
    order = sorted(files, key=lambda f: -(files[f]["cpu"] + files[f]["subprocess_cpu"]))[:top]
    lines = ["| file | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for name in ["all"] + order:
        total = everything if name == "all" else files[name]
        lines.append(f"| {name} | " + " | ".join(f"{total[c]:.0f}" for c in columns) + " |")
    return "\n".join(lines)


def programs(directory: str, top: int = 30) -> str:
    """A table of the XLA-compiled functions (by name, nested runs included), most compile
    seconds first: how often each was compiled, in how many test files, and its seconds."""
    seconds: collections.Counter = collections.Counter()
    compiles: collections.Counter = collections.Counter()
    files: dict = collections.defaultdict(set)
    for path in sorted(pathlib.Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for name, (n, t) in row.get("programs", {}).items():
                seconds[name] += t
                compiles[name] += n
                files[name].add(row["test"].split("::")[0])
    if not seconds:
        raise SystemExit(f"error: no compiled functions in the profile lines of {directory} "
                         "(recorded before they were, or no test compiled)")
    lines = ["| function | compiles | files | XLA s |", "| --- | ---: | ---: | ---: |"]
    for name, t in seconds.most_common(top):
        lines.append(f"| {name} | {compiles[name]} | {len(files[name])} | {t:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--top", type=int, default=30, help="rows to list (default 30)")
    parser.add_argument("--programs", action="store_true",
                        help="by compiled function instead of by test file")
    args = parser.parse_args(argv)
    print((programs if args.programs else summarize)(args.directory, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
