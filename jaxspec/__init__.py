"""jaxspec: GRPO post-training in JAX with rollouts from lossless speculative decoding."""

__version__ = "0.1.0"
