"""The config schema: files, overrides, validation messages, round-trip, one default and
one check per key, and the import weight of `jaxspec.config`."""

import dataclasses
import inspect
import math
import pathlib
import subprocess
import sys
import tempfile

import pytest

from jaxspec import config as C
from jaxspec import parallel
from jaxspec.config import Config, ConfigError, load_config
from jaxspec.decoding.drafters import NGramDrafter, TreeSpec
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models.config import ModelConfig
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.plan import prepare_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
QWEN = ROOT / "configs" / "qwen3_8b_eagle3.yaml"


def test_tiny_yaml_is_the_embedded_default():
    cfg = load_config(TINY)
    assert cfg == Config() == load_config(None)
    assert cfg.draft.kind == "eagle3" and cfg.draft.k == 3 and cfg.draft.online
    assert cfg.model.hf_path is None and cfg.task.name == "arithmetic"


def test_the_main_job_config_and_the_benchmark_configs_pass_the_run_checks(tmp_path):
    """configs/long.yaml (the README's main job) and configs/small.yaml load and pass every
    check made before compiling, so the README's command cannot rot unseen."""
    import jax

    for name in ("long", "small"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"run.dir={tmp_path / name}"])
        plan = prepare_run(cfg, devices=jax.devices()[:1])  # one CPU device, as a user has
        assert plan.task is not None and plan.tokenizer is not None
    long = load_config(ROOT / "configs" / "long.yaml")
    assert long.task.name == "counting" and long.draft.kind == "hybrid" and long.model.hf_path is None
    assert long.run.compare_plain > 0  # the speedup the README quotes is measured in the run


def test_overrides_are_yaml_scalars():
    cfg = load_config(TINY, ["draft.k=4", "sampling.temperature=0.7", "run.dir=runs/x y",
                             "grpo.clip_c=3", "grpo.tis=token", "draft.tree.top_k=3",
                             "task.params={digits: 3}", "draft.layers=[0, 1, 2]",
                             "run.resume=true", "mesh.rules.embed=null"])
    assert cfg.draft.k == 4
    assert cfg.sampling.temperature == 0.7
    assert cfg.run.dir == "runs/x y"
    assert cfg.grpo.clip_c == 3.0 and isinstance(cfg.grpo.clip_c, float)  # int widened
    assert cfg.grpo.tis == "token"
    assert cfg.draft.tree == TreeSpec(top_k=3)  # a null section is created by its keys
    assert cfg.task.params == {"digits": 3}
    assert cfg.draft.layers == (0, 1, 2)
    assert cfg.run.resume is True
    assert cfg.mesh.rules["embed"] is None and cfg.mesh.rules["mlp"] == "tensor"
    assert load_config(TINY, ["draft.tree.top_k=3", "draft.tree=null"]).draft.tree is None


