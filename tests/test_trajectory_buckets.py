"""Row buckets: rows of a few lengths, checked per micro-step against a naive reference.

Every check runs on what a trainer sees, `batch.micro_step(m)` cut to its shape: for
every trained token the reference rebuilds the context the tree mask gives it from the
row alone and compares it with the prompt + output prefix of a call that generated it
(`test_trajectory_process`), so buckets can never change what trains under what context.
"""

import itertools
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trajectory_process import (
    PAD,
    check_structure,
    executions,
    generated_prefixes,
    small_synthetic,
    trained_pairs,
)

from gyrejax.trajectory import Execution, ModelCall, process
from gyrejax.trajectory.buckets import choose_lengths, rows_per_micro_step_for
from gyrejax.trajectory.microsteps import assign_bucketed_micro_steps
from gyrejax.trajectory.process import ContextTooLong


def micro_step_views(batch):
    """Each micro-step as a batch-like object of its own shape (what a trainer gets)."""
    views = []
    for m in range(batch.num_micro_steps):
        arrays = batch.micro_step(m)
        assert arrays["tokens"].shape == batch.micro_step_shape(m)
        views.append(
            types.SimpleNamespace(
                **arrays,
                rows_per_micro_step=arrays["tokens"].shape[0],
                execution_ids=batch.execution_ids,
            )
        )
    return views


def check_bucketed(batch, menu, cap, row_length, rows_per_step, pad_id=PAD):
    """Shape contract, then the naive per-token check on every micro-step."""
    lengths = batch.row_lengths
    used = sorted({int(x) for x in lengths})
    assert set(used) <= set(menu) and len(used) <= cap
    assert batch.stats.row_shapes == len(used)
    assert batch.stats.packed_tokens == int(lengths.sum())
    s = batch.stats
    assert s.padding_tokens + s.repeated_tokens + s.admitted_tokens == s.packed_tokens
    # Past its length a row is padding only: cutting it to its shape loses nothing.
    past = np.arange(batch.row_length)[None, :] >= lengths[:, None]
    assert np.all(batch.execution_index[past] == -1) and np.all(batch.loss_weight[past] == 0)
    offsets = batch.micro_step_offsets
    assert offsets[0] == 0 and offsets[-1] == batch.num_rows and np.all(np.diff(offsets) > 0)
    pairs = []
    for view in micro_step_views(batch):
        rows, length = view.tokens.shape
        per = rows_per_micro_step_for(
            length, row_length=row_length, rows_per_micro_step=rows_per_step
        )
        assert rows == per
        check_structure(view, pad_id)
        pairs += trained_pairs(view)
    return pairs


def checked(exs, *, row_length, menu, cap, rows_per_step=1, **kw):
    batch = process(
        exs, row_length=row_length, row_lengths=menu, max_row_shapes=cap,
        rows_per_micro_step=rows_per_step, pad_id=PAD, **kw,
    )  # fmt: skip
    pairs = check_bucketed(batch, menu, cap or len(menu), row_length, rows_per_step)
    return batch, pairs


