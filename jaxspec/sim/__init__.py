"""jaxspec.sim: an open, analytic performance simulator of one RL step with speculative rollouts.

Roofline step costs for decode / verify / draft on a generation engine, an event-driven
batch generation with a long tail, FLOP-based logprob and training, and sync or async
pipelines. Every number the paper does not give is a named assumption
(`jaxspec.sim.assumptions`); measurements replace them through `jaxspec.sim.calibrate`.
See docs/simulator.md and scripts/simulate.py.
"""

from jaxspec.sim.acceptance import Acceptance
from jaxspec.sim.assumptions import DEFAULT, Assumptions, describe
from jaxspec.sim.calibrate import calibrate, load_measurements
from jaxspec.sim.engine import DRAFTER_KINDS, Drafter, EngineLayout, StepCost, forward_time, generation_time
from jaxspec.sim.hardware import GPU, GPUS, Cluster, get_gpu
from jaxspec.sim.models import MODELS, ModelShape, eagle3_head, get_model, mtp_head
from jaxspec.sim.pipeline import Comparison, Scenario, StepResult, SweepRow, compare, k_sweep, simulate_step
from jaxspec.sim.workloads import WORKLOADS, Workload, get_workload

__all__ = [
    "Acceptance", "Assumptions", "DEFAULT", "describe", "calibrate", "load_measurements",
    "DRAFTER_KINDS", "Drafter", "EngineLayout", "StepCost", "forward_time", "generation_time",
    "GPUS", "GPU", "Cluster", "get_gpu", "MODELS", "ModelShape", "eagle3_head", "get_model", "mtp_head",
    "Comparison", "Scenario", "StepResult", "SweepRow", "compare", "k_sweep", "simulate_step",
    "WORKLOADS", "Workload", "get_workload",
]
