"""`mini_repo`: an NL2Repo-like environment small enough for a tiny byte-level model.

A task is a short spec of a tiny repository (under 150 bytes); the agent writes the files
into its workspace, and hidden checks score it with partial credit (reward = passed/total).

Levels (`difficulty`):
  1. one or two text files with their exact contents:
       make these files:
       a.txt: red sun
       note.txt: 42
  2. two to four text files, some exact, some derived from the spec by `upper(..)`,
     `reverse(..)` or `repeat(.., k)`:
       make these files:
       b.txt: upper(hi fox)        -> HI FOX
       out.txt: reverse(cat)       -> tac
       x.txt: repeat(ab, 3)        -> ababab
  3. a Python module defining one function, given in words or by two examples, sometimes
     with a text file too:
       make these files:
       f.py: def f(x) returns x * 3
       g.py: g(1) = 5, g(2) = 6     (the agent must infer g(x) = x + 4)
     The expected solution is `def f(x):\\n    return x * 3\\n`.

Checks. Text file: exists, length, exact content (one trailing newline is tolerated).
Module: exists, defines the function, and its result on three hidden inputs (an `int`
equal to the expected one). Visible checks (the agent's `check` tool) are a subset: a text
file's existence and length, a module's existence, definition and first hidden input.
Checks that execute agent code run in `sandbox.run_python` with limits, under the
configured sandbox (bubblewrap where it works), so a module that loops or eats memory
fails its checks; only an evaluation that could not run at all raises
`EvaluationError`.

The verdict cannot be forged by the module (the `Environment` guarantee): the sandboxed
checker process that imports it holds the hidden inputs but never the answers, and
reports only what it observed (is the name callable, what did each input return). This
process compares the returned values with the answers, and checks "defines" in the
source itself (a top-level binding, parsed, never run). So whatever the module does to
that process (call or patch its reporter, print look-alike lines, exit early, read its
memory and files), a call passes only if its answer was produced.

The agent acts by the harness's action syntax (`gyrejax.harness.actions`).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import secrets
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gyrejax.harness.actions import Action, format_action
from gyrejax.harness.envs import EvaluationError, register_environment
from gyrejax.harness.sandbox import Limits, SandboxError, choose_sandbox, run_python
from gyrejax.harness.workspace import Workspace

LEVELS = (1, 2, 3)
MAX_SPEC_BYTES = 150
SPEC_HEADER = "make these files:"
# Small vocabularies: lower-case words, digits, a few file names.
WORDS = tuple(
    "hi ok yes no cat dog sun red blue tree box one two six top map sky day fox bee".split()
)
SYLLABLES = ("ab", "xo", "la", "mi", "zz", "ok", "no", "ha")
TEXT_FILES = tuple(f"{name}.txt" for name in "a b c x y note name msg out data tag id".split())
MODULES = ("f", "g", "h")
# Function templates: (words phrasing of the body, callable); `k` is a small constant.
_FORMULAS = {
    "add": ("x + {k}", lambda x, k: x + k),
    "sub": ("x - {k}", lambda x, k: x - k),
    "mul": ("x * {k}", lambda x, k: x * k),
}
MAX_TASK_INDEX = 10_000  # a task line's index: drawing up to it takes about a second
_TEXT_CHECK_BYTES = 1 << 16  # scoring reads at most this much of a file
_SCORING_LIMITS = Limits(cpu_s=1.0, memory_bytes=256 << 20, wall_s=5.0, max_output_bytes=16 << 10)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- tasks --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Goal:
    """One file a task asks for (internal: the agent sees only `spec_line`).

    Attributes:
      path: the file's path, e.g. "a.txt" or "f.py".
      spec_line: its line in the spec, e.g. "a.txt: upper(red sun)".
      solution: the canonical content.
      function: modules: the function's name ("" for text files).
      cases: modules: (input, expected) pairs; the first is also a visible check.
      derived_from: text derived from the spec (upper/reverse/repeat): its argument.
    """

    path: str
    spec_line: str
    solution: str
    function: str = ""
    cases: tuple[tuple[int, int], ...] = ()
    derived_from: str = ""


@dataclasses.dataclass(frozen=True)
class Task:
    """A mini_repo task. The agent sees `spec`; `goals` hold the hidden answer."""

    task_id: str
    difficulty: int
    spec: str
    goals: tuple[Goal, ...] = dataclasses.field(default=(), repr=False)


@dataclasses.dataclass(frozen=True)
class Check:
    """One hidden check. kind: exists | length | content | defines | call."""

    name: str
    path: str
    kind: str
    visible: bool
    expected: int | str = 0
    argument: int = 0


@dataclasses.dataclass(frozen=True)
class Score:
    """Checks passed out of the task's total, with one detail line per check."""

    passed: int
    total: int
    details: tuple[str, ...] = ()

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0


