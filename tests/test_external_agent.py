"""External agents (`rl.agent = command`, gyrejax/harness/external.py): an agent process
per execution through the run's OpenAI door.

The reference for the records is the built-in harness itself: it runs a task with a
scripted policy (a retry, a sub-agent, a compaction), and an external script replays
those very calls through the door (the `openai` client, with the role headers) against
an engine answering the same outputs. The stored records must be the harness's, call
for call. Then: a hanging agent and what it spawned are killed at the timeout, a
crashing agent is `failed` with its stderr tail, a reward.json is the reward, the task
file resolves, the example agent solves a task, an RL run with a command agent trains
its step while one member crashes, and the command warm start's demonstrations are
recorded by the agent itself, in its own format.
"""

import asyncio
import dataclasses
import json
import re
import secrets
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import AGENT_SANDBOX, REPO_ROOT, load_config_file
from test_agent import CONFIG, run_one, two_file_task
from test_openai_proxy import without_times

from gyrejax import preflight
from gyrejax.cells import split_into_cells
from gyrejax.config import ConfigError, from_dict
from gyrejax.harness import tokenizer as tok
from gyrejax.harness.chat import load_chat
from gyrejax.harness.demonstrations import command_demonstrations
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.harness.external import CommandAgents
from gyrejax.harness.tasks import load_task_file, task_json
from gyrejax.loop import Runtime
from gyrejax.loop.steps import NothingToTrain
from gyrejax.model.transformer import init_model
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.serve.openai_server import OpenAIServer
from gyrejax.trajectory import ExecutionStore, process

ADMIN_KEY = "k" * 32

REPLAY_AGENT = """
import json, os, sys
import openai
plan = json.load(open(sys.argv[1]))
client = openai.OpenAI()
for call in plan["calls"]:
    client.completions.create(
        model=os.environ["GYREJAX_MODEL"], prompt=call["prompt"], max_tokens=plan["max_tokens"],
        temperature=1.0, extra_body={"stop_token_ids": plan["stop"]},
        extra_headers={"X-Gyrejax-Agent": call["agent"], "X-Gyrejax-Role": call["role"]},
    )
for path, content in plan["files"].items():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    open(path, "w").write(content)
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def replay_engine(reference):
    """Answers each execution's prompts with the reference's outputs, in order."""
    answers = {}

    def respond(prompt, request):
        execution_id = request.request_id.rsplit("/", 1)[0]
        queue = answers.setdefault(execution_id, {})
        if not queue:
            for call in reference.calls:
                queue.setdefault(tuple(call.prompt_ids.tolist()), []).append(call.output_ids)
        return queue[tuple(prompt.tolist())].pop(0).tolist()

    return ScriptedEngine("scripted", respond)


def run_group(tmp_path, engine, command, tasks, *, reward="environment", timeout_s=30.0, **options):
    """Runs one execution per task through CommandAgents and a door; returns them.
    `options`: CommandAgents' keywords (agent_sandbox, hidden, ...)."""

    options.setdefault("agent_sandbox", AGENT_SANDBOX)

    async def body():
        door = OpenAIServer(Proxy([engine]), api_key=ADMIN_KEY, default_max_tokens=96)
        url = await door.start("127.0.0.1", 0)
        agents = CommandAgents(
            door, url, command, tmp_path / "workspaces", environment=MiniRepoEnv(),
            reward=reward, timeout_s=timeout_s, **options,
        )  # fmt: skip
        try:
            runs = [agents.run_execution(t, f"g/{i}", "g", i) for i, t in enumerate(tasks)]
            return await asyncio.gather(*runs)
        finally:
            await door.stop()

    return asyncio.run(body())


