"""Continuous batching: `generate(slots=S)` refills finished rows with waiting prompts.

The independent reference is one-prompt-at-a-time generation (a batch of one, the prompt's
global rollout id passed as `rows`): every draw is keyed by (key, rollout id, position), so
whatever slot or loop step a rollout ran in, its tokens must equal the reference token for
token (log-probs to float32 rounding, as in test_split_invariance), for plain decoding and
every drafter. The loop's iteration count is checked against a plain-Python simulation of
the slot schedule (each prompt takes its reference length in forwards under plain decoding).
"""

import heapq

import jax
import numpy as np
import pytest

from jaxspec.decoding import HistoryDrafter, SamplingConfig
from jaxspec.decoding.arguments import pad_prompts
from jaxspec.decoding.drafters import Eagle3Drafter, NGramDrafter
from jaxspec.decoding.engine import generate
from jaxspec.decoding.oracle import oracle_drafter
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head

MAX_NEW = 10
KEY = jax.random.key(7)
STOPS = (5, 9, 17, 33)
ROWS_OFFSET = 1000  # global rollout ids that are not batch positions
SAMPLING = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def setup():
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, policy.config.vocab_size, size=n).tolist() for n in (3, 7, 1, 5, 2, 6, 4)]
    tokens, lengths = pad_prompts(prompts)
    rows = ROWS_OFFSET + np.arange(len(prompts), dtype=np.int32)
    common = dict(sampling=SAMPLING, max_new_tokens=MAX_NEW, key=KEY, stop_tokens=STOPS)
    # The reference: each prompt alone (one compiled shape: [1, width] with its length).
    ref = [generate(policy, (tokens[i : i + 1], lengths[i : i + 1]), rows=rows[i : i + 1], **common)
           for i in range(len(prompts))]
    ref_tokens = np.concatenate([np.asarray(r.tokens) for r in ref])
    ref_lengths = np.concatenate([np.asarray(r.lengths) for r in ref])
    ref_logprobs = np.concatenate([np.asarray(r.logprobs) for r in ref])
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    drafters = {
        "none": None,
        "ngram": NGramDrafter(k=3, min_n=1, max_n=2),
        "eagle3": Eagle3Drafter(head, k=3),
        "oracle": oracle_drafter(tokens, lengths, ref_tokens, [0.9, 0.7, 0.5],
                                 vocab_size=policy.config.vocab_size),
    }
    return dict(policy=policy, prompts=prompts, rows=rows, common=common, drafters=drafters,
                ref=(ref_tokens, ref_lengths, ref_logprobs))


def test_reference_is_ragged_and_stops_early(setup):
    """The case exercises what refill must get right: ragged prompts, rows that stop at a
    stop token before the budget and rows that run to it."""
    ref_tokens, ref_lengths, _ = setup["ref"]
    assert len({len(p) for p in setup["prompts"]}) >= 5
    early = ref_lengths < MAX_NEW
    assert early.any() and (~early).any()
    for t, n in zip(ref_tokens[early], ref_lengths[early]):
        assert t[n - 1] in STOPS


CASES = [("none", 1), ("none", 3), ("none", None), ("ngram", 3), ("eagle3", 1), ("eagle3", 3),
         ("oracle", 3), ("oracle", None)]


@pytest.mark.parametrize("name,slots", CASES)
def test_refill_equals_one_prompt_at_a_time(setup, name, slots):
    ref_tokens, ref_lengths, ref_logprobs = setup["ref"]
    out = generate(setup["policy"], setup["prompts"], drafter=setup["drafters"][name],
                   rows=setup["rows"], slots=slots, **setup["common"])
    np.testing.assert_array_equal(np.asarray(out.lengths), ref_lengths)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref_tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref_logprobs, atol=1e-5)
    st = out.stats
    n = len(setup["prompts"])
    s = n if slots is None else slots
    np.testing.assert_array_equal(np.asarray(st.tokens_generated), ref_lengths)
    assert int(st.slot_steps) == int(st.target_forwards) * s
    assert int(st.prefill_forwards) == n - s  # each waiting prompt is prefilled once
    assert st.tokens_per_slot_step == pytest.approx(ref_lengths.sum() / (int(st.target_forwards) * s))
    assert st.wasted_row_steps == pytest.approx(1 - np.sum(st.row_steps) / (int(st.target_forwards) * s))
    if name == "oracle":  # drafts follow each prompt's own reference: most are accepted
        assert st.acceptance_length > 1.5


def test_rejection_with_sampled_drafts_equals_one_prompt_at_a_time(setup):
    """Rejection sampling draws its drafts and coins with keys of (rollout id, position): a
    refilled slot must draw its new rollout's, not the slot's earlier rollout's."""
    policy, prompts, rows = setup["policy"], setup["prompts"], setup["rows"]
    kw = dict(setup["common"], drafter=setup["drafters"]["eagle3"], method="rejection")
    tokens, lengths = pad_prompts(prompts)
    ref = [generate(policy, (tokens[i : i + 1], lengths[i : i + 1]), rows=rows[i : i + 1], **kw)
           for i in range(len(prompts))]
    out = generate(policy, prompts, rows=rows, slots=3, **kw)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.concatenate([r.lengths for r in ref]))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.concatenate([r.tokens for r in ref]))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.concatenate([r.logprobs for r in ref]),
                               atol=1e-5)