def task_checks(task: Task) -> tuple[Check, ...]:
    """All hidden checks of `task`, in spec order."""
    checks = []
    for goal in task.goals:
        p = goal.path
        if goal.function:
            fn = goal.function
            checks.append(Check(f"{p} exists", p, "exists", True))
            checks.append(Check(f"{p} defines {fn}", p, "defines", True, fn))
            for i, (x, want) in enumerate(goal.cases):
                checks.append(Check(f"{p}: {fn}({x}) == {want}", p, "call", i == 0, want, x))
        else:
            checks.append(Check(f"{p} exists", p, "exists", True))
            checks.append(Check(f"{p} length", p, "length", True, len(goal.solution)))
            checks.append(Check(f"{p} content", p, "content", False, goal.solution))
    return tuple(checks)


def _word_text(rng: np.random.Generator, min_chars: int, max_chars: int) -> str:
    while True:  # mostly words; some numbers and word+number tags
        kind = rng.choice(4, p=[0.15, 0.15, 0.35, 0.35])
        if kind == 0:
            text = str(int(rng.integers(10, 1000)))
        elif kind == 1:
            text = f"{WORDS[rng.integers(len(WORDS))]}{int(rng.integers(1, 100))}"
        else:
            count = int(rng.integers(1, 3)) if kind == 2 else 2
            text = " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=count))
        if min_chars <= len(text) <= max_chars:
            return text


def _text_goal(rng: np.random.Generator, path: str, derived: bool) -> Goal:
    if not derived:
        text = _word_text(rng, 3, 12)
        return Goal(path, f"{path}: {text}", text)
    op = ("upper", "reverse", "repeat")[rng.integers(3)]
    if op == "repeat":
        unit = SYLLABLES[rng.integers(len(SYLLABLES))]
        times = int(rng.integers(2, 5))
        return Goal(path, f"{path}: repeat({unit}, {times})", unit * times, derived_from=unit)
    text = _word_text(rng, 3, 8)
    solution = text.upper() if op == "upper" else text[::-1]
    if solution == text:  # a palindrome or digits: make the derivation visible
        text = "cat " + text if op == "reverse" else "hi " + text
        solution = text.upper() if op == "upper" else text[::-1]
    return Goal(path, f"{path}: {op}({text})", solution, derived_from=text)


def _module_goal(rng: np.random.Generator, name: str, line_seed: int) -> Goal:
    formula = ("add", "sub", "mul")[rng.integers(3)]
    k = int(rng.integers(2, 10))
    words, fn = _FORMULAS[formula]
    body = words.format(k=k)
    path = f"{name}.py"
    by_examples = formula in ("add", "mul") and rng.random() < 0.4
    if by_examples:
        line = f"{path}: {name}(1) = {fn(1, k)}, {name}(2) = {fn(2, k)}"
    else:
        line = f"{path}: def {name}(x) returns {body}"
    # Hidden inputs follow from the line alone, so a task is fully determined by its spec.
    hidden = np.random.default_rng([line_seed, zlib.crc32(line.encode())])
    inputs = hidden.choice(np.arange(3, 40), size=3, replace=False)
    cases = tuple((int(x), fn(int(x), k)) for x in inputs)
    solution = f"def {name}(x):\n    return {body}\n"
    return Goal(path, line, solution, function=name, cases=cases)


def _sample_goals(rng: np.random.Generator, level: int) -> tuple[Goal, ...]:
    if level == 1:
        count, derived_p = int(rng.integers(1, 3)), 0.0
    elif level == 2:
        count, derived_p = int(rng.integers(2, 5)), 0.6
    else:
        count, derived_p = int(rng.random() < 0.5), 0.0
    paths = rng.choice(len(TEXT_FILES), size=count, replace=False)
    goals = [_text_goal(rng, TEXT_FILES[i], bool(rng.random() < derived_p)) for i in paths]
    if level == 3:
        module = _module_goal(rng, MODULES[rng.integers(len(MODULES))], line_seed=3)
        goals.insert(int(rng.integers(len(goals) + 1)), module)
    return tuple(goals)


