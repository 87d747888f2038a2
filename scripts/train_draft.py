#!/usr/bin/env python
"""Offline (in-domain) EAGLE-3 training on the policy's own rollouts, then export.

    python scripts/train_draft.py configs/tiny.yaml run.dir=runs/draft warmup.draft_steps=300
    python scripts/train_draft.py configs/qwen3_8b_eagle3.yaml run.dir=runs/draft \
        model.hf_path=/data/Qwen3-8B task.path=/data/math_train.jsonl

The policy is the config's (`model.hf_path`, or the tiny model after its supervised
warm-up). It generates `warmup.draft_rollouts` rollouts on task prompts that the RL run
never uses, the draft vocabulary is chosen from their token counts, and the head trains
`warmup.draft_steps` steps with the training-time-test loss — the same update the RL step
runs online, with the draft's own optimizer (`draft_optim`). Writes <run.dir>/policy (HF)
and <run.dir>/eagle3 (vLLM/SGLang layout); point `draft.hf_path` of a GRPO run at the
latter, or benchmark both with scripts/bench_rollout.py. The config's own `draft.hf_path` is
ignored (set to null): a GRPO config's pointer to a trained head, or its placeholder. Builds no GRPO trainer: the run
plan, the device cluster, the (warmed-up) policy and the draft learner only.
"""

from __future__ import annotations

import argparse
import sys
import time


def train_draft(cfg, plan, *, log=print):
    """(policy, head): the config's policy (warmed up when it is the tiny model) and a new
    EAGLE-3 head initialised in-domain on its rollouts."""
    from jaxspec.rl.build import build_policy
    from jaxspec.rl.cluster import Cluster
    from jaxspec.rl.drafting import DraftLearner
    from jaxspec.rl.steps import sampling_of

    cluster = Cluster.from_plan(cfg, plan)
    policy = build_policy(cfg, plan, cluster, resuming=False, log=log)
    sampling, filtered = sampling_of(cfg.sampling)
    learner = DraftLearner(cfg, plan, cluster, sampling, filtered=filtered, log=log)
    head, _ = learner.build_head(policy, resuming=False)
    return policy, head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.dir=runs/draft")
    args = p.parse_args(argv)
    start = time.perf_counter()

    from jaxspec.config import ConfigError, load_config
    from jaxspec.rl.build import export_models
    from jaxspec.rl.plan import prepare_run

    try:
        # A new head: the config's draft.hf_path (a run config's pointer to a trained
        # head, or its placeholder) is ignored unless given on the command line.
        given = any(o.split("=", 1)[0].strip() == "draft.hf_path" for o in args.overrides)
        cfg = load_config(args.config, ["draft.hf_path=null", *args.overrides])
        if cfg.draft.kind != "eagle3":
            raise ConfigError("draft.kind", cfg.draft.kind,
                              "train_draft.py trains a new EAGLE-3 head", "eagle3")
        if given and cfg.draft.hf_path is not None:
            raise ConfigError("draft.hf_path", cfg.draft.hf_path,
                              "train_draft.py trains a new EAGLE-3 head and writes it to "
                              "<run.dir>/eagle3", "null (or leave it out)")
        plan = prepare_run(cfg)  # every input check, before anything compiles
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policy, head = train_draft(cfg, plan)
    export_models(cfg.run.dir, policy, head)
    print(f"draft trained in {time.perf_counter() - start:.1f}s -> {cfg.run.dir}/eagle3 "
          f"(policy in {cfg.run.dir}/policy); next: python scripts/bench_rollout.py "
          f"--policy {cfg.run.dir}/policy --eagle3 {cfg.run.dir}/eagle3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
