"""External agents inside the sandbox (gyrejax/harness/agent_sandbox.py): the audit's
attempts, made by a real agent process against a real door, each refused.

The audit (issue 40, item 2) ran two unsandboxed agents: each read the engine token and
admin key from its parent's /proc environ, one found the admin key in the parent's
memory, each stole the other's key and put a call in the other's record, one wrote a
forged record into the store, and a `setsid` child outlived the timeout (that last one:
test_external_agent's hanging-agent test).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
from conftest import load_config_file
from test_agent import two_file_task
from test_external_agent import ADMIN_KEY, replay_engine, run_group, write

from gyrejax.config import ConfigError, HarnessConfig, from_dict
from gyrejax.harness.agent import workspace_name
from gyrejax.harness.agent_sandbox import agent_sandbox_summary
from gyrejax.harness.cgroups import limits_summary
from gyrejax.harness.sandbox import choose_sandbox
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.run import run
from gyrejax.serve.openai_server import OpenAIServer

pytestmark = pytest.mark.skipif(
    choose_sandbox("auto").used != "bwrap", reason="bubblewrap does not work here"
)

# Each attempt is a name and an expression; the agent records ["done", result] or
# ["refused", the error]. Everything it needs to aim at comes in its environment.
ATTACKER = r"""
import json, os, socket, urllib.request

aim = json.loads(os.environ["AIM"])
done = {}


def attempt(name, how):
    try:
        done[name] = ["done", repr(how())[:300]]
    except Exception as e:
        done[name] = ["refused", repr(e)[:300]]


def memory(pid):  # the first readable bytes of the process's heap
    for line in open(f"/proc/{pid}/maps"):
        if "[heap]" in line:
            start = int(line.split("-")[0], 16)
            with open(f"/proc/{pid}/mem", "rb") as f:
                f.seek(start)
                return f.read(1 << 16)


def visible_processes():
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[entry] = open(f"/proc/{entry}/cmdline", "rb").read().decode()
            except OSError:
                pass
    return found


def environments():
    blocks = []
    for pid in visible_processes():
        try:
            blocks.append(open(f"/proc/{pid}/environ", "rb").read().decode("latin-1"))
        except OSError:
            pass
    return "\n".join(blocks)


def post(path, key, body):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    return urllib.request.urlopen(request, timeout=20).status


def write_back(path):  # the same value back: still a write to a kernel setting
    value = open(path).read()
    with open(path, "w") as f:
        f.write(value)


attempt("runtime environ", lambda: open(f"/proc/{aim['runtime_pid']}/environ", "rb").read())
attempt("runtime memory", lambda: memory(aim["runtime_pid"]))
me = os.environ["GYREJAX_EXECUTION"]
sibling = next(path for who, path in aim["workspaces"].items() if who != me)
attempt("sibling workspace", lambda: os.listdir(sibling))
attempt("store listing", lambda: os.listdir(aim["store"]))
attempt("forged record", lambda: open(os.path.join(aim["store"], "forged.json"), "w").write(
    json.dumps({"execution_id": "forged", "reward": 1.0})))
attempt("task file", lambda: open(aim["task_file"]).read() or 1 / 0)
attempt("agent logs", lambda: open(aim["logs"]).read())
attempt("/proc/sys", lambda: write_back("/proc/sys/kernel/core_uses_pid"))
attempt("/proc/sysrq-trigger", lambda: open("/proc/sysrq-trigger", "w").write("h"))
attempt("root-only file", lambda: open(aim["root_only"]).read())
attempt("host port", lambda: socket.create_connection(("127.0.0.1", aim["host_port"]), 2))
attempt("admin key at the door", lambda: post("/executions", aim["admin_key"], {}))
done["own key at the door"] = post(
    "/completions", os.environ["OPENAI_API_KEY"], {"model": "m", "prompt": [1], "max_tokens": 1})
