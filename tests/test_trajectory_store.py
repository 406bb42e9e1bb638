"""ExecutionStore: round trips, corruption detection, crash safety under SIGKILL, and
validation of every field on put and on read."""

import asyncio
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyrejax.loop.groups import store_until_stored
from gyrejax.trajectory import Execution, ExecutionStore, ModelCall, generate_executions
from gyrejax.trajectory.records import validate_record
from gyrejax.trajectory.store import MAGIC, CorruptRecordError


def small(seed=0, groups=2, size=3):
    return generate_executions(
        groups, size, seed=seed, turns=(5, 25), retry_prob=0.3, sub_agent_prob=0.2,
        sub_agent_turns=(1, 4), timeout_prob=0.3, no_artifact_prob=0.2,
    )  # fmt: skip


def assert_identical(a: Execution, b: Execution):
    assert a == b
    for ca, cb in zip(a.calls, b.calls, strict=True):
        for name in ("prompt_ids", "output_ids", "logprobs", "versions"):
            x, y = getattr(ca, name), getattr(cb, name)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()


def test_round_trip_reopen(tmp_path):
    exs = small()
    store = ExecutionStore(tmp_path / "s")
    for ex in exs:
        store.put(ex)
    reopened = ExecutionStore(tmp_path / "s")
    assert len(reopened) == len(exs)
    for ex in exs:
        assert ex.execution_id in reopened
        assert_identical(reopened.get(ex.execution_id), ex)
    assert sorted(e.execution_id for e in reopened) == sorted(e.execution_id for e in exs)
    assert reopened.group_ids() == sorted({e.group_id for e in exs})
    g = exs[0].group_id
    assert sorted(e.execution_id for e in reopened.group(g)) == sorted(
        e.execution_id for e in exs if e.group_id == g
    )
    # Delta-coded prompts: the file is far smaller than the naive token count.
    naive_bytes = 4 * sum(c.length for e in exs for c in e.calls)
    disk = sum(p.stat().st_size for p in (tmp_path / "s").iterdir())
    assert disk < naive_bytes / 3


def test_sampling_settings_round_trip_and_older_records_read_as_temperature_one(tmp_path):
    grid = [(0.6, 0.95, 20), (0.0, 1.0, 0), (1.3, 1.0, 5)]
    (ex,) = small(groups=1, size=1)
    calls = [
        dataclasses.replace(c, temperature=t, top_p=p, top_k=k)
        for c, (t, p, k) in zip(ex.calls, itertools.cycle(grid))
    ]
    ex = dataclasses.replace(ex, calls=calls)
    store = ExecutionStore(tmp_path)
    store.put(ex)
    assert_identical(ExecutionStore(tmp_path).get(ex.execution_id), ex)
    path = store.path_for(ex.execution_id)
    for name in ("temperature", "top_p", "top_k"):  # a record written before they existed
        for i in range(len(calls)):
            rewrite_header(path, delete_field(f"calls.{i}.{name}"))
    old = ExecutionStore(tmp_path).get(ex.execution_id)
    assert {(c.temperature, c.top_p, c.top_k) for c in old.calls} == {(1.0, 1.0, 0)}


@pytest.mark.parametrize(
    "ex_id", ["", ".", "..", "A", "a", "x/y\\z", "%41", "ü-ß 🚀", "\x00", "q" * 1000, "..gxr"]
)
def test_any_id_round_trips(tmp_path, ex_id):
    store = ExecutionStore(tmp_path)
    c = ModelCall(ex_id, 0, "main", "main", [1], [2, 3], [-0.5, -1.5], [4, 4], "length",
                  ("e0", "e1"), 1.5, 2.25)  # fmt: skip
    ex = Execution(ex_id, "t", "g", [c], "eval_failed", None, 3)
    store.put(ex)
    assert ex_id in store and len(store) == 1
    assert_identical(store.get(ex_id), ex)
    assert os.path.dirname(store.path_for(ex_id)) == str(tmp_path)


def test_case_distinct_ids_do_not_collide(tmp_path):
    store = ExecutionStore(tmp_path)
    for ex_id in ("A", "a", "%41"):
        store.put(Execution(ex_id, "t", "g", [], "no_artifact", None, 0))
    assert len(store) == 3
    assert len({p.name.lower() for p in tmp_path.iterdir()}) == 3


