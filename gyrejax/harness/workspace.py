"""One execution's own directory, and the confined file tools an agent uses on it.

Every tool returns the observation string the agent sees and never raises for the agent's
mistakes: a refused path or a full workspace is an observation that says exactly why
("refused: '../x' leaves the workspace").

Confinement. A path must be relative, non-empty, free of NUL and other control characters,
without a `..` component, at most `max_path_bytes` bytes (and each component at most
`max_name_bytes`), and it must resolve (`os.path.realpath`, symlinks followed) to itself
inside the root: a symlink anywhere on the way is refused, with a message saying where
it leads. `.` and empty components are dropped ("./a//b.txt" is "a/b.txt").

That check gives the message; the opens enforce it. Files are opened by `open_beneath`:
from a descriptor of the root, one component at a time relative to its parent's
descriptor (openat-style, `dir_fd`), each with O_NOFOLLOW, so a symlink anywhere on the
path, even one swapped in after the check (agent code racing the tool), fails the open
instead of leading outside. Only regular files are read (O_NONBLOCK: a FIFO left by agent
code cannot block a tool), and `write` refuses a file with more than one hard link (a link
planted in the workspace to a file outside would otherwise be overwritten through it); the
link count is checked on the open descriptor before the file is truncated.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_CONTROL_CHARS = frozenset(chr(c) for c in (*range(32), 127))
_MAX_LISTED = 200


class Workspace:
    """A directory an agent's tools may read and write, confined and capped.

    Args:
      root: the directory; created (with parents) if it does not exist.
      max_files: most regular files the workspace may hold.
      max_file_bytes: largest file `write` accepts (and most bytes `read` shows).
      max_total_bytes: largest total size of all regular files after a write.
      max_path_bytes: longest relative path, in UTF-8 bytes.
      max_name_bytes: longest single path component, in UTF-8 bytes.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        max_files: int = 32,
        max_file_bytes: int = 16_384,
        max_total_bytes: int = 262_144,
        max_path_bytes: int = 200,
        max_name_bytes: int = 100,
    ):
        for name, value in (
            ("max_files", max_files),
            ("max_file_bytes", max_file_bytes),
            ("max_total_bytes", max_total_bytes),
            ("max_path_bytes", max_path_bytes),
            ("max_name_bytes", max_name_bytes),
        ):
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"Workspace {name}={value!r}: expected a positive integer")
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.root = Path(os.path.realpath(root))
        self.max_files = max_files
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.max_path_bytes = max_path_bytes
        self.max_name_bytes = max_name_bytes

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    # Tools: each returns an observation.

    def write(self, path: str, content: str) -> str:
        """Writes `content` (UTF-8) to `path`, creating parent directories."""
        checked = self._check(path)
        if isinstance(checked, str):
            return checked
        relative, target = checked
        if not isinstance(content, str):
            return f"refused: the content for '{relative}' is not text"
        try:
            data = content.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return f"refused: the content for '{relative}' cannot be encoded as UTF-8"
        if len(data) > self.max_file_bytes:
            return (
                f"refused: '{relative}' would be {len(data)} bytes, over the "
                f"{self.max_file_bytes}-byte file size cap"
            )
        sizes = self._sizes()
        old_size = sizes.get(relative)
        if old_size is None and len(sizes) >= self.max_files:
            return (
                f"refused: the workspace already holds {len(sizes)} files, the "
                f"{self.max_files}-file cap"
            )
        total = sum(sizes.values()) - (old_size or 0) + len(data)
        if total > self.max_total_bytes:
            return (
                f"refused: writing '{relative}' would bring the workspace to {total} bytes, "
                f"over the {self.max_total_bytes}-byte total size cap"
            )
        if target.is_symlink() or (target.exists() and not target.is_file()):
            kind = "a directory" if target.is_dir() else "not a regular file"
            return f"refused: '{relative}' exists and is {kind}"
        try:
            # No O_TRUNC: the file is truncated only once its descriptor shows it is ours.
            fd = open_beneath(
                self.root, relative, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, make_parents=True
            )
        except OSError as e:
            return _open_refusal(e, relative) or (
                f"error: cannot write '{relative}': {_os_reason(e, relative)}"
            )
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return f"refused: '{relative}' exists and is not a regular file"
            if info.st_nlink > 1:
                return (
                    f"refused: '{relative}' has {info.st_nlink} hard links (it may be a file "
                    f"outside the workspace); write to a new path instead"
                )
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            return f"error: cannot write '{relative}': {_os_reason(e, relative)}"
        finally:
            os.close(fd)
        return f"wrote '{relative}' ({len(data)} bytes)"

    def read(self, path: str) -> str:
        """The text of `path`, or a notice (missing, a directory, binary, truncated)."""
        checked = self._check(path)
        if isinstance(checked, str):
            return checked
        relative, _ = checked
        try:
            data = _read_regular(self.root, relative, self.max_file_bytes + 1)
        except IsADirectoryError:
            return f"error: '{relative}' is a directory; use ls to see its files"
        except OSError as e:
            return _open_refusal(e, relative) or (
                f"error: cannot read '{relative}': {_os_reason(e, relative)}"
            )
        if data is None:
            return f"error: '{relative}' is not a regular file"
        truncated = len(data) > self.max_file_bytes
        data = data[: self.max_file_bytes]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if not (truncated and e.start >= len(data) - 3):
                return f"'{relative}' is binary or not UTF-8; not shown"
            text = data[: e.start].decode("utf-8")
        if truncated:
            return text + f"\n[truncated: '{relative}' is over {self.max_file_bytes} bytes]"
        if not text:
            return f"'{relative}' is empty"
        return text

    def list_files(self) -> str:
        """Sorted relative paths of the regular files, one per line."""
        paths = sorted(self._sizes())
        if not paths:
            return "the workspace is empty"
        shown = "\n".join(paths[:_MAX_LISTED])
        if len(paths) > _MAX_LISTED:
            shown += f"\n[... and {len(paths) - _MAX_LISTED} more]"
        return shown

    # Views for the harness and the scorer.

    def files(self) -> dict[str, bytes]:
        """Relative path -> content of every regular file (symlinks and other kinds skipped)."""
        out = {}
        for relative in sorted(self._sizes()):
            try:
                data = _read_regular(self.root, relative)
            except OSError:
                continue
            if data is not None:
                out[relative] = data
        return out

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes | None:
        """The bytes of `path` if it is a confined regular file (else None), at most
        `max_bytes` of them."""
        checked = self._check(path)
        if isinstance(checked, str):
            return None
        try:
            return _read_regular(self.root, checked[0], max_bytes)
        except OSError:
            return None

    def is_empty(self) -> bool:
        """True when the workspace holds no regular file."""
        for _ in self._walk():
            return False
        return True

    # Internals.

    def _check(self, path: object) -> tuple[str, Path] | str:
        """(normalised relative path, absolute path) or a refusal observation."""
        if not isinstance(path, str):
            return f"refused: the path must be text, not {type(path).__name__}"
        shown = repr(path) if len(path) <= 60 else repr(path[:57] + "...")
        if not path:
            return "refused: the path is empty"
        if "\x00" in path:
            return f"refused: {shown} contains a NUL byte"
        if any(c in _CONTROL_CHARS for c in path):
            return f"refused: {shown} contains a control character"
        if path != path.strip():
            return f"refused: {shown} starts or ends with whitespace"
        if path.startswith("/"):
            return f"refused: {shown} is an absolute path; use a path relative to the workspace"
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            return f"refused: {shown} leaves the workspace ('..' is not allowed)"
        if not parts:
            return f"refused: {shown} names the workspace itself, not a file"
        try:
            encoded = [p.encode("utf-8") for p in parts]
        except UnicodeEncodeError:
            return f"refused: {shown} is not valid UTF-8"
        relative = "/".join(parts)
        if len(relative.encode("utf-8")) > self.max_path_bytes:
            return f"refused: {shown} is longer than {self.max_path_bytes} bytes"
        if max(len(p) for p in encoded) > self.max_name_bytes:
            return f"refused: {shown} has a name longer than {self.max_name_bytes} bytes"
        target = self.root / relative
        try:
            real = Path(os.path.realpath(target))
        except (OSError, ValueError):
            return f"refused: {shown} cannot be resolved"
        if not (real != self.root and real.is_relative_to(self.root)):
            return f"refused: {shown} leads outside the workspace through a symlink"
        if real != target:  # a link that stays inside; the tools still never follow links
            return f"refused: {shown} goes through a symlink (symlinks are not followed)"
        return relative, target

    def _walk(self):
        """Yields (relative path, lstat) of regular files; never follows symlinks."""
        for directory, subdirs, names in os.walk(self.root, followlinks=False):
            subdirs.sort()
            for name in sorted(names):
                full = os.path.join(directory, name)
                try:
                    info = os.lstat(full)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    yield os.path.relpath(full, self.root), info

    def _sizes(self) -> dict[str, int]:
        return {relative: info.st_size for relative, info in self._walk()}


