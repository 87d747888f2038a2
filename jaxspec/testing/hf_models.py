"""Random weights for tiny `transformers` models built in tests (needs torch)."""

from __future__ import annotations


def randomise(model, seed: int, *, embed_scale: float = 1.0):
    """`model` with O(1) activations and logits: every matrix N(0, 1 / fan_in), norm weights
    1 + 0.3 N(0, 1) (so a wrong norm shows), the embedding embed_scale * N(0, 1); in eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(embed_scale * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model.eval()
