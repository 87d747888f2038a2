"""Run configuration: frozen dataclasses validated by pydantic, read from YAML files and
`a.b=c` overrides.

A key has one default and one check, in one place. Where the library defines a setting, the
section is the library's class or derived from it: `grpo` is `rl.grpo.GRPOConfig`,
`draft.tree` is `decoding.drafters.TreeSpec`; `model` has `models.config.ModelConfig`'s
fields (derived from the class; defaults: its tiny preset with 4 layers and a 256-slot
cache) and is checked by building one; `draft.ngram`, `draft.history` and `sampling` take
their defaults and checks from `NGramDrafter`, `HistoryDrafter` and `SamplingConfig`;
`mesh` takes axes, sizes and rules from `parallel`; `draft.kind` is a name in the registry
`draft_kinds.RULES`, which checks the rest of the `draft` section for its kind. The
trainer-only sections (rollout, optim, warmup, task, run, async) are defined here.

pydantic checks types (strictly: no string to number, no float to int, every float finite),
ranges and unknown keys, on the library's own dataclasses as on these; checks that span
fields run in each class's `__post_init__`. A library class raises `errors.FieldError`
(field, value, problem, valid); a section raises `ConfigError` with its relative key. Both,
and pydantic's own errors, become one `ConfigError` with the full dotted key, the value and
what is valid, and a "did you mean" for a misspelt key. YAML is read with YAML 1.2 floats,
so `1e-5` is a number.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import types
import typing
from typing import Any, Literal, Optional, Union

import pydantic
import yaml
from pydantic import Field

from jaxspec import parallel
from jaxspec.decoding.drafters import NGramDrafter, TreeSpec
from jaxspec.decoding.history import HistoryDrafter, HybridDrafter
from jaxspec.decoding.sampling import SamplingConfig, check_settings
from jaxspec.errors import ConfigError, FieldError
from jaxspec.models.config import ModelConfig
from jaxspec import draft_kinds
from jaxspec.rl.grpo import GRPOConfig

__all__ = [
    "AsyncSpec",
    "BlockSpec",
    "Config",
    "ConfigError",
    "DraftSpec",
    "GRPOConfig",
    "HistorySpec",
    "MeshSpec",
    "ModelSpec",
    "NgramSpec",
    "OptimSpec",
    "RolloutSpec",
    "RunSpec",
    "SamplingSpec",
    "TaskSpec",
    "TreeSpec",
    "WandbSpec",
    "WarmupSpec",
    "draft_headroom",
    "from_dict",
    "load_config",
    "save",
    "to_dict",
]


# ----------------------------------------------------------------------------- YAML

class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: `1e-5`, `1E+3`, `.5`, `.inf`, `-.inf`, `.nan`
    (YAML 1.1 wants a dot in the mantissa and reads `1e-5` as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_load(stream):
    return yaml.load(stream, Loader=_Loader)


# ----------------------------------------------------------------------------- schema

# Strict types (JSON-like input: mappings become dataclasses, lists tuples), unknown keys
# refused, floats finite; a field may be given by its name or its YAML key (`async`).
_SCHEMA = pydantic.ConfigDict(strict=True, extra="forbid", allow_inf_nan=False,
                              validate_by_name=True, validate_by_alias=True)


def _section(cls):
    """`cls` as a frozen pydantic dataclass of the schema; constructing it directly with a
    bad value raises ConfigError (keys relative to the section)."""
    cls = pydantic.dataclasses.dataclass(frozen=True, config=_SCHEMA)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except pydantic.ValidationError as e:
            raise _config_error(e, type(self)) from None

    cls.__init__ = __init__
    return cls


def _default(cls, name: str):
    """The default of field `name` of the library dataclass `cls`."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _unit(default: float, lo_open: bool, hi_open: bool):
    """A field holding a number in [0, 1] with the given ends open."""
    return Field(default, **({"gt": 0} if lo_open else {"ge": 0}),
                 **({"lt": 1} if hi_open else {"le": 1}))


# ----------------------------------------------------------------------------- errors

def _yaml_key(cls, name: str) -> str:
    info = getattr(cls, "__pydantic_fields__", {}).get(name)
    return (info.alias if info is not None else None) or name


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _keys_of(cls) -> dict[str, str]:
    """{YAML key: field name} of a schema dataclass."""
    return {_yaml_key(cls, f.name): f.name for f in dataclasses.fields(cls)}


