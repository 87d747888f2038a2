"""The run plan: everything a run's inputs can get wrong, settled on the host before anything
compiles — the task and its data, the tokenizer, the policy and draft architectures against
each other and the cache, sampling settings, the device split and meshes, and the checkpoint
to resume from. Values the config schema already checks are not checked again here."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax

from jaxspec import parallel
from jaxspec.checkpoint import CheckpointManager
from jaxspec.config import Config, ConfigError, draft_headroom
from jaxspec.decoding import drafters as drafters_lib
from jaxspec.kernels import resolve_backend
from jaxspec.models import ModelConfig
from jaxspec.rl import tasks as tasks_lib
from jaxspec.rl.build import policy_class
from jaxspec.rl.kinds import KINDS
from jaxspec.rl.cluster import mesh_sizes
from jaxspec.rl.faults import RunDirError, check_run_dir
from jaxspec.rl.tokenizer import HFTokenizer

__all__ = ["HFTokenizer", "RunPlan", "checkpoint_bytes", "inspect_head", "inspect_mtp",
           "prepare_run"]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What `prepare_run` settles on the host before anything is compiled."""

    task: tasks_lib.Task
    tokenizer: Any  # CharTokenizer or HFTokenizer
    model_config: ModelConfig
    draft_model_config: ModelConfig | None  # kind draft_model built from draft.model
    tree: drafters_lib.TreeSpec | None
    generation_devices: tuple
    training_devices: tuple
    resume_step: int | None  # the checkpoint a resumed run restarts from
    # a resumed run's changes from its saved config.yaml: {dotted key: (saved, now)}, none
    # of them to what the checkpoint holds (those are refused)
    config_changes: dict = dataclasses.field(default_factory=dict)


def _inspect_hf(key: str, path: str, dtype: str, backend: str) -> ModelConfig:
    """The directory's ModelConfig, with its config.json, safetensors headers, tensor names
    and shapes checked (no weights read): any problem is one ConfigError on `key`."""
    from jaxspec.models.hf import inspect_hf

    try:
        return inspect_hf(path, dtype, attention_backend=backend)
    except (OSError, ValueError) as e:  # HFCheckpointError, UnsupportedModelError, missing files
        raise ConfigError(key, path, str(e),
                          "a local HF Qwen3/Llama/Qwen3-MoE directory with config.json and "
                          "complete *.safetensors") from None


def inspect_mtp(path: str, model_config: ModelConfig) -> None:
    """The MTP layer of the HF checkpoint in `path` (config.json) checked against the policy.

    Args:
        path: draft.hf_path, a local HF checkpoint with an MTP layer.
        model_config: the policy's.

    Raises:
        ConfigError: on draft.hf_path, when the layer is unreadable or not the policy's.
    """
    from jaxspec.models.mtp import inspect_mtp

    try:
        layer = inspect_mtp(path).layer
    except (OSError, ValueError) as e:
        raise ConfigError("draft.hf_path", path, str(e), "a local HF checkpoint with an MTP "
                          "layer (num_nextn_predict_layers >= 1)") from None
    theirs = (layer.vocab_size, layer.hidden_size, layer.num_layers)
    ours = (model_config.vocab_size, model_config.hidden_size, 1)
    if theirs != ours:
        raise ConfigError("draft.hf_path", path, f"its MTP layer (vocabulary, hidden size) "
                          f"{theirs[:2]} does not match the policy's {ours[:2]}",
                          "an MTP layer made for this policy")


