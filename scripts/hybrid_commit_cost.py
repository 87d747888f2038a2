"""What a hybrid policy's state commit costs against its verify: XLA's cost analysis (FLOPs,
bytes accessed) of the verify forward over k + 1 tokens with deferred states
(`HybridPolicy.forward(defer_state=True)`) and of the `DeltaSteps.commit` after it, compiled
for this machine's CPU from abstract shapes; with --rounds, also both timed on random
weights (interleaved, median). XLA's cost analysis counts a loop body once, and both the
verify's recurrent rule and the commit are loops over the k + 1 tokens: its figures are one
token's step of each rule, the timings the whole. (Since the commit was folded into the next
forward, `commit` only records the accepted counts: the verify applies the previous pending
tokens as it reads the states; docs/design.md, "Hybrid policies".)

    python scripts/hybrid_commit_cost.py --shape small --batch 16 --k 3 --cache 512 --rounds 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import ModelConfig
from jaxspec.models.hybrid import HybridCache, HybridPolicy, random_hybrid_policy
from jaxspec.timing import interleaved

L, F = "linear_attention", "full_attention"
SHAPES = {
    "tiny": lambda: ModelConfig.tiny("qwen3_5"),
    # Qwen3.5's layer pattern and head shapes at an eighth of the width, float32
    "small": lambda: ModelConfig.tiny(
        "qwen3_5", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=8,
        layer_types=(L, L, L, F) * 2, num_heads=4, num_kv_heads=1, head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128),
    # Qwen3.5-9B's text model: 32 layers (3 Gated DeltaNet : 1 gated attention), bfloat16
    "qwen3_5_9b": lambda: ModelConfig.tiny(
        "qwen3_5", vocab_size=248_320, hidden_size=4096, intermediate_size=12_288,
        num_layers=32, layer_types=(L, L, L, F) * 8, num_heads=16, num_kv_heads=4,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=262_144,
        dtype="bfloat16"),
}


def _costs(compiled) -> dict:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return {"flops": float(analysis.get("flops", 0.0)),
            "bytes": float(analysis.get("bytes accessed", 0.0))}


def measure(config: ModelConfig, batch: int, k: int, cache_len: int, rounds: int = 0) -> dict:
    """-> {"verify": {flops, bytes[, seconds]}, "commit": {...}, "state_bytes_per_row"}."""
    policy = HybridPolicy.abstract(config)
    cache = jax.eval_shape(lambda: HybridCache.zeros(config, batch, cache_len, k + 1))
    tokens = jax.ShapeDtypeStruct((batch, k + 1), jnp.int32)

    def verify(policy, tokens, positions, cache):
        return policy.forward(tokens, positions, cache, defer_state=True)

    verify_jit = jax.jit(verify)
    compiled = verify_jit.lower(policy, tokens, tokens, cache).compile()
    _, _, after, steps = jax.eval_shape(verify, policy, tokens, tokens, cache)
    accepted = jax.ShapeDtypeStruct((batch,), jnp.int32)
    commit = jax.jit(lambda steps, cache, accepted: steps.commit(cache, accepted))
    committed = commit.lower(steps, after, accepted).compile()
    state = cache.state.shape
    out = {"verify": _costs(compiled), "commit": _costs(committed),
           "state_bytes_per_row": int(4 * state[0] * state[2] * state[3] * state[4])}
    if rounds:  # random weights, a cache holding cache_len // 2 tokens per row
        real = random_hybrid_policy(config, seed=0)
        rng = np.random.default_rng(0)
        ids = jnp.asarray(rng.integers(0, config.vocab_size, (batch, k + 1)), jnp.int32)
        start = _with_lengths(HybridCache.zeros(config, batch, cache_len, k + 1), cache_len // 2)
        pos = jnp.broadcast_to(cache_len // 2 + jnp.arange(k + 1, dtype=jnp.int32), ids.shape)
        _, _, after_real, steps_real = verify_jit(real, ids, pos, start)
        taken = jnp.asarray(rng.integers(1, k + 2, (batch,)), jnp.int32)
        times = interleaved({"verify": lambda: verify_jit(real, ids, pos, start),
                             "commit": lambda: commit(steps_real, after_real, taken)},
                            rounds, warmup=True)
        for name, t in times.items():
            out[name]["seconds"] = float(np.median(t))
    return out


def _with_lengths(cache: HybridCache, n: int) -> HybridCache:
    kv = dataclasses.replace(cache.kv, lengths=jnp.full((cache.batch,), n, jnp.int32))
    return dataclasses.replace(cache, kv=kv)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--cache", type=int, default=256, help="KV cache slots per row")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (0: none)")
    args = parser.parse_args(argv)
    out = measure(SHAPES[args.shape](), args.batch, args.k, args.cache, args.rounds)
    v, c = out["verify"], out["commit"]
    out["commit_over_verify"] = {key: c[key] / v[key] for key in v}
    print(json.dumps({"shape": args.shape, "batch": args.batch, "k": args.k, "cache": args.cache,
                      **out}, indent=1))


if __name__ == "__main__":
    main()
