"""End-to-end properties of `process`, checked against a naive per-call reference.

The reference never looks at the tree: for every trained token it rebuilds the context
the packed mask gives that token (keys visible to its pred_index query, in row order)
and checks that it is exactly the prompt + output prefix of a call that generated it.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyrejax.trajectory import (
    Execution,
    ModelCall,
    admission_rng,
    admit_paths,
    build_tree,
    generate_executions,
    process,
)

ROLES = ("main", "main_summary", "sub_agent", "sub_agent_summary")
PAD = 7


@st.composite
def executions(draw, max_execs=4, vocab=4, max_calls=7, max_len=16):
    """Executions whose calls extend, fork, retry (sometimes repeating) and restart."""
    out = []
    n_exec = draw(st.integers(1, max_execs))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=4)
    for e in range(n_exec):
        seqs, raw = [], []
        for _ in range(draw(st.integers(0, max_calls))):
            kind = draw(st.sampled_from(["extend", "fork", "retry", "restart"]))
            if kind == "retry" and raw:
                prompt, prev_out = draw(st.sampled_from(raw))
                output = list(prev_out) if draw(st.booleans()) else draw(tokens)
            else:
                base = draw(st.sampled_from(seqs)) if seqs and kind != "restart" else []
                cut = len(base) if kind == "extend" else draw(st.integers(0, len(base)))
                prompt = base[:cut] + draw(tokens)
                prompt = prompt or [draw(st.integers(0, vocab - 1))]
                output = draw(tokens)
            prompt, output = prompt[:max_len], output[: max(0, max_len - len(prompt[:max_len]))]
            seqs.append(prompt + output)
            raw.append((prompt, output))
        ids = draw(st.permutations(list(range(len(raw)))))
        ex_id = f"ex/{e}"
        calls = [
            ModelCall(
                execution_id=ex_id,
                call_id=cid,
                agent_id=draw(st.sampled_from(["main", "sub-1"])),
                role=draw(st.sampled_from(ROLES)),
                prompt_ids=prompt,
                output_ids=output,
                logprobs=[-(cid + 1) / 8 - j / 64 for j in range(len(output))],
                versions=[cid % 3] * len(output),
                finish_reason="stop",
            )
            for (prompt, output), cid in zip(raw, ids, strict=True)
        ]
        out.append(
            Execution(
                execution_id=ex_id,
                task_id="t",
                group_id=f"g{draw(st.integers(0, 1))}",
                calls=calls,
                status="finished",
                reward=float(draw(st.integers(0, 4))),
            )
        )
    return out


def generated_prefixes(execution):
    """{prefix tuple: (logprob, version)} of generated tokens, first (lowest call_id) wins."""
    ref = {}
    for c in sorted(execution.calls, key=lambda c: c.call_id):
        seq = np.concatenate([c.prompt_ids, c.output_ids]).tolist()
        p = len(c.prompt_ids)
        for j in range(len(c.output_ids)):
            ref.setdefault(tuple(seq[: p + j + 1]), (float(c.logprobs[j]), int(c.versions[j])))
    return ref


def check_structure(batch, pad_id=PAD):
    """Mask invariants that hold for every token, trained or not."""
    rows, length = batch.tokens.shape
    assert rows % batch.rows_per_micro_step == 0
    idx = np.arange(length)
    for r in range(rows):
        se, ei, pos = batch.subtree_end[r], batch.execution_index[r], batch.positions[r]
        pad = ei < 0
        assert np.all(batch.tokens[r][pad] == pad_id)
        assert np.all(pos[pad] == 0) and np.all(se[pad] == idx[pad] + 1)
        assert np.all(batch.pred_index[r][pad] == -1)
        for name in ("loss_weight", "advantage", "behavior_logprob", "version"):
            assert np.all(getattr(batch, name)[r][pad] == 0), name
        for k in range(length):
            assert k < se[k] <= length
            seen = slice(k + 1, se[k])
            # Everything a key is visible to is a deeper token of the same execution:
            # separate trees (and executions) in one row never see each other.
            assert np.all(ei[seen] == ei[k]) and np.all(pos[seen] > pos[k])
        for q in np.flatnonzero(~pad):
            keys = np.flatnonzero((idx <= q) & (q < se))
            assert pos[keys].tolist() == list(range(pos[q] + 1)), "context is not a path"
            p = batch.pred_index[r, q]
            if pos[q] == 0:
                assert p == -1
            else:
                assert keys[-2] == p


def trained_pairs(batch):
    """[(execution_id, context tuple, logprob, version, weight)] per trained token."""
    out = []
    length = batch.tokens.shape[1]
    idx = np.arange(length)
    for r, i in zip(*np.nonzero(batch.loss_weight > 0), strict=True):
        q = batch.pred_index[r, i]
        assert q >= 0
        keys = np.flatnonzero((idx <= q) & (q < batch.subtree_end[r]))
        seq = (*batch.tokens[r, keys].tolist(), int(batch.tokens[r, i]))
        positions = [*batch.positions[r, keys].tolist(), int(batch.positions[r, i])]
        assert positions == list(range(len(seq)))
        ex = batch.execution_ids[batch.execution_index[r, i]]
        out.append(
            (
                ex,
                seq,
                float(batch.behavior_logprob[r, i]),
                int(batch.version[r, i]),
                float(batch.loss_weight[r, i]),
            )
        )
    return out


def check_weights(batch):
    w = batch.loss_weight.astype(np.float64)
    trained = sorted({int(e) for e in batch.execution_index[batch.loss_weight > 0]})
    if not trained:
        assert w.sum() == 0
        return
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-5)
    for e in trained:
        np.testing.assert_allclose(w[batch.execution_index == e].sum(), 1 / len(trained), rtol=1e-5)


def grpo_reference(executions, ddof=1):
    groups = {}
    for ex in executions:
        groups.setdefault(ex.group_id, []).append(ex.reward)
    out = {}
    for ex in executions:
        r = np.asarray(groups[ex.group_id], np.float64)
        # ddof=1: rl.advantage_std's default, the unbiased std; a group of one: 0.
        adv = (ex.reward - r.mean()) / (r.std(ddof=ddof) + 1e-6) if len(r) > 1 else 0.0
        out[ex.execution_id] = adv
    return out


def check_advantages(batch, executions, ddof=1):
    ref = grpo_reference(executions, ddof)
    for e, ex_id in enumerate(batch.execution_ids):
        np.testing.assert_allclose(batch.execution_advantage[e], ref[ex_id], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(
            batch.advantage[batch.execution_index == e], batch.execution_advantage[e]
        )


def leaf_sequences(tree, leaves):
    out = []
    for leaf in leaves:
        nodes, n = [], leaf
        while n > 0:
            nodes.append(n)
            n = int(tree.node_parent[n])
        seq = []
        for n in reversed(nodes):
            seq.extend(tree.tokens[tree.node_start[n] : tree.node_end[n]].tolist())
        out.append(seq)
    return out


@settings(max_examples=150, deadline=None)
@given(
    executions(max_calls=9),
    st.sampled_from([None, 1, 2, 5]),
    st.one_of(st.integers(16, 22), st.integers(23, 40)),
    st.integers(1, 3),
    st.integers(0, 3),
)
def test_process_matches_naive_reference(exs, j_max, row_length, rows_per_step, seed):
    batch = process(
        exs, row_length=row_length, j_max=j_max, seed=seed, rows_per_micro_step=rows_per_step,
        pad_id=PAD, vocab_size=4,
    )  # fmt: skip
    check_structure(batch)
    check_weights(batch)
    check_advantages(batch, exs)
    pairs = trained_pairs(batch)
    keys = [(ex, seq) for ex, seq, *_ in pairs]
    assert len(keys) == len(set(keys)), "a tree token was trained twice"
    by_id = {ex.execution_id: ex for ex in exs}
    refs = {ex_id: generated_prefixes(ex) for ex_id, ex in by_id.items()}
    for ex, seq, lp, ver, _ in pairs:
        assert refs[ex][seq] == (lp, ver)
    if j_max is None:
        expected = {(ex_id, seq) for ex_id, ref in refs.items() for seq in ref}
    else:
        expected = set()
        for ex in exs:
            tree = build_tree(list(ex.calls))
            _, leaves = admit_paths(tree, j_max, admission_rng(seed, ex.execution_id))
            assert len(leaves) <= j_max
            for path in leaf_sequences(tree, leaves):
                for k in range(1, len(path) + 1):
                    if tuple(path[:k]) in refs[ex.execution_id]:
                        expected.add((ex.execution_id, tuple(path[:k])))
    assert set(keys) == expected
    s = batch.stats
    assert s.padding_tokens + s.repeated_tokens + s.admitted_tokens == s.packed_tokens
    assert s.admitted_trainable_tokens == len(keys)


def test_advantage_std_reaches_the_estimator():
    """process(advantage_std=...) picks GRPO's std: the unbiased one by default (ddof=1),
    the population one when asked; anything else is refused."""
    exs = small_synthetic(3)
    assert len({ex.group_id for ex in exs}) < len(exs)  # groups of several
    for ddof, options in (
        (1, {}),
        (1, {"advantage_std": "unbiased"}),
        (0, {"advantage_std": "population"}),
    ):
        check_advantages(process(exs, row_length=96, vocab_size=40, **options), exs, ddof)
    unbiased = process(exs, row_length=96, vocab_size=40).execution_advantage
    population = process(exs, row_length=96, vocab_size=40, advantage_std="population")
    assert np.abs(population.execution_advantage - unbiased).max() > 1e-3
    with pytest.raises(ValueError, match=r"advantage_std must be one of unbiased, population"):
        process(exs, row_length=96, advantage_std="ddof1")


def test_pass_shaping_gives_partial_credit_no_advantage():
    """reward_shaping="pass": the estimator sees 1 for a reward of 1 (every check) and 0
    for anything less, so a group of partial rewards without a pass has no advantage;
    the batch still reports each execution's own reward."""
    exs = small_synthetic(4)
    partial = [1.0, 0.5, 0.9, 0.0, 1.0, 0.99]
    exs = [dataclasses.replace(ex, reward=partial[i % len(partial)]) for i, ex in enumerate(exs)]
    passes = [dataclasses.replace(ex, reward=float(ex.reward >= 1.0)) for ex in exs]
    batch = process(exs, row_length=96, vocab_size=40, reward_shaping="pass")
    check_advantages(batch, passes)
    as_is = process(exs, row_length=96, vocab_size=40)
    assert np.abs(as_is.execution_advantage - batch.execution_advantage).max() > 0.1
    by_id = {ex.execution_id: ex.reward for ex in exs}
    np.testing.assert_allclose(batch.execution_reward, [by_id[i] for i in batch.execution_ids])
    with pytest.raises(ValueError, match=r"reward shaping 'binary'; expected one of as_is, pass"):
        process(exs, row_length=96, vocab_size=40, reward_shaping="binary")