def test_an_external_agent_records_what_the_builtin_harness_records(tmp_path):
    task, writes = two_file_task()
    first_line = writes[1].splitlines()[0]
    scripts = {"x": {"main": ["oops", writes[0], f"delegate {first_line}: see spec",
                              *writes[2:], "done"],
                     "sub": [writes[1], "done wrote it"]}}  # fmt: skip
    config = dataclasses.replace(CONFIG, context_budget_tokens=len(task.spec) + 120)
    reference, _ = run_one(tmp_path / "ref", task, scripts, config=config)
    roles = [c.role for c in reference.calls]
    assert {"main_summary", "sub_agent"} <= set(roles) and reference.reward == 1.0
    np.testing.assert_array_equal(reference.calls[0].prompt_ids, reference.calls[1].prompt_ids)

    (root,) = (tmp_path / "ref").iterdir()  # the harness's workspace: the agent writes it too
    files = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}
    plan = {
        "calls": [
            {"prompt": c.prompt_ids.tolist(), "agent": c.agent_id, "role": c.role}
            for c in reference.sorted_calls()
        ],
        "files": files,
        "max_tokens": config.max_new_tokens,
        "stop": [tok.EOT],
    }
    plan_path = write(tmp_path, "plan.json", json.dumps(plan))
    agent = write(tmp_path, "agent.py", REPLAY_AGENT)
    group = run_group(
        tmp_path, replay_engine(reference), [sys.executable, agent, plan_path], [task, task]
    )

    for i, execution in enumerate(group):
        assert (execution.status, execution.reward, execution.error) == ("finished", 1.0, "")
        expected = [dataclasses.replace(c, execution_id=f"g/{i}") for c in reference.calls]
        assert without_times(execution.calls) == without_times(expected)
    batch = process(list(group), row_length=2048, vocab_size=tok.VOCAB_SIZE)
    assert batch.stats.executions_dropped == 0 and batch.tokens.size


@pytest.mark.parametrize(
    "agent_sandbox",
    [
        pytest.param(
            "bwrap", marks=pytest.mark.skipif(AGENT_SANDBOX != "bwrap", reason="no bwrap")
        ),
        "none",
    ],
)
def test_a_hanging_agent_and_its_children_are_killed_at_the_timeout(tmp_path, agent_sandbox):
    # Sleeps of a length nothing else uses mark the agent's processes on the host. In
    # its own session, a child leaves the process group: only the sandbox's PID
    # namespace takes it down (the audit's `setsid` survivor).
    sleeps = [f"sleep {10**6 + secrets.randbelow(10**6) * 2 + i}" for i in range(2)]
    survivor = f"setsid {sleeps[1]} &" if agent_sandbox == "bwrap" else ""
    agent = write(tmp_path, "hang.sh", f"""
        echo partial > data.txt
        {sleeps[0]} & {survivor}
        wait
    """)  # fmt: skip
    started = time.monotonic()
    (execution,) = run_group(
        tmp_path, replay_engine(None), ["sh", agent], [two_file_task()[0]], timeout_s=1.5,
        agent_sandbox=agent_sandbox,
    )  # fmt: skip
    assert 1.5 <= time.monotonic() - started < 10
    assert execution.status == "timed_out" and execution.reward is not None  # scored
    assert not any(running(sleep) for sleep in sleeps)


