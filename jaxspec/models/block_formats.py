"""The checkpoint layouts of `jaxspec.models.block.BlockHead`: DFlash's (`z-lab/*-DFlash-b16`,
served by SGLang's and vLLM's DFLASH workers, with DSpark's extra tensors), and DSpark's own
(DeepSpec's `Qwen3DSparkModel`, read by DeepSpec, SGLang and vLLM).

config.json: a Qwen3 layer config (num_hidden_layers = the draft's layers), `block_size`,
`num_target_layers`, and `dflash_config` {block_size, mask_token_id, target_layer_ids}
(target layer ids are layer outputs: DFlash reads HF `hidden_states[id + 1]`, our
`capture_layers`). Tensors (torch Linear weights are [out, in]): fc.weight [H, n H_target],
hidden_norm.weight, layers.{i}.{input_layernorm, post_attention_layernorm}.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight, norm.weight; no embedding and no LM head (the
target's). DSpark adds `markov_rank` / `markov_head_type` ("vanilla") /
`confidence_head_with_markov` to the config and markov_head.markov_w1.weight [V, r] (the
previous token's embedding), markov_head.markov_w2.weight [V, r] (its bias projection),
confidence_head.proj.{weight [1, H + r], bias [1]}.

DSpark (DeepSpec `deepspec/modeling/dspark/qwen3/`): config.json is the target's Qwen3 config
with num_hidden_layers = the draft's layers, architectures ["Qwen3DSparkModel"], top-level
block_size, num_target_layers, target_layer_ids (strictly increasing), mask_token_id,
num_anchors, enable_confidence_head, confidence_head_with_markov (when it has one),
markov_rank, markov_head_type (when r > 0), tie_word_embeddings false; the tensors are
DFlash's plus the model's own embed_tokens.weight [V, H] and lm_head.weight [V, H] (copies of
the target's). Block slot i drafts the token i + 1 after the anchor (the anchor's slot
included: `BlockConfig.sample_from_anchor`), where DFlash's slot i drafts token i.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.block import BlockConfig, BlockHead
from jaxspec.models.hf import HFCheckpointError

_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "Qwen3DSparkModel"


def _flat(params) -> dict:
    """{("layers", "0", "mlp", "up_proj"): array} from the head's params."""
    out = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(str(k.key) if isinstance(k, jax.tree_util.DictKey) else str(k.idx)
                     for k in kp if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey)))
        out[path] = x
    return out


def _table(cfg: BlockConfig):
    """(HF name, our path, to_hf, to_ours) of every tensor."""
    lc = cfg.layer
    h, nq, nkv, d = lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
    t = lambda w: w.T  # noqa: E731
    ident = lambda w: w  # noqa: E731
    qkv = lambda n: (lambda w: w.reshape(h, n * d).T, lambda w: w.T.reshape(h, n, d))  # noqa: E731
    o = (lambda w: w.reshape(nq * d, h).T, lambda w: w.T.reshape(nq, d, h))
    rows = [("fc.weight", ("fc",), t, t),
            ("hidden_norm.weight", ("hidden_norm", "scale"), ident, ident),
            ("norm.weight", ("norm", "scale"), ident, ident)]
    for i in range(lc.num_layers):
        pre, ours = f"layers.{i}.", ("layers", str(i))
        rows += [
            (pre + "input_layernorm.weight", ours + ("input_layernorm", "scale"), ident, ident),
            (pre + "post_attention_layernorm.weight", ours + ("post_attention_layernorm", "scale"),
             ident, ident),
            (pre + "self_attn.q_proj.weight", ours + ("self_attn", "q_proj"), *qkv(nq)),
            (pre + "self_attn.k_proj.weight", ours + ("self_attn", "k_proj"), *qkv(nkv)),
            (pre + "self_attn.v_proj.weight", ours + ("self_attn", "v_proj"), *qkv(nkv)),
            (pre + "self_attn.o_proj.weight", ours + ("self_attn", "o_proj"), *o),
            (pre + "self_attn.q_norm.weight", ours + ("self_attn", "q_norm", "scale"), ident, ident),
            (pre + "self_attn.k_norm.weight", ours + ("self_attn", "k_norm", "scale"), ident, ident),
            (pre + "mlp.gate_proj.weight", ours + ("mlp", "gate_proj"), t, t),
            (pre + "mlp.up_proj.weight", ours + ("mlp", "up_proj"), t, t),
            (pre + "mlp.down_proj.weight", ours + ("mlp", "down_proj"), t, t),
        ]
    if cfg.markov_rank:
        rows += [("markov_head.markov_w1.weight", ("markov_w1",), ident, ident),
                 ("markov_head.markov_w2.weight", ("markov_w2",), t, t)]
    if cfg.confidence:
        rows += [("confidence_head.proj.weight", ("confidence_w",), t, t),
                 ("confidence_head.proj.bias", ("confidence_b",), ident, ident)]
    return rows


