"""family qwen3_5_moe (Qwen3.5's Gated DeltaNet and gated attention, every layer's
feed-forward a top-k mixture of experts plus a sigmoid-gated shared expert) against
transformers' Qwen3_5MoeForCausalLM. Its save_pretrained writes one tensor per expert and
projection; in memory (and in a file it reads as well) each layer's experts are two fused
3D tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]): load_hf reads both layouts."""

import numpy as np
import pytest

import jax
from safetensors.torch import save_file

from jaxspec.models import ModelConfig, load_hf, save_hf
from jaxspec.models.hybrid_hf import config_to_hf

L, F = "linear_attention", "full_attention"
PATTERNS = [(L, F), (F, L, L)]
IDS = ["LF", "FLL"]
SMALL = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             rms_norm_eps=1e-4, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
             moe_intermediate_size=16, shared_expert_intermediate_size=24,
             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                              "partial_rotary_factor": 0.5})
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _model(layer_types, seed=0):
    """transformers' own initialisation (normal(0.02) weights and router, A_log = log
    uniform(0.01, 16), dt_bias 1, zero-centred norms 0)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(
        **SMALL, num_hidden_layers=len(layer_types), layer_types=list(layer_types))
    return transformers.Qwen3_5MoeForCausalLM(config).eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _tokens(b, t, seed):
    return np.random.default_rng(seed).integers(0, SMALL["vocab_size"], (b, t))


def _both_rules(policy, tokens):
    """Our float32 logits [B, T, V]: the chunked rule (a forward without cache), then the
    recurrent one (a cache, the state deferred over every token)."""
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t), (b, t))
    deferring = policy.replace(pending_tokens=t)
    cache = deferring.init_cache(b, t)
    return (np.asarray(policy.forward(tokens, positions)[0]),
            np.asarray(deferring.forward(tokens, positions, cache, defer_state=True)[0]))


def test_model_type_and_layouts_are_transformers():
    """What this family's tables assume of transformers: the text config's model_type, and
    the fused 3D experts in memory (no per-expert names there)."""
    assert transformers.Qwen3_5MoeTextConfig().model_type == "qwen3_5_moe_text"
    names = set(_model((L, F)).state_dict())
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.linear_attn.in_proj_qkv.weight"} <= names
    assert not any(".experts.0." in n for n in names)


@pytest.mark.parametrize("layer_types", PATTERNS, ids=IDS)
def test_every_logit_within_1e5_of_transformers_at_its_own_init(tmp_path, layer_types):
    """Every float32 logit of ours, chunked and recurrent delta rule, within 1e-5 of
    transformers' float32 forward at 7 and 70 tokens (past a chunk). The experts matter:
    zeroing their weights moves transformers' logits far beyond 1e-5."""
    model = _model(layer_types)
    model.save_pretrained(tmp_path)
    policy = load_hf(tmp_path)
    assert policy.config.family == "qwen3_5_moe" and all(policy.config.sparse_layers)
    for t in (7, 70):
        tokens = _tokens(2, t, seed=t)
        want = _logits(model, tokens)
        assert np.ptp(want, axis=-1).min() > 0.1  # logits that differ: 1e-5 means something
        err = max(np.abs(ours - want).max() for ours in _both_rules(policy, tokens))
        print(f"{layer_types} T={t}: max |ours - transformers| {err:.1e}, "
              f"max |logit| {np.abs(want).max():.2f}")
        assert err <= 1e-5, err
    # negative control: the routed experts' weights move the logits
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.zero_()
    assert np.abs(_logits(model, tokens) - want).max() > 1e-3


def test_export_to_transformers_and_back_is_bit_exact(tmp_path):
    """load_hf -> save_hf -> Qwen3_5MoeForCausalLM.from_pretrained holds every tensor
    bit for bit (the fused expert tensors split into our gate/up/down and back), and the
    re-import equals the first."""
    model = _model((L, L, F), seed=3)
    with torch.no_grad():  # weights of order 1, so that a swapped or transposed half shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp_path / "a")
    policy = load_hf(tmp_path / "a")
    save_hf(policy, tmp_path / "b")
    reloaded = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "b")
    first, second = model.state_dict(), reloaded.state_dict()
    assert sorted(first) == sorted(second)
    assert [n for n in first if not torch.equal(first[n], second[n])] == []
    tokens = _tokens(1, 9, seed=6)
    assert np.array_equal(_logits(reloaded, tokens), _logits(model, tokens))
    # the fused layout (transformers' in-memory tensors as they are) reads to the same params
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "c" / "model.safetensors"), metadata={"format": "pt"})
    back, fused = load_hf(tmp_path / "b"), load_hf(tmp_path / "c")
    for a, b, c in zip(*(jax.tree.leaves(p.params) for p in (policy, back, fused))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.array_equal(np.asarray(a), np.asarray(c))


def test_config_checks_name_the_field():
    cfg = ModelConfig.tiny("qwen3_5_moe")
    assert all(cfg.sparse_layers) and cfg.shared_expert_intermediate_size
    assert config_to_hf(cfg)["model_type"] == "qwen3_5_moe_text"
    for field, value in (("num_experts", 0), ("shared_expert_intermediate_size", 0),
                         ("norm_topk_prob", False), ("decoder_sparse_step", 2),
                         ("mlp_only_layers", (1,))):
        with pytest.raises(ValueError, match=field):
            cfg.replace(**{field: value})
