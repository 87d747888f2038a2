"""Qwen3.5 / Qwen3-Next's multi-token-prediction (MTP) head, its `mtp.*` checkpoint tensors,
and a chain drafter over it.

The head (as vLLM's and SGLang's Qwen3-Next / Qwen3.5 MTP models run it) reads the trunk's
hidden state h_t AFTER the trunk's final norm (the state its LM head reads) and the
embedding of token t+1:
  x = fc([pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(h_t)])   (embedding first)
  y = one full-attention decoder layer of the trunk's kind over x (gated attention with
      partial RoPE, then the MLP, or the experts when the trunk's are: qwen3_next)
  h' = norm(y)
and predicts token t+2 as the trunk's LM head of h' (the embedding and LM head are the
trunk's, shared: the head adds no vocabulary-sized weights). A chain of drafts feeds h' back
as the next step's hidden state. Every norm is zero-centred (scale stored as w, applied as
1 + w). Unlike `jaxspec.models.mtp.MTPHead` (DeepSeek-V3's pre-norm convention), this head's
input and output hidden states are both normed: `forward` returns h', `draft_logits` is
the LM head alone.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.decoding.heads import _HeadDrafter
from jaxspec.decoding.protocols import Observation
from jaxspec.kernels import tree_attention
from jaxspec.models.config import ModelConfig, matmul_precision
from jaxspec.models.hybrid import CenteredRMSNorm, FeedForward, GatedAttention
from jaxspec.models.layers import logical_param
from jaxspec.models.mtp import MTPHead

__all__ = ["HybridMTPConfig", "HybridMTPDrafter", "HybridMTPHead", "load_hybrid_mtp",
           "save_hybrid_mtp", "trunk_final_norm", "trunk_logits"]

# config.json keys announcing the MTP layers (Qwen3.5 / Qwen3-Next write the first; vLLM's
# converted configs the second)
_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


@dataclasses.dataclass(frozen=True)
class HybridMTPConfig:
    trunk: ModelConfig  # the hybrid policy's config (family qwen3_5 / qwen3_next)

    def __post_init__(self):
        if not self.trunk.is_hybrid:
            raise ValueError(f"HybridMTPConfig: family {self.trunk.family!r} is not a hybrid "
                             "family (qwen3_5, qwen3_next); DeepSeek-V3 / MiMo-style heads are "
                             "jaxspec.models.mtp.MTPHead")
        if self.trunk.family == "qwen3_5_moe":
            raise ValueError("HybridMTPConfig: family 'qwen3_5_moe' has no MTP head yet "
                             "(its fused expert tensors); valid: qwen3_5, qwen3_next")

    @property
    def layer(self) -> ModelConfig:
        """The head's one full-attention layer: the trunk's shapes, sparse as the trunk's
        layer 0 would be (vLLM builds mtp.layers.0 with layer index 0)."""
        t = self.trunk
        return t.replace(num_layers=1, layer_types=("full_attention",),
                         mlp_only_layers=tuple(i for i in t.mlp_only_layers if i == 0))

    @property
    def sparse(self) -> bool:  # the layer's feed-forward is the experts
        return self.layer.sparse_layers[0]

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.trunk.num_layers - 1,)

    @property
    def hidden_size(self) -> int:
        return self.trunk.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.trunk.vocab_size


class _Attention(GatedAttention):
    """GatedAttention cut at the attention (`project_gated`, then `gated_output`), so that
    the draft training unroll (`jaxspec.rl.draft.mtp_hidden`) can run its own attention."""

    def project(self, h, positions):  # [B, T, H], [B, T] -> (q, k, v) as project_gated
        q, _, k, v = self.project_gated(h, positions)
        return q, k, v


class _Layer(nnx.Module):
    """mtp.layers.0 and mtp.norm: the full-attention decoder layer, then the final norm."""

    def __init__(self, cfg: HybridMTPConfig, rngs: nnx.Rngs):
        lc = cfg.layer
        self.self_attn = _Attention(lc, rngs=rngs)
        self.ffn = FeedForward(lc, sparse=cfg.sparse, rngs=rngs)
        self.norm = CenteredRMSNorm(lc.hidden_size, lc.rms_norm_eps, dtype=lc.param_dtype)

    def attention_input(self, x):  # [B, T, H] -> [B, T, H] input-normed
        return self.self_attn.input_layernorm(x)

    def finish(
        self,
        x,  # [B, T, H] the layer's input
        heads,  # [B, T, heads, d] attention output
        gate=None,  # [B, T, heads, d] or None (recomputed)
    ):  # -> [B, T, H] the head's normed output h'
        return self.norm(self.ffn(self.self_attn.gated_output(x, heads, gate)))


class HybridMTPModule(nnx.Module):
    def __init__(self, cfg: HybridMTPConfig, rngs: nnx.Rngs):
        lc = cfg.layer
        dtype, h = lc.param_dtype, lc.hidden_size
        self.pre_fc_norm_embedding = CenteredRMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.pre_fc_norm_hidden = CenteredRMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.fc = logical_param(rngs, (2 * h, h), dtype, ("mlp", "embed"))  # rows [embed; hidden]
        self.block = _Layer(cfg, rngs)


def trunk_final_norm(policy, x):  # [..., H] a hybrid policy's last layer output -> [..., H]
    """The policy's final norm: what its LM head (and this head) read."""
    return nnx.merge(policy.graphdef, policy.params).norm(x.astype(policy.config.param_dtype))


