"""A plain tool-calling agent: the `openai` package and the standard library only.

It works against any OpenAI-compatible server: gyrejax's door in the RL loop
(`rl.agent = "command"`, `rl.agent_command = "python examples/agents/react_agent.py"`),
or vLLM's own server while you debug it outside RL:

  OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x GYREJAX_MODEL=<model> \
  GYREJAX_TASK='{"id": "t", "prompt": "a.txt: hello"}' python react_agent.py

Environment: OPENAI_BASE_URL / OPENAI_API_KEY (read by the client), GYREJAX_TASK (the
task as JSON: "prompt", optionally "test_command", run by run_tests in the workspace),
GYREJAX_WORKSPACE (default: the working directory), GYREJAX_MODEL, and optionally
AGENT_MAX_TURNS (default 16) and AGENT_MAX_TOKENS (default 256).

Tools: write_file, read_file, run_tests, done. Paths stay inside the workspace. The
agent exits 0 when the model calls done or its turns run out; the RL loop then scores
the workspace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai

SYSTEM = (
    "You write the files a task asks for in your workspace, using the tools. "
    "Call done when finished."
)


def _function(name: str, description: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
            },
        },
    }


TOOLS = [
    _function(
        "write_file",
        "Write a file in the workspace.",
        {"path": {"type": "string"}, "content": {"type": "string"}},
    ),
    _function("read_file", "Read a file of the workspace.", {"path": {"type": "string"}}),
    _function("run_tests", "Run the task's tests in the workspace.", {}),
    _function("done", "Finish the task.", {}),
]


class Tools:
    """The tools, confined to the workspace."""

    def __init__(self, root: Path, task: dict):
        self.root = root.resolve()
        self.task = task

    def _path(self, path: str) -> Path:
        target = (self.root / path).resolve()
        if self.root not in target.parents:
            raise ValueError(f"{path!r} is outside the workspace")
        return target

    def write_file(self, path: str, content: str) -> str:
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        return f"wrote {path} ({len(content)} chars)"

    def read_file(self, path: str) -> str:
        return self._path(path).read_text(encoding="utf-8")[:4000]

    def run_tests(self) -> str:
        command = self.task.get("test_command")
        if not command:
            return "this task has no tests to run"
        done = subprocess.run(
            command, shell=True, cwd=self.root, capture_output=True, text=True, timeout=60
        )
        return f"exit {done.returncode}\n{(done.stdout + done.stderr)[-2000:]}"


def call_tool(tools: Tools, name: str, arguments: str) -> str:
    """A tool's observation; a bad call is an observation too, never a crash."""
    try:
        args = json.loads(arguments or "{}")
        if name not in ("write_file", "read_file", "run_tests"):
            return f"error: unknown tool {name!r}"
        return getattr(tools, name)(**args)
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def main() -> int:
    task = json.loads(os.environ["GYREJAX_TASK"])
    tools = Tools(Path(os.environ.get("GYREJAX_WORKSPACE", ".")), task)
    client = openai.OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY
    model = os.environ.get("GYREJAX_MODEL", "default")
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "256"))
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["prompt"]},
    ]
    for _ in range(int(os.environ.get("AGENT_MAX_TURNS", "16"))):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # plain text: remind it of the tools
            messages.append({"role": "user", "content": "use a tool (or call done)"})
            continue
        for call in message.tool_calls:
            if call.function.name == "done":
                return 0
            observation = call_tool(tools, call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
    return 0


if __name__ == "__main__":
    sys.exit(main())
