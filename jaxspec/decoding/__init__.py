"""Sampling, draft trees, lossless verification, drafters and the rollout engine."""

from jaxspec.decoding.sampling import SamplingConfig, process_logits, sample
from jaxspec.decoding.tree import Tree
from jaxspec.decoding.verify import METHODS, Verdict, verify
from jaxspec.decoding.protocols import DraftContext, DraftHead, Drafter, Observation  # noqa: E402
from jaxspec.decoding.drafters import (  # noqa: E402  (drafters build on the above)
    DraftModelDrafter,
    Eagle3Drafter,
    MTPDrafter,
    NGramDrafter,
    NoDrafter,
    TreeSpec,
)
from jaxspec.decoding.engine import Rollouts, RolloutStats, decoding_policy, generate  # noqa: E402
from jaxspec.decoding.adaptive import AdaptiveK, measure_costs  # noqa: E402
from jaxspec.decoding.history import HistoryDrafter, HistoryStore, HybridDrafter  # noqa: E402

__all__ = [
    "METHODS",
    "AdaptiveK",
    "DraftContext",
    "DraftHead",
    "DraftModelDrafter",
    "Drafter",
    "Eagle3Drafter",
    "HistoryDrafter",
    "HistoryStore",
    "HybridDrafter",
    "MTPDrafter",
    "NGramDrafter",
    "NoDrafter",
    "Observation",
    "RolloutStats",
    "Rollouts",
    "SamplingConfig",
    "Tree",
    "TreeSpec",
    "Verdict",
    "decoding_policy",
    "generate",
    "measure_costs",
    "process_logits",
    "sample",
    "verify",
]
