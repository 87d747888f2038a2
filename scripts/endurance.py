#!/usr/bin/env python
"""Endurance: a long run of the main job that must stay healthy.

    python scripts/endurance.py --steps 1000 --out /tmp/endurance.json
    python scripts/endurance.py configs/tiny.yaml --steps 200 rollout.group_size=2

Runs GRPOTrainer on the config (default: the tiny default; 1000 steps take about 10 minutes
on a 2-core CPU) and records, per step: non-finite metrics
(NaN/inf are written as null in metrics.jsonl; the guard's `nonfinite` flag), resident
memory (RSS), step time, and every --sample-every steps the size of run.dir/checkpoints
(pruned to run.keep_checkpoints) and of the other files (metrics.jsonl and tb/ grow by a
row per step). Prints a JSON summary and the markdown table of
docs/BENCHMARKS.md; exits 1 when a health bound fails (any non-finite value, RSS growth
>= 5%, step-time drift >= 10%, checkpoints/ growing after the first pruning).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# The tiny default as it is (save every 10 steps, keep 3, plain comparison every 5), with
# one progress line per 100 steps; scale it with overrides, e.g. rollout.group_size=4.
DEFAULT_SCALE = ["run.log_every=100"]


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # a checkpoint pruned while walking
    return total


def _median(values):
    return statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value, after the default scale-down")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument("--out", default=None, help="the JSON summary and per-step samples")
    args = p.parse_intermixed_args(argv)
    if args.steps < 20:
        print(f"error: --steps {args.steps}: at least 20 (first / last 10% medians)",
              file=sys.stderr)
        return 2

    import psutil

    from jaxspec.config import ConfigError, load_config
    from jaxspec.rl.trainer import GRPOTrainer

    run_dir = tempfile.mkdtemp(prefix="jaxspec-endurance-")
    overrides = [*DEFAULT_SCALE, f"run.steps={args.steps}", f"run.dir={run_dir}", *args.overrides]
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    proc = psutil.Process()
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(cfg, log=lambda line: print(line, file=sys.stderr))
    build_s = time.perf_counter() - t0
    step_times, walls, cpu, rss, disk, bad = [], [], [], [], [], []
    previous = [time.perf_counter(), time.process_time()]

    def on_step(step, row):
        step_times.append(row["time/step"])
        now = time.perf_counter()
        walls.append(now - previous[0])  # the step with its metrics row and checkpoint save
        cpu.append(time.process_time() - previous[1])  # CPU seconds: less load-sensitive
        previous[0], previous[1] = now, time.process_time()
        rss.append(proc.memory_info().rss)
        for k, v in row.items():
            if v is None or k in ("nonfinite", "nonfinite_skipped"):
                bad.append((step, k))
        if step % args.sample_every == 0 or step == args.steps:
            ckpt = _dir_bytes(os.path.join(run_dir, "checkpoints"))
            disk.append((step, ckpt, _dir_bytes(run_dir) - ckpt))
            print(f"step {step}: {row['time/step']:.3f}s rss {rss[-1] / 2**20:.0f} MiB "
                  f"checkpoints {ckpt / 2**20:.1f} MiB, other files {disk[-1][2] / 2**20:.1f} "
                  f"MiB, reward {row['reward']:.3f} "
                  f"acc_len {row['acceptance_length']:.2f}", file=sys.stderr, flush=True)

    t1 = previous[0] = time.perf_counter()
    previous[1] = time.process_time()
    trainer.run(on_step=on_step)
    train_s = time.perf_counter() - t1
    n = max(len(step_times) // 10, 1)
    first = _median(step_times[1:n + 1])  # step 1 compiles
    last = _median(step_times[-n:])
    rss_ref = rss[n - 1]  # after the first 10% (compilation and caches settled)
    after_prune = [b for s, b, _ in disk
                   if s > cfg.run.save_every * (cfg.run.keep_checkpoints + 1)]
    summary = {
        "config": args.config, "overrides": overrides[:-1], "steps": len(step_times),
        "build_s": round(build_s, 1), "train_s": round(train_s, 1),
        "nonfinite_values": len(bad), "nonfinite_first": bad[:5],
        "rss_step1_mib": round(rss[0] / 2**20, 1), "rss_at_10pct_mib": round(rss_ref / 2**20, 1),
        "rss_end_mib": round(rss[-1] / 2**20, 1),
        "rss_growth_pct": round(100 * (rss[-1] / rss_ref - 1), 2),
        "step_time_first10pct_median_s": round(first, 4),
        "step_time_last10pct_median_s": round(last, 4),
        "step_time_drift_pct": round(100 * (last / first - 1), 2),
        "wall_per_step_first10pct_median_s": round(_median(walls[1:n + 1]), 4),
        "wall_per_step_last10pct_median_s": round(_median(walls[-n:]), 4),
        "wall_per_step_mean_s": round(statistics.mean(walls[1:]), 4),
        "cpu_per_step_first10pct_median_s": round(_median(cpu[1:n + 1]), 4),
        "cpu_per_step_last10pct_median_s": round(_median(cpu[-n:]), 4),
        "cpu_per_step_drift_pct": round(100 * (_median(cpu[-n:]) / _median(cpu[1:n + 1]) - 1), 2),
        "checkpoints_mib": [(s, round(b / 2**20, 2)) for s, b, _ in disk],
        "other_files_mib": [(s, round(o / 2**20, 2)) for s, _, o in disk],  # metrics, tb
        "other_files_kib_per_step": round(disk[-1][2] / 1024 / disk[-1][0], 2),
        "checkpoints_min_max_after_pruning_mib": [round(min(after_prune) / 2**20, 2),
                                                  round(max(after_prune) / 2**20, 2)]
        if after_prune else None,
        "checkpoints_kept": sorted(int(x) for x in os.listdir(os.path.join(run_dir, "checkpoints"))
                                   if x.isdigit()),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }
    bounded = not after_prune or max(after_prune) <= 1.05 * min(after_prune)
    summary["healthy"] = bool(summary["nonfinite_values"] == 0 and summary["rss_growth_pct"] < 5
                              and abs(summary["step_time_drift_pct"]) < 10 and bounded)
    print(json.dumps(summary, indent=1))
    print(f"| steps | non-finite values | RSS after 10% -> end | step time median first -> "
          f"last 10% | checkpoints/ after pruning (min-max) | wall |\n| --- | --- | --- | --- | --- | --- |\n"
          f"| {summary['steps']} | {summary['nonfinite_values']} | {summary['rss_at_10pct_mib']} "
          f"-> {summary['rss_end_mib']} MiB ({summary['rss_growth_pct']:+.2f}%) | "
          f"{first * 1000:.1f} -> {last * 1000:.1f} ms ({summary['step_time_drift_pct']:+.2f}%) | "
          f"{summary['checkpoints_min_max_after_pruning_mib']} MiB | {build_s:.0f}s build + "
          f"{train_s:.0f}s train |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(summary, step_times=step_times, walls=walls, cpu=cpu, rss=rss), fh)
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if summary["healthy"] else 1


if __name__ == "__main__":
    sys.exit(main())
