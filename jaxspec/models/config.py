"""Static description of a decoder-only transformer (Qwen3 / Llama-3 families)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math

import jax
import jax.numpy as jnp

from jaxspec.kernels import BACKENDS
from jaxspec.errors import FieldError

FAMILIES = ("qwen3", "llama")
DTYPES = ("float32", "bfloat16")
LAYER_LOOPS = ("auto", "scan", "unroll")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 RoPE frequency scaling (HF rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable, static model description; changing any field means a new compile."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = False
    max_position_embeddings: int = 40960
    dtype: str = "float32"
    attention_backend: str = "reference"
    family: str = "qwen3"
    # Batch-invariant forward (jaxspec.kernels.invariant): a token's logits do not depend on
    # how many rows and tokens share the forward, so bf16 replay is bitwise; it replaces
    # attention_backend and costs speed.
    batch_invariant: bool = False
    # How decoding runs the layers: one scan over the stacked weights, or unrolled over
    # per-layer copies made once per generate call (on CPU and GPU a scan copies each
    # layer's weights per step); "auto": unrolled on CPU and GPU (never with batch_invariant,
    # whose generation must match the scanned training forward bit for bit), scan on TPU.
    # Training always scans.
    layer_loop: str = "auto"

    def __post_init__(self):
        for name, choices in (("family", FAMILIES), ("dtype", DTYPES),
                              ("attention_backend", BACKENDS), ("layer_loop", LAYER_LOOPS)):
            value = getattr(self, name)
            if value not in choices:
                close = difflib.get_close_matches(str(value), choices, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise FieldError("ModelConfig", name, value, f"is unknown{hint}",
                                 "one of " + ", ".join(repr(c) for c in choices),
                                 message=f"ModelConfig.{name}={value!r} is unknown{hint}; valid: "
                                 "one of " + ", ".join(repr(c) for c in choices))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise FieldError("ModelConfig", name, value, "must be a positive int",
                                 "an int >= 1", message=f"ModelConfig.{name}={value!r}; must be "
                                 "a positive int")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise FieldError("ModelConfig", name, value, "must be a finite number > 0",
                                 "a finite number > 0", message=f"ModelConfig.{name}={value!r}; "
                                 "must be a finite number > 0")
        if not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings < 1:
            raise FieldError("ModelConfig", "max_position_embeddings",
                             self.max_position_embeddings, "must be a positive int", "an int >= 1",
                             message=f"ModelConfig.max_position_embeddings="
                             f"{self.max_position_embeddings!r}; must be a positive int")
        if self.num_heads % self.num_kv_heads:
            problem = (f"must divide num_heads: num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (GQA needs whole groups)")
            raise FieldError("ModelConfig", "num_kv_heads", self.num_kv_heads, problem,
                             f"a divisor of num_heads={self.num_heads}",
                             message=f"ModelConfig.num_kv_heads={self.num_kv_heads} {problem}")
        if not isinstance(self.batch_invariant, bool):
            raise FieldError("ModelConfig", "batch_invariant", self.batch_invariant,
                             "must be true or false", "true or false",
                             message=f"ModelConfig.batch_invariant={self.batch_invariant!r}; "
                             "must be true or false")
        if self.head_dim % 2:
            raise FieldError("ModelConfig", "head_dim", self.head_dim, "must be even for RoPE",
                             "an even int", message=f"ModelConfig.head_dim={self.head_dim} must "
                             "be even for RoPE")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise FieldError("ModelConfig", "rope_scaling", self.rope_scaling, "wrong type",
                             "None or Llama3RopeScaling",
                             message=f"ModelConfig.rope_scaling={self.rope_scaling!r}; valid: "
                             "None or Llama3RopeScaling")

    @property
    def param_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, family: str = "qwen3", **overrides) -> ModelConfig:
        """A ~100k-parameter model for tests and CPU runs.

        qwen3: QK-norm, GQA (4 query heads over 2 KV heads), tied embeddings.
        llama: no QK-norm, untied embeddings, Llama-3 RoPE scaling with a short original
        context so that the scaling changes the frequencies used in tests.
        """
        if family == "qwen3":
            base = dict(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                qk_norm=True, tie_embeddings=True, max_position_embeddings=512, family="qwen3",
            )
        elif family == "llama":
            base = dict(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                rope_scaling=Llama3RopeScaling(
                    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32,
                ),
                rms_norm_eps=1e-5, qk_norm=False, tie_embeddings=False,
                max_position_embeddings=512, family="llama",
            )
        else:
            raise ValueError(f"ModelConfig.tiny(family={family!r}); valid: {FAMILIES}")
        base.update(overrides)
        return cls(**base)


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Layers whose outputs EAGLE-3 fuses: (1, L//2 - 1, L - 4), clamped into [0, L-1]."""
    if num_layers <= 0:
        raise ValueError(f"num_layers={num_layers}; must be positive")
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


def matmul_precision(dtype):
    """The context a policy's matrix products run in: precision HIGHEST for float32 weights
    (full float32 on every backend), JAX's default otherwise. JAX's default on a GPU rounds
    float32 operands to TF32, which moved logits by ~1e-3 relative on an H100 and, since a
    verify forward and a decode forward then round differently, made speculative rollouts
    differ from plain ones token for token (docs/BENCHMARKS.md, "On a GPU"). Every product
    with the policy's weights goes through it: `Policy.forward`, the chunked training LM
    head (jaxspec.rl.chunked) and the MTP head's use of the policy's LM head."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()