def inspect_head(d, model_config: ModelConfig, dtype: str):
    """The EAGLE-3 head in draft.hf_path checked against the policy and the `draft:`
    section `d` (config.json, safetensors headers, shapes, captured layers; no weights read).

    Args:
        d: the `draft:` section (config.DraftSpec), its hf_path set.
        model_config: the policy's.
        dtype: model.dtype, the head's parameter dtype.

    Returns:
        The head's Eagle3Config.

    Raises:
        ConfigError: the first mismatch, on draft.hf_path, draft.draft_vocab_size or
            draft.layers.
    """
    from jaxspec.models.eagle3 import inspect_eagle3

    path = d.hf_path

    def bad(problem, valid="an EAGLE-3 head trained for this policy (config.json with "
                           "draft_vocab_size, complete *.safetensors)"):
        return ConfigError("draft.hf_path", path, problem, valid)

    try:
        head = inspect_eagle3(path, target_num_layers=model_config.num_layers, dtype=dtype)
    except (OSError, ValueError) as e:
        raise bad(str(e)) from None
    if head.vocab_size != model_config.vocab_size:
        raise bad(f"the head's vocabulary ({head.vocab_size} target ids) does not match the "
                  f"policy's ({model_config.vocab_size})", "a head trained for this policy")
    if model_config.hidden_size not in {head.target_hidden_size} & {head.hidden_size}:
        raise bad(f"the head's hidden size {head.hidden_size} (target {head.target_hidden_size})"
                  f" does not match the policy's {model_config.hidden_size}",
                  "a head trained for this policy")
    layers = head.capture_layers
    if not all(0 <= i < model_config.num_layers for i in layers):
        raise bad(f"the head captures layer outputs {list(layers)} (HF hidden_states "
                  f"{[i + 1 for i in layers]}): outside the policy's {model_config.num_layers} "
                  f"layers", f"layer outputs in [0, {model_config.num_layers - 1}]: a head "
                  f"trained for this policy")
    if d.draft_vocab_size is not None and d.draft_vocab_size != head.draft_vocab_size:
        raise ConfigError("draft.draft_vocab_size", d.draft_vocab_size,
                          f"the head in draft.hf_path has {head.draft_vocab_size}",
                          f"null or {head.draft_vocab_size}")
    if d.layers is not None and tuple(d.layers) != head.capture_layers:
        raise ConfigError("draft.layers", list(d.layers),
                          f"the head in draft.hf_path was trained on layer outputs "
                          f"{list(head.capture_layers)}", f"null or {list(head.capture_layers)}")
    return head


def _check_hybrid(config: ModelConfig) -> None:
    """What a hybrid policy (jaxspec.models.hybrid) does not do in the trainer, refused by
    name: the fused decoder-layer kernels, and experts (the router losses and the routing
    mismatch read a routing record its forward does not return)."""
    if not config.is_hybrid:
        return
    family = config.family
    if config.fused_kernels == "pallas":
        raise ConfigError("model.fused_kernels", "pallas", f"family {family!r} has no fused "
                          "decoder-layer kernels (its layers are Gated DeltaNet and gated "
                          "attention)", "'auto' or 'xla'")
    if config.is_moe:
        raise ConfigError("model.num_experts", config.num_experts,
                          f"the trainer does not train family {family!r} with experts yet: "
                          "its forward reports no routing for the router losses and the "
                          "routing mismatch", "0 (family qwen3_next with dense MLPs), or "
                          "family qwen3_5")


def _tiny_model_config(spec, vocab: int) -> ModelConfig:
    return spec.model_config(vocab)  # the schema built and checked the same ModelConfig


def checkpoint_bytes(cfg: Config, model_config: ModelConfig,
                     draft_model_config: ModelConfig | None = None) -> int:
    """An estimate of one checkpoint's size: the policy's params, its AdamW moments (2x)
    and the reference (KL), plus a small draft model and its moments. (An EAGLE-3 head is
    about one decoder layer and is left out.)"""
    def nbytes(config):
        params = policy_class(config).abstract(config).params
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))

    total = nbytes(model_config) * (3 + (cfg.grpo.kl_coef > 0))
    if draft_model_config is not None:
        total += nbytes(draft_model_config) * 3
    return total


def _checkpoint_dir(cfg: Config) -> str:
    return os.path.join(cfg.run.dir, "checkpoints")


def saved_config_path(cfg: Config) -> str:
    return os.path.join(cfg.run.dir, "config.yaml")


