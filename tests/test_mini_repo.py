"""mini_repo: registry, seeded tasks, sandboxed partial-credit scoring, actions, demos."""

import ast
import string
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyrejax.config import ENVIRONMENTS
from gyrejax.harness import envs
from gyrejax.harness.actions import ACTION_KINDS, Action, format_action, parse_action
from gyrejax.harness.envs import (
    EvaluationError,
    get_environment,
    known_environments,
    register_environment,
)
from gyrejax.harness.envs.mini_repo import MAX_SPEC_BYTES, MiniRepoEnv, Task, task_checks
from gyrejax.harness.sandbox import Limits, SandboxError, SandboxUnavailable, choose_sandbox
from gyrejax.harness.workspace import Workspace

FAST = Limits(cpu_s=1.0, memory_bytes=256 << 20, wall_s=2.0)
REPO = Path(__file__).resolve().parent.parent
OUR_MODULES = (
    "gyrejax/harness/workspace.py",
    "gyrejax/harness/sandbox.py",
    "gyrejax/harness/envs/__init__.py",
    "gyrejax/harness/envs/mini_repo.py",
)


@pytest.fixture(scope="module")
def env():
    return MiniRepoEnv(limits=FAST)


def apply(actions: list[str], root: Path) -> Workspace:
    """Runs the workspace tools of `actions` (what the harness does for write/read/ls)."""
    ws = Workspace(root)
    for text in actions:
        action = parse_action(text)
        assert not action.malformed, (text, action.error)
        if action.kind == "write":
            assert ws.write(action.path, action.content).startswith("wrote")
    return ws


def task_with(env: MiniRepoEnv, level: int, predicate, seed: int = 0) -> Task:
    return next(t for t in env.sample_tasks(200, seed=seed, difficulty=level) if predicate(t))


def module_task(env) -> Task:
    return task_with(env, 3, lambda t: len(t.goals) == 1)


# --- registry -----------------------------------------------------------------------------


def test_registry():
    assert "mini_repo" in known_environments()
    assert set(ENVIRONMENTS) <= set(known_environments())
    env = get_environment("mini_repo", fail_evaluations=1)
    assert isinstance(env, MiniRepoEnv)
    with pytest.raises(ValueError, match=r"unknown environment 'nope'; known environments: .*"):
        get_environment("nope")

    assert register_environment("mini_repo")(MiniRepoEnv) is MiniRepoEnv  # same one: fine
    with pytest.raises(ValueError, match="already registered"):

        @register_environment("mini_repo")
        class Other:
            pass

    assert envs._REGISTRY["mini_repo"] is MiniRepoEnv
    register_environment("test_only_env")(lambda scale=1: ("made", scale))
    try:
        assert get_environment("test_only_env", scale=3) == ("made", 3)
        assert "test_only_env" in known_environments()
    finally:
        del envs._REGISTRY["test_only_env"]
    with pytest.raises(ValueError, match="non-empty string"):
        register_environment("")


def test_modules_import_no_jax():
    for path in OUR_MODULES:
        tree = ast.parse((REPO / path).read_text())
        imported = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for alias in n.names}  # fmt: skip
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        roots = {name.split(".")[0] for name in imported if name}
        assert not roots & {"jax", "flax", "optax", "orbax", "ml_collections"}, (path, roots)


# --- tasks --------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2, 3])
def test_task_sampling_is_seeded_and_small(env, level):
    tasks = env.sample_tasks(40, seed=7, difficulty=level)
    assert tasks == env.sample_tasks(40, seed=7, difficulty=level)
    assert tasks[:10] == env.sample_tasks(10, seed=7, difficulty=level)
    assert tasks != env.sample_tasks(40, seed=8, difficulty=level)
    assert len({t.task_id for t in tasks}) == 40
    allowed = set(string.ascii_letters + string.digits + " .:(),=+-*\n_")
    for task in tasks:
        assert task.difficulty == level
        assert task.task_id.startswith(f"mini_repo-L{level}-")
        assert len(task.spec.encode()) < MAX_SPEC_BYTES
        assert set(task.spec) <= allowed, task.spec
        assert task.spec.splitlines()[0] == "make these files:"
        assert [line.split(":")[0] for line in task.spec.splitlines()[1:]] == [
            g.path for g in task.goals
        ]
        assert "solution" not in repr(task)  # the hidden answer stays out of logs
    # The same task has the same id whatever seed drew it.
    others = {
        t.task_id: t for s in range(6) for t in env.sample_tasks(40, seed=s, difficulty=level)
    }
    for task in tasks:
        if task.task_id in others:
            assert others[task.task_id] == task


