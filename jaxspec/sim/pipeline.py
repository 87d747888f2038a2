"""One RL step on a cluster: data, setup (weight refit), generation, logprob, training.

Synchronous RL (`policy_lag == 0`): every GPU generates, then every GPU runs logprob
and training; the stages add up.

Asynchronous RL (`policy_lag >= 1`): a generation group and a training group run side
by side; rollouts are made with weights up to `policy_lag` steps old, so generating the
next batch overlaps logprob + training of this one. The generation group still stops
once a step to load new weights (refit). The period is the slower side; generation
beyond the training side is *exposed*. With deterministic stage times any lag >= 1
already reaches this steady state (lag 1 needs period >= (generation + refit +
training) / 2, which the max always meets); a larger lag only absorbs step-to-step
variance, which this model does not have.
"""

from __future__ import annotations

import dataclasses

from jaxspec.sim.acceptance import Acceptance
from jaxspec.sim.assumptions import DEFAULT, Assumptions
from jaxspec.sim.engine import Drafter, EngineLayout, StepCost, engine_concurrency, generation_time
from jaxspec.sim.hardware import Cluster
from jaxspec.sim.models import ModelShape
from jaxspec.sim.workloads import Workload

__all__ = ["Scenario", "StepResult", "Comparison", "SweepRow", "simulate_step", "compare", "k_sweep"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Everything one simulated RL step depends on."""

    model: ModelShape
    cluster: Cluster
    workload: Workload
    drafter: Drafter = Drafter()
    acceptance: Acceptance | None = None  # None: the workload's profile for this drafter kind
    tp: int | None = None  # GPUs per generation engine; None: the smallest that fits
    policy_lag: int = 0  # 0: synchronous RL
    generation_gpus: int | None = None  # async only; None: the split that minimises the period
    assumptions: Assumptions = DEFAULT
    verify_decode_cost_ratio: float | None = None  # measured override, see jaxspec.sim.calibrate
    measured_k: int = 3  # draft length at which verify_decode_cost_ratio was measured

    def __post_init__(self):
        if self.policy_lag < 0:
            raise ValueError(f"policy_lag must be >= 0, got {self.policy_lag}")
        if self.policy_lag == 0 and self.generation_gpus is not None:
            raise ValueError("generation_gpus is for async RL (policy_lag >= 1); sync RL generates on every GPU")

    def with_k(self, k: int) -> "Scenario":
        """The same scenario with draft length k (same drafter, same acceptance profile)."""
        return dataclasses.replace(self, drafter=dataclasses.replace(self.drafter, k=k))

    def plain(self) -> "Scenario":
        """The same step without speculation."""
        return dataclasses.replace(self, drafter=Drafter(), acceptance=None)

    @property
    def acceptance_profile(self) -> Acceptance | None:
        if not self.drafter.speculative:
            return None
        return self.acceptance or self.workload.acceptance_for(self.drafter.kind)

    @property
    def acceptance_length(self) -> float:
        """Expected tokens per target forward (1 for plain decoding)."""
        profile = self.acceptance_profile
        return 1.0 if profile is None else profile.length(self.drafter.k)

    @property
    def engine_tp(self) -> int:
        return self.tp or EngineLayout.default_tp(self.model, self.cluster.gpu, self.assumptions)

    def step_cost(self) -> StepCost:
        layout = EngineLayout(self.cluster.gpu, self.engine_tp)
        return StepCost(self.model, layout, self.drafter, self.assumptions, self.verify_decode_cost_ratio,
                        self.measured_k)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Seconds per stage of one RL step, and the generation layout that produced them."""

    scenario: Scenario
    data_s: float
    setup_s: float  # weight refit of the generation engines
    generation_s: float
    logprob_s: float
    training_s: float
    step_s: float  # sync: the sum of the stages; async: the pipeline period
    exposed_generation_s: float  # generation (+ refit, async) on the critical path
    generation_gpus: int
    engines: int
    rollouts_per_engine: int
    concurrency: int  # sequences an engine runs at once
    acceptance_length: float

    @property
    def generation_share(self) -> float:
        return self.exposed_generation_s / self.step_s


def _generation(s: Scenario, gpus: int) -> tuple[float, int, int, int]:
    """(seconds, engines, rollouts per engine, concurrency) to generate one batch on `gpus` GPUs."""
    w = s.workload
    tp = s.engine_tp
    if gpus < tp:
        raise ValueError(f"{gpus} generation GPUs cannot hold one {s.model.name} engine of tp={tp}")
    engines = gpus // tp
    per_engine = -(-w.rollouts // engines)  # the fullest engine sets the pace
    cost = s.step_cost()
    mean_response, _ = w.moments()
    concurrency = engine_concurrency(cost.layout, s.model, s.drafter.shape(s.model), s.assumptions,
                                     rollouts=per_engine, mean_sequence_tokens=w.prompt_tokens + mean_response)
    lengths = w.response_lengths(per_engine, total=w.rollouts)
    seconds = generation_time(cost, lengths, prompt_tokens=w.prompt_tokens, tokens_per_step=s.acceptance_length,
                              concurrency=concurrency)
    return seconds, engines, per_engine, concurrency


def _train_side(s: Scenario, gpus: int) -> tuple[float, float]:
    """(logprob seconds, training seconds) for one batch on `gpus` GPUs, from FLOPs and MFU."""
    a, w, m = s.assumptions, s.workload, s.model
    mean_response, mean_sq = w.moments()
    tokens = w.rollouts * (w.prompt_tokens + mean_response)
    # one forward over every rollout: matmuls + causal attention (S^2 / 2 query-key pairs)
    forward = 2.0 * m.active_params * tokens + m.attention_flops(1, 0.5 * mean_sq * w.rollouts)
    mfu = a.train_mfu_moe if m.is_moe else a.train_mfu_dense
    rate = gpus * s.cluster.gpu.peak_bf16_flops * mfu
    return a.logprob_forwards * forward / rate, a.train_flops_per_token_factor * forward / rate


def _refit(s: Scenario, *, across_network: bool) -> float:
    """Load the new policy weights into the generation engines (NVLink when colocated,
    the network when generation runs on its own GPUs)."""
    a, gpu = s.assumptions, s.cluster.gpu
    per_gpu = s.model.total_params * s.model.bytes_per_param / s.engine_tp
    draft = s.drafter.shape(s.model)
    if draft is not None:  # an EAGLE-3 / MTP head or draft model trained alongside is refit too
        per_gpu += draft.total_params * draft.bytes_per_param / s.engine_tp
    bw = gpu.scaleout_bandwidth if across_network else gpu.nvlink_bandwidth
    return a.setup_fixed_s + per_gpu / (bw * a.link_efficiency)


def _best_split(s: Scenario) -> int:
    """Generation GPUs (whole units of max(node, engine)) that minimise the async period.

    Generation time falls and training time rises with the generation share, so the
    best split sits where they cross; bisect for it, then keep the better neighbour.
    """
    n = s.cluster.num_gpus
    unit = max(s.cluster.gpu.gpus_per_node, s.engine_tp)
    units = n // unit
    if units < 2:
        raise ValueError(f"{n} GPUs cannot be split into a generation and a training group of >= {unit} GPUs")
    refit = _refit(s, across_network=True)

    def sides(u: int) -> tuple[float, float]:
        return _generation(s, u * unit)[0] + refit, sum(_train_side(s, n - u * unit)) + s.assumptions.data_s

    lo, hi = 1, units - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        gen, train = sides(mid)
        if gen > train:
            lo = mid
        else:
            hi = mid
    return unit * min((lo, hi), key=lambda u: max(sides(u)))


def simulate_step(s: Scenario) -> StepResult:
    """Stage times of one RL step for scenario `s`."""
    a, n = s.assumptions, s.cluster.num_gpus
    if s.policy_lag == 0:
        gen, engines, per_engine, conc = _generation(s, n)
        logprob, train = _train_side(s, n)
        setup = _refit(s, across_network=False)
        step = a.data_s + setup + gen + logprob + train
        return StepResult(s, a.data_s, setup, gen, logprob, train, step, gen, n, engines, per_engine, conc,
                          s.acceptance_length)
    g = s.generation_gpus if s.generation_gpus is not None else _best_split(s)
    if not 0 < g < n:
        raise ValueError(f"generation_gpus must be in (0, {n}), got {g}")
    gen, engines, per_engine, conc = _generation(s, g)
    logprob, train = _train_side(s, n - g)
    refit = _refit(s, across_network=True)
    train_side = a.data_s + logprob + train
    period = max(gen + refit, train_side)
    exposed = max(0.0, gen + refit - train_side)
    return StepResult(s, a.data_s, refit, gen, logprob, train, period, exposed, g, engines, per_engine, conc,
                      s.acceptance_length)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A speculative step against its baseline.

    `generation_baseline_s` is plain generation on the speculative run's generation GPUs
    (for sync RL, all GPUs), so the generation speedup compares the same hardware even
    when the baseline's async split differs.
    """

    baseline: StepResult
    spec: StepResult
    generation_baseline_s: float

    @property
    def generation_speedup(self) -> float:
        return self.generation_baseline_s / self.spec.generation_s

    @property
    def step_speedup(self) -> float:
        return self.baseline.step_s / self.spec.step_s


def compare(s: Scenario, baseline: Scenario | None = None) -> Comparison:
    """Speculative scenario `s` against `baseline` (default: the same step with plain
    decoding; for async RL without a fixed split, plain decoding at its own best split)."""
    spec = simulate_step(s)
    base = simulate_step(baseline if baseline is not None else s.plain())
    generation = base.generation_s
    if base.generation_gpus != spec.generation_gpus:
        generation = _generation(s.plain(), spec.generation_gpus)[0]
    return Comparison(base, spec, generation)


@dataclasses.dataclass(frozen=True)
class SweepRow:
    k: int
    acceptance_length: float
    verify_over_decode: float  # verify cost / decode cost at the engine's typical batch
    draft_over_decode: float  # draft cost / decode cost at the same batch
    verify_tokens: int  # tokens the target feeds per verify at that batch (B * (k + 1), or B * (N + 1))
    generation_gpus: int
    generation_s: float
    generation_speedup: float
    step_speedup: float

    @property
    def step_cost_over_decode(self) -> float:
        return self.verify_over_decode + self.draft_over_decode


def k_sweep(s: Scenario, ks=range(1, 8), baseline: Scenario | None = None) -> list[SweepRow]:
    """Speedups of `s`'s drafter at each draft length in `ks`, same acceptance profile.

    Cost ratios are taken at the engine's typical batch: full concurrency, contexts at
    the prompt plus half the mean response.
    """
    if not s.drafter.speculative:
        raise ValueError("k_sweep needs a speculative drafter (eagle3, mtp, draft_model, ngram)")
    mean_response, _ = s.workload.moments()
    rows = []
    for k in ks:
        sk = s.with_k(k)
        c = compare(sk, baseline)
        cost = sk.step_cost()
        n = c.spec.concurrency
        ctx = n * (s.workload.prompt_tokens + 0.5 * mean_response)
        decode = cost.decode(n, ctx)
        rows.append(SweepRow(
            k, sk.acceptance_length, cost.verify(n, ctx) / decode, cost.draft(n, ctx) / decode,
            n * (sk.drafter.verified_tokens + 1), c.spec.generation_gpus, c.spec.generation_s,
            c.generation_speedup, c.step_speedup,
        ))
    return rows
