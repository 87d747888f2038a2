"""The block draft model against a PyTorch forward of DFlash's published equations, read from
a checkpoint written in the DFlash layout (the `z-lab/*-DFlash-b16` one, with DSpark's
Markov and confidence tensors); import -> export round trip exact; bad checkpoints refused."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jaxspec.models import HFCheckpointError, ModelConfig
from jaxspec.models.block import BlockHead
from jaxspec.models.block_formats import inspect_dflash, load_dflash, save_dflash
from jaxspec.models.transformer import random_policy


@pytest.fixture(scope="module")
def model():
    policy = random_policy(ModelConfig.tiny("qwen3", vocab_size=40, num_layers=4), seed=3)
    head = BlockHead.init_for(policy, jax.random.key(5), block_size=5, num_layers=2,
                              capture_layers=(0, 2, 3), markov_rank=6, confidence=True)
    rng = np.random.default_rng(0)  # every tensor random (norm scales and Markov too)
    leaves, treedef = jax.tree_util.tree_flatten(head.params)
    leaves = [jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape) if x.ndim == 1 and x.shape[0] > 1
                          else 0.1 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return policy, BlockHead(head.config, head.graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, heads, d], pos [T]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _torch_dflash(t, cfg, features, ctx_pos, embeds, block_pos, lm_head):
    """DFlash's draft forward in float64 from the checkpoint's tensors `t`: context =
    hidden_norm(fc(features)); per layer, queries of the (input-normed) block with q-norm,
    keys/values of [context; block] with k-norm, RoPE at their positions, attention over all
    of them (non-causal), o_proj, residual, SwiGLU MLP; final norm; the target's LM head."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = _rms(features @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embeds
    for i in range(cfg["num_hidden_layers"]):
        w = lambda n: t[f"layers.{i}.{n}"]  # noqa: E731
        xn = _rms(x, w("input_layernorm.weight"), eps)
        q = _rms((xn @ w("self_attn.q_proj.weight").T).view(-1, nq, d), w("self_attn.q_norm.weight"), eps)
        both = torch.cat([ctx, xn])
        k = _rms((both @ w("self_attn.k_proj.weight").T).view(-1, nkv, d), w("self_attn.k_norm.weight"), eps)
        v = (both @ w("self_attn.v_proj.weight").T).view(-1, nkv, d)
        pos = torch.cat([ctx_pos, block_pos])
        q, k = _rope(q, block_pos, theta), _rope(k, pos, theta)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(len(block_pos), nq * d)
        x = x + out @ w("self_attn.o_proj.weight").T
        xn = _rms(x, w("post_attention_layernorm.weight"), eps)
        mlp = torch.nn.functional.silu(xn @ w("mlp.gate_proj.weight").T) * (xn @ w("mlp.up_proj.weight").T)
        x = x + mlp @ w("mlp.down_proj.weight").T
    return _rms(x, t["norm.weight"], eps) @ lm_head.T


def test_logits_match_a_torch_forward_of_the_dflash_equations(model, tmp_path):
    policy, head = model
    save_dflash(head, tmp_path, num_target_layers=policy.config.num_layers)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dflash_config"] == {"block_size": 5, "mask_token_id": 39, "target_layer_ids": [0, 2, 3]}
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in load_file(tmp_path / "model.safetensors").items()}
    rng = np.random.default_rng(1)
    n_ctx, h = 7, policy.config.hidden_size
    features = rng.standard_normal((n_ctx, 3 * h)).astype(np.float32)
    block = np.array([11] + [39] * 4, np.int32)
    embeds = np.asarray(policy.embed(jnp.asarray(block[None])))[0]
    cache = head.context(jnp.asarray(features[None]), jnp.arange(n_ctx, dtype=jnp.int32)[None],
                         head.init_cache(1, 16))
    ours = head.logits(head.block(jnp.asarray(embeds[None]), jnp.arange(n_ctx, n_ctx + 5)[None], cache),
                       policy)[0]
    lm = torch.from_numpy(np.asarray(policy.params["embed_tokens"][...], np.float64))  # tied
    ref = _torch_dflash(t, cfg, torch.from_numpy(features.astype(np.float64)), torch.arange(n_ctx),
                        torch.from_numpy(embeds.astype(np.float64)), torch.arange(n_ctx, n_ctx + 5), lm)
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=2e-4, atol=2e-4)


def test_markov_and_confidence_heads_match_their_published_form(model, tmp_path):
    """DSpark: bias = markov_w2 @ markov_w1[previous] ([V, r] tensors), confidence =
    proj([hidden; markov_w1[previous]])."""
    policy, head = model
    save_dflash(head, tmp_path, num_target_layers=policy.config.num_layers)
    t = load_file(tmp_path / "model.safetensors")
    prev = np.array([3, 17])
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    np.testing.assert_allclose(np.asarray(head.markov_bias(jnp.asarray(prev))), w1[prev] @ w2.T,
                               rtol=1e-5, atol=1e-6)
    hidden = np.random.default_rng(2).standard_normal((2, policy.config.hidden_size)).astype(np.float32)
    expect = np.concatenate([hidden, w1[prev]], -1) @ t["confidence_head.proj.weight"][0] \
        + t["confidence_head.proj.bias"][0]
    np.testing.assert_allclose(np.asarray(head.confidence_logit(jnp.asarray(hidden), jnp.asarray(prev))),
                               expect, rtol=1e-5, atol=1e-5)


def test_import_export_round_trip_is_exact(model, tmp_path):
    policy, head = model
    save_dflash(head, tmp_path / "a", num_target_layers=policy.config.num_layers)
    loaded = load_dflash(tmp_path / "a")
    assert loaded.config == head.config
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_dflash(loaded, tmp_path / "b", num_target_layers=policy.config.num_layers)
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    assert inspect_dflash(tmp_path / "a", policy.config) == head.config


def test_bad_checkpoints_are_refused_by_name(model, tmp_path):
    policy, head = model
    save_dflash(head, tmp_path, num_target_layers=policy.config.num_layers)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="mask_token_id"):
        load_dflash(tmp_path)
    cfg["dflash_config"]["mask_token_id"] = 39
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"missing \['layers.2"):
        load_dflash(tmp_path)
    cfg["num_hidden_layers"] = 2
    cfg["dflash_config"]["target_layer_ids"] = [0, 2, 9]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"capture_layers \[9\] outside"):
        inspect_dflash(tmp_path, policy.config)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_dflash(tmp_path / "absent")
