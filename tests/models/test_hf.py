"""HF interop: parity with `transformers` (PyTorch, CPU) on tiny random models, export
round-trips, and the errors a user can cause with a bad checkpoint directory."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.models import (
    HFCheckpointError,
    Llama3RopeScaling,
    ModelConfig,
    UnsupportedModelError,
    load_hf,
    save_hf,
)
from jaxspec.models.hf import config_from_hf
from jaxspec.testing.hf_models import randomise

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 16
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _hf_model(name):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  max_position_embeddings=512)
    if name == "qwen3_tied":  # GQA 4/2, QK-norm, tied embeddings
        cfg = transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       tie_word_embeddings=True, rope_theta=10_000.0, **common)
        return transformers.Qwen3ForCausalLM(cfg)
    if name == "qwen3_untied":  # MHA, head_dim != hidden / heads, untied
        cfg = transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                       tie_word_embeddings=False, rope_theta=1_000_000.0, **common)
        return transformers.Qwen3ForCausalLM(cfg)
    if name == "llama3":  # Llama-3 RoPE scaling (original context 32 < 512), untied
        cfg = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, rope_theta=10_000.0,
                                       rope_scaling=dict(LLAMA3_ROPE), rms_norm_eps=1e-5, **common)
        return transformers.LlamaForCausalLM(cfg)
    raise KeyError(name)


def _randomise(model, seed):
    """O(1) activations; embedding 0.4 N(0, 1): tied logits of magnitude ~10, not ~40."""
    return randomise(model, seed, embed_scale=0.4)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (checkpoint dir, torch model, input ids [2, SEQ], HF fp32 outputs)."""
    out = {}
    for seed, name in enumerate(["qwen3_tied", "qwen3_untied", "llama3"]):
        torch.manual_seed(seed)
        model = _randomise(_hf_model(name), seed)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            res = model(ids, output_hidden_states=True)
        out[name] = (path, model, ids, res)
    return out


def _fp32_tol(ref):
    """float32 parity bound: 2e-5 for values of magnitude <= 10, relative beyond.

    We measure 3e-6 to 8e-6 on logits of magnitude 4 to 13; that is float32 rounding:
    against the same HF model run in float64, transformers' own float32 logits are off
    by as much (2.6e-6 to 8.5e-6) as ours.
    """
    return 2e-5 * max(1.0, float(np.abs(ref).max()) / 10)


def _positions(batch=2):
    return np.tile(np.arange(SEQ, dtype=np.int32), (batch, 1))


@pytest.mark.parametrize("unrolled", [False, True], ids=["scan", "unrolled"])
@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_untied", "llama3"])
def test_float32_logits_and_hidden_states_match_transformers(hf, name, unrolled):
    path, model, ids, res = hf[name]
    policy = load_hf(path)
    if unrolled:  # the per-layer copies decoding reads on CPU (Policy.unstack_layers)
        policy = policy.unstack_layers()
        assert len(policy.layer_params) == policy.config.num_layers
    assert policy.config.tie_embeddings == (name == "qwen3_tied")
    assert (policy.config.rope_scaling is not None) == (name == "llama3")
    layers = policy.config.num_layers
    logits, captured, _ = policy.forward(ids.numpy(), _positions(), capture=tuple(range(layers)))
    ref = res.logits.numpy()
    assert np.abs(ref).max() > 2  # non-trivial logits
    np.testing.assert_allclose(logits, ref, atol=_fp32_tol(ref), rtol=0)
    # capture i == HF hidden_states[i + 1]; HF reports the last layer after the final norm.
    for i in range(layers - 1):
        want = res.hidden_states[i + 1].numpy()
        np.testing.assert_allclose(captured[i], want, atol=_fp32_tol(want), rtol=0)
    with torch.no_grad():
        last = model.model.norm(torch.from_numpy(np.array(captured[layers - 1]))).numpy()
    want = res.hidden_states[layers].numpy()
    np.testing.assert_allclose(last, want, atol=_fp32_tol(want), rtol=0)


