"""Mixture-of-experts policies (family qwen3_moe): logits and routing against `transformers`'
Qwen3MoeForCausalLM on tiny random models, the HF import / export round trip, the grouped
(ragged_dot) expert path against the dense one, the router losses against NumPy, and the
errors a bad MoE config raises."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jaxspec.errors import FieldError
from jaxspec.models import ModelConfig, Policy, load_hf, save_hf
from jaxspec.models.moe import load_balancing_loss, router_z_loss, routing_mismatch
from jaxspec.models.transformer import random_policy
from jaxspec.testing.hf_models import randomise

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 12
VARIANTS = {
    # every layer sparse, top-k renormalised (Qwen3-30B-A3B's routing)
    "sparse": dict(num_hidden_layers=2, norm_topk_prob=True),
    # layer 1 dense by mlp_only_layers, layer 2 dense by decoder_sparse_step, raw top-k weights
    "mixed": dict(num_hidden_layers=4, norm_topk_prob=False, decoder_sparse_step=2,
                  mlp_only_layers=[1]),
}


def _hf_model(variant, seed):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10_000.0,
        tie_word_embeddings=False, **VARIANTS[variant])
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    return randomise(model, seed)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """variant -> (checkpoint dir, torch model, ids [2, SEQ], HF outputs with router logits)."""
    out = {}
    for seed, variant in enumerate(VARIANTS):
        model = _hf_model(variant, seed)
        path = tmp_path_factory.mktemp(variant)
        model.save_pretrained(path)
        ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            res = model(ids, output_router_logits=True, output_hidden_states=True)
        out[variant] = (path, model, ids, res)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_hidden_states_and_routing_match_transformers(hf, variant):
    path, _, ids, res = hf[variant]
    policy = load_hf(path, dtype="float32")
    cfg = policy.config
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.sparse_layers == {"sparse": (True, True),
                                 "mixed": (False, False, False, True)}[variant]
    tokens = jnp.asarray(ids.numpy(), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), tokens.shape)
    layers = tuple(range(cfg.num_layers - 1))  # what an EAGLE-3 head captures: layer outputs
    logits, captured, _, routing = policy.forward(tokens, positions, capture=layers, routing=True)
    for i in layers:  # HF's hidden_states[i + 1] is layer i's output (before the final norm)
        np.testing.assert_allclose(np.asarray(captured[i]), res.hidden_states[i + 1].numpy(),
                                   atol=1e-5, rtol=0)
    ref = res.logits.numpy()
    assert np.abs(ref).max() > 1.0  # a tolerance on O(1) logits means something
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5, rtol=0)
    # the router logits of every sparse layer, in HF's order ([B*T, E] per sparse layer)
    sparse = [i for i, s in enumerate(cfg.sparse_layers) if s]
    assert len(res.router_logits) == len(sparse)
    for layer, hf_logits in zip(sparse, res.router_logits):
        ours = np.asarray(routing["router_logits"][layer]).reshape(-1, cfg.num_experts)
        np.testing.assert_allclose(ours, hf_logits.numpy(), atol=1e-5, rtol=0)
        top = np.sort(np.argsort(-hf_logits.numpy(), axis=-1)[:, :2], axis=-1)
        np.testing.assert_array_equal(
            np.sort(np.asarray(routing["experts"][layer]).reshape(-1, 2), axis=-1), top)
    dense = [i for i, s in enumerate(cfg.sparse_layers) if not s]
    assert np.all(np.asarray(routing["experts"])[dense] == -1)


def test_decode_with_cache_matches_full_forward(hf):
    """Prefill 5 tokens, then one token at a time: the MoE block routes per token, so the
    cached decode gives the full forward's logits."""
    path, _, ids, _ = hf["mixed"]
    policy = load_hf(path, dtype="float32")
    tokens = jnp.asarray(ids.numpy(), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), tokens.shape)
    full = policy.forward(tokens, pos)[0]
    cache = policy.init_cache(2, SEQ)
    steps, cache = [], policy.forward(tokens[:, :5], pos[:, :5], cache)[2]
    for t in range(5, SEQ):
        out, _, cache = policy.forward(tokens[:, t:t + 1], pos[:, t:t + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)),
                               np.asarray(full[:, 5:]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_import_round_trip(hf, tmp_path, variant):
    """load -> save_hf (sharded) -> the tensor names and values transformers wrote, bit for
    bit; transformers loads our export and gives its logits; load_hf of it gives the params."""
    path, model, ids, res = hf[variant]
    policy = load_hf(path, dtype="float32")
    out = tmp_path / "export"
    save_hf(policy, out, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    with safe_open(str(path / "model.safetensors"), "np") as f:
        theirs = {name: f.get_tensor(name) for name in f.keys()}
    ours = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / file), "np") as f:
            ours.update({name: f.get_tensor(name) for name in f.keys()})
    assert sorted(ours) == sorted(theirs)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in ours)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(ids).logits.numpy(), res.logits.numpy())
    again = load_hf(out, dtype="float32")
    assert again.config == policy.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(policy.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _moe_config(**kw):
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=16, moe_intermediate_size=16)
    return ModelConfig.tiny("qwen3_moe", **{**base, **kw})


