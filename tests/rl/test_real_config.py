"""configs/qwen3_8b_eagle3.yaml end to end, scaled down on the command line, on a tiny random
Qwen3 saved by `transformers` with a real-format tokenizer built here (byte-level BPE, Qwen's
special tokens, a chat template, generation_config.json with two EOS ids): the mesh
(fsdp=-1), the chat template and the EOS list are checked against transformers' own
tokenizer and the rollouts themselves (issue 14)."""

import json
import pathlib

import numpy as np
import pytest

from jaxspec.testing.qwen_tokenizer import PROMPTS, write_tokenizer_files
from jaxspec.testing.scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
QWEN = str(ROOT / "configs" / "qwen3_8b_eagle3.yaml")
MAX_NEW = 12


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random Qwen3 directory as transformers writes it, whose two EOS ids are likely
    next tokens: lm_head rows +c*u and -c*u (u a unit vector) make one of them score c|h.u|,
    so rows end with either id or run to max_new_tokens."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3")
    ids = write_tokenizer_files(path)
    im_end, eot = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        u = torch.randn(64)
        u /= u.norm()
        model.lm_head.weight[im_end] = 6.0 * u
        model.lm_head.weight[eot] = -6.0 * u
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot}))
    data = path.parent / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS))
    return path, data, (im_end, eot)


def _overrides(path, data, run_dir):
    """The shipped config scaled to a CPU test: every key the file sets for an 8B run that a
    tiny model cannot take, and nothing else."""
    return [f"model.hf_path={path}", f"task.path={data}", f"run.dir={run_dir}",
            "model.dtype=float32", "model.attention_backend=reference",
            "draft.hf_path=null", "draft.draft_vocab_size=64", "draft.ttt_steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=4",
            f"rollout.max_new_tokens={MAX_NEW}", "rollout.max_prompt_len=48",
            "warmup.draft_rollouts=8", "warmup.draft_steps=1", "run.steps=2",
            "run.compare_plain=1"]


def test_qwen3_config_runs_with_chat_template_and_every_eos(qwen, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from jaxspec.rl.trainer import GRPOTrainer

    path, data, (im_end, eot) = qwen
    made = []
    init = GRPOTrainer.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(GRPOTrainer, "__init__", keep)
    run_dir = tmp_path / "run"
    assert load_script("train_grpo").main([QWEN, *_overrides(path, data, run_dir)]) == 0
    trainer = made[0]
    # The mesh: fsdp=-1 over every device for training, generation over the same devices.
    assert trainer.train_mesh.shape["fsdp"] == len(trainer.train_mesh.devices.flat) > 1
    assert set(trainer.gen_mesh.devices.flat) == set(trainer.train_mesh.devices.flat)

    # The prompts the policy saw are transformers' own chat-templated encodings.
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    templated = {tuple(hf.apply_chat_template([{"role": "user", "content": p}],
                                              tokenize=True, add_generation_prompt=True,
                                              return_dict=False))
                 for p, _ in PROMPTS}
    batch = trainer.last_batch
    seen = {tuple(row[:n]) for row, n in zip(batch.prompts, batch.prompt_lengths, strict=True)}
    assert seen <= templated and len(seen) == 2

    # Both EOS ids stop generation: each ends some rows, neither appears before a row's end.
    rows = [list(t[:n]) for t, n in zip(batch.tokens, batch.lengths, strict=True)]
    ended = [r[-1] in (im_end, eot) for r in rows]
    assert all(im_end not in r[:-1] and eot not in r[:-1] for r in rows)
    assert {r[-1] for r in rows if r[-1] in (im_end, eot)} == {im_end, eot}
    assert all(e or len(r) == MAX_NEW for r, e in zip(rows, ended, strict=True))
    np.testing.assert_array_equal(batch.ended, ended)
    assert 0 < sum(ended) < len(rows)  # some rows were truncated: scored 0
    assert all(reward == 0 for reward, e in zip(batch.rewards, ended, strict=True) if not e)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[-1]["fraction_properly_ended"] == pytest.approx(np.mean(ended))
    assert lines[0]["replay_identical"] == 1.0


def test_train_draft_with_the_qwen3_config(qwen, tmp_path):
    """The placeholder draft.hf_path of the shipped config is ignored: a new head."""
    path, data, _ = qwen
    run_dir = tmp_path / "draft"
    overrides = [o for o in _overrides(path, data, run_dir) if not o.startswith("draft.hf_path")]
    assert load_script("train_draft").main([QWEN, *overrides]) == 0
    config = json.loads((run_dir / "eagle3" / "config.json").read_text())
    assert config["draft_vocab_size"] == 64


def test_a_later_prompt_too_long_once_templated_is_one_error_before_compiling(
        qwen, tmp_path, capsys, caplog):
    """The whole JSONL is checked at plan time, as the policy will see it (templated): the
    last prompt fits max_prompt_len as raw text, not inside the chat template."""
    import logging

    import jax
    from transformers import AutoTokenizer

    path, _, _ = qwen
    long = "What is " + " + ".join(str(i) for i in range(1, 16)) + "?"
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    raw = len(hf.encode(long, add_special_tokens=False))
    templated = len(hf.apply_chat_template([{"role": "user", "content": long}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False))
    assert raw < templated
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                            for p, a in PROMPTS + [(long, "120")]))
    overrides = [*_overrides(path, data, tmp_path / "run"), f"rollout.max_prompt_len={raw}"]
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        assert load_script("train_grpo").main([QWEN, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config key 'rollout.max_prompt_len'"), err
    assert f"prompt {len(PROMPTS)} " in err[0] and f"has {templated} tokens" in err[0], err[0]
    assert not [r for r in caplog.records if "ompil" in r.getMessage()]


@pytest.mark.parametrize("mesh,n_gen,n_train,gen,train", [
    ((1, -1, 1), 8, 8, (1, 8, 1), (1, 8, 1)),  # the shipped config: fsdp over every device
    ((2, -1, 1), 8, 8, (2, 4, 1), (2, 4, 1)),
    ((1, -1, 2), 8, 8, (1, 4, 2), (1, 4, 2)),
    ((-1, 2, 1), 8, 8, (4, 2, 1), (4, 2, 1)),  # the tiny configs' data=-1 as before
    ((1, -1, 1), 2, 6, (1, 2, 1), (1, 6, 1)),  # async: a smaller generation group
    ((1, 2, -1), 8, 8, (1, 2, 4), (1, 2, 4)),
])
def test_generation_mesh_resolves_the_training_fsdp(mesh, n_gen, n_train, gen, train):
    """Generation: the training mesh's fsdp and tensor sizes (resolved), data the rest;
    checked against the meshes `make_mesh` builds from the sizes."""
    import types

    import jax

    from jaxspec import parallel
    from jaxspec.rl.cluster import mesh_sizes

    spec = types.SimpleNamespace(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    sizes = mesh_sizes(spec, n_gen, n_train)
    devices = jax.devices()
    for key, n, want in (("generation", n_gen, gen), ("training", n_train, train)):
        built = parallel.make_mesh(*sizes[key], devices[:n])
        assert tuple(built.shape[a] for a in ("data", "fsdp", "tensor")) == want, key
