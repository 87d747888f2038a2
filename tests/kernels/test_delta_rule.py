"""The stacked-state recurrent kernel (jaxspec.kernels.delta_rule), interpreted on this CPU,
against the model's recurrent rule (jaxspec.models.gated_deltanet.delta_rule_recurrent,
itself checked against transformers and a float64 loop in tests/models/test_hybrid.py): the
outputs and the layer's new state within float32 rounding, the stack's other layers and (not
written) the layer itself untouched bit for bit. And the engine with every recurrent forward
routed through it (as a forward built for one GPU does): speculative rollouts equal plain
ones token for token under replay, and both equal the XLA path's within 1e-5."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingConfig
from jaxspec.decoding.engine import generate, pad_prompts
from jaxspec.decoding.oracle import oracle_drafter
from jaxspec.kernels import delta_rule
from jaxspec.models import ModelConfig
from jaxspec.models import hybrid as hybrid_module
from jaxspec.models.gated_deltanet import delta_rule_recurrent, l2_normalize
from jaxspec.models.hybrid import random_hybrid_policy


def _inputs(t, seed=0, b=2, hk=2, hv=4, dk=16, dv=64, layers=3):
    rng = np.random.default_rng(seed)

    def f(*s):
        return jnp.asarray(rng.normal(size=s), jnp.float32)

    q = l2_normalize(f(b, t, hk, dk)) * dk ** -0.5
    k, v = l2_normalize(f(b, t, hk, dk)), f(b, t, hv, dv)
    g, beta = -jnp.abs(f(b, t, hv)) * 3, jax.nn.sigmoid(f(b, t, hv))
    return q, k, v, g, beta, f(layers, b, hv, dk, dv)


@pytest.mark.parametrize("t", [1, 3, 4, 7])
def test_kernel_equals_the_recurrent_rule_and_touches_only_its_layer(t):
    q, k, v, g, beta, stack = _inputs(t, seed=t)
    want_out, want_state = delta_rule_recurrent(q, k, v, g, beta, stack[1])
    out, new = delta_rule.recurrent_stacked(q, k, v, g, beta, stack, jnp.int32(1), write="all",
                                            interpret=True)
    scale = float(jnp.abs(want_state).max())
    assert float(jnp.abs(out - want_out).max()) <= 1e-6 * float(jnp.abs(want_out).max())
    assert float(jnp.abs(new[1] - want_state).max()) <= 1e-6 * scale
    assert float(jnp.abs(new[1] - stack[1]).max()) > 1e-2 * scale  # it did write
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(stack[i]))
    out2, kept = delta_rule.recurrent_stacked(q, k, v, g, beta, stack, jnp.int32(1),
                                              write=None, interpret=True)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(stack))
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))


def test_identity_steps_leave_the_state_bit_for_bit():
    """g = 0, beta = 0 (the padding steps, and the commit's rejected tokens) change nothing."""
    q, k, v, g, beta, stack = _inputs(4, seed=9)
    _, new = delta_rule.recurrent_stacked(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta),
                                          stack, jnp.int32(0), write="all", interpret=True)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(stack))


def _pending(p, layers=3, seed=6):  # the pending tokens' stacks [L, B, P, ..], as a cache holds
    q, k, v, g, beta, _ = _inputs(p, seed=seed)
    return tuple(jnp.stack([a * (1.0 + 0.25 * i) if a is v else a for i in range(layers)])
                 for a in (q, k, v, g, beta))


def _unfolded(q, k, v, g, beta, stack, layer, count, pending, write, **kw):
    """The fold's reference: the kept pending tokens as their own pass (the rejected ones
    identity steps: g = 0, beta = 0), then the new tokens: the commit-then-verify arithmetic."""
    keep = (jnp.arange(pending[3].shape[2])[None, :] < count[:, None])[..., None]
    pq, pk, pv, pg, pb = (a[layer] for a in pending)
    mid = delta_rule.recurrent_stacked(pq, pk, pv, jnp.where(keep, pg, 0.0),
                                       jnp.where(keep, pb, 0.0), stack, layer, write="all", **kw)[1]
    out, end = delta_rule.recurrent_stacked(q, k, v, g, beta, mid, layer, write="all", **kw)
    return out, end if write == "all" else mid