def test_levels_have_their_shapes(env):
    for task in env.sample_tasks(30, seed=1, difficulty=1):
        assert 1 <= len(task.goals) <= 2
        assert all(3 <= len(g.solution) <= 12 and g.spec_line.endswith(g.solution)
                   for g in task.goals)  # fmt: skip
    level2 = env.sample_tasks(30, seed=1, difficulty=2)
    assert all(2 <= len(t.goals) <= 4 for t in level2)
    assert any("upper(" in t.spec for t in level2) and any("reverse(" in t.spec for t in level2)
    assert any("repeat(" in t.spec for t in level2)
    level3 = env.sample_tasks(30, seed=1, difficulty=3)
    assert all(sum(bool(g.function) for g in t.goals) == 1 for t in level3)
    assert any("returns" in t.spec for t in level3) and any("(1) = " in t.spec for t in level3)
    mixed = env.sample_tasks(30, seed=1, difficulty=(1, 3))
    assert {t.difficulty for t in mixed} == {1, 3}
    with pytest.raises(ValueError, match="difficulty"):
        env.sample_tasks(1, seed=0, difficulty=4)
    with pytest.raises(ValueError, match="seed"):
        env.sample_tasks(1, seed=-1)


def test_checks_and_visible_subset(env):
    task = task_with(env, 3, lambda t: len(t.goals) == 2)
    checks = task_checks(task)
    assert len(checks) == 8  # text: exists, length, content; module: exists, defines, 3 calls
    visible = [c for c in checks if c.visible]
    assert [c.kind for c in visible] == (
        ["exists", "length", "exists", "defines", "call"]
        if not task.goals[0].function
        else ["exists", "defines", "call", "exists", "length"]
    )


# --- scoring ------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2, 3])
def test_perfect_partial_and_empty_workspaces(env, tmp_path, level):
    task = task_with(env, level, lambda t: len(t.goals) >= 2)
    perfect = Workspace(tmp_path / "perfect")
    for goal in task.goals:
        perfect.write(goal.path, goal.solution)
    score = env.score(task, perfect.root)
    assert (score.passed, score.reward) == (score.total, 1.0), score.details
    assert all(d.startswith("pass: ") for d in score.details)

    partial = Workspace(tmp_path / "partial")
    first, *rest = task.goals
    partial.write(first.path, first.solution)
    for goal in rest:
        partial.write(goal.path, goal.solution[:-1] + "#")  # exists, right length, wrong
    score = env.score(task, partial.root)
    assert 0.0 < score.reward < 1.0
    assert any(d.startswith("fail: ") for d in score.details)

    empty = Workspace(tmp_path / "empty")
    score = env.score(task, empty.root)
    assert score.passed == 0 and score.reward == 0.0 and score.total == len(task_checks(task))
    assert env.score(task, tmp_path / "never_created").reward == 0.0


def test_text_content_rules(env, tmp_path):
    task = task_with(env, 1, lambda t: len(t.goals) == 1)
    goal = task.goals[0]
    ws = Workspace(tmp_path)
    ws.write(goal.path, goal.solution + "\n")  # one trailing newline is tolerated
    assert env.score(task, tmp_path).reward == 1.0
    ws.write(goal.path, goal.solution + "\n\n")
    assert env.score(task, tmp_path).reward == pytest.approx(1 / 3)
    (tmp_path / goal.path).write_bytes(b"\xff" * len(goal.solution))
    details = env.score(task, tmp_path).details
    assert details[1:] == (f"fail: {goal.path} length (not UTF-8 text)",
                           f"fail: {goal.path} content (not UTF-8 text)")  # fmt: skip


@pytest.mark.parametrize(
    "body, passes",
    [
        ("return {body}", 5),
        ("return float({body})", 2),  # exists + defines: a float is not an int
        ("return str({body})", 2),
        ("raise RuntimeError('no')", 2),
        ("return None", 2),
    ],
)
def test_module_results_on_hidden_inputs(env, tmp_path, body, passes):
    task = module_task(env)
    goal = task.goals[0]
    expression = goal.solution.split("return ")[1].strip()
    source = f"def {goal.function}(x):\n    " + body.format(body=expression) + "\n"
    Workspace(tmp_path).write(goal.path, source)
    score = env.score(task, tmp_path)
    assert score.passed == passes, score.details


