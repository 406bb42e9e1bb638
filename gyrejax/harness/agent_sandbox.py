"""External agents (`rl.agent = command`) inside the sandbox: `harness.agent_sandbox`.

With "bwrap" (the default) each agent process tree runs under bubblewrap with
`sandbox.bwrap_argv`'s profile, the one that confines agent-written code:

  * its own PID namespace: it sees no other process (not the runtime, not another
    agent) and no other /proc; when its command exits, or at the timeout, the
    namespace's init is killed and the kernel kills everything left in it (a `setsid`
    child included);
  * its own network namespace, with a loopback only. Its one way out is the door: a
    small forwarder (`_FORWARDER`, started first) listens on 127.0.0.1:PORT inside and
    carries each connection to a unix socket of the door's bound at `DOOR_SOCKET`. The
    door serves that socket for this execution alone (`OpenAIServer.
    serve_execution_socket`): another execution's key, even stolen, or the admin key
    is refused there;
  * the filesystem read-only, with its workspace the one writable place, a private
    /tmp of `agent_tmp_bytes`, and the run's workdir (the store, checkpoints, other
    workspaces, every agent's logs) and task file hidden: empty in there;
  * under a root caller, uid and gid 65534 with no capabilities (setpriv); otherwise
    "nobody" in a user namespace of its own;
  * per process: address space `agent_memory_bytes`, file size `agent_file_bytes`, no
    core dumps (rlimits, set by the forwarder before the agent starts); for the whole
    tree, where the run is root, `agent_max_processes` and `agent_memory_bytes` in a
    cgroup of its own (harness/cgroups.py), and the workspace's bytes and inodes
    (harness/workspace_quota.py); run_summary.json says which hold.

What it can still read: what the sandbox's user may read on the host outside the hidden
places (the system, the project's source, the virtualenv), and the environment the run
gives it (the runtime's, minus the run's secrets). Not root, its processes are not
counted per execution: RLIMIT_NPROC counts a uid across the host.

With "none" the command runs beside the runtime as before, with a warning in the log
and in run_summary.json: it can read the runtime's /proc, the store and every
workspace, so it is for trusted agents only (the cgroups and the workspace quota still
hold where the run is root, and the cgroup's kill at the end takes a `setsid` child).
benchmarks/adversarial.py makes the audit's attacks from inside a run under each mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gyrejax.harness import sandbox
from gyrejax.harness.cgroups import limits_summary

DOOR_SOCKET = "/run/gyrejax/door.sock"
# How long bubblewrap may take to make the namespaces before the agent counts as failed.
_START_S = 30.0
AGENT_SANDBOX_WARNING = (
    "harness.agent_sandbox='none': the agent command runs unsandboxed beside the run; it "
    "can read the runtime's /proc, the store and every workspace (trusted agents only)"
)


def agent_sandbox_summary(harness) -> dict:
    """`harness.agent_sandbox` for run_summary.json (says plainly when there is none),
    with the per-execution process and memory limits and what enforces them."""
    mode = harness.agent_sandbox
    record = {"used": mode, "security_boundary": mode == "bwrap"}
    if mode != "bwrap":
        record["warning"] = AGENT_SANDBOX_WARNING
    record["limits"] = limits_summary(harness.agent_max_processes, harness.agent_memory_bytes)
    return record


# Runs first inside the sandbox as `python -I -S -c _FORWARDER PORT SOCKET MEMORY FILE --
# COMMAND...`: listens on 127.0.0.1:PORT, carries each connection to the door's unix
# SOCKET, sets the agent's rlimits, runs COMMAND and exits with its status (128 + N for
# signal N), which ends the sandbox and everything in it. C modules only (_socket, _thread,
# posix_spawn): socket, threading and subprocess would double its start-up.
_FORWARDER = r"""
import _socket, _thread, os, resource, sys

port, door, memory_bytes, file_bytes = sys.argv[1:5]
command = sys.argv[sys.argv.index("--") + 1:]
listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(port)))
listener.listen(128)


def pump(source, sink, done=None):
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    for end in (sink, source):
        try:
            end.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
    if done is not None:
        done.release()


def bridge(fd):
    client = _socket.socket(fileno=fd)
    upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        upstream.connect(door)
    except OSError:
        client.close()
        return
    back = _thread.allocate_lock()
    back.acquire()
    try:
        _thread.start_new_thread(pump, (upstream, client, back))
    except RuntimeError:  # the tree's process limit: this connection only is dropped
        client.close()
        upstream.close()
        return
    pump(client, upstream)
    back.acquire()
    client.close()
    upstream.close()


