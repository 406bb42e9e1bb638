"""On-disk execution store: one checksummed record file per execution.

Record format (little-endian):

  b"GXEXEC01" | header_len: u64 | header: JSON (utf-8) | payload | sha256(all before): 32B

The header holds every scalar field of the execution and its calls (their sampling
settings too; a record written before those were stored reads as temperature 1, no
truncation, what the trainer then assumed); the payload holds
four concatenated arrays: prompt suffixes (int32), outputs (int32), logprobs (float32),
versions (int32). Prompts are delta-coded: a multi-turn agent re-sends its whole
history, so each prompt is stored as (reference call, shared prefix length, suffix),
the reference being the earlier call (same agent's last call, or the previous call)
whose prompt + output shares the longest prefix with it. Disk use is then about the
unique tokens U rather than the naive tokens N.

Writes are atomic: a temp file (".tmp-*", never listed) in the same directory is
written, flushed and fsynced, then moved into place with os.link (put without
overwrite: fails if the record exists) or os.replace (overwrite), and the directory is
fsynced. A reader therefore sees either no record or a complete one.

Records are validated both ways (`records.validate_record`: field types, a known status,
a finite reward or None): `put` refuses a bad execution with a ValueError naming the
field and value, and a reader skips a record that fails its checksum (truncated,
bit-flipped) or holds bad fields under a valid checksum (written by other code, or
edited). A skipped record is named in a warning (once per store object), counted in
`bad_records`, and reported to the caller that asked for it (`groups(..., skipped=)`),
so one bad record never stops a reader: iteration, `group_ids()` and group lookups go
on with the others.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gyrejax.trajectory.records import (
    STATUSES,
    Execution,
    ModelCall,
    check_sampling,
    validate_record,
)

logger = logging.getLogger(__name__)

MAGIC = b"GXEXEC01"
SUFFIX = ".gxr"
_DIGEST_BYTES = 32
# A call's sampling settings, and what a record written before they were stored reads as.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")
_MAX_NAME = 200


class CorruptRecordError(ValueError):
    """A record file failed its integrity checks, or holds fields no execution may have."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_header(header: dict) -> None:
    """Checks the JSON types of a record header's fields, before any is used.

    A header with a valid checksum can still hold anything (another writer, an edit):
    `reward: "abc"`, `call_id: "x"`, `execution_id: 12`. The records' constructors
    would coerce some of these silently and raise on others, so the raw JSON is checked.

    Raises:
      ValueError naming the field (and call) and the offending value.
    """
    for name in ("execution_id", "task_id", "group_id"):
        if not isinstance(header.get(name), str):
            raise ValueError(f"{name}={header.get(name)!r}: expected a string")
    if header.get("status") not in STATUSES:
        raise ValueError(f"status={header.get('status')!r}: expected one of {STATUSES}")
    reward = header.get("reward")
    if reward is not None and not (_is_number(reward) and math.isfinite(reward)):
        raise ValueError(f"reward={reward!r}: expected a finite number or null")
    attempts = header.get("eval_attempts")
    if not _is_int(attempts) or attempts < 0:
        raise ValueError(f"eval_attempts={attempts!r}: expected an int >= 0")
    if not isinstance(header.get("error", ""), str):  # absent in records written before it
        raise ValueError(f"error={header.get('error')!r}: expected a string")
    calls = header.get("calls")
    if not isinstance(calls, list):
        raise ValueError(f"calls={calls!r}: expected a list")
    for i, meta in enumerate(calls):
        if not isinstance(meta, dict):
            raise ValueError(f"calls[{i}]={meta!r}: expected an object")
        for name in ("call_id", "prompt_len", "output_len", "ref", "shared"):
            if not _is_int(meta.get(name)):
                raise ValueError(f"calls[{i}].{name}={meta.get(name)!r}: expected an int")
        if meta["prompt_len"] < 0 or meta["output_len"] < 0 or meta["ref"] < -1:
            raise ValueError(f"calls[{i}]: negative length or reference in {meta!r}")
        if not 0 <= meta["shared"] <= meta["prompt_len"]:
            raise ValueError(f"calls[{i}].shared={meta['shared']!r}: outside the prompt")
        for name in ("agent_id", "role", "finish_reason"):
            if not isinstance(meta.get(name), str):
                raise ValueError(f"calls[{i}].{name}={meta.get(name)!r}: expected a string")
        engines = meta.get("engines")
        if not isinstance(engines, list) or not all(isinstance(e, str) for e in engines):
            raise ValueError(f"calls[{i}].engines={engines!r}: expected a list of names")
        for name in ("started_at", "finished_at"):
            value = meta.get(name)
            if not (_is_number(value) and math.isfinite(value)):
                raise ValueError(f"calls[{i}].{name}={value!r}: expected a finite number")
        # Absent in records written before the sampling settings were stored.
        for name, default in SAMPLING_DEFAULTS.items():
            value = meta.get(name, default)
            if not (_is_int(value) if name == "top_k" else _is_number(value)):
                raise ValueError(f"calls[{i}].{name}={value!r}: expected a number")
        check_sampling(*(meta.get(n, d) for n, d in SAMPLING_DEFAULTS.items()), f"calls[{i}]")