def trunk_logits(policy, x):  # [..., H] final-normed -> float32 [..., V]
    """The hybrid policy's LM head (tied: the embedding), as HybridTransformer applies it."""
    p = policy.params
    w = p["embed_tokens"][...].T if policy.config.tie_embeddings else p["lm_head"][...]
    with matmul_precision(policy.config.dtype):
        return jnp.einsum("...h,hv->...v", x.astype(w.dtype), w,
                          preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridMTPHead(MTPHead):
    """The head as a pytree (static config and graphdef, params as leaves); a
    `jaxspec.decoding.DraftHead` whose hidden states are normed (module docstring). Its
    pytree, cache and `forward` are MTPHead's; the layer, its input and the logits are its own."""

    config: HybridMTPConfig = dataclasses.field(metadata=dict(static=True))

    @staticmethod
    def init_for(policy, key: jax.Array) -> HybridMTPHead:
        return HybridMTPHead.init_for_config(HybridMTPConfig(policy.config), key)

    @staticmethod
    def init_for_config(cfg: HybridMTPConfig, key: jax.Array) -> HybridMTPHead:
        graphdef, params = nnx.split(HybridMTPModule(cfg, nnx.Rngs(params=key)))
        return HybridMTPHead(cfg, graphdef, params)

    def astype(self, dtype: str) -> HybridMTPHead:
        """The params cast to "float32" or "bfloat16" (the config follows)."""
        cfg = HybridMTPConfig(self.config.trunk.replace(dtype=dtype))
        new = jax.eval_shape(lambda: HybridMTPHead.init_for_config(cfg, jax.random.key(0)))
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), self.params)
        return HybridMTPHead(cfg, new.graphdef, params)

    def check_compatible(self, policy) -> None:
        pc, tc = policy.config, self.config.trunk
        problems = []
        if not pc.is_hybrid:
            problems.append(f"the policy's family {pc.family!r} is not hybrid (qwen3_5, "
                            "qwen3_next): use jaxspec.models.mtp.MTPHead")
        for name in ("vocab_size", "hidden_size", "num_layers"):
            if getattr(pc, name) != getattr(tc, name):
                problems.append(f"{name} {getattr(tc, name)} != policy's {getattr(pc, name)}")
        if problems:
            raise ValueError("Qwen3.5 / Qwen3-Next MTP head does not match the policy: "
                             + "; ".join(problems))

    def layer_input(
        self,
        embeds,  # [B, T, H] token embeddings (of the tokens after each entry)
        hidden,  # [B, T, H] normed: the trunk's final-normed hidden, or the head's output
    ):  # -> [B, T, H] fc([pre_fc_norm_embedding(embeds); pre_fc_norm_hidden(hidden)])
        m = self.module
        dtype = self.config.layer.param_dtype
        x = jnp.concatenate([m.pre_fc_norm_embedding(embeds.astype(dtype)),
                             m.pre_fc_norm_hidden(hidden.astype(dtype))], axis=-1)
        return x @ m.fc[...]

    def layer_step(
        self,
        embeds,  # [B, T, H]
        hidden,  # [B, T, H] normed
        positions,  # [B, T] int32
        k_cache,  # [B, S, kv_heads, head_dim] (or a kernels.CacheLayer / WithAncestors view)
        v_cache,  # [B, S, kv_heads, head_dim]
        cache_lengths,  # [B] int32, <= S
        *,
        mask,  # [B, T, T] bool among the new entries (padding already masked)
        fuse: bool,
        thread: bool = False,
    ):  # -> (h' [B, T, H], k [B, T, kv_heads, head_dim], v); thread: + (k_cache, v_cache)
        """`forward` (MTPHead's: the head's normed output h' and the cache with the new
        entries; `fuse` unused, trunk features and its own outputs enter alike) without
        storing the new entries' keys and values (DraftHead)."""
        del fuse
        block = self.module.block
        x = self.layer_input(embeds, hidden)
        q, gate, k, v = block.self_attn.project_gated(block.attention_input(x),
                                                      jnp.maximum(positions, 0))
        out = tree_attention(q, k_cache, v_cache, cache_lengths, k, v, mask,
                             backend=self.config.layer.attention_backend, thread=thread)
        heads, caches = (out[0], out[1:]) if thread else (out, ())
        return (block.finish(x, heads, gate), k, v, *caches)

    def draft_logits(self, hidden, policy):  # [..., H] normed -> (float32 [..., V], None)
        """The policy's LM head on the head's normed output (ids are the policy's own)."""
        return trunk_logits(policy, hidden), None


