"""Policy transformer (Qwen3 / Llama-3 / Qwen3-MoE; hybrid Qwen3.5 / Qwen3-Next) as Flax NNX
modules, KV cache, HF interop."""

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
from jaxspec.models.hybrid import HybridCache, HybridPolicy
from jaxspec.models.transformer import Policy, Transformer

__all__ = [
    "CacheOverflowError",
    "HFCheckpointError",
    "HybridCache",
    "HybridPolicy",
    "KVCache",
    "Llama3RopeScaling",
    "ModelConfig",
    "Policy",
    "SpecialTokens",
    "Transformer",
    "UnsupportedModelError",
    "compact",
    "default_eagle3_layers",
    "inspect_hf",
    "load_hf",
    "save_hf",
    "special_tokens",
]
