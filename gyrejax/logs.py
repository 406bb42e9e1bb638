"""JSON-lines logs (`metrics.jsonl`, `dispatch.jsonl`, `transitions.jsonl`), read and
trimmed defensively.

A run appends one JSON object per line and can be killed at any moment, so the last
line may be torn (cut mid-write). Readers warn about a line that does not parse and
ignore it; before a resumed run appends again, `prepare_for_append` cuts a torn tail
away, so the next record starts on a line of its own instead of being glued to the torn
one, and drops rows the resumed run will write again (metric rows of steps past the
restored checkpoint), so each step appears once. Rewrites are atomic (temp file, fsync,
rename): a kill during one leaves the old log or the new one, never a mix.

`mark` notes moments (a training step, a checkpoint write, ...) in the file named by
the GYREJAX_MARKERS environment variable, for a fault-injection harness
(`benchmarks/chaos.py`) to aim its kills at; unset, it does nothing.

Pure Python: no JAX, no gyrejax imports.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def _parse(path: Path, number: int, line: str) -> dict | None:
    """The record on one line, or None (after a warning naming file and line) if bad."""
    try:
        record = json.loads(line)
    except ValueError as e:
        logger.warning("%s line %d: unreadable JSON, ignored (%s): %.80r", path, number, e, line)
        return None
    if not isinstance(record, dict):
        logger.warning("%s line %d: not a JSON object, ignored: %.80r", path, number, line)
        return None
    return record


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines log; [] if it does not exist.

    Blank lines are skipped; a line that is not a JSON object (a torn last line, a
    damaged one) is named in a warning and ignored. The file is not modified.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip() and (record := _parse(path, number, line)) is not None:
            records.append(record)
    return records


def prepare_for_append(
    path: str | os.PathLike, keep: Callable[[dict], bool] | None = None
) -> list[dict]:
    """Makes a log safe to append to again after a restart; returns the records kept.

    A torn last line (no final newline) is cut away with a warning, or, if it is a
    complete record that only lacks its newline, kept and completed. With `keep`, the
    records it rejects are removed (e.g. metric rows of steps a resumed run redoes). A
    damaged line in the middle is warned about and left as it is: it is not the resumed
    run's to drop.

    Args:
      path: the log; nothing happens if it does not exist.
      keep: record -> whether it stays; None keeps every readable record.
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline (or is empty)
    if tail.strip():
        record = _parse_tail(path, len(lines) + 1, tail)
        if record is not None:
            lines.append(tail)  # complete, only the newline was lost
    kept_lines, kept = [], []
    dropped = 0
    for number, raw in enumerate(lines, start=1):
        text = raw.decode("utf-8", errors="replace")
        record = _parse(path, number, text) if text.strip() else None
        if record is not None and keep is not None and not keep(record):
            dropped += 1
            continue
        kept_lines.append(raw)
        if record is not None:
            kept.append(record)
    new = b"".join(line + b"\n" for line in kept_lines)
    if new != data:
        _replace(path, new)
        if dropped:
            logger.info("%s: removed %d record(s) the resumed run writes again", path, dropped)
    return kept


def up_to_step(step: int) -> Callable[[dict], bool]:
    """A `keep` for `prepare_for_append`: metric rows of steps <= `step` stay (and rows
    without an integer step, which are not the resumed run's to judge)."""

    def keep(record: dict) -> bool:
        row_step = record.get("step")
        return not (isinstance(row_step, int) and row_step > step)

    return keep


def _parse_tail(path: Path, number: int, tail: bytes) -> dict | None:
    try:
        record = json.loads(tail.decode("utf-8"))
    except ValueError:
        record = None
    if not isinstance(record, dict):
        logger.warning(
            "%s line %d: torn last line (%d bytes) removed before appending",
            path,
            number,
            len(tail),
        )
        return None
    return record


def _replace(path: Path, data: bytes) -> None:
    """Atomically replaces `path`'s contents with `data` (temp file, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Appends one record as one line (flushed to the OS when this returns)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


MARKERS_ENV = "GYREJAX_MARKERS"


def mark(event: str) -> None:
    """Appends "<unix time> <event>" to the file $GYREJAX_MARKERS names, if it is set.

    Events come in pairs, "<moment>" when it begins and "<moment> done" when it ends, so
    a harness that kills the process can tell whether the kill landed inside. Nothing
    else depends on it: it changes no behaviour.
    """
    path = os.environ.get(MARKERS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.6f} {event}\n")