def save_dflash(head: BlockHead, path, *, num_target_layers: int) -> None:
    """config.json + model.safetensors in the DFlash layout (DSpark's tensors when present)."""
    from safetensors.numpy import save_file

    from jaxspec.models.hf import config_to_hf

    cfg = head.config
    if cfg.sample_from_anchor:
        raise ValueError("this block draft model drafts from the anchor's slot (DSpark's "
                         "convention), which DFlash's readers do not: save it with save_dspark")
    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    flat = {p: np.asarray(jax.device_get(x)) for p, x in _flat(head.params).items()}
    tensors = {name: np.ascontiguousarray(to_hf(flat[p])) for name, p, to_hf, _ in _table(cfg)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg.layer)
    hf.update(
        architectures=[_ARCH], model_type="qwen3", block_size=cfg.block_size,
        num_target_layers=int(num_target_layers), target_hidden_size=cfg.target_hidden_size,
        dflash_config={"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                       "target_layer_ids": list(cfg.capture_layers)},
    )
    if cfg.markov_rank or cfg.confidence:  # DSpark
        hf.update(markov_rank=cfg.markov_rank, markov_head_type="vanilla",
                  confidence_head=cfg.confidence, confidence_head_with_markov=cfg.markov_rank > 0)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def _policy_lm_head(policy) -> tuple[np.ndarray, np.ndarray]:
    """(embed_tokens [V, H], lm_head [V, H]) of the policy, host arrays."""
    embed = np.asarray(jax.device_get(policy.params["embed_tokens"][...]))
    if policy.config.tie_embeddings:
        return embed, embed
    return embed, np.asarray(jax.device_get(policy.params["lm_head"][...])).T


def check_dspark_layers(ids, num_target_layers: int) -> tuple[int, ...]:
    """DeepSpec's rule for target_layer_ids: layer outputs in [0, L - 1], strictly
    increasing (its `-1`, the embedding output, is not a layer jaxspec captures)."""
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if not ids or bad or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"target_layer_ids {list(ids)}: DSpark needs policy layers in [0, "
                         f"{num_target_layers - 1}], strictly increasing")
    return ids


