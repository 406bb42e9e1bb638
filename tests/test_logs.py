"""JSON-lines logs: a torn last line is tolerated and cut away before appending again,
rows of steps a resumed run redoes are dropped, and a rewrite is atomic."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

from gyrejax.logs import append_jsonl, prepare_for_append, read_jsonl, up_to_step


def write(path, text):
    path.write_bytes(text.encode())


def test_read_tolerates_a_torn_last_line_and_names_it(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    write(log, '{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="gyrejax.logs"):
        assert read_jsonl(log) == [{"step": 1}, {"step": 2}]
    assert f"{log} line 3" in caplog.text
    assert log.read_text().endswith('"lo')  # reading never modifies the log
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_appending_after_a_torn_line_starts_on_a_fresh_line(tmp_path, caplog):
    log = tmp_path / "dispatch.jsonl"
    write(log, '{"group": "g0", "seq": 0}\n{"group": "g1", "se')
    with caplog.at_level(logging.WARNING, logger="gyrejax.logs"):
        kept = prepare_for_append(log)
    assert kept == [{"group": "g0", "seq": 0}]
    assert "torn last line" in caplog.text and str(log) in caplog.text
    append_jsonl(log, {"group": "g1", "seq": 1})
    assert read_jsonl(log) == [{"group": "g0", "seq": 0}, {"group": "g1", "seq": 1}]
    assert log.read_text().count("\n") == 2


def test_a_complete_last_record_that_lost_its_newline_is_kept(tmp_path):
    log = tmp_path / "transitions.jsonl"
    write(log, '{"kind": "publish"}\n{"kind": "to_training"}')
    assert prepare_for_append(log) == [{"kind": "publish"}, {"kind": "to_training"}]
    assert log.read_text() == '{"kind": "publish"}\n{"kind": "to_training"}\n'


def test_rows_past_the_restored_step_are_dropped_and_others_kept(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    write(log, '{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n{"note": "x"}\n{"step": 4, ')
    with caplog.at_level(logging.WARNING, logger="gyrejax.logs"):
        kept = prepare_for_append(log, keep=up_to_step(2))
    assert kept == [{"step": 1}, {"step": 2}, {"note": "x"}]
    # A damaged line in the middle is named and left alone (not the resumed run's to drop).
    assert f"{log} line 3" in caplog.text
    assert log.read_text() == '{"step": 1}\n{"step": 2}\nnot json\n{"note": "x"}\n'
    append_jsonl(log, {"step": 3})
    assert [r.get("step") for r in read_jsonl(log)] == [1, 2, None, 3]
    assert not [p for p in tmp_path.iterdir() if p.name != log.name]  # no temp file left


def test_an_intact_log_is_not_rewritten(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write(log, '{"step": 1}\n')
    before = os.stat(log).st_ino, os.stat(log).st_mtime_ns
    assert prepare_for_append(log, keep=up_to_step(5)) == [{"step": 1}]
    assert (os.stat(log).st_ino, os.stat(log).st_mtime_ns) == before
    assert prepare_for_append(tmp_path / "missing.jsonl") == []


APPENDER = """
import sys
from gyrejax.logs import append_jsonl
i = 0
while True:
    append_jsonl(sys.argv[1], {"step": i, "pad": "x" * 5000})
    i += 1
"""


def test_a_log_killed_mid_append_is_readable_and_appendable(tmp_path):
    log = tmp_path / "metrics.jsonl"
    for _ in range(3):
        writer = subprocess.Popen([sys.executable, "-c", APPENDER, str(log)])
        while not log.exists() or log.stat().st_size < 200_000:
            time.sleep(0.005)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        kept = prepare_for_append(log)
        append_jsonl(log, {"step": "marker"})
        rows = read_jsonl(log)
        assert rows[: len(kept)] == kept and rows[-1] == {"step": "marker"}
        assert all(json.loads(line) for line in log.read_text().splitlines())
