"""The mixture-of-experts feed-forward of `family: qwen3_moe` (HF Qwen3MoeSparseMoeBlock), its
router, and the router losses (load balancing, z-loss).

A token's router logits are x @ W_router in the parameter dtype; the softmax over the
`num_experts` experts is taken in float32, the top `num_experts_per_tok` probabilities are
kept (renormalised to sum to 1 when `norm_topk_prob`) and cast back to the activations'
dtype, as transformers does. Each chosen expert is a SwiGLU MLP of width
`moe_intermediate_size`; the outputs are summed with those weights. An optional shared
expert (Qwen2-MoE style) runs for every token, gated by sigmoid(x @ w_gate).

Expert paths. A forward of N tokens with N * top-k <= E (a decode or a small verify) gathers
the chosen experts' weights and applies them per token: it reads only the experts a token
picked, which is what a memory-bound decode step should cost. Larger forwards take
`ModelConfig.expert_backend`:
- "ragged": the token-expert assignments sorted by expert, each projection one grouped
  matmul over the groups (`jax.lax.ragged_dot`), results put back in (token, slot) order.
  Its FLOPs follow the assignments where XLA lowers ragged_dot to a grouped GEMM (TPU;
  cuDNN on GPU behind an XLA flag); XLA's default lowering (CPU, GPU without the flag)
  expands it into zero-padded per-expert products, E / top-k times the FLOPs, and on this
  CPU it is slower than "dense" (docs/BENCHMARKS.md);
- "blocked": the same sorted assignments with each expert's group padded to whole blocks of
  EXPERT_BLOCK rows, every block one batched matmul with its expert's weights gathered: a
  grouped matmul from ordinary ops, so its FLOPs follow the assignments (plus at most a
  block of padding per expert) on every backend;
- "dense": every expert over every token, the unchosen ones weighted 0 (E / top-k times the
  FLOPs): the reference the tests compare the grouped paths with.
On one GPU (a forward built for the platform "gpu", kernels.platform, on at most one device)
two paths read the expert weights in place instead: "blocked" runs `_grouped`, the Pallas
grouped matmul of jaxspec.kernels.grouped (each routed expert's weights read once from the
stacked [E, H, I] arrays, an empty expert not at all; its backward is Pallas too), and a
decode-sized forward runs `_gathered_reduce`, whose products are summed by reductions that
XLA fuses the expert gathers into (einsum's matmuls take a gathered copy of the weights
first: 2-3x the bytes). On a mesh whose batch axes split the rows, each batch shard's
tokens are routed and blocked on their own (`_per_shard`), so FSDP gathers whole expert
weights instead of all-reducing partial sums of every row's tokens; there the kernel runs
per device in a shard_map when only batch axes split the weights (XLA cannot partition
its custom call), the XLA paths otherwise. docs/BENCHMARKS.md has the compiled programs'
bytes and collectives.
With `batch_invariant` every product is a per-row `tree_sum` over the gathered expert's
weights (jaxspec.kernels.invariant), so a token's output never depends on the other tokens
routed with it (a grouped matmul's tiling does: the group sizes change with the batch).

Parameters: router [H, E] (embed, -), gate_proj / up_proj [E, H, I] (experts, embed, mlp),
down_proj [E, I, H] (experts, mlp, embed); the "experts" logical axis is what expert
parallelism shards (jaxspec.parallel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxspec.kernels.grouped import fits as grouped_fits
from jaxspec.kernels.grouped import group_bounds, grouped_matmul
from jaxspec.kernels.invariant import invariant_dot, tree_sum, uncontracted
from jaxspec.kernels.platform import platform
from jaxspec.models.config import ModelConfig

__all__ = ["EXPERT_BLOCK", "MoE", "load_balancing_loss", "router_z_loss", "routing_mismatch"]

# Rows per block of the "blocked" expert backend (fewer when the assignments per expert are
# fewer): each block is one expert's, so its padding costs at most E blocks of rows.
EXPERT_BLOCK = 128

# The logical axes of gate_proj, up_proj, down_proj (jaxspec.parallel's rules place them).
_EXPERT_AXES = (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed"))


def _one_gpu() -> bool:
    """Whether the forward is built for a GPU (kernels.platform) on at most one device: the
    grouped Pallas kernel is one custom call, which XLA cannot partition over a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return platform() == "gpu" and (mesh.empty or mesh.size == 1)


