"""The block model's training: its batched-anchor forward equals what the drafter computes
at inference (context cache + one block), and the update (its own optimizer, stop-gradient
features) learns: the loss falls and the trained drafter's acceptance rises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import BlockDrafter, SamplingConfig, generate
from jaxspec.models import ModelConfig
from jaxspec.models.block import BlockHead
from jaxspec.models.transformer import random_policy
from jaxspec.rl.block_train import BlockLossConfig, _anchors, block_hidden, block_update
from jaxspec.rl.steps import make_optimizer, score_rollouts
from jaxspec.config import OptimSpec

SAMPLING = SamplingConfig(0.5)


def _setup():
    policy = random_policy(ModelConfig.tiny("qwen3", vocab_size=24, num_layers=3), seed=1)
    head = BlockHead.init_for(policy, jax.random.key(2), block_size=4, num_layers=1,
                              capture_layers=(0, 1, 2), markov_rank=8, confidence=True)
    return policy, head


def test_training_forward_equals_the_drafters_inference():
    policy, head = _setup()
    head = BlockHead(head.config, head.graphdef, jax.tree.map(
        lambda x: x + 0.05 * jnp.ones_like(x), head.params))  # Markov weights non-zero too
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 23, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    _, captured, _ = policy.forward(tokens, positions, capture=head.capture_layers)
    features = jnp.concatenate([captured[i] for i in head.capture_layers], -1)
    anchors = jnp.array([[3, 7, 8], [5, 1, 10]], jnp.int32)
    trained = block_hidden(head, head.params, policy.embed, features, tokens, positions, anchors)
    drafter = BlockDrafter(head)
    for row in range(2):
        for n, a in enumerate(np.asarray(anchors[row])):
            cache = head.context(features[row:row + 1, :a], positions[row:row + 1, :a],
                                 head.init_cache(1, 16))
            block = jnp.concatenate([tokens[row:row + 1, a:a + 1],
                                     jnp.full((1, 3), head.config.mask_token_id, jnp.int32)], 1)
            inferred = head.block(policy.embed(block), a + jnp.arange(4)[None], cache)
            np.testing.assert_allclose(np.asarray(trained[row, n]), np.asarray(inferred[0]),
                                       rtol=2e-4, atol=2e-4)
    assert drafter.k == 3


def test_anchors_lie_where_a_response_token_follows():
    response = jnp.array([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]], bool)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    anchors, real = _anchors(response, tokens, 3)
    a, r = np.asarray(anchors), np.asarray(real)
    assert set(a[0]) <= {1, 2, 3, 4} and r[0].all() and len(set(a[0])) == 3
    assert set(a[1][r[1]]) <= {0, 1} and r[1].tolist() == [True, True, False]


def test_updates_learn_and_the_trained_drafter_is_accepted_more():
    policy, head = _setup()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 1]] * 4
    out = generate(policy, prompts, sampling=SAMPLING, max_new_tokens=20, key=jax.random.key(4))
    width = max(len(p) for p in prompts)
    prompt_arr = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
    scored = score_rollouts(policy, None, prompt_arr, np.array([len(p) for p in prompts], np.int32),
                            out.tokens, out.lengths, out.logprobs, SAMPLING, capture=head.capture_layers)
    optimizer = make_optimizer(OptimSpec(lr=3e-3))
    opt_state = optimizer.init(head.params)
    cfg = BlockLossConfig(anchors=8, tv=0.5)
    before = generate(policy, prompts[:4], drafter=BlockDrafter(head), sampling=SAMPLING,
                      max_new_tokens=20, key=jax.random.key(9))
    losses = []
    for _ in range(40):
        head, opt_state, metrics = block_update(head, opt_state, policy, scored, optimizer=optimizer,
                                                loss_cfg=cfg)
        losses.append(float(metrics["draft_loss"]))
        assert float(metrics["finite_loss"]) == 1.0
    assert losses[-1] < 0.7 * losses[0], losses
    after = generate(policy, prompts[:4], drafter=BlockDrafter(head), sampling=SAMPLING,
                     max_new_tokens=20, key=jax.random.key(9))
    np.testing.assert_array_equal(np.asarray(after.tokens), np.asarray(before.tokens))  # lossless
    assert after.stats.acceptance_length > before.stats.acceptance_length + 0.2
    assert "draft_conf_bce" in metrics and "draft_tv_2" in metrics


def test_config_names_a_k_past_the_block():
    import pytest

    from jaxspec.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["draft.kind=block", "draft.k=5", "draft.block.size=4"])
    assert e.value.key == "draft.k" and "draft.block.size=4" in str(e.value) and "[1, 3]" in str(e.value)
    cfg = load_config(None, ["draft.kind=hybrid_block", "draft.k=3", "draft.block.size=8",
                             "draft.block.markov_rank=16", "draft.block.confidence=true"])
    assert cfg.draft.block.markov_rank == 16 and cfg.draft.kind == "hybrid_block"


def test_config_turns_the_confidence_length_on_with_adaptive_k():
    """draft.block.confidence_length (default true) reaches the drafter only with
    draft.adaptive_k: without it no k is chosen, so no estimate is computed."""
    from jaxspec.config import load_config
    from jaxspec.rl import kinds

    _, head = _setup()
    base = ["draft.kind=block", "draft.k=3", "draft.block.size=4", "draft.block.confidence=true"]
    for extra, on in ((["draft.adaptive_k=true"], True), ([], False),
                      (["draft.adaptive_k=true", "draft.block.confidence_length=false"], False)):
        d = load_config(None, base + extra).draft
        drafter = kinds.KINDS["block"].make_drafter(d, None, head=head)
        assert drafter.confidence_length is on and drafter.estimates_acceptance is on, extra
        assert (drafter.acceptance_estimate(drafter.init_state(None, 1, 8)) is None) is not on