@pytest.mark.parametrize("backend,shared", [("ragged", 0), ("ragged", 24), ("blocked", 0)])
def test_grouped_experts_equal_dense_experts_with_gradients(backend, shared):
    """The grouped-matmul paths (tokens sorted by expert; jax.lax.ragged_dot, or blocks of one
    expert each) against every expert over every token: the same logits and the same
    gradients, with a shared expert too."""
    cfg = _moe_config(shared_expert_intermediate_size=shared, expert_backend=backend)
    ragged = random_policy(cfg, seed=3)
    dense = ragged.with_config(expert_backend="dense")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), tokens.shape)

    def loss(params, policy):
        logits = policy.replace(params=params).forward(tokens, pos)[0]
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    (lr, gr), (ld, gd) = (jax.value_and_grad(loss)(p.params, p) for p in (ragged, dense))
    np.testing.assert_allclose(float(lr), float(ld), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gd)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    expert_grad = gr["layers"]["moe"]["gate_proj"][...]
    assert np.abs(np.asarray(expert_grad)).max() > 0  # the experts learn through the grouped path


def test_gathered_and_blocked_experts_equal_dense_experts():
    """The decode-sized path (N * top-k <= E: each token's chosen experts' weights gathered)
    and the blocked grouped path under skewed routing, against every expert over every
    token, with the same routing."""
    cfg = _moe_config(num_experts=8, num_experts_per_tok=2)
    moe = random_policy(cfg, seed=5).module.layers  # stacked layers; take layer 0's MoE
    from flax import nnx

    layer_def, stacked = nnx.split(moe)
    layer = nnx.merge(layer_def, jax.tree.map(lambda a: a[0], stacked))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 32)), jnp.float32)
    _, weights, experts = layer.moe.route(x)
    np.testing.assert_allclose(np.asarray(layer.moe._gathered(x, weights, experts)),
                               np.asarray(layer.moe._dense(x, weights, experts)),
                               atol=1e-6, rtol=1e-6)
    out, _, _ = layer.moe(x[None, :3])  # 3 tokens x top-2 <= 8 experts: the gathered path
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(
        layer.moe._dense(x[:3], weights[:3], experts[:3])), atol=1e-6, rtol=1e-6)
    # the blocked path under skewed routing: every token's first choice is expert 3, and
    # 40 tokens fill several blocks of it while most experts get none
    x = jnp.asarray(np.random.default_rng(2).standard_normal((40, 32)), jnp.float32)
    _, weights, experts = layer.moe.route(x)
    experts = experts.at[:, 0].set(3).at[:, 1].set(jnp.where(experts[:, 1] == 3, 5, experts[:, 1]))
    np.testing.assert_allclose(np.asarray(layer.moe._blocked(x, weights, experts)),
                               np.asarray(layer.moe._dense(x, weights, experts)),
                               atol=1e-6, rtol=1e-6)


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def test_router_losses_against_numpy_and_transformers():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 2, 5, 8)).astype(np.float32) * 2  # [L, B, T, E]
    mask = rng.random((2, 5)) < 0.7
    sparse = (True, False, True)
    k = 2
    # NumPy reference: E * sum_e f_e P_e over the sparse layers' masked rows
    rows = logits[[0, 2]].reshape(2, -1, 8)
    m = mask.reshape(-1)
    probs = _np_softmax(rows.astype(np.float64))
    top = np.argsort(-probs, axis=-1)[..., :k]
    counts = np.zeros_like(probs)
    for layer in range(2):
        for n in range(rows.shape[1]):
            counts[layer, n, top[layer, n]] = 1
    f = (counts * m[None, :, None]).sum((0, 1)) / (2 * m.sum())
    p = (probs * m[None, :, None]).sum((0, 1)) / (2 * m.sum())
    expected = 8 * np.sum(f * p)
    got = float(load_balancing_loss(jnp.asarray(logits), k, sparse, jnp.asarray(mask)))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # transformers' own function over the same sparse layers and mask
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf_value = load_balancing_loss_func(tuple(torch.tensor(r) for r in rows), 8, k,
                                        torch.tensor(mask))
    np.testing.assert_allclose(got, float(hf_value), rtol=1e-5)
    # uniform routing probabilities give the loss's floor, top_k
    flat = float(load_balancing_loss(jnp.zeros((1, 4, 16, 8)), k, (True,)))
    np.testing.assert_allclose(flat, k, rtol=1e-6)
    # z-loss: mean of logsumexp^2 over the sparse layers' masked tokens
    lse = np.log(np.exp(rows.astype(np.float64)).sum(-1))
    z_expected = (lse**2 * m[None]).sum() / (2 * m.sum())
    z = float(router_z_loss(jnp.asarray(logits), sparse, jnp.asarray(mask)))
    np.testing.assert_allclose(z, z_expected, rtol=1e-5)