def save_dspark(head: BlockHead, path, *, policy, num_anchors: int = 512) -> None:
    """config.json + model.safetensors in DeepSpec's DSpark layout (`Qwen3DSparkModel`), with
    the policy's embedding and LM head as the model's own. `head` must draft from the anchor's
    slot (`sample_from_anchor`), as DSpark's readers do; `num_anchors` (DeepSpec's training
    blocks per sequence) is recorded for its trainer."""
    from safetensors.numpy import save_file

    from jaxspec.models.hf import config_to_hf

    cfg = head.config
    pc = policy.config
    if not cfg.sample_from_anchor:
        raise ValueError("this block draft model drafts token i from slot i (DFlash's "
                         "convention); DSpark's readers draft token i + 1 there: train it with "
                         "sample_from_anchor=True, or save it with save_dflash")
    if cfg.target_hidden_size != cfg.hidden_size or pc.hidden_size != cfg.hidden_size:
        raise ValueError(f"DSpark's body is as wide as its target: hidden_size "
                         f"{cfg.hidden_size}, target {pc.hidden_size}")
    ids = check_dspark_layers(cfg.capture_layers, pc.num_layers)
    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    flat = {p: np.asarray(jax.device_get(x)) for p, x in _flat(head.params).items()}
    tensors = {name: np.ascontiguousarray(to_hf(flat[p])) for name, p, to_hf, _ in _table(cfg)}
    embed, lm_head = _policy_lm_head(policy)
    dtype = np.dtype(cfg.layer.param_dtype)
    tensors["embed_tokens.weight"] = np.ascontiguousarray(embed.astype(dtype))
    tensors["lm_head.weight"] = np.ascontiguousarray(lm_head.astype(dtype))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg.layer)
    hf.update(
        architectures=[DSPARK_ARCH], model_type="qwen3", block_size=cfg.block_size,
        num_target_layers=int(pc.num_layers), tie_word_embeddings=False,
        layer_types=["full_attention"] * cfg.layer.num_layers, target_layer_ids=list(ids),
        mask_token_id=cfg.mask_token_id, num_anchors=int(num_anchors),
        enable_confidence_head=cfg.confidence, markov_rank=cfg.markov_rank)
    if cfg.confidence:
        hf["confidence_head_with_markov"] = cfg.markov_rank > 0
    if cfg.markov_rank:
        hf["markov_head_type"] = "vanilla"
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def save_block(head: BlockHead, path, *, policy) -> None:
    """The layout the head's slot convention is read in: DSpark's when it drafts from the
    anchor's slot, else DFlash's."""
    if head.config.sample_from_anchor:
        save_dspark(head, path, policy=policy)
    else:
        save_dflash(head, path, num_target_layers=policy.config.num_layers)


def _config(path: pathlib.Path, dtype, attention_backend) -> BlockConfig:
    from jaxspec.models.hf import _read_json, config_from_hf

    if not path.is_dir():
        raise FileNotFoundError(f"DFlash draft directory {str(path)!r} does not exist (nothing "
                                f"is downloaded)")
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: a DFlash draft needs config.json")
    hf = _read_json(file)
    dspark = _is_dspark(hf)
    if dspark:
        missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id", "num_anchors",
                               "enable_confidence_head", "markov_rank", "num_target_layers")
                   if k not in hf]
        if hf.get("markov_rank") and "markov_head_type" not in hf:
            missing.append("markov_head_type")
        if hf.get("enable_confidence_head") and "confidence_head_with_markov" not in hf:
            missing.append("confidence_head_with_markov")
        if missing:
            raise HFCheckpointError(f"{file}: a {DSPARK_ARCH} config needs {missing}")
        ids, mask, block = hf["target_layer_ids"], hf["mask_token_id"], hf["block_size"]
        try:
            check_dspark_layers(ids, int(hf["num_target_layers"]))
        except ValueError as e:
            raise HFCheckpointError(f"{file}: {e}") from None
        confidence = bool(hf["enable_confidence_head"])
    else:
        dc = hf.get("dflash_config") or {}
        ids = dc.get("target_layer_ids")
        mask = dc.get("mask_token_id", hf.get("mask_token_id"))
        block = dc.get("block_size", hf.get("block_size"))
        if ids is None or mask is None or block is None:
            raise HFCheckpointError(f"{file}: dflash_config needs target_layer_ids, mask_token_id "
                                    f"and block_size; got {dc!r}")
        confidence = bool(hf.get("confidence_head", False))
    layer = config_from_hf({**hf, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
                           dtype=dtype or "float32", attention_backend=attention_backend)
    layer = layer.replace(tie_embeddings=False)
    if hf.get("markov_head_type", "vanilla") != "vanilla":
        raise HFCheckpointError(f"{file}: markov_head_type={hf['markov_head_type']!r}; valid: "
                                f"'vanilla' (the low-rank previous-token bias)")
    try:
        return BlockConfig(layer, int(block), int(hf.get("target_hidden_size") or layer.hidden_size),
                           tuple(int(i) for i in ids), int(mask), int(hf.get("markov_rank") or 0),
                           confidence, sample_from_anchor=dspark)
    except (TypeError, ValueError) as e:
        raise HFCheckpointError(f"{file} describes an invalid block draft: {e}") from None


def _is_dspark(hf: dict) -> bool:
    return DSPARK_ARCH in (hf.get("architectures") or ())


def _confidence_without_markov(path: pathlib.Path, cfg: BlockConfig) -> bool:
    """A DSpark confidence head that reads the hidden state alone (no Markov embedding)."""
    from jaxspec.models.hf import _read_json

    hf = _read_json(path / "config.json")
    return (_is_dspark(hf) and cfg.confidence and cfg.markov_rank > 0
            and not hf.get("confidence_head_with_markov"))


def _read(path: pathlib.Path, cfg: BlockConfig, *, weights: bool):
    """{name: array (weights) or shape} of the checkpoint, checked against the config."""
    from jaxspec.models.hf import _open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    found = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                found[name] = f.get_tensor(name) if weights else tuple(f.get_slice(name).get_shape())
    abstract = jax.eval_shape(lambda: BlockHead.init(cfg, jax.random.key(0)))
    ours = _flat(abstract.params)
    expected = {name: jax.eval_shape(to_hf, ours[p]).shape for name, p, to_hf, _ in _table(cfg)}
    if cfg.sample_from_anchor:  # DSpark: the model's own copies of the target's
        expected["embed_tokens.weight"] = expected["lm_head.weight"] = (cfg.vocab_size,
                                                                        cfg.hidden_size)
        if _confidence_without_markov(path, cfg):
            expected["confidence_head.proj.weight"] = (1, cfg.hidden_size)
    shape = lambda x: tuple(x.shape) if weights else x  # noqa: E731
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{n}: checkpoint {shape(found[n])}, config {expected[n]}" for n in sorted(expected)
             if n in found and shape(found[n]) != tuple(expected[n])]
    if missing or unexpected or wrong:
        raise HFCheckpointError(f"block draft in {path} does not match its config: missing "
                                f"{missing}, unexpected {unexpected}, wrong shapes {wrong}")
    return found, abstract


