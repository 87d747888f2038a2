"""A DeepSeek-V3-style multi-token-prediction (MTP) head.

The head combines the policy's last hidden state h_t (its final layer's output, before the
final norm) with the embedding of token t+1: x = eh_proj([enorm(embedding); hnorm(h_t)]),
runs one decoder layer over x, and predicts token t+2 with its own final norm followed by
the policy's LM head (shared, so the head adds no vocabulary-sized weights). Chain drafting
feeds the layer's own output back as h.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.cache import KVCache, single_layer_forward
from jaxspec.models.config import ModelConfig, matmul_precision
from jaxspec.models.layers import DecoderLayer, RMSNorm, logical_param


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    layer: ModelConfig  # one decoder layer, sized like the policy's
    capture_layers: tuple[int, ...]  # (the policy's last layer,)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


class MTPModule(nnx.Module):
    def __init__(self, cfg: MTPConfig, rngs: nnx.Rngs):
        lc = cfg.layer
        dtype, h = lc.param_dtype, lc.hidden_size
        self.enorm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.eh_proj = logical_param(rngs, (2 * h, h), dtype, ("mlp", "embed"))
        self.block = DecoderLayer(lc, rngs=rngs)
        self.norm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPHead:
    """The head as a pytree: static config and graphdef, params as leaves."""

    config: MTPConfig = dataclasses.field(metadata=dict(static=True))
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    params: Any
    buffers: Any = dataclasses.field(default_factory=dict)  # none (placement treats heads alike)

    @staticmethod
    def init_for(policy, key: jax.Array) -> "MTPHead":
        pc = policy.config
        if pc.is_hybrid:  # Qwen3.5 / Qwen3-Next: their own MTP layer (jaxspec.models.hybrid_mtp)
            from jaxspec.models.hybrid_mtp import HybridMTPHead

            return HybridMTPHead.init_for(policy, key)
        cfg = MTPConfig(layer=pc.without_experts().replace(num_layers=1),
                        capture_layers=(pc.num_layers - 1,))
        return MTPHead.init_for_config(cfg, key)

    @staticmethod
    def init_for_config(cfg: MTPConfig, key: jax.Array) -> "MTPHead":
        graphdef, params = nnx.split(MTPModule(cfg, nnx.Rngs(params=key)))
        return MTPHead(cfg, graphdef, params)

    @property
    def module(self) -> MTPModule:
        return nnx.merge(self.graphdef, self.params)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:  # drafts over the policy's whole vocabulary
        return self.config.vocab_size

    def check_compatible(self, policy) -> None:
        pc, lc = policy.config, self.config.layer
        problems = []
        if pc.vocab_size != lc.vocab_size:
            problems.append(f"vocab_size {lc.vocab_size} != policy's {pc.vocab_size}")
        if pc.hidden_size != lc.hidden_size:
            problems.append(f"hidden_size {lc.hidden_size} != policy's {pc.hidden_size}")
        if self.capture_layers != (pc.num_layers - 1,):
            problems.append(f"capture_layers {self.capture_layers} != the policy's last layer ({pc.num_layers - 1},)")
        if problems:
            raise ValueError("MTP head does not match the policy: " + "; ".join(problems))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.zeros(self.config.layer, batch, max_len)

    def forward(
        self,
        embeds,  # [B, T, H] token embeddings of the next tokens
        hidden,  # [B, T, H] the policy's last-layer output, or the head's own output
        positions,  # [B, T] int32; < 0 marks padding
        cache: KVCache,
        *,
        mask=None,  # [B, T, T] bool among the new entries; default causal
        fuse: bool,  # unused: the same projection serves target features and own outputs
    ):
        """One pass of the head over new entries; returns (pre-norm hidden, cache)."""
        return single_layer_forward(self.layer_step, embeds, hidden, positions, cache,
                                    mask=mask, fuse=fuse)

    def layer_step(
        self,
        embeds,  # [B, T, H]
        hidden,  # [B, T, H]
        positions,  # [B, T] int32
        k_cache,  # [B, S, kv_heads, head_dim] (or a kernels.WithAncestors view)
        v_cache,  # [B, S, kv_heads, head_dim]
        cache_lengths,  # [B] int32, <= S
        *,
        mask,  # [B, T, T] bool among the new entries (padding already masked)
        fuse: bool,  # unused, as in `forward`
        thread: bool = False,
    ):  # -> (pre-norm hidden [B, T, H], k [B, T, kv_heads, head_dim], v); thread: + (k_cache, v_cache)
        """`forward` without storing the new entries' keys and values: they are returned
        (thread=True: also the caches as the attention passed them on, kernels.tree_attention)."""
        del fuse
        return self.module.block(self.layer_input(embeds, hidden), jnp.maximum(positions, 0),
                                 k_cache, v_cache, cache_lengths, mask, thread=thread)

    def layer_input(
        self,
        embeds,  # [B, T, H]
        hidden,  # [B, T, H]
    ):  # -> [B, T, H] the decoder layer's input, eh_proj([enorm(embeds); hnorm(hidden)])
        """The head's fusion before its decoder layer (`module.block`, whose halves
        attention_input / self_attn.project / finish the MTP training unroll runs)."""
        m = self.module
        dtype = self.config.layer.param_dtype
        x = jnp.concatenate([m.enorm(embeds.astype(dtype)), m.hnorm(hidden.astype(dtype))], axis=-1)
        return x @ m.eh_proj[...]

    def draft_logits(self, hidden, policy):  # [..., H] -> (float32 [..., V], None: ids are the target's)
        """Logits through the policy's shared LM head, over the full target vocabulary."""
        normed = self.module.norm(hidden.astype(self.config.layer.param_dtype))
        squeeze = normed.ndim == 2
        normed = normed[:, None] if squeeze else normed
        with matmul_precision(policy.config.dtype):  # as Policy.forward runs this LM head
            logits = policy.module.logits(normed)
        return (logits[:, 0] if squeeze else logits), None


