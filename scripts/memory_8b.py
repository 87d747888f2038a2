"""XLA's compiled memory per device of the logprob stage (`score_rollouts`) and the GRPO
policy update (`policy_update`) at a Qwen3-8B shape, with abstract bf16 params (nothing is
allocated or run), on a simulated mesh of CPU devices (fsdp over all of them).

    python scripts/memory_8b.py                       # the config's batch, 36 layers
    python scripts/memory_8b.py --layers 2 --chunk 0 --micro-batch 0 --stage score

Prints one line per (stage, chunk, micro-batch): argument, output, temp and total bytes per
device, from `compiled.memory_analysis()`, and the compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices = fsdp size")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--batch", type=int, default=512, help="rollout rows (prompts x group)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, nargs="+", default=[8192], help="grpo.logprob_chunk values")
    p.add_argument("--micro-batch", type=int, nargs="+", default=[0], help="grpo.micro_batch values")
    p.add_argument("--stage", choices=("score", "update", "both", "draft"), default="both",
                   help="both = score and update; draft = the online EAGLE-3 TTT update")
    p.add_argument("--draft-vocab", type=int, default=32_000)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--no-ref", action="store_true", help="no reference policy (kl_coef 0)")
    p.add_argument("--filtered", action="store_true", help="top-k 20 / top-p 0.95 sampling")
    p.add_argument("--capture", action="store_true",
                   help="scoring also returns the EAGLE-3 features (layers 1, L/2-1, L-4)")
    return p.parse_args(argv)


def qwen3_8b(layers: int):
    from jaxspec.models import ModelConfig

    return ModelConfig(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288,
                       num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128,
                       qk_norm=True, tie_embeddings=False, dtype="bfloat16",
                       max_position_embeddings=40_960)


def main(argv=None) -> int:
    args = _args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxspec import parallel
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.models import Policy
    from jaxspec.models.config import default_eagle3_layers
    from jaxspec.rl.grpo import GRPOConfig
    from jaxspec.models.eagle3 import Eagle3Head
    from jaxspec.rl.draft import DraftLossConfig
    from jaxspec.rl.steps import (POLICY_INPUTS, draft_update, make_optimizer, policy_update,
                                  score_rollouts)
    from jaxspec.config import OptimSpec

    mesh = parallel.make_mesh(data=1, fsdp=args.devices, tensor=1)
    policy = Policy.abstract(qwen3_8b(args.layers))
    shardings = parallel.param_shardings(policy, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          policy.params, shardings)
    policy = policy.replace(params=params)
    ref = None if args.no_ref else params
    b, p, n = args.batch, args.prompt_len, args.new_tokens
    t = p + n

    def rows(shape, dtype):
        spec = parallel.batch_sharding(mesh, len(shape))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=spec)

    sampling = SamplingConfig(1.0, 20, 0.95) if args.filtered else SamplingConfig(1.0, 0, 1.0)
    capture = default_eagle3_layers(args.layers) if args.capture else ()
    optimizer = make_optimizer(OptimSpec())
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             opt_state, parallel.param_shardings(opt_state, mesh))
    def placed(tree):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, parallel.param_shardings(tree, mesh))

    head = jax.eval_shape(lambda: Eagle3Head.init_for(policy, args.draft_vocab, jax.random.key(0)))
    head = dataclasses.replace(head, params=placed(head.params), buffers=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        head.buffers))
    draft_optimizer = make_optimizer(OptimSpec(lr=5e-5, b2=0.95, clip_norm=0.5))
    draft_opt_state = placed(jax.eval_shape(draft_optimizer.init, head.params))
    gib = 2.0**30
    print(f"Qwen3-8B shape, {args.layers} layers, {policy.num_params / 1e9:.2f}B params bf16; "
          f"{b} rows x {t} tokens; fsdp={args.devices} CPU devices; reference policy: "
          f"{'no' if ref is None else 'yes'}; sampling top-k/top-p: "
          f"{'20 / 0.95' if args.filtered else 'off'}; EAGLE-3 capture: {capture or 'off'}",
          flush=True)
    print(f"{'stage':<8} {'chunk':>6} {'micro':>6} {'argument':>10} {'output':>10} {'temp':>10} "
          f"{'total':>10}  GiB per device  (compile s)", flush=True)
    for chunk in args.chunk:
        for micro in args.micro_batch:
            cfg = GRPOConfig(kl_coef=0.0 if ref is None else 0.01, logprob_chunk=chunk,
                             micro_batch=micro)
            stages = ("score", "update") if args.stage == "both" else (args.stage,)
            loss_cfg = DraftLossConfig(steps=args.ttt_steps, decay=0.8, chunk=chunk,
                                       micro_batch=micro)
            for stage in stages:
                start = time.perf_counter()
                with jax.set_mesh(mesh):
                    if stage == "score":
                        lowered = score_rollouts.lower(
                            policy, ref, rows((b, p), jnp.int32), rows((b,), jnp.int32),
                            rows((b, n), jnp.int32), rows((b,), jnp.int32),
                            rows((b, n), jnp.float32), sampling, capture=capture,
                            filtered=args.filtered, chunk=chunk, micro_batch=micro)
                    elif stage == "draft":
                        h = policy.config.hidden_size
                        scored = {"features": rows((b, t, 3 * h), jnp.bfloat16),
                                  "target_hidden": rows((b, t, h), jnp.bfloat16),
                                  "tokens": rows((b, t), jnp.int32), "response": rows((b, t), bool)}
                        lowered = draft_update.lower(head, draft_opt_state, policy, scored,
                                                     optimizer=draft_optimizer, loss_cfg=loss_cfg)
                    else:
                        scored = {k: rows((b, t), jnp.int32 if k in ("tokens", "positions")
                                          else bool if k == "mask" else jnp.float32)
                                  for k in POLICY_INPUTS if k != "ref_logprobs" or ref is not None}
                        lowered = policy_update.lower(
                            policy, opt_state, scored, rows((b,), jnp.float32), sampling,
                            optimizer=optimizer, grpo_cfg=cfg, minibatches=1,
                            filtered=args.filtered)
                    mem = lowered.compile().memory_analysis()
                seconds = time.perf_counter() - start
                arg, out, temp = (mem.argument_size_in_bytes, mem.output_size_in_bytes,
                                  mem.temp_size_in_bytes)
                total = arg + out + temp - mem.alias_size_in_bytes
                print(f"{stage:<8} {chunk:>6} {micro:>6} {arg / gib:>10.2f} {out / gib:>10.2f} "
                      f"{temp / gib:>10.2f} {total / gib:>10.2f}  ({seconds:.0f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
