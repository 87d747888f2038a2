"""For the parallel tests: mesh splits of the 8 simulated CPU devices and O(1)-logit random
weights."""

import jax
import numpy as np

from jaxspec.models.transformer import param_path

# (data, fsdp, tensor) splits of the 8 simulated CPU devices.
MESHES = {"d2f2t2": (2, 2, 2), "d8": (8, 1, 1), "f4t2": (1, 4, 2)}


def rescaled(params, seed: int):
    """Norm scales 1 + 0.1 N(0,1), embeddings 0.3 N(0,1), matrices N(0,1)/sqrt(fan_in):
    logits of order 1, so tolerances mean something (the 0.02 init gives ~uniform logits)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = param_path(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if name[-1] == "scale":
            value = 1.0 + 0.1 * noise
        elif name[-1] == "embed_tokens":
            value = 0.3 * noise
        else:
            stacked = name[0] == "layers"
            shape = leaf.shape[1:] if stacked else leaf.shape
            fan_in = int(np.prod(shape[:2])) if name[-1] == "o_proj" else shape[0]
            value = noise / np.sqrt(fan_in)
        out.append(np.asarray(value, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
