"""Run configuration: the library's own frozen dataclasses as the schema, read from YAML
files and `a.b=c` overrides.

A key has one default and one check, in one place. Where the library defines a setting, the
section is the library's class or derived from it: `grpo` is `rl.grpo.GRPOConfig`,
`draft.tree` is `decoding.drafters.TreeSpec`; `model` holds `models.config.ModelConfig`'s
fields (defaults: its tiny preset with 4 layers and a 256-slot cache) and is checked by
building one; `draft.ngram` takes defaults and checks from `NGramDrafter`; `sampling` takes
its defaults and checks from `decoding.sampling.SamplingConfig` (its host-side
`check_settings`, so loading a file touches no device); `mesh` takes axes, sizes and
rules from `parallel` (`make_mesh`'s defaults, `DEFAULT_RULES`, `check_mesh_sizes`, `resolve_rules`). The
trainer-only sections (rollout, optim, warmup, task, run, async) are defined here.

A library class raises ValueError naming its field (`TreeSpec.budget ...`); the loader turns
it into one `ConfigError` with the full dotted key, the value and what is valid. Every float
must be finite. YAML is read with YAML 1.2 floats, so `1e-5` is a number.

Why a small loader over dataclasses rather than pydantic: the schema has to be the library's
plain frozen dataclasses (hashable static jit arguments, usable with no config layer);
pydantic would need a second model per class, the duplication this module removes, or
pydantic types inside the library. The loader below (coercion, dotted keys, "did you mean")
is about 250 lines. Library classes are imported on first use, so `import jaxspec.config`
imports neither jax nor the trainer.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import types
import typing
from typing import Any, Callable, Literal, Optional, Union

import yaml

__all__ = [
    "AsyncSpec",
    "Config",
    "ConfigError",
    "DraftSpec",
    "GRPOConfig",
    "MeshSpec",
    "ModelSpec",
    "HistorySpec",
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


# ----------------------------------------------------------------------------- library types

# Schema types the library defines, imported on first use (they import jax).
_LIBRARY = {
    "GRPOConfig": "jaxspec.rl.grpo",
    "Llama3RopeScaling": "jaxspec.models.config",
    "ModelConfig": "jaxspec.models.config",
    "NGramDrafter": "jaxspec.decoding.drafters",
    "HistoryDrafter": "jaxspec.decoding.history",
    "HybridDrafter": "jaxspec.decoding.history",
    "SamplingConfig": "jaxspec.decoding.sampling",
    "TreeSpec": "jaxspec.decoding.drafters",
}


def _lib(name: str):
    return getattr(importlib.import_module(_LIBRARY[name]), name)


def __getattr__(name: str):  # `jaxspec.config.TreeSpec` is the library's class itself
    if name in _LIBRARY:
        return _lib(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _parallel():
    return importlib.import_module("jaxspec.parallel")


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


# ----------------------------------------------------------------------------- fields

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


def _library_default(cls_name: str, name: str):
    """The default of field `name` of library class `cls_name`: a lazy factory."""
    def default():
        f = {f.name: f for f in dataclasses.fields(_lib(cls_name))}[name]
        return f.default if f.default_factory is _MISSING else f.default_factory()
    return dataclasses.field(default_factory=default)


# ----------------------------------------------------------------------------- schema core

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, localns={n: _lib(n) for n in _LIBRARY})
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
    return {bool: "true or false", int: "an integer", float: "a finite number",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


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
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                math.isfinite(value):
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


def _checked(cls, f: dataclasses.Field, value):
    """Field `f` of `cls` coerced to its type and checked, or one ConfigError (key relative)."""
    hint = _hints(cls)[f.name]
    key = _yaml_key(f)
    try:
        value = _coerce(hint, value)
    except _Bad:
        problem = "wrong type"
        if (isinstance(value, float) and not math.isfinite(value)) or (
                isinstance(value, str) and value.strip().lstrip("+-.").lower() in ("inf", "nan")):
            problem = "not a finite number"
        if typing.get_origin(hint) is Literal:
            choices = [str(a) for a in typing.get_args(hint)]
            close = difflib.get_close_matches(str(value), choices, n=1)
            problem = "not a valid choice" + (f" (did you mean '{close[0]}'?)" if close else "")
        raise ConfigError(key, value, problem, _describe(hint)) from None
    except ConfigError as e:
        raise e.under(key) from None
    check = f.metadata.get("check")
    if check is not None and value is not None and not check(value):
        raise ConfigError(key, value, "out of range", f.metadata.get("valid"))
    return value


def _library_error(obj_or_cls, values: dict, error: Exception) -> ConfigError:
    """A library class's ValueError as a ConfigError on the field its message is about
    (`TreeSpec.budget ...`; else a field it names, preferring one not at its default)."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    text = str(error)
    subject = [m.group(1) for m in re.finditer(r"\b[A-Za-z_]\w*\.(\w+)", text)
               if m.group(1) in fields]
    named = [n for n in fields if re.search(rf"\b{n}\b", text)]

    def changed(n):
        f = fields[n]
        default = f.default if f.default_factory is _MISSING else f.default_factory()
        return n in values and values[n] != default

    pick = subject[0] if subject else next((n for n in named if changed(n)),
                                           named[0] if named else None)
    if pick is None:
        return ConfigError("", values, text)
    value = values.get(pick, getattr(obj_or_cls, pick, None))
    prefix = f"{cls.__name__}.{pick}={value!r}"
    problem = text[len(prefix):].lstrip(" :;,") if text.startswith(prefix) else text
    return ConfigError(_yaml_key(fields[pick]), value, problem or text)


