#!/usr/bin/env python
"""Plots of a GRPO run: python scripts/report.py RUN_DIR

Reads RUN_DIR/metrics.jsonl (written by scripts/train_grpo.py) and writes into RUN_DIR:
  reward.png       mean reward per step (and its 5-step running mean)
  acceptance.png   acceptance length per step (tokens per policy forward) and the
                   per-position acceptance rates of the drafts
  stages.png       the step time split into every stage the step line reports (data, setup,
                   generation, history, reward, logprob, training, draft, other: the
                   untimed rest, e.g. the plain comparison), stacked per step: each bar's
                   height is the step's time/step
  generation.png   speculative vs plain generation time at the steps where both ran
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


def stages_figure(rows):
    """The stacked stage times per step (a matplotlib Figure; one bar container per
    stage, in `stage_times` order)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    bottom = np.zeros(len(rows))
    colors = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # 7: gray
    for i, (stage, seconds) in enumerate(stage_times(rows).items()):
        color = "0.8" if stage == "other" else colors[i % len(colors)]
        ax.bar(steps, seconds, bottom=bottom, label=stage, width=0.9, color=color)
        bottom += np.asarray(seconds)
    if len(rows) > 1:  # the first step compiles; keep the scale for the others
        top = 1.15 * max(bottom[1:].max(), 1e-3)
        ax.set_ylim(0, top)
        for step, total in zip(steps, bottom, strict=True):  # a cut bar: its height in text
            if total > top:
                ax.text(step, 0.97 * top, f"{total:.1f}s", ha="center", va="top", fontsize=8,
                        bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
    ax.set(xlabel="step", ylabel="seconds",
           title="Step time by stage (bar = time/step; step 1 compiles)")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    return fig


def plot_run(run_dir: str) -> list[str]:
    """Write the four PNGs into run_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    from jaxspec.metrics import read_metrics

    rows = read_metrics(run_dir)
    paths = []

    def save(fig, name):
        for ax in fig.axes:  # steps are whole numbers
            if ax.get_xlim()[1] - ax.get_xlim()[0] > 2:  # (else MaxNLocator falls back)
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

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = _series(rows, "acceptance_length")
    ax.plot(xs, ys, marker=".", lw=1.5, color="k", label="acceptance length")
    ax.axhline(1.0, ls=":", color="gray")
    ax.set(xlabel="step", ylabel="tokens per policy forward", title="Speculation")
    positions = sorted({k for r in rows for k in r if k.startswith("spec/acceptance_at_")},
                       key=lambda k: int(k.rsplit("_", 1)[1]))
    if positions:
        ax2 = ax.twinx()
        for key in positions:
            px, py = _series(rows, key)
            ax2.plot(px, py, lw=1, alpha=0.7, label=f"accepted at depth {key.rsplit('_', 1)[1]}")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("acceptance rate (right axis)")
    handles = [h for a in fig.axes for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3,
              fontsize=8)  # below the axes: the curves fill the plot
    ax.grid(alpha=0.3)
    save(fig, "acceptance.png")

    save(stages_figure(rows), "stages.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    compared = [r for r in rows if r.get("generation_plain_time_s") is not None]
    if compared:
        xs = np.array([r["step"] for r in compared], float)
        ax.bar(xs - 0.2, [r["generation_time_s"] for r in compared], width=0.4,
               label="speculative")
        ax.bar(xs + 0.2, [r["generation_plain_time_s"] for r in compared], width=0.4,
               label="plain (same key, same step)")
        ax.set_xticks(xs)  # the compared steps
        ax.set_title("Generation time: speculative vs plain")
    else:
        xs, ys = _series(rows, "generation_time_s")
        ax.plot(xs, ys, marker=".", label="generation")
        ax.set_title("Generation time (no plain comparison: run.compare_plain = 0)")
    ax.set(xlabel="step", ylabel="seconds")
    ax.legend()
    save(fig, "generation.png")
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
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
