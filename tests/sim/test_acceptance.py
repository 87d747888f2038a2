"""Acceptance profiles against the closed form of the i.i.d. chain."""

import pytest

from jaxspec.sim import Acceptance


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.81, 0.95])
@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_constant_rate_matches_closed_form(a, k):
    closed = (1 - a ** (k + 1)) / (1 - a)
    assert Acceptance.constant(a).length(k) == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize("length,k", [(1.0, 3), (2.47, 3), (3.0, 3), (3.9, 3), (2.0, 1), (4.5, 7)])
def test_from_length_inverts(length, k):
    assert Acceptance.from_length(length, k).length(k) == pytest.approx(length, abs=1e-9)


def test_length_three_at_k3_is_rate_081():
    # the 235B projection's draft: acceptance length 3 at k = 3
    assert Acceptance.from_length(3.0, 3).rates[0] == pytest.approx(0.8105, abs=5e-4)


def test_marginal_round_trip():
    marginal = [0.8, 0.6, 0.45, 0.3]
    acc = Acceptance.from_marginal(marginal)
    assert acc.marginal(4) == pytest.approx(marginal)
    assert acc.length(4) == pytest.approx(1 + sum(marginal))
    # positions past the profile reuse the last conditional rate (0.3 / 0.45)
    assert acc.marginal(5)[-1] == pytest.approx(0.3 * 0.3 / 0.45)


def test_decaying_with_no_decay_is_constant():
    assert Acceptance.decaying(0.7, 1.0).length(5) == pytest.approx(Acceptance.constant(0.7).length(5))


def test_length_saturates_below_one_over_one_minus_a():
    acc = Acceptance.constant(0.6)
    lengths = [acc.length(k) for k in range(12)]
    assert all(b > a for a, b in zip(lengths, lengths[1:]))
    assert lengths[-1] < 1 / (1 - 0.6)


def test_invalid_profiles_raise():
    with pytest.raises(ValueError, match="non-increasing"):
        Acceptance.from_marginal([0.5, 0.7])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Acceptance((1.2,))
    with pytest.raises(ValueError, match="k\\+1"):
        Acceptance.from_length(4.5, 3)