@pytest.mark.parametrize("name", ["qwen3_tied", "llama3"])
def test_bfloat16_is_as_accurate_as_transformers_bfloat16(hf, name):
    """Both bf16 forwards round every activation to 8 significant bits, so neither matches
    the fp32 logits closely; we require ours to stay within 2x transformers' own bf16
    error on the same (bf16-rounded) weights, and under 2^-5 of the largest logit."""
    path, model, ids, res = hf[name]
    policy = load_hf(path, dtype="bfloat16")
    assert policy.config.dtype == "bfloat16"
    logits, _, _ = policy.forward(ids.numpy(), _positions())
    assert logits.dtype == jnp.float32
    ref = res.logits.numpy()
    hf_bf16 = _hf_model(name)
    hf_bf16.load_state_dict(model.state_dict())
    with torch.no_grad():
        hf_logits = hf_bf16.to(torch.bfloat16).eval()(ids).logits.float().numpy()
    ours_err = np.abs(np.asarray(logits) - ref).max()
    hf_err = np.abs(hf_logits - ref).max()
    assert ours_err <= 2 * hf_err, (ours_err, hf_err)
    assert ours_err <= 2.0**-5 * np.abs(ref).max(), ours_err


@pytest.mark.parametrize("name", ["qwen3_tied", "llama3"])
def test_save_hf_loads_back_in_transformers(hf, name, tmp_path):
    path, model, ids, res = hf[name]
    policy = load_hf(path)
    save_hf(policy, tmp_path / "single")
    save_hf(policy, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    for out in ["single", "sharded"]:
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype=torch.float32)
        assert type(again) is type(model)
        with torch.no_grad():
            np.testing.assert_array_equal(again(ids).logits.numpy(), res.logits.numpy())
        reloaded = load_hf(tmp_path / out)
        assert reloaded.config == policy.config
        for a, b in zip(_leaves(reloaded), _leaves(policy)):
            np.testing.assert_array_equal(a, b)


def test_save_hf_bfloat16_keeps_the_weights(hf, tmp_path):
    path, model, _, _ = hf["llama3"]
    policy = load_hf(path, dtype="bfloat16")
    save_hf(policy, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = model.model.layers[1].self_attn.k_proj.weight.detach().to(torch.bfloat16)
    got = again.model.layers[1].self_attn.k_proj.weight.detach()
    assert torch.equal(got, want)  # fp32 -> bf16 rounding is the same in both
    assert load_hf(tmp_path).config.dtype == "bfloat16"  # dtype=None: the checkpoint's


def test_load_hf_puts_each_tensor_on_its_sharding(hf):
    """Shardings from logical axis names + rules (what a mesh module does) are honoured."""
    import flax.linen as nn
    import jax
    from flax import nnx

    from jaxspec.models import Policy

    path = hf["llama3"][0]
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (("layers", None), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
             ("kv_heads", "tensor"), ("vocab", "tensor"), ("head_dim", None))
    with nn.logical_axis_rules(rules):
        shardings = nnx.get_named_sharding(Policy.abstract(load_hf(path).config).params, mesh)
    sharded, plain = load_hf(path, shardings=shardings), load_hf(path)
    up = sharded.params["layers"]["mlp"]["up_proj"][...]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len(up.sharding.device_set) == 4
    for a, b in zip(_leaves(sharded), _leaves(plain)):
        np.testing.assert_array_equal(a, b)


def _leaves(policy):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(policy.params)]


def test_rope_settings_read_from_both_spellings():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    v4 = config_from_hf({**base, "rope_theta": 500000.0,
                         "rope_scaling": {**LLAMA3_ROPE, "rope_type": None, "type": "llama3"}})
    v5 = config_from_hf({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}})
    assert v4 == v5
    assert v5.rope_theta == 500000.0
    assert v5.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 32)
    assert v5.head_dim == 16 and not v5.qk_norm and v5.family == "llama"
    plain = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6


# --------------------------------------------------------------------------- errors


