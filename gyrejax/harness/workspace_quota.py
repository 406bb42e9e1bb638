"""Per-execution workspace quotas, bytes and inodes, that agent code cannot get around.

The workspace tools cap what they write themselves (`Workspace`: files, bytes), and a
sandboxed process may not write a file past its RLIMIT_FSIZE; but agent code in a check,
or an external agent, may write many files: one check of the audit filled a 64 MiB disk
in 0.13 s, another made 52,108 files. Where the runtime is root, each execution's
workspace is a tmpfs of its own, mounted before the execution starts with
`size=harness.workspace_bytes,nr_inodes=harness.workspace_inodes` (nosuid, nodev): past
either, writes fail with ENOSPC inside that workspace only, whoever writes. When the
execution ends (scored), its files are copied to disk where the workspace was and the
tmpfs is unmounted, so a workspace reads afterwards as it always did. Mounts a killed
run left behind (their source is named `SOURCE`) are unmounted when the next run starts
on the workdir (`clear_stale`).

Not root: nothing is mounted, and the summary says the limits are not enforced beyond
the tools' caps and the per-file size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import os
import shutil
import tempfile
from pathlib import Path

from absl import logging

SOURCE = "gyrejax-workspace"  # a workspace mount's source, to find them in mountinfo
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _mount_tmpfs(path: Path, size_bytes: int, inodes: int) -> None:
    options = f"size={size_bytes},nr_inodes={inodes},mode=0755".encode()
    flags = _MS_NOSUID | _MS_NODEV
    if _libc().mount(SOURCE.encode(), os.fsencode(path), b"tmpfs", flags, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount tmpfs on {path}: {os.strerror(code)}")


def _unmount(path: Path) -> None:
    if _libc().umount2(os.fsencode(path), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"umount {path}: {os.strerror(code)}")


@functools.cache
def mount_problem() -> str | None:
    """None if this process can mount a workspace tmpfs, else why not (probed once)."""
    if os.geteuid() != 0:
        return "the run is not root, and only root may mount a tmpfs per workspace"
    probe = Path(os.path.realpath(tempfile.mkdtemp(prefix="gyrejax-quota-")))
    try:
        _mount_tmpfs(probe, 1 << 16, 16)
        _unmount(probe)
    except OSError as e:
        return f"mounting a tmpfs failed here ({e})"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


def quota_summary(size_bytes: int, inodes: int) -> dict:
    """For run_summary.json: a workspace's limits and whether they hold here."""
    problem = mount_problem()
    record = {"bytes": size_bytes, "inodes": inodes, "enforced": problem is None}
    if problem is None:
        record["by"] = "a tmpfs per workspace (size, nr_inodes)"
    else:
        record["reason"] = problem
    return record


def _mounts_under(directory: Path) -> list[Path]:
    """Workspace mounts (source SOURCE) at or below `directory`, deepest first."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            if fields[separator + 2] != SOURCE:
                continue
            point = Path(_unescape(fields[4]))
            if point == directory or directory in point.parents:
                found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


class WorkspaceQuota:
    """Mounts (root only) a size- and inode-limited tmpfs on each execution's workspace.

    Args:
      workdir: where the workspaces live; stale mounts under it are cleared now.
      size_bytes: a workspace's bytes (`harness.workspace_bytes`).
      inodes: its files and directories (`harness.workspace_inodes`).
    """

    def __init__(self, workdir: Path | str, size_bytes: int, inodes: int):
        self.workdir = Path(os.path.realpath(workdir))
        self.size_bytes, self.inodes = size_bytes, inodes
        self.problem = mount_problem()
        if self.problem is None:
            self.clear_stale()
        else:
            logging.warning("workspace quotas not enforced: %s", self.problem)

    @property
    def enforced(self) -> bool:
        return self.problem is None

    def clear_stale(self) -> None:
        """Unmounts workspace tmpfs mounts a killed run left under the workdir (their
        files were never copied out: that execution was never stored either)."""
        for point in _mounts_under(self.workdir):
            logging.warning("unmounting a workspace a killed run left: %s", point)
            _unmount(point)

    def open(self, root: Path) -> None:
        """Makes `root` and, where enforced, mounts its tmpfs (before anything is in it)."""
        root.mkdir(parents=True, exist_ok=True)
        if self.enforced and not _mounts_under(Path(os.path.realpath(root))):
            _mount_tmpfs(root, self.size_bytes, self.inodes)

    async def close(self, root: Path) -> None:
        """Copies the workspace's files to disk where it was, then unmounts it (off the
        event loop: up to `size_bytes` to copy)."""
        if self.enforced:
            await asyncio.to_thread(self._copy_out, Path(os.path.realpath(root)))

    @staticmethod
    def _copy_out(root: Path) -> None:
        if root not in _mounts_under(root):
            return
        kept = root.with_name(root.name + ".copying")
        shutil.rmtree(kept, ignore_errors=True)
        try:
            shutil.copytree(root, kept, symlinks=True)
        except (OSError, shutil.Error) as e:  # a full host disk: the record matters, not this
            logging.warning("workspace %s not kept on disk: %s", root, e)
            shutil.rmtree(kept, ignore_errors=True)
            kept = None
        _unmount(root)
        if kept is not None:
            shutil.rmtree(root)  # the empty directory it was mounted on
            kept.rename(root)