def open_beneath(root: Path | str, relative: str, flags: int, *, make_parents: bool = False) -> int:
    """Opens `root/relative` without following a symlink anywhere below `root`.

    Walks the path one component at a time: each directory is opened relative to its
    parent's descriptor with O_DIRECTORY | O_NOFOLLOW, and the last component with
    O_NOFOLLOW, so the kernel refuses a symlink at any step, even one put there after a
    path check (a plain `open(root / relative)` would follow a swapped-in link in the
    middle of the path).

    Args:
      root: the directory the path is confined to (itself opened normally).
      relative: a normalised relative path: no "", ".", ".." or absolute components.
      flags: `os.open` flags for the last component (O_NOFOLLOW and O_CLOEXEC are added);
        with O_CREAT the file is created with mode 0o644.
      make_parents: create missing directories on the way (mode 0o755).

    Returns:
      An open file descriptor; the caller closes it.

    Raises:
      OSError: as `os.open` does; ELOOP when a component is a symlink.
    """
    parts = relative.split("/")
    if not all(parts) or any(p in (".", "..") for p in parts):
        raise ValueError(f"open_beneath: {relative!r} is not a normalised relative path")
    directory_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts[:-1]:
            try:
                child = os.open(name, directory_flags, dir_fd=fd)
            except FileNotFoundError:
                if not make_parents:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:  # made meanwhile: the open below checks what it is
                    pass
                child = _open_directory(name, directory_flags, fd)
            except NotADirectoryError:
                child = _open_directory(name, directory_flags, fd)
            os.close(fd)
            fd = child
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
    finally:
        os.close(fd)


