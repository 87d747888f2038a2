"""SamplingConfig, process_logits against a float64 reference, position-keyed sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig, process_logits, sample
from jaxspec.testing.laws import ALPHA, law_test, processed_probs

SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 3, 0.9),
    (1.3, 1, 1.0),
    (1.0, 0, 0.5),
    (0.5, 2, 0.99),
    (2.0, 50, 0.3),
    (1.0, 0, 1e-6),
    (0.0, 0, 1.0),
    (0.0, 5, 0.2),
    (1e-3, 0, 0.9),
    (1e-30, 4, 0.9),
]


def _logits(vocab, rows=6, seed=0):
    rng = np.random.default_rng(seed + vocab)
    x = (rng.normal(size=(rows, vocab)) * 2).astype(np.float32)
    x[0] = np.round(x[0])  # ties
    if vocab > 3:
        x[1, :2] = -np.inf  # masked entries (a padded vocabulary tile, say)
    return x


@pytest.mark.parametrize("vocab", [1, 2, 5, 64, 65, 300])  # both sides of the pairwise/bisection switch
def test_process_logits_matches_float64_reference(vocab):
    logits = _logits(vocab)
    process = jax.jit(process_logits)
    for setting in SETTINGS:
        expected = processed_probs(logits, *setting)
        got = np.exp(np.asarray(process(jnp.asarray(logits), SamplingConfig(*setting)), np.float64))
        np.testing.assert_array_equal(got > 0, expected > 0, err_msg=f"support, {setting}")
        np.testing.assert_allclose(got, expected, atol=2e-6, err_msg=f"{setting}")


def test_unused_filters_compile_away_with_the_same_draws():
    """`without_unused_filters` (what `generate` compiles with): where top-k and top-p are off
    the program holds no filter (one conditional fewer) and draws the same tokens and
    log-probs, bit for bit, as the program with the traced filters; both against the float64
    definition. Any filter on, or values only known inside a trace: the config unchanged."""
    logits = jnp.asarray(_logits(300))  # the bisection path: the largest filter program
    draw = lambda cfg: jax.jit(sample).lower(jax.random.key(3), logits, cfg, jnp.arange(6)).compile()
    for temperature in (1.0, 0.6, 0.0):
        traced = SamplingConfig(temperature)
        unfiltered = traced.without_unused_filters()
        assert type(unfiltered) is not SamplingConfig and isinstance(unfiltered, SamplingConfig)
        # a structure of its own (jax 0.10 compares dataclass structures by static fields only)
        assert jax.tree.structure(unfiltered) != jax.tree.structure(traced)
        programs = [draw(cfg) for cfg in (traced, unfiltered)]
        counts = [p.as_text().count(" conditional(") for p in programs]
        assert counts[1] == counts[0] - 1, counts
        (tok_a, lp_a), (tok_b, lp_b) = (
            p(jax.random.key(3), logits, cfg, jnp.arange(6)) for p, cfg in zip(programs, (traced, unfiltered)))
        np.testing.assert_array_equal(tok_a, tok_b)
        np.testing.assert_array_equal(lp_a, lp_b)
        np.testing.assert_allclose(np.exp(np.asarray(process_logits(logits, unfiltered), np.float64)),
                                   processed_probs(np.asarray(logits), temperature, 0, 1.0), atol=2e-6)
    for on in (SamplingConfig(1.0, 3, 1.0), SamplingConfig(1.0, 0, 0.9), SamplingConfig(0.0, 1, 0.5)):
        assert on.without_unused_filters() is on
    kinds = []
    jax.jit(lambda cfg: kinds.append(type(cfg.without_unused_filters())))(SamplingConfig(1.0))
    assert kinds == [SamplingConfig]  # traced values: not known to be off
    unfiltered = SamplingConfig(1.0).without_unused_filters()
    with pytest.raises(ValueError, match=r"top_k 0 and top_p 1.0; got top_k=0, top_p=0.5"):
        type(unfiltered)(1.0, 0, 0.5)


def test_process_logits_large_vocabulary_top_k_top_p():
    # A real vocabulary size, bisection path: exact top-k count, top-p mass just over top_p.
    logits = jax.random.normal(jax.random.key(0), (3, 151_936)) * 3
    logp = process_logits(logits, SamplingConfig(0.8, 1000, 0.6))
    kept = np.asarray(jnp.isfinite(logp))
    probs = np.asarray(jnp.exp(logp))
    assert np.all(kept.sum(1) <= 1000)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    ref = processed_probs(np.asarray(logits), 0.8, 1000, 0.6)
    np.testing.assert_array_equal(kept, ref > 0)
    np.testing.assert_allclose(probs, ref, atol=1e-6)


def test_never_masks_every_token_and_no_nan_from_bf16():
    big = jnp.array([[3e38, -3e38, 0.0, 1.0], [-jnp.inf, -jnp.inf, 5.0, -jnp.inf]], jnp.bfloat16)
    for setting in [(1.0, 0, 1.0), (1e-6, 1, 1e-6), (0.0, 0, 1.0), (50.0, 2, 0.5)]:
        logp = process_logits(big, SamplingConfig(*setting))
        assert logp.dtype == jnp.float32
        assert not np.any(np.isnan(np.asarray(logp)))
        assert np.all(np.isfinite(np.asarray(logp)).sum(-1) >= 1)
        np.testing.assert_allclose(np.exp(np.asarray(logp)).sum(-1), 1.0, rtol=1e-6)


def test_greedy_is_the_argmax_point_mass():
    logits = jnp.asarray(_logits(37, rows=8))
    logp = process_logits(logits, SamplingConfig.greedy())
    np.testing.assert_array_equal(np.asarray(logp == 0).argmax(-1), np.asarray(logits).argmax(-1))
    assert np.all(np.isfinite(np.asarray(logp)).sum(-1) == 1)
    tokens, token_logp = jax.jit(sample)(jax.random.key(1), logits, SamplingConfig(0.0), jnp.arange(8))
    np.testing.assert_array_equal(tokens, np.asarray(logits).argmax(-1))
    # The reported log-prob at T = 0 is the unscaled softmax's (docs/training.md, "Temperature
    # 0"), as the trainer scores it: against a float64 NumPy log-softmax.
    x = np.asarray(logits, np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(token_logp, ref[np.arange(8), tokens], rtol=0, atol=2e-6)
    assert np.all(np.asarray(token_logp) < 0)  # not the point mass's log p = 0


def test_settings_are_traced_a_new_temperature_does_not_recompile():
    traces = []

    @jax.jit
    def draw(key, logits, cfg):
        traces.append(1)
        return sample(key, logits, cfg, jnp.arange(logits.shape[0]))

    logits = jnp.asarray(_logits(16))
    results = [draw(jax.random.key(0), logits, SamplingConfig(*s)) for s in SETTINGS]
    assert len(traces) == 1 and draw._cache_size() == 1
    np.testing.assert_array_equal(results[SETTINGS.index((0.0, 0, 1.0))][0], np.asarray(logits).argmax(-1))


def test_sample_noise_depends_only_on_key_row_position():
    draw = jax.jit(sample)
    key = jax.random.key(7)
    batch, steps, vocab = 64, 3, 11
    logits = jax.random.normal(jax.random.key(1), (batch, steps, vocab))
    positions = 3 + jnp.arange(steps)[None, :] + jnp.arange(batch)[:, None]
    cfg = SamplingConfig(1.1, 6, 0.95)
    rows = jnp.arange(batch, dtype=jnp.int32)
    all_at_once, all_logp = draw(key, logits, cfg, positions, rows)
    for t in range(steps):  # one position at a time
        tokens, logp = draw(key, logits[:, t], cfg, positions[:, t], rows)
        np.testing.assert_array_equal(tokens, all_at_once[:, t])
        np.testing.assert_allclose(logp, all_logp[:, t], rtol=1e-6)
    # Rows in another order (and batch), named by their rollout ids: the same tokens.
    order = np.random.default_rng(0).permutation(batch)
    tokens, _ = draw(key, logits[order, 0], cfg, positions[order, 0], rows[order])
    np.testing.assert_array_equal(tokens, all_at_once[order, 0])
    # Another row id or position draws fresh noise.
    flat = jnp.zeros((batch, vocab))
    base, _ = draw(key, flat, cfg, positions[:, 0], rows)
    other_rows, _ = draw(key, flat, cfg, positions[:, 0], rows + batch)
    other_positions, _ = draw(key, flat, cfg, positions[:, 0] + 1, rows)
    assert np.mean(np.asarray(base) == np.asarray(other_rows)) < 0.5
    assert np.mean(np.asarray(base) == np.asarray(other_positions)) < 0.5


def test_sample_follows_processed_law():
    """Chi-square at level ALPHA (one of the NUM_LAW_TESTS Bonferroni-counted tests)."""
    vocab, rows = 9, 1 << 18
    logits = jax.random.normal(jax.random.key(2), (1, vocab)) * 1.5
    cfg = (0.8, 6, 0.95)
    tokens, _ = jax.jit(sample)(
        jax.random.key(5), jnp.broadcast_to(logits, (rows, vocab)), SamplingConfig(*cfg), jnp.full(rows, 40)
    )
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    p_value, statistic, outside = law_test(counts, processed_probs(np.asarray(logits[0]), *cfg))
    assert outside == 0 and p_value > ALPHA, (statistic, p_value)


@pytest.mark.parametrize("vocab", [1, 7, 100])
def test_token_ids_stay_below_vocab(vocab):
    # The largest id carries nearly all the mass: an off-by-one would show up as id == vocab.
    logits = jnp.where(jnp.arange(vocab) == vocab - 1, 30.0, -30.0)[None].repeat(64, 0)
    draw = jax.jit(sample)
    for cfg in [SamplingConfig(), SamplingConfig(0.0), SamplingConfig(5.0, vocab + 4, 0.999)]:
        tokens, logp = draw(jax.random.key(0), logits.astype(jnp.bfloat16), cfg, jnp.arange(64))
        assert np.all((np.asarray(tokens) >= 0) & (np.asarray(tokens) < vocab))
        assert np.all(np.isfinite(np.asarray(logp)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=np.ones(2)), "scalar"),
    ],
)
def test_bad_settings_raise_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_settings_are_stored_with_fixed_dtypes():
    cfg = SamplingConfig(temperature=1, top_k=np.int64(5), top_p=1)
    assert (cfg.temperature.dtype, cfg.top_k.dtype, cfg.top_p.dtype) == (jnp.float32, jnp.int32, jnp.float32)
    leaves, treedef = jax.tree.flatten(cfg)
    assert len(leaves) == 3
    assert jax.tree.unflatten(treedef, leaves).top_k is leaves[1]
