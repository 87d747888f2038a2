"""FSDP moves weights, not activations: the GRPO update compiled on 8 simulated devices
(fsdp 8, one row per device in each micro-batch) gathers each MLP weight whole for its
matmul and all-reduces no activation; with the layer-boundary constraints switched off
(the negative control) XLA splits the MLP matmuls along the hidden dimension and
all-reduces their [rows, T, mlp] partial sums, as it did on 8 H100s (docs/BENCHMARKS.md).
Read with the GPU inspector's collective parser from the optimized HLO."""

import math

import jax
import jax.numpy as jnp
import pytest

from jaxspec import parallel
from jaxspec.config import OptimSpec
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.gpu_targets import collectives, hlo
from jaxspec.models import ModelConfig, Policy, moe
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.steps import POLICY_INPUTS, make_optimizer, policy_update

HIDDEN, MLP, ROWS, T, MICRO = 256, 512, 16, 32, 8
UP = "bth,hm->btm"  # the MLP's gate / up projection (jaxspec.models.layers)


DENSE = ModelConfig.tiny("qwen3").replace(hidden_size=HIDDEN, intermediate_size=MLP,
                                          vocab_size=256, num_layers=1)
# 8 experts of width 128, 2 per token: each micro-batch's 8 x 32 tokens make 512 assignments
EXPERTS, EXPERT_MLP = 8, 128
MOE = ModelConfig.tiny("qwen3_moe").replace(
    hidden_size=HIDDEN, vocab_size=256, num_layers=1, num_experts=EXPERTS, num_experts_per_tok=2,
    moe_intermediate_size=EXPERT_MLP, expert_backend="blocked")


def _update_collectives(cfg=DENSE):
    mesh = parallel.make_mesh(data=1, fsdp=8)

    def placed(tree):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, parallel.param_shardings(tree, mesh))

    policy = Policy.abstract(cfg)
    policy = policy.replace(params=placed(policy.params))
    optimizer = make_optimizer(OptimSpec())
    opt_state = placed(jax.eval_shape(optimizer.init, policy.params))

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=parallel.batch_sharding(mesh, len(shape)))

    scored = {k: rows((ROWS, T), jnp.int32 if k in ("tokens", "positions")
                      else bool if k == "mask" else jnp.float32)
              for k in POLICY_INPUTS if k != "ref_logprobs"}
    grpo = GRPOConfig(micro_batch=MICRO, kl_coef=0.0)

    def fn(policy, opt_state, scored, adv):
        return policy_update(policy, opt_state, scored, adv, SamplingConfig(1.0),
                             optimizer=optimizer, grpo_cfg=grpo, minibatches=1, filtered=False)

    jax.clear_caches()  # the jitted forward is traced afresh (the control patches it)
    with jax.set_mesh(mesh):
        text = jax.jit(fn).trace(policy, opt_state, scored, rows((ROWS,), jnp.float32)
                                 ).lower().compile().as_text()
    return collectives.collectives(hlo.parse(text), dict(mesh.shape), 1.0)


ACTIVATION = f"f32[{MICRO},{T},{MLP}]"  # one micro-batch's MLP activations, all rows


def test_update_gathers_mlp_weights_and_reduces_no_activation():
    found = _update_collectives()
    gathers = [c for c in found if c.kind == "all-gather" and UP in c.op_name]
    # each [embed, mlp] weight whole (f32): forward, its rematerialisation, backward
    assert len(gathers) >= 3 and all(
        c.shape.startswith(f"f32[{HIDDEN},{MLP}]") and c.bytes == HIDDEN * MLP * 4
        and c.axes == "fsdp" for c in gathers), gathers
    assert not [c for c in found if c.kind == "all-reduce" and ACTIVATION in c.shape]


def test_negative_control_without_row_constraints_all_reduces_activations(monkeypatch):
    monkeypatch.setattr(parallel, "constrain_rows", lambda x, dim=0, rules=None: x)
    found = _update_collectives()
    reduced = [c for c in found if c.kind == "all-reduce" and ACTIVATION in c.shape]
    assert reduced and all(UP in c.op_name or "mh->bth" in c.op_name for c in reduced), reduced
    jax.clear_caches()


@pytest.mark.parametrize("rules, want", [(None, ("data", "fsdp")),
                                         ({"batch": ["fsdp"]}, "fsdp")])
def test_constrain_rows_follows_the_rules_and_skips_indivisible_rows(rules, want):
    mesh = parallel.make_mesh(data=2, fsdp=4)
    seen = {}

    def f(x, y):
        x, y = parallel.constrain_rows(x), parallel.constrain_rows(y)
        seen["x"], seen["y"] = x, y
        return x, y

    with jax.set_mesh(mesh), parallel.use_rules(rules):
        jaxpr = jax.make_jaxpr(f)(jnp.zeros((8, 3)), jnp.zeros((2, 3)))
    constraints = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert len(constraints) == 1  # 2 rows split neither 8 nor 4 ways: left alone
    spec = constraints[0].params["sharding"].spec
    assert spec[0] == want and spec[1] is None


# An MoE layer: each batch shard's tokens are routed and blocked on their own
# (jaxspec.models.moe._per_shard), so the expert weights [E, H, I] are gathered whole for the
# blocks' matmuls. The control routes every row's tokens together, as before: XLA then splits
# the blocks' matmuls over `embed` and all-reduces [blocks, rows, mlp] partial sums (on 8
# H100s: 528 MB x 3,072 per step of Qwen3-30B-A3B, docs/BENCHMARKS.md).
def _expert_gathers(found):
    whole = {f"f32[1,{EXPERTS},{HIDDEN},{EXPERT_MLP}]", f"f32[1,{EXPERTS},{EXPERT_MLP},{HIDDEN}]"}
    return [c for c in found if c.kind == "all-gather" and c.shape.split("{")[0] in whole]


def _activation_exchanges(found):
    """All-reduces or all-to-alls carrying an array with the expert width and 32+ rows of
    the blocks' tokens (partial sums, or per-block weight copies)."""
    def big(shape):
        dims = [int(d) for d in shape.split("[", 1)[1].split("]")[0].split(",") if d]
        return EXPERT_MLP in dims and math.prod(dims) >= 32 * EXPERT_MLP * 2
    return [c for c in found if c.kind in ("all-reduce", "all-to-all")
            and any(big(part) for part in c.shape.split("f32")[1:])
            and "_forward" in c.op_name and "/(transpose" not in c.op_name]


def test_moe_update_gathers_expert_weights_and_exchanges_no_activation():
    found = _update_collectives(MOE)
    gathers = _expert_gathers(found)
    # gate, up, down whole (E x H x I f32), forward and rematerialised/backward
    assert len(gathers) >= 6 and all(c.bytes == EXPERTS * HIDDEN * EXPERT_MLP * 4
                                     and c.axes == "fsdp" for c in gathers), gathers
    assert not _activation_exchanges(found), _activation_exchanges(found)


def test_moe_negative_control_routing_all_rows_together_exchanges_activations(monkeypatch):
    monkeypatch.setattr(moe, "_per_shard", lambda path, w, rows, x, weights, experts, kernel:
                        path(x, weights, experts, w))
    found = _update_collectives(MOE)
    assert _activation_exchanges(found) and not _expert_gathers(found)
    jax.clear_caches()
