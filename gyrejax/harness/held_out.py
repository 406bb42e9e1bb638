"""The held-out tasks of an evaluation, disjoint from every task the run's training can
draw (`eval.*` in the config; the RL loop's dispatch is gyrejax/loop/evaluation.py).

What training can draw (`training_tasks`), enumerated through the very draws it makes:

  * `harness.task_pool = K > 0`: the pool, `env.sample_tasks(K, seed=config.seed)`;
    RL groups and demonstrations draw only from it;
  * else each RL group seq < train.steps x rl.groups_per_step draws
    `draw_tasks(env, harness, 1, seed=seq, run_seed=config.seed)` (groups.py), and a
    warm start (`warmup.steps > 0`) `draw_tasks(..., warmup.demonstrations, seed=1)`
    (stages.py);
  * `rl.tasks_path`: every task of that file too.

The held-out tasks are either `eval.tasks_path` (environment task lines, as
`env.task_line` writes them; one naming a training task is refused) or `eval.num_tasks`
tasks of `env.sample_tasks(n, seed=eval.seed)` (the first ones that training cannot
draw; a task is left out when its id or its spec is a training task's: mini_repo's id is
a hash of its spec). A resume with more train.steps (harness.task_pool = 0) can draw more
training tasks: the split is computed again at its start, so it may then change.
"""

from __future__ import annotations

import dataclasses

from gyrejax.config import Config, ConfigError
from gyrejax.evaluation import task_family
from gyrejax.harness.tasks import draw_tasks, load_task_file


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """A held-out task: the environment's `task` (what the harness runs and the verifier
    scores) and its `family` (gyrejax.evaluation.task_family)."""

    task: object
    family: str


def training_tasks(config: Config, env) -> dict[str, str]:
    """Task id -> spec of every task the run's training can draw (module docstring)."""
    h = config.harness
    drawn = []
    if h.task_pool:
        drawn += env.sample_tasks(h.task_pool, seed=config.seed, difficulty=h.difficulty)
    else:
        if not config.rl.tasks_path:
            for seq in range(config.train.steps * config.rl.groups_per_step):
                drawn += draw_tasks(env, h, 1, seed=seq, run_seed=config.seed)
        if config.warmup.steps:
            demos = config.warmup.demonstrations
            drawn += draw_tasks(env, h, demos, seed=1, run_seed=config.seed)
    tasks = {t.task_id: t.spec for t in drawn}
    if config.rl.tasks_path:
        scorer = env if config.rl.reward == "environment" else None
        tasks.update({t.task_id: t.spec for t in load_task_file(config.rl.tasks_path, scorer)})
    return tasks


def held_out_tasks(config: Config, env) -> list[EvalTask]:
    """The evaluation's tasks (module docstring), in a fixed order.

    Raises:
      ConfigError: one line naming the eval field and its value: the task file cannot be
        read, is empty, has a bad line or names a training task; or the environment has
        too few tasks outside training's.
    """
    e = config.eval
    training = training_tasks(config, env)
    specs = set(training.values())
    if e.tasks_path:
        where = f"eval.tasks_path={e.tasks_path!r}"
        lines = load_task_file(e.tasks_path, env, field="eval.tasks_path")
        shared = [t.task_id for t in lines if t.task_id in training or t.env_task.spec in specs]
        if shared:
            raise ConfigError(
                f"config.{where}: {len(shared)} of its tasks can be drawn by training "
                f"(e.g. {shared[:3]}); held-out tasks must be disjoint from them"
            )
        return [EvalTask(t.env_task, task_family(t.task_id, t.data)) for t in lines]
    n = e.num_tasks
    # Each training task leaves out at most two candidates (one by id, one by spec), so
    # this many candidates always hold enough where the environment has them.
    limit = e.num_tasks + 2 * len(training)
    step_by_missing = False  # doubling n, until the environment runs out of tasks
    last = last_kept = 0  # the largest n drawn without running out; how many it kept
    while True:
        try:
            candidates = env.sample_tasks(n, seed=e.seed, difficulty=config.harness.difficulty)
        except ValueError as error:  # fewer than n tasks: try fewer, if not tried yet
            if step_by_missing or not last:
                raise ConfigError(
                    f"config.eval.num_tasks={e.num_tasks}: the environment has too few tasks "
                    f"outside the {len(training)} training can draw ({error})"
                ) from None
            step_by_missing, n = True, last + e.num_tasks - last_kept
            continue
        kept = [t for t in candidates if t.task_id not in training and t.spec not in specs]
        if len(kept) >= e.num_tasks:
            return [EvalTask(t, task_family(t.task_id)) for t in kept[: e.num_tasks]]
        if n >= limit:  # (an environment whose draws repeat a spec under two ids)
            raise ConfigError(
                f"config.eval.num_tasks={e.num_tasks}: only {len(kept)} of the environment's "
                f"first {n} tasks (eval.seed={e.seed}) are outside training's"
            )
        last, last_kept = n, len(kept)
        n = min(limit, n + e.num_tasks - len(kept) if step_by_missing else 2 * n)
