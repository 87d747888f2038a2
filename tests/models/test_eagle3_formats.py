"""EAGLE-3 heads between jaxspec, vLLM, SGLang and SpecForge: the captured layers survive a
round trip in each server's convention, checked against `transformers`' hidden states.

The two readers below restate the servers' rules (from their code, not ours):
- vLLM: the draft config's top-level `eagle_aux_hidden_state_layer_ids`; the target appends
  the residual stream *before* running layer id, i.e. HF `hidden_states[id]`.
- SGLang: `eagle_config.eagle_aux_hidden_state_layer_ids`, plus 1, then captures before that
  layer: HF `hidden_states[id + 1]`.
Both fall back to capturing before layers (2, L//2, L-3) when the config names none.
"""

import json

import jax
import numpy as np
import pytest

from jaxspec.models import HFCheckpointError, ModelConfig, save_hf
from jaxspec.models.config import default_eagle3_layers
from jaxspec.models.eagle3 import Eagle3Head, inspect_eagle3, load_eagle3, save_eagle3
from jaxspec.models.transformer import random_policy

L = 8  # a tiny policy deep enough for three distinct default layers
CONFIG = ModelConfig.tiny("qwen3").replace(num_layers=L, vocab_size=64)


def vllm_hidden_state_ids(cfg: dict) -> list[int]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, L // 2, L - 3]


def sglang_hidden_state_ids(cfg: dict) -> list[int]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [i + 1 for i in ids] if ids is not None else [2, L // 2, L - 3]


@pytest.fixture(scope="module")
def policy():
    return random_policy(CONFIG, seed=3)


@pytest.fixture(scope="module")
def exported(policy, tmp_path_factory):
    """A head on the default layers (the (1, 17, 32) of a 36-layer target), exported."""
    head = Eagle3Head.init_for(policy, 32, jax.random.key(1))
    assert head.capture_layers == (1, L // 2 - 1, L - 4) == default_eagle3_layers(L)
    path = tmp_path_factory.mktemp("eagle3")
    save_eagle3(head, path)
    return head, path


def test_both_servers_capture_the_layers_the_head_was_trained_on(policy, exported, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    head, path = exported
    cfg = json.loads((path / "config.json").read_text())
    save_hf(policy, tmp_path / "policy")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (1, 12))
    with torch.no_grad():
        hidden = model(torch.from_numpy(ids), output_hidden_states=True).hidden_states
    positions = np.arange(12, dtype=np.int32)[None]
    _, captured, _ = policy.forward(ids.astype(np.int32), positions, capture=head.capture_layers)
    trained_on = [np.asarray(captured[i]) for i in head.capture_layers]
    for reader in (vllm_hidden_state_ids, sglang_hidden_state_ids):
        served = [hidden[i].numpy() for i in reader(cfg)]
        for got, want in zip(trained_on, served, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert vllm_hidden_state_ids(cfg) == sglang_hidden_state_ids(cfg) == [2, 4, 5]


def _rewrite(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _specforge(cfg):
    """SpecForge's configs (e.g. configs/qwen3-4b-eagle3.json) name no layers at all."""
    cfg.pop("eagle_config"), cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg.pop("target_hidden_size")


def _vllm(cfg):  # speculators / vLLM-style: the top-level field only
    cfg.pop("eagle_config")


def _sglang(cfg):  # SGLang / SpecForge-with-ids style: eagle_config only
    cfg.pop("eagle_aux_hidden_state_layer_ids")


@pytest.mark.parametrize("style", ["ours", "vllm", "sglang", "specforge"])
def test_every_style_loads_to_the_same_captured_layers(exported, tmp_path, style):
    head, path = exported
    if style != "ours":
        edit = {"vllm": _vllm, "sglang": _sglang, "specforge": _specforge}[style]
        path = _rewrite(path, tmp_path / style, edit)
    loaded = load_eagle3(path, target_num_layers=L)
    assert loaded.capture_layers == head.capture_layers == (1, 3, 4)
    assert inspect_eagle3(path, target_num_layers=L) == loaded.config
    np.testing.assert_array_equal(loaded.draft_to_target(), head.draft_to_target())
    # and it saves back in both conventions
    save_eagle3(loaded, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert vllm_hidden_state_ids(again) == sglang_hidden_state_ids(again) == [2, 4, 5]


def test_specforge_head_needs_the_target_depth(exported, tmp_path):
    path = _rewrite(exported[1], tmp_path / "sf", _specforge)
    with pytest.raises(HFCheckpointError, match="names no captured layers.*target_num_layers"):
        load_eagle3(path)
    assert load_eagle3(path, target_num_layers=36).capture_layers == (1, 17, 32)


def test_disagreeing_fields_are_one_error(exported, tmp_path):
    def edit(cfg):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # = vLLM's ids

    path = _rewrite(exported[1], tmp_path / "bad", edit)
    with pytest.raises(HFCheckpointError, match=r"two different layer sets.*\[2, 4, 5\].*"
                                                r"captured as inputs \[3, 5, 6\]"):
        load_eagle3(path, target_num_layers=L)