class _Section:
    """Base of the config's own sections: coerces and checks each field on construction."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked(type(self), f, getattr(self, f.name)))
        self._validate()

    def _validate(self) -> None:
        """Checks that involve several fields; raise ConfigError(field, ...)."""

    def _library_check(self, build: Callable[[], Any]):
        """`build()` (which constructs a library object from these fields) or a ConfigError."""
        try:
            return build()
        except (ValueError, TypeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise _library_error(self, {f.name: getattr(self, f.name)
                                        for f in dataclasses.fields(self)}, e) from None


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
    """Section or library class `cls` from a plain mapping; errors carry keys relative to
    the caller."""
    if not isinstance(data, dict):
        raise ConfigError("", data, "expected a mapping", _describe(cls))
    by_key = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in by_key:
            hint = _suggest(cls, str(key), prefix)
            raise ConfigError(str(key), value, "unknown key" + (f" ({hint})" if hint else ""),
                              ", ".join(by_key))
        f = by_key[key]
        target = _section_type(_hints(cls)[f.name])
        if target is not None and isinstance(value, dict):
            try:
                value = _build(target, value, prefix + key + ".")
            except ConfigError as e:
                raise e.under(key) from None
        kwargs[f.name] = _checked(cls, f, value)
    if issubclass(cls, _Section):
        return cls(**kwargs)
    try:  # a library class checks itself
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise _library_error(cls, kwargs, e) from None


# ----------------------------------------------------------------------------- sections

_TINY_POLICY = dict(family="qwen3", num_layers=4, max_position_embeddings=256)


@functools.cache
def _tiny_policy():
    """The tiny run's policy: ModelConfig's tiny preset with 4 layers and a 256-slot cache."""
    return _lib("ModelConfig").tiny(**_TINY_POLICY)


def _tiny(name: str):
    return dataclasses.field(default_factory=lambda: getattr(_tiny_policy(), name))


@dataclasses.dataclass(frozen=True)
class ModelSpec(_Section):
    """The policy: a local HF directory (`hf_path`; the architecture fields are then read
    from its config.json and ignored here) or a tiny transformer built from these fields,
    which are `ModelConfig`'s (defaults from `ModelConfig.tiny`, checks by `ModelConfig`)."""

    hf_path: Optional[str] = None
    family: str = _tiny("family")
    vocab_size: Optional[int] = None  # null: the task tokenizer's vocabulary
    hidden_size: int = _tiny("hidden_size")
    intermediate_size: int = _tiny("intermediate_size")
    num_layers: int = _tiny("num_layers")
    num_heads: int = _tiny("num_heads")
    num_kv_heads: int = _tiny("num_kv_heads")
    head_dim: int = _tiny("head_dim")
    rope_theta: float = _tiny("rope_theta")
    rope_scaling: Optional[Llama3RopeScaling] = _tiny("rope_scaling")  # noqa: F821 (lazy)
    rms_norm_eps: float = _tiny("rms_norm_eps")
    qk_norm: bool = _tiny("qk_norm")
    tie_embeddings: bool = _tiny("tie_embeddings")
    max_position_embeddings: int = _tiny("max_position_embeddings")
    dtype: str = _tiny("dtype")
    attention_backend: str = _tiny("attention_backend")  # jaxspec.kernels.BACKENDS
    batch_invariant: bool = _tiny("batch_invariant")  # bitwise bf16 replay; costs speed
    layer_loop: str = _tiny("layer_loop")  # decoding: auto | scan | unroll (jaxspec.models)

    def model_config(self, vocab_size: int):
        """The `ModelConfig` of these fields with the given vocabulary."""
        names = [f.name for f in dataclasses.fields(_lib("ModelConfig")) if f.name != "vocab_size"]
        return _lib("ModelConfig")(vocab_size=vocab_size, **{n: getattr(self, n) for n in names})

    def _validate(self):
        self._library_check(lambda: self.model_config(
            self.vocab_size if self.vocab_size is not None else 1))