def _per_shard(path, w, rows: int, x, weights, experts, kernel=None):
    # [N, H], [N, K], [N, K] -> [N, H]
    """`path` over the tokens of each batch shard on its own (the N = rows * T tokens split
    in order into the shards `parallel.constrain_rows` gives the rows), the shard axis
    pinned to the batch sharding and the expert weights `w` gathered whole first
    (`parallel.gather_weight`): every device sorts and blocks only its own tokens and XLA
    all-gathers the expert weights for the expert matmuls (FSDP; their gradients are
    reduce-scattered), instead of splitting the matmuls over `embed` and all-reducing
    partial sums of every row's tokens together (docs/scaling.md). Without a mesh (or batch
    shards that do not divide the rows) `path` over all tokens.

    `kernel` (the grouped Pallas matmul, on a GPU) runs instead of `path` in a shard_map over
    the batch axes, each device's weights all-gathered inside it (reduce-scattered in the
    backward), when the weights are split over batch axes only (no expert or tensor split).
    """
    from jaxspec import parallel  # (jaxspec.parallel imports the models)

    shards = parallel.row_shards(rows)
    if shards == 1:
        return path(x, weights, experts, w)
    k = weights.shape[-1]
    if kernel is not None and _kernel_fits(x.shape[0] // shards * k, w):
        return _kernel_shards(kernel, shards, x, weights, experts, w)
    w = tuple(parallel.gather_weight(a, axes) for a, axes in zip(w, _EXPERT_AXES, strict=True))
    split = [parallel.constrain_rows(a.reshape((shards, -1) + a.shape[1:]))
             for a in (x, weights, experts)]
    out = parallel.constrain_rows(jax.vmap(lambda *a: path(*a, w))(*split))
    return out.reshape(x.shape)


def _spec_axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _kernel_fits(assignments: int, w) -> bool:
    """Whether the grouped kernel takes a shard's assignments with the expert weights split
    over the batch mesh axes only (an expert or tensor split leaves a device part of them)."""
    from jaxspec import parallel

    mesh = jax.sharding.get_abstract_mesh()
    batch = set(parallel.resolve_rules()["batch"] or ())
    for axes in _EXPERT_AXES:
        for entry in parallel.logical_to_mesh(axes):
            if any(mesh.shape[a] > 1 and a not in batch for a in _spec_axes(entry)):
                return False
    _, h, i = w[0].shape
    return grouped_fits(assignments, h, i)


def _kernel_shards(kernel, shards: int, x, weights, experts, w):
    """`kernel` on each device's tokens in a shard_map over every mesh axis (rows split over
    the batch axes), each expert weight all-gathered over the axes that split it (the
    transpose: a reduce-scatter of its gradient)."""
    from jaxspec import parallel

    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in (parallel.resolve_rules()["batch"] or ()) if mesh.shape[a] > 1)
    rows = P(axes[0] if len(axes) == 1 else axes)
    specs = tuple(parallel.logical_to_mesh(a) for a in _EXPERT_AXES)

    def body(x, weights, experts, *w):  # this device's [1, n, ...] tokens, its weight shards
        whole = []
        for a, spec in zip(w, specs, strict=True):
            for dim, entry in enumerate(spec):
                split = tuple(n for n in _spec_axes(entry) if mesh.shape[n] > 1)
                if split:
                    a = jax.lax.all_gather(a, split if len(split) > 1 else split[0], axis=dim,
                                           tiled=True)
            whole.append(a)
        return kernel(x[0], weights[0], experts[0], tuple(whole))[None]

    split = [a.reshape((shards, -1) + a.shape[1:]) for a in (x, weights, experts)]
    out = jax.shard_map(body, in_specs=(rows,) * 3 + specs, out_specs=rows,
                        axis_names=frozenset(mesh.axis_names), check_vma=False)(*split, *w)
    return out.reshape(x.shape)


