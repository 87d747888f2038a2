"""The persistent compilation cache the scripts turn on (jaxspec.compilation_cache), and a
`--resume` of a run that already finished: one line and exit 0, before anything compiles."""

import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache as jax_cache
from jax._src import monitoring

from jaxspec import compilation_cache
from jaxspec.config import load_config
from jaxspec.models import Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SHORT = ["warmup.steps=0", "warmup.draft_steps=0", "rollout.prompts_per_step=4",
         "rollout.group_size=2", "run.compare_plain=0", "run.steps=3"]
train_grpo = load_script("train_grpo")

_KEYS = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
         "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def jax_cache_settings():
    """The suite's cache settings, put back after the test (JAX opens its cache once per
    process, at the first compile: `reset_cache` makes it reopen the directory set now)."""
    saved = {k: getattr(jax.config, k) for k in _KEYS}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    jax_cache.reset_cache()


@pytest.mark.quick
@pytest.mark.parametrize("env, expected", [
    ({}, "{home}/.cache/jaxspec/jax"),
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/jaxspec/jax"),
    ({"JAXSPEC_COMPILATION_CACHE": "{tmp}/mine"}, "{tmp}/mine"),
    ({"JAXSPEC_COMPILATION_CACHE": "0"}, None),
    ({"JAXSPEC_COMPILATION_CACHE": "off", "XDG_CACHE_HOME": "{tmp}/xdg"}, None),
])
def test_the_cache_directory_per_user_and_its_switch(env, expected, tmp_path, monkeypatch,
                                                     jax_cache_settings):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CACHE_HOME", "JAXSPEC_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    before = jax.config.jax_compilation_cache_dir
    got = compilation_cache.enable()
    if expected is None:
        assert got is None and jax.config.jax_compilation_cache_dir == before
        return
    expected = expected.format(home=home, tmp=tmp_path)
    assert got == expected and pathlib.Path(expected).is_dir()
    assert jax.config.jax_compilation_cache_dir == expected
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compilation_cache.MIN_COMPILE_SECONDS


@pytest.mark.quick
def test_a_users_jax_cache_dir_wins(tmp_path, monkeypatch, jax_cache_settings):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
    monkeypatch.setenv("JAXSPEC_COMPILATION_CACHE", str(tmp_path / "ours"))
    before = jax.config.jax_compilation_cache_dir
    assert compilation_cache.enable() == str(tmp_path / "theirs")
    assert jax.config.jax_compilation_cache_dir == before  # JAX read its own variable
    assert not (tmp_path / "ours").exists()


def test_a_second_compile_reads_the_first_from_disk(tmp_path, jax_cache_settings):
    """Turned on in an empty directory, a program compiled once is written there; compiled
    again after the in-memory caches are dropped, it is a cache hit (JAX's own event)."""
    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    assert compilation_cache.enable(tmp_path, min_compile_seconds=0) == str(tmp_path)
    jax_cache.reset_cache()  # (a script enables it before its first compile)

    def f(x):  # a program of its own (the constant), compiled nowhere else
        return jnp.sin(x) * 0.123456789 + jnp.cumsum(x)

    x = jnp.arange(7.0)
    want = jax.jit(f)(x)
    assert any(tmp_path.iterdir())
    jax.clear_caches()
    events.clear()
    got = jax.jit(f)(x)
    assert "/jax/compilation_cache/cache_hits" in events
    assert jnp.array_equal(got, want)


@pytest.mark.quick
def test_resuming_a_finished_run_says_so_before_compiling(tmp_path, monkeypatch, capsys):
    """A run dir whose checkpoint is at run.steps and whose export is written: `--resume`
    prints one line naming the step and what to do, exits 0 and builds no trainer."""
    run = tmp_path / "run"
    cfg = load_config(TINY, SHORT + [f"run.dir={run}"])
    policy = Policy.init(cfg.model.model_config(25), jax.random.key(0))
    head = Eagle3Head.init_for(policy, 25, jax.random.key(1))
    trainer = GRPOTrainer(cfg, policy=policy, head=head, log=lambda line: None)
    trainer.write_config()
    trainer.completed = 3  # as the last step leaves it
    trainer.save()
    (run / "policy").mkdir()
    (run / "policy" / "config.json").write_text("{}")

    def no_trainer(*args, **kwargs):
        raise AssertionError("a finished run built a trainer (and compiled)")

    monkeypatch.setattr("jaxspec.rl.trainer.GRPOTrainer", no_trainer)
    argv = [TINY, *SHORT, f"run.dir={run}", "--resume"]
    assert train_grpo.main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())  # (lines wrap at 120 columns)
    assert f"{run}: the run already finished (checkpoint at step 3, run.steps=3)" in text
    assert "run.steps=N with N > 3" in text
    # more steps asked: it resumes (a trainer is built)
    with pytest.raises(AssertionError, match="built a trainer"):
        train_grpo.main(argv + ["run.steps=4"])