done["processes"] = visible_processes()
done["environments"] = environments()
json.dump(done, open("attempts.json", "w"))
"""

REFUSED = [
    "runtime environ",
    "runtime memory",
    "sibling workspace",
    "store listing",
    "forged record",
    "task file",
    "agent logs",
    "/proc/sys",
    "/proc/sysrq-trigger",
    "host port",
    "admin key at the door",
]


@pytest.fixture
def outside_tmp():
    """A scratch directory outside /tmp: a sandboxed agent has a /tmp of its own, which
    would hide anything under the host's /tmp whatever the rest of the profile did."""
    path = Path(tempfile.mkdtemp(prefix="gyrejax-test-", dir="/var/tmp"))
    path.chmod(0o755)  # open to uid 65534 too: only the profile may hide what is in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_sandboxed_agent_meets_each_of_the_audits_attempts_refused(outside_tmp, monkeypatch):
    tmp_path = outside_tmp
    run_dir = tmp_path / "run"  # what a run's workdir holds: the store, a task file
    (run_dir / "store").mkdir(parents=True)
    (run_dir / "store" / "real.json").write_text("{}")
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text('{"id": "t", "env": "mini_repo", "seed": 7, "index": 3}\n')
    root_only = tmp_path / "root_only"
    root_only.write_text("secret")
    root_only.chmod(0o600)
    listener = socket.create_server(("127.0.0.1", 0))  # a service on the host's loopback
    workspaces = tmp_path / "workspaces"
    aim = {
        "runtime_pid": os.getpid(),
        "admin_key": ADMIN_KEY,  # as if leaked: the door must refuse it from in there
        "store": str(run_dir / "store"),
        "task_file": str(task_file),
        "logs": str(workspaces / (workspace_name("g/1") + ".err")),
        "root_only": str(root_only),
        "host_port": listener.getsockname()[1],
        "workspaces": {e: str(workspaces / workspace_name(e)) for e in ("g/0", "g/1")},
    }
    agent = write(tmp_path, "attacker.py", ATTACKER)
    run_secret = "s" * 40  # a secret in the runtime's environment
    monkeypatch.setenv("GYREJAX_API_KEY", run_secret)
    monkeypatch.setenv("AIM", json.dumps(aim))
    engine = ScriptedEngine("scripted", lambda prompt, request: [0])
    try:
        executions = run_group(
            tmp_path, engine, [sys.executable, agent], [two_file_task()[0]] * 2,
            hidden=(run_dir, task_file),
        )  # fmt: skip
    finally:
        listener.close()
    for execution in executions:
        assert execution.status == "finished", execution.error
        assert len(execution.calls) == 1  # its own call, nobody else's
    for i in range(2):
        attempts = json.loads((workspaces / workspace_name(f"g/{i}") / "attempts.json").read_text())
        for name in REFUSED:
            assert attempts[name][0] == "refused", (name, attempts[name])
        assert attempts["own key at the door"] == 200
        # It sees its sandbox's processes only: bubblewrap's init, the forwarder, itself.
        assert len(attempts["processes"]) <= 3, attempts["processes"]
        for cmdline in attempts["processes"].values():  # not the runtime, not the sibling
            words = cmdline.split("\0")
            assert words[0].endswith("/bwrap") or words[1:3] == ["-I", "-S"] or words[1] == agent, (
                words
            )
        assert run_secret not in attempts["environments"]
    assert sorted(os.listdir(run_dir / "store")) == ["real.json"]
    summary = agent_sandbox_summary(HarnessConfig(agent_sandbox="bwrap"))
    assert (summary["used"], summary["security_boundary"]) == ("bwrap", True)


HOG = r"""
import json, os, signal, time
children = []
try:
    while len(children) < 1000:  # a fork bomb, held by the tree's process limit
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except OSError as e:
    refused = e.errno
for pid in children:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
hogs = []
for _ in range(3):  # 3 x 100 MiB, each under its own address-space limit
    pid = os.fork()
    if pid == 0:
        block = bytearray(100 << 20)
        block[:: 1 << 12] = b"1" * len(block[:: 1 << 12])  # touched: resident
        time.sleep(5)
        os._exit(0)
    hogs.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in hogs]
print(json.dumps({"forks": len(children), "refused": refused, "hog_codes": codes}))
"""


