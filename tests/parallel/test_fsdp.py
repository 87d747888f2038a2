"""FSDP moves weights, not activations: the GRPO update compiled on 8 simulated devices
(fsdp 8, one row per device in each micro-batch) gathers each MLP weight whole for its
matmul and all-reduces no activation; with the layer-boundary constraints switched off
(the negative control) XLA splits the MLP matmuls along the hidden dimension and
all-reduces their [rows, T, mlp] partial sums, as it did on 8 H100s (docs/BENCHMARKS.md).
Read with the GPU inspector's collective parser from the optimized HLO."""

import jax
import jax.numpy as jnp
import pytest

from jaxspec import parallel
from jaxspec.config import OptimSpec
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.gpu_targets import collectives, hlo
from jaxspec.models import ModelConfig, Policy
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.steps import POLICY_INPUTS, make_optimizer, policy_update

HIDDEN, MLP, ROWS, T, MICRO = 256, 512, 16, 32, 8
UP = "bth,hm->btm"  # the MLP's gate / up projection (jaxspec.models.layers)


def _update_collectives():
    cfg = ModelConfig.tiny("qwen3").replace(hidden_size=HIDDEN, intermediate_size=MLP,
                                            vocab_size=256, num_layers=1)
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
