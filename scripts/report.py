#!/usr/bin/env python
"""Plots of a GRPO run: python scripts/report.py RUN_DIR

Reads RUN_DIR/metrics.jsonl (written by scripts/train_grpo.py) and writes into RUN_DIR:
  reward.png       mean reward per step (and its 5-step running mean)
  acceptance.png   acceptance length per step (tokens per policy forward, left axis; 1.0:
                   nothing accepted) and the per-depth acceptance rates of the drafts (right
                   axis)
  stages.png       the step time split into every stage the step line reports (data, setup,
                   generation, history, reward, logprob, training, draft, other: the
                   untimed rest, e.g. the plain comparison), stacked per step: each bar's
                   height is the step's time/step; the axis is scaled to the steps that did
                   not compile (the first, and the first after each resume, are cut, their
                   height in text)
  generation.png   speculative vs plain generation time at the steps where both ran (ticks
                   at those steps), each pair labelled with its ratio plain / speculative
Prints the run's headline numbers (the ones docs/BENCHMARKS.md quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# the stages in pipeline order (jaxspec.rl.trainer); one the trainer adds later is stacked
# after these, by name, and `other` (the step's untimed rest) last
STAGES = ("data", "setup", "generation", "history", "reward", "logprob", "training", "draft")


def stage_times(rows) -> dict[str, list[float]]:
    """{stage: seconds per row} for every `time/<stage>` key of the rows but time/step, in
    pipeline order, `other` last; a stage a row lacks counts 0 there. The stages of a row
    add up to its time/step (`StageTimer.summary`)."""
    names = {k[len("time/"):] for r in rows for k in r if k.startswith("time/")} - {"step"}
    order = [s for s in STAGES if s in names] + sorted(names - set(STAGES) - {"other"})
    order += ["other"] if "other" in names else []
    return {s: [r.get(f"time/{s}") or 0.0 for r in rows] for s in order}


def _series(rows, key):
    xs = [r["step"] for r in rows if r.get(key) is not None]
    return xs, [r[key] for r in rows if r.get(key) is not None]


def compiled_steps(rows, run_dir: str | None = None) -> list[int]:
    """The steps that compiled the run's programs: the first one, and the first after each
    resume (<run_dir>/config_history.jsonl, which the trainer appends on every resume)."""
    steps = [r["step"] for r in rows]
    out = set(steps[:1])
    path = os.path.join(run_dir, "config_history.jsonl") if run_dir else None
    if path and os.path.isfile(path):
        with open(path) as fh:
            for line in fh:
                try:
                    resumed = json.loads(line).get("resumed_at_step")
                except (json.JSONDecodeError, AttributeError):
                    continue  # a torn line
                if isinstance(resumed, int):
                    out.add(resumed + 1)
    return sorted(s for s in out if s in steps)


def stages_figure(rows, compiled=None):
    """The stacked stage times per step (a matplotlib Figure; one bar container per
    stage, in `stage_times` order). The y-axis is scaled to the steps that did not compile
    (`compiled`: the steps that did; default the first): a cut bar shows its height."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    compiled = set(steps[:1] if compiled is None else compiled)
    bottom = np.zeros(len(rows))
    colors = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # 7: gray
    for i, (stage, seconds) in enumerate(stage_times(rows).items()):
        color = "0.8" if stage == "other" else colors[i % len(colors)]
        ax.bar(steps, seconds, bottom=bottom, label=stage, width=0.9, color=color)
        bottom += np.asarray(seconds)
    steady = [t for s, t in zip(steps, bottom, strict=True) if s not in compiled]
    if steady:  # the compiling steps: keep the scale for the others
        top = 1.15 * max(max(steady), 1e-3)
        ax.set_ylim(0, top)
        for step, total in zip(steps, bottom, strict=True):  # a cut bar: its height in text
            if total > top:
                ax.text(step, 0.97 * top, f"{total:.1f}s", ha="center", va="top", fontsize=8,
                        bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
    cut = ", ".join(str(s) for s in sorted(compiled))
    ax.set(xlabel="step", ylabel="seconds",
           title=f"Step time by stage (bar = time/step; step{'s' if len(compiled) > 1 else ''} "
                 f"{cut} compiled)")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    return fig


def acceptance_figure(rows):
    """Acceptance length per step (left axis) and the per-depth acceptance rates (right
    axis); the legend names each line's axis, and the 1.0 line (nothing accepted) is
    labelled."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = _series(rows, "acceptance_length")
    ax.plot(xs, ys, marker=".", lw=1.5, color="k", label="acceptance length (left axis)")
    ax.axhline(1.0, ls=":", color="gray", label="1.0 = plain decoding (left axis)")
    ax.annotate("1.0: no draft token accepted", xy=(0.01, 1.0),
                xycoords=("axes fraction", "data"), xytext=(0, 2), textcoords="offset points",
                fontsize=8, color="gray", va="bottom")
    ax.set(xlabel="step", ylabel="tokens per policy forward (left axis)", title="Speculation")
    positions = sorted({k for r in rows for k in r if k.startswith("spec/acceptance_at_")},
                       key=lambda k: int(k.rsplit("_", 1)[1]))
    if positions:
        ax2 = ax.twinx()
        for key in positions:
            px, py = _series(rows, key)
            ax2.plot(px, py, lw=1, alpha=0.7,
                     label=f"accepted at depth {key.rsplit('_', 1)[1]} (right axis)")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("acceptance rate (right axis)")
    handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2,
              fontsize=8)  # below the axes: the curves fill the plot
    ax.grid(alpha=0.3)
    return fig


def generation_figure(rows):
    """Speculative vs plain generation time at the compared steps (ticks at those steps,
    each pair labelled with its ratio plain / speculative); without comparisons the
    speculative time per step."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    compared = [r for r in rows if r.get("generation_plain_time_s") is not None]
    if compared:
        xs = np.array([r["step"] for r in compared], float)
        spec = [r["generation_time_s"] for r in compared]
        plain = [r["generation_plain_time_s"] for r in compared]
        width = 0.4 * max(np.min(np.diff(xs)) if len(xs) > 1 else 1.0, 1.0)
        ax.bar(xs - width / 2, spec, width=width, label="speculative")
        ax.bar(xs + width / 2, plain, width=width, label="plain (same key, same step)")
        for x, a, b in zip(xs, spec, plain, strict=True):
            if a > 0:
                ax.annotate(f"{b / a:.2f}x", xy=(x, max(a, b)), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [str(int(x)) for x in xs])  # the compared steps
        ax.margins(y=0.12)  # room for the ratios
        ax.set_title("Generation time: speculative vs plain (label: plain / speculative)")
    else:
        xs, ys = _series(rows, "generation_time_s")
        ax.plot(xs, ys, marker=".", label="generation")
        ax.set_title("Generation time (no plain comparison: run.compare_plain = 0)")
    ax.set(xlabel="step", ylabel="seconds")
    ax.legend()
    return fig


def plot_run(run_dir: str) -> list[str]:
    """Write the four PNGs into run_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import AutoLocator, MaxNLocator

    from jaxspec.metrics import read_metrics

    rows = read_metrics(run_dir)
    paths = []

    def save(fig, name):
        for ax in fig.axes:  # steps are whole numbers (ticks a figure placed stay)
            auto = isinstance(ax.xaxis.get_major_locator(), AutoLocator)
            if auto and ax.get_xlim()[1] - ax.get_xlim()[0] > 2:  # (else MaxNLocator falls back)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        path = os.path.join(run_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110, bbox_inches="tight")  # legends below the axes too
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = _series(rows, "reward")
    ax.plot(xs, ys, marker=".", lw=1, label="reward (batch mean)")
    if len(ys) >= 5:
        smooth = np.convolve(ys, np.ones(5) / 5, mode="valid")
        ax.plot(xs[4:], smooth, lw=2, label="5-step running mean")
    ax.set(xlabel="step", ylabel="reward", title="GRPO reward")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "reward.png")

    save(acceptance_figure(rows), "acceptance.png")
    save(stages_figure(rows, compiled_steps(rows, run_dir)), "stages.png")
    save(generation_figure(rows), "generation.png")
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the run.dir of a scripts/train_grpo.py run")
    args = p.parse_args(argv)
    from jaxspec.metrics import read_metrics, run_summary

    try:
        rows = read_metrics(args.run_dir)
        summary = run_summary(rows)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in plot_run(args.run_dir):
        print(f"wrote {path}")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