def running(text: str) -> list[int]:
    """Host pids whose command line contains `text` and are not zombies (a killed
    orphan may linger as one until init reaps it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_crashing_agent_is_failed_with_its_stderr_tail_and_the_others_go_on(tmp_path):
    agent = write(tmp_path, "crash.py", """
        import json, os, sys
        if os.environ["GYREJAX_EXECUTION"].endswith("/0"):
            sys.exit("boom: the agent broke")
        open("reward.json", "w").write(json.dumps({"reward": 0.25}))
    """)  # fmt: skip
    task = two_file_task()[0]
    crashed, fine = run_group(
        tmp_path, replay_engine(None), [sys.executable, agent], [task, task], reward="agent"
    )
    assert crashed.status == "failed" and crashed.reward is None
    assert crashed.error.startswith("exit code 1") and "boom: the agent broke" in crashed.error
    assert (fine.status, fine.reward) == ("finished", 0.25)
    store = ExecutionStore(tmp_path / "store")
    store.put(crashed)
    assert store.get("g/0") == crashed  # the error survives the store
    batch = process([crashed, fine], row_length=512, vocab_size=tok.VOCAB_SIZE)
    assert batch.stats.executions_dropped == 1  # never trained


def test_an_agent_finishing_its_own_execution_ends_only_that_and_cannot_set_its_reward(
    tmp_path,
):
    # The audit's crash: the documented finish on its own execution ended the whole run
    # (KeyError when the run closed it). Now it ends the agent's requests; the run
    # scores the workspace and keeps the record, and the reward the agent sent is ignored.
    agent = write(tmp_path, "finisher.py", """
        import json, os, urllib.parse, httpx
        url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
        me = urllib.parse.quote(os.environ["GYREJAX_EXECUTION"], safe="")
        auth = {"Authorization": f"Bearer {key}"}
        first = httpx.post(f"{url}/completions", headers=auth, timeout=30,
                           json={"model": "m", "prompt": [1, 2], "max_tokens": 4})
        done = httpx.post(f"{url}/executions/{me}/finish",
                          headers=auth, json={"status": "finished", "reward": 1.0})
        after = httpx.post(f"{url}/completions", headers=auth, timeout=30,
                           json={"model": "m", "prompt": [1, 2], "max_tokens": 4})
        json.dump([first.status_code, done.status_code, done.json(), after.status_code],
                  open("answers.json", "w"))
    """)  # fmt: skip
    task = two_file_task()[0]
    engine = ScriptedEngine("scripted", lambda prompt, request: [tok.EOT])
    finished, other = run_group(tmp_path, engine, [sys.executable, agent], [task, task])
    for execution in (finished, other):  # both recorded and scored by the run
        assert (execution.status, execution.reward) == ("finished", 0.0)  # not the 1.0 sent
        assert len(execution.calls) == 1  # the call before finish; none after
    for answers in (tmp_path / "workspaces").rglob("answers.json"):
        first, done, body, after = json.loads(answers.read_text())
        assert (first, done, after) == (200, 200, 401)
        assert body["ended"] is True and body["scored_by"] == "the run"


def test_the_agent_gets_its_task_workspace_and_key_not_the_runs_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("GYREJAX_API_KEY", ADMIN_KEY)
    agent = write(tmp_path, "env.py", """
        import json, os
        keys = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "GYREJAX_TASK", "GYREJAX_WORKSPACE",
                "GYREJAX_MODEL", "GYREJAX_API_KEY")
        seen = {k: os.environ.get(k) for k in keys} | {"cwd": os.getcwd()}
        json.dump(seen, open("env.json", "w"))
    """)  # fmt: skip
    task = two_file_task()[0]
    (execution,) = run_group(
        tmp_path, replay_engine(None), [sys.executable, agent], [task], reward="environment"
    )
    (env_file,) = (tmp_path / "workspaces").rglob("env.json")
    seen = json.loads(env_file.read_text())
    assert seen["GYREJAX_API_KEY"] is None and seen["OPENAI_API_KEY"] != ADMIN_KEY
    assert seen["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
    assert seen["OPENAI_BASE_URL"].endswith("/v1")
    assert seen["cwd"] == seen["GYREJAX_WORKSPACE"] == str(env_file.parent)
    assert json.loads(seen["GYREJAX_TASK"]) == json.loads(task_json(task))
    assert execution.status == "finished" and execution.reward == 0.0  # no goal file


def test_the_example_agent_solves_a_task_from_the_shipped_task_file(tmp_path):
    tasks = load_task_file(str(REPO_ROOT / "examples/agents/mini_repo_tasks.jsonl"), MiniRepoEnv())
    env = MiniRepoEnv()
    assert len(tasks) == 24 and [t.data for t in tasks[:8]] == [
        env.task_line(t, seed=0, index=i) for i, t in enumerate(env.sample_tasks(8, seed=0))
    ]
    task = tasks[0]

    def respond(prompt, request):  # a policy that writes each goal, then calls done
        text = tok.decode(prompt)
        written = text.count("wrote ")
        goals = task.env_task.goals
        if written < len(goals):
            args = {"path": goals[written].path, "content": goals[written].solution}
            call = {"name": "write_file", "arguments": args}
        else:
            call = {"name": "done", "arguments": {}}
        return tok.answer(f"<tool_call>{json.dumps(call)}</tool_call>")

    example = str(REPO_ROOT / "examples/agents/react_agent.py")
    (execution,) = run_group(
        tmp_path, ScriptedEngine("scripted", respond), [sys.executable, example], [task]
    )
    assert (execution.status, execution.reward) == ("finished", 1.0)
    assert [c.role for c in execution.calls] == ["main"] * (len(task.env_task.goals) + 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"agent": "command"}, r"config\.rl\.agent_command='': empty"),
        ({"agent_command": "x"}, r"config\.rl\.agent_command='x': only with rl\.agent=command"),
        ({"agent": "shell"}, r"config\.rl\.agent='shell': expected one of builtin, command"),
        ({"agent": "command", "agent_command": "a 'b"}, r"not shell-splittable"),
    ],
)
def test_bad_agent_settings_are_one_line_naming_the_field(overrides, message):
    c = load_config_file("tiny_cpu", "smoke")
    for name, value in overrides.items():
        setattr(c.rl, name, value)
    with pytest.raises(ConfigError, match=message):
        from_dict(c)


def test_a_bad_task_file_names_every_bad_line_at_once_before_the_run_starts(tmp_path):
    # The audit's files: invalid UTF-8 (was a traceback), index -1 (an IndexError), a huge
    # index (a hang), beside the older shapes of error; one error names them all.
    good = MiniRepoEnv().task_line(MiniRepoEnv().sample_tasks(1, seed=0)[0], seed=0, index=0)
    located = {"seed": 0, "difficulty": 1}
    lines = [
        json.dumps(good).encode(),
        b'{"id": "b", "prompt": "caf\xe9"}',
        json.dumps(good | {"mini_repo": located | {"index": -1}}).encode(),
        json.dumps(good | {"mini_repo": located | {"index": 10**12}}).encode(),
        json.dumps(good | {"mini_repo": located | {"index": 0, "seed": True}}).encode(),
        json.dumps(good | {"mini_repo": "0/1/0"}).encode(),
        b'{"id": "c"}',
        b"not json",
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        load_task_file(str(path), MiniRepoEnv())
    assert time.monotonic() - started < 10  # the huge index is refused, not drawn
    head, *named = str(error.value).splitlines()
    assert re.fullmatch(r"config\.rl\.tasks_path='.*tasks.jsonl': 7 bad lines:", head)
    assert [line.split(":")[0].strip() for line in named] == [f"line {n}" for n in range(2, 9)]
    for line, fragment in zip(named, [
        "not UTF-8 (byte 26: b'\\xe9')", '"mini_repo"."index"=-1', '"index"=1000000000000',
        '"mini_repo"."seed"=True', '"mini_repo"=\'0/1/0\'', 'string "id" and "prompt"',
        "not JSON",
    ], strict=True):  # fmt: skip
        assert fragment in line, (fragment, line)
    # launch reads it before anything is built (preflight), with the same message.
    c = load_config_file("tiny_cpu", "smoke")
    c.rl.agent, c.rl.agent_command, c.rl.tasks_path = "command", "true", str(path)
    with pytest.raises(ConfigError, match="7 bad lines"):
        preflight.check_inputs(from_dict(c))


def test_the_agent_sees_a_task_lines_public_fields_never_its_hidden_task(tmp_path):
    # The audit regenerated the answers from the seed and index GYREJAX_TASK carried.
    env = MiniRepoEnv()
    line = env.task_line(env.sample_tasks(1, seed=0)[0], seed=0, index=0) | {"hint": "x"}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(line) + "\n")
    for scorer in (env, None):  # rl.reward = environment | agent
        (task,) = load_task_file(str(path), scorer, private_fields=env.private_task_fields)
        seen = json.loads(task_json(task))
        assert seen == {"id": line["id"], "prompt": line["prompt"], "hint": "x"}
    assert task.data["mini_repo"] == line["mini_repo"]  # the run still resolves it


def test_an_rl_run_with_a_command_agent_trains_while_a_member_crashes(tmp_path):
    """The runtime serves the door; each execution is a process of the agent (chat calls
    with a retry, a summary and a sub-agent); member 2 of every group crashes, is
    `failed` and dropped, and the step trains on the rest. Every member of the first
    group crashes: it has nothing to train, and a new group takes its place (the run
    once waited for good on the group the schedule never dispatched)."""
    agent = write(tmp_path, "chat_agent.py", """
        import json, os, sys
        import openai
        me = os.environ["GYREJAX_EXECUTION"]
        if me.endswith("/2") or me.startswith("g0/"):
            sys.exit("boom")
        client, model = openai.OpenAI(), os.environ["GYREJAX_MODEL"]
        task = json.loads(os.environ["GYREJAX_TASK"])
        messages = [{"role": "system", "content": "go"},
                    {"role": "user", "content": task["prompt"]}]
        def ask(messages, agent="main", role="main"):
            headers = {"X-Gyrejax-Agent": agent, "X-Gyrejax-Role": role}
            return client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, extra_headers=headers, stream=True)
        for _ in range(2):  # an answer and its retry
            list(ask(messages))
        list(ask(messages + [{"role": "user", "content": "summarise"}], role="main_summary"))
        list(ask([{"role": "user", "content": "sub"}], agent="sub-1", role="sub_agent"))
        open("data.txt", "w").write("x")
    """)  # fmt: skip
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4
    c.scheduler.policy, c.scheduler.async_training_cells = "async", 1
    c.train.steps, c.rl.group_size = 1, 3
    c.rl.agent, c.rl.agent_command = "command", f"{sys.executable} {agent}"
    c.rl.tasks_path = str(REPO_ROOT / "examples/agents/mini_repo_tasks.jsonl")
    c.harness.agent_sandbox = AGENT_SANDBOX
    config = from_dict(c)
    summary = Runtime(
        config, split_into_cells(config.cells), init_model(config.model), tmp_path
    ).run()
    assert summary["steps"] == 1
    assert summary["agent_sandbox"]["used"] == AGENT_SANDBOX
    store = ExecutionStore(tmp_path / "executions")
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    (group,) = row["groups"]
    assert group == "g1"  # g0 had nothing to train: replaced
    assert all(e.status == "failed" for e in store.group("g0"))
    executions = store.groups([group])[group]
    statuses = sorted((e.execution_id, e.status) for e in executions)
    assert statuses == [(f"{group}/0", "finished"), (f"{group}/1", "finished"),
                        (f"{group}/2", "failed")]  # fmt: skip
    for e in executions:
        if e.status == "finished":
            roles = [c.role for c in e.sorted_calls()]
            assert roles == ["main", "main", "main_summary", "sub_agent"]
            assert [c.agent_id for c in e.sorted_calls()][-1] == "sub-1"
        else:
            assert "boom" in e.error and not e.calls


def test_an_agent_that_fails_every_execution_ends_the_run_saying_why(tmp_path):
    c = load_config_file("tiny_cpu", "smoke")
    c.rl.agent, c.rl.agent_command = "command", "sh -c 'echo cannot find my model >&2; exit 3'"
    c.rl.tasks_path = str(REPO_ROOT / "examples/agents/mini_repo_tasks.jsonl")
    c.harness.agent_sandbox = AGENT_SANDBOX
    config = from_dict(c)
    runtime = Runtime(config, split_into_cells(config.cells), init_model(config.model), tmp_path)
    with pytest.raises(NothingToTrain, match=r"4 groups in a row .*exit code 3\ncannot find"):
        runtime.run()
    assert len(ExecutionStore(tmp_path / "executions")) >= 4 * c.rl.group_size  # all kept


def test_demonstrations_drive_the_users_agent_in_its_own_format(tmp_path, bpe_tokenizer):
    """The warm start of `rl.agent = command` (harness/demonstrations.py): the
    environment's demonstrations drive the example agent itself through a door, so the
    records hold its own system prompt and tools, each answer is a tool call it ran, and
    a perfect demonstrator (quality 1) solves every task."""
    c = load_config_file("tiny_cpu", "smoke")
    c.model.tokenizer, c.model.vocab_size = str(bpe_tokenizer), 1024
    c.rl.agent = "command"
    c.harness.agent_sandbox = AGENT_SANDBOX
    c.rl.agent_command = f"{sys.executable} {REPO_ROOT / 'examples/agents/react_agent.py'}"
    config = from_dict(c)
    env = MiniRepoEnv()
    tasks = env.sample_tasks(3, seed=4)
    chat = load_chat(config.model.tokenizer)
    executions = asyncio.run(
        command_demonstrations(config, env, tasks, tmp_path, seed=0, quality=1.0, chat=chat)
    )
    assert [(e.status, e.reward) for e in executions] == [("finished", 1.0)] * 3
    for execution, task in zip(executions, tasks, strict=True):
        calls = execution.sorted_calls()
        first = chat.tokenizer.decode(list(calls[0].prompt_ids))
        assert first.startswith("<|im_start|>system\nYou write the files a task asks for")
        assert '"name": "run_tests"' in first  # the agent's tools, not the harness's
        actions = [chat.parse(call.output_ids) for call in calls]
        assert [a.kind for a in actions] == ["write"] * len(task.goals) + ["done"]
        assert {(a.path, a.content) for a in actions[:-1]} == {
            (g.path, g.solution) for g in task.goals
        }
    batch = process(executions, row_length=1280, vocab_size=1024, j_max=100)
    assert batch.stats.admitted_trainable_tokens == sum(
        len(call.output_ids) for e in executions for call in e.calls
    )
