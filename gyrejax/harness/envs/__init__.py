"""Environments by name: the config's `harness.environment` string picks one.

    @register_environment("mini_repo")
    class MiniRepoEnv: ...

    env = get_environment("mini_repo", fail_evaluations=1)

The built-in environments register themselves when their module is imported; the registry
imports them on first use, so `get_environment("mini_repo")` works without importing
`gyrejax.harness.envs.mini_repo` first.

The harness and the stages build environments with
`get_environment(name, sandbox=config.harness.sandbox)`, so a factory takes a `sandbox`
keyword: the mode (`gyrejax.harness.sandbox.choose_sandbox`) for any agent code it runs.

What the harness needs of an environment is `Environment`; a scoring that cannot run
raises `EvaluationError` (the harness retries it within `harness.eval_retry_budget`).
The agent's action syntax is the harness's (`gyrejax.harness.actions`), not an
environment's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

_Factory = TypeVar("_Factory", bound=Callable[..., Any])


class EvaluationError(RuntimeError):
    """The evaluation itself could not run (an infrastructure failure, worth a retry);
    never raised for a check that legitimately fails."""


class Environment(Protocol):
    """What the harness, the task draws and the warm start use of an environment.

    A task has at least `task_id` and `spec` (the text the agent is given); a score has
    `reward` (in [0, 1]). An environment whose tasks come from task-file lines
    (`task_from_dict`) names the lines' keys that locate a hidden task in
    `private_task_fields`: the agent never sees them (`tasks.FileTask.public`).
    """

    name: str

    def sample_tasks(self, n: int, *, seed: int, difficulty: Any = 1) -> list:
        """`n` distinct tasks, a function of (seed, difficulty) only."""

    def score(self, task: Any, workspace_root: Path | str) -> Any:
        """Scores a workspace; raises `EvaluationError` if the evaluation cannot run.

        The verifier's guarantee (the policy is an adversary, and learns whatever moves
        its reward): the answers, and whatever they follow from, never enter a process
        that runs or imports agent code; a process that does (a sandboxed checker)
        reports observations only, and the verdict is computed outside it. So no file
        the agent writes can pass a check except by doing what the check asks.
        """

    def run_visible_checks(self, task: Any, workspace_root: Path | str) -> str:
        """The agent's `check` tool: the visible checks' results, as an observation."""


# Modules holding the built-in environments, imported on first lookup.
_BUILTIN_MODULES = ("gyrejax.harness.envs.mini_repo",)
_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_environment(name: str) -> Callable[[_Factory], _Factory]:
    """Decorator registering a class or factory under `name`.

    Raises:
      ValueError: `name` is empty or already taken by another factory.
    """
    if not (isinstance(name, str) and name):
        raise ValueError(f"environment name {name!r}: expected a non-empty string")

    def decorator(factory: _Factory) -> _Factory:
        existing = _REGISTRY.get(name)
        # The same class registered again (a module re-import) is not a conflict.
        if existing is not None and _qualname(existing) != _qualname(factory):
            raise ValueError(
                f"environment {name!r} is already registered to {_qualname(existing)}; "
                f"cannot register {_qualname(factory)}"
            )
        _REGISTRY[name] = factory
        return factory

    return decorator


def get_environment(name: str, **kwargs: Any) -> Any:
    """A new environment: the factory registered under `name`, called with `kwargs`.

    Raises:
      ValueError: no environment is registered under `name` (the message lists the known
        ones).
    """
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        known = ", ".join(known_environments()) or "(none)"
        raise ValueError(f"unknown environment {name!r}; known environments: {known}")
    return factory(**kwargs)


def known_environments() -> tuple[str, ...]:
    """The registered names, sorted."""
    _load_builtins()
    return tuple(sorted(_REGISTRY))


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _qualname(factory: Callable[..., Any]) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"