@pytest.mark.parametrize(
    "source",
    [
        "while True:\n    pass\n",  # at import
        "def {fn}(x):\n    while True:\n        pass\n",  # in the call
        "hog = []\nwhile True:\n    hog.append(bytearray(1 << 24))\n",
        "def {fn}(x):\n    return [0] * (1 << 40)\n",
        "import time\ntime.sleep(60)\n",
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "import os\nos.fork()\n",
        'print(\'start\')\nprint(\'{{"step": "call0", "ok": true}}\')\n',  # forged reports
        "def {fn}(x):\n    return 10 ** 100000\n",
        "class Liar(int):\n    def __eq__(self, other):\n        return True\n"
        "def {fn}(x):\n    return Liar(-1)\n",
    ],
)
def test_runaway_modules_fail_their_checks_in_time(env, tmp_path, source):
    task = module_task(env)
    goal = task.goals[0]
    Workspace(tmp_path).write(goal.path, source.format(fn=goal.function))
    start = time.monotonic()
    score = env.score(task, tmp_path)
    assert time.monotonic() - start < FAST.wall_s + 2.0
    assert score.total == 5
    assert score.passed <= 2, score.details  # at most: exists (+ defines)
    assert score.details[0] == f"pass: {goal.path} exists"


# Agent code that tries to forge its verdict instead of writing the function. Each runs in
# the checker's own process (it is the module the checker imports).
# The checker's globals, found up the import's stack (the script runs under exec): a
# forger that uses `checker` starts with this.
CHECKER_GLOBALS = (
    "import sys\n"
    "frame = sys._getframe()\n"
    "while 'report' not in frame.f_globals:\n"
    "    frame = frame.f_back\n"
    "checker = frame.f_globals\n"
)
FORGERS = {
    # The audit's forger: no function; it calls the checker's own reporter with passes.
    "calls the checker's reporter": (
        "import os\n"
        "for step in ('defines', 'call0', 'call1', 'call2'):\n"
        "    checker['report'](step, ok=True, callable=True, value=-77, got='ok')\n"
        "checker['report']('end')\nos._exit(0)\n"
    ),
    "prints verdict-like lines": (
        "import os, json\n"
        "for i in range(3):\n"
        "    os.write(1, f'pass: {{i}}\\n'.encode())\n"
        "    os.write(1, (json.dumps({{'step': f'call{{i}}', 'ok': True, 'value': -77}})"
        " + '\\n').encode())\n"
    ),
    "exits 0 early": "def {fn}(x):\n    return -77\nimport os\nos._exit(0)\n",
    "monkeypatches the harness": (
        "import json\n"
        "real = checker['report']\n"
        "def report(step, **fields):\n"
        "    real(step, **fields | {{'ok': True, 'callable': True}})\n"
        "checker['report'] = report\n"
        "checker['callable'] = lambda f: True\n"
        "def {fn}(x):\n    return -77\n"
    ),
    # Reads everything the checker process holds: its code's constants and globals up
    # the stack, its files and command line (at import), its objects and the caller's
    # variables (at each call), for anything that looks like the answer to x.
    "reads the checker's files and memory": (
        "import gc, os, sys\n"
        "found = []\n"
        "frame = sys._getframe()\n"
        "while frame:\n"
        "    found += [repr(frame.f_code.co_consts), repr(list(frame.f_globals.items()))]\n"
        "    frame = frame.f_back\n"
        "for path in ['/proc/self/fd/' + fd for fd in os.listdir('/proc/self/fd')] + "
        "['/proc/self/cmdline', '/proc/self/environ']:\n"
        "    try:\n"
        "        if os.path.isfile(path):  # (a pipe's read would wait for ever)\n"
        "            found.append(open(path, errors='replace').read(1 << 16))\n"
        "    except Exception:\n"
        "        pass\n"
        "open('found.txt', 'w').write('\\n'.join(found))\n"
        "def {fn}(x):\n"
        "    for obj in gc.get_objects():  # an [input, answer] pair\n"
        "        if type(obj) in (list, tuple) and len(obj) == 2 and obj[0] == x \\\n"
        "                and type(obj[1]) is int and obj[1] != x:\n"
        "            return obj[1]\n"
        "    for name, value in sys._getframe(1).f_globals.items():  # want, expected, ...\n"
        "        if type(value) is int and name not in ('x', 'i', 'got') and value != x:\n"
        "            return value\n"
        "    return -77\n"
    ),
}