@pytest.mark.skipif(limits_summary(64, 1 << 30)["pids"]["enforced"] is False, reason="no cgroups")
def test_an_agents_whole_tree_is_held_to_its_process_and_memory_limits(tmp_path):
    agent = write(tmp_path, "hog.py", HOG)
    (execution,) = run_group(
        tmp_path, replay_engine(None), [sys.executable, agent], [two_file_task()[0]],
        max_processes=48, memory_bytes=256 << 20,
    )  # fmt: skip
    assert execution.status == "no_artifact", execution.error  # exit 0, nothing written
    (out,) = (tmp_path / "workspaces").glob("*.out")
    seen = json.loads(out.read_text())
    assert seen["refused"] == 11 and seen["forks"] < 48  # EAGAIN at the tree's limit
    # Not one of them is past its own address-space limit, together they are past the
    # tree's memory: the kernel kills inside the tree.
    assert -9 in seen["hog_codes"], seen


def test_the_door_serves_an_executions_socket_for_that_execution_alone(tmp_path):
    engine = ScriptedEngine("scripted", lambda prompt, request: [0])

    async def body():
        door = OpenAIServer(Proxy([engine]), api_key=ADMIN_KEY, default_max_tokens=2)
        await door.start("127.0.0.1", 0)
        keys = {name: door.open_execution(name) for name in ("a", "b")}
        for name in keys:
            await door.serve_execution_socket(name, tmp_path / f"{name}.sock")
        answers = {}
        for via, key_of in (("a", "a"), ("a", "b"), ("b", "a"), ("a", "admin")):
            key = ADMIN_KEY if key_of == "admin" else keys[key_of]
            connector = aiohttp.UnixConnector(path=str(tmp_path / f"{via}.sock"))
            async with aiohttp.ClientSession(connector=connector) as session:
                auth = {"Authorization": f"Bearer {key}"}
                async with session.post(
                    "http://door/v1/completions",
                    json={"model": "m", "prompt": [1], "max_tokens": 1},
                    headers=auth,
                ) as response:
                    answers[via, key_of, "completions"] = response.status
                async with session.post(
                    "http://door/v1/executions", json={}, headers=auth
                ) as response:
                    answers[via, key_of, "executions"] = response.status
                async with session.get("http://door/v1/models", headers=auth) as response:
                    answers[via, key_of, "models"] = response.status
        await door.close_execution("a")
        gone = not (tmp_path / "a.sock").exists()
        await door.stop()
        return answers, gone

    answers, gone = asyncio.run(body())
    assert answers[("a", "a", "completions")] == 200 and answers[("a", "a", "models")] == 200
    assert answers[("a", "b", "completions")] == 401  # b's key, stolen, on a's socket
    assert answers[("b", "a", "completions")] == 401
    for what in ("completions", "executions", "models"):  # the admin key: never there
        assert answers[("a", "admin", what)] == 401, what
    assert answers[("a", "a", "executions")] == 401
    assert gone  # the socket goes with its execution


def test_an_unsandboxed_agent_is_an_explicit_choice_said_in_the_log_and_summary(tmp_path, caplog):
    agent = write(tmp_path, "ok.py", "open('reward.json', 'w').write('{\"reward\": 1}')")
    (execution,) = run_group(
        tmp_path, replay_engine(None), [sys.executable, agent], [two_file_task()[0]],
        reward="agent", agent_sandbox="none",
    )  # fmt: skip
    assert (execution.status, execution.reward) == ("finished", 1.0)
    assert "agent_sandbox='none'" in caplog.text
    summary = agent_sandbox_summary(HarnessConfig(agent_sandbox="none"))
    assert summary["security_boundary"] is False and "unsandboxed" in summary["warning"]


def test_a_missing_bubblewrap_refuses_a_sandboxed_agent_run_naming_the_field(tmp_path, monkeypatch):
    c = load_config_file("tiny_cpu", "smoke")
    c.rl.agent, c.rl.agent_command = "command", "true"
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(ConfigError, match=r"config\.harness\.agent_sandbox='bwrap'.*'none'"):
        run(from_dict(c), str(tmp_path / "run"))