def serve():
    while True:
        fd, _ = listener._accept()
        try:
            _thread.start_new_thread(bridge, (fd,))
        except RuntimeError:  # as above: the forwarder itself goes on
            os.close(fd)


for which, value in (
    (resource.RLIMIT_CORE, 0),
    (resource.RLIMIT_AS, int(memory_bytes)),
    (resource.RLIMIT_FSIZE, int(file_bytes)),
):
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))
try:
    pid = os.posix_spawnp(command[0], command, os.environ)
except OSError as e:
    os.write(2, ("cannot start %r: %s\n" % (command[0], e)).encode())
    os._exit(127)
_thread.start_new_thread(serve, ())
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os._exit(code if code >= 0 else 128 - code)
"""


def agent_argv(
    bwrap: str,
    command: list[str],
    workspace: Path,
    door_socket: Path,
    port: int,
    *,
    hidden: tuple[Path, ...],
    memory_bytes: int,
    file_bytes: int,
    tmp_bytes: int,
    info_fd: int,
) -> list[str]:
    """The command line that runs `command` sandboxed in `workspace` (see the module
    docstring). `hidden`: directories (the workdir) and files (the task file) the agent
    must not see."""
    hidden_dirs = tuple(p for p in hidden if p.is_dir())
    hidden_files = tuple(p for p in hidden if p.exists() and not p.is_dir())
    argv = sandbox.bwrap_argv(
        bwrap,
        workspace,
        info_fd,
        visible=_command_files(command),
        hidden=hidden_dirs,
        blanked=hidden_files,
        door=(door_socket, DOOR_SOCKET),
        tmp_bytes=tmp_bytes,
    )
    return [
        *argv,
        sys.executable, "-I", "-S", "-c", _FORWARDER,
        str(port), DOOR_SOCKET, str(memory_bytes), str(file_bytes), "--", *command,
    ]  # fmt: skip


def _command_files(command: list[str]) -> tuple[Path, ...]:
    """What the agent needs to see wherever it lies: the Python environment the run
    uses (its agents usually run in it) and the command's words that name files or
    directories (its script, its program)."""
    paths = {Path(sys.prefix), Path(sys.base_prefix)}
    for word in command:
        path = Path(word)
        if path.is_absolute() or os.sep in word:
            if path.exists():
                paths.add(Path(os.path.realpath(path)))
    return tuple(sorted(paths))


class AgentProcess:
    """An agent's process tree: `start`, then wait on `process`; `kill` ends the tree
    and may be called more than once.

    This one (`harness.agent_sandbox = "none"`) runs the command beside the run, in its
    own process group, killed whole (a `setsid` child leaves the group and escapes)."""

    def __init__(self):
        self.process: asyncio.subprocess.Process | None = None

    async def start(
        self, argv_for: Callable[[int | None], list[str]], **popen
    ) -> asyncio.subprocess.Process:
        """Starts `argv_for(None)` (`popen`: create_subprocess_exec's keywords); raises
        OSError when it cannot."""
        self.process = await asyncio.create_subprocess_exec(
            *argv_for(None), start_new_session=True, **popen
        )
        return self.process

    async def kill(self) -> None:
        """Kills the process group and reaps the process."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            if self.process.returncode is None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self.process.wait())


class SandboxedAgent(AgentProcess):
    """An agent's process tree under bubblewrap: its PID namespace dies whole."""

    def __init__(self):
        super().__init__()
        self._init_pidfd: int | None = None

    async def start(
        self, argv_for: Callable[[int | None], list[str]], **popen
    ) -> asyncio.subprocess.Process:
        """Starts `argv_for(info_fd)` (bubblewrap's command line, reporting its init on
        info_fd) and waits until its namespaces exist."""
        info_read, info_write = os.pipe()
        try:
            self.process = await asyncio.create_subprocess_exec(
                *argv_for(info_write), pass_fds=[info_write], start_new_session=True, **popen
            )
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
        init_pid = await asyncio.to_thread(
            sandbox.read_init_pid, info_read, time.monotonic() + _START_S
        )
        if init_pid is not None:
            self._init_pidfd = sandbox.open_init(self.process, init_pid)
        return self.process

    async def kill(self) -> None:
        """Kills the namespace (every process in it: the kernel empties it before its
        init's exit is seen), then bubblewrap."""
        pidfd, self._init_pidfd = self._init_pidfd, None
        if pidfd is not None:
            await asyncio.to_thread(sandbox.kill_namespace, pidfd)
        await super().kill()
