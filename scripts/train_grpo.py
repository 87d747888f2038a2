#!/usr/bin/env python
"""GRPO on rollouts from lossless speculative decoding: the main job.

    python scripts/train_grpo.py configs/long.yaml                    # the README's main job, CPU
    python scripts/train_grpo.py configs/long.yaml run.dir=runs/k3 draft.k=3
    python scripts/train_grpo.py runs/k3/config.yaml --resume           # continue that run
    python scripts/train_grpo.py configs/tiny.yaml                    # the smallest run (defaults)

Overrides are `dotted.key=value` (YAML values). Writes into run.dir: config.yaml (the
resolved config), metrics.jsonl (one line per step), tb/ (TensorBoard, when tensorboardX is
installed), wandb/ (with run.wandb: Weights & Biases, docs/training.md), checkpoints/
(every run.save_every steps and at the end), policy/ and eagle3/ (the final policy and
draft in HF / vLLM-SGLang layout). Plots: scripts/report.py RUN_DIR. Long stretches before
the first step (warm-up, draft init, compiles) print a progress line at least every ~10 s.
A bad config or input stops with one `error:` line before anything compiles (exit code 2).

Exit codes (jaxspec.rl.faults): 0 done; 2 bad config or input, or run.dir not writable / no
room for a checkpoint; 3 diverged (a non-finite loss, gradient norm or parameter: the update
was not applied, the last finite step is checkpointed and exported); 74 a checkpoint or
export could not be written (the previous checkpoint stays the resume point); 75 stopped by
SIGTERM / SIGINT after checkpointing the last completed step (requeue with --resume); 128 +
the signal's number: a second signal, exit at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.dir=runs/x")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run.dir from its latest checkpoint (= run.resume=true)")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    start = time.perf_counter()
    from jaxspec.metrics import Progress  # imports no JAX: it watches JAX's import (seconds)

    with Progress(lambda text: print(text, flush=True), "GRPO") as setup:
        setup.line(f"{args.config}: starting (importing JAX and the trainer)")
        from jaxspec import parallel
        from jaxspec.host import collect_garbage_rarely, keep_freed_memory

        keep_freed_memory()  # XLA CPU's per-call buffers: no page faults on every call
        from jaxspec import compilation_cache

        cache = compilation_cache.enable()  # re-runs and resumes read compiled programs
        setup.line(f"compiled programs cached in {cache} ({compilation_cache.ENV}=0: off)"
                   if cache else "persistent compilation cache off")

        try:  # an srun launch or JAXSPEC_* variables join one run (docs/scaling.md), before
            parallel.initialize_distributed()  # anything below touches a device; else nothing
        except ValueError as e:  # a malformed JAXSPEC_* variable
            print(f"error: {e}", file=sys.stderr)
            return 2
        from jaxspec.config import ConfigError, load_config
        from jaxspec.metrics import Console, read_metrics, run_summary
        from jaxspec.rl import faults
        from jaxspec.rl.trainer import GRPOTrainer

        collect_garbage_rarely()  # after the imports: tracing's objects, not modules, scanned

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + (["run.resume=true"] if args.resume else [])
    console = Console()  # a bar only on a terminal; plain lines <= 120 columns elsewhere
    # SIGTERM / SIGINT from here on: checkpoint the last completed step, exit 75
    with faults.StopSignals(log=console.line) as stop:
        try:
            cfg = load_config(args.config, overrides)
            finished = _finished(cfg)
            if finished is not None:  # nothing to train: say so before anything compiles
                console.line(finished)
                return 0
            stop.setting_up = True  # a signal during the warm-up / draft init stops at once
            trainer = GRPOTrainer(cfg, log=console.line)
            stop.setting_up = False
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (faults.SetupInterrupted, Exception) as e:  # (a stop signal, maybe wrapped)
            stopped = faults.setup_interruption(e)
            if stopped is None:
                raise
            print(f"{stopped}", file=sys.stderr, flush=True)
            return faults.EXIT_PREEMPTED
        try:
            with console:
                _train(cfg, trainer, stop, args.config, start, console)
        except faults.Preempted as e:
            print(f"{e}", file=sys.stderr, flush=True)
            return faults.EXIT_PREEMPTED
        except faults.Diverged as e:
            print(f"error: {e} (exit code {faults.EXIT_DIVERGED})", file=sys.stderr, flush=True)
            return faults.EXIT_DIVERGED
        except faults.SaveFailed as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return faults.EXIT_SAVE_FAILED
    summary = run_summary(read_metrics(cfg.run.dir))
    console.line(
        f"done in {time.perf_counter() - start:.1f}s | reward first fifth "
        f"{summary['reward_first_fifth']:.3f} -> last fifth {summary['reward_last_fifth']:.3f} "
        f"(step-to-step noise {summary['reward_noise']:.3f}) | acceptance length "
        f"{summary['acceptance_length_mean']:.2f}"
        + (f" | generation speedup {summary['generation_speedup']:.2f}x (median of the "
           f"compared steps' ratios; mean times speculative "
           f"{summary['generation_time_mean']:.4f}s vs plain "
           f"{summary['generation_plain_time_mean']:.4f}s)"
           if summary.get("generation_speedup") is not None else "")
        + f" | plots: python scripts/report.py {cfg.run.dir}")
    return 0


def _finished(cfg) -> str | None:
    """With run.resume: the message that the run in run.dir already finished run.steps
    (its checkpoint is at run.steps or later and its export is written), else None. Reads
    the checkpoint directory's names only (orbax renames a step's directory to its number
    when the step is complete), so a bad config is still refused before orbax is touched."""
    import os

    from jaxspec.rl.plan import _checkpoint_dir

    if not cfg.run.resume:
        return None
    ckpt = _checkpoint_dir(cfg)
    steps = sorted(int(n) for n in (os.listdir(ckpt) if os.path.isdir(ckpt) else ())
                   if n.isdigit() and os.path.isdir(os.path.join(ckpt, n)))
    if not steps or steps[-1] < cfg.run.steps:
        return None
    if not os.path.isfile(os.path.join(cfg.run.dir, "policy", "config.json")):
        return None  # stopped before its export: the resume writes it
    return (f"{cfg.run.dir}: the run already finished (checkpoint at step {steps[-1]}, "
            f"run.steps={cfg.run.steps}); nothing to do. To train further: --resume "
            f"run.steps=N with N > {steps[-1]}; plots: python scripts/report.py {cfg.run.dir}")


def _train(cfg, trainer, stop, config_path, start, console) -> None:
    """The training loop with its progress bar (on a terminal) and one line per step."""
    import jax

    total = cfg.run.steps
    console.line(f"GRPO: {config_path} -> {cfg.run.dir} | draft {cfg.draft.kind} k={cfg.draft.k}"
                 f" | {cfg.rollout.prompts_per_step}x{cfg.rollout.group_size} rollouts/step | "
                 f"{total} steps | ready after {time.perf_counter() - start:.1f}s")
    if jax.process_count() > 1:
        console.line(f"process {jax.process_index()} of {jax.process_count()}: "
                     f"{jax.local_device_count()} of the run's {jax.device_count()} devices")
    console.start(total, initial=trainer.completed)

    def on_step(step, row):
        console.step(step, row, total=total,
                     show=step % cfg.run.log_every == 0 or step == total)

    trainer.run(on_step=on_step, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
