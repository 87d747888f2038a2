"""Model shapes (dense and MoE) and the parameter / FLOP / KV-byte counts derived from them.

Presets use the published `config.json` values of the Hugging Face checkpoints. Draft
shapes (EAGLE-3 head, MTP head) are derived from their target, as the draft in
`jaxspec.models` is.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ModelShape", "MODELS", "get_model", "eagle3_head", "mtp_head"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, enough to count bytes and FLOPs.

    Dense models have `num_experts == 0` and an MLP of width `intermediate_size`.
    MoE models route each token to `experts_per_token` of `num_experts` experts of width
    `expert_intermediate_size` (plus `shared_expert_intermediate_size` if any).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int = 0  # dense MLP width (0 for MoE layers)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_embeddings: bool = False
    qkv_in_features: int = 0  # q/k/v input width; 0 = hidden_size (EAGLE-3 uses 2H)
    extra_params: int = 0  # parameters outside the layers read once per forward (EAGLE-3 fc)
    has_embedding: bool = True  # False for heads that reuse the target's embedding
    has_lm_head: bool = True  # False for heads that reuse the target's LM head
    lm_head_vocab: int = 0  # LM-head rows if they differ from vocab_size (draft vocab)
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_value: float = 2.0  # bf16 KV cache

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ---- parameters -------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """Per layer: q, k, v, o projections (no biases in Qwen3 / Llama-3)."""
        d_in = self.qkv_in_features or self.hidden_size
        q = d_in * self.num_heads * self.head_dim
        kv = 2 * d_in * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        return q + kv + o

    @property
    def dense_mlp_params(self) -> int:
        """Per layer: MLP weights every token reads (dense MLP, router, shared expert)."""
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.is_moe:
            mlp += self.hidden_size * self.num_experts  # router
            mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size
        return mlp

    @property
    def expert_params(self) -> int:
        """Per layer, per routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * (self.lm_head_vocab or self.vocab_size) if self.has_lm_head else 0

    @property
    def embedding_params(self) -> int:
        if not self.has_embedding or (self.tie_embeddings and self.has_lm_head):
            return 0  # tied: counted once, as the LM head
        return self.hidden_size * self.vocab_size

    @property
    def total_params(self) -> int:
        per_layer = self.attention_params + self.dense_mlp_params + self.num_experts * self.expert_params
        return self.num_layers * per_layer + self.lm_head_params + self.embedding_params + self.extra_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with (embedding lookup excluded)."""
        per_layer = self.attention_params + self.dense_mlp_params + self.experts_per_token * self.expert_params
        return self.num_layers * per_layer + self.lm_head_params + self.extra_params

    def weight_bytes_read(self, tokens: float) -> float:
        """Weight bytes one forward over `tokens` tokens reads from HBM.

        Dense weights are read once. A routed expert is read if at least one token picks
        it: with uniform routing the expected fraction touched is 1 - (1 - e/E)^tokens.
        The embedding table is a gather (tokens rows), not a full read.
        """
        dense = self.num_layers * (self.attention_params + self.dense_mlp_params)
        dense += self.lm_head_params + self.extra_params
        touched = 0.0
        if self.is_moe:
            frac = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(tokens, 0.0)
            touched = self.num_layers * self.num_experts * frac * self.expert_params
        return (dense + touched) * self.bytes_per_param

    # ---- KV cache and attention ---------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value

    def attention_flops(self, query_tokens: float, context: float) -> float:
        """QK^T and PV FLOPs for `query_tokens` queries over `context` keys each."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * query_tokens * context

    def forward_flops(self, tokens: float, attended_context: float) -> float:
        """FLOPs of a forward over `tokens` tokens that attend to `attended_context` keys in total."""
        attention = 4.0 * self.num_layers * self.num_heads * self.head_dim * attended_context
        return 2.0 * self.active_params * tokens + attention


_QWEN3_VOCAB = 151936

MODELS: dict[str, ModelShape] = {
    # Qwen/Qwen3-8B config.json: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    # intermediate 12288, vocab 151936, untied embeddings -> 8.19 B parameters.
    "Qwen3-8B": ModelShape(
        "Qwen3-8B", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        vocab_size=_QWEN3_VOCAB, intermediate_size=12288,
    ),
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 64 heads, 4 KV heads,
    # head_dim 128, 128 experts, 8 per token, moe_intermediate 1536, no shared expert,
    # vocab 151936, untied -> 235 B total, 22 B active.
    "Qwen3-235B-A22B": ModelShape(
        "Qwen3-235B-A22B", num_layers=94, hidden_size=4096, num_heads=64, num_kv_heads=4,
        head_dim=128, vocab_size=_QWEN3_VOCAB, num_experts=128, experts_per_token=8,
        expert_intermediate_size=1536,
    ),
    # Qwen/Qwen3-0.6B: a small draft model sharing Qwen3's tokenizer (tied embeddings).
    "Qwen3-0.6B": ModelShape(
        "Qwen3-0.6B", num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
        vocab_size=_QWEN3_VOCAB, intermediate_size=3072, tie_embeddings=True,
    ),
    # Qwen/Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads, 4 KV heads, 128 experts, 8 active.
    "Qwen3-30B-A3B": ModelShape(
        "Qwen3-30B-A3B", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
        head_dim=128, vocab_size=_QWEN3_VOCAB, num_experts=128, experts_per_token=8,
        expert_intermediate_size=768,
    ),
}


def get_model(name: str) -> ModelShape:
    """The preset named `name` (case-insensitive)."""
    for key, shape in MODELS.items():
        if key.lower() == name.lower():
            return shape
    raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")


def eagle3_head(target: ModelShape, *, draft_vocab: int = 32000, intermediate: int = 0) -> ModelShape:
    """The EAGLE-3 head of `target`: fc 3H->H, one decoder layer with q/k/v from 2H, a
    draft-vocabulary LM head; the token embedding is the target's (a gather, not a read).

    `intermediate` defaults to the target's dense MLP width, or 3H for an MoE target
    (EAGLE-3 heads are dense).
    """
    h = target.hidden_size
    width = intermediate or target.intermediate_size or 3 * h
    return ModelShape(
        f"EAGLE-3({target.name})", num_layers=1, hidden_size=h, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, vocab_size=target.vocab_size,
        intermediate_size=width, qkv_in_features=2 * h, extra_params=3 * h * h,
        has_embedding=False, lm_head_vocab=draft_vocab,
    )


def mtp_head(target: ModelShape) -> ModelShape:
    """A DeepSeek-V3-style MTP module: projection 2H->H and one target-shaped layer; it
    shares the target's embedding and full-vocabulary LM head (read on every draft step)."""
    h = target.hidden_size
    return dataclasses.replace(
        target, name=f"MTP({target.name})", num_layers=1, extra_params=2 * h * h, has_embedding=False,
    )
