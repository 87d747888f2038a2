"""Compile the programs a run executes on a GPU, without a GPU, and say what they cost.

`inspect(...)` builds each program with abstract arguments on a mesh of target GPUs
(`jaxspec.gpu_targets.mesh`), inside `kernels.target_platform("gpu")` so that the library's
backend choices are the GPU's (the attention kernel, the layer loop), compiles it for CUDA,
and reads the optimized HLO (`jaxspec.gpu_targets.hlo`) and XLA's thunk sequence (which
kernels run inside a command buffer, i.e. a CUDA graph):

- decode: one plain decode step (forward of 1 token per row, greedy pick) in a loop;
- verify_k3: a chain verify step (forward of k + 1 = 4 tokens, acceptance, length rollback);
- tree_n16: a tree verify step (forward of 16 tree nodes under an ancestor mask, the
  accepted path compacted into the cache);
- refill: a prefill of `prompt_len` tokens per row into the cache (no loop: the program);
- eagle3_draft: one EAGLE-3 chain-draft step (the head's layer over 1 token, its LM head
  over the draft vocabulary, greedy pick) in a loop;
- block_draft: one block-drafter step (`BlockDrafter.propose`: a DFlash body of one layer
  over a block of BLOCK_SIZE, a Markov head of rank BLOCK_MARKOV_RANK and the confidence
  head's estimate of every depth's acceptance for the confidence-driven length; greedy
  drafts of k = VERIFY_K) in a loop;
- grpo_score / grpo_update: the GRPO scoring forward and policy update of `jaxspec.rl.steps`
  at the run's batch, fsdp over `devices` GPUs.

Per program: HBM bytes moved per loop iteration (the method in `gpu_targets.hlo`) against a
floor (the bytes the step must read: the weights it multiplies with once, the embedding rows
it gathers, the live KV cache once, the new KV entries written once), copies over 1 MB
inside the loop and their jax origin, kernels per iteration (from the HLO, and from XLA's
thunks: how many inside a command buffer), `memory_analysis()` per device, and a time per
iteration (`jaxspec.gpu_targets.estimate`: per kernel the larger of FLOPs over the peak and
bytes over the bandwidth, plus a launch cost). Training
programs get the model-FLOPs bound too (2 N per token forward, 6 N per token with the
backward, 8 N with each layer rematerialised, N the parameters a token multiplies with:
all of a dense model's, a mixture of experts' less the experts it is not routed to).

Attention kernels (Pallas `tree_attention`) read one layer of the stacked KV cache that
they receive whole: they are charged one layer of each 5-D operand at full capacity (the
inspector sets context = capacity, so that is the live KV).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import gpu_targets
from jaxspec.gpu_targets import estimate, hlo

__all__ = [
    "DECODE_PROGRAMS",
    "HYBRID_PROGRAMS",
    "PROGRAMS",
    "Program",
    "active_params",
    "build_program",
    "experts_touched",
    "floor_bytes",
    "inspect_program",
    "stacked_attention_reads",
    "thunk_kernels",
]

DECODE_PROGRAMS = ("decode", "verify_k3", "tree_n16", "refill", "eagle3_draft", "block_draft")
PROGRAMS = DECODE_PROGRAMS + ("grpo_score", "grpo_update")
# a hybrid (linear-attention) policy: no tree (one recurrent state per node), no draft heads here
HYBRID_PROGRAMS = ("decode", "verify_k3", "refill")
COPY_LIMIT = 1 << 20  # copies above 1 MB inside a loop body are reported
LOOP_STEPS = 4  # iterations of each program's loop (the cost is per iteration)
VERIFY_K = 3
TREE_NODES = 16
BLOCK_SIZE = 16  # block_draft: DFlash's released block size (z-lab *-DFlash-b16)
BLOCK_MARKOV_RANK = 64  # block_draft: the Markov head's rank
_WORK_THUNKS = re.compile(r"^\s*\d+: (k\w+)")
_CONTAINERS = {"kCommandBuffer", "kWhile", "kConditional", "kSequential"}


@dataclasses.dataclass
class Program:
    """A program to compile: `fn(*args)` with abstract, sharded args, and its floors."""

    name: str
    fn: Callable
    args: tuple
    loop: bool  # the cost is per iteration of the entry's (largest) while loop
    floor: float  # bytes the step must move at least
    floor_parts: dict
    flops: float = 0.0  # model FLOPs of the program (training programs)
    donate: tuple = ()
    unknown_trip: int = 1  # trip count for loops XLA could not count
    notes: str = ""


def _param_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer routes `tokens` tokens to when each picks `top_k`
    of `num_experts` uniformly at random: E (1 - (1 - K/E)^n), the independence model
    scripts/bench_moe_experts.py measures real routing against (measured on a policy's own
    rollouts it touches at most this many: 28.5 vs 29.1 at 4 tokens, docs/BENCHMARKS.md)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def floor_bytes(cfg, batch: int, fed: int, context: int, *, embed_rows: bool = True,
                rollback: bool = False) -> dict:
    """The bytes a forward of `fed` tokens per row over `context` cached slots must move:
    every weight once (the token embedding only in the rows it gathers, unless tied: then
    it is the LM head too), the live KV once, the new KV entries once. -> {part: bytes}.

    An MoE policy (cfg.is_moe) reads, of its routed experts, only those the batch's
    batch * fed tokens route to: per sparse layer `experts_touched` of them (uniform-random
    routing), each expert's gate, up and down projections once; its other weights (dense
    layers, attention, router, shared experts, LM head) every step."""
    from jaxspec.models import Policy

    if cfg.is_hybrid:
        return _hybrid_floor(cfg, batch, fed, context, embed_rows=embed_rows, rollback=rollback)
    params = Policy.abstract(cfg).params
    item = jnp.dtype(cfg.param_dtype).itemsize
    total = _param_bytes(params)
    embed = cfg.vocab_size * cfg.hidden_size * item
    weights = total if cfg.tie_embeddings else total - embed
    kv_row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item
    parts = {"weights": weights}
    if cfg.is_moe:
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * item  # one expert's
        sparse = sum(cfg.sparse_layers)
        touched = experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch * fed)
        parts = {"weights (dense)": weights - sparse * cfg.num_experts * expert,
                 f"routed experts ({touched:.1f} of {cfg.num_experts} per layer)":
                     sparse * touched * expert}
    return {
        **parts,
        "embedding rows": batch * fed * cfg.hidden_size * item if embed_rows else 0,
        "KV read": batch * context * kv_row,
        "KV written": batch * fed * kv_row,
    }


def _array(shape: str) -> tuple[str, str] | None:
    """(dtype, dims) of a single-array shape, else None."""
    found = hlo._ARRAY.findall(shape)
    return found[0] if len(found) == 1 else None


def stacked_attention_reads(inst, operands) -> int | None:
    """Bytes a jaxspec Pallas `tree_attention` call moves: one layer of each stacked KV
    operand read, the other operands read whole, and its own outputs written except the
    stacks it passes through (aliased to its inputs, never written). The same for the
    recurrent delta-rule kernel (kernels.delta_rule) over its stacked states, whose stack,
    when it is an output (aliased), has one layer written. The stacks are the
    largest rank-5 operands ([layers, batch, slots, kv_heads, head_dim]; q and the tree's
    keys and values may be rank 5 too, far smaller); an operand passed twice is read once.
    None for other instructions."""
    if inst.opcode != "custom-call" or not any(name in inst.op_name for name in
                                                 ("tree_attention", "delta_rule_recurrent")):
        return None
    # One buffer passed as two operands is read once (the tree's keys and values are one
    # array, each operand's blocks reading its half).
    operands = list({op.name: op for op in operands}.values())
    rank5 = [op for op in operands if (a := _array(op.shape)) and len(a[1].split(",")) == 5]
    stack = _array(max(rank5, key=lambda op: op.bytes).shape) if rank5 else None
    layers = int(stack[1].split(",")[0]) if stack else 1
    read = sum(op.bytes // layers if _array(op.shape) == stack else op.bytes for op in operands)
    outputs = [f"{t}[{d}]" for t, d in hlo._ARRAY.findall(inst.shape)]
    if "delta_rule_recurrent" in inst.op_name:  # its stack, when an output, written one layer
        # (and the pending tokens' stacks [layers, batch, P, ..]: one layer read)
        lead = tuple(stack[1].split(",")[:2]) if stack else None
        pending = sum(op.bytes - op.bytes // layers for op in operands
                      if (a := _array(op.shape)) and a != stack
                      and tuple(a[1].split(",")[:2]) == lead)
        return read - pending + sum(hlo.shape_bytes(o) // (layers if _array(o) == stack else 1)
                                    for o in outputs)
    written = sum(hlo.shape_bytes(o) for o in outputs if _array(o) != stack)
    return read + written


def thunk_kernels(text: str) -> dict:
    """Kernels of the first `while` body in XLA's thunk sequence (after its thunk passes):
    {"kernels": N, "in_command_buffer": M, "nested_loops": K} (nested loops' kernels
    counted once)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if re.search(r"\d+: kWhile", l)), None)
    if start is None:
        return {"kernels": 0, "in_command_buffer": 0, "nested_loops": 0}
    base = len(lines[start]) - len(lines[start].lstrip())
    in_body, stack, kernels, buffered, nested = False, [], 0, 0, 0
    for line in lines[start + 1:]:
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent <= base and _WORK_THUNKS.match(line):
            break
        if line.strip() == "body:":
            in_body = True
            continue
        if line.strip() == "condition:":
            in_body = False
            continue
        m = _WORK_THUNKS.match(line)
        if not (in_body and m):
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        kind = m.group(1)
        if kind in _CONTAINERS:
            nested += kind == "kWhile"
            stack.append((indent, kind))
            continue
        kernels += 1
        buffered += any(k == "kCommandBuffer" for _, k in stack)
    return {"kernels": kernels, "in_command_buffer": buffered, "nested_loops": nested}


