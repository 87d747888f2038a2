#!/usr/bin/env python
"""Max logit error of our float32 forward against transformers' float32 forward (torch on
the CPU), for tiny random Qwen3 and Llama-3 checkpoints, per JAX matmul precision.

    python scripts/hf_parity.py                 # default and highest precision
    JAX_PLATFORMS=cuda python scripts/hf_parity.py

On a CPU every precision is full float32 (errors ~1e-5 at logits of magnitude ~10). On a
GPU, JAX's default precision for float32 matrix products may use reduced-precision units
(TF32 on Ampere and Hopper): this prints how far that moves the logits, against the
`highest` precision, which `Policy.forward` uses for float32 policies (this script runs the
forward beneath it, to show both).
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import jax
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "models"))

from test_hf import SEQ, _hf_model, _randomise  # the suite's tiny checkpoints  # noqa: E402

from jaxspec.models import load_hf  # noqa: E402
from jaxspec.models.transformer import _forward  # noqa: E402


def main() -> int:
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"{'model':<14}{'precision':>10}{'max |logit|':>13}{'max error':>12}{'relative':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for seed, name in enumerate(["qwen3_tied", "qwen3_untied", "llama3"]):
            torch.manual_seed(seed)
            model = _randomise(_hf_model(name), seed)
            path = pathlib.Path(tmp) / name
            model.save_pretrained(path)
            ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                ref = model(ids).logits.numpy().astype(np.float64)
            policy = load_hf(path)
            pos = np.tile(np.arange(SEQ, dtype=np.int32), (2, 1))
            for precision in ("default", "highest"):
                # The module-level forward: Policy.forward itself fixes float32 at "highest"
                # (jaxspec.models.transformer), which would hide what TF32 does.
                with jax.default_matmul_precision(precision):
                    logits = jax.jit(lambda p, i, q: _forward(p, i, q, None, None, (), True)[0])(
                        policy, ids.numpy(), pos)
                err = float(np.max(np.abs(np.asarray(logits, np.float64) - ref)))
                top = float(np.max(np.abs(ref)))
                print(f"{name:<14}{precision:>10}{top:>13.2f}{err:>12.2e}{err / top:>11.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
