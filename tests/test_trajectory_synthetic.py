"""The synthetic trace generator: deterministic, agent-shaped, within its limits."""

import itertools

import numpy as np
import pytest

from gyrejax.trajectory import SyntheticConfig, generate_executions, process


def test_deterministic_and_agent_shaped():
    kw = dict(turns=(30, 60), sub_agent_prob=0.2, retry_prob=0.1, compaction_budget=1500)
    a = generate_executions(2, 3, seed=4, **kw)
    b = generate_executions(2, 3, seed=4, **kw)
    assert a == b
    assert a != generate_executions(2, 3, seed=5, **kw)
    roles = {c.role for ex in a for c in ex.calls}
    assert roles == {"main", "main_summary", "sub_agent", "sub_agent_summary"}
    cfg = SyntheticConfig(**kw)
    for ex in a:
        calls = ex.sorted_calls()
        assert [c.call_id for c in calls] == list(range(len(calls)))
        assert max(c.length for c in calls) <= cfg.longest_call() <= cfg.max_call_tokens
        for c in calls:
            assert np.all(c.logprobs <= 0) and c.versions.min() >= 0
            assert c.finished_at > c.started_at
        # Every main call's prompt extends the previous main context (or restarts after
        # a summary, or retries the same prompt).
        main = [c for c in calls if c.agent_id == "main"]
        for prev, cur in itertools.pairwise(main):
            seq = np.concatenate([prev.prompt_ids, prev.output_ids])
            head = cur.prompt_ids[: len(seq)]
            extends = len(cur.prompt_ids) > len(seq) and np.array_equal(head, seq)
            retry = np.array_equal(cur.prompt_ids, prev.prompt_ids)
            assert extends or retry or prev.role == "main_summary" or cur.role == "main_summary"
    groups = {}
    for ex in a:
        groups.setdefault(ex.group_id, set()).add(ex.task_id)
        assert ex.status in ("finished", "timed_out") and ex.reward is not None
    assert all(len(tasks) == 1 for tasks in groups.values())


def test_default_traces_have_large_naive_to_unique_ratio():
    exs = generate_executions(1, 2, seed=0, turns=(100, 120))
    stats = process(exs, row_length=8192).stats
    assert stats.naive_over_unique > 15


def test_statuses_and_config_checks():
    exs = generate_executions(
        2, 10, seed=0, turns=(3, 5), no_artifact_prob=0.3, eval_failed_prob=0.3, timeout_prob=0.2
    )
    statuses = {ex.status for ex in exs}
    assert statuses == {"finished", "timed_out", "no_artifact", "eval_failed"}
    assert process(exs, row_length=8192).stats.executions_dropped == sum(
        ex.status == "eval_failed" for ex in exs
    )
    with pytest.raises(ValueError, match="max_call_tokens"):
        SyntheticConfig(compaction_budget=9000)
    with pytest.raises(ValueError, match="turns"):
        SyntheticConfig(turns=(5, 2))
