"""Qwen3.5 / Qwen3-Next's MTP head (jaxspec.models.hybrid_mtp) against a plain-NumPy float64
MTP forward written here from vLLM's / SGLang's Qwen3-Next and Qwen3.5 MTP models
(qwen3_next_mtp.py, qwen3_5_mtp.py): it reads the exported `mtp.*` tensors by their HF
names, so it checks the checkpoint layout too. Also: the `mtp.*` round trip (bit for bit),
load_mtp's dispatch, chain drafting against the reference run recursively, and the MTP
training unroll against the drafter."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxspec.decoding.protocols import DraftContext, Observation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import ModelConfig, load_hf
from jaxspec.models.hybrid import random_hybrid_policy
from jaxspec.models.hybrid_mtp import (
    HybridMTPDrafter,
    HybridMTPHead,
    load_hybrid_mtp,
    save_hybrid_mtp,
)
from jaxspec.models.mtp import load_mtp
from jaxspec.models.transformer import param_path

FAMILIES = ["qwen3_5", "qwen3_next"]  # dense MLP / MoE with a gated shared expert


def _policy(family, dtype="float32", seed=0):
    cfg = ModelConfig.tiny(family, num_layers=3, dtype=dtype,
                           layer_types=("linear_attention", "full_attention", "linear_attention"))
    return random_hybrid_policy(cfg, seed=seed)


def _random_head(policy, seed=1):
    """O(1) weights drawn with NumPy by name: ~1/sqrt(fan_in) matrices, norms 0.3 N(0,1)."""
    head = HybridMTPHead.init_for(policy, jax.random.key(0))
    rng = np.random.default_rng(seed)

    def draw(kp, x):
        name = "/".join(param_path(kp))
        noise = rng.standard_normal(x.shape).astype(np.float32)
        if name.endswith("scale"):
            return jnp.asarray(0.3 * noise, x.dtype)
        fan_in = {"o_proj": x.shape[0] * x.shape[1]}.get(name.rsplit("/", 1)[-1], x.shape[-2])
        return jnp.asarray(noise / np.sqrt(fan_in), x.dtype)
    return dataclasses.replace(head, params=jax.tree_util.tree_map_with_path(draw, head.params))


# ----------------------------------------------------------------------------- reference
# float64; `w` maps HF tensor names (mtp.*) to arrays, `lm_head` is [V, H].

def _norm(x, w, eps):  # zero-centred RMSNorm: x / rms(x) * (1 + w)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, pos, rotary, theta):  # x [T, n, d]: the first `rotary` dims rotated (rotate_half)
    inv = 1.0 / theta ** (np.arange(0, rotary, 2) / rotary)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    r, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rot = np.concatenate([-r[..., half:], r[..., :half]], -1)
    return np.concatenate([r * cos[:, None] + rot * sin[:, None], rest], -1)


def _swiglu(x, pre, w):
    gate, up = x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ w[pre + "down_proj.weight"].T


def _moe(x, w, cfg):  # Qwen3-Next's sparse block: top-k of softmax, renormed; gated shared expert
    pre = "mtp.layers.0.mlp."
    probs = np.exp(x @ w[pre + "gate.weight"].T)
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        top = np.argsort(-probs[i])[:cfg.num_experts_per_tok]
        weights = probs[i, top] / (probs[i, top].sum() if cfg.norm_topk_prob else 1.0)
        for e, p in zip(top, weights):
            out[i] += p * _swiglu(x[i:i + 1], f"{pre}experts.{e}.", w)[0]
    gate = 1 / (1 + np.exp(-(x @ w[pre + "shared_expert_gate.weight"].T)))
    return out + gate * _swiglu(x, pre + "shared_expert.", w)


def reference_mtp(w, lm_head, cfg, embeds, hidden, positions, *, swap=False, centred=True):
    """One sequence [T] of MTP entries, causal: entry i reads (embedding of the token after i,
    the trunk's final-normed hidden at i) at RoPE position positions[i]. Returns (the head's
    normed outputs [T, H], logits [T, V]). swap / centred=False: the negative controls."""
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    nq, nkv = cfg.num_heads, cfg.num_kv_heads

    def norm(x, name):
        return _norm(x, w[name], eps) if centred else _norm(x, w[name] - 1.0, eps)
    e = norm(embeds, "mtp.pre_fc_norm_embedding.weight")
    h = norm(hidden, "mtp.pre_fc_norm_hidden.weight")
    x = np.concatenate([h, e] if swap else [e, h], -1) @ w["mtp.fc.weight"].T
    pre = "mtp.layers.0."
    a = norm(x, pre + "input_layernorm.weight")
    t = x.shape[0]
    qg = (a @ w[pre + "self_attn.q_proj.weight"].T).reshape(t, nq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (a @ w[pre + "self_attn.k_proj.weight"].T).reshape(t, nkv, d)
    v = (a @ w[pre + "self_attn.v_proj.weight"].T).reshape(t, nkv, d)
    q = _rope(norm(q, pre + "self_attn.q_norm.weight"), positions, cfg.rotary_dim, cfg.rope_theta)
    k = _rope(norm(k, pre + "self_attn.k_norm.weight"), positions, cfg.rotary_dim, cfg.rope_theta)
    group = nq // nkv
    heads = np.zeros((t, nq, d))
    for n in range(nq):
        s = q[:, n] @ k[:, n // group].T / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        heads[:, n] = (p / p.sum(-1, keepdims=True)) @ v[:, n // group]
    heads = heads / (1 + np.exp(-gate))
    x = x + heads.reshape(t, nq * d) @ w[pre + "self_attn.o_proj.weight"].T
    m = norm(x, pre + "post_attention_layernorm.weight")
    x = x + (_moe(m, w, cfg) if cfg.num_experts else _swiglu(m, pre + "mlp.", w))
    out = norm(x, "mtp.norm.weight")
    return out, out @ lm_head.T


def _exported(head, tmp_path):
    """The head's mtp.* tensors as written by save_hybrid_mtp, in float64."""
    save_hybrid_mtp(head, tmp_path)
    return {n: np.asarray(a, np.float64) for n, a in load_file(tmp_path / "model.safetensors").items()}