def test_routing_mismatch_counts_tokens_with_a_different_expert_set():
    a = np.zeros((2, 1, 4, 2), np.int32)
    a[..., 0], a[..., 1] = 1, 3
    b = a.copy()
    b[0, 0, 1] = [3, 1]  # the same set in another order: not a mismatch
    b[1, 0, 2] = [1, 2]  # a different set in layer 1
    b[0, 0, 3] = [0, 3]  # token 3 differs in layer 0 ...
    mask = np.array([[True, True, True, False]])  # ... but does not count
    got = routing_mismatch(jnp.asarray(a), jnp.asarray(b), (True, True), jnp.asarray(mask))
    assert float(got) == pytest.approx(1 / 3)
    only_first = routing_mismatch(jnp.asarray(a), jnp.asarray(b), (True, False), jnp.asarray(mask))
    assert float(only_first) == 0.0


@pytest.mark.parametrize("field,value,valid", [
    ("num_experts_per_tok", 9, "an int in [1, num_experts=8]"),
    ("moe_intermediate_size", 0, "an int >= 1 for family 'qwen3_moe'"),
    ("mlp_only_layers", (3,), "layer indices in [0, 2)"),
    ("expert_backend", "grouped", "one of 'ragged', 'blocked', 'dense'"),
])
def test_bad_moe_config_names_the_field(field, value, valid):
    with pytest.raises(FieldError) as e:
        _moe_config(**{field: value})
    assert e.value.field == field and valid in str(e.value)


def test_experts_need_the_moe_family():
    with pytest.raises(FieldError, match="num_experts=4 .*needs family 'qwen3_moe'"):
        ModelConfig.tiny("qwen3", num_experts=4)


def test_draft_heads_of_an_moe_policy_are_dense():
    from jaxspec.models.eagle3 import Eagle3Head
    from jaxspec.models.mtp import MTPHead

    policy = Policy.abstract(_moe_config())
    head = Eagle3Head.init_for(policy, 32, jax.random.key(0))
    assert head.config.layer.num_experts == 0 and head.config.layer.family == "llama"
    mtp = MTPHead.init_for(policy, jax.random.key(0))
    assert mtp.config.layer.family == "qwen3" and not mtp.config.layer.is_moe