@pytest.fixture
def ckpt(hf, tmp_path):
    """A writable copy of the tiny Qwen3 checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf["qwen3_tied"][0], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_directory_or_files(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match=r"does not exist .*nothing is downloaded"):
        load_hf(tmp_path / "Qwen" / "Qwen3-8B")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        load_hf(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        load_hf(ckpt)


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(UnsupportedModelError, match=r"\['MistralForCausalLM'\].*supported: "
                       r"\['LlamaForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', "
                       r"'Qwen3NextForCausalLM', 'Qwen3_5ForCausalLM', 'Qwen3_5MoeForCausalLM'\]"):
        load_hf(ckpt)


def test_unsupported_options(ckpt):
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                 attention_bias=True)
    with pytest.raises(UnsupportedModelError, match=r"attention_bias=True; rope_type='yarn'"):
        load_hf(ckpt)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(HFCheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight$"):
        load_hf(ckpt)


def test_unexpected_tensor(ckpt):
    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)

    _edit_tensors(ckpt, add)
    with pytest.raises(HFCheckpointError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.q_proj\.bias$"):
        load_hf(ckpt)


def test_shape_mismatch(ckpt):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:63].copy()

    _edit_tensors(ckpt, shrink)
    with pytest.raises(HFCheckpointError, match=r"shape mismatches: model\.norm\.weight: checkpoint \(63,\), config \(64,\)"):
        load_hf(ckpt)


def test_all_problems_are_named_in_one_error(ckpt):
    _edit_config(ckpt, num_hidden_layers=4)  # config says 4 layers, weights hold 3
    def edit(t):
        t["model.norm.weight"] = np.zeros(3, np.float32)
        t["extra.weight"] = np.zeros(1, np.float32)

    _edit_tensors(ckpt, edit)
    with pytest.raises(HFCheckpointError) as err:
        load_hf(ckpt)
    msg = str(err.value)
    assert "layers=4" in msg and "missing tensors: model.layers.3." in msg
    assert "unexpected tensors: extra.weight" in msg
    assert "shape mismatches: model.norm.weight: checkpoint (3,), config (64,)" in msg


def test_sharded_index_with_a_missing_shard(hf, tmp_path):
    policy = load_hf(hf["llama3"][0])
    save_hf(policy, tmp_path, max_shard_bytes=40_000)
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match=r"shards listed in .*index\.json are missing"):
        load_hf(tmp_path)


def test_config_preset_matches_the_hf_tiny_model(hf):
    """ModelConfig.tiny is the config of the tiny HF models above (same compiled forward)."""
    assert load_hf(hf["qwen3_tied"][0]).config == ModelConfig.tiny("qwen3")
    assert load_hf(hf["llama3"][0]).config == ModelConfig.tiny("llama")


# --------------------------------------------------------------------------- servable exports


def test_run_export_with_the_builtin_tokenizer_is_servable(tmp_path):
    """A tiny run's policy/: AutoTokenizer round-trips the character tokenizer, the special
    ids are in config.json and generation_config.json stops at EOS."""
    import jax

    from jaxspec.models import Policy
    from jaxspec.rl.build import export_models
    from jaxspec.rl.tasks import CharTokenizer

    tok = CharTokenizer()
    policy = Policy.init(ModelConfig.tiny("qwen3").replace(vocab_size=32), jax.random.key(0))
    export_models(str(tmp_path), policy, tokenizer=tok)
    out = tmp_path / "policy"
    served = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "12+(3*4)= 15.5"
    assert served.encode(text, add_special_tokens=False) == tok.encode(text)
    assert served.decode(tok.encode(text)) == text
    assert (served.bos_token_id, served.eos_token_id, served.pad_token_id) == (
        tok.bos_id, tok.eos_id, tok.pad_id)
    gen = transformers.GenerationConfig.from_pretrained(out, local_files_only=True)
    assert gen.eos_token_id == tok.eos_id
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    assert load_hf(out).config == policy.config


def test_run_export_from_an_hf_model_carries_its_serving_files(hf, tmp_path):
    """model.hf_path's tokenizer (byte-level BPE with a chat template) and its EOS list go
    into policy/ unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxspec.rl.build import export_models

    path, *_ = hf["qwen3_tied"]
    src = tmp_path / "src"
    shutil.copytree(path, src)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the answer is 42", "x + y = 7"] * 8, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<|endoftext|>", "<|im_end|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    export_models(str(tmp_path / "run"), load_hf(src), source=str(src))
    out = tmp_path / "run" / "policy"
    served = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "the answer is 42"
    assert served.encode(text) == fast.encode(text) and served.decode(fast.encode(text)) == text
    assert served.apply_chat_template([{"role": "user", "content": "x"}],
                                      tokenize=False) == "x<|im_end|>"
    gen = transformers.GenerationConfig.from_pretrained(out, local_files_only=True)
    assert gen.eos_token_id == [1, 0]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [1, 0]