@dataclasses.dataclass(frozen=True)
class NgramSpec(_Section):
    """Prompt-lookup drafting (`NGramDrafter`): match the last n tokens, min_n <= n <= max_n."""

    min_n: int = _library_default("NGramDrafter", "min_n")
    max_n: int = _library_default("NGramDrafter", "max_n")

    def _validate(self):
        self._library_check(lambda: _lib("NGramDrafter")(min_n=self.min_n, max_n=self.max_n))


@dataclasses.dataclass(frozen=True)
class HistorySpec(_Section):
    """Group-aware drafting (`HistoryDrafter`, kinds history and hybrid): the continuations of
    the longest matched suffix (min_n <= n <= max_n) in the group's in-flight rollouts and the
    prompt's stored earlier rollouts; a tree of `budget` nodes (hybrid: shared with the
    EAGLE-3 chain of draft.k), `depth` deep (null: draft.k). The store keeps `per_prompt` rollouts for each of `prompts`
    prompts (least recently written reused first) and is checkpointed with the run."""

    budget: int = _library_default("HistoryDrafter", "budget")  # tree nodes per verify
    depth: Optional[int] = _field(None, **_ge(1))  # history draft depth; null: draft.k
    min_n: int = _library_default("HistoryDrafter", "min_n")
    max_n: int = _library_default("HistoryDrafter", "max_n")
    max_matches: int = _library_default("HistoryDrafter", "max_matches")  # merged per row
    prompts: int = _field(64, **_ge(1))  # prompt slots in the store
    per_prompt: int = _field(4, **_ge(1))  # stored rollouts per prompt (a ring)
    # hybrid: the head drafts only in iterations where some live row's history has no
    # full-depth path (false: at every iteration)
    gate_head: bool = _library_default("HybridDrafter", "gate")

    def drafter_settings(self, k: int) -> dict:
        """The HistoryDrafter keywords of these fields (depth: `depth`, else k)."""
        return dict(k=self.depth or k, budget=self.budget, min_n=self.min_n, max_n=self.max_n,
                    max_matches=self.max_matches)

    def _validate(self):
        self._library_check(lambda: _lib("HistoryDrafter")(
            store=None, siblings=None, slots=None, **self.drafter_settings(1)))


@dataclasses.dataclass(frozen=True)
class DraftSpec(_Section):
    """The drafter proposing tokens for the policy to verify."""

    # history: group-aware suffix drafts; hybrid: history + the EAGLE-3 chain in one tree
    kind: Literal["none", "eagle3", "mtp", "draft_model", "ngram", "history", "hybrid"] = "eagle3"
    k: int = _field(3, **_ge(1))  # chain length (drafted tokens per verify)
    # choose k in 0..k (0 = plain) per loop iteration from costs measured at start-up and the
    # live acceptance (chain kinds eagle3 / mtp / draft_model / ngram)
    adaptive_k: bool = False
    # replay: chain drafts (eagle3 / mtp / draft_model, the hybrid's head) drawn from the
    # draft distribution with the verifier's noise at their position, so a calibrated draft is
    # accepted far more often at temperature > 0; false: the draft's argmax
    coupled: bool = True
    tree: Optional[TreeSpec] = None  # noqa: F821 (lazy) null: chain drafting
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
    history: HistorySpec = _field(factory=HistorySpec)  # kinds history and hybrid

    def _validate(self):
        if self.tree is not None and self.kind in ("none", "ngram", "history", "hybrid"):
            raise ConfigError("tree", dataclasses.asdict(self.tree),
                              f"draft kind '{self.kind}' does not take draft.tree"
                              + (" (its tree is draft.history.budget nodes)"
                                 if self.kind in ("history", "hybrid") else ""),
                              "null, or kind eagle3 / mtp / draft_model")
        if self.kind in ("history", "hybrid"):  # the budget must hold a chain of k
            deepest = self.history.depth or self.k  # hybrid: the head's chain too
            deepest = max(deepest, self.k) if self.kind == "hybrid" else deepest
            try:
                self.history._library_check(lambda: _lib("HistoryDrafter")(
                    store=None, siblings=None, slots=None,
                    **dict(self.history.drafter_settings(self.k), k=deepest)))
            except ConfigError as e:
                raise e.under("history") from None
        if self.adaptive_k and (self.kind not in ("eagle3", "mtp", "draft_model", "ngram")
                                or self.tree is not None):
            raise ConfigError("adaptive_k", True,
                              f"adaptive draft length needs chain drafts; draft kind "
                              f"'{self.kind}'" + (" with draft.tree" if self.tree is not None else "")
                              + " has none", "false, or kind eagle3 / mtp / draft_model / ngram "
                              "without draft.tree")
        if self.kind == "draft_model" and self.model is None and self.hf_path is None:
            raise ConfigError("model", None, "kind 'draft_model' needs a model",
                              "a model spec (draft.model.*) or draft.hf_path")
        if self.kind != "none":  # a verify step accepts at most depth + 1 tokens
            most = (self.tree.depth if self.tree is not None else self.k) + 1
            what = "draft.tree.depth" if self.tree is not None else "draft.k"
            if self.kind == "history":
                most = self.history.drafter_settings(self.k)["k"] + 1
                what = "draft.history.depth (or draft.k)"
            elif self.kind == "hybrid":
                most = max(self.k, self.history.depth or self.k) + 1
                what = "the deeper of draft.k and draft.history.depth"
            if self.collapse_threshold > most:
                raise ConfigError("collapse_threshold", self.collapse_threshold,
                                  f"above the longest possible acceptance ({what} + 1 = {most}),"
                                  f" so the alarm would never clear", f"a number in [1, {most}]")