@settings(max_examples=60, deadline=None)
@given(
    executions(max_calls=8),
    st.sets(st.sampled_from([8, 12, 16, 20, 24, 32, 48]), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([None, 2]),
    st.integers(0, 3),
)
def test_buckets_match_naive_reference(exs, lengths, cap, rows_per_step, j_max, seed):
    menu = sorted(lengths | {40})  # calls reach 16 tokens; 40 holds them all
    base = menu[len(menu) // 2]
    batch, pairs = checked(
        exs, row_length=base, menu=menu, cap=cap, rows_per_step=rows_per_step, j_max=j_max,
        seed=seed, vocab_size=4,
    )  # fmt: skip
    keys = [(ex, seq) for ex, seq, *_ in pairs]
    assert len(keys) == len(set(keys)), "a tree token was trained twice"
    refs = {ex.execution_id: generated_prefixes(ex) for ex in exs}
    for ex, seq, lp, ver, _ in pairs:
        assert refs[ex][seq] == (lp, ver)
    # Admission does not depend on packing: the same tokens train as with one length.
    single = process(exs, row_length=40, j_max=j_max, seed=seed, pad_id=PAD)
    assert set(keys) == {(ex, seq) for ex, seq, *_ in trained_pairs(single)}
    if j_max is None:
        assert set(keys) == {(e, seq) for e, ref in refs.items() for seq in ref}
    w = sum(p[4] for p in pairs)
    assert w == pytest.approx(1.0 if pairs else 0.0, rel=1e-5)
    # Never worse than any one allowed length with the same micro-step shape.
    longest_call = max((c.length for ex in exs for c in ex.calls), default=0)
    for length in menu:
        if length < longest_call:
            continue
        per = rows_per_micro_step_for(length, row_length=base, rows_per_micro_step=rows_per_step)
        one = process(exs, row_length=length, j_max=j_max, seed=seed, rows_per_micro_step=per)
        assert batch.stats.packed_tokens <= one.stats.packed_tokens


def test_default_is_one_length():
    exs = small_synthetic(3)
    batch = process(exs, row_length=96, j_max=None, rows_per_micro_step=2, pad_id=PAD)
    assert batch.shapes == ((2, 96),)
    assert np.all(batch.row_lengths == 96) and batch.stats.row_shapes == 1
    np.testing.assert_array_equal(batch.micro_step_offsets, np.arange(0, batch.num_rows + 1, 2))
    np.testing.assert_array_equal(batch.micro_step(1)["tokens"], batch.tokens[2:4])


def chain_execution(ex_id, prompt_len, output_len):
    prompt, output = [1] * prompt_len, [2] * output_len
    logprobs, versions = [-1.0] * output_len, [0] * output_len
    call = ModelCall(ex_id, 0, "main", "main", prompt, output, logprobs, versions, "stop")
    return Execution(ex_id, "t", "g", [call], "finished", 1.0)


def test_short_buckets_take_the_remainder():
    # Chains of 90 tokens fill rows of 96 one each; the last one of 20 needs only 24.
    exs = [chain_execution(f"e{i}", 80, 10) for i in range(3)] + [chain_execution("s", 15, 5)]
    one = process(exs, row_length=96, j_max=None, pad_id=PAD)
    assert one.stats.packed_tokens == 4 * 96
    # Base shape [1, 24]: rows of 96 (over a sequence axis) and of 24 are one a step.
    batch, _ = checked(exs, row_length=24, menu=(24, 48, 96), cap=None, j_max=None)
    assert batch.stats.packed_tokens == 3 * 96 + 24
    assert batch.shapes == ((1, 96), (1, 24))
    capped, _ = checked(exs, row_length=24, menu=(24, 48, 96), cap=1, j_max=None)
    assert capped.stats.packed_tokens == one.stats.packed_tokens
    # Base shape [1, 96]: four rows of 24 make one micro-step, as many tokens as a row
    # of 96, so buckets below the base length never save a token; fewer shapes win.
    same, _ = checked(exs, row_length=96, menu=(24, 48, 96), cap=None, j_max=None)
    assert same.stats.packed_tokens == one.stats.packed_tokens and same.shapes == ((1, 96),)


def test_cap_on_shapes_is_respected_and_costs_at_most_what_it_saves():
    exs = small_synthetic(4)
    menu = (24, 32, 48, 64, 96)
    packed = []
    for cap in (1, 2, 3, 5):
        batch, _ = checked(exs, row_length=96, menu=menu, cap=cap, j_max=None)
        assert len(batch.shapes) <= cap
        packed.append(batch.stats.packed_tokens)
    assert packed == sorted(packed, reverse=True)  # a looser cap is never worse


def test_longer_rows_repeat_less_context():
    # One execution whose tree is much bigger than a row of 96 (see test_trajectory_process).
    exs = small_synthetic(5, turns=(20, 30), retry_prob=0.0, sub_agent_prob=0.0)[:1]
    one = process(exs, row_length=96, j_max=None, pad_id=PAD)
    assert one.stats.repeated_tokens > 0
    batch, pairs = checked(exs, row_length=96, menu=(96, 192, 384), cap=None, j_max=None)
    assert batch.stats.repeated_tokens < one.stats.repeated_tokens
    assert batch.stats.packed_tokens <= one.stats.packed_tokens
    assert {seq for _, seq, *_ in pairs} == set(generated_prefixes(exs[0]))


def test_micro_steps_keep_the_token_budget():
    exs = small_synthetic(6)
    batch, _ = checked(exs, row_length=96, menu=(24, 48, 96), cap=None, rows_per_step=2)
    for rows, length in batch.shapes:
        assert rows == max(1, 2 * 96 // length)


def test_bad_menus_are_refused():
    exs = small_synthetic(1)
    for bad in ([], [0, 96], "96", [96.0]):
        with pytest.raises(ValueError, match="row_lengths"):
            process(exs, row_length=96, row_lengths=bad)
    with pytest.raises(ValueError, match="max_row_shapes"):
        process(exs, row_length=96, row_lengths=[96], max_row_shapes=0)
    longest = max(c.length for ex in exs for c in ex.calls)
    with pytest.raises(ValueError, match="row_length"):
        process(exs, row_length=96, row_lengths=[longest - 1])


def test_tree_longer_than_every_row_names_the_length_to_add():
    # A call of 70 tokens with rows of at most 64: refused, naming what would hold it.
    exs = [chain_execution("long", 60, 10), chain_execution("short", 10, 5)]
    with pytest.raises(ContextTooLong) as info:
        process(exs, row_length=32, row_lengths=[16, 32, 64], pad_id=PAD)
    e = info.value
    assert (e.execution_id, e.call_id, e.length, e.longest, e.suggested) == ("long", 0, 70, 64, 96)
    for piece in ["'long' call 0", "70", "row_length 64", "train.row_lengths", "96"]:
        assert piece in str(e), (piece, str(e))
    # The suggested length added to the menu: the tree trains whole, in one longer row.
    menu = [16, 32, 64, 96]
    batch = process(exs, row_length=32, row_lengths=menu, j_max=None, pad_id=PAD)
    pairs = check_bucketed(batch, menu, len(menu), 32, 1)
    assert (batch.row_lengths == 96).sum() == 1 and batch.stats.repeated_tokens == 0
    assert {(x, s) for x, s, *_ in pairs} == {
        (x.execution_id, s) for x in exs for s in generated_prefixes(x)
    }


def reference_choice(fills, allowed, cap, base, r):
    """Plain loops over every subset: the fewest packed tokens (micro-step padding in)."""
    best = None
    for size in range(1, cap + 1):
        for subset in itertools.combinations(allowed, size):
            if max(subset) < max(fills):
                continue
            counts = {}
            for f in fills:
                fit = min(x for x in subset if x >= f)
                counts[fit] = counts.get(fit, 0) + 1
            total = 0
            for length, n in counts.items():
                per = max(1, r * base // length)
                total += -(-n // per) * per * length
            best = total if best is None else min(best, total)
    return best


def test_choose_lengths_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        allowed = sorted(rng.choice([8, 16, 24, 32, 64, 128], rng.integers(1, 5), replace=False))
        fills = rng.integers(1, allowed[-1] + 1, rng.integers(1, 9))
        cap, r = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        choice = choose_lengths(fills, allowed, cap, base_length=32, rows_per_micro_step=r)
        assert choice.packed_tokens == reference_choice(fills.tolist(), allowed, cap, 32, r)
        assert len(choice.lengths) <= cap and np.all(choice.row_length >= fills)


def test_bucketed_micro_steps_are_one_length_each():
    costs = np.array([5.0, 1.0, 4.0, 2.0, 3.0, 6.0])
    lengths = np.array([8, 4, 8, 4, 4, 8])
    order, ordered, offsets = assign_bucketed_micro_steps(costs, lengths, {8: 2, 4: 2})
    assert sorted(order.tolist()) == list(range(8))  # rows 6, 7: one padding row each
    for a, b in itertools.pairwise(offsets.tolist()):
        assert len(set(ordered[a:b].tolist())) == 1
    real = order < len(costs)
    np.testing.assert_array_equal(lengths[order[real]], ordered[real])