def test_existing_id_needs_overwrite(tmp_path):
    ex = small(groups=1, size=1)[0]
    store = ExecutionStore(tmp_path)
    store.put(ex)
    with pytest.raises(FileExistsError, match=ex.execution_id):
        store.put(ex)
    store.put(dataclasses.replace(ex, reward=0.125), overwrite=True)
    assert store.get(ex.execution_id).reward == 0.125
    with pytest.raises(KeyError):
        store.get("missing")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "header", "empty"])
def test_corrupt_record_is_reported_and_skipped(tmp_path, caplog, damage):
    exs = small(groups=1, size=3)
    store = ExecutionStore(tmp_path)
    for ex in exs:
        store.put(ex)
    victim = exs[1].execution_id
    path = store.path_for(victim)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bitflip":
        data[len(data) // 2] ^= 0x10
    elif damage == "header":
        data[20] ^= 0x01
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="gyrejax.trajectory.store"):
        loaded = list(store)
    assert sorted(e.execution_id for e in loaded) == sorted(
        e.execution_id for e in exs if e.execution_id != victim
    )
    assert any(str(path) in r.getMessage() for r in caplog.records)
    with pytest.raises(CorruptRecordError, match=str(path.name)):
        store.get(victim)


def test_temp_files_are_ignored(tmp_path):
    ex = small(groups=1, size=1)[0]
    store = ExecutionStore(tmp_path)
    store.put(ex)
    (tmp_path / ".tmp-abc.partial").write_bytes(b"GXEXEC01 half a record")
    (tmp_path / ".tmp-def.gxr").write_bytes(b"")
    assert len(store) == 1
    assert [e.execution_id for e in store] == [ex.execution_id]
    assert store.remove_stale_temp_files(older_than_s=3600) == 0
    assert store.remove_stale_temp_files(older_than_s=0) == 2
    assert [p.name for p in tmp_path.iterdir()] == [store.path_for(ex.execution_id).name]


WRITER = """
import dataclasses, sys
import gyrejax.trajectory as t
exs = t.generate_executions(3, 3, seed=1, turns=(40, 80), retry_prob=0.2)
store = t.ExecutionStore(sys.argv[1])
i = 0
while True:
    ex = exs[i % len(exs)]
    v = i // len(exs)
    store.put(dataclasses.replace(ex, reward=float(v), eval_attempts=v), overwrite=True)
    print(i, flush=True)
    i += 1
"""


def test_sigkilled_writer_leaves_only_valid_records(tmp_path):
    exs = generate_executions(3, 3, seed=1, turns=(40, 80), retry_prob=0.2)
    expected = {e.execution_id: e for e in exs}
    root = tmp_path / "store"
    rng = np.random.default_rng(0)
    for attempt in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True
        )
        try:
            for _ in range(int(rng.integers(1, 12))):  # wait until some writes are done
                assert proc.stdout.readline(), "writer died"
            time.sleep(float(rng.uniform(0, 0.02)))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        store = ExecutionStore(root)
        loaded = list(store)
        assert len(loaded) == len(store), f"attempt {attempt}: a record failed its checksum"
        assert loaded
        for ex in loaded:
            v = int(ex.reward)
            want = dataclasses.replace(expected[ex.execution_id], reward=float(v), eval_attempts=v)
            assert_identical(ex, want)


def test_group_lookup_sees_other_writers_and_skips_corrupt_records(tmp_path, caplog):
    exs = small(groups=2, size=3)
    reader = ExecutionStore(tmp_path)
    writer = ExecutionStore(tmp_path)
    g0, g1 = exs[0].group_id, exs[-1].group_id
    for ex in exs[:3]:
        writer.put(ex)
    assert [e.execution_id for e in reader.group(g0)] == sorted(e.execution_id for e in exs[:3])
    assert reader.group(g1) == []
    for ex in exs[3:]:  # written after the reader indexed the directory
        writer.put(ex)
    assert reader.group_ids() == sorted({g0, g1})
    assert len(reader.group(g1)) == 3
    victim = writer.path_for(exs[4].execution_id)
    data = bytearray(victim.read_bytes())
    data[-40] ^= 0xFF  # flip a payload byte: the header still reads, the checksum fails
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        survivors = reader.group(g1)
    assert sorted(e.execution_id for e in survivors) == sorted(
        e.execution_id for e in exs[3:] if e is not exs[4]
    )
    assert str(victim) in caplog.text


