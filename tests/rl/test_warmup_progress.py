"""The supervised warm-up in chunks (so it can print progress lines): the same training as
one scan over every step, the same compiled program for every chunk."""

import jax
import numpy as np
import pytest

from jaxspec.models import ModelConfig, Policy
from jaxspec.rl import warmup
from jaxspec.rl.tasks import CountingTask


@pytest.mark.parametrize("steps,most,expected", [(180, 5, 5), (97, 5, 1), (6, 4, 3),
                                                 (4, 10, 4), (1, 5, 1)])
def test_chunk_length_divides_the_steps(steps, most, expected):
    assert warmup._chunk_steps(steps, most) == expected


def test_chunked_warmup_equals_one_scan_and_reports_each_chunk():
    task = CountingTask(seed=0, max_count=6)  # long-tailed lengths: packed rows
    tok = task.tokenizer
    steps, batch = 6, 8
    tokens, mask = warmup.encode_pairs(tok, task.supervised_examples(steps * batch, seed=1))
    policy = Policy.init(ModelConfig.tiny(vocab_size=tok.vocab_size), jax.random.key(0))
    whole, whole_losses = warmup.supervised_warmup(policy, tokens, mask, steps=steps,
                                                   batch_size=batch, lr=3e-3, chunk=steps)
    calls = []
    warmup._warmup_scan.clear_cache()
    parts, part_losses = warmup.supervised_warmup(
        policy, tokens, mask, steps=steps, batch_size=batch, lr=3e-3, chunk=4,
        progress=lambda done, loss: calls.append((done, loss.tolist())))
    assert warmup._warmup_scan._cache_size() == 1  # chunks of 3 steps: one program
    assert [done for done, _ in calls] == [3, 6]
    np.testing.assert_allclose(part_losses, whole_losses, rtol=1e-5)
    np.testing.assert_allclose([x for _, chunk in calls for x in chunk], part_losses)
    assert part_losses[-1] < part_losses[0]  # it trains
    for a, b in zip(jax.tree.leaves(parts.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
