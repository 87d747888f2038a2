"""Sampling, draft trees, lossless verification, drafters and the rollout engine."""

from jaxspec.decoding.adaptive import AdaptiveK
from jaxspec.decoding.block import BlockDrafter
from jaxspec.decoding.costs import measure_costs
from jaxspec.decoding.drafters import (
    DraftModelDrafter,
    Eagle3Drafter,
    ModelFreeDrafter,
    MTPDrafter,
    NGramDrafter,
    NoDrafter,
    TreeSpec,
)
from jaxspec.decoding.engine import decoding_policy, generate
from jaxspec.decoding.history import HistoryDrafter, HistoryStore, HybridDrafter
from jaxspec.decoding.protocols import (
    DraftContext,
    Drafter,
    DraftHead,
    Observation,
    StateAxes,
)
from jaxspec.decoding.sampling import SamplingConfig, process_logits, sample
from jaxspec.decoding.stats import Rollouts, RolloutStats
from jaxspec.decoding.tree import Tree
from jaxspec.decoding.verify import METHODS, Verdict, verify

__all__ = [
    "METHODS",
    "AdaptiveK",
    "BlockDrafter",
    "DraftContext",
    "DraftHead",
    "DraftModelDrafter",
    "Drafter",
    "Eagle3Drafter",
    "HistoryDrafter",
    "HistoryStore",
    "HybridDrafter",
    "MTPDrafter",
    "ModelFreeDrafter",
    "NGramDrafter",
    "NoDrafter",
    "Observation",
    "RolloutStats",
    "Rollouts",
    "SamplingConfig",
    "StateAxes",
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
