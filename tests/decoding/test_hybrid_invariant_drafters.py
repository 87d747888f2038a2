"""Every chain drafter a hybrid policy accepts, under the batch-invariant forward
(`ModelConfig.batch_invariant`): speculative rollouts equal plain ones token for token AND
log-prob for log-prob, bit for bit, with two slots (rows refilled mid-call), a cache that
grows mid-call and, for EAGLE-3, adaptive k; bfloat16 for every drafter, float32 for the
oracle. The reference is plain decoding (one token per row per forward, one full-length
cache). The row-level claims (a row's logits alone = batched = decoded = verified = the
training forward's) and the negative control are test_hybrid_invariant.py's, compiled as
users compile; these run compiled as the suite compiles (each case compiles its own loop)."""

import pytest

from jaxspec.testing.hybrid_invariant import (
    CHAIN_DRAFTERS,
    assert_speculative_is_plain_bitwise,
    hybrid_policy,
    plain_rollouts,
)


@pytest.fixture(scope="module")
def plain():  # {dtype: (policy, generate's arguments, plain rollouts)}
    return {dtype: (hybrid_policy(dtype), *plain_rollouts(hybrid_policy(dtype)))
            for dtype in ("float32", "bfloat16")}


@pytest.mark.slow
@pytest.mark.parametrize("dtype,name", [("bfloat16", n) for n in CHAIN_DRAFTERS]
                         + [("float32", "oracle")])
def test_speculative_equals_plain_bitwise(plain, dtype, name, monkeypatch):
    policy, common, ref = plain[dtype]
    assert_speculative_is_plain_bitwise(policy, name, common, ref, monkeypatch,
                                        adaptive=name == "eagle3_chain")
