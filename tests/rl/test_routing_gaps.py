"""An MoE run's routing record: a fed rollout token whose route record is missing (-1) is
counted as a gap (moe/routing_gaps), not silently left out of moe/routing_mismatch, and the
step line shows both."""

import jax
import numpy as np
import pytest

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.metrics import format_step_line
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.rl.rollouts import route_gaps


def _gaps_by_hand(routes, lengths):  # a loop over every token of every row
    count = 0
    for b in range(routes.shape[0]):
        for t in range(int(lengths[b]) - 1):  # fed: every generated token but the last
            if (routes[b, t] < 0).any():
                count += 1
    return count


@pytest.fixture(scope="module")
def generated():
    from jaxspec.decoding.engine import generate

    cfg = ModelConfig.tiny("qwen3_moe", num_layers=2, hidden_size=32, num_heads=2,
                           num_kv_heads=1, head_dim=16, moe_intermediate_size=16)
    policy = random_policy(cfg, seed=4)
    prompts = np.array([[5, 9, 13], [77, 3, 1], [8, 8, 2]], np.int32)
    out = generate(policy, prompts.tolist(), sampling=SamplingConfig(1.0), max_new_tokens=10,
                   key=jax.random.key(2))
    return policy, prompts, out


@pytest.mark.quick
def test_an_erased_route_record_is_a_gap_not_a_match(generated):
    from jaxspec.rl.steps import routing_mismatch_of

    policy, prompts, out = generated
    routes, lengths = np.array(out.routes), np.asarray(out.lengths)
    assert route_gaps(routes, lengths) == _gaps_by_hand(routes, lengths) == 0
    b = int(np.argmax(lengths))
    n = int(lengths[b])
    assert n >= 3
    erased = routes.copy()
    erased[b, 1, 0] = -1  # one layer of a fed token's record lost
    erased[b, 0] = -1  # and a whole fed token's
    erased[b, n - 1:] = -1  # the last token and past the end: never fed, not gaps
    assert route_gaps(erased, lengths) == _gaps_by_hand(erased, lengths) == 2
    # the mismatch itself leaves the wholly erased token out: it would read as a match
    args = (policy, prompts, np.array([3, 3, 3]), out.tokens, out.lengths)
    full = routing_mismatch_of(*args, routes)
    wholly = routes.copy()
    wholly[b, 0] = -1
    missing = routing_mismatch_of(*args, wholly)
    assert float(full[0]) == float(missing[0]) == 0.0
    assert int(missing[1]) == int(full[1]) - 1


@pytest.mark.quick
def test_the_step_line_shows_routing_mismatch_and_gaps():
    row = {"reward": 0.5, "acceptance_length": 1.8, "moe/routing_mismatch": 0.0125,
           "moe/routing_gaps": 3, "time/step": 2.0, "time/generation": 1.0,
           "share/generation": 0.5, "time/training": 1.0, "share/training": 0.5}
    line = format_step_line(4, row, total_steps=40)
    assert " | route_diff 0.013 | route_gaps 3 | " in line, line
    row["moe/routing_gaps"] = 0
    assert "route_gaps" not in format_step_line(4, row, total_steps=40)
