"""`launch` trains on a stored set of executions (SFT, then RL), checkpoints, resumes."""

import json
import os
import subprocess
import sys

import numpy as np
from conftest import REPO_ROOT

from gyrejax.model.hf_io import load_hf
from gyrejax.trajectory import ExecutionStore, generate_executions


def launch(workdir, *overrides):
    return subprocess.run(
        [
            sys.executable, "-m", "gyrejax.launch", "--config", "configs/tiny_cpu.py:smoke",
            "--workdir", str(workdir),
            "--config.checkpoint.every_steps=1", "--config.rl.groups_per_step=2", *overrides,
        ],
        cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


def test_sft_then_rl_steps_on_a_store_with_checkpoints_and_resume(tmp_path):
    store = ExecutionStore(tmp_path / "store")
    executions = generate_executions(
        3, 2, seed=0, turns=(3, 6), vocab_size=264, system_prompt_tokens=20, task_tokens=(5, 10),
        tool_output_tokens=(5, 20), model_output_tokens=(5, 20), summary_tokens=(5, 10),
        compaction_budget=180, max_call_tokens=256,
    )  # fmt: skip
    for ex in executions:
        store.put(ex)
    work = tmp_path / "work"
    data = f"--config.train.executions_dir={tmp_path / 'store'}"

    sft = launch(work, data, "--config.train.steps=2", "--config.rl.loss=sft")
    assert sft.returncode == 0, sft.stderr[-3000:]
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["objective"] == "sft" and r["loss"] > 0 and not r["skipped"] for r in records)
    assert all(r["cells"][0] == 0 and set(r["cells"]) <= {0, 1, 2, 3} for r in records)
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == [
        "1",
        "2",
    ]
    exported = load_hf(work / "hf" / "step_2")
    assert exported.config.num_layers == 1

    rl = launch(work, data, "--config.train.steps=3", "--config.rl.loss=ppo")
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert "resumed from checkpoint step 2 (data position 4)" in rl.stderr
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["objective"] == "ppo" and records[-1]["version"] == 3
    assert records[-1]["data_position"] == 6
    assert np.isfinite(records[-1]["loss"])

    again = launch(work, data, "--config.train.steps=3", "--config.rl.loss=ppo")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((work / "metrics.jsonl").read_text().splitlines()) == 3  # nothing left to do


def test_missing_store_is_one_clear_line(tmp_path):
    result = launch(tmp_path / "w", f"--config.train.executions_dir={tmp_path / 'nope'}")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last == f"gyrejax.launch: config.train.executions_dir={tmp_path / 'nope'}: not a directory"
    )