@pytest.mark.parametrize("write", ["all", "pending"])
@pytest.mark.parametrize("t", [1, 4])
def test_pending_then_new_in_one_pass_equals_the_passes_apart(t, write):
    """The fold of the commit into the next step: one call applies each row's kept pending
    tokens (count[b] of P = 4) then runs the T new ones, reading the state once. Against
    the pending tokens' own pass followed by the new tokens' (what a commit, then a decode
    or verify, computes) and against the XLA rule (gated_deltanet.delta_rule_recurrent over
    the kept tokens then the new ones) within float32 rounding: interpreted on this CPU,
    XLA contracts the multiply-adds of each program its own way (even a row with nothing
    pending moves by an ulp between the two programs), so bit equality is asserted where it
    is structural (a row with nothing pending keeps its state under write="pending"; other
    layers untouched) and, compiled with Triton, in the gpu-marked test below. Written: the
    state after all tokens, or after the pending ones only (a verify)."""
    q, k, v, g, beta, stack = _inputs(t, seed=t + 10)
    pending = _pending(4)
    count = jnp.asarray([3, 0], jnp.int32)  # row 0 keeps 3 of 4, row 1 nothing
    layer = jnp.int32(1)
    out, new = delta_rule.recurrent_stacked(q, k, v, g, beta, stack, layer, (count,) + pending,
                                            write=write, interpret=True)
    want_out, want = _unfolded(q, k, v, g, beta, stack, layer, count, pending, write,
                               interpret=True)
    scale = float(jnp.abs(want[1]).max())
    out_scale = float(jnp.abs(want_out).max())
    assert float(jnp.abs(out - want_out).max()) <= 1e-6 * out_scale
    assert float(jnp.abs(new[1] - want[1]).max()) <= 1e-6 * scale
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(stack[i]))
    kept = [jnp.concatenate([a[1][0:1, :3], b[0:1]], axis=1) for a, b in
            zip(pending, (q, k, v, g, beta))]  # row 0: its 3 kept tokens, then the new ones
    ref_out, ref_state = delta_rule_recurrent(*kept, stack[1, 0:1])
    assert float(jnp.abs(out[0] - ref_out[0, 3:]).max()) <= 1e-6 * out_scale
    if write == "all":
        assert float(jnp.abs(new[1, 0] - ref_state[0]).max()) <= 1e-6 * scale
    else:  # row 1 kept nothing: its state as it was, bit for bit; row 0's moved
        np.testing.assert_array_equal(np.asarray(new[1, 1]), np.asarray(stack[1, 1]))
        assert float(jnp.abs(new[1, 0] - stack[1, 0]).max()) > 1e-2 * scale


def test_bad_shapes_are_one_error():
    q, k, v, g, beta, stack = _inputs(2)
    with pytest.raises(ValueError, match="block_v 48"):
        delta_rule.recurrent_stacked(q, k, v, g, beta, stack, jnp.int32(0), write="all",
                                     block_v=48, interpret=True)


