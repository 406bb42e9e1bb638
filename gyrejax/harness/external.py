"""External agents: the user's agent program, one process per execution, through the
run's OpenAI door (`rl.agent = command`).

For each execution, `CommandAgents.run_execution` opens the execution on the door
(`OpenAIServer.open_execution`: its own key), starts `rl.agent_command` (shell-split)
in the execution's workspace, in a sandbox of its own (`harness.agent_sandbox`,
harness/agent_sandbox.py: the door reached through the execution's own unix socket,
the run's workdir hidden; or, with "none", beside the run in its own process group),
with

  OPENAI_BASE_URL    http://127.0.0.1:PORT/v1, the door (served by the runtime itself)
  OPENAI_API_KEY     the execution's own key
  GYREJAX_TASK       the task as JSON (`tasks.task_json`: its public fields only)
  GYREJAX_WORKSPACE  the workspace path (also the working directory)
  GYREJAX_MODEL      the served model name
  GYREJAX_EXECUTION  the execution id (for the agent's own logs)

and waits for it to exit. Its calls are recorded by the door exactly as the built-in
harness's (same proxy, same records); sub-agents and summaries are the calls it marks
with the door's X-Gyrejax-Agent / X-Gyrejax-Role headers. Then:

  * exit 0: scored by the environment's verifier on the workspace (`rl.reward =
    environment`, as the built-in harness scores) or by the `reward.json` the agent
    wrote there (`rl.reward = agent`: {"reward": x});
  * past `harness.timeout_s`: the whole sandbox (or process group) is killed;
    `timed_out`, scored like an exit;
  * non-zero exit (or, with `rl.reward = agent`, no readable reward.json): `failed`,
    with the stderr tail in the record's `error`; never trained, never stops the run.

stdout and stderr go to `<workdir>/<workspace name>.out` / `.err`, beside the
workspace, not in it (they are not artifacts). Agents inherit the runtime's
environment minus the run's own secrets (sandboxed: HOME is the workspace, TMPDIR its
private /tmp).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import urllib.parse
import weakref
from pathlib import Path

from absl import logging

from gyrejax.config import AGENT_SANDBOXES, Config
from gyrejax.harness.agent import score_workspace, workspace_name
from gyrejax.harness.agent_sandbox import (
    AGENT_SANDBOX_WARNING,
    AgentProcess,
    SandboxedAgent,
    agent_argv,
)
from gyrejax.harness.cgroups import ExecutionCgroup
from gyrejax.harness.chat import HfChat
from gyrejax.harness.sandbox import choose_sandbox, give_to_sandbox
from gyrejax.harness.tasks import FileTask, task_json
from gyrejax.harness.workspace import Workspace
from gyrejax.harness.workspace_quota import WorkspaceQuota
from gyrejax.serve.chat import ByteChatTemplate
from gyrejax.serve.http import API_KEY_ENV, ENGINE_TOKEN_ENV
from gyrejax.serve.openai_server import OpenAIServer
from gyrejax.trajectory import Execution

REWARD_FILE = "reward.json"
STDERR_TAIL_BYTES = 2000
# The run's secrets never reach the agent (it gets its execution's key only).
_WITHHELD_ENV = (API_KEY_ENV, ENGINE_TOKEN_ENV)


class CommandAgents:
    """Runs executions as processes of `command` against `door` (see module docstring).

    Args:
      door: the run's OpenAI door, started (its `url` is served).
      base_url: the door's URL (without /v1).
      command: the agent's argv (`shlex.split(rl.agent_command)`).
      workdir: workspaces live in `workdir/<workspace name>`.
      environment: scores workspaces (`reward = "environment"`).
      reward: "environment" or "agent".
      timeout_s: wall clock per execution; then everything the agent started is killed.
      eval_retry_budget: evaluation attempts before `eval_failed`.
      model_name: GYREJAX_MODEL.
      agent_sandbox: "bwrap" (each agent in its own sandbox, harness/agent_sandbox.py)
        or "none" (beside the run: trusted agents only).
      hidden: what sandboxed agents must not see besides `workdir` (the run's workdir,
        the task file).
      max_processes, memory_bytes: an agent tree's processes and memory (in cgroups of
        its own, harness/cgroups.py, where the run is root; memory_bytes also bounds
        each sandboxed process's address space).
      file_bytes, tmp_bytes: a sandboxed agent's file size and its private /tmp's size.
      workspace_bytes, workspace_inodes: each workspace's quota (workspace_quota.py).

    Raises:
      SandboxUnavailable: agent_sandbox="bwrap" and bubblewrap does not work here.
    """

    def __init__(
        self,
        door: OpenAIServer,
        base_url: str,
        command: list[str],
        workdir: str | Path,
        *,
        environment,
        reward: str = "environment",
        timeout_s: float = 600.0,
        eval_retry_budget: int = 3,
        model_name: str = "gyrejax",
        agent_sandbox: str = "bwrap",
        hidden: tuple[Path, ...] = (),
        max_processes: int = 512,
        memory_bytes: int = 4 << 30,
        file_bytes: int = 256 << 20,
        tmp_bytes: int = 256 << 20,
        workspace_bytes: int = 64 << 20,
        workspace_inodes: int = 4096,
    ):
        if reward not in ("environment", "agent"):
            raise ValueError(f"reward={reward!r}: expected 'environment' or 'agent'")
        if agent_sandbox not in AGENT_SANDBOXES:
            raise ValueError(f"agent_sandbox={agent_sandbox!r}: expected one of {AGENT_SANDBOXES}")
        self.bwrap = None
        if agent_sandbox == "bwrap":
            self.bwrap = choose_sandbox("bwrap").bwrap  # raises SandboxUnavailable
            # Each execution's own door socket: a short path (a unix socket's is at most
            # 107 bytes), private to the run, gone with this object.
            self._sockets = Path(tempfile.mkdtemp(prefix="gyrejax-doors-"))
            weakref.finalize(self, shutil.rmtree, self._sockets, ignore_errors=True)
        else:
            logging.warning("%s", AGENT_SANDBOX_WARNING)
        self._opened = itertools.count()
        self.hidden = tuple(Path(os.path.realpath(p)) for p in (workdir, *hidden))
        self.limits = dict(memory_bytes=memory_bytes, file_bytes=file_bytes, tmp_bytes=tmp_bytes)
        self.quota = WorkspaceQuota(workdir, workspace_bytes, workspace_inodes)
        self.max_processes = max_processes
        self.door = door
        self.base_url = base_url.rstrip("/") + "/v1"
        self.command = list(command)
        self.workdir = Path(workdir)
        self.env = environment
        self.reward = reward
        self.timeout_s = timeout_s
        self.eval_retry_budget = eval_retry_budget
        self.model_name = model_name

    async def run_execution(self, task, execution_id: str, group_id: str, seed: int) -> Execution:
        """Runs one agent process to its end; returns the record (never raises for the
        agent's behaviour). `seed` is unused: the agent seeds its own requests (the door
        seeds those that give none from the execution id and request count)."""
        del seed
        key = self.door.open_execution(execution_id, task.task_id, group_id, owned=True)
        name = workspace_name(execution_id)
        logs = self.workdir / name
        try:
            self.quota.open(self.workdir / name)
            workspace = Workspace(self.workdir / name)
            socket = None
            if self.bwrap is not None:
                socket = self._sockets / f"{next(self._opened)}.sock"
                await self.door.serve_execution_socket(execution_id, socket)
            status, error = await self._run_process(
                task, execution_id, key, workspace, logs, socket
            )
            reward, attempts = None, 0
            if status != "failed":
                reward, status, attempts, error = await self._reward(
                    task, execution_id, workspace, status, error
                )
        except BaseException:  # cancelled (the run ends): the door forgets it, unstored
            await self.door.close_execution(execution_id, "timed_out")
            raise
        finally:
            await self.quota.close(self.workdir / name)
        return await self.door.close_execution(execution_id, status, reward, attempts, error)

    async def _run_process(
        self, task, execution_id: str, key: str, workspace: Workspace, logs: Path, socket
    ) -> tuple[str, str]:
        """Starts the agent and waits: ("finished" | "timed_out" | "failed", error)."""
        env = {k: v for k, v in os.environ.items() if k not in _WITHHELD_ENV}
        env.update(
            OPENAI_BASE_URL=self.base_url,
            OPENAI_API_KEY=key,
            GYREJAX_TASK=task_json(task),
            GYREJAX_WORKSPACE=str(workspace.root),
            GYREJAX_MODEL=self.model_name,
            GYREJAX_EXECUTION=execution_id,
        )
        if self.bwrap is None:
            agent = AgentProcess()
            argv_for = lambda _: self.command
        else:  # the same URL inside: the forwarder listens on the door's port there
            agent = SandboxedAgent()
            env.update(HOME=str(workspace.root), TMPDIR="/tmp")
            root = Path(os.path.realpath(workspace.root))
            if os.geteuid() == 0:
                give_to_sandbox(root)  # agent code runs as uid 65534
            port = urllib.parse.urlsplit(self.base_url).port
            argv_for = lambda info_fd: agent_argv(
                self.bwrap, self.command, root, socket, port, hidden=self.hidden,
                info_fd=info_fd, **self.limits,
            )  # fmt: skip
        cgroup = ExecutionCgroup.create(self.max_processes, self.limits["memory_bytes"])
        err_path = logs.with_name(logs.name + ".err")
        with open(logs.with_name(logs.name + ".out"), "wb") as out, open(err_path, "wb") as err:
            try:
                process = await agent.start(
                    lambda info_fd: cgroup.join_argv(argv_for(info_fd)),
                    cwd=workspace.root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                )
            except OSError as e:  # not found, not executable: the agent's failure
                await asyncio.to_thread(cgroup.remove)
                return "failed", f"cannot start {self.command[0]!r}: {e}"
            try:
                async with asyncio.timeout(self.timeout_s):
                    code = await process.wait()
            except TimeoutError:
                logging.info("agent of %s timed out after %.0f s", execution_id, self.timeout_s)
                return "timed_out", ""
            finally:  # also on cancellation; and what it left running after it exited
                await agent.kill()
                await asyncio.to_thread(cgroup.remove)  # and what left its group
        if code != 0:
            tail = _tail(err_path)
            logging.warning("agent of %s exited with %d: %s", execution_id, code, tail[-200:])
            return "failed", f"exit code {code}\n{tail}"
        return "finished", ""

    async def _reward(
        self, task, execution_id: str, workspace: Workspace, status: str, error: str
    ) -> tuple[float | None, str, int, str]:
        """(reward, status, eval attempts, error) by the configured source."""
        if self.reward == "agent":
            reward, problem = _read_reward(workspace.root / REWARD_FILE)
            if problem:  # a timed-out agent that wrote none is still timed_out, unscored
                status = "failed" if status == "finished" else status
                return None, status, 0, problem
            return reward, status, 0, error
        env_task = task.env_task if isinstance(task, FileTask) else task
        reward, status, attempts = await score_workspace(
            self.env, env_task, workspace, status, execution_id, self.eval_retry_budget
        )
        return reward, status, attempts, error


async def start_command_agents(
    config: Config, proxy, chat, workdir: str | Path, environment, run_dirs=()
) -> CommandAgents:
    """`rl.agent_command`'s agents behind a new OpenAI door on `proxy`, served on
    loopback (stop it with `agents.door.stop()`), in `chat`'s template; sandboxed
    agents see neither `run_dirs` (the run's workdir) nor the task file."""
    model_name = Path(config.model.hf_checkpoint).name or "gyrejax"
    door = OpenAIServer(
        proxy,
        chat.template if isinstance(chat, HfChat) else ByteChatTemplate(),
        api_key=secrets.token_urlsafe(32),  # nobody creates executions but us
        model_name=model_name,
        default_max_tokens=config.harness.max_new_tokens,
        max_open_executions=max(256, 2 * config.rl.group_size * config.rl.groups_per_step),
        # Far past any context the run serves or trains (the engines refuse what is
        # too long for them; the command warm start's scripted answers do not), and
        # small enough that an oversized body is refused before it is read.
        max_prompt_tokens=4 * max(config.rollout.max_seq_len, *config.train.all_row_lengths),
    )
    url = await door.start("127.0.0.1", 0)
    hidden = (Path(config.rl.tasks_path),) if config.rl.tasks_path else ()
    return CommandAgents(
        door,
        url,
        shlex.split(config.rl.agent_command),
        workdir,
        environment=environment,
        reward=config.rl.reward,
        timeout_s=config.harness.timeout_s,
        eval_retry_budget=config.harness.eval_retry_budget,
        model_name=model_name,
        agent_sandbox=config.harness.agent_sandbox,
        hidden=(*hidden, *run_dirs),
        max_processes=config.harness.agent_max_processes,
        memory_bytes=config.harness.agent_memory_bytes,
        file_bytes=config.harness.agent_file_bytes,
        tmp_bytes=config.harness.agent_tmp_bytes,
        workspace_bytes=config.harness.workspace_bytes,
        workspace_inodes=config.harness.workspace_inodes,
    )


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - STDERR_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _read_reward(path: Path) -> tuple[float | None, str]:
    """(reward, "") from an agent's reward.json, or (None, what is wrong)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["reward"]
    except FileNotFoundError:
        return None, f"rl.reward=agent: the agent wrote no {REWARD_FILE}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f'rl.reward=agent: {REWARD_FILE} is not {{"reward": <number>}} ({e!r})'
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None, f"rl.reward=agent: {REWARD_FILE} reward={value!r}: expected a finite number"
    return float(value), ""
