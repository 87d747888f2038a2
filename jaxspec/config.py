"""Typed run configuration: nested frozen dataclasses, YAML files and `a.b=c` overrides.

The dataclass defaults *are* the embedded tiny run (configs/tiny.yaml writes them out in
full). Every section checks its own values when it is built, so a bad value fails with one
`ConfigError` naming the dotted key, the value and what is valid — before anything compiles.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Callable, Literal, Optional

import yaml

__all__ = [
    "AsyncSpec",
    "Config",
    "ConfigError",
    "DraftSpec",
    "GRPOConfig",
    "MeshSpec",
    "ModelSpec",
    "NgramSpec",
    "OptimSpec",
    "RolloutSpec",
    "RunSpec",
    "SamplingSpec",
    "TaskSpec",
    "TreeSpec",
    "WarmupSpec",
    "draft_headroom",
    "from_dict",
    "load_config",
    "save",
    "to_dict",
]


class ConfigError(ValueError):
    """One bad config entry: the full dotted key, the value found and what would be valid."""

    def __init__(self, key: str, value: Any, problem: str, valid: str | None = None):
        self.key, self.value, self.problem, self.valid = key, value, problem, valid
        msg = f"config key '{key}' = {value!r}: {problem}"
        if valid:
            msg += f"; valid: {valid}"
        super().__init__(msg)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with its key placed under the section `prefix`."""
        if not prefix:
            return self
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(key, self.value, self.problem, self.valid)


_MISSING = dataclasses.MISSING


def _field(default: Any = _MISSING, *, factory: Callable[[], Any] | None = None,
           check: Callable[[Any], bool] | None = None, valid: str | None = None,
           key: str | None = None):
    """A schema field: `check(value)` must hold (None always passes for Optional fields);
    `valid` says in words what passes; `key` is the YAML spelling when it is not the name."""
    meta = {"check": check, "valid": valid, "key": key}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _ge(lo):
    return dict(check=lambda v: v >= lo, valid=f">= {lo}")


def _gt(lo):
    return dict(check=lambda v: v > lo, valid=f"> {lo}")


def _in_unit(lo_open: bool, hi_open: bool):
    text = f"{'(' if lo_open else '['}0, 1{')' if hi_open else ']'}"
    return dict(check=lambda v: (v > 0 if lo_open else v >= 0) and (v < 1 if hi_open else v <= 1),
                valid=f"a number in {text}")


# ----------------------------------------------------------------------------- schema core

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not type(None)]
        return ("null or " if type(None) in args else "") + " or ".join(parts)
    if origin is tuple:
        return f"a list of {_describe(args[0])}" if args and args[-1] is Ellipsis else \
            f"a list of {len(args)} values"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(hint):
        return f"a mapping with keys {', '.join(_yaml_key(f) for f in dataclasses.fields(hint))}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


class _Bad(Exception):
    pass


def _coerce(hint, value):
    """`value` as type `hint` (ints widen to floats, lists to tuples), or raise _Bad."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Bad
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _Bad
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value)
            except _Bad:
                pass
        raise _Bad
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Bad
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Bad
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Bad
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Bad
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Bad
        if args and args[-1] is Ellipsis:
            return tuple(_coerce(args[0], v) for v in value)
        if len(value) != len(args):
            raise _Bad
        return tuple(_coerce(a, v) for a, v in zip(args, value, strict=True))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Bad
        vt = args[1] if args else Any
        return {k: _coerce(vt, v) for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return _build(hint, value)
        raise _Bad
    raise TypeError(f"unsupported schema type {hint!r}")


class _Section:
    """Base of every config section: coerces and checks each field on construction."""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            key = _yaml_key(f)
            try:
                value = _coerce(hints[f.name], value)
            except _Bad:
                hint = hints[f.name]
                problem = "wrong type"
                if typing.get_origin(hint) is Literal:
                    choices = [str(a) for a in typing.get_args(hint)]
                    close = difflib.get_close_matches(str(value), choices, n=1)
                    problem = "not a valid choice" + (
                        f" (did you mean '{close[0]}'?)" if close else "")
                raise ConfigError(key, value, problem, _describe(hint)) from None
            except ConfigError as e:
                raise e.under(key) from None
            check = f.metadata.get("check")
            if check is not None and value is not None and not check(value):
                raise ConfigError(key, value, "out of range", f.metadata.get("valid"))
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks that involve several fields; raise ConfigError(field, ...)."""


