"""Hugging Face interop: load a local HF directory into a `Policy`, export one back.

HF tensor names map to our params by one table of key patterns (`_WEIGHTS`); each entry
knows the HF shape, how to reshape into our layout and back. Nothing here downloads:
`path` must be a local directory with config.json and *.safetensors (a single file, a
sharded set with model.safetensors.index.json, or any *.safetensors files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxspec.models.config import DTYPES, HYBRID_FAMILIES, Llama3RopeScaling, ModelConfig
from jaxspec.models.transformer import Policy, param_path


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture or option this implementation does not cover."""


class HFCheckpointError(ValueError):
    """The checkpoint's tensors do not match the config (missing, unexpected, wrong shape)."""


_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                  "Qwen3MoeForCausalLM": "qwen3_moe",
                  # the hybrid families: config and tensor table in jaxspec.models.hybrid_hf
                  "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3NextForCausalLM": "qwen3_next",
                  "Qwen3_5MoeForCausalLM": "qwen3_5_moe"}
_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "qwen3_moe": "qwen3_moe",
                "qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next",
                "qwen3_5_moe_text": "qwen3_5_moe"}
_FAMILY_ARCH = {v: k for k, v in _ARCHITECTURES.items()}
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Non-persistent buffers some older checkpoints carry; never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# --------------------------------------------------------------------------- config


def config_from_hf(
    hf: dict, *, dtype: str | None = None, attention_backend: str = "reference"
) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (transformers 4 and 5 spellings)."""
    from jaxspec.models import hybrid_hf

    hf = hybrid_hf.text_part(hf)  # a multimodal Qwen3.5 checkpoint: its language model
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    family = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if family is None and not archs:
        family = _MODEL_TYPES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or None} (model_type={model_type!r}); "
            f"supported: {sorted(_ARCHITECTURES)}"
        )
    if family in HYBRID_FAMILIES:
        from jaxspec.models import hybrid_hf

        return hybrid_hf.config_from_hf(hf, family, dtype=dtype,
                                        attention_backend=attention_backend)
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (need 'silu')")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(flag):
            problems.append(f"{flag}=True")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        problems.append(f"per-layer-type rope parameters {sorted(rope)}")
        rope = {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1")
    scaling = None
    if rope_type == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        except KeyError as e:
            problems.append(f"llama3 rope parameters lack {e.args[0]!r}")
    elif rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (supported: 'default', 'llama3')")
    if problems:
        raise UnsupportedModelError(
            f"unsupported {archs or model_type} configuration: " + "; ".join(problems)
        )
    if dtype is None:
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    heads = _positive_int(hf, "num_attention_heads")
    hidden = _positive_int(hf, "hidden_size")
    kv_heads = _positive_int(hf, "num_key_value_heads", default=heads)
    head_dim = _positive_int(hf, "head_dim", default=hidden // heads or 1)
    experts = _experts_from_hf(hf) if family == "qwen3_moe" else {}
    try:
        return ModelConfig(
            vocab_size=_positive_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(hf, "intermediate_size"),
            num_layers=_positive_int(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=_positive_int(hf, "max_position_embeddings", default=40960),
            dtype=dtype,
            attention_backend=attention_backend,
            family=family,
            **experts,
        )
    except ValueError as e:  # ModelConfig's own checks (e.g. heads vs kv heads)
        raise HFCheckpointError(f"config.json describes an invalid model: {e}") from None


def _experts_from_hf(hf: dict) -> dict:
    """The qwen3_moe fields of ModelConfig from a Qwen3MoeConfig's config.json (transformers 5
    writes `num_local_experts` where 4 and the Hub's files have `num_experts`)."""
    if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in only):
        raise HFCheckpointError(f"config.json 'mlp_only_layers' = {only!r}; valid: a list of "
                                "layer indices")
    norm = hf.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise HFCheckpointError(f"config.json 'norm_topk_prob' = {norm!r}; valid: true or false")
    shared = hf.get("shared_expert_intermediate_size") or 0
    if shared:
        shared = _positive_int(hf, "shared_expert_intermediate_size")
    return dict(
        num_experts=_positive_int(hf, "num_experts"),
        num_experts_per_tok=_positive_int(hf, "num_experts_per_tok"),
        moe_intermediate_size=_positive_int(hf, "moe_intermediate_size"),
        norm_topk_prob=norm,
        decoder_sparse_step=_positive_int(hf, "decoder_sparse_step", default=1),
        mlp_only_layers=tuple(only),
        shared_expert_intermediate_size=shared,
    )


