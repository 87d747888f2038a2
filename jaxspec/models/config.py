"""Static description of a decoder-only transformer (Qwen3 / Llama-3 families)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math

import jax
import jax.numpy as jnp

from jaxspec.kernels import BACKENDS
from jaxspec.kernels.flash import IMPLEMENTATIONS as TRAIN_ATTENTIONS
from jaxspec.errors import FieldError

FAMILIES = ("qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_next", "qwen3_5_moe")
# Hybrid families: Gated DeltaNet (linear attention) layers between gated full-attention ones
# (jaxspec.models.hybrid); qwen3_next may add experts (as qwen3_moe does); qwen3_5_moe is
# Qwen3.5's layers with experts and a gated shared expert in every layer.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
# The families whose layers may route to experts (jaxspec.models.moe).
EXPERT_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")
EXPERT_BACKENDS = ("ragged", "blocked", "dense")
DTYPES = ("float32", "bfloat16")
LAYER_LOOPS = ("auto", "scan", "unroll")
FUSED_KERNELS = ("auto", "xla", "pallas")


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
    # The attention of forwards with no cache (training, scoring: jaxspec.kernels.flash), which
    # never forms [B, heads, T, T] scores: "chunked" (jnp, blocked online softmax), "cudnn"
    # (GPU, bfloat16: cuDNN's fused attention), "auto" (cudnn on a GPU for bfloat16, else
    # chunked) or "reference" (the dense mask through attention_backend: T^2 memory).
    train_attention: str = "auto"
    family: str = "qwen3"
    # Batch-invariant forward (jaxspec.kernels.invariant): a token's logits do not depend on
    # how many rows and tokens share the forward, so bf16 replay is bitwise; it replaces
    # attention_backend and costs speed. Every family (hybrids: the recurrent delta rule in
    # every forward, jaxspec.models.gated_deltanet.delta_rule_invariant).
    batch_invariant: bool = False
    # How decoding runs the layers: one scan over the stacked weights, or unrolled over
    # per-layer copies made once per generate call (on CPU and GPU a scan copies each
    # layer's weights per step); "auto": unrolled on CPU and GPU (never with batch_invariant,
    # whose generation must match the scanned training forward bit for bit), scan on TPU.
    # Training always scans.
    layer_loop: str = "auto"
    # A decoder layer's two fused Pallas kernels: its attention inputs (input norm, q/k/v
    # projections, QK-norm, RoPE: jaxspec.kernels.qkv) and its MLP's silu(x @ gate) * (x @ up)
    # (jaxspec.kernels.swiglu), each writing only its outputs where XLA writes and re-reads
    # the intermediates. "xla" and "auto" (the kernels lose to XLA on a GPU as they stand:
    # docs/kernels.md): never; "pallas": wherever the sizes are whole tiles (interpreted off
    # GPU). Never with batch_invariant; EAGLE-3's layer (2H input) keeps XLA's attention inputs.
    fused_kernels: str = "auto"
    # Mixture of experts (family qwen3_moe, HF Qwen3MoeForCausalLM; jaxspec.models.moe): each
    # sparse layer routes a token to `num_experts_per_tok` of `num_experts` SwiGLU experts of
    # width `moe_intermediate_size` (softmax router, top-k, renormalised if norm_topk_prob),
    # plus a gated shared expert of width `shared_expert_intermediate_size` (0: none; Qwen2-MoE
    # style). Layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    # == 0; the others run the dense MLP of width intermediate_size. expert_backend, for
    # forwards of more tokens than a decode's: "blocked" (tokens sorted by expert, one batched
    # matmul per block of one expert's rows), "ragged" (jax.lax.ragged_dot: a grouped GEMM
    # where XLA lowers it to one; its default lowering multiplies every expert) or "dense"
    # (every expert over every token, masked: the reference). jaxspec.models.moe.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    expert_backend: str = "blocked"
    # Hybrid families (qwen3_5, qwen3_next; jaxspec.models.hybrid), HF's names: layer i is a
    # Gated DeltaNet ("linear_attention") or a gated full attention ("full_attention") per
    # layer_types; a linear layer has linear_num_key_heads query/key heads of width
    # linear_key_head_dim, linear_num_value_heads value heads of width linear_value_head_dim and
    # a causal convolution of linear_conv_kernel_dim taps; full attention rotates the first
    # partial_rotary_factor of each head's dims. Empty / 0 / 1.0 for the other families.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        for name, choices in (("family", FAMILIES), ("dtype", DTYPES),
                              ("attention_backend", BACKENDS), ("layer_loop", LAYER_LOOPS),
                              ("train_attention", TRAIN_ATTENTIONS),
                              ("fused_kernels", FUSED_KERNELS),
                              ("expert_backend", EXPERT_BACKENDS)):
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
        self._check_experts()
        self._check_hybrid()
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise FieldError("ModelConfig", "rope_scaling", self.rope_scaling, "wrong type",
                             "None or Llama3RopeScaling",
                             message=f"ModelConfig.rope_scaling={self.rope_scaling!r}; valid: "
                             "None or Llama3RopeScaling")

    def _check_hybrid(self):
        if isinstance(self.layer_types, list):  # hashable: the config is a static jit argument
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        linear = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim")

        def bad(name, value, valid, problem="is out of range"):
            raise FieldError("ModelConfig", name, value, problem, valid,
                             message=f"ModelConfig.{name}={value!r} {problem}; valid: {valid}")

        if not self.is_hybrid:
            if self.layer_types:
                bad("layer_types", self.layer_types, f"() for family {self.family!r} (layer "
                    f"types need a hybrid family: {', '.join(HYBRID_FAMILIES)})", "needs a hybrid family")
            for name in linear:
                if getattr(self, name):
                    bad(name, getattr(self, name), f"0 for family {self.family!r}",
                        "needs a hybrid family")
            if self.partial_rotary_factor != 1.0:
                bad("partial_rotary_factor", self.partial_rotary_factor,
                    f"1.0 for family {self.family!r}", "needs a hybrid family")
            return
        if (len(self.layer_types) != self.num_layers
                or any(t not in LAYER_TYPES for t in self.layer_types)):
            bad("layer_types", self.layer_types, f"{self.num_layers} entries (num_layers), each "
                + " or ".join(repr(t) for t in LAYER_TYPES))
        for name in linear:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(name, value, f"an int >= 1 for family {self.family!r}")
        if self.linear_conv_kernel_dim < 2:
            bad("linear_conv_kernel_dim", self.linear_conv_kernel_dim, "an int >= 2")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad("linear_num_value_heads", self.linear_num_value_heads,
                f"a multiple of linear_num_key_heads={self.linear_num_key_heads}")
        factor = self.partial_rotary_factor
        if (not isinstance(factor, (int, float)) or not 0 < factor <= 1
                or int(self.head_dim * factor) % 2 or int(self.head_dim * factor) < 2):
            bad("partial_rotary_factor", factor, f"a number in (0, 1] whose share of head_dim="
                f"{self.head_dim} is an even int >= 2")
        if self.rope_scaling is not None:
            bad("rope_scaling", self.rope_scaling, f"None for family {self.family!r}",
                "is not supported")

    @property
    def is_hybrid(self) -> bool:
        """Whether the layers mix Gated DeltaNet and full attention (jaxspec.models.hybrid)."""
        return self.family in HYBRID_FAMILIES

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each attention head that RoPE rotates (all but for hybrids)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_experts(self):
        if isinstance(self.mlp_only_layers, list):  # hashable: the config is a static jit argument
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

        def bad(name, value, valid, problem="is out of range"):
            raise FieldError("ModelConfig", name, value, problem, valid,
                             message=f"ModelConfig.{name}={value!r} {problem}; valid: {valid}")

        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                bad(name, value, "an int >= 0")
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            bad("decoder_sparse_step", self.decoder_sparse_step, "an int >= 1")
        if not isinstance(self.norm_topk_prob, bool):
            bad("norm_topk_prob", self.norm_topk_prob, "true or false", "wrong type")
        layers = tuple(self.mlp_only_layers)
        if any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers):
            bad("mlp_only_layers", layers, f"layer indices in [0, {self.num_layers})")
        if self.family == "qwen3_next" and not self.num_experts:
            return  # a dense Qwen3-Next
        if self.family == "qwen3_5_moe":  # HF Qwen3_5MoeSparseMoeBlock in every layer
            for name in ("num_experts", "shared_expert_intermediate_size"):
                if getattr(self, name) < 1:
                    bad(name, getattr(self, name), "an int >= 1 for family 'qwen3_5_moe' (every layer has "
                        "experts and a gated shared expert)")
            for name, value, want in (("norm_topk_prob", self.norm_topk_prob, True),
                                      ("decoder_sparse_step", self.decoder_sparse_step, 1),
                                      ("mlp_only_layers", layers, ())):
                if value != want:
                    bad(name, value, f"{want!r} for family 'qwen3_5_moe' (transformers' "
                        "Qwen3.5-MoE renormalises the top-k and routes in every layer)")
        if self.family not in EXPERT_FAMILIES:
            if self.num_experts:
                bad("num_experts", self.num_experts, f"0 for family {self.family!r} (experts "
                    "need family 'qwen3_moe')", "needs family 'qwen3_moe'")
            return
        if self.num_experts < 1:
            bad("num_experts", self.num_experts, "an int >= 1 for family 'qwen3_moe'")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            bad("num_experts_per_tok", self.num_experts_per_tok,
                f"an int in [1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size < 1:
            bad("moe_intermediate_size", self.moe_intermediate_size,
                "an int >= 1 for family 'qwen3_moe'")

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is the mixture of experts (HF Qwen3MoeDecoderLayer's rule)."""
        if self.family not in EXPERT_FAMILIES or not self.num_experts:
            return (False,) * self.num_layers
        skip = set(self.mlp_only_layers)
        return tuple(i not in skip and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer runs the dense MLP (then every layer carries one: stacked layers
        share a structure, and a sparse layer's is zero and unused; see jaxspec.models.moe)."""
        return not all(self.sparse_layers)

    def without_experts(self) -> ModelConfig:
        """This config with a dense MLP in every layer (family qwen3 for qwen3_moe): the shape
        of a draft head's layer for an MoE policy (EAGLE-3, MTP heads are dense)."""
        if self.family != "qwen3_moe":
            return self
        return self.replace(family="qwen3", num_experts=0, num_experts_per_tok=0,
                            moe_intermediate_size=0, norm_topk_prob=False, decoder_sparse_step=1,
                            mlp_only_layers=(), shared_expert_intermediate_size=0)

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
        qwen3_moe: qwen3's attention, untied, every layer 8 experts of width 32, top-2.
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
        elif family == "qwen3_moe":
            base = dict(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                qk_norm=True, tie_embeddings=False, max_position_embeddings=512,
                family="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True,
            )
        elif family in HYBRID_FAMILIES:
            # 4 layers, 3 Gated DeltaNet then 1 gated full attention (the released models'
            # pattern); qwen3_next adds qwen3_moe's experts and a gated shared expert.
            base = dict(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                qk_norm=True, tie_embeddings=False, max_position_embeddings=512, family=family,
                layer_types=("linear_attention",) * 3 + ("full_attention",),
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
            )
            if family in ("qwen3_next", "qwen3_5_moe"):
                base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            norm_topk_prob=True, shared_expert_intermediate_size=32)
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