def _resume_changes(cfg: Config) -> dict:
    """A resumed run against the config.yaml its first start saved: one ConfigError naming
    every key whose change the checkpoint cannot be restored into; the other changes."""
    import yaml

    from jaxspec.config import from_dict, to_dict
    from jaxspec.rl.state import config_changes

    path = saved_config_path(cfg)
    if not os.path.isfile(path):
        return {}  # no saved config: the checkpoint check below decides
    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh) or {}
        saved = to_dict(from_dict(raw))  # defaults filled as now
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise ConfigError("run.resume", True, f"the saved config {path} cannot be read ({e})",
                          "a run.dir whose config.yaml the run wrote") from None
    shaping, other = config_changes(saved, to_dict(cfg))
    if shaping:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in shaping.items())
        now = {k: b for k, (_, b) in shaping.items()}
        raise ConfigError(", ".join(shaping), now.popitem()[1] if len(now) == 1 else now,
                          f"the run in {cfg.run.dir} was saved with other values of what its "
                          f"checkpoint holds ({listed}), so it cannot resume with these",
                          f"the saved values (resume with `{path}` as the config, adding only "
                          f"the changes you mean), or a new run.dir")
    return other


def _saved_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return CheckpointManager(directory, create=False).all_steps()


def prepare_run(cfg: Config, *, devices: Sequence | None = None) -> RunPlan:
    """Every check a user's input can fail, on the host, before any compilation: the task
    and its data, the tokenizer, prompt lengths against the cache (with the draft kind's
    headroom), the draft against the policy (the kind's head or draft model on disk), the
    device split, and the checkpoint to resume from.

    Args:
        cfg: the run's validated config.
        devices: the devices to run on; None: all of them.

    Returns:
        The RunPlan the trainer builds from.

    Raises:
        ConfigError: the first problem found, with its dotted key.
    """
    d, r = cfg.draft, cfg.rollout
    changes = _resume_changes(cfg) if cfg.run.resume else {}  # before orbax is touched
    try:  # a named attention kernel this platform cannot run
        resolve_backend(cfg.model.attention_backend)
    except ValueError as e:
        raise ConfigError("model.attention_backend", cfg.model.attention_backend, str(e),
                          "'auto', or 'reference'/'pallas' off CUDA") from None
    # The task and its data.
    try:
        task = tasks_lib.make_task(cfg.task.name, seed=cfg.run.seed, path=cfg.task.path,
                                   **cfg.task.params)
    except (tasks_lib.DatasetError, FileNotFoundError) as e:
        raise ConfigError("task.path", cfg.task.path, str(e),
                          "a JSONL file of {\"prompt\", \"answer\"} lines") from None
    # The policy's architecture and the tokenizer.
    if cfg.model.hf_path is not None:
        model_config = _inspect_hf("model.hf_path", cfg.model.hf_path, cfg.model.dtype,
                                   cfg.model.attention_backend)
    else:
        model_config = None
    tokenizer = task.tokenizer
    if tokenizer is None:
        try:
            tokenizer = HFTokenizer(cfg.model.hf_path, chat_template=cfg.task.chat_template)
        except (OSError, ValueError) as e:
            raise ConfigError("model.hf_path", cfg.model.hf_path, f"no usable tokenizer ({e})",
                              "a HF directory with tokenizer files") from None
    if model_config is None:
        model_config = _tiny_model_config(cfg.model, cfg.model.vocab_size or tokenizer.vocab_size)
    _check_hybrid(model_config)
    vocab = model_config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError("model.vocab_size", vocab,
                          f"smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})",
                          f">= {tokenizer.vocab_size}")
    # Prompt + rollout + draft headroom must fit the policy's cache.
    cache, headroom = model_config.max_position_embeddings, draft_headroom(d)
    room = cache - r.max_new_tokens - headroom
    if r.max_prompt_len > room:
        fits = (f"a prompt of {r.max_prompt_len} tokens + rollout.max_new_tokens "
                f"{r.max_new_tokens} + draft headroom {headroom} does not fit the cache "
                f"(max_position_embeddings = {cache})")
        longest = cache - headroom - r.max_prompt_len  # new tokens beside this prompt length
        if room < 1:  # no prompt fits: the rollout length is what is too long
            raise ConfigError("rollout.max_new_tokens", r.max_new_tokens, fits,
                              f"an int in [1, {longest}] (with rollout.max_prompt_len="
                              f"{r.max_prompt_len}), or a larger model.max_position_embeddings"
                              if longest >= 1 else
                              f"model.max_position_embeddings >= "
                              f"{r.max_prompt_len + r.max_new_tokens + headroom}")
        raise ConfigError("rollout.max_prompt_len", r.max_prompt_len, fits,
                          f"an int in [1, {room}] (with rollout.max_new_tokens="
                          f"{r.max_new_tokens})" + (
                              f", rollout.max_new_tokens in [1, {longest}]" if longest >= 1
                              else "") + ", or a larger model.max_position_embeddings")
    if isinstance(task, tasks_lib.JsonlTask):  # every prompt of the file
        prompts = [(f"prompt {i}", ex.prompt) for i, ex in enumerate(task.examples)]
    else:  # the longest a generated task can produce (RL and warm-up streams)
        prompts = [(f"the longest prompt of task '{cfg.task.name}'", task.longest_prompt())]
    for what, text in prompts:
        n = len(tokenizer.encode_prompt(text))  # as generation sees it: templated
        if n > r.max_prompt_len:
            raise ConfigError("rollout.max_prompt_len", r.max_prompt_len,
                              f"{what} ({text[:40]!r}) has {n} tokens: longer than the "
                              f"prompt cache allows", f">= {n} (and within the policy's cache)")
    # The draft against the policy.
    if d.layers is not None:
        bad = [x for x in d.layers if not 0 <= x < model_config.num_layers]
        if bad:
            raise ConfigError("draft.layers", list(d.layers), "layer out of range",
                              f"three layer indices in [0, {model_config.num_layers - 1}]")
    tree = d.tree  # the config's tree is the library's TreeSpec, checked when loaded
    if d.draft_vocab_size is not None and d.draft_vocab_size > vocab:
        raise ConfigError("draft.draft_vocab_size", d.draft_vocab_size,
                          f"larger than the policy's vocabulary ({vocab})", f"<= {vocab}")
    kind = KINDS[d.kind]
    history_chain = d.kind == "history" and d.history.chain
    if model_config.is_hybrid and (tree is not None or (kind.history and not history_chain)):
        key, value = ("draft.tree", dataclasses.asdict(tree)) if tree is not None else \
            ("draft.history.chain", False) if d.kind == "history" else ("draft.kind", d.kind)
        raise ConfigError(key, value, f"it drafts trees, which policy family "
                          f"{model_config.family!r} cannot verify: its Gated DeltaNet layers "
                          f"keep one recurrent state per row, a tree would need one per node",
                          "chains: draft.tree=null, and a chain draft.kind (none, eagle3, mtp, "
                          "ngram, block) or draft.kind=history with draft.history.chain=true")
    draft_vocab = vocab  # the drafter's vocabulary (a tree expands top_k of it per node)
    if kind.head is not None and kind.head.draft_vocab:
        draft_vocab = d.draft_vocab_size or vocab
    if kind.head is not None and d.hf_path is not None:
        draft_vocab = kind.head.inspect(d, model_config, cfg.model.dtype) or draft_vocab
    if tree is not None and tree.top_k > draft_vocab:
        raise ConfigError("draft.tree.top_k", tree.top_k,
                          f"larger than the draft vocabulary ({draft_vocab} tokens): a node has "
                          f"at most {draft_vocab} children", f"<= {draft_vocab}")
    draft_model_config = None
    if kind.draft_model:
        if d.hf_path is not None:
            small = _inspect_hf("draft.hf_path", d.hf_path, cfg.model.dtype,
                                cfg.model.attention_backend)
            if small.vocab_size != vocab:
                raise ConfigError("draft.hf_path", d.hf_path,
                                  f"the draft model's vocabulary ({small.vocab_size}) does "
                                  f"not match the policy's ({vocab})",
                                  "a draft model with the policy's tokenizer")
        else:
            draft_model_config = _tiny_model_config(d.model, vocab)
            if draft_model_config.is_hybrid:
                raise ConfigError("draft.model.family", draft_model_config.family,
                                  "a draft model's recurrent states could not roll back the "
                                  "drafts it proposed", "qwen3, llama or qwen3_moe")
    # Devices.
    devices = tuple(jax.devices() if devices is None else devices)
    batch = r.prompts_per_step * r.group_size
    a = cfg.async_
    if a.enabled:
        n_gen = a.generation_devices or max(len(devices) // 2, 1)
        n_train = a.training_devices or len(devices) - n_gen
        try:
            gen, train = map(tuple, parallel.split_devices(n_gen, n_train, devices))
        except ValueError as e:
            raise ConfigError("async.training_devices", a.training_devices, str(e),
                              f"generation_devices + training_devices <= {len(devices)}, "
                              f"each >= 1") from None
    else:
        gen = train = devices
    meshes, sizes = {}, mesh_sizes(cfg.mesh, len(gen), len(train))
    for key, group in (("generation", gen), ("training", train)):
        try:
            meshes[key] = parallel.make_mesh(*sizes[key], list(group), expert=cfg.mesh.expert)
        except ValueError as e:
            raise ConfigError("mesh", {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp,
                                       "expert": cfg.mesh.expert, "tensor": cfg.mesh.tensor},
                              f"{e} (the {key} group has {len(group)} devices)") from None
        rules = parallel.resolve_rules(cfg.mesh.rules)
        vocab_shards = math.prod(meshes[key].shape[ax] for ax in rules["vocab"] or ())
        if vocab % vocab_shards:
            name = "tensor" if "tensor" in rules["vocab"] else "rules.vocab"
            raise ConfigError(f"mesh.{name}", getattr(cfg.mesh, name, cfg.mesh.rules["vocab"]),
                              f"the policy's vocabulary ({vocab}) does not split into the "
                              f"{vocab_shards} shards of mesh.rules.vocab on the {key} devices",
                              f"sizes whose product divides {vocab}, or mesh.rules.vocab=null")
        expert_shards = math.prod(meshes[key].shape[ax] for ax in rules["experts"] or ())
        if model_config.is_moe and model_config.num_experts % expert_shards:
            raise ConfigError("mesh.expert", cfg.mesh.expert,
                              f"the policy's {model_config.num_experts} experts per layer do "
                              f"not split into the {expert_shards} shards of "
                              f"mesh.rules.experts on the {key} devices",
                              f"a divisor of {model_config.num_experts}")
        if not model_config.is_moe and cfg.mesh.expert > 1:
            raise ConfigError("mesh.expert", cfg.mesh.expert,
                              f"family {model_config.family!r} has no experts to split",
                              "1 (an expert axis needs model.family qwen3_moe)")
        shards = meshes[key].shape["data"] * meshes[key].shape["fsdp"]
        if batch % shards:
            raise ConfigError("rollout.prompts_per_step", r.prompts_per_step,
                              f"the {batch} rollouts of a step do not split over the {shards} "
                              f"batch shards of the {key} devices",
                              f"prompts_per_step x group_size divisible by {shards}")
    # run.dir takes files, and a checkpoint fits.
    try:
        check_run_dir(cfg.run.dir, checkpoint_bytes(cfg, model_config, draft_model_config))
    except RunDirError as e:
        raise ConfigError("run.dir", cfg.run.dir, str(e),
                          "a writable directory with room for a checkpoint") from None
    # Checkpoints.
    ckpt = _checkpoint_dir(cfg)
    steps = _saved_steps(ckpt)
    if cfg.run.resume and not steps:
        raise ConfigError("run.resume", True, f"no checkpoint to resume from in {ckpt!r}",
                          "run.resume=false to start a new run, or run.dir=<a run that saved "
                          "checkpoints>")
    if not cfg.run.resume and steps:
        raise ConfigError("run.dir", cfg.run.dir,
                          f"already holds checkpoints of a run (latest step {steps[-1]})",
                          "run.resume=true to continue it, or a new run.dir")
    return RunPlan(task=task, tokenizer=tokenizer, model_config=model_config,
                   draft_model_config=draft_model_config, tree=tree, generation_devices=gen,
                   training_devices=train, resume_step=steps[-1] if cfg.run.resume else None,
                   config_changes=changes)


