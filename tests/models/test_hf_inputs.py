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