def _section_type(hint):
    """The section class a field holds (`TreeSpec` for Optional[TreeSpec]), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + _yaml_key(f)
        keys.append(key)
        sub = _section_type(_hints(cls)[f.name])
        if sub is not None:
            keys.extend(_all_keys(sub, key + "."))
    return keys


def _suggest(cls, bad: str, prefix: str) -> str:
    """A 'did you mean' for an unknown key: a close key of the same section, else the same
    leaf name anywhere in the schema (e.g. 'rollout.temperature' -> 'sampling.temperature')."""
    here = [_yaml_key(f) for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(bad, here, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    everywhere = _all_keys(Config)
    leaf_hits = [k for k in everywhere if k.rsplit(".", 1)[-1] == bad]
    if leaf_hits:
        return f"did you mean '{leaf_hits[0]}'?"
    close = difflib.get_close_matches(prefix + bad, everywhere, n=1, cutoff=0.75)
    return f"did you mean '{close[0]}'?" if close else ""


def _build(cls, data: Any, prefix: str = ""):
    """Section `cls` from a plain mapping; errors carry keys relative to the caller."""
    if not isinstance(data, dict):
        raise ConfigError("", data, "expected a mapping", _describe(cls))
    by_key = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in by_key:
            hint = _suggest(cls, str(key), prefix)
            raise ConfigError(str(key), value, "unknown key" + (f" ({hint})" if hint else ""),
                              ", ".join(by_key))
        f = by_key[key]
        target = _section_type(hints[f.name])
        if target is not None and isinstance(value, dict):
            try:
                value = _build(target, value, prefix + key + ".")
            except ConfigError as e:
                raise e.under(key) from None
        kwargs[f.name] = value
    return cls(**kwargs)


# ----------------------------------------------------------------------------- sections

@dataclasses.dataclass(frozen=True)
class ModelSpec(_Section):
    """The policy: a local HF directory (`hf_path`; the architecture fields are then read
    from its config.json and ignored here) or a tiny transformer built from these fields."""

    hf_path: Optional[str] = None
    family: Literal["qwen3", "llama"] = "qwen3"
    vocab_size: Optional[int] = _field(None, **_ge(1))  # null: the task tokenizer's vocabulary
    hidden_size: int = _field(64, **_ge(1))
    intermediate_size: int = _field(128, **_ge(1))
    num_layers: int = _field(4, **_ge(1))
    num_heads: int = _field(4, **_ge(1))
    num_kv_heads: int = _field(2, **_ge(1))
    head_dim: int = _field(16, **_ge(1))
    rope_theta: float = _field(10000.0, **_gt(0))
    rope_scaling: Optional[dict[str, Any]] = None  # Llama-3 scaling parameters, or null
    rms_norm_eps: float = _field(1e-6, **_gt(0))
    qk_norm: bool = True
    tie_embeddings: bool = True
    max_position_embeddings: int = _field(256, **_ge(1))
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention_backend: Literal["reference", "pallas", "triton"] = "reference"

    def _validate(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads = {self.num_heads}",
                              "a divisor of num_heads")


@dataclasses.dataclass(frozen=True)
class TreeSpec(_Section):
    """Dynamic draft tree (EAGLE-2/3): expand top_k per frontier node for `depth` steps,
    keep the best `budget` nodes."""

    top_k: int = _field(4, **_ge(1))
    depth: int = _field(3, **_ge(1))
    budget: int = _field(8, **_ge(1))

    def _validate(self):
        if self.budget < self.depth:
            raise ConfigError("budget", self.budget, f"smaller than depth = {self.depth}",
                              ">= depth (a tree needs room for one full-depth path)")


@dataclasses.dataclass(frozen=True)
class NgramSpec(_Section):
    """Prompt-lookup drafting: match the last n tokens, min_n <= n <= max_n."""

    min_n: int = _field(1, **_ge(1))
    max_n: int = _field(3, **_ge(1))

    def _validate(self):
        if self.max_n < self.min_n:
            raise ConfigError("max_n", self.max_n, f"smaller than min_n = {self.min_n}",
                              ">= min_n")


DRAFT_KINDS = ("none", "eagle3", "mtp", "draft_model", "ngram")


@dataclasses.dataclass(frozen=True)
class DraftSpec(_Section):
    """The drafter proposing tokens for the policy to verify."""

    kind: Literal["none", "eagle3", "mtp", "draft_model", "ngram"] = "eagle3"
    k: int = _field(3, **_ge(1))  # chain length (drafted tokens per verify)
    tree: Optional[TreeSpec] = None  # null: chain drafting
    draft_vocab_size: Optional[int] = _field(None, **_ge(1))  # null: the policy's vocabulary
    hf_path: Optional[str] = None  # pretrained head (eagle3/mtp) or draft model directory
    layers: Optional[tuple[int, int, int]] = None  # EAGLE-3 captured layers; null: default
    online: bool = True  # train the EAGLE-3 head inside each RL step (other kinds: ignored)
    ttt_steps: int = _field(3, **_ge(1))  # training-time-test unroll steps
    ttt_decay: float = _field(0.8, **_in_unit(True, False))  # loss weight decay^step
    collapse_threshold: float = _field(1.05, **_ge(1))  # acceptance length under it is a collapse
    collapse_patience: int = _field(3, **_ge(1))  # alarm after this many collapsed steps in a row
    model: Optional[ModelSpec] = None  # the small model for kind draft_model (or hf_path)
    ngram: NgramSpec = _field(factory=NgramSpec)

    def _validate(self):
        if self.tree is not None and self.kind in ("none", "ngram"):
            raise ConfigError("tree", dataclasses.asdict(self.tree),
                              f"draft kind '{self.kind}' does not draft trees",
                              "null, or kind eagle3 / mtp / draft_model")
        if self.kind == "draft_model" and self.model is None and self.hf_path is None:
            raise ConfigError("model", None, "kind 'draft_model' needs a model",
                              "a model spec (draft.model.*) or draft.hf_path")


def draft_headroom(draft: DraftSpec) -> int:
    """Cache slots a verify step needs beyond the committed tokens: the fed draft nodes + 1."""
    if draft.kind == "none":
        return 1
    return (draft.tree.budget if draft.tree is not None else draft.k) + 1


@dataclasses.dataclass(frozen=True)
class SamplingSpec(_Section):
    """The rollout sampling distribution (traced at run time; changing it never recompiles)."""

    temperature: float = _field(1.0, **_ge(0))  # 0 = greedy
    top_k: int = _field(0, **_ge(0))  # 0 = off
    top_p: float = _field(1.0, **_in_unit(True, False))  # 1.0 = off


@dataclasses.dataclass(frozen=True)
class RolloutSpec(_Section):
    prompts_per_step: int = _field(8, **_ge(1))
    group_size: int = _field(8, **_ge(2))  # G samples per prompt
    max_new_tokens: int = _field(8, **_ge(1))
    max_prompt_len: int = _field(16, **_ge(1))  # prompt tokens (BOS included); longer: an error
    method: Literal["replay", "rejection", "greedy"] = "replay"  # verification rule


@dataclasses.dataclass(frozen=True)
class GRPOConfig(_Section):
    """The GRPO loss (static, hashable: `grpo_loss` is jitted with it as a static argument)."""

    loss: str = "clipped_pg"  # name in jaxspec.rl.grpo.LOSSES
    advantage: str = "grpo"  # name in jaxspec.rl.grpo.ADVANTAGES
    normalize_std: bool = True  # divide advantages by the group's reward std
    eps_low: float = _field(0.2, **_in_unit(False, True))
    eps_high: float = _field(0.2, **_ge(0))
    clip_c: Optional[float] = _field(None, **_gt(1))  # dual clip for A < 0; null = off
    kl_coef: float = _field(0.01, **_ge(0))  # k3 KL to the reference; 0 = no reference
    loss_agg: Literal["token", "sequence"] = "token"
    tis: Literal["none", "token", "sequence"] = "none"  # truncated importance weights
    tis_cap: float = _field(2.0, **_gt(0))
    minibatches: int = _field(1, **_ge(1))  # optimizer updates per step, on disjoint minibatches

    def _validate(self):
        from jaxspec.rl import grpo  # the registries live beside the functions they name

        for key, registry in (("loss", grpo.LOSSES), ("advantage", grpo.ADVANTAGES)):
            name = getattr(self, key)
            if name not in registry:
                close = difflib.get_close_matches(name, list(registry), n=1)
                raise ConfigError(key, name, "unknown" + (f" (did you mean '{close[0]}'?)"
                                                          if close else ""),
                                  "one of " + ", ".join(repr(n) for n in registry))


@dataclasses.dataclass(frozen=True)
class OptimSpec(_Section):
    """AdamW with global-norm clipping and linear warm-up."""

    lr: float = _field(1e-3, **_gt(0))
    weight_decay: float = _field(0.0, **_ge(0))
    b1: float = _field(0.9, **_in_unit(False, True))
    b2: float = _field(0.999, **_in_unit(False, True))
    eps: float = _field(1e-8, **_gt(0))
    clip_norm: Optional[float] = _field(1.0, **_gt(0))  # null = no clipping
    warmup_steps: int = _field(0, **_ge(0))


@dataclasses.dataclass(frozen=True)
class WarmupSpec(_Section):
    """Supervised warm-up that turns the random tiny model into the 'base' policy."""

    steps: int = _field(600, **_ge(0))
    lr: float = _field(3e-3, **_gt(0))
    batch_size: int = _field(64, **_ge(1))
    draft_rollouts: int = _field(512, **_ge(1))  # policy rollouts for the in-domain draft init
    draft_steps: int = _field(100, **_ge(0))  # offline draft steps (fresh EAGLE-3 heads only)


@dataclasses.dataclass(frozen=True)
class TaskSpec(_Section):
    """A task from jaxspec.rl.tasks.TASKS, its constructor parameters, or a JSONL file."""

    name: str = "arithmetic"
    params: dict[str, Any] = _field(factory=dict)  # {}: the task's own defaults
    path: Optional[str] = None  # the JSONL file for name 'jsonl'

    def _validate(self):
        import inspect

        from jaxspec.rl import tasks

        if self.name not in tasks.TASKS:
            close = difflib.get_close_matches(self.name, list(tasks.TASKS), n=1)
            raise ConfigError("name", self.name, "unknown task" + (
                f" (did you mean '{close[0]}'?)" if close else ""),
                "one of " + ", ".join(repr(n) for n in tasks.TASKS))
        accepted = [p for p in inspect.signature(tasks.TASKS[self.name]).parameters
                    if p not in ("seed", "path")]
        for p in self.params:
            if p not in accepted:
                close = difflib.get_close_matches(p, accepted, n=1)
                raise ConfigError(f"params.{p}", self.params[p],
                                  f"task '{self.name}' has no such parameter" + (
                                      f" (did you mean 'task.params.{close[0]}'?)"
                                      if close else ""),
                                  ", ".join(accepted) or "no parameters")
        if self.name != "jsonl":  # built-in tasks are cheap: check their values now
            try:
                tasks.make_task(self.name, **self.params)
            except (TypeError, ValueError) as e:
                raise ConfigError("params", self.params, str(e),
                                  f"the parameters of {tasks.TASKS[self.name].__name__}"
                                  ) from None
        if self.name == "jsonl" and not self.path:
            raise ConfigError("path", self.path, "task 'jsonl' needs a file",
                              "a path to a JSONL file of {\"prompt\", \"answer\"} lines")
        if self.name != "jsonl" and self.path is not None:
            raise ConfigError("path", self.path, f"task '{self.name}' reads no file",
                              "null (path is for task 'jsonl')")


@dataclasses.dataclass(frozen=True)
class RunSpec(_Section):
    dir: str = "runs/tiny"
    steps: int = _field(40, **_ge(1))
    seed: int = 0
    save_every: int = _field(10, **_ge(0))  # 0 = never
    keep_checkpoints: int = _field(3, **_ge(1))
    log_every: int = _field(1, **_ge(1))
    resume: bool = False
    compare_plain: int = _field(5, **_ge(0))  # also time plain generation every N steps; 0 = off


@dataclasses.dataclass(frozen=True)
class AsyncSpec(_Section):
    """Generation and training on separate device groups, rollouts at most
    `max_policy_lag` policy versions old."""

    enabled: bool = False
    max_policy_lag: int = _field(1, **_ge(0))
    generation_devices: Optional[int] = _field(None, **_ge(1))  # null: half of the devices
    training_devices: Optional[int] = _field(None, **_ge(1))  # null: the rest

    def _validate(self):
        if self.enabled and self.max_policy_lag < 1:
            raise ConfigError("max_policy_lag", self.max_policy_lag,
                              "async mode overlaps generation with training", ">= 1")


MESH_AXES = ("data", "fsdp", "tensor")


def _default_rules() -> dict[str, Any]:
    return {"batch": ("data", "fsdp"), "embed": "fsdp", "vocab": "tensor", "heads": "tensor",
            "kv_heads": "tensor", "mlp": "tensor", "head_dim": None, "layers": None}


@dataclasses.dataclass(frozen=True)
class MeshSpec(_Section):
    """Device mesh sizes (-1: all remaining devices) and logical axis -> mesh axis rules."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: dict[str, Optional[str | tuple[str, ...]]] = _field(factory=_default_rules)

    def _validate(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if size == 0 or size < -1:
                raise ConfigError(axis, size, "bad mesh axis size", ">= 1, or -1 for the rest")
        if [getattr(self, a) for a in MESH_AXES].count(-1) > 1:
            raise ConfigError("data", self.data, "more than one mesh axis is -1",
                              "at most one axis of data/fsdp/tensor set to -1")
        for logical, target in self.rules.items():
            for axis in (target,) if isinstance(target, str) else (target or ()):
                if axis not in MESH_AXES:
                    raise ConfigError(f"rules.{logical}", target, "unknown mesh axis",
                                      "null, or one or a list of " + ", ".join(MESH_AXES))


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    """A whole run. `Config()` is the embedded tiny default (configs/tiny.yaml)."""

    model: ModelSpec = _field(factory=ModelSpec)
    draft: DraftSpec = _field(factory=DraftSpec)
    sampling: SamplingSpec = _field(factory=SamplingSpec)
    rollout: RolloutSpec = _field(factory=RolloutSpec)
    grpo: GRPOConfig = _field(factory=GRPOConfig)
    optim: OptimSpec = _field(factory=OptimSpec)
    draft_optim: OptimSpec = _field(factory=lambda: OptimSpec(lr=3e-3, b2=0.95, clip_norm=0.5))
    warmup: WarmupSpec = _field(factory=WarmupSpec)
    task: TaskSpec = _field(factory=TaskSpec)
    run: RunSpec = _field(factory=RunSpec)
    async_: AsyncSpec = _field(factory=AsyncSpec, key="async")
    mesh: MeshSpec = _field(factory=MeshSpec)

    def _validate(self):
        m, d = self.model, self.draft
        if d.layers is not None and m.hf_path is None:
            for x in d.layers:
                if not 0 <= x < m.num_layers:
                    raise ConfigError("draft.layers", list(d.layers), "layer out of range",
                                      f"three layer indices in [0, {m.num_layers - 1}]")
        vocab = m.vocab_size
        if m.hf_path is None and self.task.name != "jsonl":
            from jaxspec.rl import tasks

            need = tasks.CharTokenizer().vocab_size
            if vocab is not None and vocab < need:
                raise ConfigError("model.vocab_size", vocab,
                                  f"smaller than the task tokenizer's vocabulary ({need})",
                                  f"null or >= {need}")
            vocab = vocab or need
        if m.hf_path is None and self.task.name == "jsonl":
            raise ConfigError("model.hf_path", None,
                              "task 'jsonl' needs a real model and its tokenizer",
                              "a local HF model directory")
        if vocab is not None and d.draft_vocab_size is not None and d.draft_vocab_size > vocab:
            raise ConfigError("draft.draft_vocab_size", d.draft_vocab_size,
                              f"larger than the policy vocabulary ({vocab})", f"<= {vocab}")
        if d.model is not None and d.model.vocab_size not in (None, vocab):
            raise ConfigError("draft.model.vocab_size", d.model.vocab_size,
                              "a draft model shares the policy's tokenizer",
                              f"null or {vocab}")
        if self.rollout.method == "greedy" and self.sampling.temperature != 0:
            raise ConfigError("rollout.method", "greedy",
                              f"greedy verification is lossless only for temperature 0 "
                              f"(sampling.temperature = {self.sampling.temperature})",
                              "'replay' or 'rejection', or sampling.temperature=0")
        if self.rollout.method == "rejection" and d.tree is not None:
            raise ConfigError("rollout.method", "rejection",
                              "the rejection rule verifies sampled chains, not trees",
                              "'replay' or 'greedy', or draft.tree=null")
        if m.hf_path is None:  # the tiny model's cache: prompt + rollout + draft headroom
            need = self.rollout.max_prompt_len + self.rollout.max_new_tokens + draft_headroom(d)
            if need > m.max_position_embeddings:
                raise ConfigError(
                    "rollout.max_prompt_len", self.rollout.max_prompt_len,
                    f"a prompt of {self.rollout.max_prompt_len} tokens + max_new_tokens "
                    f"{self.rollout.max_new_tokens} + draft headroom {draft_headroom(d)} = {need} "
                    f"does not fit the cache (model.max_position_embeddings = "
                    f"{m.max_position_embeddings})",
                    f"<= {m.max_position_embeddings - self.rollout.max_new_tokens - draft_headroom(d)}"
                    f", or a larger model.max_position_embeddings")
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.grpo.minibatches:
            raise ConfigError("grpo.minibatches", self.grpo.minibatches,
                              f"does not divide the {batch} rollouts of a step "
                              f"(rollout.prompts_per_step x rollout.group_size)",
                              f"a divisor of {batch}")
        if self.async_.enabled and self.grpo.tis == "none":
            raise ConfigError("grpo.tis", "none",
                              "async rollouts are off-policy by up to max_policy_lag steps",
                              "'token' or 'sequence' when async.enabled")


# ----------------------------------------------------------------------------- loading

def _check_paths(cfg: Config) -> None:
    """Local files named by the config exist (nothing is ever downloaded)."""
    for key, path, want in (("model.hf_path", cfg.model.hf_path, "dir"),
                            ("draft.hf_path", cfg.draft.hf_path, "dir"),
                            ("draft.model.hf_path",
                             cfg.draft.model.hf_path if cfg.draft.model else None, "dir"),
                            ("task.path", cfg.task.path, "file")):
        if path is None:
            continue
        if want == "dir" and not os.path.isdir(path):
            raise ConfigError(key, path, "no such directory (nothing is downloaded)",
                              "a local HF directory with config.json and *.safetensors")
        if want == "dir" and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(key, path, "the directory has no config.json",
                              "a local HF directory with config.json and *.safetensors")
        if want == "file" and not os.path.isfile(path):
            raise ConfigError(key, path, "no such file", "a path to an existing JSONL file")


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(item, None, "an override must look like key=value",
                          "e.g. draft.k=4 or run.dir=runs/x")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key, text, "empty key in override", "a dotted key such as draft.k")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key, text, f"the value is not a YAML scalar ({e})", None) from None
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def from_dict(data: dict, *, check_paths: bool = False) -> Config:
    """A Config from a plain nested mapping (the YAML layout)."""
    cfg = _build(Config, data or {})
    if check_paths:
        _check_paths(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = (),
                *, check_paths: bool = True) -> Config:
    """Config from a YAML file (None: the embedded tiny default) plus `a.b=c` overrides,
    whose values are parsed as YAML scalars (`draft.tree=null`, `grpo.clip_c=3`)."""
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("<file>", str(path), "no such config file",
                              "a YAML file such as configs/tiny.yaml")
        with open(path) as fh:
            try:
                raw = yaml.safe_load(fh) or {}
            except yaml.YAMLError as e:
                raise ConfigError("<file>", str(path), f"not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("<file>", str(path), "the top level must be a mapping")
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(raw, check_paths=check_paths)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {_yaml_key(f): _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain YAML-able data (the file layout; `from_dict` inverts it)."""
    return _plain(cfg)


def save(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config (e.g. <run.dir>/config.yaml) so a run records what it ran."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False, default_flow_style=None)
