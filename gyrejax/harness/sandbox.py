"""Run agent-written Python in a separate, limited process.

`run_python(script, workspace, limits)` starts `sys.executable -I -S -B -X utf8 -c BOOTSTRAP`
with stdin closed, cwd = the workspace, its own session (so its own process group) and a
scrubbed environment (PATH=/usr/bin:/bin, HOME=TMPDIR=the workspace, a UTF-8 locale;
nothing inherited). The script travels through an anonymous in-memory file, never through
the workspace or argv. The bootstrap, before any agent code runs:

1. sets rlimits on itself: CPU time (soft = ceil(cpu_s): SIGXCPU; hard one second later:
   SIGKILL), address space, file size (a write past it fails with EFBIG, since CPython
   ignores SIGXFSZ), core dumps off, and (unless running as root, which ignores it)
   RLIMIT_NPROC = 0, so the child can create neither processes nor threads.
   The limits are set here rather than in a `preexec_fn` because `preexec_fn` is unsafe
   when the caller has threads (the harness runs many executions concurrently).
2. installs a `sys.addaudithook` hook (hooks cannot be removed) that raises
   PermissionError for: `open`/`os.open` with a write, create, truncate or append flag
   outside the workspace (`/dev/null` is allowed); `os.remove/rmdir/mkdir/rename/link/
   symlink/chmod/chown/utime/truncate/chflags/setxattr/removexattr` outside it (symlink:
   the link's location; rename and link: both ends); `os.chdir` out of it; spawning
   processes (`subprocess.Popen`, `os.system`, `os.exec*`, `os.spawn*`, `os.posix_spawn*`,
   `os.fork`, `os.forkpty`); signals to other processes (`os.kill`, `os.killpg`); every
   socket operation; every ctypes operation (and importing ctypes); raising rlimits.
   Paths are resolved with `os.path.realpath` (symlinks followed, relative paths against the
   cwd or, for a `dir_fd` the event reports, against that directory).
3. replaces `_posixsubprocess.fork_exec` (which raises no audit event; multiprocessing
   uses it) and `os.mkfifo` / `os.mknod` (no events either) with guarded versions.

The caller reads stdout and stderr concurrently, keeps the first `max_output_bytes` of each,
and at `wall_s` kills the whole process group with SIGKILL; it also kills the group after a
normal exit, so nothing the script left behind in its group survives the call.

This is a best-effort guard for cooperative-but-buggy code (infinite loops, memory bombs,
fork bombs, giant files, writes to the wrong place), NOT a security boundary against a
malicious agent. Known gaps: the audit hook lives in the same interpreter as the agent code,
so code that rebinds the hook's helpers through `gc`/frame introspection, rebuilds an
extension module (`importlib.util.module_from_spec` on `_posixsubprocess` or `posix`), or
uses `os.open(name, dir_fd=fd)` with a relative name (the `open` event does not report the
dir_fd, so the name is resolved against the cwd) can get around it; reads anywhere the OS
allows are permitted; there is no disk quota beyond the per-file size (many files can fill
the disk); there is no network namespace; and when the caller is root RLIMIT_NPROC is not
enforced and a bypassing process could raise its own hard limits. For real isolation run
the child in a container, a user/PID/network namespace, or under seccomp.
"""

from __future__ import annotations

import dataclasses
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_MIB = 1 << 20
_KIB = 1 << 10
_SAFE_PATH = "/usr/bin:/bin"
# Once the script has exited, how long to keep reading output that something else in its
# process group may still be writing before the group is killed.
_DRAIN_AFTER_EXIT_S = 0.25