def test_engine_through_the_kernel_equals_plain_and_the_xla_path(monkeypatch):
    cfg = ModelConfig.tiny("qwen3_5", vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_layers=3, layer_types=("linear_attention", "full_attention",
                                                      "linear_attention"),
                           linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8)
    policy = random_hybrid_policy(cfg, seed=1)
    prompts = [[5, 9, 13, 5, 9, 13, 5], [77, 3], [40, 41, 42, 43, 40, 41]]
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=12,
                  key=jax.random.key(11))
    xla = generate(policy, prompts, **common)
    tokens, lengths = pad_prompts(prompts)

    used = []
    kernel = functools.partial(delta_rule.recurrent_stacked, block_v=8, interpret=True)
    monkeypatch.setattr(hybrid_module, "recurrent_stacked",
                        lambda *a, **kw: used.append(a[0].shape[1]) or kernel(*a, **kw))
    monkeypatch.setattr(hybrid_module, "stacked_rule", lambda tokens, stack, recurrent: (
        stack.shape[1] > 0 and (tokens == 1 or recurrent) and tokens <= delta_rule.MAX_TOKENS))
    jax.clear_caches()
    try:
        plain = generate(policy, prompts, **common)
        drafter = oracle_drafter(tokens, lengths, plain.tokens, [0.9, 0.7, 0.5], vocab_size=128)
        spec = generate(policy, prompts, drafter=drafter, **common)
    finally:
        jax.clear_caches()
    assert 1 in used and 4 in used  # decode steps, and the verify / commit of k = 3
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    # (a verify's matmuls over 4 tokens round as a decode's over 1 do not: log-probs within
    # float32 rounding, as for the XLA path in tests/decoding/test_hybrid_engine.py)
    np.testing.assert_allclose(np.asarray(spec.logprobs), np.asarray(plain.logprobs), atol=1e-5)
    assert float(spec.stats.acceptance_length) > 1.5
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(xla.tokens))
    np.testing.assert_allclose(np.asarray(plain.logprobs), np.asarray(xla.logprobs), atol=1e-5)


@pytest.mark.gpu
def test_on_a_gpu_pending_then_new_in_one_pass_is_the_decode_steps_arithmetic():
    """Compiled with Triton (skipped without a GPU): a decode step that first applies a
    verify's kept tokens (pending, count per row) leaves the state and gives the output of
    one-token calls over those tokens and then the new one, bit for bit: plain decoding's
    arithmetic, which the engine's replay exactness needs on a GPU."""
    q, k, v, g, beta, stack = _inputs(1, seed=4, dv=128)
    pq, pk, pv, pg, pb, _ = _inputs(4, seed=5, dv=128)
    pending = tuple(jnp.stack([a] * 3) for a in (pq, pk, pv, pg, pb))
    count = jnp.asarray([4, 2], jnp.int32)
    out, once = delta_rule.recurrent_stacked(q, k, v, g, beta, stack, jnp.int32(2),
                                             (count,) + pending, write="all")
    for row, n in enumerate((4, 2)):
        steps = stack[:, row:row + 1]
        for t in range(n):
            steps = delta_rule.recurrent_stacked(
                *(a[row:row + 1, t:t + 1] for a in (pq, pk, pv, pg, pb)), steps, jnp.int32(2),
                write="all")[1]
        o, steps = delta_rule.recurrent_stacked(*(a[row:row + 1] for a in (q, k, v, g, beta)),
                                                steps, jnp.int32(2), write="all")
        np.testing.assert_array_equal(np.asarray(steps[2, 0]), np.asarray(once[2, row]))
        np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(out[row]))


@pytest.mark.gpu
def test_on_a_gpu_a_verify_and_its_commit_do_a_decode_steps_arithmetic():
    """Compiled with Triton (skipped without a GPU: JAXSPEC_TEST_PLATFORMS=cuda): the kernel
    within float32 rounding of the rule, and four one-token calls (decode steps) leave the
    state bit for bit where one four-token call (a verify's commit) does, with the same
    outputs: the exactness the engine's replay needs on a GPU."""
    q, k, v, g, beta, stack = _inputs(4, seed=3, dv=128)
    want_out, want_state = delta_rule_recurrent(q, k, v, g, beta, stack[2])
    out, once = delta_rule.recurrent_stacked(q, k, v, g, beta, stack, jnp.int32(2), write="all")
    assert float(jnp.abs(once[2] - want_state).max()) <= 1e-5 * float(jnp.abs(want_state).max())
    steps, outs = stack, []
    for t in range(4):
        o, steps = delta_rule.recurrent_stacked(*(a[:, t:t + 1] for a in (q, k, v, g, beta)),
                                                steps, jnp.int32(2), write="all")
        outs.append(o)
    np.testing.assert_array_equal(np.asarray(steps), np.asarray(once))
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(out))
