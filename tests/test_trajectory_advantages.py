"""Advantage estimators against direct NumPy formulas."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyrejax.trajectory import get_advantage, known_advantages, register_advantage

rewards = st.lists(st.floats(-10, 10), min_size=1, max_size=12).map(np.asarray)


@settings(max_examples=100, deadline=None)
@given(rewards)
def test_estimators_match_formulas(r):
    np.testing.assert_allclose(get_advantage("grpo")(r), (r - r.mean()) / (r.std() + 1e-6))
    np.testing.assert_allclose(get_advantage("mean_centered")(r), r - r.mean(), atol=1e-12)
    loo = [r[i] - np.delete(r, i).mean() if len(r) > 1 else 0.0 for i in range(len(r))]
    np.testing.assert_allclose(get_advantage("rloo")(r), loo, atol=1e-9)


def test_constant_group_has_zero_advantage():
    for name in ("grpo", "mean_centered", "rloo"):
        np.testing.assert_array_equal(get_advantage(name)(np.full(4, 0.5)), 0.0)


def test_registry():
    assert {"grpo", "mean_centered", "rloo"} <= set(known_advantages())
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; known: \[.*'grpo'"):
        get_advantage("ppo")

    @register_advantage("rank_test")
    def rank(r):
        return np.argsort(np.argsort(r)).astype(np.float64)

    assert get_advantage("rank_test") is rank
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("rank_test")(lambda r: r)
