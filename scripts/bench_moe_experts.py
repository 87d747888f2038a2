"""Distinct experts a verify forward touches, against draft length k and batch, on an MoE
policy with realistic routing width (default 128 experts, 8 per token, as Qwen3-30B-A3B and
Qwen3-235B-A22B), and what that does to a memory-bound verify's cost c(k+1) / c(1).

A verify forward feeds k + 1 tokens per row; an expert's weights are read when at least one
of the batch x (k + 1) tokens routes to it. The routing is measured (the policy's own top-k
over tokens of real sequences: the rollouts of a plain `generate` call, so consecutive tokens
are as correlated as a rollout's are), counted per layer, and compared with the independence
model the simulator uses (jaxspec.sim.models: E (1 - (1 - K/E)^n) of E experts for n tokens).
The cost ratio is the bytes a forward reads (dense weights once, the touched experts, the
KV cache of the rows) at a real shape (--shape, jaxspec.sim.models), with the measured
fraction of experts touched.

    python scripts/bench_moe_experts.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.engine import generate
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.sim.models import get_model


def _experts_touched(experts, sparse, rows: int, width: int, starts) -> np.ndarray:
    """Mean distinct experts per sparse layer over windows of `width` consecutive tokens in
    each of `rows` sequences: experts [L, S, T, K] -> [windows] float."""
    out = []
    layers = [i for i, s in enumerate(sparse) if s]
    for start in starts:
        for first in range(0, experts.shape[1] - rows + 1, rows):
            block = experts[layers][:, first:first + rows, start:start + width]  # [L, rows, w, K]
            touched = [len(np.unique(layer)) for layer in block]
            out.append(np.mean(touched))
    return np.asarray(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ks", default="0,1,2,3,5,7")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--shape", default="Qwen3-30B-A3B", help="jaxspec.sim model for the bytes")
    parser.add_argument("--context", type=int, default=2048, help="KV cache tokens per row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    e, top = args.experts, args.top_k
    cfg = ModelConfig.tiny("qwen3_moe", vocab_size=256, hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, num_experts=e,
                           num_experts_per_tok=top, moe_intermediate_size=8,
                           max_position_embeddings=128, norm_topk_prob=True)
    policy = random_policy(cfg, seed=0)
    n_seq = max(batches)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, (n_seq, 4)).tolist()
    t0 = time.perf_counter()
    out = generate(policy, prompts, sampling=SamplingConfig(1.0), max_new_tokens=48,
                   key=jax.random.key(0))
    seqs = np.concatenate([np.asarray(prompts), np.asarray(out.tokens)], axis=1)
    positions = np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape)
    _, _, _, routing = policy.forward(jnp.asarray(seqs, jnp.int32), positions, routing=True)
    experts = np.asarray(routing["experts"])  # [L, S, T, K]
    model = get_model(args.shape)
    starts = range(8, 40, 4)  # windows inside the rollouts
    dense = model.weight_bytes_read(0)  # weights every forward reads whatever its tokens
    expert_bytes = model.num_layers * model.num_experts * model.expert_params * model.bytes_per_param
    rows = []
    for b in batches:
        kv = b * args.context * model.kv_bytes_per_token  # a verify reads the rows' cache once
        cost = {}
        for k in sorted(set(ks) | {0}):
            measured = float(np.mean(_experts_touched(experts, cfg.sparse_layers, b, k + 1, starts)))
            cost[k] = (measured, dense + measured / e * expert_bytes + kv)
        for k in ks:
            n = b * (k + 1)
            measured, verify = cost[k]
            independent = e * (1 - (1 - top / e) ** n)
            ratio = verify / cost[0][1]
            rows.append([b, k, n, round(measured, 1), round(independent, 1), round(ratio, 2)])
            print(f"batch {b:3d} k {k}: {n:4d} tokens, experts touched {measured:6.1f} "
                  f"(independent {independent:6.1f}) of {e}; bytes c(k+1)/c(1) {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "seconds": time.perf_counter() - t0,
                       "columns": ["batch", "k", "tokens per verify", "experts touched per layer",
                                   "independent model", f"bytes c(k+1)/c(1) at {args.shape}"],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