def _spec(goals: Sequence[Goal]) -> str:
    return "\n".join([SPEC_HEADER, *(g.spec_line for g in goals)]) + "\n"


# --- the environment ----------------------------------------------------------------------


@register_environment("mini_repo")
class MiniRepoEnv:
    """Seeded tiny-repository tasks, sandboxed partial-credit scoring, demonstrations.

    Args:
      limits: sandbox limits for checks that run agent code.
      fail_evaluations: the next this-many `score` calls raise EvaluationError (for tests
        of the harness's retry path).
      sandbox: how checks that run agent code are confined (`harness.sandbox`: "auto",
        "bwrap" or "python_guard"; see `sandbox.choose_sandbox`), resolved here, once.

    Raises:
      SandboxUnavailable: `sandbox="bwrap"` and bubblewrap does not work here.
    """

    name = "mini_repo"
    # A task line's key that locates its hidden task (seed, difficulty, index): the
    # answers follow from it, so the agent never sees it (tasks.FileTask.public).
    private_task_fields = ("mini_repo",)

    def __init__(
        self, *, limits: Limits | None = None, fail_evaluations: int = 0, sandbox: str = "auto"
    ):
        if not (isinstance(fail_evaluations, int) and fail_evaluations >= 0):
            raise ValueError(
                f"mini_repo fail_evaluations={fail_evaluations!r}: expected an int >= 0"
            )
        self.sandbox = choose_sandbox(sandbox)
        self.limits = _SCORING_LIMITS if limits is None else limits
        self._fail_evaluations = fail_evaluations
        self._lock = threading.Lock()
        self._drawn: dict[tuple[int, int], list[Task]] = {}  # task_from_dict's draws

    # Tasks.

    def sample_tasks(self, n: int, *, seed: int, difficulty: int | Sequence[int] = 1) -> list[Task]:
        """`n` distinct tasks, a function of (seed, difficulty) only.

        Args:
          n: how many.
          seed: a non-negative int.
          difficulty: a level (1-3), or a sequence of levels to draw from uniformly.

        Returns:
          Tasks with unique ids; a larger `n` extends a smaller one's list. The id is a
          hash of the spec, so the same task has the same id whatever seed drew it.
        """
        levels = (difficulty,) if isinstance(difficulty, int) else tuple(difficulty)
        if not levels or any(level not in LEVELS for level in levels):
            raise ValueError(f"mini_repo difficulty={difficulty!r}: expected levels in {LEVELS}")
        if not (isinstance(seed, int) and seed >= 0):
            raise ValueError(f"mini_repo seed={seed!r}: expected an int >= 0")
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"mini_repo n={n!r}: expected an int >= 0")
        rng = np.random.default_rng([seed, *levels])
        tasks, seen = [], set()
        attempts = 0
        while len(tasks) < n:
            attempts += 1
            if attempts > 100 * n + 1000:
                raise ValueError(
                    f"mini_repo: only {len(tasks)} distinct tasks found for n={n} at "
                    f"difficulty {difficulty!r}"
                )
            level = int(levels[rng.integers(len(levels))])
            goals = _sample_goals(rng, level)
            spec = _spec(goals)
            if len(spec.encode()) > MAX_SPEC_BYTES or spec in seen:
                continue
            seen.add(spec)
            digest = hashlib.sha1(spec.encode()).hexdigest()[:12]
            tasks.append(Task(f"mini_repo-L{level}-{digest}", level, spec, goals))
        return tasks

    def task_line(self, task: Task, *, seed: int, index: int) -> dict:
        """A JSONL task line (`rl.tasks_path`) for `sample_tasks(n > index, seed=seed,
        difficulty=task.difficulty)[index]`: id, prompt, and where it is drawn from."""
        where = {"seed": seed, "difficulty": task.difficulty, "index": index}
        return {"id": task.task_id, "prompt": task.spec, "mini_repo": where}

    def task_from_dict(self, data: dict) -> Task:
        """The task a `task_line` names (drawn again: the hidden checks are never in the
        file). Draws are cached per (seed, difficulty), so a file costs one draw each.

        Raises:
          ValueError naming the field: "mini_repo" is not {"seed": int >= 0,
            "difficulty": a level, "index": int in [0, MAX_TASK_INDEX)}, or the line's
            id is not the task drawn.
        """
        where = data.get("mini_repo")
        if not isinstance(where, dict):
            raise ValueError(f'"mini_repo"={where!r}: expected {{"seed", "difficulty", "index"}}')
        seed, level, index = (where.get(k) for k in ("seed", "difficulty", "index"))
        for name, value, ok, expected in (
            ("seed", seed, _is_int(seed) and seed >= 0, "an int >= 0"),
            ("difficulty", level, _is_int(level) and level in LEVELS, f"one of {LEVELS}"),
            ("index", index, _is_int(index) and 0 <= index < MAX_TASK_INDEX,
             f"an int in [0, {MAX_TASK_INDEX})"),
        ):  # fmt: skip
            if not ok:
                raise ValueError(f'"mini_repo"."{name}"={value!r}: expected {expected}')
        with self._lock:
            drawn = self._drawn.get((seed, level), [])
            if len(drawn) <= index:  # a larger draw extends a smaller one
                drawn = self.sample_tasks(index + 1, seed=seed, difficulty=level)
                self._drawn[seed, level] = drawn
        task = drawn[index]
        if task.task_id != data["id"]:
            raise ValueError(f"id {data['id']!r} is not the task drawn ({task.task_id!r})")
        return task

    # Scoring.

    def score(self, task: Task, workspace_root: Path | str) -> Score:
        """Runs every hidden check on the workspace; reward = passed / total.

        Raises:
          EvaluationError: the evaluation could not run (or one was injected with
            `fail_evaluations`); a failing check is never an error.
        """
        with self._lock:
            if self._fail_evaluations > 0:
                self._fail_evaluations -= 1
                raise EvaluationError(
                    f"injected evaluation failure for {task.task_id} (fail_evaluations)"
                )
        results = self._evaluate(task, Path(workspace_root), visible_only=False)
        passed = sum(ok for _, ok, _ in results)
        details = tuple(
            f"pass: {check.name}" if ok else f"fail: {check.name}{note}"
            for check, ok, note in results
        )
        return Score(passed, len(results), details)

    def run_visible_checks(self, task: Task, workspace_root: Path | str) -> str:
        """The agent's `check` tool: which visible checks pass, as an observation."""
        try:
            results = self._evaluate(task, Path(workspace_root), visible_only=True)
        except EvaluationError as e:
            return f"error: the checks could not run ({e}); try again"
        passed = sum(ok for _, ok, _ in results)
        lines = [f"{passed}/{len(results)} visible checks pass"]
        lines += [
            f"pass: {check.name}" if ok else f"fail: {check.name}{note}"
            for check, ok, note in results
        ]
        return "\n".join(lines)

    def _evaluate(
        self, task: Task, root: Path, *, visible_only: bool
    ) -> list[tuple[Check, bool, str]]:
        """(check, passed, note) for each check; note explains a failure."""
        workspace = Workspace(root) if root.is_dir() else None
        results = []
        for goal in task.goals:
            checks = [
                c
                for c in task_checks(task)
                if c.path == goal.path and (c.visible or not visible_only)
            ]
            data = workspace.read_bytes(goal.path, _TEXT_CHECK_BYTES) if workspace else None
            if data is None:
                results += [(c, False, "" if c.kind == "exists" else " (no file)") for c in checks]
            elif goal.function:
                results += self._module_results(goal, checks, root, data)
            else:
                results += _text_results(data, checks)
        return results

    def _module_results(
        self, goal: Goal, checks: list[Check], root: Path, source: bytes
    ) -> list[tuple[Check, bool, str]]:
        """A module's checks. The sandboxed child imports the agent's module and reports
        only what it observes: whether the name is callable and what it returned for
        each hidden input. The expected answers never enter that process: this one
        compares, so a module can score a call only by producing its right answer."""
        calls = [c for c in checks if c.kind == "call"]
        nonce = secrets.token_hex(8)  # framing only: our reports apart from its prints
        script = _CHECKER.format(
            nonce=json.dumps(nonce),
            module=json.dumps(goal.path[: -len(".py")]),
            function=json.dumps(goal.function),
            inputs=json.dumps([c.argument for c in calls]),
        )
        try:
            run = run_python(script, root, self.limits, sandbox=self.sandbox)
        except (SandboxError, ValueError) as e:
            raise EvaluationError(f"checker for {goal.path} could not start: {e}") from e
        reports: dict[str, dict | None] = {}
        for line in run.stdout.splitlines():
            if not line.startswith(nonce + " "):
                continue
            try:
                report = json.loads(line[len(nonce) + 1 :])
                step = str(report["step"])
            except (ValueError, KeyError, TypeError):
                continue  # not a report of ours (the module can write to fd 1 too)
            reports[step] = None if step in reports else report  # twice: believe neither
        if "start" not in reports:
            raise EvaluationError(
                f"checker for {goal.path} produced no result: {run.summary()}; "
                f"stderr: {run.stderr[-500:]!r}"
            )
        ended = "" if "end" in reports else f" (the run ended early: {run.summary()})"
        results = []
        for check in checks:
            if check.kind == "exists":
                results.append((check, True, ""))
            elif check.kind == "defines":
                results.append(_defines_result(check, source, reports.get("defines"), ended))
            else:
                report = reports.get(f"call{calls.index(check)}")
                results.append(_call_result(check, report, ended))
        return results

    # Demonstrations.

    def demonstration(self, task: Task, *, rng: np.random.Generator, quality: float) -> list[str]:
        """The action texts of a competent agent: write each file, maybe `check`, `done`.

        With probability 1 - quality per file the attempt has a realistic mistake: a typo,
        a wrong content (an underived argument, a wrong constant or operator, a syntax
        error) or the file skipped. quality=1 solves the task.
        """
        _check_quality(quality)
        actions = [a for goal in task.goals if (a := _attempt(goal, rng, quality)) is not None]
        if rng.random() < 0.5:
            actions.append("check")
        actions.append("done")
        return actions

    def demonstration_with_delegation(
        self, task: Task, *, rng: np.random.Generator, quality: float
    ) -> tuple[list[str], list[str]]:
        """Like `demonstration`, but one file is delegated to a sub-agent.

        The main agent writes the other files and, in that file's place, says
        `delegate write <its spec line>`; the sub-agent (whose task text is that subtask)
        writes the file and says `done wrote <path>`.

        Returns:
          (main agent's action texts, sub-agent's action texts).
        """
        _check_quality(quality)
        delegated = int(rng.integers(len(task.goals)))
        main, sub = [], []
        for i, goal in enumerate(task.goals):
            if i == delegated:
                main.append(format_action(Action("delegate", subtask=f"write {goal.spec_line}")))
                attempt = _attempt(goal, rng, quality)
                sub += [attempt] if attempt is not None else []
                sub.append(format_action(Action("done", result=f"wrote {goal.path}")))
            elif (attempt := _attempt(goal, rng, quality)) is not None:
                main.append(attempt)
        if rng.random() < 0.5:
            main.append("check")
        main.append("done")
        return main, sub