def inspect_dflash(path, model_config=None, *, dtype: str | None = None) -> BlockConfig:
    """Check a DFlash directory as `load_dflash` would, without reading weights (and against
    the policy's `model_config` when given: HFCheckpointError naming each mismatch)."""
    path = pathlib.Path(path).expanduser()
    cfg = _config(path, dtype, "reference")
    _read(path, cfg, weights=False)
    if model_config is not None:
        abstract = jax.eval_shape(lambda: BlockHead.init(cfg, jax.random.key(0)))
        from jaxspec.models.transformer import Policy

        try:
            abstract.check_compatible(Policy.abstract(model_config))
        except ValueError as e:
            raise HFCheckpointError(f"{path}: {e}") from None
    return cfg


def load_dflash(path, *, dtype: str | None = None, attention_backend: str = "reference") -> BlockHead:
    """A BlockHead from a DFlash directory or a DSpark one (DeepSpec's `Qwen3DSparkModel`,
    drafting from the anchor's slot; its embedding and LM head, copies of the target's, are
    not read: the policy's are used), local only."""
    path = pathlib.Path(path).expanduser()
    cfg = _config(path, dtype, attention_backend)
    tensors, abstract = _read(path, cfg, weights=True)
    if cfg.sample_from_anchor and _confidence_without_markov(path, cfg):
        w = np.asarray(tensors["confidence_head.proj.weight"])  # [1, H]: zero weight on the
        tensors["confidence_head.proj.weight"] = np.concatenate(  # Markov embedding
            [w, np.zeros((1, cfg.markov_rank), w.dtype)], axis=1)
    values = {p: to_ours(np.asarray(tensors[name])) for name, p, _, to_ours in _table(cfg)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)
    paths = list(_flat(abstract.params))
    params = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(values[p], x.dtype) for p, (_, x) in zip(paths, leaves, strict=True)])
    return BlockHead(cfg, abstract.graphdef, params)
