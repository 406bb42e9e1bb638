"""Calibration of the simulator on run logs (gyrejax/scheduler/calibrate.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyrejax.scheduler import calibrate
from gyrejax.scheduler.simulator import HOUR, SimConfig, simulate

# A run whose parameters we know: cells sharing one host (as CPU-emulated devices do),
# engines that hold a request only while it generates, a fixed per-step overhead.
TRUTH = SimConfig(
    cells=4,
    capacity=16,
    group_size=4,
    groups_per_step=4,
    steps=60,
    mu=1,
    phi=1,
    max_staleness=3,
    duration_median_s=30.0,
    duration_sigma=0.4,
    timeout_s=120.0,
    tokens_mean=2000.0,
    tokens_sigma=0.0,
    train_s_per_token=4e-4,
    step_overhead_s=0.5,
    train_parallel=False,
    to_training_s=1.5,
    to_rollout_s=0.8,
    executions_hold_slots=False,
)


@pytest.mark.parametrize("policy", ["elastic", "async"])
def test_fit_recovers_known_parameters_from_a_simulated_log(tmp_path, policy):
    options = {"training_cells": 1} if policy == "async" else {}
    result = simulate(TRUTH, policy, **options)
    calibrate.write_run_logs(TRUTH, result, policy, tmp_path, startup_s=7.0)
    fit = calibrate.fit_run(tmp_path)
    got = fit.summary()
    for name in (
        "duration_median_s",
        "duration_sigma",
        "tokens_mean",
        "train_s_per_token",
        "step_overhead_s",
    ):
        assert got[name] == pytest.approx(getattr(TRUTH, name), rel=0.05), name
    assert got["train_parallel"] is False
    # async(1) trains on one cell throughout: the log cannot tell the two models apart.
    assert got["train_parallel_identified"] is (policy == "elastic")
    assert got["startup_s"] == pytest.approx(7.0)
    if policy == "elastic":  # async never switches after its first moves
        assert got["to_training_s"] == pytest.approx(TRUTH.to_training_s, rel=0.05)
        assert got["to_rollout_s"] == pytest.approx(TRUTH.to_rollout_s, rel=0.05)


def test_fit_tells_data_parallel_training_apart(tmp_path):
    truth = TRUTH.replace(train_parallel=True, steps=40)
    result = simulate(truth, "elastic")
    calibrate.write_run_logs(truth, result, "elastic", tmp_path)
    fit = calibrate.fit_run(tmp_path)
    assert fit.sim.train_parallel is True
    assert fit.sim.train_s_per_token == pytest.approx(truth.train_s_per_token, rel=0.05)


def test_predict_replays_the_calibration_run(tmp_path):
    # Predicting the very run that was fitted lands near its wall time; another policy's
    # schedule is simulated under the same model.
    result = simulate(TRUTH, "elastic")
    calibrate.write_run_logs(TRUTH, result, "elastic", tmp_path, startup_s=5.0)
    fit = calibrate.fit_run(tmp_path)
    run = calibrate.read_run(tmp_path)
    assert calibrate.predict(fit, run) == pytest.approx(run["wall_s"], rel=0.10)
    colocate = {**run, "schedule": {**run["schedule"], "policy": "colocate", "phi": 0}}
    assert calibrate.predict(fit, colocate) > calibrate.predict(fit, run)


def test_a_torn_log_line_is_skipped_and_missing_logs_are_named(tmp_path):
    result = simulate(TRUTH.replace(steps=8), "elastic")
    calibrate.write_run_logs(TRUTH.replace(steps=8), result, "elastic", tmp_path)
    with open(tmp_path / "executions.jsonl", "a") as f:
        f.write('{"execution": "g9/0", "started')  # a kill mid-write
    calibrate.fit_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"no executions\.jsonl or metrics\.jsonl"):
        calibrate.fit_run(tmp_path)
    assert json.loads((tmp_path / "run_summary.json").read_text())["schedule"]["cells"] == 4
    assert HOUR == 3600.0


LOAD_TRUTH = SimConfig(
    cells=4,
    capacity=16,
    group_size=4,
    groups_per_step=4,
    steps=12,
    max_staleness=3,
    duration_median_s=2.0,
    duration_sigma=0.5,
    timeout_s=120.0,
    tokens_mean=40.0,
    tokens_sigma=0.0,
    train_s_per_token=1e-3,
    step_overhead_s=0.5,
    train_parallel=False,
    executions_hold_slots=False,
    decode_cores=3.7,
    train_cores=2.0,
    turns=3,
    tool_median_s=1.0,
    tool_sigma=0.4,
    first_step_s=10.0,
)


def test_load_fit_recovers_known_parameters_from_a_simulated_log(tmp_path):
    result = simulate(LOAD_TRUTH, "elastic")
    calibrate.write_run_logs(LOAD_TRUTH, result, "elastic", tmp_path, startup_s=3.0)
    fit = calibrate.fit_run(tmp_path, load=True).sim
    assert fit.turns == LOAD_TRUTH.turns
    for name in ("decode_cores", "train_cores", "train_s_per_token", "step_overhead_s"):
        assert getattr(fit, name) == pytest.approx(getattr(LOAD_TRUTH, name), rel=0.05), name
    assert fit.first_step_s == pytest.approx(LOAD_TRUTH.first_step_s, rel=0.05)
    # Sampled quantities: within sampling error of a few hundred executions.
    assert fit.duration_median_s == pytest.approx(LOAD_TRUTH.duration_median_s, rel=0.15)
    assert fit.tool_median_s == pytest.approx(LOAD_TRUTH.tool_median_s, rel=0.15)


# Compilation and per-engine batching (the load model's runtime costs).
COMPILE_TRUTH = LOAD_TRUTH.replace(
    steps=16,
    decode_cores=2.5,
    per_engine=True,
    batch_cost=0.3,
    engine_compile_s=(6.0, 0.0, 3.0),
    train_compile_s=2.0,
    join_compile_s=3.0,
)


def test_load_fit_recovers_compilation_and_batching_from_a_simulated_log(tmp_path):
    result = simulate(COMPILE_TRUTH, "elastic")
    calibrate.write_run_logs(COMPILE_TRUTH, result, "elastic", tmp_path, startup_s=3.0)
    # The run exercises every cost: a join's compile and a step at a new width.
    joins = result.log["join_compiles"]
    assert joins and len({k for *_, k in result.log["steps"]}) > 1
    fit = calibrate.fit_run(tmp_path, load=True).sim
    for name in ("decode_cores", "train_cores", "batch_cost"):
        assert getattr(fit, name) == pytest.approx(getattr(COMPILE_TRUTH, name), rel=0.05), name
    for name in ("train_compile_s", "join_compile_s", "first_step_s"):
        got, want = getattr(fit, name), getattr(COMPILE_TRUTH, name)
        assert got == pytest.approx(want, rel=0.05), (name, got, want)
    # The engines compile at turns 0 and 2 (wall seconds), not at turn 1.
    np.testing.assert_allclose(fit.engine_compile_s, COMPILE_TRUTH.engine_compile_s, atol=0.3)