def _schedule(lengths, slots: int) -> int:
    """Loop iterations of plain decoding with refill, simulated: prompts start in order, each
    in the slot that frees first (a slot whose row ends at iteration t starts the next
    prompt at iteration t + 1), and a row of length n occupies n iterations."""
    free = [(0, s) for s in range(slots)]  # (first iteration the slot is free, slot)
    end = 0
    for n in lengths:
        t, s = heapq.heappop(free)
        heapq.heappush(free, (t + int(n), s))
        end = max(end, t + int(n))
    return end


@pytest.mark.parametrize("slots", [1, 3, None])
def test_plain_iterations_and_waste_match_the_schedule(setup, slots):
    ref_lengths = setup["ref"][1]
    out = generate(setup["policy"], setup["prompts"], rows=setup["rows"], slots=slots, **setup["common"])
    s = len(ref_lengths) if slots is None else slots
    iterations = _schedule(ref_lengths, s)
    st = out.stats
    assert int(st.target_forwards) == iterations
    np.testing.assert_array_equal(np.asarray(st.row_steps), ref_lengths)  # one token per forward
    assert st.wasted_row_steps == pytest.approx(1 - ref_lengths.sum() / (iterations * s))
    assert st.acceptance_length == 1.0
    if slots == 1:
        assert st.wasted_row_steps == 0.0


def test_bad_slots_fail_before_compiling(setup):
    policy, prompts = setup["policy"], setup["prompts"]
    for bad in (0, -2, 2.0, True, "3"):
        with pytest.raises(ValueError, match="slots must be an int >= 1"):
            generate(policy, prompts, max_new_tokens=4, key=KEY, slots=bad)
    history = HistoryDrafter.for_batch(np.arange(len(prompts) + 1) // 2, k=2, budget=2)
    with pytest.raises(ValueError, match=f"built for {len(prompts) + 1} prompts; generate got "
                                         f"{len(prompts)}"):
        generate(policy, prompts, drafter=history, max_new_tokens=4, key=KEY, slots=2)
    n = len(prompts)
    for bad in ([0] * n, list(range(n - 1)), np.arange(n) + 1, np.arange(n) * 1.0):
        with pytest.raises(ValueError, match="order must be a permutation"):
            generate(policy, prompts, max_new_tokens=4, key=KEY, slots=2, order=bad)


def test_refilled_rollouts_follow_the_policy_joint_law():
    """Chi-square: N rollouts of one prompt (distinct rollout ids), 2 tokens each, decoded
    speculatively (n-gram drafts) in 16 refilled slots. Their (y0, y1) counts must follow
    P(y0, y1) = p(y0 | prompt) p(y1 | prompt, y0), computed in float64 from full forwards of
    the policy. A rollout keyed by its slot instead of its id would repeat the slot's earlier
    rollouts and fail. Level 1e-5: the false-failure probability of this test (on top of
    the 1e-4 of the suite's other law tests, jaxspec.testing.laws.ALPHA)."""
    from jaxspec.models.transformer import random_policy
    from jaxspec.testing.laws import law_test, processed_probs

    vocab, n, prompt = 6, 4096, [1, 2, 1]
    policy = random_policy(ModelConfig.tiny("qwen3", vocab_size=vocab, num_layers=1,
                                            max_position_embeddings=16), seed=5)
    out = generate(policy, [prompt] * n, drafter=NGramDrafter(k=2, min_n=1, max_n=1),
                   sampling=SAMPLING, max_new_tokens=2, key=jax.random.key(9), slots=16)
    assert int(out.stats.prefill_forwards) == n - 16
    y = np.asarray(out.tokens)
    counts = np.bincount(y[:, 0] * vocab + y[:, 1], minlength=vocab * vocab)
    seqs = np.array([prompt + [a] for a in range(vocab)], np.int32)
    logits, _, _ = policy.forward(seqs, np.broadcast_to(np.arange(4), seqs.shape))
    logits = np.asarray(logits, np.float64)
    p0 = processed_probs(logits[0, 2], 1.0, 0, 1.0)  # after the prompt
    p1 = processed_probs(logits[:, 3], 1.0, 0, 1.0)  # [y0, y1]
    law = (p0[:, None] * p1).reshape(-1)
    p_value, statistic, outside = law_test(counts, law)
    assert outside == 0 and p_value >= 1e-5, (p_value, statistic)


def test_config_rollout_slots():
    import pathlib

    from jaxspec.config import ConfigError, load_config

    tiny = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    assert load_config(tiny, ["rollout.slots=4"]).rollout.slots == 4
    assert load_config(tiny, []).rollout.slots is None
    with pytest.raises(ConfigError, match="rollout.slots.*out of range"):
        load_config(tiny, ["rollout.slots=0"])
    assert load_config(tiny, ["draft.kind=history", "rollout.slots=4"]).rollout.slots == 4
