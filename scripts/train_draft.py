#!/usr/bin/env python
"""Offline (in-domain) training of a new draft head on the policy's own rollouts, then export.

    python scripts/train_draft.py configs/tiny.yaml run.dir=runs/draft warmup.draft_steps=300
    python scripts/train_draft.py configs/tiny.yaml run.dir=runs/mtp draft.kind=mtp \
        [--mtp-layout deepseek_v3|mimo|qwen3_next]
    python scripts/train_draft.py configs/qwen3_8b_eagle3.yaml run.dir=runs/draft \
        model.hf_path=/data/Qwen3-8B task.path=/data/math_train.jsonl

The policy is the config's (`model.hf_path`, or the tiny model after its supervised
warm-up). It generates `warmup.draft_rollouts` rollouts on task prompts that the RL run
never uses and the head of `draft.kind` (`rl.kinds.HeadKind.init_offline`: kinds eagle3 and
hybrid train an EAGLE-3 head, its draft vocabulary chosen from their token counts; kind mtp
an MTP layer) trains `warmup.draft_steps` steps of the update the RL step runs online,
with the draft's own optimizer (`draft_optim`). Writes <run.dir>/policy (HF) and the head
to <run.dir>/<head name> in its serving layout (EAGLE-3: vLLM / SGLang; MTP:
`--mtp-layout`, default DeepSeek-V3's); point `draft.hf_path` of a GRPO run at it, or
benchmark it with scripts/bench_rollout.py. The config's own `draft.hf_path` is ignored
(set to null): a GRPO config's pointer to a trained head, or its placeholder. Builds no
GRPO trainer: the run plan, the device cluster, the (warmed-up) policy and the draft
learner only.
"""

from __future__ import annotations

import argparse
import sys
import time


def train_draft(cfg, plan, *, log=print):
    """(policy, head): the config's policy (warmed up when it is the tiny model) and a new
    head of draft.kind initialised in-domain on its rollouts."""
    from jaxspec.rl.build import build_policy
    from jaxspec.rl.cluster import Cluster
    from jaxspec.rl.drafting import DraftLearner
    from jaxspec.rl.kinds import KINDS
    from jaxspec.rl.steps import sampling_of

    cluster = Cluster.from_plan(cfg, plan)
    policy = build_policy(cfg, plan, cluster, resuming=False, log=log)
    sampling, filtered = sampling_of(cfg.sampling)
    learner = DraftLearner(cfg, plan, cluster, sampling, filtered=filtered, log=log)
    head, _ = KINDS[cfg.draft.kind].head.init_offline(learner, policy, cfg.run.seed)
    return policy, head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.dir=runs/draft")
    p.add_argument("--mtp-layout", default="deepseek_v3",
                   help="HF layout of an MTP head (draft.kind=mtp): deepseek_v3, mimo, qwen3_next")
    args = p.parse_args(argv)
    start = time.perf_counter()

    from jaxspec.config import ConfigError, load_config
    from jaxspec.host import collect_garbage_rarely
    from jaxspec.models.mtp import MTP_LAYOUTS
    from jaxspec.rl.build import export_models
    from jaxspec.rl.kinds import KINDS
    from jaxspec.rl.plan import prepare_run

    collect_garbage_rarely()  # after the imports: tracing's objects, not modules, scanned

    if args.mtp_layout not in MTP_LAYOUTS:
        print(f"error: --mtp-layout {args.mtp_layout!r}; valid: {', '.join(MTP_LAYOUTS)}",
              file=sys.stderr)
        return 2

    try:
        # A new head: the config's draft.hf_path (a run config's pointer to a trained
        # head, or its placeholder) is ignored unless given on the command line.
        given = any(o.split("=", 1)[0].strip() == "draft.hf_path" for o in args.overrides)
        cfg = load_config(args.config, ["draft.hf_path=null", *args.overrides])
        offline = [n for n, k in KINDS.items() if k.head and k.head.init_offline]
        if cfg.draft.kind not in offline:
            raise ConfigError("draft.kind", cfg.draft.kind,
                              "train_draft.py trains a new draft head of its own kind",
                              ", ".join(offline))
        if given and cfg.draft.hf_path is not None:
            raise ConfigError("draft.hf_path", cfg.draft.hf_path,
                              f"train_draft.py trains a new head and writes it to "
                              f"<run.dir>/{_out_dir(cfg)}", "null (or leave it out)")
        plan = prepare_run(cfg)  # every input check, before anything compiles
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policy, head = train_draft(cfg, plan)
    export_models(cfg.run.dir, policy, source=cfg.model.hf_path, tokenizer=plan.tokenizer)
    out = f"{cfg.run.dir}/{_out_dir(cfg)}"
    KINDS[cfg.draft.kind].head.save(head, out, policy=policy, layout=args.mtp_layout)
    print(f"draft trained in {time.perf_counter() - start:.1f}s -> {out} (policy in "
          f"{cfg.run.dir}/policy); next: a GRPO run with draft.kind={cfg.draft.kind} "
          f"draft.hf_path={out}, or scripts/bench_rollout.py")
    return 0


def _out_dir(cfg) -> str:
    from jaxspec.rl.kinds import KINDS

    return KINDS[cfg.draft.kind].head.name


if __name__ == "__main__":
    sys.exit(main())
