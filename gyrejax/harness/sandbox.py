"""Run agent-written Python in a separate, limited process, under an OS sandbox.

`run_python(script, workspace, limits, sandbox=...)` runs `sys.executable -I -S -B -X utf8
-c BOOTSTRAP` with stdin closed, cwd = the workspace, its own session and a scrubbed
environment (PATH=/usr/bin:/bin, HOME=TMPDIR=PWD=the workspace, a UTF-8 locale; nothing
inherited). The script travels through an anonymous in-memory file, never through the
workspace or argv. Two layers confine it:

1. **bubblewrap** (`sandbox="bwrap"`, the Debian/Ubuntu package `bubblewrap`), the
   security boundary. The child runs in new user, PID, network, IPC, UTS (and, where the
   kernel allows, cgroup) namespaces, as an unprivileged uid with no capabilities; it sees
   the whole filesystem read-only (`/dev` a minimal read-only device set, `/proc` its own
   PID namespace's and read-only, `/proc/sys` included, `/run` empty), with the
   workspace as the only writable bind, and has no network (only a loopback of its
   own); it cannot make nested user namespaces (bubblewrap 0.8+). `--new-session`
   stops it writing to our terminal; `--die-with-parent` and the PID namespace mean
   nothing it starts outlives the run:
   when the script ends, or at the wall-clock kill, bubblewrap's init (PID 1 of the
   namespace) exits and the kernel kills every process left in the namespace before that
   exit is seen. So a libc `system()`, a `setsid` child, a symlink swapped under a check,
   a `dir_fd` outside, signals or priorities aimed at the harness all meet the kernel,
   not Python code.
2. **The Python guard** (always, inside bubblewrap too; alone with
   `sandbox="python_guard"`). Before any agent code runs, the bootstrap
   - sets rlimits on itself: CPU time (soft = ceil(cpu_s): SIGXCPU; hard one second
     later: SIGKILL), address space, file size (a write past it fails with EFBIG, since
     CPython ignores SIGXFSZ), core dumps off, and (unless it runs as uid 0, which
     ignores it) RLIMIT_NPROC = 0, so the child can create neither processes nor
     threads. The limits are set here rather than in a `preexec_fn` because `preexec_fn`
     is unsafe when the caller has threads (the harness runs many executions at once).
   - installs a `sys.addaudithook` hook (hooks cannot be removed) that raises
     PermissionError for: `open`/`os.open` with a write, create, truncate or append flag
     outside the workspace (`/dev/null` is allowed); `os.remove/rmdir/mkdir/rename/link/
     symlink/chmod/chown/utime/truncate/chflags/setxattr/removexattr` outside it
     (symlink: the link's location; rename and link: both ends); `os.chdir` out of it;
     spawning processes (`subprocess.Popen`, `os.system`, `os.exec*`, `os.spawn*`,
     `os.posix_spawn*`, `os.fork`, `os.forkpty`); signals to other processes (`os.kill`,
     `os.killpg`); every socket operation; every ctypes operation (and importing ctypes);
     raising rlimits. Paths are resolved with `os.path.realpath` (relative paths against
     the cwd or, for a `dir_fd` the event reports, against that directory).
   - replaces functions that raise no audit event with guarded versions:
     `_posixsubprocess.fork_exec` (multiprocessing uses it), `os.mkfifo` / `os.mknod`,
     `os.open` with a `dir_fd` (the `open` event does not report it), `os.setpriority`
     and `os.pidfd_open` on other processes.

The caller reads stdout and stderr concurrently, keeps the first `max_output_bytes` of
each, and at `wall_s` kills the sandbox (bubblewrap's init, then the process group); it
also does so after a normal exit, so nothing the script left behind survives the call.

`sandbox="auto"` (the config's default, `harness.sandbox`) uses bubblewrap when it works
here (found on PATH and a probe run succeeds; probed once per binary and cached), else the
guard alone, with a warning in the log (and, for an RL run, in `run_summary.json`:
`sandbox_summary`). `sandbox="bwrap"` raises `SandboxUnavailable` instead of falling back.

The guard alone is a best-effort net for cooperative-but-buggy code (infinite loops,
memory bombs, fork bombs, giant files, writes to the wrong place), NOT a security
boundary: the audit hook lives in the interpreter it guards, so a C call that raises no
audit event (cffi's libc `system()`), a symlink swapped between the hook's check and the
open, code that rebinds the hook's helpers through `gc`/frame introspection or rebuilds
an extension module (`importlib.util.module_from_spec` on `_posixsubprocess` or `posix`)
gets around it; and there is no network namespace. Under both: reads anywhere the OS lets
the sandbox's user read are permitted; the workspace's own bytes and inodes are the
caller's to bound (workspace_quota.py: a tmpfs per workspace under root; otherwise many
files can fill its disk). Under the guard alone a root caller's
RLIMIT_NPROC is not enforced (under bubblewrap agent code is uid 65534, see below).

Running as root. A user namespace made by root maps the sandbox's user to uid 0 outside,
where the kernel would let it read root-only files, connect to root's unix sockets and
escape RLIMIT_NPROC. So under a root caller bubblewrap makes no user namespace: it sets
up the mounts and namespaces with root's rights, and `setpriv` (util-linux) then drops
to the host's uid and gid 65534 with no groups, no capabilities (bounding set empty) and
no_new_privs, just before Python starts. Agent code is then an ordinary unprivileged
user: root-only files and sockets are closed to it, `/proc/sys` is not its to write
(EACCES before EROFS), and RLIMIT_NPROC = 0 holds, so it can start neither processes nor
threads. The workspace tree is given to uid 65534 (`lchown`) before each run. Directories
on the way to the interpreter or the workspace that uid 65534 may not enter (pyenv under
/root, mode 0700; pytest's temp tree) are covered by an empty read-only tmpfs with just
those two bound back. What this leaves: a user namespace of its own, as any local user
may make one (bubblewrap's `--disable-userns` needs a user namespace of ours).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import logging

from gyrejax.config import SANDBOXES

_MIB = 1 << 20
_KIB = 1 << 10
_SAFE_PATH = "/usr/bin:/bin"
# Once the script has exited, how long to keep reading output that something else in its
# process group may still be writing before the group is killed.
_DRAIN_AFTER_EXIT_S = 0.25
# The uid and gid agent code runs as ("nobody"). For an unprivileged caller it is the id
# inside bubblewrap's user namespace (outside it is the caller). For a root caller it is
# the host's own uid 65534: bubblewrap then makes no user namespace (its mapping would
# make agent code uid 0 outside) and `setpriv` drops to it, with no capabilities.
_SANDBOX_ID = "65534"
_SETPRIV = "setpriv"
# How long to wait for the kernel to empty a killed sandbox's PID namespace.
_TEARDOWN_S = 5.0
_PROBE_TIMEOUT_S = 20.0
NOT_A_BOUNDARY = (
    "agent code runs under the Python audit-hook guard only, which is NOT a security "
    "boundary (libc calls, races and other known gaps get around it)"
)


class SandboxError(RuntimeError):
    """The sandboxed process could not be started (an infrastructure failure, not the
    script's fault)."""


class SandboxUnavailable(SandboxError):
    """`sandbox="bwrap"` was asked for, but bubblewrap is missing or does not work here."""


@dataclasses.dataclass(frozen=True)
class SandboxChoice:
    """Which sandbox runs agent code (`choose_sandbox`).

    Attributes:
      requested: the mode asked for: "auto", "bwrap" or "python_guard".
      used: "bwrap" (bubblewrap, with the Python guard inside) or "python_guard".
      bwrap: the bubblewrap binary, when `used` is "bwrap".
      reason: why bubblewrap is not used, when it was looked for ("" otherwise).
    """

    requested: str
    used: str
    bwrap: str | None = None
    reason: str = ""

    @property
    def security_boundary(self) -> bool:
        """Whether agent code is confined by the kernel (bubblewrap), not only by Python."""
        return self.used == "bwrap"

    def summary(self) -> dict:
        """A JSON-able record for run summaries (says plainly when it is no boundary)."""
        record = {
            "requested": self.requested,
            "used": self.used,
            "security_boundary": self.security_boundary,
        }
        if not self.security_boundary:
            record["warning"] = NOT_A_BOUNDARY
            if self.reason:
                record["reason"] = self.reason
        return record


def choose_sandbox(mode: str = "auto", *, bwrap: str | None = None) -> SandboxChoice:
    """Resolves a sandbox mode to the sandbox that will run agent code.

    bubblewrap is probed once per binary (a real run of the sandbox, cached for the
    process), so calling this per environment or per run is cheap.

    Args:
      mode: "auto" (bubblewrap when it works, else the Python guard with a warning),
        "bwrap" (bubblewrap or an error) or "python_guard" (the guard only).
      bwrap: the bubblewrap binary (default: `bwrap` on PATH).

    Returns:
      A SandboxChoice.

    Raises:
      ValueError: `mode` is not one of SANDBOXES.
      SandboxUnavailable: `mode` is "bwrap" and bubblewrap is missing or does not work.
    """
    if mode not in SANDBOXES:
        raise ValueError(f"sandbox={mode!r}: expected one of {', '.join(SANDBOXES)}")
    if mode == "python_guard":
        return SandboxChoice(mode, "python_guard", reason="python_guard was asked for")
    path = bwrap if bwrap is not None else shutil.which("bwrap")
    problem = _probe_bwrap(path) if path else "bubblewrap (bwrap) is not on PATH"
    if problem is None:
        return SandboxChoice(mode, "bwrap", bwrap=path)
    if mode == "bwrap":
        raise SandboxUnavailable(
            f"sandbox='bwrap': {problem}; install bubblewrap (Debian/Ubuntu package "
            f"`bubblewrap`) or choose sandbox='auto' or 'python_guard'"
        )
    _warn_fallback(problem)
    return SandboxChoice(mode, "python_guard", reason=problem)


def sandbox_summary(mode: str, *, bwrap: str | None = None) -> dict:
    """What `choose_sandbox(mode)` picks, as a JSON-able record for `run_summary.json`.

    Never raises: an unknown mode or missing bubblewrap is recorded, not thrown (a run
    that got as far as writing its summary has already been checked).

    Args:
      mode: the configured mode (`harness.sandbox`).
      bwrap: the bubblewrap binary (default: `bwrap` on PATH).

    Returns:
      {"requested", "used", "security_boundary"} plus, without bubblewrap, "warning"
      (it is not a security boundary) and "reason".
    """
    try:
        return choose_sandbox(mode, bwrap=bwrap).summary()
    except (ValueError, SandboxError) as e:
        return {"requested": mode, "used": None, "security_boundary": False, "error": str(e)}


@functools.cache
def _warn_fallback(problem: str) -> None:
    # Cached: one warning per reason per process, not one per environment or check.
    logging.warning("sandbox: bubblewrap not used (%s); %s", problem, NOT_A_BOUNDARY)


@functools.cache
def _probe_bwrap(path: str) -> str | None:
    """None if bubblewrap at `path` runs this Python in the sandbox we use, else why not.

    A real run (not `--version`): a kernel without unprivileged user namespaces, or a
    container that forbids them, has a bwrap that exists but cannot sandbox.
    """
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return f"bubblewrap {path!r} is not an executable file"
    with tempfile.TemporaryDirectory(prefix="gyrejax-bwrap-probe-") as scratch:
        root = Path(os.path.realpath(scratch))
        if os.geteuid() == 0:
            if shutil.which(_SETPRIV, path=_SAFE_PATH) is None:
                return f"running as root needs {_SETPRIV} (util-linux) to drop to uid 65534"
            give_to_sandbox(root)
        argv = [
            *bwrap_argv(path, root, info_fd=None),
            sys.executable, "-I", "-S", "-c", "open('probe', 'w').write('ok')",
        ]  # fmt: skip
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8"},
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap {path!r} could not run: {e}"
        if done.returncode != 0 or not (root / "probe").is_file():
            last = _last_line(done.stderr.decode("utf-8", "replace")) or "no message"
            return f"bubblewrap {path!r} does not work here (exit {done.returncode}: {last})"
    return None


@functools.cache
def _can_disable_userns(bwrap: str) -> bool:
    """Whether this bubblewrap has `--disable-userns` (0.8+): without it agent code could
    make nested user namespaces, and hold every capability there (more kernel surface)."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--disable-userns" in done.stdout + done.stderr


def bwrap_argv(
    bwrap: str,
    root: Path,
    info_fd: int | None,
    *,
    visible: tuple[Path, ...] = (),
    hidden: tuple[Path, ...] = (),
    blanked: tuple[Path, ...] = (),
    door: tuple[Path, str] | None = None,
    tmp_bytes: int | None = None,
) -> list[str]:
    """bubblewrap's command line for a sandbox whose only writable place is `root`.

    The defaults are `run_python`'s profile. An external agent's (harness/agent_sandbox.py)
    adds: `visible`, paths bound back read-only under anything hidden (its command's
    files, the virtualenv); `hidden`, directories covered by an empty read-only tmpfs
    (the run's workdir: the store, checkpoints, other workspaces); `blanked`, files
    covered by an empty one (the task file); `door`, (a unix socket here, where it
    appears inside); `tmp_bytes`, a private writable /tmp of that size.
    """
    as_root = os.geteuid() == 0
    if as_root:  # host uid 65534 (setpriv, after the mounts): no user namespace to map
        identity = []
    else:  # own user namespace as "nobody" with no capabilities
        identity = [
            "--unshare-user", "--uid", _SANDBOX_ID, "--gid", _SANDBOX_ID, "--cap-drop", "ALL",
            *(["--disable-userns"] if _can_disable_userns(bwrap) else []),
        ]  # fmt: skip
    # Under root, the directories uid 65534 cannot enter on the way to the interpreter
    # and the workspace (e.g. /root, mode 0700, holding pyenv) are covered by an empty,
    # read-only tmpfs with just those bound back: the rest of them stays unseen.
    readable = [Path(sys.base_prefix), *visible]
    closed = _closed_ancestors([*readable, root]) if as_root else []
    covered = _outermost([*closed, *hidden])
    tmp = [Path("/tmp")] if tmp_bytes is not None else []
    under = _outermost([*covered, *tmp])  # where bound paths need directories made
    masked = [path for path in covered if not _below(path, tmp)]  # own read-only tmpfs
    argv = [
        bwrap,
        *identity,
        # Own PIDs (the harness and every other process are invisible, and all ours die
        # with the namespace's init), own network (a loopback only), IPC, hostname,
        # cgroup view.
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--hostname", "sandbox",
        # Nothing outlives the run: killed with its parent; no controlling terminal.
        "--die-with-parent", "--new-session",
        # The system read-only; a minimal /dev (null, zero, urandom, ...); a /proc of its
        # own; an empty /run: daemons keep their unix sockets there (docker, containerd,
        # the system bus), and a read-only mount does not stop a connect (see the module
        # docstring). The workspace is the one writable bind: /dev and /run are made
        # read-only after it is bound (it may lie below one of them).
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/run",
        *(["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"] if tmp else []),
        *[arg for path in masked for arg in ("--tmpfs", str(path))],
        *_open_directories(under, [*readable, root]),
        *[
            arg
            for path in readable
            if _below(path, under) and not _below(path, [root])
            for arg in ("--ro-bind", str(path), str(path))
        ],
        "--bind", str(root), str(root),
        *[
            arg
            for path in blanked
            if not _below(path, under) or _below(path, readable)  # else unseen anyway
            for arg in ("--ro-bind", "/dev/null", str(path))
        ],
        # A socket on a read-only mount still connects (only files, directories and
        # links are write-protected by one).
        *(["--perms", "0755", "--dir", str(Path(door[1]).parent)] if door else []),
        *(["--ro-bind", str(door[0]), door[1]] if door else []),
        *[arg for path in masked for arg in ("--remount-ro", str(path))],
        # /proc read-only as a whole: bubblewrap covers /proc/sys and /proc/sysrq-trigger
        # only where the sandbox user cannot already write them, and under a root caller
        # it can (the kernel sees uid 0), so a sysctl such as kernel.core_pattern would
        # be a host-root escape. Nothing agent code needs writes to /proc.
        "--remount-ro", "/dev", "--remount-ro", "/run", "--remount-ro", "/proc",
        "--chdir", str(root),
    ]  # fmt: skip
    if info_fd is not None:  # bwrap writes {"child-pid": <its init, our pid space>, ...}
        argv += ["--info-fd", str(info_fd)]
    argv.append("--")
    if as_root:  # the last step before Python: uid/gid 65534, no groups, no capabilities
        argv += [
            _SETPRIV, f"--reuid={_SANDBOX_ID}", f"--regid={_SANDBOX_ID}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
        ]  # fmt: skip
    return argv


def _below(path: Path, tops: list[Path]) -> bool:
    """Whether `path` is one of `tops` or lies under one."""
    return any(path == top or top in path.parents for top in tops)


def _outermost(paths: list[Path]) -> list[Path]:
    """`paths` without those under another of them, outermost first."""
    paths = sorted(set(paths), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in paths:
        if not _below(path, kept):
            kept.append(path)
    return kept


def _closed_ancestors(paths: list[Path]) -> list[Path]:
    """For each path, its outermost ancestor that uid 65534 may not enter (no o+x), if
    any; each once, outermost first."""
    closed: list[Path] = []
    for path in paths:
        for ancestor in reversed(path.parents):
            if ancestor != Path("/") and not os.stat(ancestor).st_mode & stat.S_IXOTH:
                closed.append(ancestor)
                break
    return _outermost(closed)


def _open_directories(hidden: list[Path], targets: list[Path]) -> list[str]:
    """bubblewrap arguments making the directories between a hidden tmpfs and a path
    bound below it enterable (mode 0755; bubblewrap's own are 0700, which uid 65534
    could not pass)."""
    args: list[str] = []
    for target in targets:
        for parent in reversed(target.parents):
            if any(h in parent.parents for h in hidden):
                args += ["--perms", "0755", "--dir", str(parent)]
    return args


def give_to_sandbox(root: Path) -> None:
    """Under a root caller: the workspace tree owned by uid 65534, so agent code (which
    runs as it) can write there; links are changed, never followed."""
    uid = gid = int(_SANDBOX_ID)
    os.lchown(root, uid, gid)
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(directory, name), uid, gid)


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
      returncode: the exit status; negative -N when signal N ended the process. (Under
        bubblewrap, which reports a signal as 128 + N, a script's own exit status in
        129..128+NSIG reads as that signal.)
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

    # The `open` event does not report a dir_fd, so the hook resolves a relative name
    # against the cwd; check writes relative to a directory fd here instead.
    def guarded_open(path, flags, mode=0o777, *, dir_fd=None, _open=posix.open):
        if dir_fd is not None and flags & write_flags:
            check_inside("os.open", path, dir_fd)
        return _open(path, flags, mode, dir_fd=dir_fd)

    # Neither raises an audit event; both reach other processes (the harness).
    def guarded_setpriority(which, who, priority, _set=posix.setpriority):
        if not (which == posix.PRIO_PROCESS and who in (0, my_pid)):
            refuse("os.setpriority", "only the script's own priority may change")
        return _set(which, who, priority)

    def guarded_pidfd_open(pid, flags=0, _open=getattr(posix, "pidfd_open", None)):
        if pid != my_pid:
            refuse("os.pidfd_open", "other processes are out of reach")
        return _open(pid, flags)

    _posixsubprocess.fork_exec = fork_exec
    replacements = {"open": guarded_open, "setpriority": guarded_setpriority}
    if hasattr(posix, "pidfd_open"):
        replacements["pidfd_open"] = guarded_pidfd_open
    for name in ("mkfifo", "mknod"):
        replacements[name] = guarded(name, getattr(posix, name))
    for name, wrapper in replacements.items():
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


def run_python(
    script: str,
    workspace: Path | str,
    limits: Limits | None = None,
    *,
    sandbox: str | SandboxChoice = "auto",
) -> RunResult:
    """Runs `script` with Python in a limited, sandboxed child process; cwd = `workspace`.

    Never hangs: the call returns within about `limits.wall_s` (plus process start-up and
    teardown), whatever the script does. The script's own failures (exceptions, refusals,
    limits) are reported in the RunResult, never raised. When it returns, no process the
    script started is left (under bubblewrap; the guard alone cannot promise that).

    Args:
      script: Python source, run as `__main__` (file name "<agent>").
      workspace: an existing directory: the cwd and the only writable place.
      limits: resource limits (default `Limits()`).
      sandbox: a mode ("auto", "bwrap", "python_guard"; see `choose_sandbox`) or an
        already made SandboxChoice.

    Returns:
      A RunResult.

    Raises:
      ValueError: `workspace` is not an existing directory, or is "/"; or a bad mode.
      SandboxUnavailable: `sandbox="bwrap"` and bubblewrap does not work here.
      SandboxError: the child process (or bubblewrap's sandbox) could not be started.
    """
    limits = Limits() if limits is None else limits
    choice = sandbox if isinstance(sandbox, SandboxChoice) else choose_sandbox(sandbox)
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
    pass_fds = [script_fd]
    info_read = info_write = None
    if choice.used == "bwrap":
        if os.geteuid() == 0:
            give_to_sandbox(root)
        info_read, info_write = os.pipe()
        args = bwrap_argv(choice.bwrap, root, info_write) + args
        pass_fds.append(info_write)
    env = {
        "PATH": _SAFE_PATH,
        "HOME": str(root),
        "TMPDIR": str(root),
        "PWD": str(root),  # bubblewrap sets it anyway: the same environment under both
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    start = time.monotonic()
    deadline = start + limits.wall_s
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
            pass_fds=pass_fds,
        )
    except OSError as e:
        if info_read is not None:
            os.close(info_read)
        raise SandboxError(f"could not start the sandboxed python ({args[0]}): {e}") from e
    finally:
        for fd in (script_fd, info_write):
            if fd is not None:
                os.close(fd)
    init_pid = init_pidfd = None
    try:
        if info_read is not None:
            init_pid = read_init_pid(info_read, deadline)
            init_pidfd = None if init_pid is None else open_init(proc, init_pid)
        stdout, stderr, timed_out = _collect(proc, deadline, limits.max_output_bytes)
    finally:
        _end(proc, init_pidfd)
    wall_s = time.monotonic() - start
    returncode = proc.returncode
    if info_read is not None:
        if init_pid is None and not timed_out:  # bubblewrap failed before its namespaces
            reason = _last_line(stderr[0].decode("utf-8", "replace")) or f"exit {returncode}"
            raise SandboxError(f"bubblewrap could not start the sandbox: {reason}")
        # bubblewrap exits 128 + N when signal N ended the script (the shell's convention);
        # report it as the signal, as a direct child's status would be.
        if 128 < returncode < 128 + signal.NSIG:
            returncode = 128 - returncode
    return RunResult(
        returncode=returncode,
        stdout=stdout[0].decode("utf-8", "replace"),
        stderr=stderr[0].decode("utf-8", "replace"),
        timed_out=timed_out,
        killed=returncode < 0,
        wall_s=wall_s,
        stdout_truncated=stdout[1],
        stderr_truncated=stderr[1],
    )


def read_init_pid(info_read: int, deadline: float) -> int | None:
    """The pid of bubblewrap's init (PID 1 of the sandbox's PID namespace), or None.

    bubblewrap writes JSON to its info fd once the namespaces exist and then closes it; it
    exits without writing when it cannot create them. Closes `info_read`.
    """
    data = b""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(info_read, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0 and selector.select(left):
                chunk = os.read(info_read, 4096)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(info_read)
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def open_init(proc, pid: int) -> int | None:
    """A pidfd for bubblewrap's init `pid` (None if it has already gone).

    The pidfd is what lets `_end` kill the whole namespace and wait until it is empty.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # already exited and reaped: the namespace is gone with it
        return None
    # The pid could have died and been reused before pidfd_open; it is bubblewrap's init
    # only if its parent is our bubblewrap (which forks nothing else).
    if _parent_pid(pid) != proc.pid:
        os.close(pidfd)
        return None
    return pidfd


def _parent_pid(pid: int) -> int | None:
    """The parent of `pid` from /proc (None if it is gone)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return int(stat_line[stat_line.rindex(")") + 2 :].split()[1])


def _end(proc: subprocess.Popen, init_pidfd: int | None) -> None:
    """Kills what is left of the run and reaps it; closes `init_pidfd`."""
    if init_pidfd is not None:
        kill_namespace(init_pidfd)
    # Kill the whole group before reaping: while the child is an unreaped zombie its pid
    # (= the group id) cannot be reused, so this never hits another process.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def kill_namespace(init_pidfd: int) -> None:
    """Kills the sandbox whose init `init_pidfd` is and waits (up to _TEARDOWN_S) until
    it is empty; closes the pidfd."""
    # Kill bubblewrap's init while its parent (our bubblewrap) is alive to reap it. The
    # kernel kills every other process in the namespace, and waits for them, before the
    # init's exit is seen, so once the pidfd is readable the sandbox is empty.
    try:
        signal.pidfd_send_signal(init_pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(init_pidfd, selectors.EVENT_READ)
            selector.select(_TEARDOWN_S)
    finally:
        os.close(init_pidfd)


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
