"""The agent harness: runs executions of tasks through the proxy and records them.

One execution = the main agent's loop on one task, in its own workspace:

  model call -> parse action -> run tool -> append observation -> ...

until `done`, out of turns, or out of time. Along the way:
  * compaction: when a context passes `context_budget_tokens`, a summary call (role
    `main_summary` / `sub_agent_summary`) writes a summary and the agent continues from
    system + task + summary;
  * sub-agents: `delegate <subtask>` runs a sub-agent loop with its own context (role
    `sub_agent`) in the same workspace; its `done <result>` comes back as an observation;
  * retries: a malformed action is asked again from the same context (a fork in the
    trajectory tree) up to `max_retries` times, then answered with an error observation;
    a tool that raises becomes an error observation, never a crash;
  * timeouts by wall clock and by turns: the execution stops, its in-flight calls are
    cancelled, and its workspace is kept and scored (status `timed_out`).
Scoring runs the task's hidden checks on the preserved workspace (reward = fraction
passed); an evaluation that errors is retried up to `eval_retry_budget` times, then the
execution is `eval_failed`; an empty workspace is `no_artifact` (reward 0). The model
calls are recorded by the proxy; the harness only assembles the `Execution`.

Contexts are built, and turns parsed, by a chat format (harness/chat.py): the byte
tokenizer's layout with text actions, or an HF tokenizer's chat template with tool calls
(`model.tokenizer`). Either way each answer goes back into its context as the exact
generated ids, so an agent's calls share their prefix in the trajectory tree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from pathlib import Path

import numpy as np
from absl import logging

from gyrejax.config import HarnessConfig
from gyrejax.harness.chat import ByteChat
from gyrejax.harness.envs import EvaluationError, get_environment
from gyrejax.harness.workspace import Workspace
from gyrejax.harness.workspace_quota import WorkspaceQuota
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.types import SamplingParams
from gyrejax.trajectory import Execution

# Short on purpose: a byte-level model pays for every byte of every context it trains on.
MAIN_SYSTEM = "write the spec's files, then: done"
SUB_SYSTEM = "do the subtask, then: done <result>"


class _OutOfTurns(Exception):
    """The main agent used all its turns without finishing."""


@dataclasses.dataclass
class _Run:
    """Mutable state of one execution."""

    execution_id: str
    task: object
    workspace: Workspace
    seed: int
    calls: int = 0  # model calls made (seeds each call's sampling)
    sub_agents: int = 0


class Harness:
    """Runs executions of an environment's tasks through a proxy.

    Args:
      proxy: the door to the engines (it records every call).
      config: turns, timeouts, budgets.
      workdir: workspaces live in `workdir/<execution id>`.
      temperature, top_p, top_k: how every call samples (`rollout.temperature`, ...).
      environment: defaults to `get_environment(config.environment,
        sandbox=config.sandbox)`.
      chat: the chat format (harness/chat.py); default the byte tokenizer's.
    """

    def __init__(
        self,
        proxy: Proxy,
        config: HarnessConfig,
        workdir: str | Path,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        environment=None,
        chat=None,
    ):
        self.proxy = proxy
        self.config = config
        self.workdir = Path(workdir)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        if environment is None:
            environment = get_environment(config.environment, sandbox=config.sandbox)
        self.env = environment
        self.chat = chat if chat is not None else ByteChat()
        self.quota = WorkspaceQuota(self.workdir, config.workspace_bytes, config.workspace_inodes)

    # --- executions -----------------------------------------------------------------------

    async def run_group(
        self, task, group_id: str, size: int, seed: int, prefix: str = ""
    ) -> list[Execution]:
        """`size` concurrent executions of one task (one group, for relative advantages)."""
        runs = [
            self.run_execution(task, f"{prefix}{group_id}/{i}", group_id, seed=seed * 1000 + i)
            for i in range(size)
        ]
        return list(await asyncio.gather(*runs))

    async def run_execution(self, task, execution_id: str, group_id: str, seed: int) -> Execution:
        """Runs one execution to its end and returns its record (never raises for agent
        or tool behaviour)."""
        self.proxy.dispatch(execution_id)
        root = self.workdir / workspace_name(execution_id)
        self.quota.open(root)
        try:
            run = _Run(execution_id, task, Workspace(root), seed)
            status = "finished"
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await self._agent(run, "main", self.config.max_turns)
            except TimeoutError:
                status = "timed_out"
                logging.info(
                    "execution %s timed out after %.0f s", execution_id, self.config.timeout_s
                )
            except _OutOfTurns:
                status = "timed_out"
            finally:
                self.proxy.cancel_execution(execution_id)
            reward, status, attempts = await self._score(run, status)
        finally:
            await self.quota.close(root)
        return Execution(
            execution_id=execution_id,
            task_id=task.task_id,
            group_id=group_id,
            calls=self.proxy.finish(execution_id),
            status=status,
            reward=reward,
            eval_attempts=attempts,
        )

    async def _score(self, run: _Run, status: str) -> tuple[float | None, str, int]:
        return await score_workspace(
            self.env,
            run.task,
            run.workspace,
            status,
            run.execution_id,
            self.config.eval_retry_budget,
        )

    # --- agents ----------------------------------------------------------------------------

    async def _agent(self, run: _Run, kind: str, max_turns: int, subtask: str = "") -> str:
        """Runs one agent loop; returns its result text (`done <result>`).

        `kind` is "main" or "sub"; the main agent raises `_OutOfTurns` when it runs out.
        """
        if kind == "main":
            agent_id, role, summary_role = "main", "main", "main_summary"
            system, task_text = MAIN_SYSTEM, run.task.spec
        else:
            run.sub_agents += 1
            agent_id, role, summary_role = f"sub-{run.sub_agents}", "sub_agent", "sub_agent_summary"
            system, task_text = SUB_SYSTEM, subtask
        context = self.chat.start(system, task_text)
        for _ in range(max_turns):
            if len(context) > self.config.context_budget_tokens:
                summary = await self._call(run, agent_id, summary_role, context.summary_prompt())
                context.restart(self._clip("summary: " + self.chat.text(summary)))
            output, action = await self._act(run, agent_id, role, context.prompt())
            context.add_answer(output)  # the exact ids: the next prompt extends this one
            if action.malformed:
                text = f"error: {action.error}"
            elif action.kind == "done":
                return action.result
            elif action.kind == "delegate" and kind == "main":
                result = await self._agent(
                    run, "sub", self.config.sub_agent_max_turns, subtask=action.subtask
                )
                text = f"subtask result: {result}"
            else:
                text = await self._tool(run, action)
            context.add_observation(self._clip(text))
        if kind == "main":
            raise _OutOfTurns()
        return "subtask unfinished"

    async def _act(self, run: _Run, agent_id: str, role: str, prompt: list[int]):
        """Asks for an action; re-asks the same prompt while the answer is malformed
        (each retry is a fork of the same context in the trajectory tree)."""
        for _ in range(1 + self.config.max_retries):
            output = await self._call(run, agent_id, role, prompt)
            action = self.chat.parse(output)
            if not action.malformed:
                break
        return output, action

    async def _call(self, run: _Run, agent_id: str, role: str, prompt: list[int]) -> list[int]:
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.config.max_new_tokens,
            stop_ids=self.chat.stop_ids,
            seed=(zlib.crc32(run.execution_id.encode()) + run.seed * 7919 + run.calls) % 2**31,
        )
        run.calls += 1
        completion = await self.proxy.generate(
            run.execution_id, agent_id, role, np.asarray(prompt), sampling
        )
        return completion.output_ids.tolist()

    async def _tool(self, run: _Run, action) -> str:
        """Runs a workspace or environment tool; any exception becomes an observation."""
        await asyncio.sleep(self._tool_latency_s(run))
        ws = run.workspace
        try:  # workspace I/O off the event loop: a workspace of many files is slow
            if action.kind == "write":
                return await asyncio.to_thread(ws.write, action.path, action.content)
            if action.kind == "read":
                return await asyncio.to_thread(ws.read, action.path)
            if action.kind == "ls":
                return await asyncio.to_thread(ws.list_files)
            if action.kind == "check":
                return await asyncio.to_thread(self.env.run_visible_checks, run.task, ws.root)
            return f"error: {action.kind} is not available here"
        except Exception as e:  # a tool failure is the agent's observation, not a crash
            logging.warning("tool %s failed in %s: %r", action.kind, run.execution_id, e)
            return f"error: tool {action.kind} failed: {type(e).__name__}: {e}"

    def _tool_latency_s(self, run: _Run) -> float:
        """The modelled wall time of this tool call (`harness.tool_latency_*`), seeded by
        the execution and its call count, so a run's latencies repeat across policies."""
        median, sigma = self.config.tool_latency_median_s, self.config.tool_latency_sigma
        if median <= 0:
            return 0.0
        key = zlib.crc32(run.execution_id.encode()) ^ (run.seed * 7919 + run.calls)
        return float(median * np.exp(sigma * np.random.default_rng(key).standard_normal()))

    def _clip(self, text: str) -> str:
        limit = self.config.max_observation_tokens - 2
        data = text.encode("utf-8")
        if len(data) <= limit:
            return text
        return data[: limit - 3].decode("utf-8", errors="ignore") + "..."


async def score_workspace(
    env, task, workspace: Workspace, status: str, execution_id: str, retry_budget: int
) -> tuple[float | None, str, int]:
    """(reward, status, attempts) of a finished workspace by the environment's hidden
    checks: an empty one is `no_artifact`; an evaluation that errors is retried up to
    `retry_budget` times, then `eval_failed`. Shared by the built-in and external agents."""
    if await asyncio.to_thread(workspace.is_empty):
        return 0.0, "no_artifact", 0
    attempts = 0
    while True:
        attempts += 1
        try:
            score = await asyncio.to_thread(env.score, task, workspace.root)
            return score.reward, status, attempts
        except EvaluationError as e:
            logging.warning("evaluation of %s failed (attempt %d): %s", execution_id, attempts, e)
            if attempts >= retry_budget:
                return None, "eval_failed", attempts


def workspace_name(execution_id: str) -> str:
    """A directory name for an execution id."""
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in execution_id)
    return f"{keep[:80]}-{zlib.crc32(execution_id.encode()):08x}"