def _open_directory(name: str, flags: int, dir_fd: int) -> int:
    """Opens a directory component; ELOOP (not ENOTDIR) when it is a symlink, so callers
    can tell a link on the way from a file in the way."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except NotADirectoryError:
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, "a symlink on the way (not followed)", name) from None
        raise


def _read_regular(root: Path, relative: str, max_bytes: int | None = None) -> bytes | None:
    """Reads a regular file under `root` (see `open_beneath`) without blocking on a FIFO;
    None if it is not a regular file.

    Raises:
      IsADirectoryError: it is a directory.
      OSError: it cannot be opened (ELOOP: a symlink on the way or at the end).
    """
    fd = open_beneath(root, relative, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", relative)
        if not stat.S_ISREG(mode):
            return None
        chunks = []
        remaining = max_bytes
        while remaining is None or remaining > 0:
            chunk = os.read(fd, 1 << 16 if remaining is None else min(remaining, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            if remaining is not None:
                remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_refusal(error: OSError, relative: str) -> str | None:
    """The refusal for an open that met a symlink (ELOOP), else None."""
    if error.errno == errno.ELOOP:
        return f"refused: '{relative}' goes through a symlink (symlinks are not followed)"
    return None


def _os_reason(error: OSError, relative: str) -> str:
    if error.errno == errno.ENOENT:
        return "no such file"
    if error.errno == errno.EISDIR:
        return "it is a directory"
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        return "a part of the path is a file, not a directory"
    if error.errno == errno.ELOOP:
        return "it is a symlink"
    return error.strerror or type(error).__name__