def draft_headroom(draft: DraftSpec) -> int:
    """Cache slots a verify step needs beyond the committed tokens: the fed draft nodes + 1."""
    if draft.kind == "none":
        return 1
    if draft.kind in ("history", "hybrid"):
        return draft.history.budget + 1
    return (draft.tree.budget if draft.tree is not None else draft.k) + 1


@dataclasses.dataclass(frozen=True)
class SamplingSpec(_Section):
    """The rollout sampling distribution (traced at run time; changing it never recompiles).
    Defaults and range checks are `SamplingConfig`'s (its host-side `check_settings`)."""

    temperature: float = _library_default("SamplingConfig", "temperature")  # 0 = greedy
    top_k: int = _library_default("SamplingConfig", "top_k")  # 0 = off
    top_p: float = _library_default("SamplingConfig", "top_p")  # 1.0 = off

    def _validate(self):  # SamplingConfig's own checks, on the host values (no device work)
        self._library_check(lambda: importlib.import_module("jaxspec.decoding.sampling")
                            .check_settings(self.temperature, self.top_k, self.top_p))

    def sampling_config(self):
        """The `SamplingConfig` (device scalars)."""
        return _lib("SamplingConfig")(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclasses.dataclass(frozen=True)
class RolloutSpec(_Section):
    prompts_per_step: int = _field(8, **_ge(1))
    group_size: int = _field(8, **_ge(2))  # G samples per prompt
    max_new_tokens: int = _field(8, **_ge(1))
    max_prompt_len: int = _field(16, **_ge(1))  # prompt tokens (BOS included); longer: an error
    method: str = "replay"  # verification rule: jaxspec.decoding.verify.METHODS
    # Rows decoded at once (continuous batching: a finished row's slot takes the next
    # rollout inside the loop; the first sample of every prompt starts first: see
    # rl.rollouts.leaders_first); null: all rollouts of the step at once (a static batch).
    slots: Optional[int] = _field(None, **_ge(1))
    # A completion that hit max_new_tokens without an EOS is unfinished: 'zero' gives it
    # reward 0 (NeMo RL's default), 'score' grades its text like a finished one.
    truncated_reward: Literal["zero", "score"] = "zero"

    def _validate(self):
        methods = importlib.import_module("jaxspec.decoding.verify").METHODS
        if self.method not in methods:
            close = difflib.get_close_matches(self.method, list(methods), n=1)
            raise ConfigError("method", self.method, "not a valid choice" + (
                f" (did you mean '{close[0]}'?)" if close else ""),
                "one of " + ", ".join(repr(m) for m in methods))


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
    # Prompts through the HF tokenizer's chat template (one user turn + the assistant
    # header): 'auto' when the tokenizer has one, true requires one, false sends raw text.
    # Built-in tasks use their own character tokenizer, which has none.
    chat_template: Union[bool, Literal["auto"]] = "auto"

    def _validate(self):
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


@dataclasses.dataclass(frozen=True)
class WandbSpec(_Section):
    """Weights & Biases logging: metrics.jsonl's rows and the resolved config, process 0
    (`pip install 'jaxspec[wandb]'`)."""

    project: str = _field("jaxspec", check=lambda v: bool(v.strip()), valid="a W&B project")
    name: Optional[str] = None  # the W&B run's name; null: run.dir's last part
    mode: Literal["online", "offline"] = "online"  # offline: <run.dir>/wandb, `wandb sync` it
    entity: Optional[str] = None  # a W&B team or user; null: the login's default

    def _validate(self):
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("", dataclasses.asdict(self), "the wandb package is not installed",
                              "pip install 'jaxspec[wandb]', or run.wandb: null (no W&B)")


@dataclasses.dataclass(frozen=True)
class RunSpec(_Section):
    dir: str = _field("runs/tiny", check=lambda v: bool(v.strip()),
                      valid="a directory path (not empty; made if missing)")
    steps: int = _field(40, **_ge(1))
    seed: int = 0
    save_every: int = _field(10, **_ge(0))  # 0 = never
    keep_checkpoints: int = _field(3, **_ge(1))
    log_every: int = _field(1, **_ge(1))
    resume: bool = False
    compare_plain: int = _field(5, **_ge(0))  # also time plain generation every N steps; 0 = off
    # a non-finite loss, gradient norm or parameter: the update is never applied; "stop"
    # ends the run (exit 3), "skip" goes on without it, at most max_nonfinite_skips in a row
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_nonfinite_skips: int = _field(3, **_ge(1))
    wandb: Optional[WandbSpec] = None  # W&B logging, e.g. {project: p, mode: offline}; null: off


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


def _mesh_default(axis: str) -> int:
    return inspect.signature(_parallel().make_mesh).parameters[axis].default


@dataclasses.dataclass(frozen=True)
class MeshSpec(_Section):
    """Device mesh sizes (-1: all remaining devices; defaults those of `parallel.make_mesh`)
    and logical axis -> mesh axis rules: `parallel.DEFAULT_RULES`, with the entries given
    here replacing theirs."""

    data: int = dataclasses.field(default_factory=lambda: _mesh_default("data"))
    fsdp: int = dataclasses.field(default_factory=lambda: _mesh_default("fsdp"))
    tensor: int = dataclasses.field(default_factory=lambda: _mesh_default("tensor"))
    rules: dict[str, Optional[str | tuple[str, ...]]] = dataclasses.field(
        default_factory=lambda: dict(_parallel().DEFAULT_RULES))

    def _validate(self):
        parallel = _parallel()
        self._library_check(lambda: parallel.check_mesh_sizes(
            {a: getattr(self, a) for a in parallel.MESH_AXES}))
        for logical, target in self.rules.items():
            try:
                parallel.resolve_rules({logical: target})
            except ValueError as e:
                raise ConfigError(f"rules.{logical}", target, str(e)) from None
        object.__setattr__(self, "rules", {**parallel.DEFAULT_RULES, **self.rules})

    def shards(self, logical: str) -> int:
        """Into how many parts the fixed mesh sizes split a logical axis (-1 axes count 1)."""
        axes = _parallel().resolve_rules(self.rules)[logical] or ()
        return math.prod(max(getattr(self, a), 1) for a in axes)


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    """A whole run. `Config()` is the embedded tiny default (configs/tiny.yaml)."""

    model: ModelSpec = _field(factory=ModelSpec)
    draft: DraftSpec = _field(factory=DraftSpec)
    sampling: SamplingSpec = _field(factory=SamplingSpec)
    rollout: RolloutSpec = _field(factory=RolloutSpec)
    grpo: GRPOConfig = _field(factory=lambda: _lib("GRPOConfig")())  # noqa: F821 (lazy)
    optim: OptimSpec = _field(factory=OptimSpec)
    draft_optim: OptimSpec = _field(factory=lambda: OptimSpec(lr=3e-3, b2=0.95, clip_norm=0.5))
    warmup: WarmupSpec = _field(factory=WarmupSpec)
    task: TaskSpec = _field(factory=TaskSpec)
    run: RunSpec = _field(factory=RunSpec)
    async_: AsyncSpec = _field(factory=AsyncSpec, key="async")
    mesh: MeshSpec = _field(factory=MeshSpec)

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

    def _validate(self):
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
        if self.rollout.method == "rejection" and d.tree is not None:
            raise ConfigError("rollout.method", "rejection",
                              "the rejection rule verifies sampled chains, not trees",
                              "'replay' or 'greedy', or draft.tree=null")
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
                raw = _yaml_load(fh) or {}
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