def _param(rngs, shape, dtype, axes):
    from jaxspec.models.layers import logical_param  # layers imports this module

    return logical_param(rngs, shape, dtype, axes)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (+ an optional gated shared expert)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        from jaxspec.models.layers import MLP

        self.config = config
        dtype = config.param_dtype
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.router = _param(rngs, (h, e), dtype, ("embed", None))
        gate, up, down = _EXPERT_AXES
        self.gate_proj = _param(rngs, (e, h, i), dtype, gate)
        self.up_proj = _param(rngs, (e, h, i), dtype, up)
        self.down_proj = _param(rngs, (e, i, h), dtype, down)
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(h, config.shared_expert_intermediate_size, dtype=dtype,
                                     rngs=rngs, invariant=config.batch_invariant)
            self.shared_expert_gate = _param(rngs, (h, 1), dtype, ("embed", None))
        else:
            self.shared_expert = None
            self.shared_expert_gate = None

    def route(
        self,
        x,  # [N, H]
    ):  # -> (router logits [N, E] float32, weights [N, K] x.dtype, experts [N, K] int32)
        """The router: softmax in float32 over x @ W_router, the top-k kept (renormalised if
        norm_topk_prob), the weights cast to x's dtype (transformers' order of operations)."""
        cfg = self.config
        if cfg.batch_invariant:
            logits = invariant_dot(x, self.router[...])
            z = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
            probs = z / tree_sum(z)[..., None]
        else:
            logits = jnp.dot(x, self.router[...]).astype(jnp.float32)
            probs = jax.nn.softmax(logits, axis=-1)
        top, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
        if cfg.norm_topk_prob:
            total = tree_sum(top) if cfg.batch_invariant else jnp.sum(top, axis=-1)
            top = top / total[..., None]
        return logits, top.astype(x.dtype), experts.astype(jnp.int32)

    def __call__(
        self,
        x,  # [B, T, H] (post-attention-normed)
    ):  # -> (out [B, T, H], router logits [B, T, E] float32, experts [B, T, K] int32)
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        logits, weights, experts = self.route(flat)
        cfg = self.config
        small = flat.shape[0] * cfg.num_experts_per_tok <= cfg.num_experts
        if cfg.batch_invariant:
            out = self._invariant(flat, weights, experts)
        elif small and _one_gpu():
            out = self._gathered_reduce(flat, weights, experts)
        elif small:
            out = self._gathered(flat, weights, experts)  # decode-sized: read only the chosen
        elif (cfg.expert_backend == "blocked" and _one_gpu()
              and grouped_fits(flat.shape[0] * cfg.num_experts_per_tok, h,
                               cfg.moe_intermediate_size)):
            out = self._grouped(flat, weights, experts)
        else:
            path = {"dense": self._dense, "blocked": self._blocked}.get(cfg.expert_backend,
                                                                        self._ragged)
            kernel = self._grouped if cfg.expert_backend == "blocked" and platform() == "gpu" else None
            out = _per_shard(path, self._experts(), b, flat, weights, experts, kernel)
        if self.shared_expert is not None:
            shared = self.shared_expert(x).reshape(b * t, h)
            if cfg.batch_invariant:
                gate = jax.nn.sigmoid(invariant_dot(flat, self.shared_expert_gate[...]))
                out = out + uncontracted(gate.astype(out.dtype) * shared)
            else:
                gate = jax.nn.sigmoid(jnp.dot(flat, self.shared_expert_gate[...]))
                out = out + gate * shared
        k = cfg.num_experts_per_tok
        return (out.reshape(b, t, h), logits.reshape(b, t, cfg.num_experts),
                experts.reshape(b, t, k))

    def _experts(self):  # -> (gate_proj [E, H, I], up_proj [E, H, I], down_proj [E, I, H])
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]

    def _ragged(self, x, weights, experts, w=None):  # [N, H], [N, K], [N, K] -> [N, H]
        """Grouped matmuls over the assignments sorted by expert."""
        wg, wu, wd = self._experts() if w is None else w
        n, k = experts.shape
        e = self.config.num_experts
        flat = experts.reshape(-1)  # [N*K] in (token, slot) order
        order = jnp.argsort(flat, stable=True)  # assignment indices grouped by expert
        sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)  # [E]
        xs = x[order // k]  # [N*K, H] each assignment's token, grouped by expert
        gate = jax.lax.ragged_dot(xs, wg, sizes)
        up = jax.lax.ragged_dot(xs, wu, sizes)
        ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, wd, sizes)  # [N*K, H]
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to (token, slot)
        return jnp.sum(y * weights[..., None], axis=1)

    def _grouped(self, x, weights, experts, w=None, interpret: bool = False):
        """The grouped Pallas kernel (jaxspec.kernels.grouped): the assignments sorted by
        expert, each projection one kernel that reads each routed expert's weights in place
        (no per-block weight copy, no zero buffers, no searchsorted), results gathered
        back in (token, slot) order with the inverse permutation."""
        wg, wu, wd = self._experts() if w is None else w
        n, k = experts.shape
        e = self.config.num_experts
        flat = experts.reshape(-1)  # [N*K] in (token, slot) order
        order = jnp.argsort(flat, stable=True)  # assignment indices grouped by expert
        starts, ends = group_bounds(flat[order], e)
        xs = x[order // k]  # [N*K, H] each assignment's token, grouped by expert

        def gmm(a, w):
            return grouped_matmul(a, w, starts, ends, False, interpret)

        gate, up = gmm(xs, wg), gmm(xs, wu)
        ys = gmm(jax.nn.silu(gate) * up, wd)  # [N*K, H] grouped order
        back = jnp.argsort(order)  # each (token, slot)'s row in the grouped order
        y = ys[back].reshape(n, k, -1)
        return jnp.sum(y * weights[..., None], axis=1)

    def _gathered_reduce(self, x, weights, experts):  # [N, H], [N, K], [N, K] -> [N, H]
        """`_gathered` as products summed by reductions: on a GPU XLA fuses each expert
        gather into the reduction that reads it, so the chosen experts' weights are read
        once, in place (einsum's matmuls take a gathered copy of them first)."""
        f32 = jnp.float32

        def proj(v, w):  # [N, K, A] @ [N, K, A, O] (gathered) -> [N, K, O], summed in f32
            return jnp.sum(v.astype(f32)[..., None] * w.astype(f32), axis=-2).astype(x.dtype)

        xk = jnp.broadcast_to(x[:, None, :], experts.shape + x.shape[-1:])
        gate = proj(xk, self.gate_proj[...][experts])
        up = proj(xk, self.up_proj[...][experts])
        y = proj(jax.nn.silu(gate) * up, self.down_proj[...][experts])  # [N, K, H]
        return jnp.sum(y * weights[..., None], axis=1)

    def _gathered(self, x, weights, experts):  # [N, H], [N, K], [N, K] -> [N, H]
        """Each assignment's expert weights gathered and applied per row: the weights read
        are the chosen experts' only, which is what a decode or verify forward of a few
        tokens should cost (N * K <= E; a grouped matmul in XLA's default lowering reads
        and multiplies every expert's)."""
        gate = jnp.einsum("nh,nkhi->nki", x, self.gate_proj[...][experts])
        up = jnp.einsum("nh,nkhi->nki", x, self.up_proj[...][experts])
        y = jnp.einsum("nki,nkih->nkh", jax.nn.silu(gate) * up, self.down_proj[...][experts])
        return jnp.sum(y * weights[..., None], axis=1)

    def _blocked(self, x, weights, experts, w=None):  # [N, H], [N, K], [N, K] -> [N, H]
        """A grouped matmul from batched ones: the assignments sorted by expert, each expert's
        group padded to whole blocks of EXPERT_BLOCK rows, every block multiplied by its
        expert's weights (gathered per block). Static shapes, FLOPs within E blocks of the
        assignments', on any backend (no ragged_dot lowering needed)."""
        wg, wu, wd = self._experts() if w is None else w
        n, k = experts.shape
        e, h = self.config.num_experts, x.shape[-1]
        m = n * k
        block = min(EXPERT_BLOCK, max(8, 1 << (max(m // e, 1) - 1).bit_length()))
        blocks = -(-(m + e * (block - 1)) // block)  # enough for any routing
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)  # [E]
        padded = -(-sizes // block) * block
        ends = jnp.cumsum(padded)
        starts_padded = ends - padded
        starts = jnp.cumsum(sizes) - sizes
        sorted_e = flat[order]
        rows = starts_padded[sorted_e] + jnp.arange(m, dtype=jnp.int32) - starts[sorted_e]
        xs = jnp.zeros((blocks * block, h), x.dtype).at[rows].set(x[order // k])
        owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), e - 1)
        xb = xs.reshape(blocks, block, h)
        gate = jnp.einsum("bth,bhi->bti", xb, wg[owner])
        up = jnp.einsum("bth,bhi->bti", xb, wu[owner])
        yb = jnp.einsum("bti,bih->bth", jax.nn.silu(gate) * up, wd[owner])
        ys = yb.reshape(blocks * block, h)[rows]  # [M, H] grouped order
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, h)
        return jnp.sum(y * weights[..., None], axis=1)

    def _dense(self, x, weights, experts, w=None):  # [N, H], [N, K], [N, K] -> [N, H]
        """Every expert over every token; unchosen experts weigh 0."""
        wg, wu, wd = self._experts() if w is None else w
        gate = jnp.einsum("nh,ehi->eni", x, wg)
        up = jnp.einsum("nh,ehi->eni", x, wu)
        y = jnp.einsum("eni,eih->enh", jax.nn.silu(gate) * up, wd)  # [E, N, H]
        picked = jnp.take_along_axis(jnp.moveaxis(y, 0, 1), experts[:, :, None], axis=1)  # [N, K, H]
        return jnp.sum(picked * weights[..., None], axis=1)

    def _invariant(self, x, weights, experts):  # [N, H], [N, K], [N, K] -> [N, H] float32
        """Per-assignment products with the chosen expert's weights, each summed by tree_sum."""
        def per_row(v, w):  # [N, K, A], [N, K, A, O] -> [N, K, O]
            return tree_sum(jnp.swapaxes(v.astype(jnp.float32)[..., :, None]
                                         * w.astype(jnp.float32), -2, -1))

        xk = jnp.broadcast_to(x[:, None, :], experts.shape + x.shape[-1:])
        gate = per_row(xk, self.gate_proj[...][experts])
        up = per_row(xk, self.up_proj[...][experts])
        y = per_row(jax.nn.silu(gate) * up, self.down_proj[...][experts])  # [N, K, H]
        terms = uncontracted(y * weights.astype(jnp.float32)[..., None])
        return tree_sum(jnp.swapaxes(terms, -2, -1))


# --------------------------------------------------------------------------- router losses


def _sparse_rows(router_logits, sparse, mask):
    """The sparse layers' logits [L', N, E] and the token mask [N] (1.0 / 0.0)."""
    idx = [i for i, s in enumerate(sparse) if s]
    logits = router_logits[jnp.asarray(idx)] if len(idx) != len(sparse) else router_logits
    logits = logits.reshape(len(idx), -1, logits.shape[-1]).astype(jnp.float32)
    if mask is None:
        return logits, jnp.ones(logits.shape[1], jnp.float32)
    return logits, jnp.asarray(mask, jnp.float32).reshape(-1)


def load_balancing_loss(
    router_logits,  # [L, B, T, E] float32 (Policy.forward(routing=True)["router_logits"])
    top_k: int,
    sparse: tuple[bool, ...],  # ModelConfig.sparse_layers: which of the L layers route
    mask=None,  # [B, T] bool: tokens that count (default all)
):  # -> scalar float32
    """Switch-Transformer load balancing as transformers computes it over all sparse layers
    at once: E * sum_e f_e * P_e, f_e the fraction of (token, layer) rows whose top-k holds
    expert e (summing to top_k over e), P_e the mean router probability of e. 1.0 * top_k
    when the load is uniform; it grows as routing concentrates."""
    logits, m = _sparse_rows(router_logits, sparse, mask)
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)  # [L', N, E]
    _, chosen = jax.lax.top_k(probs, top_k)
    counts = jnp.sum(jax.nn.one_hot(chosen, e, dtype=jnp.float32), axis=-2)  # [L', N, E]
    rows = jnp.maximum(m.sum() * logits.shape[0], 1.0)
    f = jnp.sum(counts * m[None, :, None], axis=(0, 1)) / rows
    p = jnp.sum(probs * m[None, :, None], axis=(0, 1)) / rows
    return e * jnp.sum(f * p)


def router_z_loss(
    router_logits,  # [L, B, T, E] float32
    sparse: tuple[bool, ...],
    mask=None,  # [B, T] bool
):  # -> scalar float32
    """ST-MoE's router z-loss: the mean over sparse layers and counted tokens of
    logsumexp(router logits)^2 (keeps the logits small, so the router's softmax stays
    well-conditioned)."""
    logits, m = _sparse_rows(router_logits, sparse, mask)
    z = jax.nn.logsumexp(logits, axis=-1) ** 2  # [L', N]
    return jnp.sum(z * m[None]) / jnp.maximum(m.sum() * logits.shape[0], 1.0)


def routing_mismatch(
    experts_a,  # [L, B, T, K] int32 chosen experts (one forward)
    experts_b,  # [L, B, T, K] int32 (another forward of the same tokens)
    sparse: tuple[bool, ...],
    mask=None,  # [B, T] bool: tokens that count
):  # -> scalar float32
    """The fraction of counted tokens whose chosen expert set differs, in any sparse layer,
    between two forwards (the order within the top-k is ignored)."""
    idx = jnp.asarray([i for i, s in enumerate(sparse) if s])
    a = jnp.sort(experts_a[idx], axis=-1)
    b = jnp.sort(experts_b[idx], axis=-1)
    differs = jnp.any(a != b, axis=(0, -1))  # [B, T]
    m = jnp.ones(differs.shape, bool) if mask is None else jnp.asarray(mask, bool)
    return jnp.sum(differs & m) / jnp.maximum(jnp.sum(m), 1)