def small_synthetic(seed, **kw):
    cfg = dict(
        turns=(3, 10), tool_output_tokens=(1, 10), model_output_tokens=(1, 8),
        summary_tokens=(2, 8), system_prompt_tokens=10, task_tokens=(2, 6),
        compaction_budget=60, sub_agent_prob=0.3, sub_agent_turns=(1, 4), retry_prob=0.3,
        retry_repeat_prob=0.5, timeout_prob=0.3, vocab_size=40, max_call_tokens=96,
    )  # fmt: skip
    cfg.update(kw)
    return generate_executions(2, 3, seed=seed, **cfg)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([None, 3]))
def test_synthetic_traces_match_reference(seed, j_max):
    exs = small_synthetic(seed)
    batch = process(exs, row_length=96, j_max=j_max, seed=seed, pad_id=PAD, vocab_size=40)
    check_structure(batch)
    check_weights(batch)
    check_advantages(batch, exs)
    pairs = trained_pairs(batch)
    refs = {ex.execution_id: generated_prefixes(ex) for ex in exs}
    keys = [(ex, seq) for ex, seq, *_ in pairs]
    assert len(keys) == len(set(keys))
    for ex, seq, lp, ver, _ in pairs:
        assert refs[ex][seq] == (lp, ver)
    if j_max is None:
        assert set(keys) == {(e, seq) for e, ref in refs.items() for seq in ref}


