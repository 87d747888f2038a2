"""Every misuse of `generate` / `SamplingConfig` is one clear error, raised before compiling.

Each case asserts the message names the argument and the value given, and that JAX traced
nothing while the call failed (a listener on JAX's own trace events).
"""

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import Eagle3Drafter, SamplingConfig, TreeSpec
from jaxspec.decoding.engine import generate
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head

_TRACES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, _secs, **_: _TRACES.append(name) if name == "/jax/core/compile/jaxpr_trace_duration" else None
)

PROMPTS = [[3, 4, 5], [6, 7]]


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("qwen3", num_layers=1), jax.random.key(0))


@contextlib.contextmanager
def fails_before_tracing(error, *fragments):
    """The block raises `error` whose message contains every fragment; nothing was traced."""
    _TRACES.clear()
    with pytest.raises(error) as info:
        yield
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not _TRACES, f"{len(_TRACES)} traces before the error: {message}"


def _call(policy, **changes):
    """generate() with these changes, its arguments built now (building them may trace)."""
    kwargs = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=4, key=jax.random.key(0))
    kwargs.update(changes)
    prompts = kwargs.pop("prompts", PROMPTS)
    return lambda: generate(policy, prompts, **kwargs)


def test_greedy_method_needs_temperature_zero(policy):
    call = _call(policy, method="greedy")
    with fails_before_tracing(ValueError, "method='greedy'", "temperature=1.0", "lossless only at temperature 0"):
        call()
    call = _call(policy, method="greedy", sampling=SamplingConfig(temperature=jnp.float32(0.5)))
    with fails_before_tracing(ValueError, "temperature=0.5"):
        call()


@pytest.mark.parametrize(
    "changes, error, fragments",
    [
        (dict(stop_tokens=2), TypeError, ["stop_tokens", "2 (int)", "e.g. [2]"]),
        (dict(stop_tokens=[2.0]), TypeError, ["stop_tokens", "2.0 (float)"]),
        (dict(sampling=dict(temperature=1.0)), TypeError, ["sampling", "{'temperature': 1.0} (dict)", "SamplingConfig("]),
        (dict(key=0), TypeError, ["key", "0 (int)", "jax.random.key(seed)"]),
        (dict(key=jnp.zeros(3, jnp.uint32)), TypeError, ["key", "uint32[2]"]),
        (dict(method="beam"), ValueError, ["method", "'beam' (str)", "replay"]),
        (dict(max_new_tokens=0), ValueError, ["max_new_tokens", "0 (int)", ">= 1"]),
        (dict(max_new_tokens=4.0), ValueError, ["max_new_tokens", "4.0 (float)"]),
        (dict(pad_id=-1), ValueError, ["pad_id", "-1 (int)", "[0, 128)"]),
        (dict(drafter="eagle3"), TypeError, ["drafter", "'eagle3' (str)", "Drafter"]),
        (dict(rows=[0.5, 1.5]), ValueError, ["rows", "float64"]),
        (dict(prompts=[1, 2, 3]), TypeError, ["prompts[0] is 1 (int)", "[[1, 2, 3]]"]),
        (dict(prompts="hello"), TypeError, ["prompts", "'hello' (str)"]),
    ],
)
def test_argument_types_are_named(policy, changes, error, fragments):
    call = _call(policy, **changes)
    with fails_before_tracing(error, *fragments):
        call()


def test_policy_must_be_a_policy():
    call = _call(None)
    with fails_before_tracing(TypeError, "policy", "None (NoneType)", "jaxspec.models.Policy"):
        call()