class SandboxError(RuntimeError):
    """The sandboxed process could not be started (an infrastructure failure, not the
    script's fault)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed run.

    Attributes:
      cpu_s: CPU seconds (rounded up to whole seconds: the rlimit's unit); SIGXCPU at the
        limit, SIGKILL one second later.
      memory_bytes: address-space limit; allocations past it raise MemoryError.
      file_size_bytes: largest file the process may write; writes past it fail (EFBIG).
      wall_s: wall-clock limit; the whole process group is killed when it passes.
      max_output_bytes: stdout and stderr are each truncated to this many bytes.
    """

    cpu_s: float = 2.0
    memory_bytes: int = 512 * _MIB
    file_size_bytes: int = 1 * _MIB
    wall_s: float = 10.0
    max_output_bytes: int = 64 * _KIB

    def __post_init__(self):
        for name in ("cpu_s", "wall_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"Limits.{name}={value!r}: expected a positive number")
        for name in ("memory_bytes", "file_size_bytes", "max_output_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"Limits.{name}={value!r}: expected a positive integer")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a sandboxed run did.

    Attributes:
      returncode: the exit status; negative -N when signal N ended the process.
      stdout, stderr: decoded as UTF-8 (invalid bytes replaced), each at most
        `max_output_bytes` bytes before decoding.
      timed_out: the wall-clock limit passed and the process group was killed.
      killed: a signal ended the process (a CPU limit, the wall-clock kill, or another).
      wall_s: seconds from start to the end of the call.
      stdout_truncated, stderr_truncated: output past `max_output_bytes` was dropped.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed: bool
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exited normally with status 0."""
        return self.returncode == 0 and not self.timed_out

    def summary(self) -> str:
        """One line: how the run ended, and the last line of stderr when it failed."""
        if self.timed_out:
            text = f"timed out after {self.wall_s:.1f} s (wall-clock limit); killed"
        elif self.returncode < 0:
            number = -self.returncode
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            reason = {
                "SIGXCPU": " (CPU-time limit)",
                "SIGKILL": " (hard CPU-time limit or out of memory)",
                "SIGXFSZ": " (file-size limit)",
            }.get(name, "")
            text = f"killed by {name}{reason}"
        else:
            text = f"exit {self.returncode}"
            last = _last_line(self.stderr)
            if self.returncode != 0 and last:
                text += f": {last}"
        if self.stdout_truncated or self.stderr_truncated:
            text += " (output truncated)"
        return text


def _last_line(text: str, max_chars: int = 200) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            line = line.strip()
            return line if len(line) <= max_chars else line[: max_chars - 3] + "..."
    return ""


# Runs first in the child (`python -c`), with argv = [-c, root, cpu_s, memory_bytes,
# file_size_bytes, script_fd]. Everything lives inside one function so the script's globals
# start clean; the hook's helpers are bound as defaults so rebinding `os.path` does not
# change them.
_BOOTSTRAP = r"""
import sys


def _gyrejax_sandbox():
    import _posixsubprocess
    import linecache
    import os
    import posix
    import resource
    import traceback

    root, cpu_s, memory_bytes, file_size_bytes, script_fd = sys.argv[1:6]
    cpu_s, script_fd = int(cpu_s), int(script_fd)
    with os.fdopen(script_fd, "rb") as f:
        script = f.read().decode("utf-8", "surrogateescape")

    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, int(memory_bytes)),
        (resource.RLIMIT_FSIZE, int(file_size_bytes)),
    ]
    if os.geteuid() != 0:
        limits.append((resource.RLIMIT_NPROC, 0))
    limits.append((resource.RLIMIT_CPU, cpu_s))
    for which, value in limits:
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:  # never above what the caller may have itself
            value = min(value, hard)
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later if that is handled.
        soft_hard = (value, value + 1) if which == resource.RLIMIT_CPU else (value, value)
        if hard != resource.RLIM_INFINITY:
            soft_hard = (soft_hard[0], min(soft_hard[1], hard))
        resource.setrlimit(which, soft_hard)

    root = os.path.realpath(root)
    my_pid = os.getpid()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def resolve(path, dir_fd=None, _realpath=os.path.realpath, _join=os.path.join,
                _readlink=os.readlink, _getcwd=os.getcwd, _fsdecode=os.fsdecode):
        if isinstance(path, int):
            path = _readlink("/proc/self/fd/%d" % path)  # "pipe:[..]" etc. stay relative
            return _realpath(path) if path.startswith("/") else None
        path = _fsdecode(path)
        if not path.startswith("/"):
            if isinstance(dir_fd, int) and dir_fd >= 0:
                base = _readlink("/proc/self/fd/%d" % dir_fd)
            else:
                base = _getcwd()
            path = _join(base, path)
        return _realpath(path)

    def check_inside(event, path, dir_fd=None, allow_root=False, _root=root, _prefix=root + "/"):
        try:
            real = resolve(path, dir_fd)
        except Exception:
            real = None
        if real is not None and (real.startswith(_prefix) or (allow_root and real == _root)):
            return
        raise PermissionError(
            "sandbox refused %s(%r): outside the workspace %s" % (event, path, _root)
        )

    def refuse(event, why):
        raise PermissionError("sandbox refused %s: %s" % (event, why))

    # event -> ((path argument index, its dir_fd argument index or None), ...)
    path_events = {
        "os.remove": ((0, 1),),
        "os.rmdir": ((0, 1),),
        "os.mkdir": ((0, 2),),
        "os.rename": ((0, 2), (1, 3)),
        "os.link": ((0, 2), (1, 3)),
        "os.symlink": ((1, 2),),
        "os.chmod": ((0, 2),),
        "os.chown": ((0, 3),),
        "os.utime": ((0, 3),),
        "os.truncate": ((0, None),),
        "os.chflags": ((0, None),),
        "os.lchflags": ((0, None),),
        "os.setxattr": ((0, None),),
        "os.removexattr": ((0, None),),
    }
    spawn_events = {
        "subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn",
        "os.fork", "os.forkpty", "os.startfile", "pty.spawn",
    }

    def hook(event, args, _fsdecode=os.fsdecode):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return  # an already-open descriptor; it was checked when it was opened
            writes = (flags or 0) & write_flags or any(c in (mode or "") for c in "wax+")
            if writes and _fsdecode(path) != "/dev/null":
                check_inside("open", path, allow_root=False)
        elif event in path_events:
            for path_index, dir_fd_index in path_events[event]:
                dir_fd = None if dir_fd_index is None else args[dir_fd_index]
                check_inside(event, args[path_index], dir_fd, allow_root=event == "os.mkdir")
        elif event == "os.chdir":
            check_inside(event, args[0], allow_root=True)
        elif event in spawn_events:
            refuse(event, "spawning processes is not allowed")
        elif event in ("os.kill", "os.killpg") and args[0] not in (my_pid, 0):
            refuse(event, "signals to other processes are not allowed")
        elif event.startswith(("socket.", "ctypes.")):
            refuse(event, "sockets and ctypes are not allowed")
        elif event in ("resource.setrlimit", "resource.prlimit"):
            refuse(event, "limits cannot be changed")
        elif event == "import" and args[0] in ("ctypes", "_ctypes"):
            refuse("import " + args[0], "ctypes is not allowed")

    sys.addaudithook(hook)

    def fork_exec(*args, **kwargs):
        refuse("_posixsubprocess.fork_exec", "spawning processes is not allowed")

    def guarded(name, original):
        def wrapper(path, *args, dir_fd=None, **kwargs):
            check_inside("os." + name, path, dir_fd)
            return original(path, *args, dir_fd=dir_fd, **kwargs)

        return wrapper

    _posixsubprocess.fork_exec = fork_exec
    for name in ("mkfifo", "mknod"):
        wrapper = guarded(name, getattr(posix, name))
        setattr(posix, name, wrapper)
        setattr(os, name, wrapper)

    # Tracebacks show the script's source lines and none of the bootstrap's frames.
    linecache.cache["<agent>"] = (len(script), None, script.splitlines(True), "<agent>")

    def excepthook(kind, value, tb, _print=traceback.print_exception):
        while tb is not None and tb.tb_frame.f_code.co_filename != "<agent>":
            tb = tb.tb_next
        _print(kind, value, tb)

    sys.excepthook = excepthook
    sys.argv = ["<agent>"]
    return compile(script, "<agent>", "exec")