def test_tree_bigger_than_row_is_split_with_repeated_context():
    # One execution: shared system prefix, many long branches; rows hold only a few.
    exs = small_synthetic(5, turns=(20, 30), retry_prob=0.0, sub_agent_prob=0.0)[:1]
    batch = process(exs, row_length=96, j_max=None, pad_id=PAD)
    s = batch.stats
    assert s.admitted_tokens > 96 and s.rows > 1
    assert s.repeated_tokens > 0
    assert s.padding_tokens + s.repeated_tokens + s.admitted_tokens == s.packed_tokens
    assert s.waste_fraction == (s.padding_tokens + s.repeated_tokens) / s.packed_tokens
    check_structure(batch)
    pairs = trained_pairs(batch)
    ref = generated_prefixes(exs[0])
    assert {seq for _, seq, *_ in pairs} == set(ref)


def test_unit_that_fits_no_row_is_opened_into_other_rows_tails():
    def ex(ex_id, seqs):
        calls = [
            ModelCall(ex_id, i, "main", "main", p, o, [-1.0] * len(o), [0] * len(o), "stop")
            for i, (p, o) in enumerate(seqs)
        ]
        return Execution(ex_id, "t", "g", calls, "finished", 1.0)

    big = [([1] * 13, [2])]  # a 14-token chain: rows of 20 keep 6 free
    forked = [([0, 1], [2, 3, 4, 5]), ([0, 2], [3, 3, 3, 3])]  # root 0 + two 5-token branches
    exs = [ex("b", big), ex("c", big), ex("a", forked)]
    batch = process(exs, row_length=20, j_max=None, pad_id=PAD)
    assert batch.stats.rows == 2  # without opening "a" (11 tokens) would need a third row
    assert batch.stats.repeated_tokens == 1  # its root token, repeated in the second row
    check_structure(batch)
    pairs = trained_pairs(batch)
    assert {(e, s) for e, s, *_ in pairs} == {
        (x.execution_id, s) for x in exs for s in generated_prefixes(x)
    }