# ----------------------------------------------------------------------------- HF layouts
# Three published layouts of one MTP layer (checked against vLLM's deepseek_mtp.py,
# mimo_mtp.py and qwen3_next_mtp.py, and the HF MiMo / Qwen3-Next modelling code):
#
# deepseek_v3  config num_nextn_predict_layers >= 1; the layer is one more decoder layer after
#              the trunk, model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm, <block>},
#              eh_proj input [enorm(embedding); hnorm(h)]; embed_tokens / shared_head.head are
#              copies of the trunk's (read from the policy, written only when asked).
# mimo         config num_nextn_predict_layers >= 1; model.mtp_layers.{i}.{token_layernorm,
#              hidden_layernorm, input_proj, final_layernorm, <block>}; input_proj input
#              [hidden_layernorm(h); token_layernorm(embedding)]: the halves swapped.
# qwen3_next   config mtp_num_hidden_layers >= 1; mtp.{pre_fc_norm_embedding,
#              pre_fc_norm_hidden, fc, norm} and mtp.layers.{i}.<block>; fc input
#              [norm(embedding); norm(h)]; every RMSNorm is zero-centred (x * (1 + w)).
#
# <block> = input_layernorm, self_attn.{q,k,v,o}_proj (+ q_norm, k_norm), post_attention_layernorm,
# mlp.{gate,up,down}_proj: our DecoderLayer (Qwen3 / Llama attention, dense SwiGLU MLP).
# Not supported, refused by name: MoE MLPs (Qwen3-Next's experts / shared_expert, DeepSeek-V3's),
# attention biases (MiMo's Qwen2 layer), Qwen3-Next's gated attention (q_proj of 2x rows),
# MLA, partial RoPE. Only the first MTP layer is read; the LM head is the policy's. A real
# Qwen3.5 / Qwen3-Next checkpoint (hybrid trunk, by config.json) is jaxspec.models.hybrid_mtp's.

MTP_LAYOUTS = ("deepseek_v3", "mimo", "qwen3_next")
_COUNT_KEY = {"deepseek_v3": "num_nextn_predict_layers", "mimo": "num_nextn_predict_layers",
              "qwen3_next": "mtp_num_hidden_layers"}