_gyrejax_code = _gyrejax_sandbox()
del _gyrejax_sandbox
exec(_gyrejax_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


def run_python(script: str, workspace: Path | str, limits: Limits | None = None) -> RunResult:
    """Runs `script` with Python in a limited child process whose cwd is `workspace`.

    Never hangs: the call returns within about `limits.wall_s` (plus process start-up and
    teardown), whatever the script does. The script's own failures (exceptions, refusals,
    limits) are reported in the RunResult, never raised.

    Args:
      script: Python source, run as `__main__` (file name "<agent>").
      workspace: an existing directory: the cwd and the only writable place.
      limits: resource limits (default `Limits()`).

    Returns:
      A RunResult.

    Raises:
      ValueError: `workspace` is not an existing directory, or is "/".
      SandboxError: the child process could not be started.
    """
    limits = Limits() if limits is None else limits
    root = Path(workspace)
    if not root.is_dir():
        raise ValueError(f"workspace {str(workspace)!r}: expected an existing directory")
    root = Path(os.path.realpath(root))
    if root == Path("/"):
        raise ValueError("workspace '/': refusing to make the whole filesystem writable")

    script_fd = _script_fd(script)
    args = [
        sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP,
        str(root), str(max(1, math.ceil(limits.cpu_s))), str(limits.memory_bytes),
        str(limits.file_size_bytes), str(script_fd),
    ]  # fmt: skip
    env = {
        "PATH": _SAFE_PATH,
        "HOME": str(root),
        "TMPDIR": str(root),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=root,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=(script_fd,),
        )
    except OSError as e:
        raise SandboxError(f"could not start the sandboxed python ({sys.executable}): {e}") from e
    finally:
        os.close(script_fd)
    try:
        stdout, stderr, timed_out = _collect(proc, start + limits.wall_s, limits.max_output_bytes)
    finally:
        # Kill the whole group before reaping: while the script is an unreaped zombie its pid
        # (= the group id) cannot be reused, so this never hits another process.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    wall_s = time.monotonic() - start
    return RunResult(
        returncode=proc.returncode,
        stdout=stdout[0].decode("utf-8", "replace"),
        stderr=stderr[0].decode("utf-8", "replace"),
        timed_out=timed_out,
        killed=proc.returncode < 0,
        wall_s=wall_s,
        stdout_truncated=stdout[1],
        stderr_truncated=stderr[1],
    )


def _script_fd(script: str) -> int:
    """An anonymous, rewound file holding the script (a memfd where the OS has one)."""
    data = script.encode("utf-8", "surrogateescape")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("gyrejax-script", os.MFD_CLOEXEC)  # pass_fds lets the child have it
    else:  # pragma: no cover - non-Linux
        fd = os.dup(tempfile.TemporaryFile().fileno())
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _collect(
    proc: subprocess.Popen, deadline: float, max_bytes: int
) -> tuple[tuple[bytes, bool], tuple[bytes, bool], bool]:
    """Reads stdout and stderr until the process exits (and its pipes close) or `deadline`.

    Returns ((stdout, truncated), (stderr, truncated), timed_out). Does not reap the process.
    """
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = dict.fromkeys(buffers, False)
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # pragma: no cover - old kernels
        pidfd = None
    if pidfd is not None:
        selector.register(pidfd, selectors.EVENT_READ)
    open_pipes = set(buffers)
    exited_at = None
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
            if exited_at is not None and (
                not open_pipes or now >= min(deadline, exited_at + _DRAIN_AFTER_EXIT_S)
            ):
                break
            if now >= deadline:
                timed_out = exited_at is None
                break
            wait_s = deadline - now
            if exited_at is not None:
                wait_s = min(wait_s, exited_at + _DRAIN_AFTER_EXIT_S - now)
            elif pidfd is None:  # pragma: no cover - poll for the exit
                wait_s = min(wait_s, 0.05)
            for key, _ in selector.select(max(wait_s, 0.0)):
                fd = key.fd
                if fd == pidfd:
                    selector.unregister(pidfd)
                    continue
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    selector.unregister(fd)
                    open_pipes.discard(fd)
                    continue
                room = max_bytes - len(buffers[fd])
                if len(data) > room:
                    truncated[fd] = True
                buffers[fd] += data[:room]
    finally:
        selector.close()
        if pidfd is not None:
            os.close(pidfd)
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    return (
        (bytes(buffers[out]), truncated[out]),
        (bytes(buffers[err]), truncated[err]),
        timed_out,
    )


def _has_exited(pid: int) -> bool:
    """Whether `pid` has exited, without reaping it (its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True
