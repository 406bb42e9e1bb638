"""Per-execution process and memory limits for agent commands, in cgroups (root only).

An rlimit cannot bound an agent's process tree: RLIMIT_NPROC counts every process of a
uid on the host, and every sandbox runs as the same one; RLIMIT_AS bounds each process
alone. A cgroup per execution does: `pids.max` (processes and threads) and the memory
limit (every process of the tree together, page cache and tmpfs pages included) hold
whatever the tree does, and the kernel's OOM killer stays inside it.

`ExecutionCgroup.create(name, max_processes, memory_bytes)` makes one child cgroup per
controller we may write (cgroup v2: `pids.max`, `memory.max`, where the parent's
`cgroup.subtree_control` offers them; v1: the `pids` and `memory` hierarchies), and
`join_argv` puts the agent's command line in them before it runs (a shell that writes
its own pid to each `cgroup.procs`, then execs). `remove` deletes them once the tree is
dead. Whatever cannot be made is reported (`limits_summary`), never silently assumed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time
from pathlib import Path

from absl import logging

_PREFIX = f"gyrejax-{os.getpid()}-"
_KILL_ROUNDS = 100
_counter = itertools.count()


@functools.cache
def _hierarchies() -> dict[str, tuple[Path, str]]:
    """controller -> (where this process's cgroup is, "v1" | "v2"), for pids and memory."""
    found: dict[str, tuple[Path, str]] = {}
    mounts = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, fstype, options = line.split()[:4]
            if fstype == "cgroup2":
                mounts.setdefault("v2", Path(point))
            elif fstype == "cgroup":
                for controller in ("pids", "memory"):
                    if controller in options.split(","):
                        mounts[controller] = Path(point)
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            relative = path.lstrip("/")
            if controllers == "" and "v2" in mounts:  # the unified hierarchy
                here = mounts["v2"] / relative
                offered = _read(here / "cgroup.subtree_control").split()
                for controller in ("pids", "memory"):
                    if controller in offered:
                        found.setdefault(controller, (here, "v2"))
            for controller in controllers.split(","):
                if controller in ("pids", "memory") and controller in mounts:
                    found[controller] = (mounts[controller] / relative, "v1")
    for parent, _ in found.values():
        _clear_stale(parent)
    return found


def _clear_stale(parent: Path) -> None:
    """Removes the empty cgroups of runs that are gone (a killed run leaves its own)."""
    with contextlib.suppress(OSError):
        for child in parent.iterdir():
            pid = child.name.split("-")[1] if child.name.startswith("gyrejax-") else ""
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    child.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


_LIMIT_FILES = {
    ("pids", "v1"): "pids.max",
    ("pids", "v2"): "pids.max",
    ("memory", "v1"): "memory.limit_in_bytes",
    ("memory", "v2"): "memory.max",
}


class ExecutionCgroup:
    """One execution's cgroups (see the module docstring)."""

    def __init__(self, directories: list[Path], problems: dict[str, str]):
        self.directories = directories
        self.problems = problems

    @classmethod
    def create(cls, max_processes: int, memory_bytes: int) -> ExecutionCgroup:
        """Makes this execution's cgroups where it may; `problems` says where not."""
        directories, problems = [], {}
        if os.geteuid() != 0:
            reason = "the run is not root"
            return cls([], {"pids": reason, "memory": reason})
        name = f"{_PREFIX}{next(_counter)}"
        hierarchies = _hierarchies()
        for controller, limit in (("pids", max_processes), ("memory", memory_bytes)):
            if controller not in hierarchies:
                problems[controller] = f"no writable {controller} cgroup controller here"
                continue
            parent, version = hierarchies[controller]
            child = parent / name
            try:
                child.mkdir()
            except FileExistsError:
                pass
            except OSError as e:
                problems[controller] = f"cannot make a {controller} cgroup ({e})"
                continue
            try:
                (child / _LIMIT_FILES[controller, version]).write_text(str(limit))
            except OSError as e:
                problems[controller] = f"cannot set the {controller} limit ({e})"
                with contextlib.suppress(OSError):
                    child.rmdir()
                continue
            if child not in directories:
                directories.append(child)
        return cls(directories, problems)

    def join_argv(self, argv: list[str]) -> list[str]:
        """`argv`, run from inside these cgroups (unchanged if there are none)."""
        if not self.directories:
            return argv
        procs = [str(d / "cgroup.procs") for d in self.directories]
        script = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(procs)))
        script += f' && shift {len(procs)} && exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *procs, *argv]

    def remove(self) -> None:
        """Kills what is left in the cgroups (a process that left the agent's process
        group or session is still in them) and deletes them."""
        for directory in self.directories:
            for _ in range(_KILL_ROUNDS):  # a process may fork while its siblings die
                pids = _read(directory / "cgroup.procs").split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.01)
            try:
                directory.rmdir()
            except OSError as e:  # still busy: the kernel frees it once empty
                logging.warning("cgroup %s not removed: %s", directory, e)
        self.directories = []


def limits_summary(max_processes: int, memory_bytes: int) -> dict:
    """For run_summary.json: the per-execution process and memory limits of agent
    commands and what enforces them here."""
    probe = ExecutionCgroup.create(max_processes, memory_bytes)
    probe.remove()
    hierarchies = _hierarchies()
    record = {}
    for controller, limit in (("pids", max_processes), ("memory", memory_bytes)):
        if controller in probe.problems:
            record[controller] = {"limit": limit, "enforced": False}
            record[controller]["reason"] = probe.problems[controller]
        else:
            version = hierarchies[controller][1]
            record[controller] = {"limit": limit, "enforced": True, "by": f"cgroup {version}"}
    return record
