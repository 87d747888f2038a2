"""A real-model run (`model.hf_path`) whose directory is broken stops with one `error:` line
naming the key and the file, before anything compiles (issue 19)."""

import json
import logging
import pathlib

import jax
import pytest

from jaxspec.models import ModelConfig, Policy, save_hf
from jaxspec.testing.scripts import load_script

train_grpo = load_script("train_grpo")

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "policy"
    save_hf(Policy.init(ModelConfig.tiny(vocab_size=40), jax.random.key(0)), path)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _drop_heads(path):
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_attention_heads"]
    (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


CASES = {
    "no tokenizer files": (lambda p: None, "has no tokenizer files"),
    "config.json without num_attention_heads": (_drop_heads,
                                                "config.json has no 'num_attention_heads'"),
    "truncated safetensors": (_truncate, "model.safetensors is not a readable safetensors file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_hf_directory_is_one_error_before_compiling(case, saved, tmp_path, capsys, caplog):
    edit, words = CASES[case]
    hf = _copy(saved, tmp_path / "hf")
    edit(hf)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        code = train_grpo.main([TINY, f"run.dir={tmp_path / 'run'}", f"model.hf_path={hf}",
                                "task.name=jsonl", f"task.path={data}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: config key 'model.hf_path'") and words in err[0], err[0]
    assert not [r for r in caplog.records if "ompil" in r.getMessage()]