# ----------------------------------------------------------------------------- drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridMTPDrafter(_HeadDrafter):
    """Chain drafts from Qwen3.5 / Qwen3-Next's MTP head (`HybridMTPHead`). The engine
    captures the policy's last layer (`capture_layers`), as for `MTPDrafter`; `observe` puts
    it through the policy's final norm, the state the head reads. (A hybrid policy verifies
    chains only: the engine refuses a `tree` for it.)"""

    def observe(self, state, policy, obs: Observation):
        (layer,) = self.head.capture_layers
        normed = trunk_final_norm(policy, obs.captured[layer])
        return super().observe(state, policy, dataclasses.replace(obs, captured={layer: normed}))


# ----------------------------------------------------------------------------- checkpoints
# mtp.fc.weight [H, 2H] (input [embedding; hidden]), mtp.pre_fc_norm_{embedding,hidden}.weight,
# mtp.norm.weight, and mtp.layers.0.* named as the trunk's full-attention layer and
# feed-forward are (jaxspec.models.hybrid_hf's table, model.layers.{i}. -> mtp.layers.0.).
# Only the first MTP layer is read; embed_tokens / lm_head are the trunk's.

_HEAD_TENSORS = {  # HF name -> (our path, HF shape, HF <-> ours transposes)
    "mtp.fc.weight": (("fc",), lambda c: (c.hidden_size, 2 * c.hidden_size), True),
    "mtp.pre_fc_norm_embedding.weight": (("pre_fc_norm_embedding", "scale"),
                                         lambda c: (c.hidden_size,), False),
    "mtp.pre_fc_norm_hidden.weight": (("pre_fc_norm_hidden", "scale"),
                                      lambda c: (c.hidden_size,), False),
    "mtp.norm.weight": (("block", "norm", "scale"), lambda c: (c.hidden_size,), False),
}
_OUR_STACK = {"full_layers": ("block", "self_attn"), "mlps": ("block", "ffn"),
              "moes": ("block", "ffn")}


