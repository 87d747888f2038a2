"""EAGLE-3 draft head: fuse three target layers, one decoder layer, reduced-vocab LM head.

Layout (the one vLLM and SGLang read): `fc` (3·H_target -> H, no bias) fuses the captured
target hidden states; the layer's attention input is [input_layernorm(token embedding);
hidden_norm(fused hidden)] (2H); residual = fused hidden; post-attention norm + SwiGLU
MLP; final `norm`; `lm_head` over `draft_vocab_size` tokens, mapped back to target ids by
`d2t` (target id = i + d2t[i]). The token embedding is the target's, frozen, so the head
does not hold one. Later draft steps feed back the head's own pre-norm output (H wide).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.cache import KVCache, single_layer_forward
from jaxspec.models.config import ModelConfig, default_eagle3_layers
from jaxspec.models.hf import HFCheckpointError
from jaxspec.models.layers import DecoderLayer, RMSNorm, logical_param
from jaxspec.models.transformer import param_path


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's decoder layer is described by a one-layer `ModelConfig` (its heads, RoPE,
    norms, dtype and attention backend); the rest is what EAGLE-3 adds."""

    layer: ModelConfig  # num_layers=1; vocab_size = the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    capture_layers: tuple[int, ...]

    def __post_init__(self):
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, {self.layer.vocab_size}] (the target vocabulary); "
                f"got {self.draft_vocab_size}"
            )
        if len(self.capture_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses 3 target layers; got capture_layers={self.capture_layers}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


class Eagle3Module(DecoderLayer):
    """The head IS one shared decoder layer with a 2H attention input (`embed_input`), plus
    `fc` (fuses the target features), a final `norm`, and `lm_head` over the draft vocabulary.
    Its params keep the served names: fc, input_layernorm, hidden_norm, self_attn, mlp, ..."""

    def __init__(self, cfg: Eagle3Config, rngs: nnx.Rngs):
        lc = cfg.layer
        dtype, h = lc.param_dtype, lc.hidden_size
        self.fc = logical_param(rngs, (3 * cfg.target_hidden_size, h), dtype, ("mlp", "embed"))
        super().__init__(lc, embed_input=True, rngs=rngs)
        self.norm = RMSNorm(h, lc.rms_norm_eps, dtype=dtype)
        self.lm_head = logical_param(rngs, (h, cfg.draft_vocab_size), dtype, ("embed", "vocab"))
        # Identity map until a vocabulary is chosen; not a Param, so optimizers skip it.
        self.d2t = nnx.Variable(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

    def fuse(self, features):  # [B,T,3*H_target] -> [B,T,H]
        return features @ self.fc[...]

    def logits(self, hidden):  # [..., H] -> float32 [..., draft_vocab]
        return (self.norm(hidden) @ self.lm_head[...]).astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """The head as a pytree: static config and graphdef, params (and d2t) as leaves."""

    config: Eagle3Config = dataclasses.field(metadata=dict(static=True))
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    params: Any
    buffers: Any  # non-trainable state: d2t

    @staticmethod
    def init(config: Eagle3Config, key: jax.Array) -> "Eagle3Head":
        module = Eagle3Module(config, nnx.Rngs(params=key))
        graphdef, params, buffers = nnx.split(module, nnx.Param, ...)
        return Eagle3Head(config, graphdef, params, buffers)

    @staticmethod
    def init_for(policy, draft_vocab_size: int, key: jax.Array, *, capture_layers=None) -> "Eagle3Head":
        """A head shaped like one layer of `policy`, over a draft vocabulary of the given size
        (the first ids until `with_vocab` sets one chosen from token counts)."""
        pc = policy.config
        layers = tuple(capture_layers) if capture_layers is not None else default_eagle3_layers(pc.num_layers)
        layer = pc.without_experts().replace(num_layers=1, qk_norm=False, tie_embeddings=False,
                                             family="llama")
        cfg = Eagle3Config(layer, int(draft_vocab_size), pc.hidden_size, layers)
        head = Eagle3Head.init(cfg, key)
        return head.with_vocab(np.arange(draft_vocab_size))

    @property
    def module(self) -> Eagle3Module:
        return nnx.merge(self.graphdef, self.params, self.buffers)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.config.capture_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @property
    def d2t(self) -> jax.Array:  # [draft_vocab]
        return self.module.d2t.get_value()

    def draft_to_target(self) -> jax.Array:  # [draft_vocab] target ids
        return jnp.arange(self.config.draft_vocab_size, dtype=jnp.int32) + self.d2t

    def with_vocab(self, target_ids) -> "Eagle3Head":
        """Use these target ids (any order; stored sorted) as the draft vocabulary."""
        ids = np.unique(np.asarray(target_ids, np.int64))
        if ids.shape != (self.config.draft_vocab_size,) or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(
                f"a draft vocabulary needs {self.config.draft_vocab_size} distinct ids in "
                f"[0, {self.config.vocab_size}); got {len(ids)} ids in [{ids.min()}, {ids.max()}]"
            )
        module = self.module
        module.d2t.set_value(jnp.asarray(ids - np.arange(len(ids)), jnp.int32))
        graphdef, params, buffers = nnx.split(module, nnx.Param, ...)
        return Eagle3Head(self.config, graphdef, params, buffers)

    def check_compatible(self, policy) -> None:
        pc, hc = policy.config, self.config
        problems = []
        if pc.vocab_size != hc.vocab_size:
            problems.append(f"vocab_size {hc.vocab_size} != policy's {pc.vocab_size}")
        if pc.hidden_size != hc.target_hidden_size:
            problems.append(f"target_hidden_size {hc.target_hidden_size} != policy's hidden_size {pc.hidden_size}")
        if pc.hidden_size != hc.hidden_size:
            problems.append(
                f"hidden_size {hc.hidden_size} != policy's {pc.hidden_size} (the head uses the "
                f"policy's token embedding)"
            )
        bad = [i for i in hc.capture_layers if not 0 <= i < pc.num_layers]
        if bad:
            problems.append(f"capture_layers {bad} outside the policy's {pc.num_layers} layers")
        if problems:
            raise ValueError("EAGLE-3 head does not match the policy: " + "; ".join(problems))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.zeros(self.config.layer, batch, max_len)

    def forward(
        self,
        embeds,  # [B, T, H] target token embeddings of the next tokens
        hidden,  # [B, T, 3*H_target] target features (fuse=True) or [B, T, H] own output
        positions,  # [B, T] int32; < 0 marks padding
        cache: KVCache,
        *,
        mask=None,  # [B, T, T] bool among the new entries; default causal
        fuse: bool,
    ):
        """One pass of the decoder layer over new entries; returns (pre-norm hidden, cache)."""
        return single_layer_forward(self.layer_step, embeds, hidden, positions, cache,
                                    mask=mask, fuse=fuse)

    def layer_step(
        self,
        embeds,  # [B, T, H]
        hidden,  # [B, T, 3*H_target] (fuse=True) or [B, T, H]
        positions,  # [B, T] int32
        k_cache,  # [B, S, kv_heads, head_dim] (or a kernels.WithAncestors view)
        v_cache,  # [B, S, kv_heads, head_dim]
        cache_lengths,  # [B] int32, <= S
        *,
        mask,  # [B, T, T] bool among the new entries (padding already masked)
        fuse: bool,
        thread: bool = False,
    ):  # -> (pre-norm hidden [B, T, H], k [B, T, kv_heads, head_dim], v); thread: + (k_cache, v_cache)
        """`forward` without storing the new entries' keys and values: they are returned
        (thread=True: also the caches as the attention passed them on, kernels.tree_attention)."""
        m = self.module
        dtype = self.config.layer.param_dtype
        hidden = hidden.astype(dtype)
        if fuse:
            hidden = m.fuse(hidden)
        return m(  # the module is its decoder layer
            hidden, jnp.maximum(positions, 0), k_cache, v_cache, cache_lengths, mask,
            embeds=embeds.astype(dtype), thread=thread,
        )

    def logits(self, hidden):  # [..., H] -> float32 [..., draft_vocab]
        return self.module.logits(hidden)

    def draft_logits(self, hidden, policy=None):  # [..., H] -> (float32 [..., draft_vocab], ids [draft_vocab])
        """Logits over the draft vocabulary and the target id of each entry (drafting picks
        among these and maps the winners: no full-vocabulary array)."""
        del policy  # the head has its own LM head over the draft vocabulary
        return self.logits(hidden), self.draft_to_target()


def choose_draft_vocab(token_counts, draft_vocab_size: int) -> np.ndarray:  # [V] -> [draft_vocab] ids
    """The `draft_vocab_size` most frequent target ids (ties to the lower id), sorted by id."""
    counts = np.asarray(token_counts)
    if draft_vocab_size > counts.shape[0]:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the vocabulary size {counts.shape[0]}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    return np.sort(order[:draft_vocab_size])


# --------------------------------------------------------------------------- checkpoints
#
# The layout vLLM and SGLang read: llama-style config.json with `draft_vocab_size` and one
# hidden layer; torch Linear weights are [out, in].
#
# Which target layers a head fuses, in each server's convention (read from their code):
# - ours (`Eagle3Config.capture_layers`): 0-based indices of layer *outputs*, before the final
#   norm; output of layer i = HF `hidden_states[i + 1]` = the input of layer i + 1.
# - vLLM (`eagle3_utils.get_eagle3_aux_layers_from_config`): the draft config's top-level
#   `eagle_aux_hidden_state_layer_ids`; the target model appends `hidden_states + residual`
#   *before* running layer idx, so an id is an *input* index (HF `hidden_states[id]`): ours + 1.
#   It does not read `eagle_config`; without the field it falls back to the model's default
#   (2, L//2, L-3) inputs = outputs (1, L//2-1, L-4).
# - SGLang (eagle worker -> `set_eagle3_layers_to_capture(ids)`): reads
#   `eagle_config.eagle_aux_hidden_state_layer_ids` (newer versions also the top-level field
#   when there is no eagle_config) and captures before layer `id + 1`: an id is a layer
#   *output*, our convention. Without ids it captures before (2, L//2, L-3).
# - SpecForge (`get_default_eagle3_aux_layer_ids`): trains on layer outputs
#   (1, L//2-1, L-4) and writes no ids, so its heads rely on the servers' defaults; when it
#   writes `eagle_config` ids they are layer outputs (SGLang's convention).
# So `save_eagle3` writes both fields (top-level = ours + 1, eagle_config = ours) and
# `load_eagle3` reads either, or the default of the target's depth when neither is there.

_ARCH = "LlamaForCausalLMEagle3"


def _eagle3_table(cfg: Eagle3Config):
    """(name, our path, to_hf, to_ours) for every tensor but d2t / t2d."""
    lc = cfg.layer
    h, nq, nkv, d = lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
    t = lambda w: w.T  # noqa: E731
    qkv = lambda n: (lambda w: w.reshape(2 * h, n * d).T, lambda w: w.T.reshape(2 * h, n, d))  # noqa: E731
    o = (lambda w: w.reshape(nq * d, h).T, lambda w: w.T.reshape(nq, d, h))
    ident = lambda w: w  # noqa: E731
    return [
        ("fc.weight", ("fc",), t, t),
        ("midlayer.self_attn.q_proj.weight", ("self_attn", "q_proj"), *qkv(nq)),
        ("midlayer.self_attn.k_proj.weight", ("self_attn", "k_proj"), *qkv(nkv)),
        ("midlayer.self_attn.v_proj.weight", ("self_attn", "v_proj"), *qkv(nkv)),
        ("midlayer.self_attn.o_proj.weight", ("self_attn", "o_proj"), *o),
        ("midlayer.mlp.gate_proj.weight", ("mlp", "gate_proj"), t, t),
        ("midlayer.mlp.up_proj.weight", ("mlp", "up_proj"), t, t),
        ("midlayer.mlp.down_proj.weight", ("mlp", "down_proj"), t, t),
        ("midlayer.input_layernorm.weight", ("input_layernorm", "scale"), ident, ident),
        ("midlayer.hidden_norm.weight", ("hidden_norm", "scale"), ident, ident),
        ("midlayer.post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), ident, ident),
        ("norm.weight", ("norm", "scale"), ident, ident),
        ("lm_head.weight", ("lm_head",), t, t),
    ]


def save_eagle3(head: Eagle3Head, path) -> None:
    """Write config.json + model.safetensors in the layout vLLM / SGLang serve, with the
    captured layers in both servers' fields (see the notes above `save_eagle3`)."""
    from safetensors.numpy import save_file

    from jaxspec.models.hf import config_to_hf

    cfg = head.config
    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    flat = {param_path(kp): np.asarray(jax.device_get(x)) for kp, x in jax.tree_util.tree_flatten_with_path(head.params)[0]}
    tensors = {name: np.ascontiguousarray(to_hf(flat[p])) for name, p, to_hf, _ in _eagle3_table(cfg)}
    d2t = np.asarray(jax.device_get(head.d2t), np.int64)
    t2d = np.zeros((cfg.vocab_size,), bool)
    t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
    tensors["d2t"], tensors["t2d"] = d2t, t2d
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg.layer)
    hf.update(
        architectures=[_ARCH],
        model_type="llama",
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in cfg.capture_layers],  # vLLM: inputs
        eagle_config={  # SGLang: layer outputs (it adds 1)
            "eagle_aux_hidden_state_layer_ids": list(cfg.capture_layers),
            "use_aux_hidden_state": True,
        },
    )
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def capture_layers_from_config(hf: dict, target_num_layers: int | None = None, *,
                               where: str = "config.json") -> tuple[int, ...]:
    """The captured layers (ours: layer outputs) a head's config.json names: SGLang's
    `eagle_config` ids as they are, vLLM's top-level ids minus 1, both (they must agree), or
    neither: the default of a `target_num_layers`-layer target (what both servers use)."""
    def ids(value, field):
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise HFCheckpointError(f"{where} {field} = {value!r}; valid: three layer ids")
        return tuple(value)

    eagle_config = hf.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise HFCheckpointError(f"{where} eagle_config = {eagle_config!r}; valid: a mapping")
    outputs = ids(eagle_config.get("eagle_aux_hidden_state_layer_ids"),
                  "eagle_config.eagle_aux_hidden_state_layer_ids")
    inputs = ids(hf.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids")
    if inputs is not None and outputs is not None and outputs != tuple(i - 1 for i in inputs):
        raise HFCheckpointError(
            f"{where} names two different layer sets: eagle_aux_hidden_state_layer_ids "
            f"{list(inputs)} (vLLM: layer inputs) and eagle_config's {list(outputs)} (SGLang: "
            f"layer outputs, captured as inputs {[i + 1 for i in outputs]}); valid: top-level "
            f"= eagle_config's + 1, or only one of them")
    if outputs is not None:
        return outputs
    if inputs is not None:
        return tuple(i - 1 for i in inputs)
    if target_num_layers is None:
        raise HFCheckpointError(
            f"{where} names no captured layers (a SpecForge head: the servers use their default "
            f"for the target's depth); pass target_num_layers, or add eagle_config."
            f"eagle_aux_hidden_state_layer_ids (layer outputs)")
    return default_eagle3_layers(target_num_layers)


def _head_config(path: pathlib.Path, dtype, attention_backend, target_num_layers):
    """(Eagle3Config, {tensor name: file}) of a head directory, every header and shape
    checked without reading a weight; problems raise HFCheckpointError / FileNotFoundError."""
    from jaxspec.models.hf import _open, _read_json, config_from_hf

    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE-3 head directory {str(path)!r} does not exist (nothing is downloaded)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: an EAGLE-3 head needs config.json")
    hf = _read_json(config_file)
    if "draft_vocab_size" not in hf:
        raise HFCheckpointError(f"{config_file} has no draft_vocab_size: not an EAGLE-3 head config")
    if hf.get("num_hidden_layers", 1) != 1:
        raise HFCheckpointError(f"{config_file}: num_hidden_layers={hf['num_hidden_layers']}; EAGLE-3 heads have 1")
    layer = config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                           dtype=dtype or "float32", attention_backend=attention_backend)
    draft_vocab = hf["draft_vocab_size"] if hf["draft_vocab_size"] is not None else layer.vocab_size
    try:
        cfg = Eagle3Config(
            layer=layer,
            draft_vocab_size=int(draft_vocab),
            target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
            capture_layers=capture_layers_from_config(hf, target_num_layers, where=str(config_file)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, HFCheckpointError):
            raise
        raise HFCheckpointError(f"{config_file} describes an invalid head: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    where, shapes = {}, {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                where[name] = file
                shapes[name] = tuple(f.get_slice(name).get_shape())
    for name in _OPTIONAL:
        where.pop(name, None), shapes.pop(name, None)
    abstract = jax.eval_shape(lambda: Eagle3Head.init(cfg, jax.random.key(0)))
    ours = {param_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
    expected = {name: jax.eval_shape(to_hf, ours[p]).shape for name, p, to_hf, _ in _eagle3_table(cfg)}
    expected.update(d2t=(cfg.draft_vocab_size,), t2d=(cfg.vocab_size,))
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [f"{n}: checkpoint {shapes[n]}, config {expected[n]}" for n in sorted(expected)
             if n in shapes and shapes[n] != expected[n]]
    if missing or unexpected or wrong:
        raise HFCheckpointError(
            f"EAGLE-3 head in {path} does not match its config: missing {missing}, "
            f"unexpected {unexpected}, wrong shapes {wrong}"
        )
    return cfg, where


_OPTIONAL = ("embed_tokens.weight",)  # some exports carry the target's embedding


def inspect_eagle3(path, *, target_num_layers: int | None = None, dtype: str | None = None,
                   attention_backend: str = "reference") -> Eagle3Config:
    """Check a head directory as `load_eagle3` would (config.json, every safetensors header,
    tensor names and shapes) without reading weights; return its Eagle3Config."""
    return _head_config(pathlib.Path(path).expanduser(), dtype, attention_backend,
                        target_num_layers)[0]


def load_eagle3(path, *, dtype: str | None = None, attention_backend: str = "reference",
                target_num_layers: int | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head saved by `save_eagle3`, vLLM- or SGLang/SpecForge-style tooling
    (local dir only). The captured layers come from either server's field (see the notes
    above `save_eagle3`); a head naming none (SpecForge) needs `target_num_layers`."""
    from jaxspec.models.hf import _open

    path = pathlib.Path(path).expanduser()
    cfg, where = _head_config(path, dtype, attention_backend, target_num_layers)
    tensors = {}
    for file in sorted(set(where.values())):
        with _open(file) as f:
            for name in f.keys():
                if name in where:
                    tensors[name] = f.get_tensor(name)
    abstract = jax.eval_shape(lambda: Eagle3Head.init(cfg, jax.random.key(0)))
    values = {p: to_ours(tensors[name]) for name, p, _, to_ours in _eagle3_table(cfg)}
    np_dtype = jnp.dtype(cfg.layer.param_dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)
    params = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(values[param_path(kp)], np_dtype) for kp, _ in leaves]
    )
    buffers = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract.buffers)
    head = Eagle3Head(cfg, abstract.graphdef, params, buffers)
    d2t = np.asarray(tensors["d2t"], np.int64)
    return head.with_vocab(np.arange(cfg.draft_vocab_size) + d2t)
