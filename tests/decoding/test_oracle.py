"""The oracle drafter: drafts are the plain rollout's own tokens, cut at a chosen rate."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.engine import generate, pad_prompts
from jaxspec.decoding.oracle import OracleDrafter, oracle_drafter
from jaxspec.models import ModelConfig, Policy

N = 24  # max new tokens


@pytest.fixture(scope="module")
def setup():
    policy = Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))
    rng = np.random.default_rng(0)
    vocab = policy.config.vocab_size
    prompts = [list(rng.integers(3, vocab, size=n)) for n in (3, 5, 2, 7)]
    tokens, lengths = pad_prompts(prompts)
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=N,
                  key=jax.random.key(3), stop_tokens=(2,))
    plain = generate(policy, (tokens, lengths), **common)
    return policy, tokens, lengths, plain, common


def _spec(setup, acceptance):
    policy, tokens, lengths, plain, common = setup
    drafter = oracle_drafter(tokens, lengths, plain.tokens, acceptance,
                             vocab_size=policy.config.vocab_size)
    return generate(policy, (tokens, lengths), drafter=drafter, **common)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_perfect_oracle_replays_plain_at_k_plus_1_tokens_per_forward(setup, k):
    plain = setup[3]
    spec = _spec(setup, [1.0] * k)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(plain.lengths))
    lengths = np.asarray(plain.lengths)
    # every forward emits k + 1 tokens except the row's last: ceil(length / (k + 1)) forwards
    np.testing.assert_array_equal(np.asarray(spec.stats.row_steps), -(-lengths // (k + 1)))


def test_oracle_at_acceptance_zero_is_plain_speed(setup):
    plain = setup[3]
    spec = _spec(setup, [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(spec.stats.row_steps), np.asarray(plain.lengths))
    assert spec.stats.acceptance_length == 1.0
    assert np.all(spec.stats.per_position_acceptance == 0)


def test_oracle_partial_acceptance_is_lossless_and_deterministic(setup):
    plain = setup[3]
    a = _spec(setup, [0.7, 0.5, 0.5])
    b = _spec(setup, [0.7, 0.5, 0.5])
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(a.stats.row_steps), np.asarray(b.stats.row_steps))
    lengths = np.asarray(plain.lengths)
    assert np.all(np.asarray(a.stats.row_steps) < lengths) or lengths.max() <= 2
    assert np.all(np.asarray(a.stats.row_steps) >= -(-lengths // 4))


def test_oracle_rejects_bad_settings(setup):
    policy, tokens, lengths, plain, common = setup
    with pytest.raises(ValueError, match="acceptance"):
        OracleDrafter(np.zeros((4, 8), np.int32), (1.2,), vocab_size=10)
    with pytest.raises(ValueError, match="acceptance"):
        OracleDrafter(np.zeros((4, 8), np.int32), (), vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size"):
        OracleDrafter(np.zeros((4, 8), np.int32), (1.0,), vocab_size=1)
    wrong = OracleDrafter(np.zeros((4, 8), np.int32), (1.0,), vocab_size=7)
    with pytest.raises(ValueError, match="vocab_size 7"):
        generate(policy, (tokens, lengths), drafter=wrong, **common)


def _bench_rollout():
    """(repository root, scripts/bench_rollout.py loaded as a module)."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_rollout", root / "scripts" / "bench_rollout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return root, bench