def _hybrid_floor(cfg, batch: int, fed: int, context: int, *, embed_rows: bool,
                  rollback: bool) -> dict:
    """`floor_bytes` of a hybrid policy (jaxspec.models.hybrid): every weight once, the full-
    attention layers' live KV once and their new entries, and per linear layer and row its
    recurrent state (the delta rule's float32 [Hv, dk, dv] and the convolution's last K-1
    inputs) read once and written once. A verify (`rollback`) keeps its tokens pending for
    the next forward to apply once the accepted count is known (HybridCache.pending): their
    rule inputs (q, k float32 per key head, v float32 per value head, the gate and rate
    float32 per value head) and convolution inputs, written once and read once."""
    from jaxspec.models.hybrid import HybridCache, HybridPolicy, layer_plan

    params = HybridPolicy.abstract(cfg).params
    item = jnp.dtype(cfg.param_dtype).itemsize
    total = _param_bytes(params)
    embed = cfg.vocab_size * cfg.hidden_size * item
    weights = total if cfg.tie_embeddings else total - embed
    full = sum(1 for mixer, *_ in layer_plan(cfg) if mixer == "full_layers")
    linear = cfg.num_layers - full
    kv_row = 2 * full * cfg.num_kv_heads * cfg.head_dim * item
    state = jax.eval_shape(lambda: HybridCache.zeros(cfg, batch, 0))
    state_bytes = _param_bytes((state.conv, state.state))
    parts = {"weights": weights,
             "embedding rows": batch * fed * cfg.hidden_size * item if embed_rows else 0,
             "KV read": batch * context * kv_row,
             "KV written": batch * fed * kv_row,
             "recurrent state read": state_bytes,
             "recurrent state written": state_bytes}
    if rollback:
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        per_token = 2 * hk * dk * 4 + hv * dv * 4 + 2 * hv * 4 + (2 * hk * dk + hv * dv) * item
        parts["pending inputs (written, read)"] = 2 * linear * batch * fed * per_token
    return parts