def _positive_int(hf: dict, key: str, *, default: int | None = None) -> int:
    """hf[key] as an int >= 1; a missing required key or a bad value names the key."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise HFCheckpointError(
                f"config.json has no {key!r}: a {hf.get('model_type') or 'Qwen3/Llama'} "
                f"config needs it (an integer >= 1)"
            )
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFCheckpointError(f"config.json {key!r} = {value!r}; valid: an integer >= 1")
    return value


def config_to_hf(config: ModelConfig) -> dict:
    """config.json for Qwen3ForCausalLM / LlamaForCausalLM / Qwen3MoeForCausalLM (read by
    transformers 4.51+ and 5; the hybrid families': jaxspec.models.hybrid_hf)."""
    if config.is_hybrid:
        from jaxspec.models import hybrid_hf

        return hybrid_hf.config_to_hf(config)
    rope = {"rope_theta": config.rope_theta, "rope_type": "default"}
    legacy_scaling = None
    if config.rope_scaling is not None:
        legacy_scaling = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
        rope = {**legacy_scaling, "rope_theta": config.rope_theta}
    hf = {
        "architectures": [_FAMILY_ARCH[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": config.rope_theta,  # transformers 4
        "rope_scaling": legacy_scaling,  # transformers 4
        "rope_parameters": rope,  # transformers 5
        "dtype": config.dtype,
        "torch_dtype": config.dtype,
        "use_cache": True,
    }
    if config.family in ("qwen3", "qwen3_moe"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
    if config.family == "qwen3_moe":
        hf.update(num_experts=config.num_experts, num_local_experts=config.num_experts,
                  num_experts_per_tok=config.num_experts_per_tok,
                  moe_intermediate_size=config.moe_intermediate_size,
                  norm_topk_prob=config.norm_topk_prob,
                  decoder_sparse_step=config.decoder_sparse_step,
                  mlp_only_layers=list(config.mlp_only_layers),
                  output_router_logits=False, router_aux_loss_coef=0.001)
        if config.shared_expert_intermediate_size:  # Qwen2-MoE's key (Qwen3-MoE has none)
            hf["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    elif config.family == "llama":
        hf.update(mlp_bias=False, pretraining_tp=1)
    return hf


# --------------------------------------------------------------------------- weight table


@dataclasses.dataclass(frozen=True)
class _Weight:
    hf_name: str  # "{i}" stands for the layer index
    # our param path (layer params are stacked on axis 0); a tuple of paths where one HF
    # tensor holds several of ours (to_ours returns, to_hf takes, one array per path)
    path: tuple[str, ...] | tuple[tuple[str, ...], ...]
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    when: Callable[[ModelConfig], bool] = lambda c: True
    # the layers whose checkpoint has this tensor (dense MLP vs experts); None: every layer
    kind: str | None = None  # "dense" | "sparse" | None

    @property
    def paths(self) -> tuple[tuple[str, ...], ...]:
        return self.path if isinstance(self.path[0], tuple) else (self.path,)

    def parts_to_ours(self, w: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, ...]:
        out = self.to_ours(w, config)
        return out if len(self.paths) > 1 else (out,)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf_name

    def layers(self, config: ModelConfig) -> list[int]:
        if self.kind is None:
            return list(range(config.num_layers))
        want = self.kind == "sparse"
        return [i for i, s in enumerate(config.sparse_layers) if s == want]


def _same(w, c):
    return w


def _transpose(w, c):
    return w.T


def _w(hf_name, path, hf_shape, to_ours=_same, to_hf=_same, when=lambda c: True, kind=None):
    """path: "a.b.c", or a tuple of them (one HF tensor holding several of our params)."""
    path = (tuple(tuple(p.split(".")) for p in path) if isinstance(path, tuple)
            else tuple(path.split(".")))
    return _Weight(hf_name, path, hf_shape, to_ours, to_hf, when, kind)


def _mlp(prefix, path, width, when, kind):
    """The three SwiGLU projections (HF [out, in] <-> ours [in, out])."""
    return (
        _w(prefix + "gate_proj.weight", path + ".gate_proj", lambda c: (width(c), c.hidden_size),
           _transpose, _transpose, when=when, kind=kind),
        _w(prefix + "up_proj.weight", path + ".up_proj", lambda c: (width(c), c.hidden_size),
           _transpose, _transpose, when=when, kind=kind),
        _w(prefix + "down_proj.weight", path + ".down_proj", lambda c: (c.hidden_size, width(c)),
           _transpose, _transpose, when=when, kind=kind),
    )


_LAYER = "model.layers.{i}."
_WEIGHTS = (
    _w("model.embed_tokens.weight", "embed_tokens", lambda c: (c.vocab_size, c.hidden_size)),
    _w("model.norm.weight", "norm.scale", lambda c: (c.hidden_size,)),
    _w("lm_head.weight", "lm_head", lambda c: (c.vocab_size, c.hidden_size),
       _transpose, _transpose, when=lambda c: not c.tie_embeddings),
    _w(_LAYER + "input_layernorm.weight", "layers.input_layernorm.scale",
       lambda c: (c.hidden_size,)),
    _w(_LAYER + "post_attention_layernorm.weight", "layers.post_attention_layernorm.scale",
       lambda c: (c.hidden_size,)),
    # q/k/v: HF [heads*head_dim, H] <-> ours [H, heads, head_dim]
    _w(_LAYER + "self_attn.q_proj.weight", "layers.self_attn.q_proj",
       lambda c: (c.num_heads * c.head_dim, c.hidden_size),
       lambda w, c: w.T.reshape(c.hidden_size, c.num_heads, c.head_dim),
       lambda w, c: w.reshape(c.hidden_size, -1).T),
    _w(_LAYER + "self_attn.k_proj.weight", "layers.self_attn.k_proj",
       lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
       lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
       lambda w, c: w.reshape(c.hidden_size, -1).T),
    _w(_LAYER + "self_attn.v_proj.weight", "layers.self_attn.v_proj",
       lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
       lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
       lambda w, c: w.reshape(c.hidden_size, -1).T),
    # o: HF [H, heads*head_dim] <-> ours [heads, head_dim, H]
    _w(_LAYER + "self_attn.o_proj.weight", "layers.self_attn.o_proj",
       lambda c: (c.hidden_size, c.num_heads * c.head_dim),
       lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
       lambda w, c: w.reshape(-1, c.hidden_size).T),
    _w(_LAYER + "self_attn.q_norm.weight", "layers.self_attn.q_norm.scale",
       lambda c: (c.head_dim,), when=lambda c: c.qk_norm),
    _w(_LAYER + "self_attn.k_norm.weight", "layers.self_attn.k_norm.scale",
       lambda c: (c.head_dim,), when=lambda c: c.qk_norm),
    # the dense MLP (every layer of a dense model; an MoE model's mlp_only layers)
    *_mlp(_LAYER + "mlp.", "layers.mlp", lambda c: c.intermediate_size,
          lambda c: c.has_dense_mlp, "dense"),
    # qwen3_moe: router gate.weight [E, H] <-> ours [H, E]; one tensor per expert and
    # projection, as transformers writes them ("{j}" the expert: it fuses them only in memory)
    _w(_LAYER + "mlp.gate.weight", "layers.moe.router", lambda c: (c.num_experts, c.hidden_size),
       _transpose, _transpose, when=lambda c: c.is_moe, kind="sparse"),
    *_mlp(_LAYER + "mlp.experts.{j}.", "layers.moe", lambda c: c.moe_intermediate_size,
          lambda c: c.is_moe, "sparse"),
    # an optional shared expert, under Qwen2-MoE's names
    *_mlp(_LAYER + "mlp.shared_expert.", "layers.moe.shared_expert",
          lambda c: c.shared_expert_intermediate_size,
          lambda c: c.is_moe and c.shared_expert_intermediate_size > 0, "sparse"),
    _w(_LAYER + "mlp.shared_expert_gate.weight", "layers.moe.shared_expert_gate",
       lambda c: (1, c.hidden_size), _transpose, _transpose,
       when=lambda c: c.is_moe and c.shared_expert_intermediate_size > 0, kind="sparse"),
)


def _expected(config: ModelConfig, names=()) -> dict[str, tuple[_Weight, tuple[int, ...]]]:
    """HF tensor name -> (table entry, its index in our stacked param: (layer,), (layer,
    expert) or ()) for this config (a hybrid's: (index in its layer kind's stack,); `names`,
    the checkpoint's, tell a multimodal Qwen3.5 layout from a text-only one)."""
    if config.is_hybrid:
        from jaxspec.models import hybrid_hf

        return hybrid_hf.expected(config, names)
    out = {}
    for w in _WEIGHTS:
        if not w.when(config):
            continue
        if w.per_expert:
            for i in w.layers(config):
                for j in range(config.num_experts):
                    out[w.hf_name.format(i=i, j=j)] = (w, (i, j))
        elif w.per_layer:
            for i in w.layers(config):
                out[w.hf_name.format(i=i)] = (w, (i,))
        else:
            out[w.hf_name] = (w, ())
    return out


def _optional(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that we do not need."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    if config.is_hybrid and name.startswith(("mtp.", "model.visual.")):  # the MTP head's and
        return True  # a multimodal checkpoint's vision tower: not the policy's
    return config.tie_embeddings and name == "lm_head.weight"  # a tied head saved anyway


# --------------------------------------------------------------------------- files


def _read_json(file: pathlib.Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{file} must hold a JSON object; got {type(data).__name__}")
    return data


def _open(file: pathlib.Path):
    """safe_open, with a truncated or corrupt file reported as one HFCheckpointError."""
    try:
        return safe_open(str(file), framework="np")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise HFCheckpointError(
            f"{file} is not a readable safetensors file ({e}); it may be truncated: "
            "copy or convert it again"
        ) from None


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index} has no 'weight_map'")
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"shards listed in {index} are missing: {absent}")
        return files
    single = path / "model.safetensors"
    candidates = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not candidates:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        raise FileNotFoundError(
            f"no *.safetensors weights in {path}"
            + (f" (found {others}; convert them to safetensors first)" if others else "")
        )
    files = {}
    for file in candidates:
        with _open(file) as f:
            for name in f.keys():
                files[name] = file
    return files


def _shapes(files: dict[str, pathlib.Path]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(set(files.values())):
        with _open(file) as f:
            present = set(f.keys())
            for name in [n for n, p in files.items() if p == file]:
                if name in present:  # an index may name a tensor its shard lacks
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _check(config: ModelConfig, expected: dict, shapes: dict, where: pathlib.Path) -> None:
    missing = sorted(n for n in expected if n not in shapes)
    unexpected = sorted(n for n in shapes if n not in expected and not _optional(n, config))
    mismatched = []
    for name, (w, _) in expected.items():
        if name in shapes and shapes[name] != w.hf_shape(config):
            mismatched.append(f"{name}: checkpoint {shapes[name]}, config {w.hf_shape(config)}")
    problems = []

    def show(items):
        return ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")

    if missing:
        problems.append(f"missing tensors: {show(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {show(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {show(mismatched)}")
    if problems:
        arch = _FAMILY_ARCH[config.family]
        raise HFCheckpointError(
            f"checkpoint {where} does not match its {arch} config "
            f"(layers={config.num_layers}, tied={config.tie_embeddings}): " + "; ".join(problems)
        )


def _inspect(path: pathlib.Path, dtype, attention_backend):
    if not path.is_dir():
        raise FileNotFoundError(
            f"HF checkpoint directory {str(path)!r} does not exist (load_hf reads local "
            "directories only; nothing is downloaded)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: a HF checkpoint needs config.json")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"load_hf dtype={dtype!r}; valid: {DTYPES} or None")
    config = config_from_hf(
        _read_json(config_file), dtype=dtype, attention_backend=attention_backend
    )
    files = _tensor_files(path)
    _check(config, _expected(config, files), _shapes(files), path)
    return config, files


def inspect_hf(path, dtype: str | None = None, *, attention_backend: str = "reference") -> ModelConfig:
    """Check a local HF directory as `load_hf` would — config.json, every safetensors
    header, tensor names and shapes — without reading any weights; return its ModelConfig.
    Cheap enough to run before anything compiles."""
    return _inspect(pathlib.Path(os.fspath(path)).expanduser(), dtype, attention_backend)[0]


def load_hf(
    path,
    dtype: str | None = None,
    *,
    attention_backend: str = "reference",
    shardings=None,
) -> Policy:
    """Load a local HF Qwen3 / Llama-3 / Qwen3-MoE checkpoint directory into a Policy (a
    Qwen3.5 / Qwen3-Next one into a `jaxspec.models.hybrid.HybridPolicy`).

    dtype: "float32" | "bfloat16" | None (the checkpoint's dtype if one of those, else
    float32). shardings: None, one `jax.sharding.Sharding` for every param, or a pytree
    with the params' structure (e.g. from `nnx.get_named_sharding`); each tensor is put
    straight onto its sharding.
    """
    path = pathlib.Path(os.fspath(path)).expanduser()
    config, files = _inspect(path, dtype, attention_backend)
    expected = _expected(config, files)

    # Read each file once, convert into our layout and dtype, straight into the stacked
    # arrays (a model mixing dense and sparse layers keeps zeros where a layer has none).
    np_dtype = _NP_DTYPES[config.dtype]
    if config.is_hybrid:
        from jaxspec.models.hybrid import HybridPolicy

        abstract = HybridPolicy.abstract(config)
    else:
        abstract = Policy.abstract(config)
    shapes = {param_path(kp): tuple(leaf.shape)
              for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
    by_path: dict[tuple[str, ...], np.ndarray] = {}
    for file in sorted({files[name] for name in expected}):
        with _open(file) as f:
            for name, (w, index) in expected.items():
                if files[name] != file:
                    continue
                for p, part in zip(w.paths, w.parts_to_ours(f.get_tensor(name), config)):
                    if p not in by_path:
                        by_path[p] = np.zeros(shapes[p], np_dtype)
                    by_path[p][index] = np.asarray(part, dtype=np_dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        targets = [shardings] * len(leaves)
    else:
        targets = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if len(targets) != len(leaves):
            raise ValueError(f"shardings has {len(targets)} leaves; the params have {len(leaves)}")
    values = []
    for (keypath, leaf), target in zip(leaves, targets):
        value = by_path.get(param_path(keypath))
        if value is None:  # a dense model's stacked param no layer of the checkpoint has
            value = np.zeros(leaf.shape, np_dtype)
        assert value.shape == leaf.shape, (keypath, value.shape, leaf.shape)
        if target is not None and not target.is_fully_addressable:
            # Multi-host: build only this process's shards (device_put would all-gather to compare).
            values.append(jax.make_array_from_callback(value.shape, target, lambda i, v=value: v[i]))
        else:
            values.append(jax.device_put(value, target))
    return abstract.replace(params=jax.tree_util.tree_unflatten(treedef, values))


# Files a server needs beside the weights: the tokenizer (every format transformers writes)
# and the generation defaults, whose eos_token_id list is what stops generation.
_SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                  "chat_template.jinja", "chat_template.json", "generation_config.json")
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Special-token ids of a HF model directory (None where it names none)."""

    bos: int | None
    eos: tuple[int, ...]  # every id that ends a generation
    pad: int | None


def _ids(value, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise HFCheckpointError(f"{where} = {value!r}; valid: a token id or a list of ids")
    return tuple(values)


def special_tokens(path) -> SpecialTokens:
    """bos / eos / pad ids from config.json and generation_config.json (whose eos list wins:
    it is what transformers, vLLM and SGLang stop on; config.json's ids are added to it)."""
    path = pathlib.Path(os.fspath(path)).expanduser()
    merged: dict[str, tuple[int, ...]] = {k: () for k in _SPECIAL_IDS}
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if not file.is_file():
            continue
        data = _read_json(file)
        for key in _SPECIAL_IDS:
            ids = _ids(data.get(key), f"{file} {key}")
            if key == "eos_token_id":
                merged[key] = tuple(dict.fromkeys(ids + merged[key]))  # ordered union
            elif ids:
                merged[key] = ids[:1]
    bos, pad = merged["bos_token_id"], merged["pad_token_id"]
    return SpecialTokens(bos[0] if bos else None, merged["eos_token_id"], pad[0] if pad else None)


def _copy_serving_files(source: pathlib.Path, dest: pathlib.Path) -> SpecialTokens:
    if not source.is_dir():
        raise FileNotFoundError(f"tokenizer source {str(source)!r} is not a directory")
    for name in _SERVING_FILES:
        if (source / name).is_file():
            (dest / name).write_bytes((source / name).read_bytes())
    return special_tokens(source)


def save_char_tokenizer(path, tokens, *, bos_id: int | None, eos_id: int, pad_id: int | None,
                        max_length: int | None = None) -> None:
    """A character-level tokenizer that `AutoTokenizer` loads (tokenizer.json: BPE over
    single characters, no merges; tokenizer_config.json; special_tokens_map.json).
    tokens[i] is the text of id i; the bos / eos / pad ids are special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens = list(tokens)
    special = {i for i in (bos_id, eos_id, pad_id) if i is not None}
    bad = [t for i, t in enumerate(tokens) if i not in special and len(t) != 1]
    if bad or len(set(tokens)) != len(tokens):
        raise ValueError(f"a character tokenizer needs distinct one-character tokens besides "
                         f"the special ones; got {bad or 'duplicates'}")
    path = pathlib.Path(os.fspath(path)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(special)])
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.save(str(path / "tokenizer.json"))
    names = {"bos_token": bos_id, "eos_token": eos_id, "pad_token": pad_id}
    names = {k: tokens[i] for k, i in names.items() if i is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names,
              "clean_up_tokenization_spaces": False}
    if max_length is not None:
        config["model_max_length"] = max_length
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")


def save_hf(policy: Policy, path, *, max_shard_bytes: int = 5 * 2**30, source=None,
            special: SpecialTokens | None = None) -> None:
    """Write config.json and safetensors (sharded with an index past max_shard_bytes)
    that `transformers` loads as Qwen3ForCausalLM / LlamaForCausalLM / Qwen3MoeForCausalLM
    (one tensor per expert, the names transformers writes).

    source: the HF directory the policy came from; its tokenizer files and
    generation_config.json are copied and its bos/eos/pad ids written into config.json,
    so a server (or `AutoTokenizer`) can use the export as it is. special: the ids to
    write when there is no source (a built-in tokenizer). Either way a
    generation_config.json carrying every EOS id is written when none was copied."""
    config = policy.config
    path = pathlib.Path(os.fspath(path)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    ids = special
    if source is not None:
        ids = _copy_serving_files(pathlib.Path(os.fspath(source)).expanduser(), path)
    flat = {
        param_path(kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(policy.params)[0]
    }
    tensors = {}
    host = {}
    for name, (w, index) in _expected(config).items():
        for p in w.paths:
            if p not in host:
                host[p] = np.asarray(jax.device_get(flat[p]))
        parts = tuple(host[p][index] for p in w.paths)
        tensors[name] = np.ascontiguousarray(w.to_hf(parts if len(parts) > 1 else parts[0],
                                                     config))

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = config_to_hf(config)
    if ids is not None:
        eos = list(ids.eos)
        special_ids = dict(bos_token_id=ids.bos, pad_token_id=ids.pad,
                           eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
        hf.update(special_ids)
        generation = path / "generation_config.json"
        if source is None or not (pathlib.Path(os.fspath(source)) / generation.name).is_file():
            generation.write_text(json.dumps({k: v for k, v in special_ids.items()
                                              if v is not None}, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
