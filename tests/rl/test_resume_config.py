"""`--resume` against the config the run saved: a change to what the checkpoint holds is one
`error:` line naming the keys, before orbax or any compile; other changes are listed in one
line and recorded in config_history.jsonl, with config.yaml kept."""

import json
import logging
import pathlib

import jax
import pytest
import yaml

from jaxspec.config import load_config, to_dict
from jaxspec.models import Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.rl import plan as plan_lib
from jaxspec.rl.state import config_changes
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
train_grpo = load_script("train_grpo")

TINY = str(ROOT / "configs" / "tiny.yaml")
BASE = ["warmup.steps=0", "warmup.draft_steps=0", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "run.compare_plain=0", "run.steps=4", "draft.k=4"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run dir as a first start leaves it: config.yaml and the checkpoint of step 0."""
    run = tmp_path_factory.mktemp("resume") / "run"
    cfg = load_config(TINY, BASE + [f"run.dir={run}"])
    policy = Policy.init(cfg.model.model_config(25), jax.random.key(0))
    head = Eagle3Head.init_for(policy, 25, jax.random.key(1))
    trainer = GRPOTrainer(cfg, policy=policy, head=head, log=lambda line: None)
    trainer.write_config()
    trainer.save()
    return run, (run / "config.yaml").read_text()


SHAPING = {
    "draft k (a run resumed without its draft.k override)": (["draft.k=3"], "draft.k"),
    "draft kind": (["draft.kind=ngram"], "draft.kind"),
    "model width": (["model.hidden_size=32"], "model.hidden_size"),
    "tree": (["draft.tree={top_k: 2, depth: 2, budget: 4}"], "draft.tree"),
    "optimizer structure": (["optim.clip_norm=null"], "optim.clip_norm"),
    "two keys": (["model.num_layers=2", "rollout.group_size=4"],
                 "model.num_layers, rollout.group_size"),
}


@pytest.mark.parametrize("case", list(SHAPING))
def test_a_change_to_the_state_is_one_error_before_orbax(case, saved_run, capsys, caplog,
                                                         monkeypatch):
    run, saved_yaml = saved_run
    change, keys = SHAPING[case]

    def untouched(*a, **k):
        raise AssertionError("orbax was touched")

    monkeypatch.setattr(plan_lib, "CheckpointManager", untouched)
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        code = train_grpo.main([TINY, *BASE, f"run.dir={run}", *change, "--resume"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: config key '{keys}'"), err[0]
    for key in keys.split(", "):
        assert f"{key}:" in err[0]  # each key with its saved and new value
    assert "config.yaml" in err[0] and "new run.dir" in err[0]
    assert not [r for r in caplog.records if "ompil" in r.getMessage()]
    assert (run / "config.yaml").read_text() == saved_yaml


def test_other_changes_are_listed_and_recorded(saved_run):
    run, saved_yaml = saved_run
    lines = []
    cfg = load_config(TINY, BASE + [f"run.dir={run}", "run.steps=7", "optim.lr=5e-4",
                                    "run.log_every=2", "run.resume=true"])
    trainer = GRPOTrainer(cfg, log=lines.append)
    want = {"optim.lr": (0.001, 0.0005), "run.log_every": (1, 2), "run.steps": (4, 7)}
    assert trainer.plan.config_changes == want
    assert trainer.completed == 0 and trainer.cfg.optim.lr == 0.0005  # resumed, new values
    listed = [line for line in lines if line.startswith("resuming with changes")]
    assert listed == ["resuming with changes to the saved config: optim.lr 0.001 -> 0.0005, "
                      "run.log_every 1 -> 2, run.steps 4 -> 7 (recorded in "
                      f"{run}/config_history.jsonl)"]
    trainer.write_config()
    assert (run / "config.yaml").read_text() == saved_yaml  # kept: the first start's config
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["resumed_at_step"] == 0
    assert history[-1]["changes"] == {k: list(v) for k, v in want.items()}


def test_resuming_from_the_saved_config_changes_nothing(saved_run):
    """docs/training.md: `train_grpo.py <run.dir>/config.yaml --resume` is the run as saved."""
    run, _ = saved_run
    cfg = load_config(run / "config.yaml", ["run.resume=true"])
    assert plan_lib.prepare_run(cfg).config_changes == {}


def test_config_changes_classifies_against_a_hand_written_table():
    saved = to_dict(load_config(TINY, BASE))
    now = yaml.safe_load(yaml.safe_dump(saved))
    now["optim"]["clip_norm"] = 0.5  # a value, not the structure
    now["grpo"]["kl_coef"] = 0.0  # the reference leaves the checkpoint
    now["model"]["attention_backend"] = "pallas"  # how, not what
    now["mesh"]["fsdp"] = 2
    now["sampling"]["temperature"] = 0.7
    now["run"]["dir"] = "elsewhere"  # the run dir itself
    shaping, other = config_changes(saved, now)
    assert shaping == {"grpo.kl_coef": (0.01, 0.0)}
    assert other == {"optim.clip_norm": (1.0, 0.5), "model.attention_backend": ("reference",
                                                                                "pallas"),
                     "mesh.fsdp": (1, 2), "sampling.temperature": (1.0, 0.7)}