def test_bench_rollout_oracle_mode(tmp_path):
    """scripts/bench_rollout.py --oracle on a config's random policy: one row per (batch, k)
    with speedup, tau, verify cost, bound and efficiency; perfect drafts emit k+1 per forward.
    --calls 2: two calls of 2 prompts each (4 prompts), each with its own oracle drafts."""
    import json

    root, bench = _bench_rollout()
    out = tmp_path / "b.json"
    assert bench.main(["--config", str(root / "configs" / "tiny.yaml"), "--oracle", "1.0",
                       "--ks", "2", "--batches", "2", "--calls", "2", "--max-new-tokens", "9",
                       "--rounds", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens_equal_plain"] and (row["batch"], row["k"], row["calls"]) == (2, 2, 2)
    assert 4 <= row["plain_tokens"] <= 4 * 9
    # ceil(9 / (k + 1)) = 3 forwards per call, and a perfect draft's rows emit k + 1 a forward
    assert row["tau"] <= 3.0 and row["target_forwards"] <= 2 * 3
    with pytest.raises(SystemExit, match="--calls"):
        bench.main(["--config", str(root / "configs" / "tiny.yaml"), "--oracle", "1.0", "--calls", "0"])
    assert row["bound"] == pytest.approx(row["tau"] / row["verify_cost"])
    assert row["efficiency"] == pytest.approx(row["speedup"] / row["bound"])
    with pytest.raises(SystemExit, match="--oracle"):
        bench.main(["--config", str(root / "configs" / "tiny.yaml"), "--oracle", "1.5"])


def test_bench_rollout_bound_with_the_draft(tmp_path):
    """A drafter with forwards (an untrained MTP head) gets its per-iteration cost c_draft
    measured and the bound tau / (c(k+1)/c(1) + c_draft/c(1)); a model-free one none."""
    import json

    root, bench = _bench_rollout()
    out = tmp_path / "b.json"
    assert bench.main(["--config", str(root / "configs" / "tiny.yaml"), "--drafters",
                       "mtp_untrained,ngram", "--ks", "2", "--batches", "2", "--max-new-tokens",
                       "6", "--rounds", "1", "--json", str(out)]) == 0
    mtp, ngram = json.loads(out.read_text())["rows"]
    assert mtp["tokens_equal_plain"] and ngram["tokens_equal_plain"]
    assert mtp["draft_cost"] > 0 and ngram["draft_cost"] == 0.0
    for row in (mtp, ngram):
        assert row["bound_with_draft"] == pytest.approx(
            row["tau"] / (row["verify_cost"] + row["draft_cost"]))
        assert row["efficiency_with_draft"] == pytest.approx(row["speedup"] / row["bound_with_draft"])


def test_bench_rollout_overrides_and_memory_bound(tmp_path):
    """--set overrides the config's model; --bandwidth reports plain decoding against the
    bytes it must read per step, counted here from the shape alone (closed form)."""
    import json

    from jaxspec.models import ModelConfig, Policy

    root, bench = _bench_rollout()
    out = tmp_path / "b.json"
    assert bench.main(["--config", str(root / "configs" / "tiny.yaml"), "--set", "model.num_layers=2",
                       "--oracle", "1.0", "--ks", "1", "--batches", "1", "--max-new-tokens", "5",
                       "--rounds", "1", "--bandwidth", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["read_bandwidth_gbps"] > 0
    (row,) = result["rows"]
    assert row["plain_of_memory_bound"] > 0 and row["plain_tokens_per_s"] > 0
    # Weight and KV bytes of a decode step, from the architecture: a Qwen3 layer holds q, k,
    # v, o, three MLP matrices, two norms and the q/k norms; untied, the input embedding is
    # not read (only the looked-up rows), the LM head is.
    cfg = ModelConfig.tiny("qwen3").replace(num_layers=3, tie_embeddings=False, vocab_size=50)
    h, i, d, nh, kv = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads,
                       cfg.num_kv_heads)
    layer = h * nh * d * 2 + h * kv * d * 2 + 3 * h * i + 2 * h + 2 * d
    weights = (cfg.num_layers * layer + h + h * cfg.vocab_size) * 4  # float32
    kv_bytes = 2 * 10.5 * cfg.num_layers * 2 * kv * d * 4  # batch 2, 10.5 cached tokens
    policy = Policy.abstract(cfg)
    assert bench.decode_bytes(policy, 2, 10.5) == (weights, int(kv_bytes))
    # Tied: no separate LM head; the embedding table is read whole as the LM head.
    tied = Policy.abstract(cfg.replace(tie_embeddings=True))
    assert bench.decode_bytes(tied, 2, 10.5) == (weights, int(kv_bytes))
    with pytest.raises(SystemExit, match="--set"):
        bench.main(["--policy", str(tmp_path), "--set", "model.num_layers=2"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _ShapeRounding(Policy):
    """A bf16 policy whose logits depend on how many tokens a forward is fed, as a GPU's
    matmuls round a 4-token verify differently from a 1-token decode (XLA:CPU does not:
    there the plain reference already replays perfectly, so this stands in for the GPU)."""

    def forward(self, tokens, positions, cache=None, **kwargs):
        logits, hidden, cache = super().forward(tokens, positions, cache, **kwargs)
        wobble = 0.5 * jnp.sin(1.7 * tokens.shape[1] * jnp.arange(logits.shape[-1]))
        return logits + wobble.astype(logits.dtype), hidden, cache


@pytest.fixture(scope="module")
def bf16_setup():
    cfg = ModelConfig.tiny("qwen3", num_layers=2).replace(dtype="bfloat16")
    base = Policy.init(cfg, jax.random.key(0))
    policy = _ShapeRounding(base.config, base.graphdef, base.params, base.layer_params)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=n)) for n in (4, 6, 3, 5)]
    tokens, lengths = pad_prompts(prompts)
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=N,
                  key=jax.random.key(5))
    return policy, tokens, lengths, common


def test_verify_reference_oracle_accepts_every_draft_in_bf16(bf16_setup, k=3):
    """Drafts taken from what the verify forward emits: at acceptance 1.0 every row emits
    k + 1 tokens a forward (but its last), where drafts replayed from plain decoding are
    rejected (the negative control: shape-dependent rounding)."""
    from jaxspec.decoding.oracle import verify_reference

    policy, tokens, lengths, common = bf16_setup
    vocab = policy.config.vocab_size
    plain = generate(policy, (tokens, lengths), **common)
    stale = generate(policy, (tokens, lengths), **common, drafter=oracle_drafter(
        tokens, lengths, plain.tokens, [1.0] * k, vocab_size=vocab))
    assert stale.stats.acceptance_length < k + 1  # rounding, not the drafts, decides

    reference = verify_reference(policy, (tokens, lengths), k, **common)
    spec = generate(policy, (tokens, lengths), **common, drafter=oracle_drafter(
        tokens, lengths, reference.tokens, [1.0] * k, vocab_size=vocab))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(reference.tokens))
    n = np.asarray(spec.lengths)
    assert np.all(n == N)
    np.testing.assert_array_equal(np.asarray(spec.stats.row_steps), -(-n // (k + 1)))
    assert N % (k + 1) == 0 and spec.stats.acceptance_length == k + 1  # tau = k + 1 exactly
    assert reference.stats.acceptance_length == k + 1


def test_verify_reference_needs_replay(bf16_setup):
    from jaxspec.decoding.oracle import VerifyWindowDrafter, verify_reference

    policy, tokens, lengths, common = bf16_setup
    with pytest.raises(ValueError, match="method='replay'"):
        verify_reference(policy, (tokens, lengths), 3, method="rejection", **common)
    with pytest.raises(ValueError, match="k must be an int >= 1; got 0"):
        VerifyWindowDrafter(0)