# our module path -> each layout's name for the head's own tensors
_HEAD_NAMES = {
    ("enorm", "scale"): ("enorm.weight", "token_layernorm.weight", "pre_fc_norm_embedding.weight"),
    ("hnorm", "scale"): ("hnorm.weight", "hidden_layernorm.weight", "pre_fc_norm_hidden.weight"),
    ("eh_proj",): ("eh_proj.weight", "input_proj.weight", "fc.weight"),
    ("norm", "scale"): ("shared_head.norm.weight", "final_layernorm.weight", "norm.weight"),
}


def _prefixes(layout: str, cfg: MTPConfig) -> tuple[str, str]:
    """(prefix of the head's own tensors, prefix of its decoder layer's) in `layout`."""
    if layout == "deepseek_v3":
        pre = f"model.layers.{cfg.capture_layers[0] + 1}."
        return pre, pre
    if layout == "mimo":
        return "model.mtp_layers.0.", "model.mtp_layers.0."
    if layout == "qwen3_next":
        return "mtp.", "mtp.layers.0."
    raise ValueError(f"MTP layout {layout!r}; valid: {MTP_LAYOUTS}")


def _in_first_layer(layout: str, cfg: MTPConfig, name: str) -> bool:
    """Whether tensor `name` belongs to the first MTP layer in `layout` (others are ignored)."""
    if layout == "qwen3_next":
        return name.startswith("mtp.") and not re.match(r"mtp\.layers\.(?!0\.)", name)
    return name.startswith(_prefixes(layout, cfg)[0])


