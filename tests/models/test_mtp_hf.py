"""MTP heads in the DeepSeek-V3 HF layout (model.layers.{L}.{enorm, hnorm, eh_proj,
shared_head.norm, self_attn.*, mlp.*}): a checkpoint written here by hand from the PyTorch
reference's weights loads to the same head, and save / load round-trips exactly."""

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxspec.models import ModelConfig
from jaxspec.models.hf import HFCheckpointError, save_hf
from jaxspec.models.mtp import load_mtp, save_mtp
from jaxspec.testing.torch_mtp import TorchMTP, random_head, torch_layout

# our torch-layout short names -> DeepSeek-V3's names inside model.layers.{L}.
_DEEPSEEK = {
    "enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
    "norm": "shared_head.norm.weight", "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


def _leaves(head):
    return [np.asarray(x) for x in jax.tree.leaves(head.params)]


def test_a_deepseek_layout_checkpoint_loads_and_round_trips(make_policy, tmp_path):
    policy = make_policy(ModelConfig.tiny("qwen3"), seed=3)
    head = random_head(policy, seed=4)
    n_layers = policy.config.num_layers
    # a trunk + MTP checkpoint as DeepSeek-V3 ships one: the trunk's tensors, then layer L
    save_hf(policy, tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for short, w in torch_layout(head).items():
        tensors[f"model.layers.{n_layers}.{_DEEPSEEK[short]}"] = np.ascontiguousarray(w)
    for shared in ("embed_tokens.weight", "shared_head.head.weight"):  # tied: the embedding
        tensors[f"model.layers.{n_layers}.{shared}"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))

    loaded = load_mtp(tmp_path / "ckpt")
    assert loaded.capture_layers == (n_layers - 1,)
    loaded.check_compatible(policy)
    for a, b in zip(_leaves(loaded), _leaves(head), strict=True):
        np.testing.assert_array_equal(a, b)
    # its logits are the PyTorch MTP module's on the same checkpoint weights
    b, t, h = 2, 6, policy.config.hidden_size
    rng = np.random.default_rng(0)
    embeds = np.array(policy.embed(rng.integers(0, policy.config.vocab_size, (b, t))))
    hidden = rng.standard_normal((b, t, h)).astype(np.float32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    out, _ = loaded.forward(embeds, hidden, positions, loaded.init_cache(b, t), fuse=True)
    got = np.asarray(loaded.draft_logits(out, policy)[0])
    weights = {k: tensors[f"model.layers.{n_layers}.{v}"] for k, v in _DEEPSEEK.items()}
    with torch.no_grad():
        want = TorchMTP(weights, loaded.config.layer)(
            torch.from_numpy(embeds), torch.from_numpy(hidden),
            torch.from_numpy(tensors["model.embed_tokens.weight"])).numpy()
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)

    # export in the same layout, and back: exact, tensor for tensor
    save_mtp(loaded, tmp_path / "out", policy=policy)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in saved.items():
        np.testing.assert_array_equal(value, tensors[name])
    assert set(saved) == {n for n in tensors if n.startswith(f"model.layers.{n_layers}.")}
    again = load_mtp(tmp_path / "out")
    for a, b in zip(_leaves(again), _leaves(head), strict=True):
        np.testing.assert_array_equal(a, b)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["num_hidden_layers"] == n_layers and hf["num_nextn_predict_layers"] == 1


def test_a_checkpoint_without_an_mtp_layer_is_refused(make_policy, tmp_path):
    policy = make_policy(ModelConfig.tiny("qwen3"), seed=3)
    save_hf(policy, tmp_path)
    with pytest.raises(HFCheckpointError, match="num_nextn_predict_layers = 0"):
        load_mtp(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    layer = policy.config.num_layers
    with pytest.raises(HFCheckpointError, match=rf"the MTP layer lacks \['model.layers.{layer}.enorm"):
        load_mtp(tmp_path)