def escape_id(execution_id: str) -> str:
    """Maps an execution id to a file name stem, injectively and case-insensitively safe.

    Lower-case letters, digits, '-' and '_' stay; every other character becomes %XX per
    UTF-8 byte. Stems longer than 200 characters are shortened to a prefix plus a
    sha256 of the id (marked with '~', which escaping never produces).
    """
    out = []
    for ch in execution_id:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    stem = "".join(out)
    if not stem:
        stem = "%"  # the empty id; no escaped id is a lone '%'
    if len(stem) > _MAX_NAME:
        digest = hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).hexdigest()
        stem = f"{stem[:100]}~{digest}"
    return stem


def _common_prefix(prompt_ref: np.ndarray, output_ref: np.ndarray, prompt: np.ndarray) -> int:
    """Length of the common prefix of (prompt_ref + output_ref) and prompt."""
    k = min(len(prompt_ref), len(prompt))
    diff = np.flatnonzero(prompt_ref[:k] != prompt[:k])
    if len(diff):
        return int(diff[0])
    if k < len(prompt_ref) or k == len(prompt):
        return k
    rest = prompt[k:]
    k2 = min(len(output_ref), len(rest))
    diff = np.flatnonzero(output_ref[:k2] != rest[:k2])
    return k + (int(diff[0]) if len(diff) else k2)