def _mtp_table(cfg: MTPConfig, layout: str = "deepseek_v3"):
    """(HF name, our path, to_hf, to_ours) of every tensor of the head in `layout`."""
    lc = cfg.layer
    h, nq, nkv, d = lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
    head_pre, block_pre = _prefixes(layout, cfg)
    t = lambda w: w.T  # noqa: E731
    ident = lambda w: w  # noqa: E731
    swap = lambda w: np.concatenate([w[h:], w[:h]])  # noqa: E731  [a; b] rows -> [b; a]
    # Qwen3-Next stores w with scale 1 + w; exact both ways for scales >= 0.5 (Sterbenz)
    norm = ((lambda s: (s.astype(np.float32) - 1).astype(s.dtype),
             lambda w: w.astype(np.float32) + 1) if layout == "qwen3_next" else (ident, ident))
    qkv = lambda n: (lambda w: w.reshape(h, n * d).T, lambda w: w.T.reshape(h, n, d))  # noqa: E731
    o = (lambda w: w.reshape(nq * d, h).T, lambda w: w.T.reshape(nq, d, h))
    col = MTP_LAYOUTS.index(layout)
    eh = (lambda w: swap(w).T, lambda w: swap(w.T)) if layout == "mimo" else (t, t)
    table = [(head_pre + names[col], path, *(eh if path == ("eh_proj",) else norm))
             for path, names in _HEAD_NAMES.items()]
    block = [
        ("input_layernorm.weight", ("input_layernorm", "scale"), *norm),
        ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), *norm),
        ("self_attn.q_proj.weight", ("self_attn", "q_proj"), *qkv(nq)),
        ("self_attn.k_proj.weight", ("self_attn", "k_proj"), *qkv(nkv)),
        ("self_attn.v_proj.weight", ("self_attn", "v_proj"), *qkv(nkv)),
        ("self_attn.o_proj.weight", ("self_attn", "o_proj"), *o),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj"), t, t),
        ("mlp.up_proj.weight", ("mlp", "up_proj"), t, t),
        ("mlp.down_proj.weight", ("mlp", "down_proj"), t, t),
    ]
    if lc.qk_norm:
        block += [("self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), *norm),
                  ("self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), *norm)]
    return table + [(block_pre + name, ("block", *path), to_hf, to_ours)
                    for name, path, to_hf, to_ours in block]


def save_mtp(head: MTPHead, path, *, layout: str = "deepseek_v3", policy=None) -> None:
    """Write config.json (the trunk's fields with num_hidden_layers = L and the layout's MTP
    count key = 1) and model.safetensors with the head in `layout` (one of MTP_LAYOUTS). With
    `policy` (deepseek_v3 only), also the shared embed_tokens / shared_head.head copies
    DeepSeek-V3 checkpoints carry; the other layouts share the trunk's tensors. A Qwen3.5 /
    Qwen3-Next head (jaxspec.models.hybrid_mtp) has one layout, its checkpoint's mtp.*
    (layout deepseek_v3, the default, or qwen3_next): `save_hybrid_mtp`, the whole model
    with `policy`."""
    import json
    import pathlib

    from safetensors.numpy import save_file

    from jaxspec.models.hf import config_to_hf
    from jaxspec.models.hybrid_mtp import HybridMTPHead, save_hybrid_mtp
    from jaxspec.models.transformer import param_path

    if isinstance(head, HybridMTPHead):  # Qwen3.5 / Qwen3-Next: their mtp.* layout only
        if layout not in ("deepseek_v3", "qwen3_next"):
            raise ValueError(f"save_mtp: a Qwen3.5 / Qwen3-Next head has its checkpoint's "
                             f"layout only; got layout {layout!r} (valid: 'qwen3_next')")
        return save_hybrid_mtp(head, path, policy=policy)
    cfg = head.config
    _prefixes(layout, cfg)  # a bad layout fails before anything is written
    if policy is not None and layout != "deepseek_v3":
        raise ValueError(f"save_mtp(policy=...) writes DeepSeek-V3's shared-tensor copies; "
                         f"layout {layout!r} has none (valid with a policy: 'deepseek_v3')")
    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    flat = {param_path(kp): np.asarray(jax.device_get(x))
            for kp, x in jax.tree_util.tree_flatten_with_path(head.params)[0]}
    tensors = {name: np.ascontiguousarray(to_hf(flat[p]))
               for name, p, to_hf, _ in _mtp_table(cfg, layout)}
    if policy is not None:
        head.check_compatible(policy)
        pre = _prefixes(layout, cfg)[0]
        embed = np.asarray(jax.device_get(policy.params["embed_tokens"][...]))
        out = embed if policy.config.tie_embeddings else \
            np.asarray(jax.device_get(policy.params["lm_head"][...])).T
        tensors[pre + "embed_tokens.weight"] = np.ascontiguousarray(embed)
        tensors[pre + "shared_head.head.weight"] = np.ascontiguousarray(out)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg.layer.replace(num_layers=cfg.capture_layers[0] + 1))
    hf[_COUNT_KEY[layout]] = 1
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def _mtp_count(hf: dict) -> int:
    """The number of MTP layers config.json announces (0 if none)."""
    n = hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers") or 0
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def inspect_mtp(path, *, dtype: str | None = None, attention_backend: str = "reference"):
    """The MTPConfig of a local HF checkpoint's MTP layer, from its config.json alone (a
    Qwen3.5 / Qwen3-Next checkpoint's: jaxspec.models.hybrid_mtp's HybridMTPConfig)."""
    import json
    import pathlib

    from jaxspec.models.hf import HFCheckpointError, UnsupportedModelError, config_from_hf
    from jaxspec.models.hybrid_mtp import inspect_hybrid_mtp, is_hybrid_checkpoint

    if is_hybrid_checkpoint(path):
        return inspect_hybrid_mtp(path, dtype=dtype, attention_backend=attention_backend)
    file = pathlib.Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: an MTP checkpoint needs config.json")
    hf = json.loads(file.read_text())
    if _mtp_count(hf) < 1:
        n = hf.get("num_nextn_predict_layers", hf.get("mtp_num_hidden_layers", 0))
        raise HFCheckpointError(
            f"{file}: num_nextn_predict_layers = {n!r}; an MTP checkpoint needs >= 1 "
            f"(or mtp_num_hidden_layers >= 1; the checkpoint ships no MTP layer)")
    try:
        trunk = config_from_hf(hf)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(
            f"{file}: {e}. The MTP layer is read as a Qwen3/Llama dense decoder layer; "
            f"MoE, MLA, attention biases, gated attention and partial RoPE are not supported"
        ) from None
    trunk = trunk.replace(attention_backend=attention_backend, **({"dtype": dtype} if dtype else {}))
    return MTPConfig(layer=trunk.replace(num_layers=1), capture_layers=(trunk.num_layers - 1,))


def mtp_layout(names) -> str:
    """The layout (MTP_LAYOUTS) of a checkpoint from its tensor names: Qwen3-Next's mtp.fc,
    MiMo's model.mtp_layers.*, else DeepSeek-V3's model.layers.{L}.*."""
    if any(n.startswith("mtp.") for n in names):
        return "qwen3_next"
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo"
    return "deepseek_v3"


def _unsupported(names: list[str]) -> str:
    """Why tensors have no place in our head, by what they are."""
    reasons = []
    if any(re.search(r"\.(experts|gate|shared_experts?|shared_expert_gate)\.", n) for n in names):
        reasons.append("MoE MLPs are not supported (dense SwiGLU only)")
    if any(n.endswith(".bias") for n in names):
        reasons.append("biases (e.g. the Qwen2 layer's q/k/v) are not supported")
    if any(re.search(r"self_attn\.(q_a|kv_a|q_b|kv_b)_", n) for n in names):
        reasons.append("MLA attention is not supported")
    return "; ".join(reasons) or "no such tensor in a Qwen3/Llama dense decoder layer"


def load_mtp(path, *, dtype: str | None = None, attention_backend: str = "reference") -> MTPHead:
    """The first MTP layer of a local HF checkpoint in any of MTP_LAYOUTS (found by
    `mtp_layout`), as an MTPHead on the trunk's last layer. The trunk's own tensors, if
    present, are ignored; a tensor of the MTP layer we cannot map is an error. A Qwen3.5 /
    Qwen3-Next checkpoint (by its config.json) gives jaxspec.models.hybrid_mtp's head."""
    import pathlib

    import jax.numpy as jnp

    from jaxspec.models.hf import HFCheckpointError, _open, _tensor_files
    from jaxspec.models.hybrid_mtp import is_hybrid_checkpoint, load_hybrid_mtp
    from jaxspec.models.transformer import param_path

    if is_hybrid_checkpoint(path):
        return load_hybrid_mtp(path, dtype=dtype, attention_backend=attention_backend)
    path = pathlib.Path(path).expanduser()
    cfg = inspect_mtp(path, dtype=dtype, attention_backend=attention_backend)
    where = _tensor_files(path)
    layout = mtp_layout(where)
    table = _mtp_table(cfg, layout)
    known = {name for name, *_ in table}
    shared = {_prefixes(layout, cfg)[0] + n for n in ("embed_tokens.weight", "shared_head.head.weight")}
    unknown = sorted(n for n in where if _in_first_layer(layout, cfg, n) and n not in known | shared)
    if unknown:
        raise HFCheckpointError(f"{path}: the MTP layer ({layout} layout) has tensors we cannot "
                                f"map: {unknown[:4]}" + (f" and {len(unknown) - 4} more"
                                                        if len(unknown) > 4 else "")
                                + f" ({_unsupported(unknown)})")
    missing = [name for name, *_ in table if name not in where]
    if missing:
        raise HFCheckpointError(f"{path}: the MTP layer lacks {missing[:4]}"
                                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                                + f" (read as the {layout} layout)")
    tensors = {}
    for f_name in sorted({where[name] for name in known}):
        with _open(f_name) as f:
            for name in known:
                if where[name] == f_name:
                    tensors[name] = f.get_tensor(name)
    abstract = jax.eval_shape(lambda: MTPHead.init_for_config(cfg, jax.random.key(0)))
    want = {param_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
    shapes = {name: to_hf(np.zeros(want[p].shape, np.float32)).shape for name, p, to_hf, _ in table}
    bad = [(name, tensors[name].shape, shape) for name, shape in shapes.items()
           if tensors[name].shape != shape]
    if bad:
        gated = any(n.endswith("q_proj.weight") and f[0] == 2 * w[0] for n, f, w in bad)
        raise HFCheckpointError(f"{path}: MTP tensors of the wrong shape (name, file, want): "
                                f"{bad[:3]}" + ("; a q_proj of twice the rows is Qwen3-Next's "
                                                "gated attention, not supported" if gated else ""))
    values = {p: to_ours(tensors[name]) for name, p, _, to_ours in table}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)
    params = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(values[param_path(kp)], x.dtype) for kp, x in leaves])
    return MTPHead(cfg, abstract.graphdef, params)
