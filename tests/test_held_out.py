"""The held-out split (gyrejax/harness/held_out.py): disjoint from every task the run's
training can draw, enumerated here through the very calls training makes (a `Groups`'
draw per group, the warm start's demonstrations); an eval task file naming a training
task, and every other bad eval input, is one ConfigError naming the field and value."""

import json
import types

import pytest
from conftest import load_config_file

from gyrejax.config import ConfigError, from_dict
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.harness.held_out import held_out_tasks, training_tasks
from gyrejax.harness.tasks import draw_tasks
from gyrejax.loop.groups import Groups


def _config(**fields):
    c = load_config_file("tiny_cpu", "smoke")
    c.eval.every_steps = 1
    for path, value in fields.items():
        section, name = path.split("__")
        c[section][name] = value
    return from_dict(c)


def _drawn_by_training(config, env) -> list:
    """Every task training draws, by the runtime's own code: `Groups` makes each of the
    run's groups (groups.py), and the warm start draws its demonstrations (stages.py)."""
    ctx = types.SimpleNamespace(
        config=config,
        driver=types.SimpleNamespace(burst=0, schedule=None),
    )
    groups = Groups(ctx, env, store=None)
    total = config.train.steps * config.rl.groups_per_step
    drawn = [groups._make(seq, version=0).task for seq in range(total)]
    if config.warmup.steps:
        demos = config.warmup.demonstrations
        drawn += draw_tasks(env, config.harness, demos, seed=1, run_seed=config.seed)
    return drawn


@pytest.mark.parametrize(
    "fields",
    [
        # The split's seed is the pool's: its first candidates ARE the training pool.
        {"harness__task_pool": 16, "eval__seed": 0, "eval__num_tasks": 8},
        {"harness__task_pool": 4, "eval__seed": 7, "eval__num_tasks": 5},
        # Fresh tasks per group (seeds 0.. of the run), and demonstrations (seed 1): an
        # eval seed among them.
        {
            "harness__task_pool": 0,
            "train__steps": 40,
            "warmup__steps": 1,
            "warmup__demonstrations": 50,
            "eval__seed": 3,
            "eval__num_tasks": 6,
        },
        {"harness__task_pool": 0, "harness__difficulty": 3, "eval__seed": 0},
    ],
)
def test_held_out_tasks_are_disjoint_from_everything_training_draws(fields):
    config = _config(**fields)
    env = MiniRepoEnv(sandbox="python_guard")
    held = held_out_tasks(config, env)
    assert len(held) == config.eval.num_tasks
    assert len({h.task.task_id for h in held}) == len(held)
    trained = _drawn_by_training(config, env)
    assert {t.task_id for t in trained} <= set(training_tasks(config, env))
    assert not {h.task.task_id for h in held} & {t.task_id for t in trained}
    assert not {h.task.spec for h in held} & {t.spec for t in trained}
    assert all(h.family == f"mini_repo-L{config.harness.difficulty}" for h in held)
    # Fixed by eval.seed: the same tasks every time; another seed, others.
    assert [h.task for h in held_out_tasks(config, env)] == [h.task for h in held]


def test_the_split_seed_is_the_only_thing_choosing_the_tasks():
    env = MiniRepoEnv(sandbox="python_guard")
    a = held_out_tasks(_config(eval__seed=11), env)
    b = held_out_tasks(_config(eval__seed=12), env)
    assert [h.task.task_id for h in a] != [h.task.task_id for h in b]


def _task_file(path, env, tasks, seed):
    lines = [env.task_line(t, seed=seed, index=i) for i, t in enumerate(tasks)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_an_eval_task_file_is_read_resolved_and_checked_against_training(tmp_path):
    env = MiniRepoEnv(sandbox="python_guard")
    pool = {t.task_id for t in env.sample_tasks(16, seed=0)}  # the smoke run's training
    lines = [env.task_line(t, seed=99, index=i) for i, t in enumerate(env.sample_tasks(9, seed=99))]
    lines = [line for line in lines if line["id"] not in pool][:3]
    lines[0]["family"] = "easy"
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    held = held_out_tasks(_config(eval__tasks_path=str(path)), env)
    assert [h.task.task_id for h in held] == [line["id"] for line in lines]
    assert [h.task.spec for h in held] == [line["prompt"] for line in lines]
    assert [h.family for h in held] == ["easy", "mini_repo-L1", "mini_repo-L1"]
    # Lines naming tasks of the training pool: refused, named.
    overlapping = _task_file(tmp_path / "bad.jsonl", env, env.sample_tasks(16, seed=0)[:2], 0)
    message = r"config\.eval\.tasks_path='.*bad.jsonl': 2 of its tasks can be drawn by training"
    with pytest.raises(ConfigError, match=message):
        held_out_tasks(_config(eval__tasks_path=overlapping), env)


FILE = r"config\.eval\.tasks_path='.*tasks.jsonl'"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, FILE + ": cannot read it"),
        ("", FILE + ": no tasks in it"),
        ('{"id": "a"}\n', FILE + ': 1 bad line:\n  line 1: expected an object with string "id"'),
        ('{"prompt": "p"}\n', FILE + ": 1 bad line:\n  line 1: expected an object"),
        ('{"id": "a", "prompt": "p"}\n', FILE + ": 1 bad line:\n  line 1: not a mini_repo task"),
    ],
)
def test_a_bad_eval_task_file_is_one_line_naming_the_field(tmp_path, content, message):
    path = tmp_path / "tasks.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        held_out_tasks(_config(eval__tasks_path=str(path)), MiniRepoEnv(sandbox="python_guard"))


class _SmallEnv:
    """An environment of five tasks in all."""

    name = "small"

    def sample_tasks(self, n, *, seed, difficulty=1):
        if n > 5:
            raise ValueError(f"only 5 tasks, asked for {n}")
        return [types.SimpleNamespace(task_id=f"small-{i}", spec=f"spec {i}") for i in range(n)]


def test_too_few_tasks_outside_training_is_one_line_naming_num_tasks():
    config = _config(harness__task_pool=3, eval__num_tasks=2)
    assert [h.task.task_id for h in held_out_tasks(config, _SmallEnv())] == ["small-3", "small-4"]
    message = r"config\.eval\.num_tasks=3: the environment has too few tasks outside the 3 "
    with pytest.raises(ConfigError, match=message + "training can draw"):
        held_out_tasks(_config(harness__task_pool=3, eval__num_tasks=3), _SmallEnv())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"samples_per_task": 0}, "config.eval.samples_per_task=0: expected a positive integer"),
        ({"num_tasks": 0}, "config.eval.num_tasks=0: expected a positive integer"),
        ({"every_steps": -1}, "config.eval.every_steps=-1: expected a number >= 0"),
        ({"seed": -2}, "config.eval.seed=-2: expected a number >= 0"),
        ({"tasks_path": " x.jsonl"}, "config.eval.tasks_path=' x.jsonl': expected a path"),
    ],
)
def test_bad_eval_settings_are_one_line_naming_the_field(fields, message):
    c = load_config_file("tiny_cpu", "smoke")
    c.eval.update(fields)
    with pytest.raises(ConfigError) as error:
        from_dict(c)
    assert str(error.value).startswith(message), error.value


def test_evaluation_needs_the_builtin_harness():
    c = load_config_file("tiny_cpu", "smoke")
    c.rl.agent, c.rl.agent_command = "command", "python agent.py"
    c.eval.every_steps = 2
    message = r"config\.eval\.every_steps=2: evaluation runs the built-in harness"
    with pytest.raises(ConfigError, match=message):
        from_dict(c)
