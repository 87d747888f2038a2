"""HF interop of the hybrid families (Qwen3_5ForCausalLM, Qwen3NextForCausalLM,
Qwen3_5MoeForCausalLM): their
config.json fields and their tensor table, which `jaxspec.models.hf` (load_hf, save_hf,
inspect_hf) uses in place of the dense one. Every tensor maps one to one, by a reshape or a
transpose, so an export reads back bit for bit. The MTP head's `mtp.*` tensors are skipped
(left for the MTP drafter, issue 51)."""

from __future__ import annotations

import numpy as np

from jaxspec.models.config import DTYPES, LAYER_TYPES, ModelConfig
from jaxspec.models.hf import (
    HFCheckpointError,
    UnsupportedModelError,
    _experts_from_hf,
    _mlp,
    _positive_int,
    _transpose,
    _w,
)
from jaxspec.models.hybrid import layer_plan

ARCHITECTURES = {"Qwen3_5ForCausalLM": "qwen3_5", "Qwen3NextForCausalLM": "qwen3_next",
                 "Qwen3_5MoeForCausalLM": "qwen3_5_moe"}
MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next",
               "qwen3_5_moe_text": "qwen3_5_moe"}
_FAMILY_MODEL_TYPE = {v: k for k, v in MODEL_TYPES.items()}
# Multimodal checkpoints whose language model is one of ours (config "text_config", tensors
# under "model.language_model."; the vision tower "model.visual.*" is skipped). An export
# writes the text-only model.
_MULTIMODAL = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
               "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
_MULTIMODAL_TYPES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
_TEXT_PREFIX = "model.language_model."
_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim", "linear_conv_kernel_dim")


def text_part(hf: dict) -> dict:
    """A multimodal Qwen3.5 config.json's language model as a text-only config (any other
    config as it is)."""
    archs = list(hf.get("architectures") or [])
    text = next((_MULTIMODAL[a] for a in archs if a in _MULTIMODAL), None)
    if text is None and not archs:
        text = _MULTIMODAL_TYPES.get(hf.get("model_type"))
    if text is None:
        return hf
    if not isinstance(hf.get("text_config"), dict):
        raise HFCheckpointError(f"config.json of a {archs or hf.get('model_type')} checkpoint "
                                "has no 'text_config' object (the language model's config)")
    out = {**hf["text_config"], "architectures": [text]}
    out.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    for key in ("dtype", "torch_dtype"):
        out.setdefault(key, hf.get(key))
    return out


