"""Micro-step assignment and its cost model."""

import itertools

import numpy as np

from gyrejax.trajectory.microsteps import assign_micro_steps, row_costs


def test_cost_model_counts_tokens_and_visible_pairs():
    se = np.array([[3, 2, 3, 4]], np.int32)  # tokens 0..2 one tree, token 3 padding
    ei = np.array([[0, 0, 0, -1]], np.int32)
    # pairs: key0 -> queries 0,1,2; key1 -> 1; key2 -> 2  => 5
    np.testing.assert_allclose(row_costs(se, ei), [3 + 5 / 4])


def test_assignment_is_a_permutation_with_padding_rows():
    costs = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    order = assign_micro_steps(costs, 3)
    assert sorted(order.tolist()) == list(range(6))  # row 5 is a padding row
    assert len(assign_micro_steps(np.zeros(0), 4)) == 0


def brute_force_best(costs, r):
    n = len(costs)
    best = np.inf
    for perm in itertools.permutations(range(n)):
        loads = [sum(costs[i] for i in perm[m * r : (m + 1) * r]) for m in range(n // r)]
        best = min(best, max(loads))
    return best


def test_lpt_is_near_optimal_on_small_cases():
    rng = np.random.default_rng(0)
    for _ in range(30):
        costs = rng.uniform(1, 10, size=6)
        order = assign_micro_steps(costs, 2)
        loads = costs[order].reshape(3, 2).sum(axis=1)
        assert loads.max() <= brute_force_best(costs, 2) * 4 / 3 + 1e-9
