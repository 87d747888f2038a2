"""Bad HF directories: each is one HFCheckpointError naming the key or file, found by
`inspect_hf` without reading weights (so the trainer can refuse it before compiling)."""

import json

import jax
import pytest

from jaxspec.models import HFCheckpointError, ModelConfig, Policy, inspect_hf, load_hf, save_hf

_CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf(Policy.init(_CONFIG, jax.random.key(0)), path)
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in saved.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path, drop=(), **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key in drop:
        cfg.pop(key)
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_inspect_returns_the_saved_config(saved):
    assert inspect_hf(saved) == _CONFIG


@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size", "vocab_size",
                                 "num_hidden_layers", "intermediate_size"])
def test_missing_required_key_is_named(ckpt, key):
    _edit_config(ckpt, drop=[key])
    with pytest.raises(HFCheckpointError, match=rf"config\.json has no '{key}'"):
        inspect_hf(ckpt)


@pytest.mark.parametrize("value", [0, -2, "16", 2.5, True])
def test_bad_integer_value_is_named(ckpt, value):
    _edit_config(ckpt, hidden_size=value)
    with pytest.raises(HFCheckpointError, match=r"'hidden_size' = .*valid: an integer >= 1"):
        inspect_hf(ckpt)


def test_heads_not_divisible_by_kv_heads(ckpt):
    _edit_config(ckpt, num_key_value_heads=3)
    with pytest.raises(HFCheckpointError, match=r"invalid model: .*num_kv_heads=3"):
        inspect_hf(ckpt)


def test_config_json_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(HFCheckpointError, match=r"must hold a JSON object; got list"):
        inspect_hf(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match=r"not valid JSON"):
        inspect_hf(ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_safetensors(ckpt, keep):
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(int(len(data) * keep), 9)])
    for fn in (inspect_hf, load_hf):
        with pytest.raises(HFCheckpointError, match=r"model\.safetensors is not a readable "
                                                    r"safetensors file .*truncated"):
            fn(ckpt)


def _tokenizer_dir(path):
    """A byte-level BPE tokenizer with special tokens and a chat template, written the way
    transformers writes one (built locally: nothing is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=28, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:20])
    tok.train_from_iterator(["abc abd 123"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return fast


def test_special_tokens_union_generation_config_first(ckpt):
    _edit_config(ckpt, eos_token_id=1, bos_token_id=None, pad_token_id=0)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    from jaxspec.models import special_tokens

    ids = special_tokens(ckpt)
    assert (ids.bos, ids.eos, ids.pad) == (None, (1, 7), 0)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(HFCheckpointError, match=r"eos_token_id = 'x'; valid: a token id"):
        special_tokens(ckpt)


def test_export_carries_tokenizer_generation_config_and_ids(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "src"
    src.mkdir()
    fast = _tokenizer_dir(src)
    (src / "config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}))
    out = tmp_path / "export"
    save_hf(Policy.init(_CONFIG, jax.random.key(1)), out, source=src)
    again = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert again.get_vocab() == fast.get_vocab() and len(again) > 2
    msgs = [{"role": "user", "content": "abc"}]
    assert again.apply_chat_template(msgs, tokenize=False) == "<user>abc<|im_end|>"
    gen = transformers.GenerationConfig.from_pretrained(out, local_files_only=True)
    assert gen.eos_token_id == [1, 0]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == [1, 0] and cfg["pad_token_id"] == fast.pad_token_id == 0
    assert inspect_hf(out) == _CONFIG
