"""Step time with grpo.reuse_generation_logprobs on vs off: two trainers on one warmed-up
base in one process, their steps interleaved (A, B, A, B, ...); the median over steps of the
ratio reuse / recompute, for the whole step and the logprob stage.

    python scripts/bench_reuse_logprobs.py configs/tiny.yaml --steps 12 [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from jaxspec.config import load_config
from jaxspec.rl.trainer import GRPOTrainer


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out (compiles)")
    args = ap.parse_intermixed_args(argv)
    root = tempfile.mkdtemp(prefix="bench-reuse-")
    common = list(args.overrides) + [f"run.steps={args.steps}", "run.compare_plain=0",
                                     "run.save_every=0"]

    def config(name, *extra):
        return load_config(args.config, common + [f"run.dir={os.path.join(root, name)}", *extra])

    off = GRPOTrainer(config("recompute"))
    on = GRPOTrainer(config("reuse", "grpo.reuse_generation_logprobs=true"),
                     policy=off.policy, head=off.head, draft_model=off.draft_model)
    rows = {"recompute": [], "reuse": []}
    for _ in range(args.steps):
        for name, trainer in (("recompute", off), ("reuse", on)):
            rows[name].append(trainer.step())
    keep = slice(args.skip, None)
    for key in ("time/step", "time/logprob", "time/training", "time/generation"):
        a = np.array([m[key] for m in rows["reuse"]][keep])
        b = np.array([m[key] for m in rows["recompute"]][keep])
        print(f"{key:18s} recompute median {np.median(b) * 1e3:8.1f} ms  reuse median "
              f"{np.median(a) * 1e3:8.1f} ms  median ratio reuse/recompute {np.median(a / b):.3f}")
    mism = [m["reuse/mismatch_max"] for m in rows["reuse"]]
    print(f"reused {sum(m['reuse/reused'] for m in rows['reuse'])}/{args.steps} steps; "
          f"check mismatch max {max(mism):.3g}; checked rows "
          f"{[m['reuse/checked_rows'] for m in rows['reuse']][:3]}...")


if __name__ == "__main__":
    main()