def mtp_table(cfg: HybridMTPConfig) -> dict:
    """HF name -> (our param path, index in it, HF shape, to_ours(w), to_hf(w)) of every
    tensor of the head: one to one, by transposes and reshapes only (exact both ways)."""
    from jaxspec.models.hybrid_hf import _WEIGHTS

    lc = cfg.layer
    table = {}
    for name, (path, shape, transpose) in _HEAD_TENSORS.items():
        fn = (lambda w: w.T) if transpose else (lambda w: w)
        table[name] = (path, (), shape(lc), fn, fn)
    ffn = "moes" if cfg.sparse else "mlps"
    for w in _WEIGHTS:
        if w.kind not in ("full_layers", ffn) or not w.when(lc):
            continue
        path = _OUR_STACK[w.kind] + w.path[1:]
        name = w.hf_name.replace("model.layers.{i}.", "mtp.layers.0.")
        for j in range(lc.num_experts) if w.per_expert else (None,):
            table[name.format(j=j)] = (
                path, () if j is None else (j,), w.hf_shape(lc),
                lambda x, w=w: w.to_ours(x, lc), lambda x, w=w: w.to_hf(x, lc))
    return table


def _flat(params) -> dict:
    from jaxspec.models.transformer import param_path

    return {param_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _unflat(params, values: dict):
    """`params`' structure with values[path] at each leaf."""
    from jaxspec.models.transformer import param_path

    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree_util.tree_unflatten(treedef, [values[param_path(kp)] for kp, _ in leaves])


def _hf_config(path: pathlib.Path) -> dict:
    from jaxspec.models import hybrid_hf
    from jaxspec.models.hf import _read_json

    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: an MTP checkpoint needs config.json")
    return hybrid_hf.text_part(_read_json(file))


def is_hybrid_checkpoint(path) -> bool:
    """Whether a local HF directory's config.json is a Qwen3.5 / Qwen3-Next one (its MTP
    head is this module's)."""
    from jaxspec.models import hybrid_hf

    file = pathlib.Path(path).expanduser() / "config.json"
    if not file.is_file():
        return False
    try:
        hf = hybrid_hf.text_part(json.loads(file.read_text()))
    except Exception:  # a malformed file is the loader's to report
        return False
    archs = hf.get("architectures") or []
    return (hf.get("model_type") in hybrid_hf.MODEL_TYPES
            or any(a in hybrid_hf.ARCHITECTURES for a in archs))


def inspect_hybrid_mtp(path, *, dtype: str | None = None,
                       attention_backend: str = "reference") -> HybridMTPConfig:
    """The HybridMTPConfig of a local Qwen3.5 / Qwen3-Next directory, from config.json alone."""
    from jaxspec.models.hf import HFCheckpointError, config_from_hf

    path = pathlib.Path(path).expanduser()
    hf = _hf_config(path)
    count = next((hf[k] for k in _COUNT_KEYS if k in hf), 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise HFCheckpointError(f"{path / 'config.json'}: mtp_num_hidden_layers = {count!r}; an "
                                "MTP head needs >= 1 (the checkpoint ships no MTP layer)")
    if hf.get("mtp_use_dedicated_embeddings"):
        raise HFCheckpointError(f"{path / 'config.json'}: mtp_use_dedicated_embeddings = true "
                                "is not supported (the head shares the trunk's embedding)")
    trunk = config_from_hf(hf, dtype=dtype, attention_backend=attention_backend)
    return HybridMTPConfig(trunk)


def load_hybrid_mtp(path, *, dtype: str | None = None,
                    attention_backend: str = "reference") -> HybridMTPHead:
    """The first MTP layer (`mtp.*`) of a local Qwen3.5 / Qwen3-Next checkpoint (the whole
    model's directory, or one `save_hybrid_mtp` wrote) as a HybridMTPHead."""
    from jaxspec.models.hf import HFCheckpointError, _open, _tensor_files

    path = pathlib.Path(path).expanduser()
    cfg = inspect_hybrid_mtp(path, dtype=dtype, attention_backend=attention_backend)
    table = mtp_table(cfg)
    where = _tensor_files(path)
    first = re.compile(r"mtp\.(?!layers\.)|mtp\.layers\.0\.")  # later MTP layers: ignored
    unknown = sorted(n for n in where if first.match(n) and n not in table)
    missing = sorted(n for n in table if n not in where)
    if unknown or missing:
        raise HFCheckpointError(
            f"{path}: the MTP layer does not match its {cfg.trunk.family} config (experts: "
            f"{cfg.sparse}): " + "; ".join(f"{what} {names[:4]}" + (
                f" and {len(names) - 4} more" if len(names) > 4 else "")
                for what, names in (("missing", missing), ("unexpected", unknown)) if names))
    abstract = jax.eval_shape(lambda: HybridMTPHead.init_for_config(cfg, jax.random.key(0)))
    np_dtype = np.dtype(jnp.dtype(cfg.layer.dtype))
    values = {p: np.zeros(x.shape, np_dtype) for p, x in _flat(abstract.params).items()}
    for file in sorted({where[n] for n in table}):
        with _open(file) as f:
            for name, (p, index, shape, to_ours, _) in table.items():
                if where[name] != file:
                    continue
                w = f.get_tensor(name)
                if tuple(w.shape) != tuple(shape):
                    raise HFCheckpointError(f"{path}: {name} has shape {tuple(w.shape)}; its "
                                            f"config says {tuple(shape)}")
                values[p][index] = np.asarray(to_ours(w), np_dtype)
    params = jax.tree.map(lambda x, v: jnp.asarray(v, x.dtype), abstract.params,
                          _unflat(abstract.params, values))
    return HybridMTPHead(cfg, abstract.graphdef, params)


def _tensor_bytes(path: pathlib.Path, weight_map: dict) -> int:
    """The bytes of every tensor the index lists (its metadata's total_size)."""
    from jaxspec.models.hf import _open

    size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1,
            "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    total = 0
    for file in sorted(set(weight_map.values())):
        with _open(path / file) as f:  # headers only: no tensor is read
            for name in f.keys():
                part = f.get_slice(name)
                total += int(np.prod(part.get_shape())) * size[part.get_dtype()]
    return total


def save_hybrid_mtp(head: HybridMTPHead, path, *, policy=None) -> None:
    """Write the head's `mtp.*` tensors. Without `policy`: config.json (the trunk's, with
    mtp_num_hidden_layers = 1) and model.safetensors holding the head alone. With `policy`:
    the whole checkpoint, as the released models ship it (save_hf's trunk, the head in
    mtp.safetensors, an index over both), which transformers reads as the trunk (it skips
    `mtp.*`) and vLLM / SGLang as trunk + MTP."""
    from safetensors.numpy import save_file

    from jaxspec.models.hf import config_to_hf, save_hf

    path = pathlib.Path(path).expanduser()
    flat = {p: np.asarray(jax.device_get(x)) for p, x in _flat(head.params).items()}
    tensors = {name: np.ascontiguousarray(to_hf(flat[p][index]))
               for name, (p, index, _, _, to_hf) in mtp_table(head.config).items()}
    if policy is None:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        hf = config_to_hf(head.config.trunk)
    else:
        head.check_compatible(policy)
        save_hf(policy, path)
        from jaxspec.models.hf import _tensor_files

        weight_map = {n: f.name for n, f in _tensor_files(path).items()}
        save_file(tensors, str(path / "mtp.safetensors"), metadata={"format": "pt"})
        weight_map.update({n: "mtp.safetensors" for n in tensors})
        index = {"metadata": {"total_size": _tensor_bytes(path, weight_map)},
                 "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf = json.loads((path / "config.json").read_text())
    hf["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
