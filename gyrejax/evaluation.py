"""The figures of a held-out evaluation: pass@k and one evaluation's report (pure NumPy).

An execution *passes* when its reward is at least `PASS_REWARD` = 1: mini_repo has no
success threshold of its own (its reward is the share of hidden checks passed), so a
pass is every check passing. An execution whose evaluation failed past its retry budget
(reward None) counts as reward 0 and a failure, and is counted in `eval_failed`.

Per task, with n sampled executions of which c pass, pass@k is the unbiased estimator
1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code"): the chance that k of the n, drawn without replacement, include a pass. The
report averages it over tasks, overall and per task family (`task_family`). Greedy
figures come from one temperature-0 execution per task (its pass@1 is the share of
tasks it passes).

The RL loop's dispatch of evaluations is gyrejax/loop/evaluation.py.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from gyrejax.trajectory.advantages import PASS_REWARD


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of them passing,
    drawn without replacement, include a pass (a product, exact without big binomials).

    Raises:
      ValueError: not 0 <= c <= n or not 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): expected 0 <= c <= n and 1 <= k <= n")
    if n - c < k:  # every k-subset holds a pass
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def task_family(task_id: str, data: Mapping | None = None) -> str:
    """A task's family: its task-file line's "family" where it names one, else its id
    without the last "-" part (mini_repo: "mini_repo-L2-<hash of the spec>" ->
    "mini_repo-L2", its level; an id without "-" is its own family)."""
    family = (data or {}).get("family")
    if isinstance(family, str) and family:
        return family
    head, sep, _ = task_id.rpartition("-")
    return head if sep and head else task_id


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """One held-out task's rewards: its greedy execution's and its sampled ones' (None:
    the evaluation failed past its retry budget); `sampled_empty`: which sampled ones
    left an empty workspace (status no_artifact, reward 0), () where not known."""

    task_id: str
    family: str
    greedy: float | None
    sampled: tuple[float | None, ...]
    sampled_empty: tuple[bool, ...] = ()


def passed(reward: float | None) -> bool:
    return reward is not None and reward >= PASS_REWARD


def _figures(results: Sequence[TaskResult], k: int) -> dict:
    def reward(r: float | None) -> float:
        return 0.0 if r is None else float(r)

    greedy = [r.greedy for r in results]
    sampled = [r.sampled for r in results]
    # What a policy gains splits in two: fewer empty workspaces, and better work where
    # it produced something (the mean reward of the sampled executions that did).
    known = all(len(r.sampled_empty) == len(r.sampled) for r in results)
    pairs = [
        (x, e) for r in results if known for x, e in zip(r.sampled, r.sampled_empty, strict=True)
    ]
    empty = [e for _, e in pairs]
    produced = [reward(x) for x, e in pairs if not e]
    return {
        "tasks": len(results),
        "greedy_reward": float(np.mean([reward(r) for r in greedy])),
        "greedy_pass@1": float(np.mean([passed(r) for r in greedy])),
        "sampled_reward": float(np.mean([reward(r) for s in sampled for r in s])),
        "sampled_pass@1": float(
            np.mean([pass_at_k(len(s), sum(map(passed, s)), 1) for s in sampled])
        ),
        "sampled_pass@k": float(
            np.mean([pass_at_k(len(s), sum(map(passed, s)), k) for s in sampled])
        ),
        "sampled_empty_rate": float(np.mean(empty)) if known and empty else None,
        "sampled_reward_produced": float(np.mean(produced)) if known and produced else None,
    }


def report(results: Sequence[TaskResult], k: int) -> dict:
    """One evaluation's figures, overall and per family (`families`, sorted by name):
    tasks, greedy reward and pass@1, sampled reward, pass@1 and pass@k, the share of
    sampled executions with an empty workspace and the mean reward of the others (None
    where the results do not say); `k`,
    `executions` and `eval_failed` (executions whose reward is None).

    Raises:
      ValueError: no results, or a task with fewer than k sampled executions.
    """
    if not results:
        raise ValueError("report: no task results")
    short = [r.task_id for r in results if len(r.sampled) < k]
    if short:
        raise ValueError(f"report: tasks {short} have fewer than k={k} sampled executions")
    by_family: dict[str, list[TaskResult]] = collections.defaultdict(list)
    for r in results:
        by_family[r.family].append(r)
    rewards = [x for r in results for x in (r.greedy, *r.sampled)]
    return {
        **_figures(results, k),
        "k": k,
        "pass_reward": PASS_REWARD,
        "executions": len(rewards),
        "eval_failed": sum(x is None for x in rewards),
        "families": {f: _figures(by_family[f], k) for f in sorted(by_family)},
    }