def config_from_hf(hf: dict, family: str, *, dtype: str | None,
                   attention_backend: str) -> ModelConfig:
    """ModelConfig from a Qwen3_5TextConfig / Qwen3NextConfig config.json."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (need 'silu')")
    if hf.get("attention_bias"):
        problems.append("attention_bias=True")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} (supported: 'default')")
    if problems:
        raise UnsupportedModelError(f"unsupported {family} configuration: " + "; ".join(problems))
    layers = _positive_int(hf, "num_hidden_layers")
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' default: every full_attention_interval-th is full
        interval = _positive_int(hf, "full_attention_interval", default=4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                       for i in range(layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != layers
            or any(t not in LAYER_TYPES for t in layer_types)):
        raise HFCheckpointError(f"config.json 'layer_types' = {layer_types!r}; valid: "
                                f"{layers} entries (num_hidden_layers), each one of {LAYER_TYPES}")
    if dtype is None:
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    heads = _positive_int(hf, "num_attention_heads")
    experts = {}
    if family == "qwen3_next" and hf.get("num_experts", 512):  # transformers' default is 512
        experts = _experts_from_hf({**hf, "num_experts": hf.get("num_experts", 512)})
    elif family == "qwen3_5_moe":  # every layer sparse, the top-k renormalised, whatever
        # the file says of decoder_sparse_step / mlp_only_layers / norm_topk_prob (unread)
        hf = {key: value for key, value in hf.items()
              if key not in ("decoder_sparse_step", "mlp_only_layers")}
        experts = _experts_from_hf({**hf, "norm_topk_prob": True})
        hf.setdefault("intermediate_size", experts["moe_intermediate_size"])  # no dense MLP
    try:
        return ModelConfig(
            vocab_size=_positive_int(hf, "vocab_size"),
            hidden_size=_positive_int(hf, "hidden_size"),
            intermediate_size=_positive_int(hf, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_positive_int(hf, "num_key_value_heads", default=heads),
            head_dim=_positive_int(hf, "head_dim", default=256),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=_positive_int(hf, "max_position_embeddings", default=32768),
            dtype=dtype,
            attention_backend=attention_backend,
            family=family,
            layer_types=tuple(layer_types),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 hf.get("partial_rotary_factor", 0.25))),
            **{name: _positive_int(hf, name) for name in _LINEAR},
            **experts,
        )
    except ValueError as e:  # ModelConfig's own checks
        raise HFCheckpointError(f"config.json describes an invalid model: {e}") from None


def config_to_hf(config: ModelConfig) -> dict:
    """config.json that transformers 5 reads as Qwen3_5ForCausalLM / Qwen3NextForCausalLM /
    Qwen3_5MoeForCausalLM."""
    arch = next(a for a, f in ARCHITECTURES.items() if f == config.family)
    ours = dict(num_hidden_layers="num_layers", num_attention_heads="num_heads",
                num_key_value_heads="num_kv_heads", tie_word_embeddings="tie_embeddings")
    same = ("vocab_size", "hidden_size", "intermediate_size", "head_dim",
            "max_position_embeddings", "rms_norm_eps", *_LINEAR)
    hf = {
        "architectures": [arch],
        "model_type": _FAMILY_MODEL_TYPE[config.family],
        **{key: getattr(config, ours.get(key, key)) for key in (*ours, *same)},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default",
                            "partial_rotary_factor": config.partial_rotary_factor},
        "layer_types": list(config.layer_types),
        "dtype": config.dtype,
        "use_cache": True,
    }
    if config.family == "qwen3_next":
        hf.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                  moe_intermediate_size=config.moe_intermediate_size,
                  shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                  norm_topk_prob=config.norm_topk_prob,
                  decoder_sparse_step=config.decoder_sparse_step,
                  mlp_only_layers=list(config.mlp_only_layers), output_router_logits=False,
                  router_aux_loss_coef=0.001)
    elif config.family == "qwen3_5_moe":  # Qwen3_5MoeTextConfig: no dense MLP width
        del hf["intermediate_size"]
        hf.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                  moe_intermediate_size=config.moe_intermediate_size,
                  shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                  output_router_logits=False, router_aux_loss_coef=0.001)
    return hf


# --------------------------------------------------------------------------- weight table
# kind: the stack a per-layer tensor belongs to ("linear_layers", "full_layers", "mlps",
# "moes"); our paths are within that stack, indexed by the layer's place in it.

_L = "model.layers.{i}."


def _heads_in(n, d):  # HF [n*d, H] <-> ours [H, n, d]
    return (lambda w, c: w.T.reshape(c.hidden_size, n(c), d(c)),
            lambda w, c: w.reshape(c.hidden_size, -1).T)


def _ratio(c):
    return c.linear_num_value_heads // c.linear_num_key_heads


def _value_dim(c):
    return c.linear_num_value_heads * c.linear_value_head_dim


def _conv_dim(c):
    return 2 * c.linear_num_key_heads * c.linear_key_head_dim + _value_dim(c)


def _next(c):
    return c.family == "qwen3_next"


def _not_next(c):
    return c.family != "qwen3_next"


def _fused(c):  # a Qwen3.5-MoE checkpoint may hold each layer's experts as 3D tensors
    return c.family == "qwen3_5_moe"


def _experts_t(w, c):  # HF [E, out, in] <-> ours [E, in, out]
    return w.transpose(0, 2, 1)


_WEIGHTS = (
    _w("model.embed_tokens.weight", "embed_tokens", lambda c: (c.vocab_size, c.hidden_size)),
    _w("model.norm.weight", "norm.scale", lambda c: (c.hidden_size,)),
    _w("lm_head.weight", "lm_head", lambda c: (c.vocab_size, c.hidden_size),
       _transpose, _transpose, when=lambda c: not c.tie_embeddings),
    # Gated DeltaNet
    _w(_L + "input_layernorm.weight", "linear_layers.input_layernorm.scale",
       lambda c: (c.hidden_size,), kind="linear_layers"),
    _w(_L + "linear_attn.in_proj_qkv.weight", "linear_layers.in_proj_qkv",
       lambda c: (_conv_dim(c), c.hidden_size), _transpose, _transpose, when=_not_next,
       kind="linear_layers"),
    _w(_L + "linear_attn.in_proj_z.weight", "linear_layers.in_proj_z",
       lambda c: (_value_dim(c), c.hidden_size), _transpose, _transpose, when=_not_next,
       kind="linear_layers"),
    _w(_L + "linear_attn.in_proj_b.weight", "linear_layers.in_proj_b",
       lambda c: (c.linear_num_value_heads, c.hidden_size), _transpose, _transpose,
       when=_not_next, kind="linear_layers"),
    _w(_L + "linear_attn.in_proj_a.weight", "linear_layers.in_proj_a",
       lambda c: (c.linear_num_value_heads, c.hidden_size), _transpose, _transpose,
       when=_not_next, kind="linear_layers"),
    _w(_L + "linear_attn.in_proj_qkvz.weight", "linear_layers.in_proj_qkvz",
       lambda c: (_conv_dim(c) + _value_dim(c), c.hidden_size),
       *_heads_in(lambda c: c.linear_num_key_heads,
                  lambda c: 2 * c.linear_key_head_dim + 2 * _ratio(c) * c.linear_value_head_dim),
       when=_next, kind="linear_layers"),
    _w(_L + "linear_attn.in_proj_ba.weight", "linear_layers.in_proj_ba",
       lambda c: (2 * c.linear_num_value_heads, c.hidden_size),
       *_heads_in(lambda c: c.linear_num_key_heads, lambda c: 2 * _ratio(c)),
       when=_next, kind="linear_layers"),
    _w(_L + "linear_attn.conv1d.weight", "linear_layers.conv_weight",
       lambda c: (_conv_dim(c), 1, c.linear_conv_kernel_dim),
       lambda w, c: w[:, 0, :], lambda w, c: w[:, None, :], kind="linear_layers"),
    _w(_L + "linear_attn.dt_bias", "linear_layers.dt_bias",
       lambda c: (c.linear_num_value_heads,), kind="linear_layers"),
    _w(_L + "linear_attn.A_log", "linear_layers.A_log",
       lambda c: (c.linear_num_value_heads,), kind="linear_layers"),
    _w(_L + "linear_attn.norm.weight", "linear_layers.gate_norm",
       lambda c: (c.linear_value_head_dim,), kind="linear_layers"),
    _w(_L + "linear_attn.out_proj.weight", "linear_layers.out_proj",
       lambda c: (c.hidden_size, _value_dim(c)), _transpose, _transpose, kind="linear_layers"),
    # gated full attention: q_proj's output per head is [query | gate]
    _w(_L + "input_layernorm.weight", "full_layers.input_layernorm.scale",
       lambda c: (c.hidden_size,), kind="full_layers"),
    _w(_L + "self_attn.q_proj.weight", "full_layers.q_proj",
       lambda c: (2 * c.num_heads * c.head_dim, c.hidden_size),
       *_heads_in(lambda c: c.num_heads, lambda c: 2 * c.head_dim), kind="full_layers"),
    _w(_L + "self_attn.k_proj.weight", "full_layers.k_proj",
       lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
       *_heads_in(lambda c: c.num_kv_heads, lambda c: c.head_dim), kind="full_layers"),
    _w(_L + "self_attn.v_proj.weight", "full_layers.v_proj",
       lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
       *_heads_in(lambda c: c.num_kv_heads, lambda c: c.head_dim), kind="full_layers"),
    _w(_L + "self_attn.o_proj.weight", "full_layers.o_proj",
       lambda c: (c.hidden_size, c.num_heads * c.head_dim),
       lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
       lambda w, c: w.reshape(-1, c.hidden_size).T, kind="full_layers"),
    _w(_L + "self_attn.q_norm.weight", "full_layers.q_norm.scale", lambda c: (c.head_dim,),
       kind="full_layers"),
    _w(_L + "self_attn.k_norm.weight", "full_layers.k_norm.scale", lambda c: (c.head_dim,),
       kind="full_layers"),
    # feed-forward: the dense MLP, or the experts with a gated shared expert
    _w(_L + "post_attention_layernorm.weight", "mlps.post_attention_layernorm.scale",
       lambda c: (c.hidden_size,), kind="mlps"),
    *_mlp(_L + "mlp.", "mlps.mlp", lambda c: c.intermediate_size, lambda c: True, "mlps"),
    _w(_L + "post_attention_layernorm.weight", "moes.post_attention_layernorm.scale",
       lambda c: (c.hidden_size,), kind="moes"),
    _w(_L + "mlp.gate.weight", "moes.moe.router", lambda c: (c.num_experts, c.hidden_size),
       _transpose, _transpose, kind="moes"),
    *_mlp(_L + "mlp.experts.{j}.", "moes.moe", lambda c: c.moe_intermediate_size,
          lambda c: True, "moes"),
    # or (qwen3_5_moe, transformers' in-memory layout, which it also reads from a file; it
    # writes the per-expert names above) gate_up_proj [E, 2I, H] (gate rows first) <-> ours
    # gate_proj and up_proj [E, H, I]; down_proj [E, H, I] <-> ours [E, I, H]
    _w(_L + "mlp.experts.gate_up_proj", ("moes.moe.gate_proj", "moes.moe.up_proj"),
       lambda c: (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size),
       lambda w, c: tuple(_experts_t(h, c) for h in np.split(w, 2, axis=1)),
       lambda parts, c: np.concatenate([_experts_t(h, c) for h in parts], axis=1),
       when=_fused, kind="moes"),
    _w(_L + "mlp.experts.down_proj", "moes.moe.down_proj",
       lambda c: (c.num_experts, c.hidden_size, c.moe_intermediate_size),
       _experts_t, _experts_t, when=_fused, kind="moes"),
    *_mlp(_L + "mlp.shared_expert.", "moes.moe.shared_expert",
          lambda c: c.shared_expert_intermediate_size,
          lambda c: c.shared_expert_intermediate_size > 0, "moes"),
    _w(_L + "mlp.shared_expert_gate.weight", "moes.moe.shared_expert_gate",
       lambda c: (1, c.hidden_size), _transpose, _transpose,
       when=lambda c: c.shared_expert_intermediate_size > 0, kind="moes"),
)


def expected(config: ModelConfig, names=()) -> dict:
    """HF tensor name -> (table entry, its index in our stacked param) for this config; the
    multimodal layout's names where the checkpoint's `names` are under "model.language_model.",
    the fused experts' where they have those (else, and for an export, one tensor per expert)."""
    multimodal = any(n.startswith(_TEXT_PREFIX) for n in names)
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    out = {}
    for name, entry in _text_expected(config, fused).items():
        if multimodal and name.startswith("model."):
            name = _TEXT_PREFIX + name[len("model."):]
        out[name] = entry
    return out


def _text_expected(config: ModelConfig, fused: bool) -> dict:
    out = {}
    plan = layer_plan(config)
    for w in _WEIGHTS:
        if not w.when(config) or (w.per_expert and fused) or (w.when is _fused and not fused):
            continue
        if w.kind is None:
            out[w.hf_name] = (w, ())
            continue
        for i, (mixer, m, ffn, f) in enumerate(plan):
            at = m if w.kind == mixer else f if w.kind == ffn else None
            if at is None:
                continue
            if w.per_expert:
                for j in range(config.num_experts):
                    out[w.hf_name.format(i=i, j=j)] = (w, (at, j))
            else:
                out[w.hf_name.format(i=i)] = (w, (at,))
    return out