def _text_results(data: bytes, checks: list[Check]) -> list[tuple[Check, bool, str]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.endswith("\n"):
        text = text[:-1]
    results = []
    for check in checks:
        if check.kind == "exists":
            results.append((check, True, ""))
        elif text is None:
            results.append((check, False, " (not UTF-8 text)"))
        elif check.kind == "length":
            ok = len(text) == check.expected
            results.append((check, ok, "" if ok else f" (got {len(text)} characters)"))
        else:
            ok = text == check.expected
            shown = text if len(text) <= 40 else text[:37] + "..."
            results.append((check, ok, "" if ok else f" (got {shown!r})"))
    return results


def _defines_result(check: Check, source: bytes, report, ended: str) -> tuple[Check, bool, str]:
    """`defines`: the source binds the name at top level (read here, never run) and
    the child found it callable."""
    if not _binds(source, str(check.expected)):
        return check, False, f" (no top-level {check.expected} in the source)"
    if not isinstance(report, dict):
        return check, False, ended or " (not reached)"
    ok = report.get("callable") is True
    return check, ok, "" if ok else f" (got {_shown(report.get('got'))})"


def _call_result(check: Check, report, ended: str) -> tuple[Check, bool, str]:
    """A call: the value the child saw returned, compared here with the answer."""
    if not isinstance(report, dict):
        return check, False, ended or " (not reached)"
    value = report.get("value")
    ok = type(value) is int and value == check.expected
    return check, ok, "" if ok else f" (got {_shown(report.get('got'))})"


def _binds(source: bytes, name: str) -> bool:
    """Whether `source` binds `name` at module level (def, assignment or import)."""
    try:
        tree = ast.parse(source.decode("utf-8"))
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError):
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound = [node.name]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound = [(a.asname or a.name).split(".")[0] for a in node.names]
        else:
            continue
        if name in bound:
            return True
    return False


