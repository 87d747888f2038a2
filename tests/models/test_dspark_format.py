"""The DSpark checkpoint layout (DeepSpec's `Qwen3DSparkModel`, which DeepSpec, SGLang and vLLM
read) against an independent reader written from DeepSpec's
deepspec/modeling/dspark/qwen3/{config,modeling}.py and eval/dspark/draft_ops.py: every config
key and tensor name, and a PyTorch forward of its draft block (slot i drafts the token i + 1
after the anchor, the anchor's slot included); a DeepSpec-layout checkpoint imports and drafts
as that forward does; DFlash's default captured layers are strictly increasing."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxspec.models import HFCheckpointError, ModelConfig
from jaxspec.models.block import BlockHead, default_block_layers
from jaxspec.models.block_formats import load_dflash, save_block, save_dflash, save_dspark
from jaxspec.models.hf import config_to_hf
from jaxspec.models.transformer import random_policy

V, BLOCK, MASK = 40, 5, 39

# ----------------------------------------------------------------------------- the reader


def read_deepspec(directory):
    """(config, {name: float64 tensor}) as Qwen3DSparkModel(config) + load_state_dict would
    take them: the fields its __init__ asserts, build_draft_config's target_layer_ids rule
    (-1 or a layer in [0, L - 1], strictly increasing), and exactly the tensors its modules
    own (embed_tokens, layers.*, norm, fc, hidden_norm, lm_head, markov_head.*,
    confidence_head.proj.*; the rotary buffer is not persistent)."""
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    for field in ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
                  "markov_rank", "block_size", "num_target_layers"):
        assert field in cfg, field
    r = int(cfg["markov_rank"])
    if r > 0:
        assert cfg["markov_head_type"] == "vanilla"
    with_markov = False
    if cfg["enable_confidence_head"]:
        with_markov = bool(cfg["confidence_head_with_markov"])
        assert not with_markov or r > 0
    ids = [int(i) for i in cfg["target_layer_ids"]]
    assert ids and all(i == -1 or 0 <= i < cfg["num_target_layers"] for i in ids)
    assert all(b > a for a, b in zip(ids, ids[1:])), "strictly increasing"
    assert cfg["tie_word_embeddings"] is False
    h, nq, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter, vocab = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"embed_tokens.weight": (vocab, h), "norm.weight": (h,),
              "fc.weight": (h, len(ids) * h), "hidden_norm.weight": (h,),
              "lm_head.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
        if cfg.get("attention_bias"):
            shapes.update({p + f"self_attn.{x}_proj.bias": (n * d,)
                           for x, n in (("q", nq), ("k", nkv), ("v", nkv))})
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    if r > 0:  # nn.Embedding(V, r) and nn.Linear(r, V)
        shapes.update({"markov_head.markov_w1.weight": (vocab, r),
                       "markov_head.markov_w2.weight": (vocab, r)})
    if cfg["enable_confidence_head"]:  # AcceptRatePredictor: nn.Linear(H [+ r], 1)
        shapes.update({"confidence_head.proj.weight": (1, h + (r if with_markov else 0)),
                       "confidence_head.proj.bias": (1,)})
    tensors = load_file(directory / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    return cfg, {k: torch.from_numpy(v.astype(np.float64)) for k, v in tensors.items()}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, heads, d], pos [T]; rotate_half
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def deepspec_propose(cfg, t, target_hidden, anchor):
    """DSpark's greedy proposal (temperature 0) for a context of target features [C, n H] at
    positions 0 .. C - 1 and the anchor at position C: the block [anchor, mask x (B - 1)]
    embedded by the model's embed_tokens; context = hidden_norm(fc(features)); each layer's
    keys/values over [context; input-normed block] with k-norm, queries with q-norm, RoPE,
    attention over all of them; the final norm; lm_head; slot i's logits plus the Markov bias
    of the token before it (the anchor for slot 0) draft token i + 1; the confidence head
    reads [hidden; markov_w1[previous]] (with_markov). -> (tokens [B], logits [B, V],
    confidence logits [B] or None)."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nq, nkv, d, b = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["block_size"]
    c = target_hidden.shape[0]
    ids = torch.tensor([anchor] + [cfg["mask_token_id"]] * (b - 1))
    x = t["embed_tokens.weight"][ids]
    ctx = _rms(target_hidden @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    q_pos, kv_pos = torch.arange(c, c + b), torch.arange(c + b)
    for i in range(cfg["num_hidden_layers"]):
        w = lambda n: t[f"layers.{i}.{n}"]  # noqa: E731
        xn = _rms(x, w("input_layernorm.weight"), eps)
        q = _rms((xn @ w("self_attn.q_proj.weight").T).view(b, nq, d), w("self_attn.q_norm.weight"), eps)
        both = torch.cat([ctx, xn])
        k = _rms((both @ w("self_attn.k_proj.weight").T).view(-1, nkv, d), w("self_attn.k_norm.weight"), eps)
        v = (both @ w("self_attn.v_proj.weight").T).view(-1, nkv, d)
        q, k = _rope(q, q_pos, theta), _rope(k, kv_pos, theta)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(b, nq * d) @ w("self_attn.o_proj.weight").T
        xn = _rms(x, w("post_attention_layernorm.weight"), eps)
        x = x + (torch.nn.functional.silu(xn @ w("mlp.gate_proj.weight").T)
                 * (xn @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
    hidden = _rms(x, t["norm.weight"], eps)
    base = hidden @ t["lm_head.weight"].T
    r = cfg["markov_rank"]
    tokens, logits, previous = [], [], [anchor]
    for i in range(b):
        step = base[i]
        if r:
            step = step + t["markov_head.markov_w1.weight"][previous[-1]] @ t["markov_head.markov_w2.weight"].T
        logits.append(step)
        tokens.append(int(torch.argmax(step)))
        previous.append(tokens[-1])
    confidence = None
    if cfg["enable_confidence_head"]:
        feats = hidden
        if cfg["confidence_head_with_markov"]:
            feats = torch.cat([hidden, t["markov_head.markov_w1.weight"][torch.tensor(previous[:-1])]], -1)
        confidence = feats @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0]
    return tokens, torch.stack(logits), confidence


# ----------------------------------------------------------------------------- ours


@pytest.fixture(scope="module")
def policy():
    return random_policy(ModelConfig.tiny("qwen3", vocab_size=V, num_layers=4), seed=3)


def _randomized(head, seed=0):
    rng = np.random.default_rng(seed)  # every tensor random (norm scales and Markov too)
    leaves, treedef = jax.tree_util.tree_flatten(head.params)
    leaves = [jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape) if x.ndim == 1 and x.shape[0] > 1
                          else 0.1 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return BlockHead(head.config, head.graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


def _ours(head, policy, features, anchor, previous):
    """Our head's chain logits (Markov bias from `previous`) and confidence logits at the
    block_size - 1 drafted positions."""
    c = features.shape[0]
    cache = head.context(jnp.asarray(features[None], jnp.float32), jnp.arange(c, dtype=jnp.int32)[None],
                         head.init_cache(1, 16))
    block = jnp.asarray([[anchor] + [MASK] * (BLOCK - 1)], jnp.int32)
    hidden = head.drafted(head.block(policy.embed(block), jnp.arange(c, c + BLOCK)[None], cache))[0]
    prev = jnp.asarray(previous, jnp.int32)
    logits = head.logits(hidden, policy) + head.markov_bias(prev)
    conf = head.confidence_logit(hidden, prev) if head.config.confidence else None
    return np.asarray(logits), None if conf is None else np.asarray(conf)


def test_export_reads_in_deepspecs_layout_and_drafts_as_its_forward(policy, tmp_path):
    head = _randomized(BlockHead.init_for(policy, jax.random.key(5), block_size=BLOCK, num_layers=2,
                                          capture_layers=(0, 1, 2), markov_rank=6, confidence=True,
                                          sample_from_anchor=True))
    save_dspark(head, tmp_path, policy=policy, num_anchors=64)
    cfg, t = read_deepspec(tmp_path)
    assert (cfg["target_layer_ids"], cfg["mask_token_id"], cfg["num_anchors"], cfg["block_size"],
            cfg["num_target_layers"], cfg["markov_rank"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"]) == ([0, 1, 2], MASK, 64, BLOCK, 4, 6, True, True)
    embed = np.asarray(policy.params["embed_tokens"][...], np.float64)  # tied: the LM head too
    np.testing.assert_array_equal(t["embed_tokens.weight"].numpy(), embed)
    np.testing.assert_array_equal(t["lm_head.weight"].numpy(), embed)
    features = np.random.default_rng(1).standard_normal((7, 3 * policy.config.hidden_size))
    tokens, ref_logits, ref_conf = deepspec_propose(cfg, t, torch.from_numpy(features), anchor=11)
    previous = [11] + tokens[:BLOCK - 2]
    logits, conf = _ours(head, policy, features, 11, previous)
    np.testing.assert_allclose(logits, ref_logits[:BLOCK - 1].numpy(), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(conf, ref_conf[:BLOCK - 1].numpy(), rtol=2e-4, atol=2e-4)
    assert list(np.argmax(logits, -1)) == tokens[:BLOCK - 1]
    # negative control: the same weights read with DFlash's slots draft something else
    dflash = BlockHead(dataclasses.replace(head.config, sample_from_anchor=False), head.graphdef,
                       head.params)
    shifted, _ = _ours(dflash, policy, features, 11, previous)
    assert np.abs(shifted - ref_logits[:BLOCK - 1].numpy()).max() > 1e-2


def _deepspec_checkpoint(directory, policy, *, markov_rank, with_markov, seed=7):
    """A checkpoint as DeepSpec's trainer saves one, written from the reader's spec alone:
    build_draft_config's fields on the target's config, every tensor random."""
    cfg = config_to_hf(policy.config)
    cfg.update(architectures=["Qwen3DSparkModel"], num_target_layers=4, num_hidden_layers=1,
               block_size=BLOCK, tie_word_embeddings=False, layer_types=["full_attention"],
               mask_token_id=MASK, target_layer_ids=[0, 2], num_anchors=512,
               enable_confidence_head=True, confidence_head_with_markov=with_markov,
               markov_rank=markov_rank, markov_head_type="vanilla")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    # the reader's shapes, from a first pass with placeholder tensors
    h, nq, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, r = cfg["intermediate_size"], markov_rank
    shapes = {"embed_tokens.weight": (V, h), "norm.weight": (h,), "fc.weight": (h, 2 * h),
              "hidden_norm.weight": (h,), "lm_head.weight": (V, h),
              "layers.0.self_attn.q_proj.weight": (nq * d, h), "layers.0.self_attn.k_proj.weight": (nkv * d, h),
              "layers.0.self_attn.v_proj.weight": (nkv * d, h), "layers.0.self_attn.o_proj.weight": (h, nq * d),
              "layers.0.self_attn.q_norm.weight": (d,), "layers.0.self_attn.k_norm.weight": (d,),
              "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
              "layers.0.mlp.down_proj.weight": (h, inter), "layers.0.input_layernorm.weight": (h,),
              "layers.0.post_attention_layernorm.weight": (h,),
              "confidence_head.proj.weight": (1, h + (r if with_markov else 0)),
              "confidence_head.proj.bias": (1,)}
    if r:
        shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
    rng = np.random.default_rng(seed)
    tensors = {k: (1.0 + 0.3 * rng.standard_normal(s) if k.endswith("norm.weight")
                   else 0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    embed = np.asarray(policy.params["embed_tokens"][...], np.float32)  # copied from the target
    tensors["embed_tokens.weight"] = tensors["lm_head.weight"] = embed
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("markov_rank, with_markov", [(6, True), (6, False), (0, False)])
def test_a_deepspec_checkpoint_imports_and_drafts_as_its_forward(policy, tmp_path, markov_rank,
                                                                  with_markov):
    _deepspec_checkpoint(tmp_path / "ds", policy, markov_rank=markov_rank, with_markov=with_markov)
    cfg, t = read_deepspec(tmp_path / "ds")  # the checkpoint is what DeepSpec reads
    head = load_dflash(tmp_path / "ds")
    assert head.config.sample_from_anchor and head.config.capture_layers == (0, 2)
    assert (head.config.block_size, head.config.mask_token_id, head.config.markov_rank) == (BLOCK, MASK, markov_rank)
    head.check_compatible(policy)
    features = np.random.default_rng(2).standard_normal((6, 2 * policy.config.hidden_size))
    tokens, ref_logits, ref_conf = deepspec_propose(cfg, t, torch.from_numpy(features), anchor=17)
    logits, conf = _ours(head, policy, features, 17, [17] + tokens[:BLOCK - 2])
    np.testing.assert_allclose(logits, ref_logits[:BLOCK - 1].numpy(), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(conf, ref_conf[:BLOCK - 1].numpy(), rtol=2e-4, atol=2e-4)
    # it exports back into the same layout (a confidence head without the Markov input comes
    # back with it, its weight there zero)
    save_block(head, tmp_path / "again", policy=policy)
    _, again = read_deepspec(tmp_path / "again")
    assert again.keys() == t.keys()
    for name in t:
        want = t[name].numpy()
        if name == "confidence_head.proj.weight" and markov_rank and not with_markov:
            want = np.concatenate([want, np.zeros((1, markov_rank))], 1)
        np.testing.assert_array_equal(again[name].numpy(), want)


def test_layout_mismatches_are_refused_by_name(policy, tmp_path):
    dflash_head = BlockHead.init_for(policy, jax.random.key(5), block_size=BLOCK, num_layers=1)
    dspark_head = BlockHead.init_for(policy, jax.random.key(5), block_size=BLOCK, num_layers=1,
                                     sample_from_anchor=True)
    with pytest.raises(ValueError, match="save it with save_dflash"):
        save_dspark(dflash_head, tmp_path / "a", policy=policy)
    with pytest.raises(ValueError, match="save it with save_dspark"):
        save_dflash(dspark_head, tmp_path / "b", num_target_layers=4)
    save_block(dflash_head, tmp_path / "c", policy=policy)  # each in its own layout
    save_block(dspark_head, tmp_path / "d", policy=policy)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert json.loads((tmp_path / "d" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["target_layer_ids"] = [2, 1, 3][:len(cfg["target_layer_ids"])] or [2, 1]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="strictly increasing"):
        load_dflash(tmp_path / "d")
    del cfg["num_anchors"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"needs \['num_anchors'\]"):
        load_dflash(tmp_path / "d")


@pytest.mark.quick
@pytest.mark.parametrize("layers", range(1, 13))
def test_default_captured_layers_are_strictly_increasing(layers):
    """DeepSpec refuses target_layer_ids that do not increase strictly (and its evaluator
    the target's last layer); DFlash's spread (1 .. L - 3) is kept where it is valid."""
    for count in (2, 3, 5):
        ids = default_block_layers(layers, count)
        assert all(0 <= i < layers for i in ids) and list(ids) == sorted(set(ids)), (layers, count, ids)
        assert len(ids) == min(count, max(layers - 1, 1))
        if layers > 1:
            assert layers - 1 not in ids
        spread = [int(round(1 + i * (layers - 4) / (count - 1))) for i in range(count)]
        if layers - 3 > 1 and len(set(spread)) == count:  # DFlash's own rule where it works
            assert list(ids) == spread
