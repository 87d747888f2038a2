"""A rollout depends on (key, rollout id) only: not on the batch it shares, its slot, or the
loop step that drafts it.

Every draw (drafts for `rejection`, acceptance coins, residual and replay noise) is keyed by
(key, rollout id, absolute position, tag). So generating a batch in one call or split over
several calls with `rows=` gives the same rollouts token for token, and rows with different
ids are independent samples.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decoding import SamplingConfig, process_logits
from jaxspec.decoding.drafters import (
    DraftContext, Eagle3Drafter, NGramDrafter, TreeSpec,
)
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head

PROMPTS = [[5, 9, 13, 5, 9, 13, 5], [77, 3], [40, 41, 42, 43, 40, 41], [8, 8, 8], [1, 2, 3, 1], [60]]
MAX_NEW = 8
KEY = jax.random.key(21)
# One call over all rows vs two calls over an uneven, shuffled split of the same rows.
SPLIT = ([4, 0, 2], [5, 1, 3])
# The parts' prompts are right-padded to a width the one call (7) does not have, the same
# for both parts: one compiled program serves both.
PART_WIDTH = 9


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))


@pytest.fixture(scope="module")
def drafters(policy):
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1))
    return {
        "ngram": NGramDrafter(k=3, min_n=1, max_n=2),
        "eagle3_chain": Eagle3Drafter(head, k=3),
        "eagle3_tree": Eagle3Drafter(head, tree=TreeSpec(top_k=3, depth=3, budget=7)),
    }


def _padded(prompts, width):
    """(tokens [B, width] right-padded with 0, lengths [B])."""
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in zip(tokens, prompts):
        row[: len(prompt)] = prompt
    return tokens, np.array([len(p) for p in prompts], np.int32)


def _split_vs_one(policy, drafter, method, temperature):
    cfg = SamplingConfig(temperature=temperature)
    kw = dict(drafter=drafter, method=method, sampling=cfg, max_new_tokens=MAX_NEW, key=KEY)
    one = generate(policy, PROMPTS, **kw)
    parts = [generate(policy, _padded([PROMPTS[i] for i in ids], PART_WIDTH), rows=np.asarray(ids), **kw)
             for ids in SPLIT]
    tokens = np.zeros_like(np.asarray(one.tokens))
    logprobs = np.zeros_like(np.asarray(one.logprobs))
    for ids, part in zip(SPLIT, parts):
        tokens[ids], logprobs[ids] = np.asarray(part.tokens), np.asarray(part.logprobs)
    return one, tokens, logprobs


# Greedy (no noise, a model-free chain); replay walks a tree with position-keyed noise;
# rejection samples drafts through `DraftContext.draft_keys`, which every sampling drafter
# shares (tests/decoding/test_engine.py covers speculative == plain for each drafter).
CASES = [("greedy", "ngram", 0.0), ("replay", "eagle3_tree", 1.0),
         ("rejection", "eagle3_chain", 1.0)]


@pytest.mark.parametrize("method,name,temperature", CASES)
def test_split_equals_one_call(policy, drafters, method, name, temperature):
    one, tokens, logprobs = _split_vs_one(policy, drafters[name], method, temperature)
    np.testing.assert_array_equal(tokens, one.tokens)
    np.testing.assert_allclose(logprobs, one.logprobs, atol=1e-5)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _BatchKeyed(Eagle3Drafter):
    """Negative control: a drafter whose draft noise is keyed by batch index (jax.random
    categorical over the [batch, V] logits with one key per draft depth), as before the fix.
    A subclass, so it implements the Drafter protocol as the drafter it wraps does (Python
    3.12's isinstance checks of a protocol do not see attributes forwarded by __getattr__)."""

    @classmethod
    def of(cls, drafter: Eagle3Drafter) -> "_BatchKeyed":
        return cls(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)})

    def propose(self, state, policy, ctx):
        return super().propose(state, policy, _BatchKeyedContext(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}))


@dataclasses.dataclass(frozen=True)
class _BatchKeyedContext(DraftContext):
    def draft_keys(self, offset, tag=0):
        return jax.random.split(jax.random.fold_in(self.key, offset), self.lengths.shape[0])


def test_batch_index_keying_fails_the_split_test(policy, drafters):
    one, tokens, _ = _split_vs_one(policy, _BatchKeyed.of(drafters["eagle3_chain"]), "rejection", 1.0)
    assert not np.array_equal(tokens, one.tokens)


@pytest.mark.parametrize("name", ["eagle3_chain"])
def test_rows_of_different_ids_are_independent(policy, drafters, name):
    """Two calls with the same key and prompt over disjoint rows: the first tokens of row i
    of call 1 and row i of call 2 agree with probability c = sum_v p(v)^2 (p: the policy's
    distribution after the prompt, computed here by a plain forward) if the rows are
    independent. Matches M ~ Binomial(n, c); the test fails when P(Binomial >= M) < 1e-6,
    its false-failure rate. With batch-index keyed drafts (the negative control below) the
    two calls draw the same drafts and M is close to n."""
    n, prompt = 128, [7, 21, 3]
    drafter = drafters[name]
    logits, _, _ = policy.forward(jnp.asarray([prompt]), jnp.arange(3)[None])
    p = np.exp(np.asarray(process_logits(logits[0, -1], SamplingConfig(temperature=1.0)), np.float64))
    c = float(np.sum(p**2))

    def first_tokens(drafter, rows):
        r = generate(policy, [prompt] * n, drafter=drafter, method="rejection", sampling=SamplingConfig(),
                     max_new_tokens=4, key=KEY, rows=rows)
        return np.asarray(r.tokens[:, 0])

    def tail(d):
        matches = int(np.sum(first_tokens(d, np.arange(n)) == first_tokens(d, np.arange(n, 2 * n))))
        return matches, stats.binom.sf(matches - 1, n, c)

    matches, p_value = tail(drafter)
    assert p_value >= 1e-6, f"{matches} of {n} first tokens equal; independent rows expect {n * c:.1f}"
    if name == "eagle3_chain":  # the negative control must be caught by the same test
        bad_matches, bad_p = tail(_BatchKeyed.of(drafter))
        assert bad_p < 1e-6, (bad_matches, n * c)
