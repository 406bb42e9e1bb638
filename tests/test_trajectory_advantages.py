"""Advantage estimators against direct NumPy formulas."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyrejax.trajectory import get_advantage, known_advantages, register_advantage

rewards = st.lists(st.floats(-10, 10), min_size=1, max_size=12).map(np.asarray)


def grpo_reference(r: np.ndarray, ddof: int) -> np.ndarray:
    """GRPO in plain float64 loops: (r_i - mean) / (std + 1e-6), std with `ddof`; 0 for
    a group of one."""
    n = len(r)
    if n < 2:
        return np.zeros(n)
    mean = sum(float(x) for x in r) / n
    std = (sum((float(x) - mean) ** 2 for x in r) / (n - ddof)) ** 0.5
    return np.array([(float(x) - mean) / (std + 1e-6) for x in r])


@settings(max_examples=100, deadline=None)
@given(rewards)
def test_estimators_match_formulas(r):
    grpo = get_advantage("grpo")
    np.testing.assert_allclose(grpo(r), grpo_reference(r, ddof=1), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(grpo(r, std="unbiased"), grpo(r))  # the default
    population = grpo(r, std="population")
    np.testing.assert_allclose(population, grpo_reference(r, ddof=0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(get_advantage("mean_centered")(r), r - r.mean(), atol=1e-12)
    loo = [r[i] - np.delete(r, i).mean() if len(r) > 1 else 0.0 for i in range(len(r))]
    np.testing.assert_allclose(get_advantage("rloo")(r), loo, atol=1e-9)


def test_grpo_std_conventions_differ_by_the_bessel_factor():
    """verl and TRL divide by the unbiased std (ddof=1): for rewards [1, 0, 0, 0] the
    advantages are sqrt(3)/2 times the population ones (up to eps)."""
    r = np.array([1.0, 0.0, 0.0, 0.0])
    unbiased, population = (get_advantage("grpo")(r, std=s) for s in ("unbiased", "population"))
    np.testing.assert_allclose(unbiased, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
    np.testing.assert_allclose(population, [np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3),
                                            -1 / np.sqrt(3)], rtol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match=r"advantage std 'sample'; expected one of unbiased"):
        get_advantage("grpo")(r, std="sample")


def test_a_group_of_one_has_zero_advantage_under_either_std():
    """A lone execution has no group baseline (and the unbiased std of one value is
    undefined): its advantage is 0, finite, under either convention."""
    for std in ("unbiased", "population"):
        np.testing.assert_array_equal(get_advantage("grpo")(np.array([0.7]), std=std), [0.0])


def test_constant_group_has_zero_advantage():
    for name in ("grpo", "mean_centered", "rloo"):
        np.testing.assert_array_equal(get_advantage(name)(np.full(4, 0.5)), 0.0)


def test_registry():
    assert {"grpo", "mean_centered", "rloo"} <= set(known_advantages())
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; known: \[.*'grpo'"):
        get_advantage("ppo")

    @register_advantage("rank_test")
    def rank(r, *, std="unbiased"):
        return np.argsort(np.argsort(r)).astype(np.float64)

    assert get_advantage("rank_test") is rank
    # Estimators that do not divide by a std take (and ignore) the std convention.
    np.testing.assert_array_equal(
        get_advantage("rloo")(np.array([1.0, 3.0]), std="population"), [-2.0, 2.0]
    )
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("rank_test")(lambda r: r)
