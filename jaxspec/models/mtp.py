"""A DeepSeek-V3-style multi-token-prediction (MTP) head.

The head combines the policy's last hidden state h_t (its final layer's output, before the
final norm) with the embedding of token t+1: x = eh_proj([enorm(embedding); hnorm(h_t)]),
runs one decoder layer over x, and predicts token t+2 with its own final norm followed by
the policy's LM head (shared, so the head adds no vocabulary-sized weights). Chain drafting
feeds the layer's own output back as h.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.models.cache import KVCache, new_token_mask
from jaxspec.models.config import ModelConfig
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
        cfg = MTPConfig(layer=pc.replace(num_layers=1), capture_layers=(pc.num_layers - 1,))
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
        valid, mask = new_token_mask(positions, mask)
        out, k, v = self.layer_step(
            embeds, hidden, positions, cache.k[0], cache.v[0],
            jnp.minimum(cache.lengths, cache.max_len), mask=mask, fuse=fuse,
        )
        return out, cache.append(0, k, v, valid).advance(valid)

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
    ):  # -> (pre-norm hidden [B, T, H], k [B, T, kv_heads, head_dim], v)
        """`forward` without storing the new entries' keys and values: they are returned."""
        del fuse
        m = self.module
        dtype = self.config.layer.param_dtype
        x = jnp.concatenate([m.enorm(embeds.astype(dtype)), m.hnorm(hidden.astype(dtype))], axis=-1)
        x = x @ m.eh_proj[...]
        return m.block(x, jnp.maximum(positions, 0), k_cache, v_cache, cache_lengths, mask)

    def draft_logits(self, hidden, policy):  # [..., H] -> (float32 [..., V], None: ids are the target's)
        """Logits through the policy's shared LM head, over the full target vocabulary."""
        normed = self.module.norm(hidden.astype(self.config.layer.param_dtype))
        squeeze = normed.ndim == 2
        normed = normed[:, None] if squeeze else normed
        logits = policy.module.logits(normed)
        return (logits[:, 0] if squeeze else logits), None


# ----------------------------------------------------------------------------- HF layout
# DeepSeek-V3 ships its MTP module as one more decoder layer after the trunk: with
# num_hidden_layers = L and num_nextn_predict_layers = 1, the tensors are
# model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm, self_attn.*, mlp.*,
# input_layernorm, post_attention_layernorm}; embed_tokens and shared_head.head are copies
# of the trunk's (shared here, so read from the policy and written only when asked). The
# layer itself is the policy family's (Qwen3 / Llama attention, dense SwiGLU MLP).

def _mtp_table(cfg: MTPConfig):
    """(HF name, our path, to_hf, to_ours) of every tensor of the head."""
    lc = cfg.layer
    h, nq, nkv, d = lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
    pre = f"model.layers.{cfg.capture_layers[0] + 1}."
    t = lambda w: w.T  # noqa: E731
    ident = lambda w: w  # noqa: E731
    qkv = lambda n: (lambda w: w.reshape(h, n * d).T, lambda w: w.T.reshape(h, n, d))  # noqa: E731
    o = (lambda w: w.reshape(nq * d, h).T, lambda w: w.T.reshape(nq, d, h))
    table = [
        ("enorm.weight", ("enorm", "scale"), ident, ident),
        ("hnorm.weight", ("hnorm", "scale"), ident, ident),
        ("eh_proj.weight", ("eh_proj",), t, t),  # HF [H, 2H]: input [enorm(e); hnorm(h)]
        ("shared_head.norm.weight", ("norm", "scale"), ident, ident),
        ("input_layernorm.weight", ("block", "input_layernorm", "scale"), ident, ident),
        ("post_attention_layernorm.weight", ("block", "post_attention_layernorm", "scale"),
         ident, ident),
        ("self_attn.q_proj.weight", ("block", "self_attn", "q_proj"), *qkv(nq)),
        ("self_attn.k_proj.weight", ("block", "self_attn", "k_proj"), *qkv(nkv)),
        ("self_attn.v_proj.weight", ("block", "self_attn", "v_proj"), *qkv(nkv)),
        ("self_attn.o_proj.weight", ("block", "self_attn", "o_proj"), *o),
        ("mlp.gate_proj.weight", ("block", "mlp", "gate_proj"), t, t),
        ("mlp.up_proj.weight", ("block", "mlp", "up_proj"), t, t),
        ("mlp.down_proj.weight", ("block", "mlp", "down_proj"), t, t),
    ]
    if lc.qk_norm:
        table += [("self_attn.q_norm.weight", ("block", "self_attn", "q_norm", "scale"), ident, ident),
                  ("self_attn.k_norm.weight", ("block", "self_attn", "k_norm", "scale"), ident, ident)]
    return [(pre + name, path, to_hf, to_ours) for name, path, to_hf, to_ours in table]


