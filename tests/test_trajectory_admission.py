"""Admission: role priority, proportional sampling, j_max, reproducibility."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyrejax.trajectory import (
    ModelCall,
    admission_rng,
    admit_paths,
    build_tree,
    generate_executions,
    role_priority,
)

ROLES = ("main", "main_summary", "sub_agent", "sub_agent_summary")


@st.composite
def trees(draw):
    """Calls that fork from earlier sequences at random depths, with random roles."""
    seqs, calls = [], []
    for i in range(draw(st.integers(1, 10))):
        base = draw(st.sampled_from(seqs)) if seqs and draw(st.booleans()) else []
        cut = draw(st.integers(0, len(base)))
        prompt = base[:cut] + draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
        output = draw(st.lists(st.integers(0, 3), max_size=4))
        seqs.append(prompt + output)
        calls.append(
            ModelCall("e", i, "main", draw(st.sampled_from(ROLES)), prompt, output,
                      [-1.0] * len(output), [0] * len(output), "stop")
        )  # fmt: skip
    return build_tree(calls)


def leaf_paths(tree):
    """{leaf: set of tree flat indices of trainable tokens on its root-to-leaf path}."""
    out = {}
    for leaf in range(1, tree.num_nodes):
        if tree.children[leaf]:
            continue
        flats, n = [], leaf
        while n > 0:
            flats.extend(range(tree.node_start[n], tree.node_end[n]))
            n = int(tree.node_parent[n])
        out[leaf] = {f for f in flats if tree.trainable[f]}
    return out


@settings(max_examples=300, deadline=None)
@given(trees(), st.sampled_from([None, 1, 2, 3]), st.integers(0, 5))
def test_priority_classes_and_j_max(tree, j_max, seed):
    admitted, chosen = admit_paths(tree, j_max, admission_rng(seed, "e"))
    paths = leaf_paths(tree)
    masked: set[int] = set()
    for leaf in chosen:
        live = {lf: p - masked for lf, p in paths.items() if p - masked}
        assert leaf in live, "admitted a path with nothing left to train"
        best = min(role_priority(tree.node_role[lf]) for lf in live)
        assert role_priority(tree.node_role[leaf]) == best, "skipped a higher-priority class"
        masked |= paths[leaf]
    remaining = [lf for lf, p in paths.items() if p - masked]
    if j_max is None or len(chosen) < j_max:
        assert not remaining, "stopped while trainable tokens were left"
    else:
        assert len(chosen) == j_max
    # The admitted node set is exactly the union of the chosen root-to-leaf paths.
    expected = np.zeros(tree.num_nodes, dtype=bool)
    for leaf in chosen:
        n = leaf
        while n > 0:
            expected[n] = True
            n = int(tree.node_parent[n])
    np.testing.assert_array_equal(admitted, expected)


def test_sampling_is_proportional_to_unmasked_trainable_count():
    # Two main leaves under a common prompt: 1 vs 3 trainable tokens.
    calls = [
        ModelCall("e", 0, "main", "main", [5, 5], [1], [-1.0], [0], "stop"),
        ModelCall("e", 1, "main", "main", [5, 5], [2, 2, 2], [-1.0] * 3, [0] * 3, "stop"),
    ]
    tree = build_tree(calls)
    sizes = tree.node_end - tree.node_start
    long_leaf = next(n for n in range(1, tree.num_nodes) if sizes[n] == 3)
    hits = sum(
        admit_paths(tree, 1, np.random.default_rng(s))[1][0] == long_leaf for s in range(2000)
    )
    assert 0.70 < hits / 2000 < 0.80


def test_same_seed_same_paths_and_rng_depends_only_on_seed_and_id():
    ex = generate_executions(1, 1, seed=0, turns=(30, 40))[0]
    tree = build_tree(list(ex.calls))
    a = admit_paths(tree, 3, admission_rng(7, ex.execution_id))
    b = admit_paths(tree, 3, admission_rng(7, ex.execution_id))
    assert a[1] == b[1]
    np.testing.assert_array_equal(a[0], b[0])
    assert admission_rng(7, "x").integers(1 << 30) == admission_rng(7, "x").integers(1 << 30)
    assert admission_rng(7, "x").integers(1 << 30) != admission_rng(7, "y").integers(1 << 30)


def test_main_paths_admitted_before_sub_agents():
    ex = generate_executions(1, 1, seed=1, turns=(40, 60), sub_agent_prob=0.3)[0]
    tree = build_tree(list(ex.calls))
    _, chosen = admit_paths(tree, None, admission_rng(0, ex.execution_id))
    prios = [role_priority(tree.node_role[leaf]) for leaf in chosen]
    assert prios[0] == 0 and 2 in prios
    # Sub-agent contexts share no trainable token with the main agent's, so every main
    # path is admitted before the first sub-agent path.
    first_sub = prios.index(2)
    assert 0 not in prios[first_sub:]
