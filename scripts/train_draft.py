#!/usr/bin/env python
"""Offline (in-domain) EAGLE-3 or MTP training on the policy's own rollouts, then export.

    python scripts/train_draft.py configs/tiny.yaml run.dir=runs/draft warmup.draft_steps=300
    python scripts/train_draft.py configs/tiny.yaml run.dir=runs/mtp draft.kind=mtp \
        [--mtp-layout deepseek_v3|mimo|qwen3_next]
    python scripts/train_draft.py configs/qwen3_8b_eagle3.yaml run.dir=runs/draft \
        model.hf_path=/data/Qwen3-8B task.path=/data/math_train.jsonl

The policy is the config's (`model.hf_path`, or the tiny model after its supervised
warm-up). It generates `warmup.draft_rollouts` rollouts on task prompts that the RL run
never uses, the draft vocabulary is chosen from their token counts, and the head trains
`warmup.draft_steps` steps with the training-time-test loss — the same update the RL step
runs online, with the draft's own optimizer (`draft_optim`). Writes <run.dir>/policy (HF)
and <run.dir>/eagle3 (vLLM/SGLang layout); point `draft.hf_path` of a GRPO run at the
latter, or benchmark both with scripts/bench_rollout.py. With `draft.kind=mtp` the head is an
MTP layer (the same mtp update the RL step runs online, no draft vocabulary) written to
<run.dir>/mtp in `--mtp-layout` (default the DeepSeek-V3 one); a GRPO run with draft.kind mtp
reads it through `draft.hf_path`. The config's own `draft.hf_path` is
ignored (set to null): a GRPO config's pointer to a trained head, or its placeholder. Builds no GRPO trainer: the run
plan, the device cluster, the (warmed-up) policy and the draft learner only.
"""

from __future__ import annotations

import argparse
import sys
import time


def train_draft(cfg, plan, *, log=print):
    """(policy, head): the config's policy (warmed up when it is the tiny model) and a new
    EAGLE-3 or MTP head (draft.kind) initialised in-domain on its rollouts."""
    import jax

    from jaxspec.rl.build import build_policy
    from jaxspec.rl.cluster import Cluster
    from jaxspec.rl.drafting import DraftLearner
    from jaxspec.rl.steps import sampling_of

    cluster = Cluster.from_plan(cfg, plan)
    policy = build_policy(cfg, plan, cluster, resuming=False, log=log)
    sampling, filtered = sampling_of(cfg.sampling)
    learner = DraftLearner(cfg, plan, cluster, sampling, filtered=filtered, log=log)
    if cfg.draft.kind == "mtp":
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), 1)  # the trainer's head key
        head, _ = learner.init_mtp_head(policy, key)
    else:
        head, _ = learner.build_head(policy, resuming=False)
    return policy, head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.dir=runs/draft")
    p.add_argument("--mtp-layout", default="deepseek_v3",
                   help="HF layout of an MTP head (draft.kind=mtp): deepseek_v3, mimo, qwen3_next")
    args = p.parse_args(argv)
    start = time.perf_counter()

    from jaxspec.config import ConfigError, load_config
    from jaxspec.models.mtp import MTP_LAYOUTS, save_mtp
    from jaxspec.rl.build import export_models
    from jaxspec.rl.plan import prepare_run

    if args.mtp_layout not in MTP_LAYOUTS:
        print(f"error: --mtp-layout {args.mtp_layout!r}; valid: {', '.join(MTP_LAYOUTS)}",
              file=sys.stderr)
        return 2

    try:
        # A new head: the config's draft.hf_path (a run config's pointer to a trained
        # head, or its placeholder) is ignored unless given on the command line.
        given = any(o.split("=", 1)[0].strip() == "draft.hf_path" for o in args.overrides)
        cfg = load_config(args.config, ["draft.hf_path=null", *args.overrides])
        if cfg.draft.kind not in ("eagle3", "mtp"):
            raise ConfigError("draft.kind", cfg.draft.kind,
                              "train_draft.py trains a new EAGLE-3 or MTP head", "eagle3, mtp")
        if given and cfg.draft.hf_path is not None:
            raise ConfigError("draft.hf_path", cfg.draft.hf_path,
                              f"train_draft.py trains a new head and writes it to "
                              f"<run.dir>/{_out_dir(cfg)}", "null (or leave it out)")
        plan = prepare_run(cfg)  # every input check, before anything compiles
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policy, head = train_draft(cfg, plan)
    mtp = cfg.draft.kind == "mtp"
    export_models(cfg.run.dir, policy, None if mtp else head, source=cfg.model.hf_path,
                  tokenizer=plan.tokenizer if cfg.model.hf_path is None else None)
    out = f"{cfg.run.dir}/{_out_dir(cfg)}"
    if mtp:
        save_mtp(head, out, layout=args.mtp_layout,
                 policy=policy if args.mtp_layout == "deepseek_v3" else None)
    print(f"draft trained in {time.perf_counter() - start:.1f}s -> {out} (policy in "
          f"{cfg.run.dir}/policy); next: " + (f"a GRPO run with draft.kind=mtp draft.hf_path={out}"
                                             if mtp else f"python scripts/bench_rollout.py --policy "
                                             f"{cfg.run.dir}/policy --eagle3 {out}"))
    return 0


def _out_dir(cfg) -> str:
    return "mtp" if cfg.draft.kind == "mtp" else "eagle3"


if __name__ == "__main__":
    sys.exit(main())
