"""Sampling, draft trees, lossless verification, drafters and the rollout engine."""

from jaxspec.decoding.sampling import SamplingConfig, process_logits, sample
from jaxspec.decoding.tree import Tree
from jaxspec.decoding.verify import METHODS, Verdict, verify
from jaxspec.decoding.drafters import (  # noqa: E402  (drafters build on the three above)
    DraftContext,
    DraftModelDrafter,
    Eagle3Drafter,
    MTPDrafter,
    NGramDrafter,
    TreeSpec,
)
from jaxspec.decoding.engine import Rollouts, RolloutStats, generate, pad_prompts  # noqa: E402

__all__ = [
    "METHODS",
    "DraftContext",
    "DraftModelDrafter",
    "Eagle3Drafter",
    "MTPDrafter",
    "NGramDrafter",
    "RolloutStats",
    "Rollouts",
    "SamplingConfig",
    "Tree",
    "TreeSpec",
    "Verdict",
    "generate",
    "pad_prompts",
    "process_logits",
    "sample",
    "verify",
]