# --- validation: on put, and on read of records whose checksum is valid ------------------


def tampered(obj, **fields):
    """A copy of a frozen record with `fields` set as given, past its constructor's
    coercion (what other code could hand to `put`)."""
    copy = dataclasses.replace(obj)
    for name, value in fields.items():
        object.__setattr__(copy, name, value)
    return copy


@pytest.mark.parametrize(
    ("fields", "call_fields", "message"),
    [
        ({"reward": "abc"}, {}, "reward='abc'"),
        ({"reward": float("nan")}, {}, "reward=nan"),
        ({"reward": float("inf")}, {}, "reward=inf"),
        ({"status": "weird"}, {}, "status='weird'"),
        ({"group_id": 5}, {}, "group_id=5"),
        ({"task_id": None}, {}, "task_id=None"),
        ({"eval_attempts": -1}, {}, "eval_attempts=-1"),
        ({}, {"call_id": "x"}, "call_id='x'"),
        ({}, {"agent_id": 3}, "agent_id=3"),
        ({}, {"engines": "cell0"}, "engines='cell0'"),
        ({}, {"started_at": float("nan")}, "started_at=nan"),
        ({}, {"role": "nope"}, "unknown role 'nope'"),
    ],
)
def test_put_refuses_a_bad_field_naming_it_and_its_value(tmp_path, fields, call_fields, message):
    ex = small(groups=1, size=1)[0]
    if call_fields:
        ex = tampered(ex, calls=(tampered(ex.calls[0], **call_fields), *ex.calls[1:]))
    ex = tampered(ex, **fields)
    store = ExecutionStore(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        store.put(ex)
    assert not list(tmp_path.iterdir())  # nothing written, not even a temp file


def test_put_refuses_a_non_string_execution_id(tmp_path):
    ex = tampered(small(groups=1, size=1)[0], execution_id=12)
    with pytest.raises(ValueError, match="execution_id=12"):
        ExecutionStore(tmp_path).put(ex)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"reward": "abc"}, "reward='abc'"), ({"eval_attempts": "3"}, "eval_attempts='3'")],
)
def test_records_refuse_strings_for_numbers(kwargs, message):
    ex = small(groups=1, size=1)[0]
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(ex, **kwargs)
    with pytest.raises(ValueError, match=re.escape("call_id='x'")):
        dataclasses.replace(ex.calls[0], call_id="x")


def rewrite_header(path, mutate):
    """Rewrites a record file with `mutate(header)` applied and a valid checksum: a record
    that passes the integrity check but holds whatever `mutate` put there."""
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    header = json.loads(data[start : start + header_len])
    mutate(header)
    new_header = json.dumps(header).encode()
    body = MAGIC + struct.pack("<Q", len(new_header)) + new_header
    body += data[start + header_len : -32]
    path.write_bytes(body + hashlib.sha256(body).digest())


def set_field(path, value):
    """mutate(header) setting the field at `path` ("reward", "calls.0.call_id")."""

    def mutate(header):
        *parents, last = path.split(".")
        node = header
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def delete_field(path):
    def mutate(header):
        *parents, last = path.split(".")
        node = header
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (set_field("reward", "abc"), "reward='abc'"),
        (set_field("reward", float("nan")), "reward=nan"),
        (set_field("execution_id", 12), "execution_id=12"),
        (set_field("group_id", 5), "group_id=5"),
        (set_field("status", "weird"), "status='weird'"),
        (set_field("eval_attempts", True), "eval_attempts=True"),
        (set_field("calls.0.call_id", "x"), "call_id='x'"),
        (set_field("calls.0.role", "nope"), "unknown role 'nope'"),
        (set_field("calls.0.engines", "cell0"), "engines='cell0'"),
        (set_field("calls.0.started_at", "yesterday"), "started_at='yesterday'"),
        (set_field("calls.0.prompt_len", 1.5), "prompt_len=1.5"),
        (set_field("calls", {"a": 1}), "calls={'a': 1}"),
        (delete_field("calls.0.agent_id"), "agent_id=None"),
        (set_field("calls.0.temperature", -0.5), "calls[0]: temperature=-0.5"),
        (set_field("calls.0.top_p", 0), "calls[0]: top_p=0"),
        (set_field("calls.0.top_k", 2.5), "calls[0].top_k=2.5"),
    ],
)
def test_a_record_with_bad_fields_is_skipped_named_and_counted(tmp_path, caplog, mutate, message):
    exs = small(groups=2, size=3)
    store = ExecutionStore(tmp_path)
    for ex in exs:
        store.put(ex)
    victim = exs[1]
    path = store.path_for(victim.execution_id)
    rewrite_header(path, mutate)
    others = sorted(e.execution_id for e in exs if e is not victim)

    reader = ExecutionStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="gyrejax.trajectory.store"):
        assert sorted(e.execution_id for e in reader) == others
        assert reader.group_ids() == sorted({e.group_id for e in exs})
        skipped = []
        groups = reader.groups(sorted({e.group_id for e in exs}), skipped=skipped)
        list(reader)  # met again: counted once, warned once
    got = sorted(e.execution_id for members in groups.values() for e in members)
    assert got == others
    if message != "group_id=5":  # a group id that is not a string leaves no group to ask for
        assert len(skipped) == 1 and str(path) in skipped[0] and message in skipped[0]
    assert list(reader.bad_records) == [str(path)]
    assert message in reader.bad_records[str(path)]
    warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warnings) == 1 and message in warnings[0], warnings
    with pytest.raises(CorruptRecordError, match=re.escape(message)):
        reader.get(victim.execution_id)


SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=5)
    | st.floats(allow_nan=True, allow_infinity=True)
)  # fmt: skip
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)
HEADER_FIELDS = ["execution_id", "task_id", "group_id", "status", "reward", "eval_attempts",
                 "calls", "format"]  # fmt: skip
CALL_FIELDS = ["call_id", "agent_id", "role", "finish_reason", "engines", "started_at",
               "finished_at", "prompt_len", "output_len", "ref", "shared", "temperature",
               "top_p", "top_k"]  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    field=st.sampled_from(HEADER_FIELDS + [f"calls.{{}}.{f}" for f in CALL_FIELDS]),
    call=st.integers(0, 100),
    value=JSON_VALUES,
    delete=st.booleans(),
)
def test_no_header_field_value_crashes_a_reader(tmp_path_factory, field, call, value, delete):
    """Whatever one header field holds (under a valid checksum), reading the store never
    raises: the record is either valid or skipped and counted, and the others are read."""
    root = tmp_path_factory.mktemp("store")
    exs = small(groups=2, size=2)
    store = ExecutionStore(root)
    for ex in exs:
        store.put(ex)
    victim = exs[0]
    path = store.path_for(victim.execution_id)
    field = field.format(call % len(victim.calls)) if "{}" in field else field
    rewrite_header(path, delete_field(field) if delete else set_field(field, value))

    reader = ExecutionStore(root)
    loaded = {e.execution_id: e for e in reader}
    ids = reader.group_ids()
    skipped = []
    grouped = reader.groups(ids, skipped=skipped)
    for ex in exs[1:]:
        assert ex.execution_id in loaded
    for ex in loaded.values():
        validate_record(ex)  # nothing invalid is ever handed out
    if victim.execution_id in loaded:
        assert not reader.bad_records
    else:
        assert list(reader.bad_records) == [str(path)]
    assert all(isinstance(g, str) for g in ids)
    assert sum(len(v) for v in grouped.values()) + len(skipped) <= len(exs)


def test_a_run_waits_out_a_full_disk_and_stores_every_execution(small_filesystem, caplog):
    # The run's own writes (loop/groups.py): a failed write is retried until the disk
    # has room, the record kept in memory meanwhile; nothing is lost or half-written.
    root, fill, free = small_filesystem
    store = ExecutionStore(root / "store")
    executions = generate_executions(1, 3, seed=4)
    executions = [dataclasses.replace(e, calls=e.calls[:2]) for e in executions]  # it fits
    fill()

    async def body():
        writes = [asyncio.create_task(store_until_stored(store, e, 0.05)) for e in executions]
        await asyncio.sleep(0.3)
        waiting = sum(not w.done() for w in writes)
        free()
        await asyncio.wait_for(asyncio.gather(*writes), 10)
        return waiting

    with caplog.at_level(logging.WARNING):
        waiting = asyncio.run(body())
    assert waiting == 3
    for execution in executions:
        assert store.get(execution.execution_id) == execution
    assert "No space left on device" in caplog.text and "stored at try" in caplog.text
    assert not [p for p in (root / "store").iterdir() if p.name.startswith(".tmp-")]
