"""The config schema: files, overrides, validation messages, round-trip."""

import dataclasses
import pathlib

import pytest

from jaxspec import config as C
from jaxspec.config import Config, ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
QWEN = ROOT / "configs" / "qwen3_8b_eagle3.yaml"


def test_tiny_yaml_is_the_embedded_default():
    cfg = load_config(TINY)
    assert cfg == Config() == load_config(None)
    assert cfg.draft.kind == "eagle3" and cfg.draft.k == 3 and cfg.draft.online
    assert cfg.model.hf_path is None and cfg.task.name == "arithmetic"


def test_overrides_are_yaml_scalars():
    cfg = load_config(TINY, ["draft.k=4", "sampling.temperature=0.7", "run.dir=runs/x y",
                             "grpo.clip_c=3", "grpo.tis=token", "draft.tree.top_k=2",
                             "task.params={digits: 3}", "draft.layers=[0, 1, 2]",
                             "run.resume=true", "mesh.rules.embed=null"])
    assert cfg.draft.k == 4
    assert cfg.sampling.temperature == 0.7
    assert cfg.run.dir == "runs/x y"
    assert cfg.grpo.clip_c == 3.0 and isinstance(cfg.grpo.clip_c, float)  # int widened
    assert cfg.grpo.tis == "token"
    assert cfg.draft.tree == C.TreeSpec(top_k=2)  # a null section is created by its keys
    assert cfg.task.params == {"digits": 3}
    assert cfg.draft.layers == (0, 1, 2)
    assert cfg.run.resume is True
    assert cfg.mesh.rules["embed"] is None and cfg.mesh.rules["mlp"] == "tensor"
    assert load_config(TINY, ["draft.tree.top_k=2", "draft.tree=null"]).draft.tree is None


def _error(overrides, path=TINY, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, **kw)
    return info.value


def test_unknown_key_suggests_the_right_one():
    e = _error(["draft.kk=3"])
    assert e.key == "draft.kk"
    assert "unknown key" in str(e) and "did you mean 'draft.k'" in str(e)
    e = _error(["rollout.temperature=0.5"])  # right name, wrong section
    assert "did you mean 'sampling.temperature'" in str(e)
    e = _error(["modle.hidden_size=8"])
    assert e.key == "modle" and "did you mean 'model'" in str(e)
    e = _error(["grpo.eps_hgh=0.3"])
    assert "did you mean 'grpo.eps_high'" in str(e)
    e = _error(["task.params.digit=3"])  # task parameters are checked against the task
    assert e.key == "task.params.digit" and "did you mean 'task.params.digits'" in str(e)


def test_unknown_key_in_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("draft:\n  kind: eagle3\n  tree:\n    top_k: 2\n    deepth: 3\n")
    e = _error([], path)
    assert e.key == "draft.tree.deepth" and "did you mean 'draft.tree.depth'" in str(e)


