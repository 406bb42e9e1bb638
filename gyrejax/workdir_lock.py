"""One launch per workdir: an advisory lock held for the process's whole life.

`hold(workdir, process_index)` takes an exclusive `flock` on `<workdir>/.lock` (process
0) or `<workdir>/.lock.<i>` (process i of a multi-process run, which shares the workdir
with its peers), writes its pid there and keeps the file open until the process exits:
the kernel drops the lock when the holder dies, so a crash never leaves a stale lock.
A second launch on a workdir in use fails at once with one line naming the holder's
pid, before it touches a checkpoint, the store or a log.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

_held: dict[Path, int] = {}  # lock path -> open fd, for the life of the process


class WorkdirBusy(RuntimeError):
    """Another live process holds the workdir's lock."""


def lock_path(workdir: str | Path, process_index: int = 0) -> Path:
    name = ".lock" if process_index == 0 else f".lock.{process_index}"
    return Path(workdir) / name


def hold(workdir: str | Path, process_index: int = 0) -> Path:
    """Takes the workdir's lock for this process (creating the workdir); a no-op if this
    process holds it already.

    Raises:
      WorkdirBusy: another process holds it (its pid named).
    """
    path = lock_path(workdir, process_index)
    if path in _held:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip() or "unknown"
        os.close(fd)
        raise WorkdirBusy(
            f"--workdir={workdir}: in use by pid {holder} (lock {path}); wait for it to "
            "end or pick another workdir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd
    return path
