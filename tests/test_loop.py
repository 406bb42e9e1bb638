"""`launch` trains on a stored set of executions (SFT, then RL), checkpoints, resumes;
a resume after a kill writes each step once and trains around bad records."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT, check_tensorboard_holds, load_config_file, read_jsonl
from test_trajectory_store import rewrite_header, set_field

from gyrejax.cells import split_into_cells
from gyrejax.config import ConfigError, from_dict
from gyrejax.model.hf_io import load_hf
from gyrejax.model.transformer import init_model
from gyrejax.train.loop import train_on_store
from gyrejax.trajectory import ExecutionStore, generate_executions
from gyrejax.writers import Writers


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


def test_resume_drops_redone_rows_leaves_bad_records_out_and_completes_the_export(
    tmp_path, bpe_tokenizer
):
    """A kill after step 3's metrics row but before its checkpoint (and mid-way through
    the next row and through step 2's export): the resumed run writes each step once,
    to metrics.jsonl and to TensorBoard (issue 41: one point per step, the resumed
    run's), re-exports step 2, and trains around two bad records, counting them per
    step. A resume under another `model.tokenizer` is refused before any step."""
    store = ExecutionStore(tmp_path / "store")
    executions = generate_executions(
        3, 2, seed=0, turns=(3, 6), vocab_size=264, system_prompt_tokens=20, task_tokens=(5, 10),
        tool_output_tokens=(5, 20), model_output_tokens=(5, 20), summary_tokens=(5, 10),
        compaction_budget=180, max_call_tokens=256,
    )  # fmt: skip
    # g1's first execution holds a token beyond the model's vocabulary: a valid record
    # that the trajectory processor refuses for this config.
    beyond = executions[2]
    first, *rest = beyond.calls
    first = dataclasses.replace(first, output_ids=np.full_like(first.output_ids, 300))
    executions[2] = dataclasses.replace(beyond, calls=[first, *rest])
    for ex in executions:
        store.put(ex)
    # g0's first execution: a valid checksum over a bad field, skipped by the store.
    rewrite_header(store.path_for(executions[0].execution_id), set_field("reward", "abc"))

    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4  # two cells: fewer compilations
    c.train.executions_dir = str(tmp_path / "store")
    c.train.steps, c.checkpoint.every_steps, c.rl.groups_per_step = 2, 1, 2
    c.rl.loss = "sft"
    c.logging.writers = ("jsonl", "tensorboard")
    work = tmp_path / "work"
    config = from_dict(c)
    cells = split_into_cells(config.cells)
    train_on_store(config, cells, init_model(config.model), work)
    check_tensorboard_holds(work, "metrics", ("loss", "tokens", "bad_records"))

    metrics = work / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "groups": "from the killed run"}\n{"step": 4, "lo')
    with Writers(config, work, resumed_at=2) as killed_runs:  # and its points
        for step in (3, 4):
            killed_runs.write("metrics", {"step": step, "loss": 1e3, "tokens": 0}, step)
    (work / "hf" / "step_2" / "config.json").unlink()
    c.train.steps = 3
    config = from_dict(c)
    train_on_store(config, cells, init_model(config.model), work)

    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("groups" not in r for r in rows)  # the killed run's step 3 row is gone
    check_tensorboard_holds(work, "metrics", ("loss", "tokens", "bad_records"))
    # Groups cycle g0 g1 | g2 g0 | g1 g2: g0 holds the store's bad record, g1 the refused one.
    assert [r["bad_records"] for r in rows] == [2, 1, 1]
    assert load_hf(work / "hf" / "step_2").config.num_layers == 1
    assert load_hf(work / "hf" / "step_3").config.num_layers == 1
    assert not (work / "hf" / "step_3" / "tokenizer.json").exists()  # bytes: no files

    # The checkpoints were trained with the byte tokenizer: its ids mean bytes.
    c.train.steps, c.model.tokenizer = 4, str(bpe_tokenizer)
    config = from_dict(c)
    want = f"config.model.tokenizer={bpe_tokenizer}: checkpoint {work / 'checkpoints' / '3'} "
    with pytest.raises(ConfigError, match=re.escape(want)):
        train_on_store(config, cells, init_model(config.model), work)
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3]  # nothing trained