@pytest.mark.parametrize("override,key,words", [
    ("draft.k=0", "draft.k", ">= 1"),
    ("draft.k=2.5", "draft.k", "an integer"),
    ("draft.k=true", "draft.k", "an integer"),
    ("sampling.temperature=-0.1", "sampling.temperature", ">= 0"),
    ("sampling.top_p=0", "sampling.top_p", "(0, 1]"),
    ("sampling.top_p=1.5", "sampling.top_p", "(0, 1]"),
    ("sampling.top_k=-1", "sampling.top_k", ">= 0"),
    ("rollout.group_size=1", "rollout.group_size", ">= 2"),
    ("rollout.method=beam", "rollout.method", "'replay', 'rejection', 'greedy'"),
    ("draft.kind=eagle", "draft.kind", "did you mean 'eagle3'"),
    ("grpo.loss_agg=seq", "grpo.loss_agg", "'token', 'sequence'"),
    ("grpo.clip_c=0.5", "grpo.clip_c", "> 1"),
    ("grpo.eps_low=1.0", "grpo.eps_low", "[0, 1)"),
    ("grpo.advantage=ppo", "grpo.advantage", "'grpo', 'rloo'"),
    ("draft.tree={top_k: 2, depth: 4, budget: 3}", "draft.tree.budget", ">= depth"),
    ("draft.ngram.max_n=0", "draft.ngram.max_n", ">= 1"),
    ("model.num_kv_heads=3", "model.num_kv_heads", "divide num_heads"),
    ("model.vocab_size=10", "model.vocab_size", ">= 25"),
    ("model.dtype=fp16", "model.dtype", "'float32', 'bfloat16'"),
    ("draft.layers=[0, 1, 9]", "draft.layers", "[0, 3]"),
    ("draft.layers=[0, 1]", "draft.layers", "a list of 3 values"),
    ("draft.draft_vocab_size=100", "draft.draft_vocab_size", "<= 25"),
    ("draft.kind=draft_model", "draft.model", "draft.hf_path"),
    ("draft.kind=ngram", None, None),  # valid: no error
    ("rollout.method=greedy", "rollout.method", "temperature=0"),
    ("async.enabled=true", "grpo.tis", "'token' or 'sequence'"),
    ("mesh.rules.embed=model", "mesh.rules.embed", "data, fsdp, tensor"),
    ("mesh.data=0", "mesh.data", "-1 for the rest"),
    ("task.name=addition", "task.name", "'arithmetic', 'countdown', 'jsonl'"),
    ("task.name=jsonl", "task.path", "JSONL file"),
    ("task.params={digits: 0}", "task.params", "digits must be >= 1"),
    ("task.params={ops: '/'}", "task.params", "ops must be"),
    ("model.hf_path=/no/such/dir", "model.hf_path", "local HF directory"),
    ("draft.k", "draft.k", "key=value"),
])
def test_bad_values_name_key_value_and_what_is_valid(override, key, words):
    if key is None:
        load_config(TINY, [override])
        return
    e = _error([override])
    assert e.key == key, str(e)
    assert words in str(e), str(e)
    assert f"'{key}'" in str(e)


def test_bad_value_in_direct_construction():
    with pytest.raises(ConfigError, match="'k' = 0"):
        C.DraftSpec(k=0)
    with pytest.raises(ConfigError, match="'draft.k' = 0"):
        C.from_dict({"draft": {"k": 0}})


def test_missing_config_file():
    e = _error([], ROOT / "configs" / "nope.yaml")
    assert "no such config file" in str(e)


def test_round_trip(tmp_path):
    cfg = load_config(TINY, ["draft.tree.top_k=2", "grpo.clip_c=3", "draft.layers=[0, 1, 2]",
                             "task.params={digits: 3}", "async.enabled=true",
                             "grpo.tis=sequence"])
    C.save(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(tmp_path / "run" / "config.yaml") == cfg
    assert C.from_dict(C.to_dict(cfg)) == cfg
    plain = C.to_dict(cfg)
    assert "async" in plain and "async_" not in plain
    assert plain["draft"]["layers"] == [0, 1, 2]


def test_real_model_config_points_at_local_weights(tmp_path):
    # The shipped file has placeholders: loading it says which path to fix...
    e = _error([], QWEN)
    assert e.key == "model.hf_path" and "/path/to/Qwen3-8B" in str(e)
    # ...and with real local paths it loads.
    for name in ("qwen", "head"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    cfg = load_config(QWEN, [f"model.hf_path={tmp_path / 'qwen'}",
                             f"draft.hf_path={tmp_path / 'head'}", f"task.path={data}"])
    assert cfg.draft.kind == "eagle3" and cfg.draft.k == 3
    assert cfg.draft_optim.b1 == 0.9 and cfg.draft_optim.b2 == 0.95
    assert cfg.model.dtype == "bfloat16" and cfg.task.name == "jsonl"
    e = _error([f"model.hf_path={tmp_path}", f"draft.hf_path={tmp_path / 'head'}",
                f"task.path={data}"], QWEN)
    assert e.key == "model.hf_path" and "config.json" in str(e)
    e = _error([f"model.hf_path={tmp_path / 'qwen'}", f"draft.hf_path={tmp_path / 'head'}",
                f"task.path={tmp_path / 'none.jsonl'}"], QWEN)
    assert e.key == "task.path" and "no such file" in str(e)


def test_sections_are_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.draft.k = 5  # type: ignore[misc]