def _replicated(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P())


def _abstract(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _policy_for_decode(cfg, sharding):
    """The abstract policy as `generate` decodes with it on this platform (per-layer
    weights and no stacked ones when `Policy.decodes_unrolled`), placed on `sharding`."""
    from jaxspec.models import Policy

    if cfg.is_hybrid:
        from jaxspec.models.hybrid import HybridPolicy

        policy = HybridPolicy.abstract(cfg)  # per-layer weights, as generate decodes
        return _abstract(jax.eval_shape(lambda p: p.unstack_layers().without_stacked_layers(),
                                        policy), sharding)
    policy = Policy.abstract(cfg)
    if policy.decodes_unrolled(0, 0):  # as jaxspec.decoding.decoding_policy attaches them
        policy = jax.eval_shape(lambda p: p.unstack_layers().without_stacked_layers(), policy)
    return _abstract(policy, sharding)


def build_program(name: str, cfg, *, batch: int, context: int, mesh, prompt_len: int = 1024,
                  draft_vocab: int = 32_000, run=None, platform: str = "gpu") -> Program:
    """The abstract program `name` (one of PROGRAMS) for model config `cfg`, built as on a
    GPU (`kernels.target_platform("gpu")`: e.g. the layer loop `generate` would pick), or
    as on `platform` (scripts/gpu_profile.py runs them on CPU too)."""
    from jaxspec.kernels import target_platform

    with target_platform(platform):
        return _build_program(name, cfg, batch=batch, context=context, mesh=mesh,
                              prompt_len=prompt_len, draft_vocab=draft_vocab, run=run)


def _build_program(name, cfg, *, batch, context, mesh, prompt_len, draft_vocab, run) -> Program:
    from jaxspec.models import KVCache
    from jaxspec.models.cache import compact

    rep = _replicated(mesh)
    steps = LOOP_STEPS
    if cfg.is_hybrid and name not in HYBRID_PROGRAMS:
        raise ValueError(f"program {name!r} is not built for a hybrid policy (family "
                         f"{cfg.family!r}); valid: {', '.join(HYBRID_PROGRAMS)}")
    if name in ("decode", "verify_k3", "tree_n16", "refill"):
        policy = _policy_for_decode(cfg, rep)
        if cfg.is_hybrid:
            from jaxspec.models.hybrid import HybridCache

            zeros = HybridCache.zeros
        else:
            zeros = KVCache.zeros
        fed = {"decode": 1, "verify_k3": VERIFY_K + 1, "tree_n16": TREE_NODES,
               "refill": prompt_len}[name]
        # (a hybrid verify keeps its tokens pending in the cache: a buffer of k + 1)
        pending = dict(pending=fed) if cfg.is_hybrid and name == "verify_k3" else {}
        cache = _abstract(jax.eval_shape(lambda: zeros(cfg, batch, context, **pending)), rep)
        tokens = jax.ShapeDtypeStruct((batch, fed), jnp.int32, sharding=rep)
        live = context if name != "refill" else 0
        parts = floor_bytes(cfg, batch, fed, live, rollback=name == "verify_k3")
        unknown = -(-context // 128)  # the reference attention's block loop (BLOCK_K = 128)
        if name == "decode":
            def fn(policy, cache, tokens):
                def body(i, carry):
                    cache, tok = carry
                    logits, _, cache = policy.forward(tok, cache.lengths[:, None], cache)
                    return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
                return jax.lax.fori_loop(0, steps, body, (cache, tokens))
            return Program(name, fn, (policy, cache, tokens), True, sum(parts.values()), parts,
                           donate=(1,), unknown_trip=unknown)
        if name == "verify_k3" and cfg.is_hybrid:
            def fn(policy, cache, tokens):
                def body(i, carry):
                    cache, tok = carry
                    pos = cache.lengths[:, None] + jnp.arange(tok.shape[1])[None]
                    logits, _, cache, deferred = policy.forward(tok, pos, cache,
                                                                defer_state=True)
                    target = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, k+1]
                    hit = jnp.cumprod(target[:, :-1] == tok[:, 1:], axis=1)
                    accepted = jnp.sum(hit, axis=1, dtype=jnp.int32)  # [B]
                    # the fed token and the accepted drafts kept pending: the next verify
                    # applies them to the linear layers' states as it reads them
                    cache = deferred.commit(cache, accepted + 1)
                    kv = dataclasses.replace(
                        cache.kv, lengths=cache.kv.lengths - (tok.shape[1] - 1 - accepted))
                    return dataclasses.replace(cache, kv=kv), jnp.roll(target, 1, axis=1)
                return jax.lax.fori_loop(0, steps, body, (cache, tokens))
            return Program(name, fn, (policy, cache, tokens), True, sum(parts.values()), parts,
                           donate=(1,), unknown_trip=unknown)
        if name == "verify_k3":
            def fn(policy, cache, tokens):
                def body(i, carry):
                    cache, tok = carry
                    pos = cache.lengths[:, None] + jnp.arange(tok.shape[1])[None]
                    logits, _, cache = policy.forward(tok, pos, cache)
                    target = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, k+1]
                    hit = jnp.cumprod(target[:, :-1] == tok[:, 1:], axis=1)
                    accepted = jnp.sum(hit, axis=1, dtype=jnp.int32)  # [B]
                    cache = dataclasses.replace(
                        cache, lengths=cache.lengths - (tok.shape[1] - 1 - accepted))
                    return cache, jnp.roll(target, 1, axis=1)
                return jax.lax.fori_loop(0, steps, body, (cache, tokens))
            return Program(name, fn, (policy, cache, tokens), True, sum(parts.values()), parts,
                           donate=(1,), unknown_trip=unknown)
        if name == "tree_n16":
            mask = jax.ShapeDtypeStruct((batch, fed, fed), jnp.bool_, sharding=rep)
            depth = jax.ShapeDtypeStruct((batch, fed), jnp.int32, sharding=rep)

            def fn(policy, cache, tokens, mask, depth):
                def body(i, carry):
                    cache, tok = carry
                    pos = cache.lengths[:, None] + depth
                    logits, _, cache = policy.forward(tok, pos, cache, mask=mask)
                    target = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, N]
                    # The accepted path: the nodes whose parent's pick is the node's token,
                    # in topological order (a chain of ancestors under `mask`).
                    ok = jnp.concatenate([jnp.ones_like(tok[:, :1], bool),
                                          target[:, :-1] == tok[:, 1:]], axis=1)
                    path = jnp.where(ok, jnp.arange(fed)[None], -1)
                    path = jnp.sort(jnp.where(path < 0, fed, path), axis=1)[:, :5]
                    path = jnp.where(path >= fed, -1, path).astype(jnp.int32)
                    cache = compact(cache, path, fed)
                    return cache, jnp.roll(target, 1, axis=1)
                return jax.lax.fori_loop(0, steps, body, (cache, tokens))
            return Program(name, fn, (policy, cache, tokens, mask, depth), True,
                           sum(parts.values()), parts, donate=(1,), unknown_trip=unknown)

        def refill(policy, cache, tokens):  # one prompt per row into an empty cache
            pos = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
            logits, _, cache = policy.forward(tokens, pos, cache)
            return cache, jnp.argmax(logits[:, -1], -1)
        return Program(name, refill, (policy, cache, tokens), False, sum(parts.values()), parts,
                       donate=(1,), unknown_trip=unknown)
    if name == "eagle3_draft":
        from jaxspec.models import Policy
        from jaxspec.models.eagle3 import Eagle3Head

        policy = _abstract(Policy.abstract(cfg), rep)
        head = jax.eval_shape(lambda: Eagle3Head.init_for(Policy.abstract(cfg), draft_vocab,
                                                           jax.random.key(0)))
        head = _abstract(head, rep)
        hcache = _abstract(jax.eval_shape(lambda: KVCache.zeros(head.config.layer, batch, context)),
                           rep)
        tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rep)
        hidden = jax.ShapeDtypeStruct((batch, cfg.hidden_size), jnp.float32, sharding=rep)
        item = jnp.dtype(cfg.param_dtype).itemsize
        hl = head.config.layer
        parts = floor_bytes(hl, batch, 1, context, embed_rows=False)
        # The layer, norms and the LM head over the draft vocabulary; not `fc`, which only
        # the first draft step after a verify applies (to the policy's features).
        parts["weights"] = _param_bytes(head.params) - _param_bytes(head.params["fc"])
        parts["embedding rows"] = batch * cfg.hidden_size * item  # the policy's embedding

        def fn(policy, head, cache, tokens, hidden):
            def body(i, carry):
                cache, tok, hidden = carry
                embeds = policy.embed(tok)
                out, cache = head.forward(embeds, hidden[:, None], cache.lengths[:, None], cache,
                                          fuse=False)
                logits, ids = head.draft_logits(out[:, 0])
                pick = jnp.argmax(logits, -1)
                return cache, ids[pick][:, None].astype(jnp.int32), out[:, 0].astype(jnp.float32)
            return jax.lax.fori_loop(0, steps, body, (cache, tokens, hidden))
        return Program(name, fn, (policy, head, hcache, tokens, hidden), True,
                       sum(parts.values()), parts, donate=(2,),
                       unknown_trip=-(-context // 128))
    if name == "block_draft":
        return _block_draft_program(cfg, batch, context, rep, steps)
    if name in ("grpo_score", "grpo_update"):
        return _grpo_program(name, cfg, mesh, run)
    raise ValueError(f"unknown program {name!r}; valid: {', '.join(PROGRAMS)}")


def _block_draft_program(cfg, batch, context, rep, steps) -> Program:
    """`block_draft`: BlockDrafter.propose in a loop, its body's cache holding `context`
    committed tokens (read, not written: the observation is a separate step)."""
    from jaxspec.decoding import BlockDrafter, SamplingConfig
    from jaxspec.decoding.protocols import DraftContext
    from jaxspec.models import Policy
    from jaxspec.models.block import BlockHead

    policy = _abstract(Policy.abstract(cfg), rep)
    head = _abstract(jax.eval_shape(lambda: BlockHead.init_for(
        Policy.abstract(cfg), jax.random.key(0), block_size=BLOCK_SIZE, num_layers=1,
        markov_rank=BLOCK_MARKOV_RANK, confidence=True)), rep)
    state = _abstract(jax.eval_shape(lambda: BlockDrafter(head, k=VERIFY_K).init_state(
        None, batch, context)), rep)
    buffer = jax.ShapeDtypeStruct((batch, context), jnp.int32, sharding=rep)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    item = jnp.dtype(cfg.param_dtype).itemsize
    parts = floor_bytes(head.config.layer, batch, BLOCK_SIZE, context,
                        embed_rows=False)
    del parts["KV written"]  # a draft step writes no KV
    # the body's layer and heads, and the policy's LM head the drafts go through
    parts["weights"] = _param_bytes(head.params) + cfg.vocab_size * cfg.hidden_size * item
    parts["embedding rows"] = batch * BLOCK_SIZE * cfg.hidden_size * item  # the policy's

    def fn(policy, head, state, buffer, lengths):
        drafter = BlockDrafter(head, k=VERIFY_K)

        def body(i, carry):
            state, buffer = carry
            ctx = DraftContext(buffer, lengths, jax.random.key(0), SamplingConfig(0.0), False)
            tree, _, state = drafter.propose(state, policy, ctx)
            return state, buffer.at[:, 0].set(tree.tokens[:, 0])
        return jax.lax.fori_loop(0, steps, body, (state, buffer))
    return Program("block_draft", fn, (policy, head, state, buffer, lengths), True,
                   sum(parts.values()), parts, donate=(2,), unknown_trip=-(-context // 128))


def _grpo_program(name, cfg, mesh, run) -> Program:
    """GRPO scoring or update (jaxspec.rl.steps) at the run's batch, params and optimizer
    state sharded over the mesh (fsdp), rows over its devices."""
    from jaxspec import parallel
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.models import Policy
    from jaxspec.models.config import default_eagle3_layers
    from jaxspec.rl.grpo import GRPOConfig
    from jaxspec.rl.steps import (
        POLICY_INPUTS,
        make_optimizer,
        policy_update,
        score_rollouts,
    )

    policy = Policy.abstract(cfg)

    def placed(tree):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, parallel.param_shardings(tree, mesh))

    params = placed(policy.params)
    policy = policy.replace(params=params)
    b = run["batch"]
    p, n = run["prompt_len"], run["new_tokens"]
    t = p + n

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=parallel.batch_sharding(mesh, len(shape)))

    sampling = SamplingConfig(run["temperature"], run["top_k"], run["top_p"])
    filtered = run["top_k"] > 0 or run["top_p"] < 1.0
    ref = params if run["kl_coef"] > 0 else None
    grpo = GRPOConfig(kl_coef=run["kl_coef"], logprob_chunk=run["chunk"],
                      micro_batch=run["micro_batch"])
    n_params = active_params(policy)
    tokens = b * t
    devices = int(np.prod(mesh.devices.shape))  # the floors are per device (fsdp)
    if name == "grpo_score":
        capture = default_eagle3_layers(cfg.num_layers) if run.get("capture") else ()

        def fn(policy, ref, prompts, plens, toks, lens, gen):
            return score_rollouts(policy, ref, prompts, plens, toks, lens, gen, sampling,
                                  capture=capture, filtered=filtered, chunk=run["chunk"],
                                  micro_batch=run["micro_batch"])
        args = (policy, ref, rows((b, p), jnp.int32), rows((b,), jnp.int32),
                rows((b, n), jnp.int32), rows((b,), jnp.int32), rows((b, n), jnp.float32))
        forwards = 2 if ref is not None else 1
        parts = {"weights (read once per forward)": forwards * _param_bytes(params) / devices}
        return Program(name, fn, args, False, sum(parts.values()), parts,
                       flops=forwards * 2 * n_params * tokens)
    optimizer = make_optimizer(_optim_spec(run))
    opt_state = placed(jax.eval_shape(optimizer.init, params))
    scored = {k: rows((b, t), jnp.int32 if k in ("tokens", "positions")
                      else bool if k == "mask" else jnp.float32)
              for k in POLICY_INPUTS if k != "ref_logprobs" or ref is not None}

    def fn(policy, opt_state, scored, adv):
        return policy_update(policy, opt_state, scored, adv, sampling, optimizer=optimizer,
                             grpo_cfg=grpo, minibatches=1, filtered=filtered)
    parts = {"weights, grads and optimizer state (once)": (_param_bytes(params) * 2
             + _param_bytes(opt_state)) / devices}
    return Program(name, fn, (policy, opt_state, scored, rows((b,), jnp.float32)), False,
                   sum(parts.values()), parts, flops=8 * n_params * tokens, donate=(0, 1))


def active_params(policy) -> int:
    """The parameters one token's forward multiplies with, counted from the policy's leaves:
    of the stacked layers' `moe` experts, K of E in the sparse layers only; of their dense
    `mlp`, the dense layers only (a stack of mixed layers holds both for every layer). The
    model-FLOPs bound counts these (Qwen3-30B-A3B: ~3.3B of 30.5B)."""
    cfg = policy.config
    sparse = np.asarray(cfg.sparse_layers, bool)
    count = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(policy.params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        size = float(np.prod(leaf.shape))
        stacked = "layers" in keys and leaf.shape and leaf.shape[0] == cfg.num_layers
        if stacked and "moe" in keys and any(k.endswith("_proj") for k in keys):
            size *= sparse.mean() * cfg.num_experts_per_tok / cfg.num_experts
        elif stacked and "moe" in keys:
            size *= sparse.mean()
        elif stacked and "mlp" in keys and sparse.any():
            size *= 1.0 - sparse.mean()
        count += size
    return int(round(count))


def _optim_spec(run):
    from jaxspec.config import OptimSpec

    return OptimSpec(**run.get("optim", {}))


def inspect_program(program: Program, target: str, mesh, *, hlo_dir=None, tag: str = "",
                    xla_options: dict | None = None, measured: dict | None = None) -> dict:
    """Compiles `program` for `target` on `mesh` and returns its report (a JSON-able dict),
    with the XLA options the engine compiles its programs with on a GPU
    (`kernels.compiler_options`) and then `xla_options` (extra ones, e.g.
    {"xla_gpu_enable_command_buffer": ""}; they override the engine's). Its "estimate" is
    the time per iteration (`gpu_targets.estimate`); with `measured` (a profile's kernels,
    `estimate.load_profile`) "measured" sets them beside it, furthest over first."""
    from jaxspec.kernels import compiler_options, target_platform

    gpu = gpu_targets.target(target)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump, target_platform("gpu"), jax.set_mesh(mesh):
        options = {**compiler_options(), **(xla_options or {})}
        lowered = jax.jit(program.fn, donate_argnums=program.donate).trace(*program.args).lower(
            lowering_platforms=("cuda",))
        compiled = lowered.compile(compiler_options={**options, "xla_dump_to": dump})
        thunks = sorted(pathlib.Path(dump).glob("*thunk_sequence_after_thunk_passes.txt"))
        thunk_text = thunks[-1].read_text() if thunks else ""
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    if hlo_dir is not None:
        out = pathlib.Path(hlo_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag or program.name}.hlo.txt").write_text(text)
    module = hlo.parse(text)
    trip = lambda inst: program.unknown_trip
    if program.loop:
        loops = hlo.loop_costs(module, trip, custom_reads=stacked_attention_reads)
        cost = max(loops, key=lambda c: c.bytes)
    else:
        cost = hlo.program_cost(module, trip, custom_reads=stacked_attention_reads)
    mem = compiled.memory_analysis()
    per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                  + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    big = [c for c in cost.copies if c.bytes > COPY_LIMIT]
    report = {
        "program": program.name,
        "target": target,
        "devices": int(np.prod(mesh.devices.shape)),
        "per_iteration": program.loop,
        "bytes": cost.bytes,
        "floor": program.floor,
        "floor_parts": program.floor_parts,
        "ratio": cost.bytes / program.floor if program.floor else None,
        "time_at_bandwidth_ms": 1e3 * cost.bytes / gpu.hbm_bandwidth,
        "floor_time_ms": 1e3 * program.floor / gpu.hbm_bandwidth,
        "copies_over_1mb": [dataclasses.asdict(c) for c in big],
        "kernels_hlo": cost.kernels,
        "unknown_trips": cost.unknown_trips,
        "thunks": thunk_kernels(thunk_text) if program.loop else None,
        "memory_per_device": {
            "argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
            "temp": mem.temp_size_in_bytes, "alias": mem.alias_size_in_bytes,
            "total": per_device, "capacity": gpu.hbm_bytes},
        "largest_kernels": [{"bytes": b, "name": n, "op_name": o} for b, n, o in cost.largest],
        "compile_s": seconds,
        "xla_options": options,
    }
    th = report["thunks"]
    share = th["in_command_buffer"] / th["kernels"] if th and th["kernels"] else None
    kernels = estimate.estimate_loop(module, cost, gpu, graph_share=share)
    report["estimate"] = estimate.summary(kernels)
    if measured is not None:
        report["measured"] = estimate.compare(kernels, measured)
    if program.flops:
        devices = report["devices"]
        report["flops"] = program.flops
        report["flops_time_ms"] = 1e3 * program.flops / devices / gpu.bf16_flops
    return report
