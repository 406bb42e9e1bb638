"""Demonstration executions for a supervised warm start.

The environment proposes the actions of a competent but imperfect agent (a per-file
chance of a mistake, some tasks delegated to a sub-agent); they are replayed through the
real harness and proxy by a scripted engine, so the recorded calls have exactly the
contexts the policy will later see, and each execution is scored like any other. SFT on
them gives the tiny model a non-trivial but imperfect starting reward.

With `rl.agent = command` the same actions drive the user's agent program instead
(`command_demonstrations`), so the demonstrations are in that agent's own format.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from gyrejax import progress
from gyrejax.config import Config, HarnessConfig
from gyrejax.harness.agent import SUB_SYSTEM, Harness
from gyrejax.harness.chat import ByteChat
from gyrejax.harness.external import start_command_agents
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.trajectory import Execution


async def demonstration_executions(
    env,
    tasks: list,
    config: HarnessConfig,
    workdir: str | Path,
    *,
    seed: int,
    quality: float,
    delegation_prob: float = 0.2,
    chat=None,
) -> list[Execution]:
    """One scored demonstration execution per task, recorded through the real proxy, in
    `chat`'s format (harness/chat.py; default the byte tokenizer's)."""
    chat = chat if chat is not None else ByteChat()
    rng = np.random.default_rng(seed)
    scripts: dict[str, dict[str, list[str]]] = {}
    for i, task in enumerate(tasks):
        if rng.random() < delegation_prob and len(task.goals) > 1:
            main, sub = env.demonstration_with_delegation(task, rng=rng, quality=quality)
        else:
            main, sub = env.demonstration(task, rng=rng, quality=quality), []
        scripts[f"demo-{seed}-{i}"] = {"main": main, "sub": sub}

    def respond(prompt: np.ndarray, request) -> list[int]:
        execution_id = request.request_id.rsplit("/", 1)[0]
        kind = chat.prompt_kind(prompt, SUB_SYSTEM)
        if kind == "summary":
            return chat.answer("files written so far")
        remaining = scripts[execution_id][kind]
        return chat.answer(remaining.pop(0) if remaining else "done")

    proxy = Proxy([ScriptedEngine("demonstrator", respond)])
    harness = Harness(proxy, config, workdir, temperature=0.0, environment=env, chat=chat)
    # Each demonstration is its own group: SFT needs no group-relative advantage.
    runs = [
        harness.run_execution(task, execution_id, group_id=execution_id, seed=i)
        for i, (execution_id, task) in enumerate(zip(scripts, tasks, strict=True))
    ]
    return await progress.gather(runs, progress.Progress("demonstrations", len(runs), "executions"))


async def command_demonstrations(
    config: Config,
    env,
    tasks: list,
    workdir: str | Path,
    *,
    seed: int,
    quality: float,
    chat,
    concurrency: int = 8,
    run_dirs: tuple[Path, ...] = (),
) -> list[Execution]:
    """One scored demonstration per task by the user's own agent (`rl.agent = command`);
    sandboxed agents do not see `run_dirs` (the run's workdir).

    The agent runs as in RL, through a door whose model is the environment's
    demonstrator: its answers are the demonstration's actions as tool calls in `chat`'s
    format. So the records hold the agent's own prompts, tools and turns, and SFT on them
    teaches the policy to drive that agent. The agent must offer the built-in
    `write_file(path, content)` and `done()` tools (examples/agents/react_agent.py does);
    the demonstrations' checks are left out (an agent's test tool is its own), and no
    task is delegated.
    """
    rng = np.random.default_rng(seed)
    scripts = {}
    for i, task in enumerate(tasks):
        actions = env.demonstration(task, rng=rng, quality=quality)
        scripts[f"demo-{seed}-{i}"] = [a for a in actions if a != "check"]

    def respond(prompt: np.ndarray, request) -> list[int]:
        remaining = scripts[request.request_id.rsplit("/", 1)[0]]
        return chat.answer(remaining.pop(0) if remaining else "done")

    proxy = Proxy([ScriptedEngine("demonstrator", respond)])
    agents = await start_command_agents(config, proxy, chat, workdir, env, run_dirs)
    slots = asyncio.Semaphore(concurrency)  # one agent process each

    async def run(i: int, execution_id: str, task) -> Execution:
        async with slots:
            return await agents.run_execution(task, execution_id, execution_id, seed=i)

    runs = [run(i, e, t) for i, (e, t) in enumerate(zip(scripts, tasks, strict=True))]
    try:
        counter = progress.Progress("demonstrations", len(runs), "executions")
        return await progress.gather(runs, counter)
    finally:
        await agents.door.stop()
