"""Policy transformer (Qwen3 / Llama-3 families) as Flax NNX modules, KV cache, HF interop."""

from jaxspec.models.cache import CacheOverflowError, KVCache, compact
from jaxspec.models.config import (
    Llama3RopeScaling,
    ModelConfig,
    default_eagle3_layers,
)
from jaxspec.models.hf import (
    HFCheckpointError,
    SpecialTokens,
    UnsupportedModelError,
    inspect_hf,
    load_hf,
    save_hf,
    special_tokens,
)
from jaxspec.models.layers import MLP, Attention, DecoderLayer, RMSNorm, apply_rope, rope_inv_freq
from jaxspec.models.transformer import Policy, Transformer

__all__ = [
    "MLP",
    "Attention",
    "CacheOverflowError",
    "DecoderLayer",
    "HFCheckpointError",
    "KVCache",
    "Llama3RopeScaling",
    "ModelConfig",
    "Policy",
    "RMSNorm",
    "SpecialTokens",
    "Transformer",
    "UnsupportedModelError",
    "apply_rope",
    "inspect_hf",
    "compact",
    "default_eagle3_layers",
    "load_hf",
    "rope_inv_freq",
    "save_hf",
    "special_tokens",
]
