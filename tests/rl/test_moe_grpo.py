"""GRPO on a mixture-of-experts policy: the router losses (grpo.router_aux_coef /
router_z_coef) enter the update's loss exactly as a NumPy computation from the forward's
router logits says, and their gradients reach the router."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.config import ConfigError, load_config
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.steps import POLICY_INPUTS, policy_update, score_rollouts

SGD = optax.sgd(0.1)  # params move by the gradient itself


def _np_router_losses(logits, tokens, top_k):  # [L, B, T, E], [B, T] -> (aux, z) in float64
    rows = np.asarray(logits, np.float64).reshape(logits.shape[0], -1, logits.shape[-1])
    m = np.asarray(tokens, np.float64).reshape(-1)
    z = rows - rows.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[..., :top_k]
    counts = (chosen[..., None] == np.arange(rows.shape[-1])).sum(-2)
    n = m.sum() * rows.shape[0]
    f = (counts * m[None, :, None]).sum((0, 1)) / n
    p = (probs * m[None, :, None]).sum((0, 1)) / n
    lse = np.log(np.exp(rows).sum(-1))
    return rows.shape[-1] * np.sum(f * p), (lse**2 * m[None]).sum() / n


def test_router_losses_enter_the_grpo_update():
    cfg = ModelConfig.tiny("qwen3_moe", vocab_size=48, hidden_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16, moe_intermediate_size=16)
    policy = random_policy(cfg, seed=1)
    rng = np.random.default_rng(0)
    batch = (jnp.asarray(rng.integers(1, 48, (4, 3)), jnp.int32), jnp.array([3, 2, 3, 1], jnp.int32),
             jnp.asarray(rng.integers(1, 48, (4, 6)), jnp.int32), jnp.array([6, 4, 1, 5], jnp.int32),
             jnp.zeros((4, 6), jnp.float32))
    sampling = SamplingConfig(1.0)
    scored = score_rollouts(policy, None, *batch, sampling, chunk=0)
    scored = {k: scored[k] for k in POLICY_INPUTS if k in scored}
    adv = jnp.array([1.0, -0.5, 0.3, -0.8])
    _, _, _, routing = policy.forward(scored["tokens"], scored["positions"], routing=True)
    aux, z = _np_router_losses(routing["router_logits"], scored["positions"] >= 0, 2)
    out = {}
    for name, (a, zc) in {"off": (0.0, 0.0), "on": (0.5, 0.25)}.items():
        grpo = GRPOConfig(kl_coef=0.0, logprob_chunk=0, router_aux_coef=a, router_z_coef=zc)
        out[name] = policy_update(policy, SGD.init(policy.params), scored, adv, sampling,
                                  optimizer=SGD, grpo_cfg=grpo, minibatches=1, filtered=False)
    on, off = out["on"][2], out["off"][2]
    np.testing.assert_allclose(float(on["router_aux_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(on["router_z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(on["loss"]) - float(off["loss"]), 0.5 * aux + 0.25 * z,
                               rtol=1e-4)
    router = lambda p: np.asarray(p.params["layers"]["moe"]["router"][...])  # noqa: E731
    moved = np.abs(router(out["on"][0]) - router(out["off"][0])).max()
    assert moved > 1e-4  # the router losses' gradients reach the router


def test_bad_router_coefficient_is_one_config_error():
    with pytest.raises(ConfigError, match=r"grpo.router_aux_coef.*-0.1.*>= 0"):
        load_config(None, ["grpo.router_aux_coef=-0.1"])


def _moe_policy(**kw):
    cfg = ModelConfig.tiny("qwen3_moe", num_layers=2, hidden_size=32, num_heads=2,
                           num_kv_heads=1, head_dim=16, moe_intermediate_size=16, **kw)
    return random_policy(cfg, seed=4)


@pytest.mark.parametrize("case", ["eagle3_tree", "ngram_slots_grown", "bf16_invariant"])
def test_rollouts_record_the_experts_of_the_forward_that_fed_each_token(case):
    """Rollouts.routes holds, for every generated token but the last, the experts the
    generation forward routed it to: here (float32 on this CPU) the training forward's own,
    row by row, through verify blocks (a tree), refilled slots and a grown cache, and in
    bfloat16 under model.batch_invariant (equal by construction); -1 where no forward fed the
    token. routing_mismatch_of agrees (0)."""
    from jaxspec.decoding.engine import generate
    from jaxspec.rl.steps import routing_mismatch_of
    from jaxspec.testing.drafters import PROMPTS, every_drafter

    policy = _moe_policy()
    if case == "bf16_invariant":
        policy = policy.astype("bfloat16").with_config(batch_invariant=True)
    drafter = every_drafter(policy)["ngram" if case == "ngram_slots_grown" else "eagle3_tree"]
    new, slots = (140, 1) if case == "ngram_slots_grown" else (12, None)  # 140: past 64 slots
    out = generate(policy, PROMPTS, drafter=drafter, sampling=SamplingConfig(1.0),
                   max_new_tokens=new, key=jax.random.key(1), slots=slots)
    routes = np.asarray(out.routes)
    assert routes.shape == (3, new, 2, 2)
    for b, prompt in enumerate(PROMPTS):
        n = int(out.lengths[b])
        seq = jnp.asarray([prompt + np.asarray(out.tokens[b, :n]).tolist()])
        _, _, _, train = policy.forward(seq, jnp.arange(seq.shape[1])[None], routing=True)
        want = np.sort(np.asarray(train["experts"])[:, 0, len(prompt):len(prompt) + n - 1], -1)
        np.testing.assert_array_equal(np.sort(routes[b, :n - 1].transpose(1, 0, 2), -1), want)
        assert np.all(routes[b, n - 1:] == -1)
    prompts = np.zeros((3, 7), np.int32)
    for b, p in enumerate(PROMPTS):
        prompts[b, :len(p)] = p
    mismatch, counted = routing_mismatch_of(policy, prompts, np.array([7, 2, 6]), out.tokens,
                                            out.lengths, out.routes)
    assert float(mismatch) == 0.0 and int(counted) == int(np.sum(np.asarray(out.lengths) - 1))


def test_routing_mismatch_counts_a_changed_route():
    """The metric sees a difference: rollouts routed by one policy, scored by another
    (top-1 routing, the same params) differ on most tokens."""
    from jaxspec.decoding.engine import generate
    from jaxspec.rl.steps import routing_mismatch_of

    policy = _moe_policy()
    prompts = np.array([[5, 9, 13], [77, 3, 1]], np.int32)
    out = generate(policy, prompts.tolist(), sampling=SamplingConfig(1.0), max_new_tokens=10,
                   key=jax.random.key(2))
    other = policy.with_config(norm_topk_prob=False, num_experts_per_tok=2)
    same = routing_mismatch_of(other, prompts, np.array([3, 3]), out.tokens, out.lengths,
                               out.routes)[0]
    assert float(same) == 0.0  # the weights' normalisation does not change the choice
    shifted = policy.replace(params=jax.tree.map(lambda x: x, policy.params))
    router = shifted.params["layers"]["moe"]["router"]
    shifted.params["layers"]["moe"]["router"] = router[...] * -1.0  # the opposite preferences
    changed = routing_mismatch_of(shifted, prompts, np.array([3, 3]), out.tokens, out.lengths,
                                  out.routes)[0]
    assert float(changed) > 0.9


# Qwen/Qwen3-30B-A3B's config.json as published (transformers 4.51 spelling)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_shipped_moe_configs():
    """configs/qwen3_30b_a3b_eagle3.yaml's model section is Qwen3-30B-A3B's config.json
    (30.5B parameters); configs/moe.yaml is an MoE run on the task's own vocabulary."""
    from jaxspec.models import Policy
    from jaxspec.models.hf import config_from_hf
    from jaxspec.testing import ROOT

    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b_eagle3.yaml", check_paths=False)
    ours = cfg.model.model_config(151936)
    assert ours == config_from_hf(QWEN3_30B_A3B, attention_backend=ours.attention_backend)
    assert round(Policy.abstract(ours).num_params / 1e9, 1) == 30.5
    moe = load_config(ROOT / "configs" / "moe.yaml")
    assert moe.model.family == "qwen3_moe" and moe.mesh.expert == 1
    assert moe.model.model_config(moe.tiny_vocab_size()).is_moe
