"""MTP layers in the three published HF layouts (DeepSeek-V3, MiMo, Qwen3-Next-style with a
dense layer): a tiny trunk + MTP checkpoint written here tensor by tensor in each layout loads
to a head whose logits are those of a PyTorch forward written here from that layout's
equations; save / load round-trips bitwise; tensors we cannot map are refused by name."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxspec.models import ModelConfig
from jaxspec.models.hf import HFCheckpointError, save_hf
from jaxspec.models.mtp import MTP_LAYOUTS, MTPHead, load_mtp, save_mtp

L = ModelConfig.tiny("qwen3").num_layers
# Per layout (from vLLM's deepseek_mtp / mimo_mtp / qwen3_next_mtp and the HF MiMo and
# Qwen3-Next modelling code): config key, prefix of the head's tensors, prefix of its decoder
# layer, names of (embedding norm, hidden norm, projection, final norm), whether the
# projection reads [hidden; embedding] (MiMo) instead of [embedding; hidden], and whether
# every RMSNorm multiplies by (1 + w) (Qwen3-Next).
LAYOUTS = {
    "deepseek_v3": ("num_nextn_predict_layers", f"model.layers.{L}.", f"model.layers.{L}.",
                    ("enorm", "hnorm", "eh_proj", "shared_head.norm"), False, False),
    "mimo": ("num_nextn_predict_layers", "model.mtp_layers.0.", "model.mtp_layers.0.",
             ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"), True, False),
    "qwen3_next": ("mtp_num_hidden_layers", "mtp.", "mtp.layers.0.",
                   ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), False, True),
}


def _mtp_tensors(layout, cfg, seed):
    """Random MTP tensors in `layout`, as torch Linear [out, in] weights: O(1) activations;
    zero-centred norm weights rounded to bfloat16 (as shipped), others 1 + 0.2 N(0, 1)."""
    _, head, block, (e, h, proj, out), _, zero = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    c = cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {head + proj: (c.hidden_size, 2 * c.hidden_size),
              block + "self_attn.q_proj": (q, c.hidden_size),
              block + "self_attn.k_proj": (kv, c.hidden_size),
              block + "self_attn.v_proj": (kv, c.hidden_size),
              block + "self_attn.o_proj": (c.hidden_size, q),
              block + "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
              block + "mlp.up_proj": (c.intermediate_size, c.hidden_size),
              block + "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    norms = {head + e: c.hidden_size, head + h: c.hidden_size, head + out: c.hidden_size,
             block + "input_layernorm": c.hidden_size,
             block + "post_attention_layernorm": c.hidden_size,
             block + "self_attn.q_norm": c.head_dim, block + "self_attn.k_norm": c.head_dim}
    tensors = {}
    for name, shape in shapes.items():
        tensors[name + ".weight"] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    for name, n in norms.items():
        noise = 0.2 * rng.standard_normal(n)
        w = noise.astype(ml_dtypes.bfloat16).astype(np.float32) if zero else 1 + noise
        tensors[name + ".weight"] = w.astype(np.float32)
    return tensors


def _write(tmp_path, policy, layout, mtp, *, config=None):
    """A trunk checkpoint (save_hf) with the MTP tensors added and the layout's count key."""
    save_hf(policy, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.update({LAYOUTS[layout][0]: 1}, **(config or {}))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _torch_forward(layout, t, c, embeds, hidden, lm_head):
    """The layout's MTP equations on its own tensors: two norms, the concatenation in the
    layout's order, the projection, one pre-norm decoder layer (GQA, QK-norm, RoPE, SwiGLU),
    the final norm and the shared LM head. [B,T,H], [B,T,H], [V,H] -> [B,T,V]."""
    _, head, block, (e, h, proj, out), hidden_first, zero = LAYOUTS[layout]
    w = {k: torch.from_numpy(v) for k, v in t.items()}

    def norm(name, x):
        g = w[name + ".weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1 + g if zero else g)

    def lin(x, name):
        return x @ w[name + ".weight"].T

    nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    b, n, _ = embeds.shape
    parts = [norm(head + e, embeds), norm(head + h, hidden)]
    x = lin(torch.cat(parts[::-1] if hidden_first else parts, -1), head + proj)
    a = norm(block + "input_layernorm", x)
    q = norm(block + "self_attn.q_norm", lin(a, block + "self_attn.q_proj").view(b, n, nq, d)).transpose(1, 2)
    k = norm(block + "self_attn.k_norm", lin(a, block + "self_attn.k_proj").view(b, n, nkv, d)).transpose(1, 2)
    v = lin(a, block + "self_attn.v_proj").view(b, n, nkv, d).transpose(1, 2)
    freq = c.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * freq[None]
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
    half = lambda z: torch.cat([-z[..., d // 2:], z[..., :d // 2]], -1)  # noqa: E731
    q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.softmax(scores, -1) @ v
    x = x + lin(att.transpose(1, 2).reshape(b, n, nq * d), block + "self_attn.o_proj")
    m = norm(block + "post_attention_layernorm", x)
    x = x + lin(torch.nn.functional.silu(lin(m, block + "mlp.gate_proj")) * lin(m, block + "mlp.up_proj"),
                block + "mlp.down_proj")
    return norm(head + out, x) @ lm_head.T


def _leaves(head):
    return [np.asarray(x) for x in jax.tree.leaves(head.params)]


@pytest.mark.parametrize("layout", MTP_LAYOUTS)
def test_a_checkpoint_in_each_layout_loads_to_its_reference_and_round_trips(layout, make_policy,
                                                                             tmp_path):
    policy = make_policy(ModelConfig.tiny("qwen3"), seed=3)  # QK-norm, tied embeddings
    c = policy.config
    mtp = _mtp_tensors(layout, c, seed=7)
    head = load_mtp(_write(tmp_path / "ckpt", policy, layout, mtp))
    head.check_compatible(policy)

    rng = np.random.default_rng(0)
    b, n = 2, 6
    embeds = np.array(policy.embed(rng.integers(0, c.vocab_size, (b, n))))
    hidden = rng.standard_normal((b, n, c.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
    out, _ = head.forward(embeds, hidden, positions, head.init_cache(b, n), fuse=True)
    got = np.asarray(head.draft_logits(out, policy)[0])
    with torch.no_grad():
        want = _torch_forward(layout, mtp, c, torch.from_numpy(embeds), torch.from_numpy(hidden),
                              torch.from_numpy(np.array(policy.params["embed_tokens"][...]))).numpy()
    assert np.abs(want).max() > 1.0  # non-trivial logits
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)

    # export in the same layout: the file's MTP tensors, bit for bit; and back
    save_mtp(head, tmp_path / "out", layout=layout)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(mtp)
    for name, value in saved.items():
        np.testing.assert_array_equal(value, mtp[name], err_msg=name)
    assert json.loads((tmp_path / "out" / "config.json").read_text())[LAYOUTS[layout][0]] == 1
    for a, b_ in zip(_leaves(load_mtp(tmp_path / "out")), _leaves(head), strict=True):
        np.testing.assert_array_equal(a, b_)
    # and through every other layout: the same head
    for other in MTP_LAYOUTS:
        save_mtp(head, tmp_path / other, layout=other)
        for a, b_ in zip(_leaves(load_mtp(tmp_path / other)), _leaves(head), strict=True):
            np.testing.assert_array_equal(a, b_)


def test_tensors_we_cannot_map_are_refused_by_name(make_policy, tmp_path):
    policy = make_policy(ModelConfig.tiny("qwen3"), seed=3)
    c = policy.config
    # Qwen3-Next's MoE MLP in place of the dense one
    mtp = _mtp_tensors("qwen3_next", c, seed=7)
    for p in ("gate_proj", "up_proj", "down_proj"):
        w = mtp.pop(f"mtp.layers.0.mlp.{p}.weight")
        mtp[f"mtp.layers.0.mlp.experts.0.{p}.weight"] = w
    mtp["mtp.layers.0.mlp.gate.weight"] = np.zeros((4, c.hidden_size), np.float32)
    with pytest.raises(HFCheckpointError, match=r"cannot map: \['mtp.layers.0.mlp.experts.0.down_proj"
                                                r".*MoE MLPs are not supported"):
        load_mtp(_write(tmp_path / "moe", policy, "qwen3_next", mtp))
    # MiMo's Qwen2 layer carries q/k/v biases
    mtp = _mtp_tensors("mimo", c, seed=7)
    mtp["model.mtp_layers.0.self_attn.q_proj.bias"] = np.zeros(c.num_heads * c.head_dim, np.float32)
    with pytest.raises(HFCheckpointError, match=r"q_proj.bias'\] \(biases .* are not supported"):
        load_mtp(_write(tmp_path / "bias", policy, "mimo", mtp))
    # a missing tensor
    mtp = _mtp_tensors("mimo", c, seed=7)
    del mtp["model.mtp_layers.0.input_proj.weight"]
    with pytest.raises(HFCheckpointError, match=r"lacks \['model.mtp_layers.0.input_proj.weight'\] "
                                                r"\(read as the mimo layout\)"):
        load_mtp(_write(tmp_path / "missing", policy, "mimo", mtp))
    # Qwen3-Next's gated attention: q_proj has twice the rows
    mtp = _mtp_tensors("qwen3_next", c, seed=7)
    q = mtp["mtp.layers.0.self_attn.q_proj.weight"]
    mtp["mtp.layers.0.self_attn.q_proj.weight"] = np.concatenate([q, q])
    with pytest.raises(HFCheckpointError, match="gated attention, not supported"):
        load_mtp(_write(tmp_path / "gated", policy, "qwen3_next", mtp))
    # a Qwen3-Next config (hybrid trunk) goes to jaxspec.models.hybrid_mtp's loader, which
    # reads config.json as Qwen3-Next's: this dense one's missing keys named before any tensor
    mtp = _mtp_tensors("qwen3_next", c, seed=7)
    with pytest.raises(HFCheckpointError, match="no 'num_experts_per_tok': a qwen3_next config"):
        load_mtp(_write(tmp_path / "next", policy, "qwen3_next", mtp, config={
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}))
    with pytest.raises(ValueError, match=r"MTP layout 'eagle'; valid: \('deepseek_v3', 'mimo'"):
        save_mtp(MTPHead.init_for(policy, jax.random.key(0)), tmp_path / "x", layout="eagle")
