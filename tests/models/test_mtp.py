"""MTP head against an independent PyTorch DeepSeek-V3-style MTP module
(jaxspec.testing.torch_mtp)."""

import jax.numpy as jnp
import numpy as np
import torch

from jaxspec.models import ModelConfig
from jaxspec.testing.torch_mtp import TorchMTP, random_head, torch_layout


def test_mtp_head_matches_a_torch_mtp_layer(make_policy):
    policy = make_policy(ModelConfig.tiny("qwen3"), seed=3)  # QK-norm, tied embeddings
    head = random_head(policy, seed=4)
    b, t, h = 2, 7, policy.config.hidden_size
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, policy.config.vocab_size, (b, t)).astype(np.int32)
    hidden = rng.standard_normal((b, t, h)).astype(np.float32)
    embeds = np.asarray(policy.embed(tokens))

    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, cache = head.forward(jnp.asarray(embeds), jnp.asarray(hidden), positions, head.init_cache(b, t), fuse=True)
    got, ids = head.draft_logits(out, policy)
    assert ids is None  # candidates are the policy's vocabulary
    np.testing.assert_array_equal(cache.lengths, [t, t])

    ref = TorchMTP(torch_layout(head), head.config.layer)
    lm_head = torch.tensor(np.array(policy.params["embed_tokens"][...]))  # tied
    with torch.no_grad():
        want = ref(torch.from_numpy(embeds), torch.from_numpy(hidden), lm_head).numpy()
    scale = np.abs(want).max()
    assert scale > 1.0, scale  # non-trivial logits
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5 * scale, rtol=0)
