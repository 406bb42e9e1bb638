"""Held-out evaluation: pass@k against a brute-force count over subsets, the report's
figures by hand, and the RL loop's evaluations (gyrejax/loop/evaluation.py) end to end on
the tiny smoke config: eval.jsonl at the right steps with sane figures, in the metrics,
the summary and a plot, and not one evaluation execution ever trained (`check_evaluations`,
run on test_runtime.py's colocate run, which carries the evaluation)."""

import dataclasses
import itertools
import json
import types

import numpy as np
import pytest
from conftest import read_jsonl

from gyrejax.evaluation import TaskResult, pass_at_k, report, task_family
from gyrejax.loop import Runtime
from gyrejax.loop.evaluation import Evaluation
from gyrejax.scheduler.policies import Role
from gyrejax.trajectory import ExecutionStore


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of the k-subsets of `outcomes` holding a pass, counted one by one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_counting_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            outcomes = [True] * c + [False] * (n - c)
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0


def test_pass_at_k_for_many_samples_and_bad_arguments():
    # Large n: the product form stays exact where binomials would overflow a float.
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    none_of_3 = np.prod([(1990 - i) / (2000 - i) for i in range(3)])  # C(1997,10)/C(2000,10)
    assert pass_at_k(2000, 3, 10) == pytest.approx(1 - none_of_3)
    for n, c, k in [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_task_family_from_the_line_or_the_id():
    assert task_family("mini_repo-L2-0123456789ab") == "mini_repo-L2"
    assert task_family("mini_repo-L2-0123456789ab", {"family": "hard"}) == "hard"
    assert task_family("plain") == "plain" and task_family("-x") == "-x"


def test_report_by_hand_overall_and_per_family():
    results = [
        TaskResult("a-L1-1", "a-L1", 1.0, (1.0, 0.5, 1.0), (False,) * 3),  # 2 of 3 pass
        TaskResult("a-L1-2", "a-L1", 0.5, (0.0, 0.0, 0.0), (True, True, False)),  # none
        TaskResult("a-L2-1", "a-L2", None, (1.0, None, 0.25), (False,) * 3),  # greedy failed
    ]
    r = report(results, k=2)
    assert r["sampled_empty_rate"] == pytest.approx(2 / 9)
    assert r["sampled_reward_produced"] == pytest.approx((2.5 + 0.0 + 1.25) / 7)
    assert report([dataclasses.replace(x, sampled_empty=()) for x in results], 2)[
        "sampled_empty_rate"
    ] is None  # fmt: skip
    assert r["tasks"] == 3 and r["k"] == 2 and r["executions"] == 12 and r["eval_failed"] == 2
    assert r["pass_reward"] == 1.0
    assert r["greedy_reward"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert r["greedy_pass@1"] == pytest.approx(1 / 3)
    assert r["sampled_reward"] == pytest.approx((2.5 + 0.0 + 1.25) / 9)
    outcomes = [[True, False, True], [False] * 3, [True, False, False]]
    assert r["sampled_pass@1"] == pytest.approx(np.mean([sum(o) / 3 for o in outcomes]))
    assert r["sampled_pass@k"] == pytest.approx(np.mean([brute_pass_at_k(o, 2) for o in outcomes]))
    assert list(r["families"]) == ["a-L1", "a-L2"]
    l1, l2 = r["families"]["a-L1"], r["families"]["a-L2"]
    assert l1["tasks"] == 2 and l1["greedy_pass@1"] == 0.5 and l1["sampled_pass@k"] == 0.5
    assert (
        l2["tasks"] == 1
        and l2["greedy_reward"] == 0.0
        and l2["sampled_pass@1"] == pytest.approx(1 / 3)
    )
    with pytest.raises(ValueError, match="fewer than k=4"):
        report(results, k=4)
    with pytest.raises(ValueError, match="no task results"):
        report([], k=1)


def test_an_evaluation_is_due_at_the_first_burst_boundary_at_or_after_a_multiple():
    config = types.SimpleNamespace(eval=types.SimpleNamespace(every_steps=2))
    trainer = types.SimpleNamespace(step=0)
    ctx = types.SimpleNamespace(config=config, trainer=trainer)
    evaluation = Evaluation(ctx, tasks=["a task"])
    evaluated = []
    for boundary in (1, 2, 3, 5, 6, 7, 8):  # bursts end at these steps (a resume, mu 1-2)
        trainer.step = boundary
        if evaluation.due():
            evaluated.append(boundary)
            evaluation.evaluated_step = boundary  # what `start` records
    assert evaluated == [2, 5, 6, 8]  # 4 fell inside the burst ending at 5
    assert not Evaluation(ctx, tasks=None).due()  # eval.every_steps = 0: never


def test_colocate_moves_to_training_wait_for_a_running_evaluation():
    ctx = types.SimpleNamespace(
        config=types.SimpleNamespace(eval=types.SimpleNamespace(every_steps=1))
    )
    evaluation = Evaluation(ctx, tasks=["a task"])
    R, T = Role.ROLLOUT, Role.TRAINING
    all_to_training = ((0, T), (1, T))
    assert evaluation.allowed(all_to_training, [R, R], external=False) == all_to_training
    evaluation.running = 1
    assert evaluation.allowed(all_to_training, [R, R], external=False) == ()
    assert evaluation.allowed(all_to_training, [R, R], external=True) == all_to_training
    one = ((0, T),)  # elastic and async leave a cell serving
    assert evaluation.allowed(one, [R, R], external=False) == one
    back = ((1, R),)  # a return to rollout is never held
    assert evaluation.allowed(back, [T, T], external=False) == back


def with_evaluations(c) -> None:
    """Held-out evaluation after every step, 2 tasks, 1 greedy + 2 sampled each: what
    `check_evaluations` expects. test_runtime.py's colocate run (no rollout cell while
    it trains: the hard case) carries it, so the suite runs one RL run, not two."""
    c.eval.every_steps, c.eval.num_tasks, c.eval.samples_per_task = 1, 2, 2


def record_trained_ids(runtime: Runtime) -> list[str]:
    """The execution ids every train step of `runtime` is given, appended as it runs."""
    trained_ids = []
    train_step = runtime.trainer.train_step

    def recording_train_step(batch):
        trained_ids.extend(batch.execution_ids)
        return train_step(batch)

    runtime.trainer.train_step = recording_train_step
    return trained_ids


def check_evaluations(tmp_path, runtime: Runtime, summary: dict, trained_ids: list[str]):
    """Evaluations ran at their steps, are in the metrics, summary and plot, and none of
    their executions was stored, logged as a group's or trained."""
    config = runtime.config
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [1, 2] and [e["version"] for e in evals] == [1, 2]
    tasks = [t.task.task_id for t in runtime.evaluation.tasks]
    for e in evals:
        assert e["tasks"] == 2 and e["k"] == 2 and e["executions"] == 2 * (1 + 2)
        assert [t["id"] for t in e["per_task"]] == tasks
        assert list(e["families"]) == ["mini_repo-L1"]
        for key in ("greedy_reward", "greedy_pass@1", "sampled_reward", "sampled_pass@1"):
            assert 0.0 <= e[key] <= 1.0, (key, e[key])
        assert e["sampled_pass@1"] <= e["sampled_pass@k"] <= 1.0
        # The weights evaluated: those published at the step (colocate samples it whole).
        assert e["versions"] == [e["version"], e["version"]]
        assert e["wall_s"] > 0 and e["start_s"] < e["time_s"]
    # In the metrics (a row carries what finished since the last), summary and plot.
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["eval"] is None
    assert rows[1]["eval"]["step"] == 1  # colocate trains step 2 once step 1's eval ended
    assert rows[1]["eval"]["sampled_pass@k"] == evals[0]["sampled_pass@k"]
    assert summary["eval"]["step"] == 2 and summary["evaluations"] == 2
    assert json.loads((tmp_path / "run_summary.json").read_text())["eval"] == summary["eval"]
    assert (tmp_path / "eval.png").stat().st_size > 0
    # Never trained: the steps trained the configured groups' executions and nothing else.
    stored = {e.execution_id for e in ExecutionStore(tmp_path / "executions")}
    groups = config.train.steps * config.rl.groups_per_step
    assert stored == {f"g{g}/{i}" for g in range(groups) for i in range(config.rl.group_size)}
    assert trained_ids and set(trained_ids) <= stored
    assert not [i for i in trained_ids if i.startswith("eval")]
    logged = [json.dumps(e) for e in read_jsonl(tmp_path / "dispatch.jsonl")]
    logged += [json.dumps(e) for e in read_jsonl(tmp_path / "executions.jsonl")]
    assert len(logged) == groups + len(stored) and not [x for x in logged if "eval" in x]
    assert sorted(r["groups"] for r in rows) == [["g0"], ["g1"]]