def encode_execution(execution: Execution) -> bytes:
    """Serialises one execution to the record format (see module docstring)."""
    calls = list(execution.calls)
    last_of_agent: dict[str, int] = {}
    call_meta = []
    suffixes = []
    for i, call in enumerate(calls):
        ref, shared = -1, 0
        for cand in sorted({last_of_agent.get(call.agent_id, -1), i - 1}):
            if cand < 0:
                continue
            c = calls[cand]
            n = _common_prefix(c.prompt_ids, c.output_ids, call.prompt_ids)
            if n > shared or (n == shared and n and cand > ref):
                ref, shared = cand, n
        last_of_agent[call.agent_id] = i
        suffixes.append(call.prompt_ids[shared:])
        call_meta.append(
            {
                "call_id": call.call_id,
                "agent_id": call.agent_id,
                "role": call.role,
                "finish_reason": call.finish_reason,
                "engines": list(call.engines),
                "started_at": call.started_at,
                "finished_at": call.finished_at,
                "prompt_len": len(call.prompt_ids),
                "output_len": len(call.output_ids),
                "temperature": call.temperature,
                "top_p": call.top_p,
                "top_k": call.top_k,
                "ref": ref,
                "shared": shared,
            }
        )
    header = {
        "format": 1,
        "execution_id": execution.execution_id,
        "task_id": execution.task_id,
        "group_id": execution.group_id,
        "status": execution.status,
        "reward": execution.reward,
        "eval_attempts": execution.eval_attempts,
        "error": execution.error,
        "calls": call_meta,
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")

    def cat(arrays: list[np.ndarray], dtype: str) -> bytes:
        if not arrays:
            return b""
        return np.concatenate(arrays).astype(dtype, copy=False).tobytes()

    body = b"".join(
        [
            MAGIC,
            struct.pack("<Q", len(header_bytes)),
            header_bytes,
            cat(suffixes, "<i4"),
            cat([c.output_ids for c in calls], "<i4"),
            cat([c.logprobs for c in calls], "<f4"),
            cat([c.versions for c in calls], "<i4"),
        ]
    )
    return body + hashlib.sha256(body).digest()


def decode_execution(data: bytes, source: str = "<bytes>") -> Execution:
    """Parses and verifies one record; raises CorruptRecordError naming `source`."""

    def bad(reason: str) -> CorruptRecordError:
        return CorruptRecordError(f"corrupt execution record {source}: {reason}")

    if len(data) < len(MAGIC) + 8 + _DIGEST_BYTES:
        raise bad(f"truncated ({len(data)} bytes)")
    if data[: len(MAGIC)] != MAGIC:
        raise bad("bad magic")
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise bad("checksum mismatch (truncated or modified)")
    (header_len,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    if start + header_len > len(body):
        raise bad("header overruns the file")
    try:
        header = json.loads(body[start : start + header_len].decode("utf-8", "surrogatepass"))
    except ValueError as e:
        raise bad(f"unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not an object")
    if header.get("format") != 1:
        raise bad(f"unknown format {header.get('format')!r}")
    try:
        check_header(header)
    except ValueError as e:
        raise bad(f"invalid field {e}") from None
    metas = header["calls"]
    n_suffix = sum(m["prompt_len"] - m["shared"] for m in metas)
    n_out = sum(m["output_len"] for m in metas)
    payload = memoryview(body)[start + header_len :]
    if len(payload) != 4 * (n_suffix + 3 * n_out):
        raise bad(f"payload has {len(payload)} bytes, header implies {4 * (n_suffix + 3 * n_out)}")
    suffix_all = np.frombuffer(payload, "<i4", n_suffix, 0)
    out_all = np.frombuffer(payload, "<i4", n_out, 4 * n_suffix)
    lp_all = np.frombuffer(payload, "<f4", n_out, 4 * (n_suffix + n_out))
    ver_all = np.frombuffer(payload, "<i4", n_out, 4 * (n_suffix + 2 * n_out))
    calls: list[ModelCall] = []
    s_pos = o_pos = 0
    try:
        for i, m in enumerate(metas):
            ref, shared = m["ref"], m["shared"]
            suffix = suffix_all[s_pos : s_pos + m["prompt_len"] - shared]
            s_pos += len(suffix)
            if ref >= 0:
                if not 0 <= ref < i:
                    raise bad(f"call {i} references call {ref}")
                r = calls[ref]
                pieces = [r.prompt_ids[:shared], r.output_ids[: max(0, shared - len(r.prompt_ids))]]
                prompt = np.concatenate([*pieces, suffix])
            else:
                prompt = suffix.copy()
            if len(prompt) != m["prompt_len"]:
                raise bad(f"call {i} prompt reconstructs to {len(prompt)} tokens")
            prompt.flags.writeable = False
            o = slice(o_pos, o_pos + m["output_len"])
            o_pos += m["output_len"]
            calls.append(
                ModelCall(
                    execution_id=header["execution_id"],
                    call_id=m["call_id"],
                    agent_id=m["agent_id"],
                    role=m["role"],
                    prompt_ids=prompt,
                    output_ids=out_all[o],
                    logprobs=lp_all[o],
                    versions=ver_all[o],
                    finish_reason=m["finish_reason"],
                    engines=tuple(m["engines"]),
                    started_at=m["started_at"],
                    finished_at=m["finished_at"],
                    **{n: m.get(n, d) for n, d in SAMPLING_DEFAULTS.items()},
                )
            )
        execution = Execution(
            execution_id=header["execution_id"],
            task_id=header["task_id"],
            group_id=header["group_id"],
            calls=calls,
            status=header["status"],
            reward=header["reward"],
            eval_attempts=header["eval_attempts"],
            error=header.get("error", ""),
        )
        validate_record(execution)  # roles, array lengths, finite logprobs, unique call ids
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CorruptRecordError):
            raise
        raise bad(f"invalid record ({e})") from None
    return execution


def read_header(path: Path) -> dict:
    """The JSON header of a record file, without reading or verifying its arrays.

    For indexing only: `decode_execution` verifies the whole record before use.
    """
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise CorruptRecordError(f"corrupt execution record {path}: bad magic")
        (header_len,) = struct.unpack_from("<Q", head, len(MAGIC))
        raw = f.read(min(header_len, 1 << 30))
    if len(raw) != header_len:
        raise CorruptRecordError(f"corrupt execution record {path}: truncated header")
    try:
        header = json.loads(raw.decode("utf-8", "surrogatepass"))
    except ValueError as e:
        raise CorruptRecordError(f"corrupt execution record {path}: unreadable header") from e
    if not isinstance(header, dict):
        raise CorruptRecordError(f"corrupt execution record {path}: header is not an object")
    return header


class ExecutionStore:
    """A directory of execution records (see module docstring).

    `len(store)` and `id in store` look at record files only; a record is read and
    verified by `get` (which raises CorruptRecordError for a bad one) and by iteration
    and group lookups (which skip it, see the module docstring; `bad_records` lists
    the bad records met so far).
    """

    def __init__(self, root_dir: str | os.PathLike) -> None:
        self.root = Path(root_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        # group id -> record files, from headers only; refreshed from the directory
        # listing on each lookup, so records written by other processes show up.
        self._group_of_path: dict[Path, str] = {}
        # Bad records seen: path -> ((size, mtime) when found bad, why). A record
        # rewritten since (another size or time) is read again.
        self._bad: dict[Path, tuple[tuple[int, int], str]] = {}

    @property
    def bad_records(self) -> dict[str, str]:
        """Record file -> why it was skipped, for every bad record this object has met."""
        return {str(path): why for path, (_, why) in self._bad.items()}

    def _skip(self, path: Path, error: Exception) -> str:
        """Notes a bad record: a warning the first time this object meets it; returns
        the reason, naming the file."""
        why = str(error) if str(path) in str(error) else f"{path}: {error}"
        try:
            stat = path.stat()
            key = (stat.st_size, stat.st_mtime_ns)
        except OSError:
            key = (-1, -1)
        if self._bad.get(path, (None,))[0] != key:
            logger.warning("skipping %s", why)
        self._bad[path] = (key, why)
        return why

    def path_for(self, execution_id: str) -> Path:
        """The record file of an execution id."""
        if not isinstance(execution_id, str):
            raise TypeError(f"execution ids are strings, got {execution_id!r}")
        return self.root / (escape_id(execution_id) + SUFFIX)

    def _record_files(self) -> list[Path]:
        # scandir's is_file() needs no stat call per entry; sort by name, not Path.
        with os.scandir(self.root) as entries:
            names = sorted(
                e.name
                for e in entries
                if e.name.endswith(SUFFIX) and not e.name.startswith(".") and e.is_file()
            )
        return [self.root / name for name in names]

    def put(self, execution: Execution, *, overwrite: bool = False) -> Path:
        """Writes one execution atomically and durably.

        Raises:
          FileExistsError if the id is already stored and overwrite is False.
          ValueError naming the field and value if the execution is malformed (see
          `records.validate_record`): nothing is written.
        """
        validate_record(execution)
        path = self.path_for(execution.execution_id)
        if not overwrite and path.exists():
            raise FileExistsError(f"execution {execution.execution_id!r} already stored at {path}")
        data = encode_execution(execution)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".partial", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # atomic "create if absent"
                except FileExistsError:
                    raise FileExistsError(
                        f"execution {execution.execution_id!r} already stored at {path}"
                    ) from None
                os.unlink(tmp)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return path

    def remove_stale_temp_files(self, older_than_s: float = 3600.0) -> int:
        """Deletes temp files of interrupted writes older than `older_than_s`; returns count.

        Readers ignore them anyway; this only reclaims space. Run it when no writer
        could still be working on a file that old.
        """
        now = time.time()
        removed = 0
        for p in self.root.glob(".tmp-*"):
            try:
                if now - p.stat().st_mtime >= older_than_s:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def _load(self, path: Path) -> Execution:
        execution = decode_execution(path.read_bytes(), str(path))
        if self.path_for(execution.execution_id) != path:
            raise CorruptRecordError(
                f"corrupt execution record {path}: holds id {execution.execution_id!r}"
            )
        return execution

    def get(self, execution_id: str) -> Execution:
        """Loads one execution.

        Raises:
          KeyError if it is not stored; CorruptRecordError (after a logged warning) if
          its record fails verification.
        """
        path = self.path_for(execution_id)
        if not path.is_file():
            raise KeyError(execution_id)
        try:
            execution = self._load(path)
        except CorruptRecordError as e:
            self._skip(path, e)
            raise
        if execution.execution_id != execution_id:
            raise CorruptRecordError(f"corrupt execution record {path}: id mismatch")
        return execution

    def __iter__(self) -> Iterator[Execution]:
        """Valid executions in file-name order; bad records are skipped (see the module
        docstring)."""
        for path in self._record_files():
            execution = self._load_or_skip(path)
            if execution is not None:
                yield execution

    def _load_or_skip(self, path: Path, skipped: list[str] | None = None) -> Execution | None:
        """The record at `path`, or None for a bad one (noted; its reason appended to
        `skipped`)."""
        try:
            return self._load(path)
        except (CorruptRecordError, OSError) as e:  # OSError: e.g. removed meanwhile
            why = self._skip(path, e)
            if skipped is not None:
                skipped.append(why)
            return None

    def __len__(self) -> int:
        return len(self._record_files())

    def __contains__(self, execution_id: object) -> bool:
        return isinstance(execution_id, str) and self.path_for(execution_id).is_file()

    def _refresh_group_index(self) -> None:
        """Reads the header (not the arrays) of every record not indexed yet."""
        files = self._record_files()
        present = set(files)
        for path in [p for p in self._group_of_path if p not in present]:
            del self._group_of_path[path]
        for path in files:
            if path not in self._group_of_path:
                try:
                    group_id = read_header(path).get("group_id")
                    if not isinstance(group_id, str):  # sorting ids would fail on it
                        raise CorruptRecordError(
                            f"invalid execution record {path}: group_id={group_id!r}: "
                            "expected a string"
                        )
                    self._group_of_path[path] = group_id
                except (CorruptRecordError, OSError) as e:
                    self._skip(path, e)

    def group(self, group_id: str) -> list[Execution]:
        """All valid executions of one group, in file-name order.

        Only that group's records are read in full (and verified).
        """
        return self.groups([group_id])[group_id]

    def groups(
        self, group_ids: list[str], *, skipped: list[str] | None = None
    ) -> dict[str, list[Execution]]:
        """The valid executions of several groups (one directory scan for all).

        Args:
          group_ids: the groups wanted.
          skipped: if given, gets one entry (naming the file and why) per bad record of
            these groups that was skipped, so a caller can count them per step.
        """
        self._refresh_group_index()
        wanted = set(group_ids)
        paths: dict[str, list[Path]] = {g: [] for g in group_ids}
        for path, group in self._group_of_path.items():
            if group in wanted:
                paths[group].append(path)
        out = {}
        for group, group_paths in paths.items():
            loaded = (self._load_or_skip(p, skipped) for p in sorted(group_paths))
            out[group] = [e for e in loaded if e is not None]
        return out

    def group_ids(self) -> list[str]:
        """Sorted distinct group ids of the stored records (read from headers only)."""
        self._refresh_group_index()
        return sorted(set(self._group_of_path.values()))