@pytest.mark.parametrize("attack", list(FORGERS))
def test_a_module_cannot_forge_its_verdict(env, tmp_path, attack):
    task = module_task(env)
    (goal,) = task.goals
    assert -77 not in [want for _, want in goal.cases]
    source = FORGERS[attack].format(fn=goal.function)
    source = (CHECKER_GLOBALS if "checker[" in source else "") + source
    Workspace(tmp_path).write(goal.path, source)
    score = env.score(task, tmp_path)
    assert score.details[0] == f"pass: {goal.path} exists"
    calls = [d for d in score.details if f"{goal.function}(" in d and "==" in d]
    assert len(calls) == 3 and not any(d.startswith("pass") for d in calls), score.details
    if "def {fn}" not in FORGERS[attack]:  # a "defines" reported, but nothing defined
        assert score.details[1].startswith(f"fail: {goal.path} defines"), score.details
    if attack == "reads the checker's files and memory":  # it did read the checker
        text = (tmp_path / "found.txt").read_text()
        assert all(str(x) in text for x, _ in goal.cases)
    # The solution written the same way still passes (the checker works).
    Workspace(tmp_path).write(goal.path, goal.solution)
    assert env.score(task, tmp_path).passed == 5


def test_evaluation_errors_are_injected_and_detected(tmp_path, monkeypatch):
    env = get_environment("mini_repo", fail_evaluations=2, limits=FAST)
    task = env.sample_tasks(1, seed=0, difficulty=1)[0]
    for _ in range(2):
        with pytest.raises(EvaluationError, match="injected"):
            env.score(task, tmp_path)
    assert env.score(task, tmp_path).reward == 0.0  # a legitimate 0, not an error

    # Thread-safe: exactly N of many concurrent evaluations fail.
    env = MiniRepoEnv(limits=FAST, fail_evaluations=5)
    errors = []

    def evaluate():
        try:
            env.score(task, tmp_path)
        except EvaluationError:
            errors.append(1)

    threads = [threading.Thread(target=evaluate) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 5

    # A checker that cannot run (no room to start) is an EvaluationError, not a 0.
    module = module_task(env)
    goal = module.goals[0]
    Workspace(tmp_path).write(goal.path, goal.solution)
    starved = MiniRepoEnv(limits=Limits(memory_bytes=1 << 20, wall_s=3.0))
    with pytest.raises(EvaluationError, match="no result"):
        starved.score(module, tmp_path)

    def broken(*args, **kwargs):
        raise SandboxError("no processes left")

    monkeypatch.setattr("gyrejax.harness.envs.mini_repo.run_python", broken)
    with pytest.raises(EvaluationError, match="could not start"):
        MiniRepoEnv().score(module, tmp_path)
    # The agent's check tool reports it instead of raising.
    assert MiniRepoEnv().run_visible_checks(module, tmp_path).startswith("error: the checks")


@pytest.mark.parametrize("mode", ["python_guard", "auto"])
def test_checks_run_under_the_configured_sandbox(tmp_path, mode):
    env = MiniRepoEnv(limits=FAST, sandbox=mode)
    assert env.sandbox == choose_sandbox(mode)  # resolved once, when the env is made
    module = module_task(env)
    goal = module.goals[0]
    Workspace(tmp_path).write(goal.path, goal.solution)
    assert env.score(module, tmp_path).reward == 1.0


def test_a_bwrap_env_refuses_to_exist_without_bubblewrap(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailable, match="sandbox='bwrap': bubblewrap"):
        MiniRepoEnv(sandbox="bwrap")
    assert MiniRepoEnv(sandbox="auto").sandbox.used == "python_guard"


def test_visible_checks_observation(env, tmp_path):
    task = task_with(env, 3, lambda t: len(t.goals) == 2)
    text_goal = next(g for g in task.goals if not g.function)
    module_goal = next(g for g in task.goals if g.function)
    ws = Workspace(tmp_path)
    assert env.run_visible_checks(task, tmp_path).startswith("0/5 visible checks pass")
    ws.write(text_goal.path, "#" * len(text_goal.solution))  # right length, wrong content
    ws.write(module_goal.path, module_goal.solution)
    observation = env.run_visible_checks(task, tmp_path)
    lines = observation.splitlines()
    assert lines[0] == "5/5 visible checks pass"
    assert all(line.startswith("pass: ") for line in lines[1:])
    assert text_goal.solution not in observation  # hidden content stays hidden
    assert env.score(task, tmp_path).reward == 7 / 8


# --- actions ------------------------------------------------------------------------------

_PATHS = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)),
                 min_size=1, max_size=20).map(str.strip).filter(bool)  # fmt: skip