def _shown(text) -> str:
    text = str(text)
    return text if len(text) <= 40 else text[:37] + "..."


# Runs in the sandbox with cwd = the workspace. It holds the hidden inputs but never the
# answers (the caller compares), so nothing in this process is worth forging. Everything
# it needs is imported before the workspace goes on sys.path, so a workspace file cannot
# shadow it; reports go straight to fd 1 with a nonce, the module's own prints are
# discarded.
_CHECKER = """\
import json, os, sys

def report(step, **fields):
    fields["step"] = step
    os.write(1, ({nonce} + " " + json.dumps(fields) + "\\n").encode())

def shown(value):
    if type(value) in (int, bool, float, str, type(None)):
        try:
            text = repr(value)
        except Exception:
            text = "an unprintable " + type(value).__name__
        return text if len(text) <= 40 else text[:37] + "..."
    return "a " + type(value).__name__

sys.stdout = sys.stderr = open(os.devnull, "w")
report("start")
sys.path.insert(0, os.getcwd())
try:
    module = __import__({module})
    function = getattr(module, {function}, None)
    report("defines", callable=callable(function),
           got="not defined" if function is None else "not a function")
except BaseException as e:
    report("defines", callable=False, got="import failed: " + type(e).__name__)
    function = None
for i, x in enumerate({inputs}):
    if not callable(function):
        report("call%d" % i, got="no function")
        continue
    try:
        got = function(x)
        exact = type(got) is int and -(1 << 62) < got < (1 << 62)
        report("call%d" % i, value=int(got) if exact else None, got=shown(got))
    except BaseException as e:
        report("call%d" % i, got="raised " + type(e).__name__)
report("end")
"""


