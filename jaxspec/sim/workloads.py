"""RL workloads: how many rollouts a step makes, how long they are, how well drafts match.

Apart from the acceptance lengths it reports (n-gram 2.47 / 2.05; 3 for the 235B
projection) the paper gives none of these numbers, so the preset fields are assumptions
or fits (documented in docs/simulator.md). Response lengths follow a log-normal
clipped at `max_response_tokens`: RL rollouts have a long tail, and the batch's longest
rollout decides when synchronous generation ends.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics

import numpy as np

from jaxspec.sim.acceptance import Acceptance

__all__ = ["Workload", "WORKLOADS", "get_workload"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL step's generation work and the draft acceptance it sees."""

    name: str
    prompts_per_step: int
    generations_per_prompt: int
    prompt_tokens: int
    response_median_tokens: float
    response_sigma: float  # log-normal shape: larger = longer tail
    max_response_tokens: int
    acceptance: dict[str, Acceptance] = dataclasses.field(default_factory=dict)  # by drafter kind

    def __post_init__(self):
        for field in ("prompts_per_step", "generations_per_prompt", "max_response_tokens", "response_median_tokens"):
            if getattr(self, field) <= 0:
                raise ValueError(f"workload {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        if self.prompt_tokens < 0 or self.response_sigma < 0:
            raise ValueError(f"workload {self.name!r}: prompt_tokens and response_sigma must be >= 0")

    @property
    def rollouts(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    def response_lengths(self, n: int, *, total: int | None = None) -> np.ndarray:
        """[n] response lengths at evenly spaced quantiles (deterministic, no RNG).

        If `total` is given (the batch's rollout count, n of them on this engine), the
        longest one is moved to the batch-wide maximum quantile: in synchronous RL the
        engine that holds the batch's longest rollout finishes last.
        """
        top = total if total is not None and total > n else n
        return np.array(_lengths(self.response_median_tokens, self.response_sigma, self.max_response_tokens, n, top))

    def moments(self) -> tuple[float, float]:
        """(E[response tokens], E[(prompt + response)^2]) of the clipped distribution."""
        lengths = self.response_lengths(4096)
        seq = self.prompt_tokens + lengths
        return float(lengths.mean()), float((seq**2).mean())

    def acceptance_for(self, drafter: str) -> Acceptance:
        if drafter not in self.acceptance:
            raise ValueError(
                f"workload {self.name!r} has no acceptance profile for drafter {drafter!r}; "
                f"known: {sorted(self.acceptance)}; pass acceptance=... explicitly"
            )
        return self.acceptance[drafter]


@functools.lru_cache(maxsize=256)
def _lengths(median: float, sigma: float, cap: int, n: int, top: int) -> tuple[float, ...]:
    normal = statistics.NormalDist()
    qs = [(i + 0.5) / n for i in range(n)]
    qs[-1] = (top - 0.5) / top
    return tuple(min(cap, max(1.0, median * math.exp(sigma * normal.inv_cdf(q)))) for q in qs)


WORKLOADS: dict[str, Workload] = {}


def _register(w: Workload) -> Workload:
    WORKLOADS[w.name] = w
    return w


# The 8B workloads. Prompt length, batch (256 prompts x 16 samples) and the 16k response
# cap are assumptions; the length distributions and EAGLE-3 acceptance profiles are fit
# (see docs/simulator.md) to the paper's generation times and k-sweep speedups.

# RL-Zero: GRPO from Qwen3-8B-Base on DAPO math prompts. A base model's responses are
# short but widely spread (4% reach the cap); the draft predicts them equally well at
# every depth.
RL_ZERO = _register(Workload(
    "rl-zero", prompts_per_step=256, generations_per_prompt=16, prompt_tokens=300,
    response_median_tokens=2700, response_sigma=1.03, max_response_tokens=16384,
    acceptance={
        "eagle3": Acceptance.constant(0.69),  # acceptance length 2.49 at k=3, 2.86 at k=5
        "ngram": Acceptance.from_length(2.47, 3),  # the paper's n-gram acceptance length
    },
))

# RL-Think: continued GRPO of the thinking Qwen3-8B. Long reasoning traces of similar
# length (median 7k tokens); drafts beyond the third token are rarely right.
RL_THINK = _register(Workload(
    "rl-think", prompts_per_step=256, generations_per_prompt=16, prompt_tokens=300,
    response_median_tokens=7000, response_sigma=0.26, max_response_tokens=16384,
    acceptance={
        "eagle3": Acceptance.decaying(0.595, 0.92),  # acceptance length 2.09 at k=3, 2.22 at k=5
        "ngram": Acceptance.from_length(2.05, 3),
    },
))

# The paper's async run (RL-Think, 12 generation + 4 training nodes): its batch is not
# given; 96 prompts x 16 samples puts the plain step near the reported 75 s.
RL_THINK_ASYNC = _register(dataclasses.replace(RL_THINK, name="rl-think-async", prompts_per_step=96))

# Large-scale reasoning RL for the 235B projection (512 prompts x 16 samples, 32k cap).
# The paper fixes only k = 3 and acceptance length 3; the length distribution (a quarter
# of the rollouts reach the cap) is fit with the MoE training MFU to its 512- and
# 2048-GPU points.
RL_235B = _register(Workload(
    "rl-235b", prompts_per_step=512, generations_per_prompt=16, prompt_tokens=300,
    response_median_tokens=12000, response_sigma=1.5, max_response_tokens=32768,
    acceptance={"eagle3": Acceptance.from_length(3.0, 3), "mtp": Acceptance.from_length(3.0, 3)},
))


def get_workload(name: str) -> Workload:
    key = name.lower()
    if key not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[key]
