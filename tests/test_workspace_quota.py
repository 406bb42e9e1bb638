"""Workspace quotas (gyrejax/harness/workspace_quota.py): bytes and inodes that agent code
cannot get around, where the run is root (a tmpfs per workspace).

The audit's cases (issue 40, item 6): one check filled a 64 MiB workspace disk in
0.13 s; 52,108 files made every later tool call slow.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from test_agent import two_file_task
from test_external_agent import replay_engine, run_group, write

from gyrejax.harness.sandbox import Limits, choose_sandbox, run_python
from gyrejax.harness.workspace_quota import (
    WorkspaceQuota,
    _mount_tmpfs,
    _mounts_under,
    mount_problem,
    quota_summary,
)

pytestmark = pytest.mark.skipif(mount_problem() is not None, reason=str(mount_problem()))

FILL = """
import json, os
written, made = 0, 0
try:
    with open("big", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
except OSError as e:
    big = e.errno
try:
    for i in range(100_000):
        open(f"f{i}", "w").close()
        made += 1
except OSError as e:
    many = e.errno
print(json.dumps({"written": written, "big": big, "made": made, "many": many}))
"""


def test_agent_code_fills_only_its_own_workspace_and_the_files_are_kept(tmp_path):
    quota = WorkspaceQuota(tmp_path, size_bytes=4 << 20, inodes=256)
    root = tmp_path / "w"
    quota.open(root)
    try:
        (root / "mine.txt").write_text("the agent's file")
        limits = Limits(file_size_bytes=256 << 20, memory_bytes=1 << 30, wall_s=20)
        result = run_python(FILL, root, limits, sandbox=choose_sandbox("auto"))
    finally:
        asyncio.run(quota.close(root))
    assert result.ok, result.summary()
    seen = json.loads(result.stdout)
    assert seen["big"] == seen["many"] == 28  # ENOSPC, in its workspace only
    assert seen["written"] < 4 << 20 and seen["made"] < 256
    assert _mounts_under(tmp_path) == []  # unmounted, its files on disk where they were
    assert (root / "mine.txt").read_text() == "the agent's file"
    assert len(os.listdir(root)) == seen["made"] + 2  # with "big"


def test_an_external_agent_is_held_to_the_quota(tmp_path):
    agent = write(tmp_path, "fill.py", FILL)
    (execution,) = run_group(
        tmp_path, replay_engine(None), [sys.executable, agent], [two_file_task()[0]],
        workspace_bytes=2 << 20, workspace_inodes=128,
    )  # fmt: skip
    assert execution.status == "finished", execution.error
    (report,) = (tmp_path / "workspaces").glob("*.out")  # its stdout, beside the workspace
    seen = json.loads(report.read_text())
    assert seen["big"] == seen["many"] == 28 and seen["made"] < 128
    assert _mounts_under(tmp_path) == []


def test_mounts_a_killed_run_left_are_cleared_by_the_next(tmp_path):
    stale = tmp_path / "workspaces" / "g_0"
    stale.mkdir(parents=True)
    _mount_tmpfs(stale, 1 << 20, 16)  # as a run killed mid-execution leaves it
    assert _mounts_under(tmp_path) == [stale]
    WorkspaceQuota(tmp_path / "workspaces", 1 << 20, 16)
    assert _mounts_under(tmp_path) == []


def test_the_run_summary_says_the_quota_is_enforced():
    assert quota_summary(1 << 20, 16) == {
        "bytes": 1 << 20,
        "inodes": 16,
        "enforced": True,
        "by": "a tmpfs per workspace (size, nr_inodes)",
    }
