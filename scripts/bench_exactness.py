"""bfloat16 exactness of speculative rollouts: mismatches vs plain decoding, per drafter.

For each drafter, temperature and forward mode (default, batch-invariant) it generates
--rows rollouts of --tokens tokens plainly and speculatively (replay, same key) with a tiny
random bf16 policy and reports: tokens that differ, rows that diverge, the largest log-prob
difference on equal tokens, and the largest difference between generation log-probs and a
full-sequence (training) forward over prompt + rollout. Then the invariant mode's cost:
median ratio of interleaved timings of the verify forward and of a plain generate call.

    python scripts/bench_exactness.py --rows 512 --tokens 24
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import SamplingConfig, process_logits
from jaxspec.decoding.drafters import DraftModelDrafter, Eagle3Drafter, MTPDrafter, NGramDrafter, TreeSpec
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.transformer import random_policy
from jaxspec.models.mtp import MTPHead


def make_drafters(policy: Policy) -> dict:
    small_cfg = policy.config.replace(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    head = Eagle3Head.init_for(policy, policy.config.vocab_size, jax.random.key(1))
    return {
        "ngram": NGramDrafter(k=3, min_n=1, max_n=2),
        "eagle3_chain": Eagle3Drafter(head, k=3),
        "draft_model": DraftModelDrafter(random_policy(small_cfg, 2), k=3),
        "eagle3_tree": Eagle3Drafter(head, tree=TreeSpec(top_k=3, depth=3, budget=7)),
        "mtp_chain": MTPDrafter(MTPHead.init_for(policy, jax.random.key(3)), k=2),
    }


def make_prompts(rows: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(2, 9)).tolist() for _ in range(rows)]


def training_logprobs(policy, prompts, rollouts, cfg):  # -> [rows, tokens] processed log p
    """Score prompt + rollout with one full-sequence forward, as the trainer does."""
    rows, new = rollouts.tokens.shape
    width = max(len(p) for p in prompts) + new
    seq = np.zeros((rows, width), np.int32)
    pos = np.full((rows, width), -1, np.int32)
    for i, p in enumerate(prompts):
        n = len(p) + int(rollouts.lengths[i])
        seq[i, : len(p)] = p
        seq[i, len(p) : n] = np.asarray(rollouts.tokens[i, : int(rollouts.lengths[i])])
        pos[i, :n] = np.arange(n)
    logits, _, _ = policy.forward(jnp.asarray(seq), jnp.asarray(pos))
    logp = np.asarray(process_logits(logits, cfg))
    out = np.zeros((rows, new), np.float64)
    for i in range(rows):
        n = int(rollouts.lengths[i])
        toks = np.asarray(rollouts.tokens[i, :n])
        out[i, :n] = logp[i, len(prompts[i]) - 1 + np.arange(n), toks]
    return out


def compare(policy, drafter, prompts, tokens: int, temperature: float, key, plain):
    cfg = SamplingConfig(temperature=temperature)
    spec = generate(policy, prompts, drafter=drafter, sampling=cfg, max_new_tokens=tokens, key=key)
    a, b = np.asarray(plain.tokens), np.asarray(spec.tokens)
    same = a == b
    prefix = np.cumprod(same, axis=1).astype(bool)  # positions before a row's first difference
    dlogp = np.abs(np.asarray(plain.logprobs, np.float64) - np.asarray(spec.logprobs, np.float64))
    train = training_logprobs(policy, prompts, spec, cfg)
    valid = np.arange(tokens)[None, :] < np.asarray(spec.lengths)[:, None]
    # At temperature 0 the processed law is a point mass: log p is 0, or -inf where the
    # training forward's argmax differs; count those tokens, and bound the rest.
    dtrain = np.abs(train - np.asarray(spec.logprobs, np.float64))[valid]
    return dict(
        tokens_differ=int(np.sum(~same)), total=a.size, rows_diverge=int(np.sum(~same.all(1))),
        max_dlogp=float(dlogp[prefix].max(initial=0.0)),
        train_differ=int(np.sum(dtrain != 0)), train_total=int(valid.sum()),
        max_dtrain=float(dtrain[np.isfinite(dtrain)].max(initial=0.0)),
    )


def timing(policy, inv, prompts, tokens, repeats: int):
    """Median ratio (invariant / default) of interleaved wall times of plain generate calls."""
    cfg = SamplingConfig(temperature=1.0)
    run = lambda p: generate(p, prompts, sampling=cfg, max_new_tokens=tokens, key=jax.random.key(0))
    run(policy), run(inv)  # compile
    ratios, base = [], []
    for _ in range(repeats):
        t0 = time.perf_counter(); run(policy); t1 = time.perf_counter(); run(inv); t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0)); base.append(t1 - t0)
    return float(np.median(ratios)), float(np.median(base))


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--drafters", default="ngram,eagle3_chain,draft_model,eagle3_tree,mtp_chain")
    ap.add_argument("--modes", default="default,invariant")
    args = ap.parse_args(argv)
    config = ModelConfig.tiny("qwen3", dtype="bfloat16", max_position_embeddings=128)
    base = random_policy(config, 0)
    prompts = make_prompts(args.rows, config.vocab_size)
    print(f"backend {jax.default_backend()}, {args.rows} rows x {args.tokens} tokens, bf16 tiny qwen3")
    print("| mode | drafter | T | tokens differ | rows diverge | max \\|dlogp\\| spec vs plain | "
          "log-probs != training forward | max finite \\|dlogp\\| vs training |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        policy = base if mode == "default" else base.with_config(batch_invariant=True)
        drafters = make_drafters(policy)
        key = jax.random.key(7)
        plain = {t: generate(policy, prompts, sampling=SamplingConfig(temperature=t), max_new_tokens=args.tokens,
                             key=key) for t in (0.0, 1.0)}
        for name in args.drafters.split(","):
            for temperature in (0.0, 1.0):
                r = compare(policy, drafters[name], prompts, args.tokens, temperature, key, plain[temperature])
                print(f"| {mode} | {name} | {temperature:g} | {r['tokens_differ']} / {r['total']} | "
                      f"{r['rows_diverge']} / {args.rows} | {r['max_dlogp']:.3g} | "
                      f"{r['train_differ']} / {r['train_total']} | {r['max_dtrain']:.3g} |", flush=True)
    if "invariant" in args.modes:
        ratio, t = timing(base, base.with_config(batch_invariant=True), prompts, args.tokens, args.repeats)
        print(f"\ninvariant / default wall time of a plain generate call (median of {args.repeats} "
              f"interleaved): {ratio:.2f}x (default {t:.2f} s)")


if __name__ == "__main__":
    main()
