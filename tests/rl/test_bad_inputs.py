"""Issue 14's bad inputs that used to reach a traceback: each is now one `error:` line from
scripts/train_grpo.py naming the key, the value and what is valid, before anything compiles
(and before a weight is read)."""

import json
import logging
import pathlib

import jax
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.models import ModelConfig, Policy, save_hf
from jaxspec.models.eagle3 import Eagle3Head, save_eagle3
from jaxspec.testing.scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
train_grpo = load_script("train_grpo")

TINY = str(ROOT / "configs" / "tiny.yaml")
# the tiny run's policy: 4 layers, hidden 64, the character tokenizer's 25 ids
POLICY = ModelConfig.tiny(vocab_size=25, hidden_size=64, num_layers=4)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _truncate(path, name):
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])


def _narrow(path, name, tensor):
    tensors = load_file(path / name)
    tensors[tensor] = tensors[tensor][..., :-1].copy()
    save_file(tensors, str(path / name), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Heads and HF directories, good and broken."""
    root = tmp_path_factory.mktemp("bad")
    policy = Policy.init(POLICY, jax.random.key(0))
    save_eagle3(Eagle3Head.init_for(policy, 16, jax.random.key(1)), root / "head")
    save_eagle3(Eagle3Head.init_for(policy, 16, jax.random.key(1), capture_layers=(1, 2, 6)),
                root / "head_outside")
    _truncate(_copy(root / "head", root / "head_truncated"), "model.safetensors")
    (_copy(root / "head", root / "head_no_weights") / "model.safetensors").unlink()
    _narrow(_copy(root / "head", root / "head_wrong_shape"), "model.safetensors", "fc.weight")
    save_hf(Policy.init(ModelConfig.tiny(vocab_size=40), jax.random.key(2)), root / "hf")
    (_copy(root / "hf", root / "hf_no_weights") / "model.safetensors").unlink()
    _narrow(_copy(root / "hf", root / "hf_wrong_shape"), "model.safetensors",
            "model.layers.0.mlp.up_proj.weight")
    (root / "a_file").write_text("not a directory\n")
    (root / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return root


def _hf(name):
    return [f"model.hf_path={{root}}/{name}", "task.name=jsonl", "task.path={root}/data.jsonl"]


CASES = {
    "triton on CPU": (["model.attention_backend=triton"], "model.attention_backend",
                      "needs a CUDA GPU", "'reference'/'pallas' off CUDA"),
    "draft.layers outside the policy": (["draft.layers=[1,2,4]"], "draft.layers",
                                        "out of range", "[0, 3]"),
    "head capturing outside the policy": (["draft.hf_path={root}/head_outside"], "draft.hf_path",
                                          "captures layer outputs [1, 2, 6]",
                                          "layer outputs in [0, 3]"),
    "draft.layers other than the head's": (["draft.hf_path={root}/head", "draft.layers=[0,1,2]"],
                                           "draft.layers", "trained on layer outputs [1, 1, 0]",
                                           "null or [1, 1, 0]"),
    "truncated head safetensors": (["draft.hf_path={root}/head_truncated"], "draft.hf_path",
                                   "model.safetensors is not a readable safetensors file",
                                   "complete *.safetensors"),
    "head without weights": (["draft.hf_path={root}/head_no_weights"], "draft.hf_path",
                             "no *.safetensors weights", "complete *.safetensors"),
    "head with a wrong shape": (["draft.hf_path={root}/head_wrong_shape"], "draft.hf_path",
                                "wrong shapes ['fc.weight: checkpoint (64, 191), config "
                                "(64, 192)'", "an EAGLE-3 head"),
    "HF directory without weights": (_hf("hf_no_weights"), "model.hf_path",
                                     "no *.safetensors weights", "complete *.safetensors"),
    "HF directory with a wrong shape": (_hf("hf_wrong_shape"), "model.hf_path",
                                        "model.layers.0.mlp.up_proj.weight: checkpoint "
                                        "(128, 63), config (128, 64)", "complete *.safetensors"),
    "mesh.tensor not dividing the vocabulary": (["mesh.tensor=2"], "mesh.tensor",
                                                "vocabulary (25) does not split into 2 shards",
                                                "divides 25"),
    "run.dir empty": (["run.dir=''"], "run.dir", "out of range", "not empty"),
    "run.dir missing": (["run.dir="], "run.dir", "None: wrong type", "a string"),
    "run.dir an existing file": (["run.dir={root}/a_file"], "run.dir",
                                 "an existing file, not a directory", "a directory"),
    "optim.lr inf": (["optim.lr=.inf"], "optim.lr", "not a finite number", "a finite number"),
    "optim.lr 'inf'": (["optim.lr=inf"], "optim.lr", "not a finite number", "a finite number"),
    "tree top_k over the vocabulary": (["draft.tree={{top_k: 30, depth: 2, budget: 8}}"],
                                       "draft.tree.top_k", "larger than the draft vocabulary "
                                       "(25 tokens)", "<= 25"),
    "tree top_k over the draft vocabulary": (["draft.draft_vocab_size=16",
                                              "draft.tree={{top_k: 20, depth: 2, budget: 8}}"],
                                             "draft.tree.top_k", "(16 tokens)", "<= 16"),
    "tree top_k over a loaded head's vocabulary": (["draft.hf_path={root}/head",
                                                    "draft.tree={{top_k: 20, depth: 2, budget: 8}}"],
                                                   "draft.tree.top_k", "(16 tokens)", "<= 16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_error_line_before_compiling(case, files, tmp_path, capsys, caplog):
    overrides, key, problem, valid = CASES[case]
    overrides = [o.format(root=files) for o in overrides]
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        code = train_grpo.main([TINY, f"run.dir={tmp_path / 'run'}", *overrides])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith(f"error: config key '{key}'"), line
    assert problem in line and "valid: " in line and valid in line.split("valid: ", 1)[1], line
    compiles = [r for r in caplog.records if "ompil" in r.getMessage()]
    assert not compiles, [r.getMessage() for r in compiles][:3]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