def test_same_seed_same_batch_and_order_independent_admission():
    exs = small_synthetic(11)
    a = process(exs, row_length=96, seed=4, j_max=2)
    b = process(exs, row_length=96, seed=4, j_max=2)
    for name in ("tokens", "subtree_end", "pred_index", "loss_weight", "positions"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.stats == b.stats
    c = process(list(reversed(exs)), row_length=96, seed=4, j_max=2)
    per_exec = lambda batch: {(ex, seq) for ex, seq, *_ in trained_pairs(batch)}
    assert per_exec(a) == per_exec(c)
    d = process(exs, row_length=96, seed=5, j_max=2)
    assert a.stats.admitted_tokens > 0 and isinstance(d.stats.admitted_tokens, int)


def test_micro_steps_partition_rows():
    exs = small_synthetic(2)
    batch = process(exs, row_length=96, j_max=None, rows_per_micro_step=4, pad_id=PAD)
    assert batch.num_rows % 4 == 0
    assert batch.num_micro_steps == batch.num_rows // 4 == batch.stats.micro_steps
    parts = [batch.micro_step(m) for m in range(batch.num_micro_steps)]
    np.testing.assert_array_equal(np.concatenate([p["tokens"] for p in parts]), batch.tokens)
    assert all(p["loss_weight"].shape == (4, 96) for p in parts)
    assert batch.stats.padding_rows == int(np.sum((batch.execution_index < 0).all(axis=1)))


def test_empty_input_gives_empty_batch():
    batch = process([], row_length=32)
    assert batch.tokens.shape == (0, 32)
    assert batch.num_micro_steps == 0
    assert batch.stats.waste_fraction == 0.0