def _lm_head(policy):
    p = policy.params
    w = p["embed_tokens"][...] if policy.config.tie_embeddings else p["lm_head"][...].T
    return np.asarray(w, np.float64)


@pytest.mark.parametrize("family,dtype,tol", [("qwen3_5", "float32", 1e-5),
                                              ("qwen3_next", "float32", 1e-5),
                                              ("qwen3_5", "bfloat16", 3e-2)])
def test_forward_matches_the_numpy_reference(family, dtype, tol, tmp_path):
    """float32 within 1e-5 of the largest logit (measured 5e-7); bfloat16 weights and
    activations within 3e-2 (measured 9e-3) of the float64 reference on the same weights."""
    policy = _policy(family, dtype=dtype)
    head = _random_head(policy)
    cfg = policy.config
    t = 7
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
    hidden = rng.standard_normal((1, t, cfg.hidden_size)).astype(np.float32)
    positions = np.arange(3, 3 + t, dtype=np.int32)[None]  # not starting at 0: RoPE matters
    out, cache = jax.jit(lambda e, h, p, c: head.forward(e, h, p, c, fuse=True))(
        policy.embed(tokens), hidden, positions, head.init_cache(1, 16))
    logits, ids = head.draft_logits(out, policy)
    assert ids is None and logits.dtype == jnp.float32
    w = _exported(head.astype("float32"), tmp_path)  # bf16 -> float32 is exact
    embeds = np.asarray(policy.embed(tokens).astype(jnp.float32), np.float64)[0]
    want_out, want_logits = reference_mtp(w, _lm_head(policy), cfg, embeds,
                                          hidden[0].astype(np.float64), positions[0])
    scale = np.abs(want_logits).max()
    assert scale > 1.0  # logits of order 1-10: a tolerance means something
    np.testing.assert_allclose(np.asarray(out[0], np.float64), want_out,
                               atol=tol * np.abs(want_out).max())
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits, atol=tol * scale)
    assert np.asarray(cache.lengths).tolist() == [t]
    if dtype != "float32":
        return
    # negative controls: the other concat order, or norms scaling by w instead of 1 + w
    for control in (dict(swap=True), dict(centred=False)):
        _, wrong = reference_mtp(w, _lm_head(policy), cfg, embeds, hidden[0].astype(np.float64),
                                 positions[0], **control)
        assert np.abs(wrong - np.asarray(logits[0])).max() > 100 * 1e-5 * scale, control


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_split_and_padding_match_one_forward(family):
    """Entries fed in two parts through the cache (with padding) equal one causal forward."""
    policy = _policy(family)
    head = _random_head(policy)
    rng = np.random.default_rng(3)
    b, t, h = 2, 6, policy.config.hidden_size
    tokens = rng.integers(0, policy.config.vocab_size, (b, t)).astype(np.int32)
    hidden = rng.standard_normal((b, t, h)).astype(np.float32)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    fwd = jax.jit(lambda tok, hh, p, c: head.forward(policy.embed(tok), hh, p, c, fuse=True))
    whole, _ = fwd(tokens, hidden, pos, head.init_cache(b, 16))
    # part one: row 0 takes 4 entries, row 1 takes 2 then padding
    p1 = np.array([[0, 1, 2, 3], [0, 1, -1, -1]], np.int32)
    first, cache = fwd(tokens[:, :4], hidden[:, :4], p1, head.init_cache(b, 16))
    idx = np.array([[4, 5, 5, 5], [2, 3, 4, 5]])
    p2 = np.array([[4, 5, -1, -1], [2, 3, 4, 5]], np.int32)
    second, cache = fwd(np.take_along_axis(tokens, idx, 1),
                        np.take_along_axis(hidden, idx[..., None], 1), p2, cache)
    np.testing.assert_allclose(first[0], whole[0, :4], atol=1e-5)
    np.testing.assert_allclose(first[1, :2], whole[1, :2], atol=1e-5)
    np.testing.assert_allclose(second[0, :2], whole[0, 4:], atol=1e-5)
    np.testing.assert_allclose(second[1], whole[1, 2:], atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [6, 6]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_policy", [False, True])
def test_export_import_round_trip_is_bit_exact(family, with_policy, tmp_path):
    policy = _policy(family, dtype="bfloat16")
    head = _random_head(policy)
    save_hybrid_mtp(head, tmp_path, policy=policy if with_policy else None)
    for loaded in (load_hybrid_mtp(tmp_path), load_mtp(tmp_path)):  # load_mtp dispatches
        assert isinstance(loaded, HybridMTPHead) and loaded.config == head.config
        for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(loaded.params), strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    if with_policy:  # the trunk reads back too (load_hf skips mtp.*), bit for bit
        trunk = load_hf(tmp_path)
        for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(trunk.params), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_whole_export_is_read_by_transformers(tmp_path):
    """save_hybrid_mtp(policy=...) writes the checkpoint as the released models ship it:
    transformers' Qwen3_5ForCausalLM reads the trunk (skipping mtp.*) and gives our logits;
    the trainer's generic entry points (MTPHead.init_for, save_mtp) reach this head."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxspec.models.mtp import MTPHead, save_mtp

    policy = _policy("qwen3_5")
    head = MTPHead.init_for(policy, jax.random.key(1))
    assert isinstance(head, HybridMTPHead)
    head = _random_head(policy)
    save_mtp(head, tmp_path, policy=policy)  # the trainer's default (kinds._save_mtp)
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(7).integers(0, policy.config.vocab_size, (2, 6))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got, _, _ = policy.forward(tokens, np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max())
    loaded = load_mtp(tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(head.params),
                                                     jax.tree.leaves(loaded.params), strict=True))


def test_export_names_and_shapes_are_the_checkpoint_layout(tmp_path):
    """The names vLLM / SGLang read, in HF's [out, in] layout; MoE only for qwen3_next."""
    dense = _exported(_random_head(_policy("qwen3_5")), tmp_path / "a")
    moe = _exported(_random_head(_policy("qwen3_next")), tmp_path / "b")
    h = 64
    assert dense["mtp.fc.weight"].shape == (h, 2 * h)
    assert dense["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * 4 * 16, h)  # [q | gate]
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(dense)
    assert not any(".experts." in n for n in dense)
    assert moe["mtp.layers.0.mlp.experts.7.gate_proj.weight"].shape == (32, h)
    assert moe["mtp.layers.0.mlp.shared_expert_gate.weight"].shape == (1, h)
    assert not any(n.startswith(("model.", "lm_head")) for n in dense | moe)


def test_load_refuses_a_mismatched_checkpoint(tmp_path):
    from safetensors.numpy import save_file

    from jaxspec.models.hf import HFCheckpointError

    head = _random_head(_policy("qwen3_5"))
    save_hybrid_mtp(head, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mtp.fc.weight"]
    tensors["mtp.layers.0.mlp.experts.0.up_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"missing \['mtp.fc.weight'\].*unexpected"):
        load_hybrid_mtp(tmp_path)


# ----------------------------------------------------------------------------- drafting


@pytest.mark.parametrize("family,dtype", [("qwen3_5", "float32"), ("qwen3_next", "float32"),
                                          ("qwen3_5", "bfloat16")])
def test_chain_drafts_are_the_reference_run_recursively(family, dtype, tmp_path):
    """HybridMTPDrafter after a prompt prefill proposes k argmax drafts; the reference gets
    the policy's final-normed hidden states and feeds its own normed output back, one entry
    per draft at the next position, attending to everything before it."""
    policy = _policy(family, dtype=dtype)
    head = _random_head(policy)
    cfg = policy.config
    k, p = 3, 5
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, p)).astype(np.int32)
    pos = np.arange(p, dtype=np.int32)[None]
    final, captured, _ = policy.forward(prompt, pos, capture=(cfg.num_layers - 1,), head=False)
    drafter = HybridMTPDrafter(head, k=k, coupled=False)
    drafter.check_compatible(policy)
    # the prefill's observation: entry j is prompt token j followed by prompt token j+1
    obs = Observation(fed_tokens=prompt[:, :-1], next_tokens=prompt[:, 1:], positions=pos[:, :-1],
                      captured={cfg.num_layers - 1: captured[cfg.num_layers - 1][:, :-1]})
    state = drafter.init_state(policy, 1, 32)
    state = drafter.observe(state, policy, obs)
    buffer = np.zeros((1, 32), np.int32)
    buffer[0, :p] = prompt[0]
    ctx = DraftContext(buffer=jnp.asarray(buffer), lengths=jnp.array([p], jnp.int32),
                       key=jax.random.key(0), sampling=SamplingConfig(1.0, 0, 1.0), sampled=False)
    tree, probs, _ = drafter.propose(state, policy, ctx)
    assert probs is None
    got = np.asarray(tree.tokens[0]).tolist()
    # negative control: MTPDrafter's observe (the captured layer as it is, not final-normed)
    # starts the chain from another state
    from jaxspec.decoding.heads import MTPDrafter

    plain = MTPDrafter(head, k=k, coupled=False)
    other = plain.observe(plain.init_state(policy, 1, 32), policy, obs)
    assert np.abs(np.asarray(other.last_hidden) - np.asarray(state.last_hidden)).max() > 0.05

    w = _exported(head.astype("float32"), tmp_path)
    ref_cfg = cfg.replace(dtype="float32")
    embed = np.asarray(policy.params["embed_tokens"][...], np.float64)
    lm = _lm_head(policy)
    # entries: (hidden at i, token i+1) at position i for i < p-1 (the observation), then
    # the drafts: (hidden of the last entry, its draft) at positions p-1, p, ...
    hiddens = list(np.asarray(final[0, :p - 1], np.float64))
    tokens = list(prompt[0, 1:])
    want = []
    hidden_last = None
    for i in range(k):
        if i == 0:
            hs, ts = hiddens, tokens
        else:
            hs, ts = hs + [hidden_last], ts + [want[-1]]
        out, logits = reference_mtp(w, lm, ref_cfg, embed[np.array(ts)], np.array(hs),
                                    np.arange(len(ts)))
        # draft i comes from the last entry's output (i = 0: the observed prefix's last)
        hidden_last = out[-1]
        want.append(int(np.argmax(logits[-1])))
    if dtype == "float32":
        assert got == want
    else:  # bf16 drafts agree with the float64 reference where its top-2 margin is clear
        assert got[0] == want[0]


@pytest.mark.parametrize("method", ["replay", "rejection"])
def test_generate_with_the_drafter_is_the_plain_rollout(method):
    """generate(drafter=HybridMTPDrafter) on a hybrid policy: under replay token for token the
    plain rollout (with the same key), and drafts were accepted; rejection runs too."""
    from jaxspec.decoding import SamplingConfig, generate

    policy = _policy("qwen3_5")
    prompts = np.random.default_rng(8).integers(0, policy.config.vocab_size, (2, 5))
    kw = dict(sampling=SamplingConfig(1.0, 0, 1.0), max_new_tokens=12, key=jax.random.key(0),
              method=method)
    spec = generate(policy, prompts, drafter=HybridMTPDrafter(_random_head(policy), k=3), **kw)
    assert int(np.sum(spec.stats.accepted_at)) > 0
    if method == "replay":
        plain = generate(policy, prompts, **kw)
        np.testing.assert_array_equal(spec.tokens, plain.tokens)
        np.testing.assert_array_equal(spec.lengths, plain.lengths)


def test_the_trainers_mtp_kind_drafts_with_it():
    """draft.kind mtp (rl.kinds) builds HybridMTPDrafter for this head, MTPDrafter otherwise."""
    import types

    from jaxspec.decoding.heads import MTPDrafter
    from jaxspec.models.mtp import MTPHead
    from jaxspec.models.transformer import random_policy
    from jaxspec.rl.kinds import KINDS

    spec = types.SimpleNamespace(k=2, coupled=True)
    hybrid = KINDS["mtp"].make_drafter(spec, None, head=_random_head(_policy("qwen3_5")))
    assert type(hybrid) is HybridMTPDrafter and hybrid.k == 2
    dense = MTPHead.init_for(random_policy(ModelConfig.tiny("qwen3")), jax.random.key(0))
    assert type(KINDS["mtp"].make_drafter(spec, None, head=dense)) is MTPDrafter


def test_head_refuses_a_mismatched_policy():
    head = _random_head(_policy("qwen3_5"))
    other = _policy("qwen3_5").config.replace(vocab_size=96)
    with pytest.raises(ValueError, match="vocab_size 128 != policy's 96"):
        head.check_compatible(random_hybrid_policy(other))


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("family", FAMILIES)
def test_training_unroll_is_what_the_drafter_computes(family):
    """rl.draft.mtp_hidden (the in-loop MTP loss's unroll) with this head: step s at
    position t equals the head fed as the drafter feeds it (normed outputs chained)."""
    from jaxspec.rl.draft import mtp_hidden

    policy = _policy(family)
    head = _random_head(policy)
    rng = np.random.default_rng(5)
    b, t, h, steps = 1, 10, policy.config.hidden_size, 3
    tokens = rng.integers(0, policy.config.vocab_size, (b, t)).astype(np.int32)
    positions = np.arange(t, dtype=np.int32)[None]
    features = rng.standard_normal((b, t, h)).astype(np.float32)
    unrolled = jax.jit(lambda f: mtp_hidden(head, head.params, policy.embed, f, jnp.asarray(tokens),
                                            jnp.asarray(positions), steps))(features)
    fwd = jax.jit(lambda tok, hh, p, c: head.forward(policy.embed(tok), hh, p, c, fuse=False))
    for at in (0, 3, 5):
        out, cache = fwd(tokens[:, 1:at + 2], features[:, :at + 1], positions[:, :at + 1],
                         head.init_cache(1, 16))
        hidden = out[:, -1:]
        np.testing.assert_allclose(hidden[0, 0], unrolled[0][0, at], atol=1e-5)
        for s in range(1, steps):
            hidden, cache = fwd(tokens[:, at + 1 + s:at + 2 + s], hidden,
                                jnp.array([[at + s]], jnp.int32), cache)
            np.testing.assert_allclose(hidden[0, 0], unrolled[s][0, at], atol=1e-5)


def test_the_in_loop_update_trains_it_on_the_policys_final_normed_states(tmp_path):
    """The trainer's path as it is (rl.steps.score_rollouts with the head's capture layers,
    then rl.steps.mtp_update): the head reads score_rollouts' target_hidden (final-normed),
    not its captured `features`; the step-0 loss is the NumPy reference's cross-entropy on
    token t+2 at response positions; a few Adam updates lower it."""
    import optax

    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.rl.draft import DraftLossConfig, TargetHead, mtp_loss
    from jaxspec.rl.steps import mtp_update, score_rollouts

    policy = _policy("qwen3_5")
    head = _random_head(policy)
    cfg = policy.config
    rng = np.random.default_rng(6)
    prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 4)), jnp.int32)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 8)), jnp.int32)
    scored = score_rollouts(policy, None, prompts, jnp.array([4, 3], jnp.int32), tokens,
                            jnp.array([8, 6], jnp.int32), jnp.zeros((2, 8)),
                            SamplingConfig(1.0, 0, 1.0), capture=head.capture_layers)
    target = TargetHead(scored["target_hidden"], policy.params["lm_head"][...], vocab_axis=1)
    garbage = jnp.full(scored["features"].shape, 1e3)  # `features` is not read by this head
    loss, _ = mtp_loss(head, head.params, policy.embed, garbage, scored["tokens"],
                       scored["positions"], scored["response"], target, steps=1)

    w = _exported(head, tmp_path)
    embed, lm = np.asarray(policy.params["embed_tokens"][...], np.float64), _lm_head(policy)
    terms = []
    for r in range(2):
        n = int(np.sum(np.asarray(scored["positions"][r]) >= 0))  # prompt + rollout
        seq = np.asarray(scored["tokens"][r, :n])
        hidden = np.asarray(scored["target_hidden"][r, :n - 1], np.float64)
        _, logits = reference_mtp(w, lm, cfg, embed[seq[1:]], hidden, np.arange(n - 1))
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        response = np.asarray(scored["response"][r])
        terms += [-logp[i, seq[i + 2]] for i in range(n - 2) if response[i + 2]]
    assert len(terms) == 8 + 6  # every rollout token (each has an entry two before it)
    assert float(loss) == pytest.approx(np.mean(terms), rel=1e-5)

    opt = optax.adam(3e-2)
    state, losses = opt.init(head.params), []
    for _ in range(5):
        head, state, metrics = mtp_update(head, state, policy, scored, optimizer=opt,
                                          loss_cfg=DraftLossConfig(steps=2))
        losses.append(float(metrics["draft_loss"]))
    assert losses[-1] < 0.2 * losses[0]
