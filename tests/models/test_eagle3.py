"""EAGLE-3 head: checkpoint layout vs an independent PyTorch layer, TTT vs inference drafting."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head, choose_draft_vocab, load_eagle3, save_eagle3
from jaxspec.models.hf import HFCheckpointError
from jaxspec.rl.draft import DraftLossConfig, draft_loss, ttt_logits

torch.manual_seed(0)


class TorchRMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TorchEagle3(torch.nn.Module):
    """The EAGLE-3 draft layer as the architecture describes it (written for this test):
    fc(3H->H) on target features; attention input [norm(embedding); hidden_norm(fused)];
    residual = fused; post-attention norm + SwiGLU; final norm; lm_head over the draft vocab."""

    def __init__(self, h, inter, nq, nkv, d, vd, v, eps, theta):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(3 * h, h)
        self.midlayer = torch.nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm = TorchRMSNorm(h, eps), TorchRMSNorm(h, eps)
        m.post_attention_layernorm = TorchRMSNorm(h, eps)
        m.self_attn = torch.nn.Module()
        m.self_attn.q_proj, m.self_attn.k_proj = lin(2 * h, nq * d), lin(2 * h, nkv * d)
        m.self_attn.v_proj, m.self_attn.o_proj = lin(2 * h, nkv * d), lin(nq * d, h)
        m.mlp = torch.nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj = lin(h, inter), lin(h, inter), lin(inter, h)
        self.norm = TorchRMSNorm(h, eps)
        self.lm_head = lin(h, vd)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))
        self.shape = (nq, nkv, d, theta)

    def forward(self, embeds, features):  # [B,T,H], [B,T,3H] -> logits [B,T,Vd]
        nq, nkv, d, theta = self.shape
        b, t, _ = embeds.shape
        m = self.midlayer
        hidden = self.fc(features)
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], -1)
        q = m.self_attn.q_proj(x).view(b, t, nq, d).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(b, t, nkv, d).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(b, t, nkv, d).transpose(1, 2)
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        rot = lambda z: torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = hidden + m.self_attn.o_proj(att.transpose(1, 2).reshape(b, t, nq * d))
        mlp = m.mlp
        hidden = hidden + mlp.down_proj(
            torch.nn.functional.silu(mlp.gate_proj(m.post_attention_layernorm(hidden)))
            * mlp.up_proj(m.post_attention_layernorm(hidden))
        )
        return self.lm_head(self.norm(hidden))


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("llama", rope_scaling=None), jax.random.key(0))


def _ours(head, embeds, features):
    b, t = embeds.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, _ = head.forward(embeds, features, pos, head.init_cache(b, t), fuse=True)
    return np.asarray(head.logits(out))


def _torch_for(head):
    c = head.config.layer
    return TorchEagle3(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                       head.config.draft_vocab_size, c.vocab_size, c.rms_norm_eps, c.rope_theta)


def _inputs(head, b=2, t=9, seed=1):
    rng = np.random.default_rng(seed)
    h = head.config.hidden_size
    return (rng.normal(size=(b, t, h)).astype(np.float32),
            rng.normal(size=(b, t, 3 * h)).astype(np.float32))


def _randomise_norms(head, key):
    """Non-trivial norm weights so that a swapped norm cannot pass."""
    from jaxspec.models.transformer import param_path

    def f(path, x):
        if param_path(path)[-1] == "scale":
            return x + 0.1 * jax.random.normal(jax.random.fold_in(key, len(str(path))), x.shape)
        return x
    return Eagle3Head(head.config, head.graphdef, jax.tree_util.tree_map_with_path(f, head.params), head.buffers)


def test_saved_head_loads_into_torch_reference(policy, tmp_path):
    head = _randomise_norms(Eagle3Head.init_for(policy, 48, jax.random.key(1)), jax.random.key(5))
    head = head.with_vocab(np.arange(0, 96, 2))
    save_eagle3(head, tmp_path)
    ref = _torch_for(head)
    from safetensors.torch import load_file

    missing, unexpected = ref.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    assert not missing and not unexpected
    embeds, feats = _inputs(head)
    with torch.no_grad():
        want = ref(torch.from_numpy(embeds), torch.from_numpy(feats)).numpy()
    got = _ours(head, jnp.asarray(embeds), jnp.asarray(feats))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # d2t is an offset: target id = i + d2t[i]; t2d marks exactly those ids.
    assert np.array_equal(ref.d2t.numpy() + np.arange(48), np.arange(0, 96, 2))
    assert np.array_equal(np.nonzero(ref.t2d.numpy())[0], np.arange(0, 96, 2))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 48 and cfg["num_hidden_layers"] == 1
    # vLLM reads the top-level ids (layer inputs), SGLang eagle_config's (layer outputs)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.capture_layers]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.capture_layers)


def test_torch_weights_load_into_our_head(policy, tmp_path):
    template = Eagle3Head.init_for(policy, 40, jax.random.key(2))
    save_eagle3(template, tmp_path)  # config.json in the served layout
    ref = _torch_for(template)
    ids = np.sort(np.random.default_rng(3).choice(policy.config.vocab_size, 40, replace=False))
    ref.d2t.copy_(torch.from_numpy(ids - np.arange(40)))
    ref.t2d[torch.from_numpy(ids)] = True
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    head = load_eagle3(tmp_path)
    assert np.array_equal(np.asarray(head.draft_to_target()), ids)
    embeds, feats = _inputs(head, seed=4)
    with torch.no_grad():
        want = ref(torch.from_numpy(embeds), torch.from_numpy(feats)).numpy()
    np.testing.assert_allclose(_ours(head, jnp.asarray(embeds), jnp.asarray(feats)), want, atol=2e-5, rtol=1e-5)


def test_bad_checkpoints_name_the_tensors(policy, tmp_path):
    head = Eagle3Head.init_for(policy, 32, jax.random.key(1))
    save_eagle3(head, tmp_path)
    from safetensors.numpy import load_file, save_file as save_np

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["norm.weight"]
    tensors["extra.weight"] = np.zeros(3, np.float32)
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]
    save_np(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"norm\.weight.*extra\.weight.*fc\.weight"):
        load_eagle3(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle3(tmp_path / "nope")


def test_head_must_match_the_policy(policy):
    other = Policy.init(ModelConfig.tiny("llama", vocab_size=96), jax.random.key(0))
    head = Eagle3Head.init_for(other, 32, jax.random.key(1))
    with pytest.raises(ValueError, match="vocab_size 96 != policy's 128"):
        head.check_compatible(policy)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Head.init_for(policy, 129, jax.random.key(1))


def test_choose_draft_vocab_takes_most_frequent_sorted():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    assert choose_draft_vocab(counts, 4).tolist() == [0, 2, 3, 5]
    assert choose_draft_vocab(counts, 6).tolist() == [0, 2, 3, 4, 5, 7]


def test_training_time_test_matches_inference_drafting(policy):
    """TTT step s at position t must be exactly what the head computes at inference when it
    drafts s tokens past t (observe f_0..f_t, then feed its own outputs), given the true
    tokens as drafts. Otherwise draft training optimises a different function."""
    head = _randomise_norms(Eagle3Head.init_for(policy, 128, jax.random.key(3)), jax.random.key(4))
    b, t, steps = 2, 10, 3
    tokens = jax.random.randint(jax.random.key(6), (b, t), 0, 128)
    feats = jax.random.normal(jax.random.key(7), (b, t, 3 * policy.config.hidden_size))
    got = jax.jit(lambda f, tok: ttt_logits(head, head.params, policy.embed, f, tok, jnp.ones((b, t), bool),
                                            steps))(feats, tokens)
    # the inference path jitted per call (same ops; eager op-by-op dispatch was most of the time)
    @functools.partial(jax.jit, static_argnames="fuse")
    def forward(tok, h, pos, cache, fuse):  # -> hidden [b, n, H], last logits [b, V], cache
        out, cache = head.forward(policy.embed(tok), h, pos, cache, fuse=fuse)
        return out, head.logits(out[:, -1:])[:, 0], cache

    for pos in (0, 3, 6):
        cache = head.init_cache(b, t + steps)
        positions = jnp.broadcast_to(jnp.arange(pos + 1, dtype=jnp.int32), (b, pos + 1))
        out, logits, cache = forward(tokens[:, 1 : pos + 2], feats[:, : pos + 1], positions, cache, fuse=True)
        hidden = out[:, -1:]
        np.testing.assert_allclose(logits, got[0, :, pos], atol=2e-5)
        for s in range(1, steps):
            hidden, logits, cache = forward(tokens[:, pos + 1 + s][:, None], hidden, jnp.full((b, 1), pos + s, jnp.int32),
                                            cache, fuse=False)
            np.testing.assert_allclose(logits, got[s, :, pos], atol=2e-5)


def test_draft_loss_is_soft_cross_entropy_on_the_draft_vocab(policy):
    """Step-0 loss equals a numpy soft cross-entropy over the restricted target distribution,
    masked where the target argmax leaves the draft vocab or the token is not a response."""
    head = Eagle3Head.init_for(policy, 64, jax.random.key(3)).with_vocab(np.arange(64) * 2)
    b, t = 2, 8
    tokens = jax.random.randint(jax.random.key(6), (b, t), 0, 128)
    feats = jax.random.normal(jax.random.key(7), (b, t, 3 * policy.config.hidden_size))
    tl = 3 * jax.random.normal(jax.random.key(8), (b, t, 128))
    mask = jnp.arange(t)[None, :] >= jnp.array([[3], [1]])
    cfg = DraftLossConfig(steps=2, decay=0.8)
    loss, metrics, logits = jax.jit(lambda f, tok, tl, m: (
        *draft_loss(head, head.params, policy.embed, f, tok, tl, m, cfg),
        ttt_logits(head, head.params, policy.embed, f, tok, jnp.ones((b, t), bool), 2)))(feats, tokens, tl, mask)
    logits = np.asarray(logits)
    ids, tl, mask = np.arange(64) * 2, np.asarray(tl, np.float64), np.asarray(mask)
    total = 0.0
    for s in range(2):
        ces, n = [], 0
        for bi in range(b):
            for ti in range(t - s - 2):
                src = ti + 1 + s  # target distribution of token ti+2+s
                if not mask[bi, ti + 2 + s] or tl[bi, src].argmax() % 2:
                    continue
                p = np.exp(tl[bi, src, ids] - tl[bi, src, ids].max())
                p /= p.sum()
                lq = logits[s, bi, ti] - np.log(np.exp(logits[s, bi, ti] - logits[s, bi, ti].max()).sum()) - logits[s, bi, ti].max()
                ces.append(-(p * lq).sum())
        want = np.mean(ces)
        np.testing.assert_allclose(float(metrics[f"draft_loss_{s}"]), want, rtol=1e-5)
        total += 0.8**s * want
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)
