"""The config's part of the drafter kinds (`jaxspec.draft_kinds`): it sits below both the
config and `jaxspec.rl`, and it refuses rollout.method=rejection for the kinds whose
drafters cannot provide the draft probabilities, before anything compiles."""

import pathlib
import subprocess
import sys

import pytest

from jaxspec import draft_kinds
from jaxspec.config import ConfigError, load_config
from jaxspec.decoding.block import BlockDrafter
from jaxspec.decoding.drafters import DraftModelDrafter, NGramDrafter, NoDrafter
from jaxspec.decoding.history import HistoryDrafter, HybridDrafter

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_the_config_imports_nothing_that_imports_it_back():
    """`import jaxspec.config` and loading a config import no trainer module (rl.kinds,
    rl.plan: they import the config), only the library leaves the config's sections are
    (rl.grpo's GRPOConfig, rl.tasks' registry), and none of those imports the config."""
    code = ("import sys, jaxspec.config as c; c.load_config(sys.argv[1]); "
            "print(' '.join(m for m in sys.modules if m.startswith('jaxspec.rl')))")
    out = subprocess.run([sys.executable, "-c", code, TINY], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert "jaxspec.rl.kinds" not in out and "jaxspec.rl.plan" not in out, out
    assert set(out) <= {"jaxspec.rl", "jaxspec.rl.grpo", "jaxspec.rl.tasks", "jaxspec.rl.answers"}
    for name in out:
        path = ROOT / (name.replace(".", "/") + ("/__init__.py" if name == "jaxspec.rl" else ".py"))
        assert "jaxspec.config" not in path.read_text(), name


def test_every_trainer_kind_has_the_rules_the_config_checks():
    from jaxspec.rl import kinds

    assert list(kinds.KINDS) == list(draft_kinds.RULES)
    for name, kind in kinds.KINDS.items():
        assert draft_kinds.RULES[name] == kind, name  # one registration fills both


# Which drafters sample their chains with probabilities: the drafter classes' own answer
# (an EAGLE-3 / MTP head does for chains), not the rules' copy.
REJECTION = {"none": NoDrafter.supports_rejection, "eagle3": True, "mtp": True,
             "draft_model": DraftModelDrafter.supports_rejection,
             "ngram": NGramDrafter.supports_rejection,
             "history": HistoryDrafter.supports_rejection,
             "hybrid": HybridDrafter.supports_rejection,
             "block": BlockDrafter.supports_rejection,
             "hybrid_block": HybridDrafter.supports_rejection}


@pytest.mark.parametrize("kind", sorted(REJECTION))
def test_rejection_is_refused_by_the_config_for_kinds_without_draft_probabilities(kind):
    extra = ["draft.model={num_layers: 1}"] if kind == "draft_model" else []
    overrides = [f"draft.kind={kind}", "rollout.method=rejection", *extra]
    if REJECTION[kind]:
        assert load_config(TINY, overrides).rollout.method == "rejection"
        return
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    e = info.value
    assert e.key == "rollout.method" and e.value == "rejection", str(e)
    assert f"draft kind '{kind}' does not draw its drafts with their probabilities" in str(e)
    assert "'replay'" in e.valid and "eagle3" in e.valid and kind not in e.valid.split(" / ")


def test_the_script_stops_with_one_error_line_and_exit_2(tmp_path):
    """Through scripts/train_grpo.py: one `error:` line naming the key, exit 2, and no
    compile (it returns before the trainer is built: no run.dir, no 'warm-up' line)."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "scripts/train_grpo.py", TINY, "draft.kind=history",
                           "rollout.method=rejection", f"run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in done.stderr.splitlines() if line.strip()], done.stderr
    assert len(errors) == 1 and "'rollout.method' = 'rejection'" in errors[0]
    assert "warm-up" not in done.stdout and not run_dir.exists()