def _error(overrides, path=TINY, **kw) -> ConfigError:
    """The ConfigError of loading the config, else of planning the run (the host-side checks
    that need the task, tokenizer or devices), in a fresh run.dir."""
    run_dir = ["run.dir=" + tempfile.mkdtemp()] if path == TINY else []
    with pytest.raises(ConfigError) as info:
        prepare_run(load_config(path, run_dir + list(overrides), **kw))
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
    ("sampling.temperature=.inf", "sampling.temperature", "not a finite number"),
    ("sampling.top_p=0", "sampling.top_p", "(0, 1]"),
    ("sampling.top_p=1.5", "sampling.top_p", "(0, 1]"),
    ("sampling.top_k=-1", "sampling.top_k", ">= 0"),
    ("optim.lr=inf", "optim.lr", "a finite number"),
    ("optim.lr=.inf", "optim.lr", "not a finite number"),
    ("optim.lr=.nan", "optim.lr", "not a finite number"),
    ("draft_optim.eps=-1e-8", "draft_optim.eps", "> 0"),
    ("grpo.kl_coef=.nan", "grpo.kl_coef", "not a finite number"),
    ("rollout.group_size=1", "rollout.group_size", ">= 2"),
    ("rollout.method=beam", "rollout.method", "'greedy', 'replay', 'rejection'"),
    ("rollout.method=replya", "rollout.method", "did you mean 'replay'"),
    ("draft.kind=eagle", "draft.kind", "did you mean 'eagle3'"),
    ("draft.collapse_threshold=4.5", "draft.collapse_threshold", "draft.k + 1 = 4"),
    ("draft.tree={top_k: 2, depth: 2, budget: 3}", None, None),  # valid
    ("draft.tree={top_k: 2, depth: 2, budget: 40}", "draft.tree.budget", "40"),
    ("draft.tree.depth=0", "draft.tree.depth", "depth"),
    ("grpo.loss_agg=seq", "grpo.loss_agg", "'token', 'sequence'"),
    ("grpo.clip_c=0.5", "grpo.clip_c", "> 1"),
    ("grpo.eps_low=1.0", "grpo.eps_low", "[0, 1)"),
    ("grpo.advantage=ppo", "grpo.advantage", "'grpo', 'rloo'"),
    ("grpo.loss=clipped", "grpo.loss", "did you mean 'clipped_pg'"),
    ("grpo.minibatches=7", "grpo.minibatches", "a divisor of 64"),
    ("draft.ngram.max_n=0", "draft.ngram.max_n", "min_n <= max_n"),
    ("draft.ngram={min_n: 3, max_n: 2}", "draft.ngram.min_n", "min_n <= max_n"),
    ("model.num_kv_heads=3", "model.num_kv_heads", "divide num_heads"),
    ("model.head_dim=15", "model.head_dim", "even"),
    ("model.rope_theta=.inf", "model.rope_theta", "not a finite number"),
    ("model.rope_scaling={factr: 2}", "model.rope_scaling.factr", "did you mean"),
    ("model.vocab_size=0", "model.vocab_size", "positive"),
    ("model.vocab_size=10", "model.vocab_size", ">= 25"),
    ("model.dtype=fp16", "model.dtype", "'float32', 'bfloat16'"),
    ("model.attention_backend=pallsa", "model.attention_backend", "did you mean 'pallas'"),
    ("model.attention_backend=auto", None, None),  # valid: the library resolves it
    ("draft.layers=[0, 1, 9]", "draft.layers", "[0, 3]"),
    ("draft.layers=[0, 1]", "draft.layers", "a list of 3 values"),
    ("draft.draft_vocab_size=100", "draft.draft_vocab_size", "<= 25"),
    ("draft.kind=draft_model", "draft.model", "draft.hf_path"),
    ("draft.kind=ngram", None, None),  # valid: no error
    ("draft.kind=mtp", None, None),  # valid: a fresh MTP head trained online
    ("rollout.method=greedy", "rollout.method", "temperature=0"),
    ("rollout.max_prompt_len=250", "rollout.max_prompt_len", "an int in [1, 244]"),
    # no prompt fits beside 300 new tokens: the key set is named, with a range that is not negative
    ("rollout.max_new_tokens=300", "rollout.max_new_tokens", "valid: an int in [1, 236]"),
    ("rollout.max_new_tokens=240", "rollout.max_prompt_len", "rollout.max_new_tokens in [1, 236]"),
    ("rollout.method=rejection", None, None),  # valid with kind eagle3's chains
    ("rollout.max_prompt_len=2", "rollout.max_prompt_len", "tokens"),
    ("async.enabled=true", "grpo.tis", "'token' or 'sequence'"),
    ("mesh.rules.embed=model", "mesh.rules.embed", "unknown mesh axis"),
    ("mesh.rules.embedding=fsdp", "mesh.rules.embedding", "unknown logical axis"),
    ("mesh.data=0", "mesh.data", "-1 for the remaining devices"),
    ("mesh.fsdp=-1", "mesh.fsdp", "at most one axis may be -1"),
    ("mesh.tensor=2", "mesh.tensor", "vocabulary (25)"),
    ("mesh.tensor=3", "mesh.tensor", "vocabulary (25)"),
    ("run.dir=''", "run.dir", "not empty"),
    ("task.name=addition", "task.name", "'arithmetic', 'countdown', 'jsonl'"),
    ("task.name=jsonl", "task.path", "JSONL file"),
    ("task.params={digits: 0}", "task.params", "digits must be >= 1"),
    ("task.params={ops: '/'}", "task.params", "ops must be"),
    ("model.hf_path=/no/such/dir", "model.hf_path", "local HF directory"),
    ("draft.k", "draft.k", "key=value"),
])
def test_bad_values_name_key_value_and_what_is_valid(override, key, words, tmp_path):
    if key is None:
        prepare_run(load_config(TINY, [override, f"run.dir={tmp_path}"]))
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
    cfg = load_config(TINY, ["draft.tree.top_k=3", "grpo.clip_c=3", "draft.layers=[0, 1, 2]",
                             "model.rope_scaling={factor: 4.0}", "optim.lr=1e-5",
                             "task.params={digits: 3}", "async.enabled=true",
                             "grpo.tis=sequence"])
    C.save(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(tmp_path / "run" / "config.yaml") == cfg
    assert C.from_dict(C.to_dict(cfg)) == cfg
    plain = C.to_dict(cfg)
    assert "async" in plain and "async_" not in plain
    assert plain["draft"]["layers"] == [0, 1, 2]
    assert plain["model"]["rope_scaling"]["factor"] == 4.0


SAVED_OVERRIDES = ["draft.kind=hybrid", "draft.history.depth=5", "draft.history.budget=6",
                   "draft.tree=null", "model.rope_scaling={factor: 4.0}", "optim.lr=1e-5",
                   "task.name=counting", "async.enabled=true", "grpo.tis=sequence",
                   "mesh.rules.embed=null", "rollout.slots=8", "draft.layers=[0, 1, 2]",
                   "run.dir=runs/saved"]


def test_a_config_saved_by_an_earlier_version_still_loads():
    """A resumed run reads its saved config.yaml: one written by the hand-written loader
    (commit 5503b03, from SAVED_OVERRIDES) loads to the same Config, and today's writer
    produces the same data plus the keys added since, at their defaults."""
    path = ROOT / "tests" / "data" / "config_saved_at_5503b03.yaml"
    saved = load_config(path, check_paths=False)
    assert saved == load_config(TINY, SAVED_OVERRIDES, check_paths=False)
    added_since = {("run", "wandb"): None,
                   ("draft", "block"): C.to_dict(C.Config())["draft"]["block"],
                   ("model", "num_experts"): 0,
                   ("model", "num_experts_per_tok"): 0, ("model", "moe_intermediate_size"): 0,
                   ("model", "norm_topk_prob"): False, ("model", "decoder_sparse_step"): 1,
                   ("model", "mlp_only_layers"): [], ("model", "shared_expert_intermediate_size"): 0,
                   ("model", "expert_backend"): "blocked", ("model", "fused_kernels"): "auto",
                   ("model", "train_attention"): "auto",
                   ("model", "layer_types"): [], ("model", "linear_num_key_heads"): 0,
                   ("model", "linear_num_value_heads"): 0, ("model", "linear_key_head_dim"): 0,
                   ("model", "linear_value_head_dim"): 0, ("model", "linear_conv_kernel_dim"): 0,
                   ("model", "partial_rotary_factor"): 1.0,
                   ("mesh", "expert"): 1,
                   ("grpo", "router_aux_coef"): 0.0, ("grpo", "router_z_coef"): 0.0}
    written = C.to_dict(saved)
    for (section, key), default in added_since.items():
        assert written[section].pop(key) == default
    assert written["mesh"]["rules"].pop("experts") == "expert"  # a rule added since
    assert written["draft"]["history"].pop("chain") is False  # a key added since
    assert written == C._yaml_load(path.read_text())


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


def test_exponent_floats_parse_on_the_command_line_and_in_yaml(tmp_path):
    cfg = load_config(TINY, ["optim.lr=1e-5", "draft_optim.lr=3E-4", "grpo.tis_cap=1e+1",
                             "draft.collapse_threshold=1.5e0"])
    assert cfg.optim.lr == 1e-5 and cfg.draft_optim.lr == 3e-4
    assert cfg.grpo.tis_cap == 10.0 and cfg.draft.collapse_threshold == 1.5
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-6\n  eps: 1E-8\ngrpo:\n  kl_coef: .5\n"
                    "run:\n  steps: 10\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 1e-6 and cfg.optim.eps == 1e-8 and cfg.grpo.kl_coef == 0.5
    assert cfg.run.steps == 10 and isinstance(cfg.run.steps, int)  # ints stay ints
    path.write_text("run:\n  dir: 1e3\n")
    e = _error([], path)  # a float where a string is expected is still refused
    assert e.key == "run.dir" and "a string" in str(e)
    assert C._yaml_load("[.inf, -.inf, 1E+3, 7, 0x10, '1e-5']")[:4] == [math.inf, -math.inf,
                                                                         1000.0, 7]
    assert C._yaml_load("x: 1e-5")["x"] == 1e-5 and C._yaml_load("'1e-5'") == "1e-5"


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    e = _error([f"run.dir={f}"])
    assert e.key == "run.dir" and "existing file" in str(e)


def test_collapse_threshold_limit_follows_the_tree_depth():
    assert load_config(TINY, ["draft.collapse_threshold=4"]).draft.collapse_threshold == 4
    e = _error(["draft.tree={top_k: 2, depth: 2, budget: 4}", "draft.collapse_threshold=3.5"])
    assert e.key == "draft.collapse_threshold" and "draft.tree.depth + 1 = 3" in str(e)
    assert load_config(TINY, ["draft.kind=none", "draft.collapse_threshold=9"])


def test_triton_without_cuda_is_refused_before_compiling():
    if any(d.platform == "gpu" for d in __import__("jax").devices()):
        pytest.skip("this machine has a GPU")
    e = _error(["model.attention_backend=triton"])
    assert e.key == "model.attention_backend" and "needs a CUDA GPU" in str(e)


def test_vocabulary_split_is_checked_at_load_or_in_prepare_run():
    e = _error(["model.vocab_size=26", "mesh.tensor=4"])  # known when loading
    assert e.key == "mesh.tensor" and "(26)" in str(e)
    assert load_config(TINY, ["model.vocab_size=28", "mesh.tensor=4"]).mesh.shards("vocab") == 4
    e = _error(["mesh.rules.vocab=fsdp", "mesh.fsdp=2"])
    assert e.key == "mesh.rules.vocab" and "(25)" in str(e)
    # data = -1 is only known with the devices (8 here): prepare_run checks, before compiling
    load_config(TINY, ["mesh.rules.vocab=data"])
    e = _error(["mesh.rules.vocab=data"])
    assert e.key == "mesh.rules.vocab" and "vocabulary (25)" in str(e)


def test_each_key_has_one_default_the_librarys():
    cfg = Config()
    # sections that are library classes, or take their defaults from them
    assert type(cfg.grpo) is GRPOConfig and cfg.grpo == GRPOConfig()
    assert load_config(TINY, ["draft.tree={}"]).draft.tree == TreeSpec()
    assert C.TreeSpec is TreeSpec and C.GRPOConfig is GRPOConfig
    sampling_defaults = {f.name: f.default for f in dataclasses.fields(SamplingConfig)}
    assert dataclasses.asdict(cfg.sampling) == sampling_defaults
    ngram_defaults = {f.name: f.default for f in dataclasses.fields(NGramDrafter)}
    assert dataclasses.asdict(cfg.draft.ngram) == {k: ngram_defaults[k] for k in ("min_n", "max_n")}
    tiny = ModelConfig.tiny("qwen3", num_layers=4, max_position_embeddings=256)
    model = {f.name for f in dataclasses.fields(C.ModelSpec)}
    assert model - {"hf_path"} == {f.name for f in dataclasses.fields(ModelConfig)}
    assert cfg.model.model_config(tiny.vocab_size) == tiny
    mesh_defaults = inspect.signature(parallel.make_mesh).parameters
    assert [getattr(cfg.mesh, a) for a in parallel.MESH_AXES] == [
        mesh_defaults[a].default for a in parallel.MESH_AXES]
    assert cfg.mesh.rules == parallel.DEFAULT_RULES
    # configs/tiny.yaml may list fewer rules: the others are parallel's
    assert load_config(TINY, ["mesh.rules={embed: null}"]).mesh.rules == {
        **parallel.DEFAULT_RULES, "embed": None}


def test_library_checks_are_the_schema_checks():
    """A library class's own ValueError becomes the ConfigError of the dotted key."""
    with pytest.raises(ValueError, match="TreeSpec"):
        TreeSpec(top_k=0)
    e = _error(["draft.tree.top_k=0"])
    assert e.key == "draft.tree.top_k" and "TreeSpec" not in str(e).split(":", 1)[0]
    with pytest.raises(ValueError):
        GRPOConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig.tiny(attention_backend="cuda")
    assert ModelConfig.tiny(attention_backend="auto").attention_backend == "auto"


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(*sys.modules)"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def test_importing_the_config_is_light():
    """The config imports the library classes that are its schema (and so jax), but neither
    the trainer nor checkpointing; loading a file imports nothing more of them."""
    for code in ("import jaxspec.config",
                 "import jaxspec.config as C; C.load_config('configs/tiny.yaml')"):
        mods = _modules_after(code)
        for heavy in ("orbax", "jaxspec.rl.trainer", "jaxspec.checkpoint", "jaxspec.rl.drafting"):
            assert heavy not in mods, (code, heavy)