def save_mtp(head: MTPHead, path, *, policy=None) -> None:
    """Write config.json (the trunk's fields, num_hidden_layers = L, num_nextn_predict_layers
    = 1) and model.safetensors with the head as model.layers.{L}.*; with `policy`, also the
    shared embed_tokens / shared_head.head copies DeepSeek-V3 checkpoints carry."""
    import json
    import pathlib

    import numpy as np
    from safetensors.numpy import save_file

    from jaxspec.models.hf import config_to_hf
    from jaxspec.models.transformer import param_path

    cfg = head.config
    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    flat = {param_path(kp): np.asarray(jax.device_get(x))
            for kp, x in jax.tree_util.tree_flatten_with_path(head.params)[0]}
    tensors = {name: np.ascontiguousarray(to_hf(flat[p])) for name, p, to_hf, _ in _mtp_table(cfg)}
    if policy is not None:
        head.check_compatible(policy)
        pre = f"model.layers.{cfg.capture_layers[0] + 1}."
        embed = np.asarray(jax.device_get(policy.params["embed_tokens"][...]))
        out = embed if policy.config.tie_embeddings else \
            np.asarray(jax.device_get(policy.params["lm_head"][...])).T
        tensors[pre + "embed_tokens.weight"] = np.ascontiguousarray(embed)
        tensors[pre + "shared_head.head.weight"] = np.ascontiguousarray(out)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg.layer.replace(num_layers=cfg.capture_layers[0] + 1))
    hf["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def inspect_mtp(path, *, dtype: str | None = None,
                attention_backend: str = "reference") -> MTPConfig:
    """The MTPConfig of a local HF checkpoint's MTP layer, from its config.json alone."""
    import json
    import pathlib

    from jaxspec.models.hf import HFCheckpointError, config_from_hf

    file = pathlib.Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: an MTP checkpoint needs config.json")
    hf = json.loads(file.read_text())
    n = hf.get("num_nextn_predict_layers", 0)
    if not isinstance(n, int) or n < 1:
        raise HFCheckpointError(f"{file}: num_nextn_predict_layers = {n!r}; an MTP checkpoint "
                                f"needs >= 1 (the checkpoint ships no MTP layer)")
    trunk = config_from_hf(hf).replace(attention_backend=attention_backend,
                                       **({"dtype": dtype} if dtype else {}))
    return MTPConfig(layer=trunk.replace(num_layers=1), capture_layers=(trunk.num_layers - 1,))


def load_mtp(path, *, dtype: str | None = None, attention_backend: str = "reference") -> MTPHead:
    """The MTP layer model.layers.{L}.* of a local HF checkpoint (L = num_hidden_layers, the
    first of num_nextn_predict_layers; DeepSeek-V3 layout, see `save_mtp`), as an MTPHead on
    the trunk's last layer. The trunk's own tensors, if present, are ignored."""
    import pathlib

    import jax.numpy as jnp

    from jaxspec.models.hf import HFCheckpointError, _open, _tensor_files
    from jaxspec.models.transformer import param_path

    path = pathlib.Path(path).expanduser()
    cfg = inspect_mtp(path, dtype=dtype, attention_backend=attention_backend)
    table = _mtp_table(cfg)
    where = _tensor_files(path)
    missing = [name for name, *_ in table if name not in where]
    if missing:
        raise HFCheckpointError(f"{path}: the MTP layer lacks {missing[:4]}"
                                + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    tensors = {}
    for f_name in sorted({where[name] for name, *_ in table}):
        with _open(f_name) as f:
            for name, *_ in table:
                if where[name] == f_name:
                    tensors[name] = f.get_tensor(name)
    abstract = jax.eval_shape(lambda: MTPHead.init_for_config(cfg, jax.random.key(0)))
    values = {p: to_ours(tensors[name]) for name, p, _, to_ours in table}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)
    bad = [(param_path(kp), values[param_path(kp)].shape, x.shape) for kp, x in leaves
           if tuple(values[param_path(kp)].shape) != tuple(x.shape)]
    if bad:
        raise HFCheckpointError(f"{path}: MTP tensors of the wrong shape (ours, file, want): {bad[:3]}")
    params = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(values[param_path(kp)], x.dtype) for kp, x in leaves])
    return MTPHead(cfg, abstract.graphdef, params)