def _dataclass_in(hint):
    """The dataclass a field holds (`TreeSpec` for Optional[TreeSpec]), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _locate(root, loc) -> tuple[list[str], Any, Any, str | None]:
    """Follow a pydantic error location through the schema: (YAML key parts, the type
    there, the dataclass owning the last field, that field's name). Union member tags and
    tuple indices end the walk at the field that holds them."""
    parts, hint, owner, name = [], root, None, None
    for part in loc:
        cls = _dataclass_in(hint)
        origin = typing.get_origin(hint)
        if cls is not None and isinstance(part, str) and part in _keys_of(cls):
            owner, name = cls, _keys_of(cls)[part]
            parts.append(part)
            hint = _hints(cls)[name]
        elif origin is dict and isinstance(part, str):
            parts.append(part)
            hint = typing.get_args(hint)[1]
        else:
            break
    return parts, hint, owner, name


def _describe(hint) -> str:
    """What a value of type `hint` looks like, in words."""
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
        return f"a mapping with keys {', '.join(_keys_of(hint))}"
    return {bool: "true or false", int: "an integer", float: "a finite number",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


def _bounds(owner, name: str) -> str | None:
    """A field's numeric bounds in words (">= 1", "a number in [0, 1)"), from its metadata."""
    info = getattr(owner, "__pydantic_fields__", {}).get(name)
    if info is None:
        return None
    lo = hi = None
    for m in info.metadata:
        for attr, side, text in (("ge", "lo", "["), ("gt", "lo", "("), ("le", "hi", "]"),
                                 ("lt", "hi", ")")):
            if getattr(m, attr, None) is not None:
                if side == "lo":
                    lo = (text, getattr(m, attr))
                else:
                    hi = (text, getattr(m, attr))
    if lo and hi:
        return f"a number in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {hi[1]}"
    return None


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for key, name in _keys_of(cls).items():
        keys.append(prefix + key)
        sub = _dataclass_in(_hints(cls)[name])
        if sub is not None:
            keys.extend(_all_keys(sub, prefix + key + "."))
    return keys


def _suggest(cls, bad: str, prefix: str) -> str:
    """A 'did you mean' for an unknown key: a close key of the same section, else the same
    leaf name anywhere in the schema (e.g. 'rollout.temperature' -> 'sampling.temperature')."""
    close = difflib.get_close_matches(bad, list(_keys_of(cls)), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    everywhere = _all_keys(Config)
    leaf_hits = [k for k in everywhere if k.rsplit(".", 1)[-1] == bad]
    if leaf_hits:
        return f"did you mean '{leaf_hits[0]}'?"
    close = difflib.get_close_matches(prefix + bad, everywhere, n=1, cutoff=0.75)
    return f"did you mean '{close[0]}'?" if close else ""


_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _config_error(error: pydantic.ValidationError, root) -> ConfigError:
    """pydantic's first error on `root` as one ConfigError with the dotted key."""
    err = error.errors()[0]
    parts, hint, owner, name = _locate(root, err["loc"])
    key = ".".join(parts)
    value, etype = err["input"], err["type"]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return cause.under(key)
    if isinstance(cause, FieldError):
        field = _yaml_key(_dataclass_in(hint), cause.field) if _dataclass_in(hint) else cause.field
        return ConfigError(f"{key}.{field}" if key else field, cause.value, cause.problem,
                           cause.valid)
    if cause is not None:
        return ConfigError(key, value, str(cause))
    if etype == "unexpected_keyword_argument":
        section, bad = _dataclass_in(hint), str(err["loc"][-1])
        prefix = key + "." if key else ""
        hint_text = _suggest(section, bad, prefix)
        return ConfigError(prefix + bad, value, "unknown key" + (f" ({hint_text})" if hint_text
                                                                  else ""),
                           ", ".join(_keys_of(section)))
    if etype in _RANGE:
        return ConfigError(key, value, "out of range", _bounds(owner, name))
    problem = "wrong type"
    if etype == "finite_number" or (isinstance(value, str) and
                                   value.strip().lstrip("+-.").lower() in ("inf", "nan")):
        problem = "not a finite number"
    if etype == "literal_error":
        choices = [str(a) for a in typing.get_args(hint)]
        close = difflib.get_close_matches(str(value), choices, n=1)
        problem = "not a valid choice" + (f" (did you mean '{close[0]}'?)" if close else "")
    return ConfigError(key, value, problem, _describe(hint))


# ----------------------------------------------------------------------------- sections

@functools.cache
def _tiny_policy() -> ModelConfig:
    """The tiny run's policy: ModelConfig's tiny preset with 4 layers and a 256-slot cache."""
    return ModelConfig.tiny("qwen3", num_layers=4, max_position_embeddings=256)


class _ModelFields:
    """The methods of ModelSpec (whose fields are made from ModelConfig's below)."""

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The `ModelConfig` of these fields with the given vocabulary.

        Args:
            vocab_size: the vocabulary (the spec's own `vocab_size` may be null).

        Returns:
            The library's model description, checked by its own `__post_init__`.
        """
        names = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"]
        return ModelConfig(vocab_size=vocab_size, **{n: getattr(self, n) for n in names})

    def __post_init__(self):
        self.model_config(self.vocab_size if self.vocab_size is not None else 1)


def _model_spec():
    """ModelSpec: `hf_path`, then every ModelConfig field with its type, the tiny preset's
    value as default, and `vocab_size` optional (null: the task tokenizer's vocabulary)."""
    hints, tiny = typing.get_type_hints(ModelConfig), _tiny_policy()
    fields = [("hf_path", Optional[str], None)]
    for f in dataclasses.fields(ModelConfig):
        if f.name == "vocab_size":
            fields.append((f.name, Optional[int], None))
        else:
            fields.append((f.name, hints[f.name], getattr(tiny, f.name)))
    namespace = {"__module__": __name__, "__qualname__": "ModelSpec",
                 "__annotations__": {n: t for n, t, _ in fields},
                 **{n: d for n, _, d in fields}, "__doc__": (
                     "The policy: a local HF directory (`hf_path`; the architecture fields are "
                     "then read from its config.json and ignored here) or a tiny transformer "
                     "built from these fields, which are `ModelConfig`'s (defaults from "
                     "`ModelConfig.tiny`, checks by `ModelConfig`).")}
    return _section(type("ModelSpec", (_ModelFields,), namespace))


ModelSpec = _model_spec()


@_section
class NgramSpec:
    """Prompt-lookup drafting (`NGramDrafter`): match the last n tokens, min_n <= n <= max_n."""

    min_n: int = _default(NGramDrafter, "min_n")
    max_n: int = _default(NGramDrafter, "max_n")

    def __post_init__(self):
        NGramDrafter(min_n=self.min_n, max_n=self.max_n)


@_section
class BlockSpec:
    """The block-parallel draft model (`BlockDrafter`, kinds block and hybrid_block): a DFlash
    body drafting `size` - 1 tokens in one forward (draft.k of them verified), with DSpark's
    Markov head (`markov_rank` > 0) and confidence head; trained online with its own
    optimizer (draft_optim) on the block loss (jaxspec.rl.block_train)."""

    size: int = Field(4, ge=2)  # anchor + drafted positions per forward (tokens)
    layers: int = Field(1, ge=1)  # the body's decoder layers
    capture: Optional[tuple[int, ...]] = None  # policy layers fused; null: DFlash's spread
    mask_token_id: Optional[int] = Field(None, ge=0)  # null: the vocabulary's last id
    markov_rank: int = Field(0, ge=0)  # DSpark's low-rank Markov head (0: none)
    confidence: bool = False  # DSpark's confidence head
    # with confidence and draft.adaptive_k: k chosen from the confidence head's acceptance
    # estimate of the previous draft at every depth, in place of the measured counts
    confidence_length: bool = True
    anchors: int = Field(16, ge=1)  # training blocks per rollout
    gamma: float = Field(7.0, gt=0)  # loss weight of drafted position j: exp(-(j - 1) / gamma)
    tv: float = Field(0.0, ge=0)  # weight of the total-variation term (DSpark's CE + TV)
    confidence_weight: float = Field(0.1, ge=0)  # weight of the confidence head's BCE


@_section
class HistorySpec:
    """Group-aware drafting (`HistoryDrafter`, kinds history and hybrid): the continuations
    of the longest matched suffix (min_n <= n <= max_n) in the group's in-flight rollouts and
    the prompt's stored earlier rollouts; a tree of `budget` nodes (hybrid: shared with the
    EAGLE-3 chain of draft.k), `depth` deep (null: draft.k). The store keeps `per_prompt`
    rollouts for each of `prompts` prompts (least recently written reused first) and is
    checkpointed with the run."""

    budget: int = _default(HistoryDrafter, "budget")  # tree nodes per verify
    depth: Optional[int] = Field(None, ge=1)  # history draft depth; null: draft.k
    min_n: int = _default(HistoryDrafter, "min_n")
    max_n: int = _default(HistoryDrafter, "max_n")
    max_matches: int = _default(HistoryDrafter, "max_matches")  # merged per row
    prompts: int = Field(64, ge=1)  # prompt slots in the store
    per_prompt: int = Field(4, ge=1)  # stored rollouts per prompt (a ring)
    # hybrid: the head drafts only in iterations where some live row's history has no
    # full-depth path (false: at every iteration)
    gate_head: bool = _default(HybridDrafter, "gate")
    # history: draft one chain, the best-matched path `depth` deep, not a tree of `budget`
    # nodes (a hybrid policy, family qwen3_5 / qwen3_next, verifies chains only)
    chain: bool = _default(HistoryDrafter, "chain")

    def drafter_settings(self, k: int) -> dict:
        """The HistoryDrafter keywords of these fields.

        Args:
            k: draft.k, the depth when `depth` is null.
        """
        return dict(k=self.depth or k, budget=self.budget, min_n=self.min_n, max_n=self.max_n,
                    max_matches=self.max_matches, chain=self.chain)

    def check(self, k: int) -> None:
        """HistoryDrafter's own checks of these fields at draft depth `k`; a FieldError
        on its `k` is one on `depth`."""
        try:
            HistoryDrafter(store=None, siblings=None, slots=None,
                           **dict(self.drafter_settings(1), k=k))
        except FieldError as e:
            raise ConfigError("depth" if e.field == "k" else e.field, e.value, e.problem,
                              e.valid) from None

    def __post_init__(self):
        self.check(self.depth or 1)


@_section
class DraftSpec:
    """The drafter proposing tokens for the policy to verify: a kind from `draft_kinds.RULES`
    and its settings."""

    kind: str = "eagle3"  # a name in jaxspec.draft_kinds.RULES
    k: int = Field(3, ge=1)  # chain length (drafted tokens per verify)
    # choose k in 0..k (0 = plain) per loop iteration from costs measured at start-up and the
    # live acceptance (chain kinds)
    adaptive_k: bool = False
    # replay: chain drafts drawn from the draft distribution with the verifier's noise at
    # their position, so a calibrated draft is accepted far more often at temperature > 0;
    # false: the draft's argmax
    coupled: bool = True
    tree: Optional[TreeSpec] = None  # null: chain drafting
    draft_vocab_size: Optional[int] = Field(None, ge=1)  # null: the policy's vocabulary
    hf_path: Optional[str] = None  # pretrained head (eagle3/mtp) or draft model directory
    layers: Optional[tuple[int, int, int]] = None  # EAGLE-3 captured layers; null: default
    online: bool = True  # train the kind's head inside each RL step (kinds without: ignored)
    ttt_steps: int = Field(3, ge=1)  # training-time-test unroll steps
    ttt_decay: float = _unit(0.8, True, False)  # loss weight decay^step
    collapse_threshold: float = Field(1.05, ge=1)  # acceptance length under it is a collapse
    collapse_patience: int = Field(3, ge=1)  # alarm after this many collapsed steps in a row
    model: Optional[ModelSpec] = None  # the small model for kind draft_model (or hf_path)
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    history: HistorySpec = Field(default_factory=HistorySpec)  # kinds history and hybrid
    block: BlockSpec = Field(default_factory=BlockSpec)  # kinds block and hybrid_block

    def __post_init__(self):
        draft_kinds.check_draft(self)




def draft_headroom(draft: DraftSpec) -> int:
    """Cache slots a verify step needs beyond the committed tokens: the fed draft nodes + 1."""
    return draft_kinds.headroom(draft)


@_section
class SamplingSpec:
    """The rollout sampling distribution (traced at run time; changing it never recompiles).
    Defaults and range checks are `SamplingConfig`'s (its host-side `check_settings`)."""

    temperature: float = _default(SamplingConfig, "temperature")  # 0 = greedy
    top_k: int = _default(SamplingConfig, "top_k")  # 0 = off
    top_p: float = _default(SamplingConfig, "top_p")  # 1.0 = off

    def __post_init__(self):  # SamplingConfig's own checks, on the host values (no device)
        check_settings(self.temperature, self.top_k, self.top_p)

    def sampling_config(self) -> SamplingConfig:
        """The `SamplingConfig` (device scalars)."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@_section
class RolloutSpec:
    """How a step's rollouts are generated and verified."""

    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)  # G samples per prompt
    max_new_tokens: int = Field(8, ge=1)
    max_prompt_len: int = Field(16, ge=1)  # prompt tokens (BOS included); longer: an error
    method: str = "replay"  # verification rule: jaxspec.decoding.verify.METHODS
    # Rows decoded at once (continuous batching: a finished row's slot takes the next
    # rollout inside the loop; the first sample of every prompt starts first: see
    # rl.rollouts.leaders_first); null: all rollouts of the step at once (a static batch).
    slots: Optional[int] = Field(None, ge=1)
    # A completion that hit max_new_tokens without an EOS is unfinished: 'zero' gives it
    # reward 0 (NeMo RL's default), 'score' grades its text like a finished one.
    truncated_reward: Literal["zero", "score"] = "zero"

    def __post_init__(self):
        methods = importlib.import_module("jaxspec.decoding.verify").METHODS
        if self.method not in methods:
            close = difflib.get_close_matches(self.method, list(methods), n=1)
            raise ConfigError("method", self.method, "not a valid choice" + (
                f" (did you mean '{close[0]}'?)" if close else ""),
                "one of " + ", ".join(repr(m) for m in methods))


@_section
class OptimSpec:
    """AdamW with global-norm clipping and linear warm-up."""

    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    b1: float = _unit(0.9, False, True)
    b2: float = _unit(0.999, False, True)
    eps: float = Field(1e-8, gt=0)
    clip_norm: Optional[float] = Field(1.0, gt=0)  # null = no clipping
    warmup_steps: int = Field(0, ge=0)




@_section
class WarmupSpec:
    """Supervised warm-up that turns the random tiny model into the 'base' policy."""

    steps: int = Field(600, ge=0)
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(64, ge=1)
    draft_rollouts: int = Field(512, ge=1)  # policy rollouts for the in-domain draft init
    draft_steps: int = Field(100, ge=0)  # offline draft steps (fresh EAGLE-3 heads only)


@_section
class TaskSpec:
    """A task from jaxspec.rl.tasks.TASKS, its constructor parameters, or a JSONL file."""

    name: str = "arithmetic"
    params: dict[str, Any] = Field(default_factory=dict)  # {}: the task's own defaults
    path: Optional[str] = None  # the JSONL file for name 'jsonl'
    # Prompts through the HF tokenizer's chat template (one user turn + the assistant
    # header): 'auto' when the tokenizer has one, true requires one, false sends raw text.
    # Built-in tasks use their own character tokenizer, which has none.
    chat_template: Union[bool, Literal["auto"]] = "auto"

    def __post_init__(self):
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
        if self.name != "jsonl" and self.chat_template is True:
            raise ConfigError("chat_template", True, f"task '{self.name}' uses its own "
                              "character tokenizer, which has no chat template",
                              "'auto' or false (templates are for task 'jsonl' with an HF model)")


@_section
class WandbSpec:
    """Weights & Biases logging: metrics.jsonl's rows and the resolved config, process 0
    (`pip install 'jaxspec[wandb]'`)."""

    project: str = "jaxspec"  # the W&B project (not empty)
    name: Optional[str] = None  # the W&B run's name; null: run.dir's last part
    mode: Literal["online", "offline"] = "online"  # offline: <run.dir>/wandb, `wandb sync` it
    entity: Optional[str] = None  # a W&B team or user; null: the login's default

    def __post_init__(self):
        if not self.project.strip():
            raise ConfigError("project", self.project, "out of range", "a W&B project")
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("", dataclasses.asdict(self), "the wandb package is not installed",
                              "pip install 'jaxspec[wandb]', or run.wandb: null (no W&B)")


@_section
class RunSpec:
    """Where a run writes, how long it runs and what it does on trouble."""

    dir: str = "runs/tiny"  # a directory path (not empty; made if missing)
    steps: int = Field(40, ge=1)
    seed: int = 0
    save_every: int = Field(10, ge=0)  # 0 = never
    keep_checkpoints: int = Field(3, ge=1)
    log_every: int = Field(1, ge=1)
    resume: bool = False
    compare_plain: int = Field(5, ge=0)  # also time plain generation every N steps; 0 = off
    # a non-finite loss, gradient norm or parameter: the update is never applied; "stop"
    # ends the run (exit 3), "skip" goes on without it, at most max_nonfinite_skips in a row
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_nonfinite_skips: int = Field(3, ge=1)
    wandb: Optional[WandbSpec] = None  # W&B logging, e.g. {project: p, mode: offline}; null: off

    def __post_init__(self):
        if not self.dir.strip():
            raise ConfigError("dir", self.dir, "out of range",
                              "a directory path (not empty; made if missing)")


@_section
class AsyncSpec:
    """Generation and training on separate device groups, rollouts at most
    `max_policy_lag` policy versions old."""

    enabled: bool = False
    max_policy_lag: int = Field(1, ge=0)
    generation_devices: Optional[int] = Field(None, ge=1)  # null: half of the devices
    training_devices: Optional[int] = Field(None, ge=1)  # null: the rest

    def __post_init__(self):
        if self.enabled and self.max_policy_lag < 1:
            raise ConfigError("max_policy_lag", self.max_policy_lag,
                              "async mode overlaps generation with training", ">= 1")


_MESH_DEFAULTS = inspect.signature(parallel.make_mesh).parameters


@_section
class MeshSpec:
    """Device mesh sizes (-1: all remaining devices; defaults those of `parallel.make_mesh`)
    and logical axis -> mesh axis rules: `parallel.DEFAULT_RULES`, with the entries given
    here replacing theirs."""

    data: int = _MESH_DEFAULTS["data"].default
    fsdp: int = _MESH_DEFAULTS["fsdp"].default
    tensor: int = _MESH_DEFAULTS["tensor"].default
    expert: int = _MESH_DEFAULTS["expert"].default  # expert parallelism (an MoE policy's experts)
    rules: dict[str, Optional[str | tuple[str, ...]]] = Field(
        default_factory=lambda: dict(parallel.DEFAULT_RULES))

    def __post_init__(self):
        parallel.check_mesh_sizes({a: getattr(self, a) for a in parallel.MESH_AXES})
        for logical, target in self.rules.items():
            try:
                parallel.resolve_rules({logical: target})
            except ValueError as e:
                raise ConfigError(f"rules.{logical}", target, str(e)) from None
        object.__setattr__(self, "rules", {**parallel.DEFAULT_RULES, **self.rules})

    def shards(self, logical: str) -> int:
        """Into how many parts the fixed mesh sizes split a logical axis (-1 axes count 1)."""
        axes = parallel.resolve_rules(self.rules)[logical] or ()
        return math.prod(max(getattr(self, a), 1) for a in axes)


@_section
class Config:
    """A whole run. `Config()` is the embedded tiny default (configs/tiny.yaml)."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    draft: DraftSpec = Field(default_factory=DraftSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    draft_optim: OptimSpec = Field(
        default_factory=lambda: OptimSpec(lr=3e-3, b2=0.95, clip_norm=0.5))
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async")
    mesh: MeshSpec = Field(default_factory=MeshSpec)

    def tiny_vocab_size(self) -> int | None:
        """The tiny policy's vocabulary when it is known before the task is built."""
        if self.model.hf_path is not None:
            return None
        if self.model.vocab_size is not None:
            return self.model.vocab_size
        if self.task.name == "jsonl":
            return None
        from jaxspec.rl import tasks

        return tasks.CharTokenizer().vocab_size

    def __post_init__(self):
        m, d = self.model, self.draft
        if m.hf_path is None and self.task.name == "jsonl":
            raise ConfigError("model.hf_path", None,
                              "task 'jsonl' needs a real model and its tokenizer",
                              "a local HF model directory")
        vocab = self.tiny_vocab_size()
        if d.model is not None and d.model.vocab_size not in (None, vocab):
            raise ConfigError("draft.model.vocab_size", d.model.vocab_size,
                              "a draft model shares the policy's tokenizer",
                              f"null or {vocab}")
        if vocab is not None and vocab % self.mesh.shards("vocab"):
            n = self.mesh.shards("vocab")
            axes = self.mesh.rules["vocab"]
            if "tensor" in ((axes,) if isinstance(axes, str) else axes):
                raise ConfigError("mesh.tensor", self.mesh.tensor,
                                  f"the policy's vocabulary ({vocab}) does not split into {n} "
                                  f"shards (mesh.rules.vocab = {axes!r})",
                                  f"sizes whose product divides {vocab}, or mesh.rules.vocab=null")
            raise ConfigError("mesh.rules.vocab", axes,
                              f"the policy's vocabulary ({vocab}) does not split into {n} "
                              f"shards (mesh.rules.vocab = {self.mesh.rules['vocab']!r})",
                              f"sizes whose product divides {vocab}, or mesh.rules.vocab=null")
        if self.rollout.method == "greedy" and self.sampling.temperature != 0:
            raise ConfigError("rollout.method", "greedy",
                              f"greedy verification is lossless only for temperature 0 "
                              f"(sampling.temperature = {self.sampling.temperature})",
                              "'replay' or 'rejection', or sampling.temperature=0")
        if self.rollout.method == "rejection":
            draft_kinds.check_rejection(d)
        if self.rollout.method == "rejection" and d.adaptive_k:
            raise ConfigError("rollout.method", "rejection",
                              "with draft.adaptive_k the k schedule follows measured timings, and "
                              "with rejection sampling the tokens follow the drafts, so a run (or "
                              "its resume) would not be reproducible",
                              "'replay' (tokens independent of the drafts), or draft.adaptive_k=false")
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.grpo.minibatches:
            raise ConfigError("grpo.minibatches", self.grpo.minibatches,
                              f"does not divide the {batch} rollouts of a step "
                              f"(rollout.prompts_per_step x rollout.group_size)",
                              f"a divisor of {batch}")
        micro = self.grpo.micro_batch
        if micro and (batch // self.grpo.minibatches) % micro:
            raise ConfigError("grpo.micro_batch", micro,
                              f"does not divide the {batch // self.grpo.minibatches} rollouts of "
                              f"a minibatch (rollouts of a step / grpo.minibatches)",
                              f"0 or a divisor of {batch // self.grpo.minibatches}")
        if self.async_.enabled and self.grpo.tis == "none":
            raise ConfigError("grpo.tis", "none",
                              "async rollouts are off-policy by up to max_policy_lag steps",
                              "'token' or 'sequence' when async.enabled")


_CONFIG = pydantic.TypeAdapter(Config)


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
    if os.path.exists(cfg.run.dir) and not os.path.isdir(cfg.run.dir):
        raise ConfigError("run.dir", cfg.run.dir, "an existing file, not a directory",
                          "a directory (made if missing)")


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(item, None, "an override must look like key=value",
                          "e.g. draft.k=4 or run.dir=runs/x")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key, text, "empty key in override", "a dotted key such as draft.k")
    try:
        value = _yaml_load(text) if text.strip() else None
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
    """A Config from a plain nested mapping (the YAML layout).

    Args:
        data: the sections as nested mappings, lists and scalars.
        check_paths: also check that the local files the config names exist.

    Returns:
        The validated Config.

    Raises:
        ConfigError: the first bad entry, with its dotted key.
    """
    # As JSON, so that pydantic's strict mode takes mappings for dataclasses and lists for
    # tuples (non-finite floats pass as Infinity / NaN and are refused by the schema; other
    # YAML scalars, such as dates, as their text).
    text = json.dumps(data or {}, allow_nan=True, default=str)
    try:
        cfg = _CONFIG.validate_json(text, strict=True)
    except pydantic.ValidationError as e:
        raise _config_error(e, Config) from None
    if check_paths:
        _check_paths(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = (),
                *, check_paths: bool = True) -> Config:
    """Config from a YAML file plus `a.b=c` overrides.

    Args:
        path: a YAML file; None: the embedded tiny default.
        overrides: `key=value` items whose values are parsed as YAML scalars
            (`draft.tree=null`, `grpo.clip_c=3`).
        check_paths: also check that the local files the config names exist.

    Returns:
        The validated Config.

    Raises:
        ConfigError: the first bad entry, with its dotted key.
    """
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("<file>", str(path), "no such config file",
                              "a YAML file such as configs/tiny.yaml")
        with open(path) as fh:
            try:
                raw = _yaml_load(fh) or {}
            except yaml.YAMLError as e:
                raise ConfigError("<file>", str(path), f"not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("<file>", str(path), "the top level must be a mapping")
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(raw, check_paths=check_paths)


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain YAML-able data (the file layout; `from_dict` inverts it)."""
    return _CONFIG.dump_python(cfg, mode="json", by_alias=True)


def save(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config (e.g. <run.dir>/config.yaml) so a run records what it ran."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False, default_flow_style=None)
