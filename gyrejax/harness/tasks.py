"""Where a run's tasks come from: fresh tasks, or draws from a fixed pool.

With `harness.task_pool = K > 0` every task is drawn from one pool of K tasks (fixed by
the run seed), so demonstrations and RL see the same tasks again: a tiny model can learn
them within a CPU budget. With 0, every draw samples new tasks.

External agents (`rl.agent = command`) may instead take their tasks from a JSONL file
(`rl.tasks_path`; `load_task_file`, `draw_file_task`). A line may carry "expected_s", its
expected wall time (e.g. its task family's median), which `scheduler.dispatch_order =
"longest_first"` dispatches by.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from gyrejax.config import ConfigError, HarnessConfig


def draw_tasks(env, config: HarnessConfig, n: int, *, seed: int, run_seed: int = 0) -> list:
    """`n` tasks for one batch (deterministic in `seed` and `run_seed`)."""
    if config.task_pool:
        pool = env.sample_tasks(config.task_pool, seed=run_seed, difficulty=config.difficulty)
        picks = np.random.default_rng([run_seed, seed]).integers(0, len(pool), n)
        return [pool[i] for i in picks]
    return env.sample_tasks(n, seed=seed, difficulty=config.difficulty)


@dataclasses.dataclass(frozen=True)
class FileTask:
    """A task from `rl.tasks_path`: `data` is its whole JSON line; `public` what the agent
    gets of it (GYREJAX_TASK): the line without the environment's private fields (those
    that locate the hidden task, e.g. mini_repo's seed and index); `env_task` the
    environment's own task, when the line names one (for `rl.reward = environment`);
    `expected_s` its line's "expected_s" (None: none)."""

    task_id: str
    spec: str
    data: dict
    env_task: object = None
    expected_s: float | None = None
    public: dict = dataclasses.field(default_factory=dict)


MAX_TASK_FILE_ERRORS = 20  # lines of a task file's error named one by one; then a count


def load_task_file(
    path: str,
    env=None,
    need_expected: bool = False,
    field: str = "rl.tasks_path",
    private_fields: tuple[str, ...] = (),
) -> list[FileTask]:
    """The tasks of a JSONL file, validated in full; with `env`, each line is also
    resolved to the environment's task (`env.task_from_dict`), so its verifier can score
    it. `need_expected`: every line must carry "expected_s" (a number > 0, seconds).
    `field`: the config field that names the file (errors name it). `private_fields`:
    keys never shown to the agent (also `env.private_task_fields`).

    Raises:
      ConfigError: naming `field`, then one line per bad line (its number and what is
        wrong), so a file is fixed in one pass.
    """
    where = f"config.{field}={path!r}"
    try:
        raw = Path(path).read_bytes().split(b"\n")
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    if env is not None and not hasattr(env, "task_from_dict"):
        raise ConfigError(
            f"{where}: environment {env.name!r} cannot score file tasks; use rl.reward=agent"
        )
    private = set(private_fields) | set(getattr(env, "private_task_fields", ()))
    tasks, errors = [], []
    for n, line in enumerate(raw, 1):
        try:
            task = _task_line(line, env, need_expected, private)
        except ValueError as e:
            errors.append(f"line {n}: {e}")
            continue
        if task is not None:
            tasks.append(task)
    if errors:
        shown = errors[:MAX_TASK_FILE_ERRORS]
        if len(errors) > len(shown):
            shown.append(f"... and {len(errors) - len(shown)} more bad lines")
        count = f"{len(errors)} bad line" + ("s" if len(errors) > 1 else "")
        raise ConfigError(f"{where}: {count}:\n  " + "\n  ".join(shown))
    if not tasks:
        raise ConfigError(f"{where}: no tasks in it")
    return tasks


def _task_line(line: bytes, env, need_expected: bool, private: set) -> FileTask | None:
    """One line's task (None: a blank line). Raises ValueError saying what is wrong."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start}: {line[e.start : e.start + 1]!r})") from None
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from None
    if not isinstance(data, dict) or not all(
        isinstance(data.get(k), str) and data[k] for k in ("id", "prompt")
    ):
        raise ValueError('expected an object with string "id" and "prompt"')
    expected = data.get("expected_s")
    if expected is not None or need_expected:
        if isinstance(expected, bool) or not isinstance(expected, (int, float)):
            raise ValueError(
                f'"expected_s"={expected!r}, expected a number of seconds > 0 '
                "(scheduler.dispatch_order=longest_first dispatches by it)"
            )
        try:
            seconds = float(expected)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f'"expected_s"={expected!r}, expected a finite number > 0')
        expected = seconds
    env_task = None
    if env is not None:
        try:
            env_task = env.task_from_dict(data)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a {env.name} task ({e})") from None
    public = {k: v for k, v in data.items() if k not in private}
    return FileTask(data["id"], data["prompt"], data, env_task, expected, public)


def draw_file_task(tasks: list[FileTask], *, seed: int, run_seed: int = 0) -> FileTask:
    """One task of a file for the group seeded `seed` (deterministic, like draw_tasks)."""
    return tasks[int(np.random.default_rng([run_seed, seed]).integers(0, len(tasks)))]


def task_json(task) -> str:
    """The task as the agent sees it (GYREJAX_TASK): a file task's public fields (never
    what locates its hidden answers), else the environment task's id and prompt."""
    if isinstance(task, FileTask):
        return json.dumps(task.public)
    return json.dumps({"id": task.task_id, "prompt": task.spec})
