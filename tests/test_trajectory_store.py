"""ExecutionStore: round trips, corruption detection, and crash safety under SIGKILL."""

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gyrejax.trajectory import Execution, ExecutionStore, ModelCall, generate_executions
from gyrejax.trajectory.store import CorruptRecordError


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
