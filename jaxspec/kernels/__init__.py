"""Draft-tree verification attention: a jnp reference and kernel backends."""

from jaxspec.kernels.reference import tree_attention_reference


def tree_attention(
    q,  # [batch, num_nodes, q_heads, head_dim]
    k_cache,  # [batch, max_len, kv_heads, head_dim]
    v_cache,  # [batch, max_len, kv_heads, head_dim]
    cache_lengths,  # [batch]
    k_new,  # [batch, num_nodes, kv_heads, head_dim]
    v_new,  # [batch, num_nodes, kv_heads, head_dim]
    tree_mask,  # [batch, num_nodes, num_nodes] bool
    *,
    backend: str = "reference",
    scale: float | None = None,
):
    """Attention of N tree nodes over a ragged cached prefix plus the tree (ancestor mask)."""
    if backend != "reference":
        raise ValueError(f"tree_attention backend {backend!r} is not available; valid: 'reference'")
    return tree_attention_reference(
        q, k_cache, v_cache, cache_lengths, k_new, v_new, tree_mask, scale=scale
    )


__all__ = ["tree_attention", "tree_attention_reference"]
