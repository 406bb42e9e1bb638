"""Tree tests: the radix tree against a naive set-of-prefixes reference."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyrejax.trajectory import Execution, ModelCall, build_tree, generate_executions

ROLES = ("main", "main_summary", "sub_agent", "sub_agent_summary")


def make_call(call_id, prompt, output, *, agent="main", role="main", ex="e0", lp=None, ver=None):
    n = len(output)
    return ModelCall(
        execution_id=ex,
        call_id=call_id,
        agent_id=agent,
        role=role,
        prompt_ids=np.asarray(prompt, np.int32),
        output_ids=np.asarray(output, np.int32),
        logprobs=np.asarray(lp if lp is not None else [-0.5 - call_id] * n, np.float32),
        versions=np.asarray(ver if ver is not None else [call_id] * n, np.int32),
        finish_reason="stop",
    )


@st.composite
def call_lists(draw, vocab=4, max_calls=8, max_len=20):
    """Calls that extend, fork, retry (sometimes repeating) and restart, in random order."""
    n = draw(st.integers(1, max_calls))
    seqs, calls = [], []
    tokens = st.lists(st.integers(0, vocab - 1), max_size=4)
    for _ in range(n):
        kind = draw(st.sampled_from(["extend", "fork", "retry", "restart"]))
        if kind == "retry" and calls:
            prev = draw(st.sampled_from(calls))
            prompt = list(prev[0])
            output = list(prev[1]) if draw(st.booleans()) else draw(tokens)
        else:
            base = draw(st.sampled_from(seqs)) if seqs and kind != "restart" else []
            cut = len(base) if kind == "extend" else draw(st.integers(0, len(base)))
            prompt = base[:cut] + draw(tokens)
            if not prompt:
                prompt = [draw(st.integers(0, vocab - 1))]
            output = draw(tokens)
        prompt, output = prompt[:max_len], output[: max(0, max_len - len(prompt))]
        seqs.append(prompt + output)
        calls.append((prompt, output))
    ids = draw(st.permutations(list(range(n))))
    out = []
    for (prompt, output), cid in zip(calls, ids, strict=True):
        n_out = len(output)
        lp = draw(st.lists(st.floats(-9, -0.125, width=32), min_size=n_out, max_size=n_out))
        out.append(
            make_call(
                cid,
                prompt,
                output,
                agent=draw(st.sampled_from(["main", "sub-1", "sub-2"])),
                role=draw(st.sampled_from(ROLES)),
                lp=lp,
                ver=[draw(st.integers(0, 3))] * len(output),
            )
        )
    return out


def reference(calls):
    """{prefix tuple: (trainable, logprob, version)} of all call prefixes, naively."""
    ref = {}
    for c in sorted(calls, key=lambda c: c.call_id):
        seq = np.concatenate([c.prompt_ids, c.output_ids]).tolist()
        p = len(c.prompt_ids)
        for k in range(1, len(seq) + 1):
            key = tuple(seq[:k])
            gen = k > p
            old = ref.get(key)
            if old is None or (gen and not old[0]):
                ref[key] = (
                    (True, float(c.logprobs[k - p - 1]), int(c.versions[k - p - 1]))
                    if gen
                    else (False, 0.0, 0)
                )
    return ref


def tree_prefixes(tree):
    """{prefix tuple: (trainable, logprob, version)} read off the tree."""
    out = {}
    path = {0: ()}
    order = [0]
    while order:
        node = order.pop()
        for child in tree.children[node]:
            order.append(child)
        if node == 0:
            continue
        start, end = tree.node_start[node], tree.node_end[node]
        assert tree.node_depth[node] == len(path[int(tree.node_parent[node])])
        seq = path[int(tree.node_parent[node])]
        for f in range(start, end):
            seq = (*seq, int(tree.tokens[f]))
            assert seq not in out, "a prefix appears twice in the tree"
            out[seq] = (
                bool(tree.trainable[f]),
                float(tree.logprob[f]),
                int(tree.version[f]),
            )
        path[node] = seq
    return out


@settings(max_examples=300, deadline=None)
@given(call_lists())
def test_tree_matches_naive_prefix_set(calls):
    tree = build_tree(calls)
    assert tree_prefixes(tree) == reference(calls)
    # Every real node holds tokens, and siblings start with distinct tokens.
    for node in range(1, tree.num_nodes):
        assert tree.node_end[node] > tree.node_start[node]
    for kids in tree.children:
        firsts = [int(tree.tokens[tree.node_start[k]]) for k in kids]
        assert len(firsts) == len(set(firsts))


def test_extend_in_place_keeps_one_node():
    calls = [make_call(0, [1, 2], [3, 4])]
    seq = [1, 2, 3, 4]
    for i in range(1, 20):
        seq = [*seq, 5, 6]
        calls.append(make_call(i, seq, [7]))
        seq = [*seq, 7]
    tree = build_tree(calls)
    assert tree.num_nodes == 2  # virtual root + one chain node
    assert tree.num_tokens == len(seq)
    assert tree.node_role[1] == "main"


def test_retry_that_repeats_is_one_token_trained_once_with_first_values():
    calls = [
        make_call(0, [1, 2], [3, 4], lp=[-1.0, -2.0], ver=[0, 0]),
        make_call(1, [1, 2], [3, 4], lp=[-3.0, -4.0], ver=[1, 1]),
    ]
    tree = build_tree(calls)
    assert tree.num_tokens == 4
    assert tree.trainable.tolist() == [False, False, True, True]
    np.testing.assert_array_equal(tree.logprob[2:], [-1.0, -2.0])
    np.testing.assert_array_equal(tree.version[2:], [0, 0])


def test_fork_splits_node_and_restart_is_new_root():
    calls = [
        make_call(0, [1, 2, 3], [4, 5]),
        make_call(1, [1, 2, 3], [6], role="main"),  # retry: fork at depth 3
        make_call(2, [9, 9], [8], role="main_summary"),  # matches nothing: new root
    ]
    tree = build_tree(calls)
    assert len(tree.children[0]) == 2
    root = tree.children[0][0]
    assert tree.node_end[root] - tree.node_start[root] == 3
    assert len(tree.children[root]) == 2
    assert tree.node_role[tree.children[0][1]] == "main_summary"


def test_later_prompt_containing_earlier_output_is_same_token():
    calls = [make_call(0, [1], [2, 3]), make_call(1, [1, 2, 3, 4], [5])]
    tree = build_tree(calls)
    assert tree.num_tokens == 5
    assert tree.trainable.tolist() == [False, True, True, False, True]


def test_greedy_outputs_are_context_and_a_later_sample_of_them_is_trained():
    """A greedy call's outputs are never trained as samples (they are counted); the same
    tokens sampled later by another call are trained with that call's values."""
    greedy = dataclasses.replace(make_call(0, [1, 2], [3, 4, 5]), temperature=0.0)
    sampled = dataclasses.replace(
        make_call(1, [1, 2], [3, 4, 6], agent="retry"), temperature=0.6, top_p=0.9, top_k=7
    )
    tree = build_tree([greedy])
    assert not tree.trainable.any() and tree.greedy_tokens == 3
    tree = build_tree([greedy, sampled])
    trained = np.flatnonzero(tree.trainable)
    assert tree.tokens[trained].tolist() == [3, 4, 6] and tree.greedy_tokens == 3
    np.testing.assert_array_equal(tree.logprob[trained], sampled.logprobs)
    np.testing.assert_allclose(tree.temperature[trained], 0.6)
    np.testing.assert_allclose(tree.top_p[trained], 0.9)
    assert tree.top_k[trained].tolist() == [7] * 3
    assert tree.temperature[~tree.trainable].tolist() == [1.0] * (tree.num_tokens - 3)
    # For SFT every output is a demonstration, read under the model's own distribution.
    tree = build_tree([greedy, sampled], demonstrations=True)
    assert tree.tokens[tree.trainable].tolist() == [3, 4, 5, 6] and tree.greedy_tokens == 0
    assert (tree.temperature == 1).all() and (tree.top_p == 1).all() and not tree.top_k.any()


def test_token_range_error_names_call():
    calls = [make_call(0, [1, 2], [3]), make_call(7, [1, 2, 3, 99], [4])]
    try:
        build_tree(calls, "ex-a", vocab_size=50)
    except ValueError as e:
        msg = str(e)
        assert "ex-a" in msg and "call 7" in msg and "99" in msg
    else:
        raise AssertionError("no error")


def test_synthetic_tree_unique_count_matches_reference():
    ex = generate_executions(1, 1, seed=3, turns=(8, 12), vocab_size=50)[0]
    tree = build_tree(list(ex.calls))
    ref = reference(list(ex.calls))
    assert tree.num_tokens == len(ref)
    assert int(tree.trainable.sum()) == sum(v[0] for v in ref.values())
    assert isinstance(ex, Execution)