def _check_quality(quality: float) -> None:
    if not 0.0 <= quality <= 1.0:
        raise ValueError(f"quality={quality!r}: expected a number in [0, 1]")


def _attempt(goal: Goal, rng: np.random.Generator, quality: float) -> str | None:
    """A write action for `goal`, correct with probability `quality`; None = skipped."""
    if rng.random() < quality:
        return format_action(Action("write", path=goal.path, content=goal.solution))
    mistake = rng.choice(["skip", "typo", "wrong"], p=[0.2, 0.4, 0.4])
    if mistake == "skip":
        return None
    content = _typo(goal.solution, rng) if mistake == "typo" else _wrong(goal, rng)
    return format_action(Action("write", path=goal.path, content=content))


def _typo(text: str, rng: np.random.Generator) -> str:
    """One character substituted, dropped or doubled (never the same text)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    for _ in range(20):
        i = int(rng.integers(len(text)))
        edit = rng.integers(3)
        if edit == 0:
            out = text[:i] + alphabet[rng.integers(len(alphabet))] + text[i + 1 :]
        elif edit == 1:
            out = text[:i] + text[i + 1 :]
        else:
            out = text[:i] + text[i] + text[i:]
        if out != text:
            return out
    return text + "x"


def _wrong(goal: Goal, rng: np.random.Generator) -> str:
    """A plausible but wrong content: a misread rather than a slip."""
    if goal.function:
        line = goal.solution.splitlines()[1]  # "    return x + 3"
        op, k = line.split()[-2:]
        if rng.random() < 0.5:
            wrong = line[: -len(k)] + str(int(k) + int(rng.choice([-1, 1])))
        else:
            wrong = line.replace(f" {op} ", " - " if op != "-" else " + ")
        if rng.random() < 0.3:  # forgot the colon: a syntax error
            return goal.solution.replace("(x):", "(x)", 1)
        return goal.solution.replace(line, wrong)
    if goal.derived_from and goal.derived_from != goal.solution:
        return goal.derived_from  # wrote the argument, not the derived text
    swapped = " ".join(reversed(goal.solution.split(" ")))
    return swapped if swapped != goal.solution else _typo(goal.solution, rng)
