"""Warm start (demonstrations + SFT) and a rollout batch through JAX engines on cells."""

import json

from conftest import load_config_file

from gyrejax.cells import split_into_cells
from gyrejax.config import from_dict
from gyrejax.model.transformer import init_model
from gyrejax.stages import rollout_batch, warm_start
from gyrejax.trajectory import ExecutionStore


def tiny(**overrides):
    c = load_config_file("tiny_cpu", "smoke")
    c.warmup.steps = 3
    c.warmup.demonstrations = 24
    c.warmup.groups_per_step = 8
    c.rl.groups_per_step = 2
    c.rl.group_size = 2
    for key, value in overrides.items():
        section, field = key.split(".")
        c[section][field] = value
    return from_dict(c)


def test_warm_start_then_a_rollout_batch_stored(tmp_path):
    config = tiny()
    cells = split_into_cells(config.cells)
    model = warm_start(config, cells, init_model(config.model), tmp_path)
    demonstrations = ExecutionStore(tmp_path / "demonstrations")
    assert len(demonstrations) == 24
    assert all(e.reward is not None for e in demonstrations)
    steps = [
        json.loads(line)
        for line in (tmp_path / "warmup" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in steps] == [1, 2, 3] and {s["objective"] for s in steps} == {"sft"}
    assert steps[-1]["loss"] < steps[0]["loss"]

    # Running the stage again resumes: nothing is recorded or trained twice.
    warm_start(config, cells, init_model(config.model), tmp_path)
    assert len(demonstrations) == 24
    assert len((tmp_path / "warmup" / "metrics.jsonl").read_text().splitlines()) == 3

    summary = rollout_batch(config, cells, model, tmp_path)
    stored = list(ExecutionStore(tmp_path / "executions"))
    assert summary["executions"] == len(stored) == 4
    assert {e.group_id for e in stored} == {"batch0-g0", "batch0-g1"}
    assert set(summary["statuses"]) <= {"finished", "timed_out", "no_artifact"}
    for execution in stored:
        assert execution.calls and all(c.engines for c in execution.calls)
        assert {c.engines[0] for c in execution.calls} <= {"cell0", "cell1", "cell2", "cell3"}
    assert json.loads((tmp_path / "rollout_summary.json").read_text()) == summary


def test_a_warm_start_before_rl_with_external_engines(tmp_path):
    """The RL loop's external engines are no concern of the warm start's SFT (which used
    to refuse them as a stored-set run, so no such run could start)."""
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4
    c.warmup.steps, c.warmup.demonstrations, c.warmup.groups_per_step = 1, 8, 8
    c.rollout.engine_servers = ("http://127.0.0.1:1",)  # never reached by the warm start
    config = from_dict(c)
    warm_start(config, split_into_cells(config.cells), init_model(config.model), tmp_path)
    steps = [json.loads(line) for line in (tmp_path / "warmup" / "metrics.jsonl").open()]
    assert [s["step"] for s in steps] == [1]
