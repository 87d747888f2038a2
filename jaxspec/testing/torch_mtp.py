"""An independent PyTorch DeepSeek-V3-style MTP layer, and the bridge from an `MTPHead`.

Written from the paper's definition, not from jaxspec's code: tests/models/test_mtp*.py and
tests/rl/test_mtp_training.py compare jaxspec's MTP head, loss and gradients against it.
Needs torch (the `test` extra).
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxspec.models.mtp import MTPHead
from jaxspec.models.transformer import param_path


class TorchRMSNorm(torch.nn.Module):
    """RMSNorm with a given weight: x / rms(x) * weight."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.as_tensor(weight).clone())
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TorchMTP(torch.nn.Module):
    """x = eh_proj([enorm(embedding); hnorm(h)]); one pre-norm decoder layer (GQA, QK-norm,
    RoPE, SwiGLU); logits = shared LM head(norm(out)). Weights given as torch Linear layouts."""

    def __init__(self, w, cfg):
        super().__init__()
        self.w, self.cfg = {k: torch.tensor(np.array(v)) for k, v in w.items()}, cfg
        eps = cfg.rms_norm_eps
        self.norms = {k: TorchRMSNorm(self.w[k], eps) for k in w if k.endswith("norm")}

    def forward(self, embeds, hidden, lm_head):  # [B,T,H], [B,T,H], [V,H] -> [B,T,V]
        c, w, n = self.cfg, self.w, self.norms
        nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        b, t, _ = embeds.shape
        lin = torch.nn.functional.linear
        x = lin(torch.cat([n["enorm"](embeds), n["hnorm"](hidden)], -1), w["eh_proj"])
        h = n["input_layernorm"](x)
        q = n["q_norm"](lin(h, w["q_proj"]).view(b, t, nq, d)).transpose(1, 2)
        k = n["k_norm"](lin(h, w["k_proj"]).view(b, t, nkv, d)).transpose(1, 2)
        v = lin(h, w["v_proj"]).view(b, t, nkv, d).transpose(1, 2)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        rot = lambda z: torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + lin(att.transpose(1, 2).reshape(b, t, nq * d), w["o_proj"])
        g = n["post_attention_layernorm"](x)
        x = x + lin(torch.nn.functional.silu(lin(g, w["gate_proj"])) * lin(g, w["up_proj"]), w["down_proj"])
        return lin(n["norm"](x), lm_head)


def random_head(policy, seed: int) -> MTPHead:
    """An MTP head with O(1) activations: weights ~ 1/sqrt(fan_in), norm scales 1 + 0.2 N(0, 1)."""
    head = MTPHead.init_for(policy, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(head.params)
    values = []
    for path, leaf in leaves:
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if param_path(path)[-1] == "scale":
            values.append(1.0 + 0.2 * noise)
        else:
            fan_in = leaf.shape[0] * (leaf.shape[1] if param_path(path)[-1] == "o_proj" else 1)
            values.append(noise / np.sqrt(fan_in))
    return MTPHead(head.config, head.graphdef, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(v) for v in values]))


def torch_layout(head: MTPHead) -> dict:
    """Our params as torch Linear weights [out, in] and norm weights, by short name."""
    flat = {param_path(p)[-2 if param_path(p)[-1] == "scale" else -1]: np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(head.params)[0]}
    c = head.config.layer
    out = {k: flat[k] for k in ("enorm", "hnorm", "norm", "input_layernorm", "post_attention_layernorm",
                                 "q_norm", "k_norm")}
    out["eh_proj"] = flat["eh_proj"].T
    for name in ("q_proj", "k_proj", "v_proj"):
        out[name] = flat[name].reshape(c.hidden_size, -1).T
    out["o_proj"] = flat["o_proj"].reshape(-1, c.hidden_size).T
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[name] = flat[name].T
    return out