_TEXTS = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40).map(str.strip)
_ACTIONS = st.one_of(
    st.builds(lambda p, c: Action("write", path=p, content=c), _PATHS, st.text(max_size=60)),
    st.builds(lambda p: Action("read", path=p), _PATHS),
    st.just(Action("ls")),
    st.just(Action("check")),
    st.builds(lambda s: Action("delegate", subtask=s), _TEXTS.filter(bool)),
    st.builds(lambda r: Action("done", result=r), _TEXTS),
)


@settings(max_examples=300, deadline=None)
@given(_ACTIONS)
@example(Action("delegate", subtask="0\r\n0"))  # found in CI: the "\r" was stripped
@example(Action("done", result="a \n b"))
def test_parse_format_round_trip(action):
    text = format_action(action)
    assert parse_action(text) == action
    assert format_action(parse_action(text)) == text


def test_parse_examples():
    assert parse_action("write a.txt\nhi there") == Action(
        "write", path="a.txt", content="hi there"
    )
    assert parse_action("write f.py\ndef f(x):\n    return x\n").content == (
        "def f(x):\n    return x\n"
    )
    assert parse_action("write e.txt\n") == Action("write", path="e.txt", content="")
    assert parse_action("  read a.txt \n") == Action("read", path="a.txt")
    assert parse_action("ls\n") == Action("ls")
    assert parse_action("delegate\nwrite b.txt: hi") == Action(
        "delegate", subtask="write b.txt: hi"
    )
    assert parse_action("done") == Action("done")
    assert parse_action("done wrote a.txt\n") == Action("done", result="wrote a.txt")
    assert ACTION_KINDS == ("write", "read", "ls", "check", "delegate", "done")


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "empty action"),
        ("   \n ", "empty action"),
        ("hello world", "unknown action 'hello'"),
        ("Write a.txt\nx", "unknown action 'Write'"),
        ("write\nhi", "write needs a path"),
        ("write a.txt", "write needs its content after a newline"),
        ("read", "read needs a path"),
        ("read a.txt\nb.txt", "read takes a single line"),
        ("ls -la", "ls takes no argument"),
        ("check\nplease", "check takes a single line"),
        ("delegate   ", "delegate needs a subtask"),
        (None, "expected text"),
    ],
)
def test_malformed_actions(text, why):
    action = parse_action(text)
    assert action.kind == "malformed" and action.malformed
    assert action.error.startswith(why)
    assert "one action per turn" in action.error
    if isinstance(text, str):
        assert format_action(action) == text


# --- demonstrations -----------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2, 3])
def test_perfect_demonstrations_solve_the_task(env, tmp_path, level):
    for i, task in enumerate(env.sample_tasks(5, seed=3, difficulty=level)):
        rng = np.random.default_rng(i)
        actions = env.demonstration(task, rng=rng, quality=1.0)
        assert actions[-1] == "done"
        apply(actions, tmp_path / f"plain{i}")
        assert env.score(task, tmp_path / f"plain{i}").reward == 1.0

        main, sub = env.demonstration_with_delegation(task, rng=rng, quality=1.0)
        delegated = [parse_action(a) for a in main if a.startswith("delegate")]
        assert len(delegated) == 1 and delegated[0].subtask.startswith("write ")
        assert main[-1] == "done"
        assert parse_action(sub[-1]).kind == "done" and parse_action(sub[-1]).result
        apply(main + sub, tmp_path / f"delegated{i}")
        assert env.score(task, tmp_path / f"delegated{i}").reward == 1.0


def test_imperfect_demonstrations_give_partial_rewards(env, tmp_path):
    tasks = env.sample_tasks(6, seed=4, difficulty=(1, 2, 3))
    rewards = []
    for i, task in enumerate(tasks * 2):
        actions = env.demonstration(task, rng=np.random.default_rng(100 + i), quality=0.5)
        apply(actions, tmp_path / str(i))
        rewards.append(env.score(task, tmp_path / str(i)).reward)
    assert 0.2 < np.mean(rewards) < 0.95
    assert min(rewards) < 1.0 and max(rewards) > 0.0
    worst = env.demonstration(tasks[0], rng=np.random.default_rng(0), quality=0.0)
    apply(worst, tmp_path / "worst")
    assert env.score(tasks[0], tmp_path / "worst").reward < 1.0
    # Same generator state, same demonstration.
    first = env.demonstration(tasks[1], rng=np.random.default_rng(9), quality=0.5)
    assert first == env.demonstration(tasks[1], rng=np.random.default_rng(9), quality=0.5)
    with pytest.raises(ValueError, match="quality"):
        env.demonstration(tasks[0], rng=np.random.default_rng(0), quality=1.5)