@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        (dict(temperature=math.inf), ValueError, ["temperature=inf", "finite number >= 0"]),
        (dict(temperature=math.nan), ValueError, ["temperature=nan"]),
        (dict(temperature=-0.1), ValueError, ["temperature=-0.1"]),
        (dict(top_k=math.inf), ValueError, ["top_k=inf", "integer >= 0"]),
        (dict(top_k=2.5), ValueError, ["top_k=2.5"]),
        (dict(top_k=-1), ValueError, ["top_k=-1"]),
        (dict(top_p=math.nan), ValueError, ["top_p=nan", "(0, 1]"]),
        (dict(top_p=0.0), ValueError, ["top_p=0.0", "(0, 1]"]),
        (dict(top_p=1.5), ValueError, ["top_p=1.5"]),
        (dict(temperature="1.0"), TypeError, ["temperature", "'1.0'"]),
        (dict(top_k=True), TypeError, ["top_k", "True"]),
        (dict(temperature=np.ones(2)), ValueError, ["temperature", "scalar", "(2,)"]),
        # Device values are checked where they are concrete (outside a trace).
        (dict(temperature=jnp.float32(-1)), ValueError, ["temperature=-1.0"]),
        (dict(top_p=jnp.float32(0)), ValueError, ["top_p=0.0"]),
        (dict(top_k=jnp.float32(3.5)), ValueError, ["top_k=3.5"]),
    ],
)
def test_bad_sampling_settings_are_named(kwargs, error, fragments):
    with fails_before_tracing(error, *fragments):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize(
    "prompts, fragments",
    [
        ([[3, 4.5]], ["prompts[0]", "4.5 (float)", "never truncated"]),
        ([np.array([3.0, 4.0])], ["prompts[0]", "float64", "3.0"]),
        ((np.array([[3.0, 4.0]]), np.array([2])), ["prompts[0] (tokens)", "float64"]),
    ],
)
def test_float_prompt_ids_are_refused(policy, prompts, fragments):
    call = _call(policy, prompts=prompts)
    with fails_before_tracing(TypeError, *fragments):
        call()


def test_tree_spec_errors_name_the_field():
    for kwargs, fragment in [
        (dict(top_k=0), "TreeSpec.top_k must be an int >= 1; got 0"),
        (dict(depth=2.0), "TreeSpec.depth must be an int >= 1; got 2.0"),
        (dict(top_k=2, depth=4, budget=3), "TreeSpec.budget=3 is invalid: it must be in [depth, nodes expanded] = [4, 14]"),
        (dict(top_k=1, depth=2, budget=3), "= [2, 2]"),
    ]:
        with fails_before_tracing(ValueError, fragment):
            TreeSpec(**kwargs)


def test_drafter_arguments_are_typed(policy):
    with fails_before_tracing(TypeError, "Eagle3Drafter needs a draft head", "got Policy"):
        Eagle3Drafter(policy, k=2)
    head = jax.eval_shape(lambda: Eagle3Head.init_for(policy, 16, jax.random.key(2)))
    with fails_before_tracing(TypeError, "tree must be a TreeSpec", "(3, 3, 7)"):
        Eagle3Drafter(head, tree=(3, 3, 7))


def test_a_drafter_that_does_not_fit_the_policy_fails_before_tracing(policy):
    other = Policy.init(ModelConfig.tiny("qwen3", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1),
                        jax.random.key(1))
    head = jax.eval_shape(lambda: Eagle3Head.init_for(other, 16, jax.random.key(2)))
    call = _call(policy, drafter=Eagle3Drafter(head, k=2))
    with fails_before_tracing(ValueError, "EAGLE-3 head does not match the policy", "hidden_size 32"):
        call()


def test_traced_settings_are_used_unchecked_and_raw_keys_work(policy):
    """Inside a trace a setting cannot be checked (documented); outside, both key kinds work."""
    build = jax.jit(lambda t: SamplingConfig(temperature=t).temperature)
    assert float(build(jnp.float32(-1.0))) == -1.0  # no error: a traced value is not inspected
    typed = _call(policy, key=jax.random.key(3))()
    raw = _call(policy, key=jax.random.PRNGKey(3))()
    assert re.fullmatch(r"int32", str(raw.tokens.dtype))
    np.testing.assert_array_equal(typed.tokens, raw.tokens)  # the same key data, the same rollouts
