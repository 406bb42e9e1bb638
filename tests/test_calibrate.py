"""Calibration of the simulator on run logs (gyrejax/scheduler/calibrate.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyrejax.scheduler import calibrate
from gyrejax.scheduler.driver import capacity_from_share
from gyrejax.scheduler.policies import make_policy
from gyrejax.scheduler.simulator import HOUR, SimConfig, Simulator, Trace, make_trace, simulate

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
    # The summary has no trainer_s (as runs from before it): read from the metrics rows.
    spent, direct = calibrate.read_run(tmp_path)["trainer_s"], result.trainer_time_s()
    assert spent["training"] == pytest.approx(direct["training"])
    assert spent["before_first_step"] == pytest.approx(7.0 + direct["before_first_step"])
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


def test_predict_uses_the_split_and_dispatch_depth_the_run_recorded(tmp_path):
    # An async run dispatching as deep as the gate allows, on two training cells: the
    # prediction simulates that policy, not the defaults (one cell, the phi depth).
    truth = TRUTH.replace(max_staleness=3, mu=1)
    options = {"training_cells": 2, "lookahead": "gate"}
    calibrate.write_run_logs(
        truth, simulate(truth, "async", **options), "async", tmp_path, 0.0, options
    )
    run = calibrate.read_run(tmp_path)
    assert calibrate.schedule_options(run["schedule"]) == {**options, "overcommit": 0.0}
    fit = calibrate.fit_run(tmp_path)
    walls = calibrate.predicted_walls(fit, run, seeds=(0, 1))
    sim = fit.sim.replace(max_staleness=3, mu=1)
    expected = [simulate(sim.replace(seed=s), "async", **options).makespan_s for s in (0, 1)]
    assert walls == pytest.approx(fit.startup_s + np.array(expected) + fit.shutdown_s)
    default = {**run, "schedule": {**run["schedule"], "lookahead": "default"}}
    assert calibrate.predict(fit, default) != pytest.approx(calibrate.predict(fit, run))
    # Runs logged before the depth was recorded: the policy's own.
    old = {**run, "schedule": {k: v for k, v in run["schedule"].items() if k != "lookahead"}}
    assert calibrate.predict(fit, old) == calibrate.predict(fit, default)
    # Elastic's overcommit is simulated as recorded; runs logged before it: 0.
    elastic = {**run["schedule"], "policy": "elastic", "elastic_overcommit": 0.5}
    assert calibrate.schedule_options(elastic)["overcommit"] == 0.5
    unrecorded = {k: v for k, v in elastic.items() if k != "elastic_overcommit"}
    assert calibrate.schedule_options(unrecorded)["overcommit"] == 0.0


def test_the_predicted_band_holds_most_runs_of_the_same_configuration(tmp_path):
    """One run is one draw: fitted on a seed-0 run, the 10-90% band of the prediction
    holds most other seeds' runs of the same configuration, and `predict` is its median."""
    truth = TRUTH.replace(steps=12, duration_sigma=0.8)  # few steps, long tails: wide spread
    calibrate.write_run_logs(truth, simulate(truth, "elastic"), "elastic", tmp_path)
    fit = calibrate.fit_run(tmp_path)
    run = calibrate.read_run(tmp_path)
    low, median, high = calibrate.predicted_band(fit, run)
    assert low < median < high and median == calibrate.predict(fit, run)
    others = [simulate(truth.replace(seed=s), "elastic").makespan_s for s in range(10, 20)]
    inside = sum(low <= m + fit.startup_s + fit.shutdown_s <= high for m in others)
    assert inside >= 6, (low, high, others)
    # The wall from the trainer's side, predicted: on one seed its parts sum to that
    # seed's predicted wall; over the seeds its training is the run's own within 2% (the
    # fit recovers the steps' tokens and the cost per token).
    one = calibrate.predicted_trainer_time(fit, run, seeds=(3,))
    assert sum(one.values()) == pytest.approx(calibrate.predicted_walls(fit, run, (3,))[0])
    median = calibrate.predicted_trainer_time(fit, run)
    assert median["training"] == pytest.approx(run["trainer_s"]["training"], rel=0.02)
    assert median["before_first_step"] >= fit.startup_s


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


@pytest.mark.parametrize("policy", ["elastic", "async", "colocate"])
def test_the_outside_calls_bound_is_never_beaten(tmp_path, policy):
    """A run's bound from its executions' time outside model calls never exceeds its
    wall; with long tool calls it holds much of what elastic takes, which dispatches as
    deep as the gate allows (colocate and async at their default depth lag far behind)."""
    for seed, mu in ((0, 1), (1, 2), (2, 1)):
        truth = LOAD_TRUTH.replace(seed=seed, mu=mu, tool_median_s=20.0, timeout_s=1e4)
        workdir = tmp_path / f"{seed}"
        calibrate.write_run_logs(truth, simulate(truth, policy), policy, workdir, 3.0)
        wall = json.loads((workdir / "run_summary.json").read_text())["wall_s"]
        bound = calibrate.outside_calls_bound_s(workdir)
        assert 0 < bound <= wall + 1e-9, (seed, mu, bound, wall)
        assert policy != "elastic" or bound > 0.5 * wall, (seed, mu, bound, wall)
    (workdir / "executions").rename(tmp_path / "gone")  # no model calls: no bound
    assert calibrate.outside_calls_bound_s(workdir) is None


def test_the_outside_calls_bound_charges_no_rollout_and_knows_its_premises(tmp_path):
    # Ten 100 s steps on one training cell while the other rolls out; five groups wait
    # 390 s on tools. Tool time overlaps training, so charging the groups' time outside
    # calls as cell-time (as slots would) put the bound at 1098 s over a 1001 s wall.
    b_groups, steps = 1, 10
    config = SimConfig(
        cells=2, capacity=1, group_size=1, groups_per_step=b_groups, steps=steps, mu=1, phi=0,
        max_staleness=4, executions_hold_slots=False, train_parallel=False,
        decode_cores=100.0, train_cores=1.0, turns=2, tool_median_s=1.0,
        train_s_per_token=1.0, to_training_s=0.0, to_rollout_s=0.0, timeout_s=1e9,
    )  # fmt: skip
    tool = np.array([1.0] * 5 + [390.0] * 5).reshape(steps, 1, 1)
    trace = Trace(
        np.full((steps, 1), 0.01),
        np.full((steps, 1), 100.0),
        np.zeros((steps, 1), bool),
        None,
        tool,
    )
    options = {"training_cells": 1, "lookahead": "gate"}
    result = Simulator(config, make_policy("async", **options), trace).run()
    assert result.over_stale == 0
    calibrate.write_run_logs(config, result, "async", tmp_path, 0.0, options)
    wall = json.loads((tmp_path / "run_summary.json").read_text())["wall_s"]
    bound = calibrate.outside_calls_bound_s(tmp_path)
    assert 0.9 * wall < bound <= wall + 1e-9, (bound, wall)
    # Where its premises fail it gives none: the gate broken, an update skipped, a group
    # trained in no logged step.
    summary, rows = tmp_path / "run_summary.json", tmp_path / "metrics.jsonl"
    good_summary, good_rows = summary.read_text(), rows.read_text()
    summary.write_text(json.dumps({**json.loads(good_summary), "over_stale": 1}))
    assert calibrate.outside_calls_bound_s(tmp_path) is None
    summary.write_text(good_summary)
    lines = [json.loads(line) for line in good_rows.splitlines()]
    rows.write_text("\n".join(json.dumps({**r, "skipped": r["step"] == 3}) for r in lines))
    assert calibrate.outside_calls_bound_s(tmp_path) is None
    rows.write_text("\n".join(json.dumps(r) for r in lines[:-1]))
    assert calibrate.outside_calls_bound_s(tmp_path) is None
    rows.write_text(good_rows)
    assert calibrate.outside_calls_bound_s(tmp_path) == bound


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


# Context growth (calls by work, compiles per context bucket, compile contention): the
# load model's v3 costs, what the real runs' records show.
CONTEXT_TRUTH = COMPILE_TRUTH.replace(
    decode_cores=1.5,
    engine_compile_s=(),
    context_tokens=70.0,
    context_per_call=50.0,
    context_sigma=0.3,
    call_work_s=0.7,
    bucket_compile_s=(8.0, 6.0, 5.0),
)


def test_load_fit_recovers_context_growth_and_bucket_compiles(tmp_path):
    result = simulate(CONTEXT_TRUTH, "elastic")
    calibrate.write_run_logs(CONTEXT_TRUTH, result, "elastic", tmp_path, startup_s=3.0)
    fit = calibrate.fit_run(tmp_path, load=True).sim
    assert fit.engine_compile_s == ()
    for name in ("context_tokens", "context_per_call", "call_work_s"):
        got, want = getattr(fit, name), getattr(CONTEXT_TRUTH, name)
        assert got == pytest.approx(want, rel=0.05), (name, got, want)
    assert fit.call_work_exponent == 1.0  # calls in proportion to work, as simulated
    # Buckets 128, 256, 512 as simulated; 1024 reached by none (or at no cost).
    got = fit.bucket_compile_s
    np.testing.assert_allclose(got[:3], CONTEXT_TRUTH.bucket_compile_s, rtol=0.05)
    assert not any(got[3:])
    assert fit.compile_contention == 0.0
    # Sampled: the spread of a few hundred executions' growth.
    assert fit.context_sigma == pytest.approx(CONTEXT_TRUTH.context_sigma, rel=0.15)


def test_load_fit_recovers_fewer_calls_for_long_executions(tmp_path):
    # Calls grow as work ** 0.6 (the real agents' turn limits): the longest executions
    # make fewer calls than in proportion, and the fit finds the exponent.
    truth = CONTEXT_TRUTH.replace(call_work_s=0.3, call_work_exponent=0.6)
    result = simulate(truth, "elastic")
    calibrate.write_run_logs(truth, result, "elastic", tmp_path, startup_s=3.0)
    fit = calibrate.fit_run(tmp_path, load=True).sim
    assert fit.call_work_exponent == pytest.approx(0.6, abs=0.05)
    assert fit.call_work_s == pytest.approx(0.3, rel=0.05)
    calls = make_trace(truth).calls
    assert calls.max() < make_trace(truth.replace(call_work_exponent=1.0)).calls.max()


def test_fits_with_coefficients_that_cannot_be_negative_are_least_squares():
    # The costs' fits (a step's overhead and seconds per token; a call's prefill and
    # per-token cost) are least squares with coefficients >= 0: equal to scipy's NNLS
    # on random problems, with and without an intercept column.
    nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, k = int(rng.integers(3, 30)), int(rng.integers(1, 4))
        design, target = rng.normal(size=(n, k)), rng.normal(size=n)
        design[:, -1] = 1.0 if rng.random() < 0.5 else design[:, -1]
        got, (want, _) = calibrate._nonnegative_lstsq(design, target), nnls(design, target)
        assert np.sum((design @ got - target) ** 2) == pytest.approx(
            np.sum((design @ want - target) ** 2), rel=1e-9, abs=1e-12
        )
    # Steps whose time falls a little with their tokens (noise): the time per token is
    # 0 and the overhead their mean, not the intercept of the falling line.
    steps = [
        {"tokens": t, "step_s": s, "cells": [0, 1]}
        for t, s in [(400, 0.5), (500, 0.45), (600, 0.42), (700, 0.35)]
    ]
    per_token, overhead, parallel, _ = calibrate._fit_steps(steps)
    assert per_token == 0.0 and overhead == pytest.approx(0.43) and parallel is None


def test_the_walls_of_other_runs_choose_the_cores_one_run_cannot_tell(tmp_path):
    # Engines that batch (per engine) on a host of 3.7 cores: one elastic run's engines
    # and training never demand more than that at once, so its calls are explained as
    # well by one core as by 3.7, and its one-run fit predicts the other policies
    # poorly. The wall of a run with one rollout engine (async, three training
    # cells) chooses the cores; the fit then predicts runs it never saw.
    truth = LOAD_TRUTH.replace(decode_cores=3.7, per_engine=True, batch_cost=0.3)
    runs = {
        "elastic": ("elastic", {}),
        "async3": ("async", {"training_cells": 3}),
        "async1": ("async", {"training_cells": 1}),
        "colocate": ("colocate", {}),
    }
    for name, (policy, options) in runs.items():
        result = simulate(truth, policy, **options)
        calibrate.write_run_logs(truth, result, policy, tmp_path / name, 3.0, options)
    measured = {name: calibrate.read_run(tmp_path / name) for name in runs}

    def errors(fit):
        return {n: calibrate.predict(fit, r) / r["wall_s"] - 1 for n, r in measured.items()}

    alone = calibrate.fit_run(tmp_path / "elastic", load=True)
    assert max(abs(e) for e in errors(alone).values()) > 0.2  # what the check is for
    fit = calibrate.fit_run(tmp_path / "elastic", load=True, cores_by=[tmp_path / "async3"])
    assert fit.cores_by == (str(tmp_path / "async3"),)
    assert fit.summary()["cores_by"] == [str(tmp_path / "async3")]
    # The async(3) wall rules out fewer than about 2.8 cores (the one-run fit's 1 core
    # among them); above that every choice predicts it alike (the fewest is kept).
    assert alone.sim.decode_cores < 2.5 < fit.sim.decode_cores
    got = errors(fit)
    assert abs(got["async1"]) < 0.05 and abs(got["colocate"]) < 0.05, got  # out of sample
    with pytest.raises(ValueError, match="cores_by chooses the load model's cores and demand"):
        calibrate.fit_run(tmp_path / "elastic", cores_by=[tmp_path / "async3"])


def test_another_runs_wall_gives_the_training_demand_a_colocate_run_cannot_show(tmp_path):
    # Under colocate no call decodes while a step trains, so its logs cannot show how
    # much a step slows the engines (train_cores): its one-run fit says not at all. An
    # async(1) run's wall (steps beside three rollout engines) recovers the demand and
    # the cores.
    truth = LOAD_TRUTH.replace(
        decode_cores=1.0, train_cores=4.0, per_engine=True, batch_cost=0.3, train_s_per_token=1e-2
    )
    for name, policy, options in [("colocate", "colocate", {}), ("async1", "async", {})]:
        result = simulate(truth, policy, **options)
        calibrate.write_run_logs(truth, result, policy, tmp_path / name, 3.0, options)
    alone = calibrate.fit_run(tmp_path / "colocate", load=True).sim
    assert alone.train_cores == 0.0
    fit = calibrate.fit_run(tmp_path / "colocate", load=True, cores_by=[tmp_path / "async1"])
    assert (fit.sim.train_cores, fit.sim.decode_cores) == (4.0, pytest.approx(1.0, rel=0.05))


def test_the_simulator_sizes_cells_from_the_share_in_calls_like_the_runtime(tmp_path):
    # Long tool calls: agents spend a small share of their wall time decoding, so with
    # slot_occupancy the capacity the policies see rises above the slots, to what
    # capacity_from_share gives for the last 64 finished executions (recomputed here from
    # the logged calls). A run logged with it is predicted with it (load model only).
    truth = LOAD_TRUTH.replace(tool_median_s=20.0, timeout_s=1e4, slot_occupancy=1.0)
    sim = Simulator(truth, make_policy("elastic"))
    result = sim.run()
    n = truth.group_size
    in_calls: dict[int, float] = {}
    for e, start, end, *_ in result.log["calls"]:
        in_calls[e] = in_calls.get(e, 0.0) + end - start
    finished = np.asarray(result.log["finished"])
    last = np.argsort(finished, kind="stable")[-64:]
    wall = sum(finished[e] - result.log["dispatched"][e // n] for e in last)
    share = sum(in_calls.get(int(e), 0.0) for e in last) / wall
    assert share < 0.5 and sim.driver.schedule.capacity == capacity_from_share(16, 1.0, share)
    assert sim.driver.schedule.capacity > truth.capacity
    with pytest.raises(ValueError, match=r"slot_occupancy=1\.0 needs the load model"):
        TRUTH.replace(slot_occupancy=1.0)
    calibrate.write_run_logs(truth, result, "elastic", tmp_path, 3.0)
    run = calibrate.read_run(tmp_path)
    fit = calibrate.fit_run(tmp_path, load=True)
    walls = calibrate.predicted_walls(fit, run, seeds=(0,))
    fitted = fit.sim.replace(slot_occupancy=1.0, seed=0)
    expected = fit.startup_s + simulate(fitted, "elastic").makespan_s + fit.shutdown_s
    assert walls[0] == pytest.approx(expected)


def test_contention_fit_tells_concurrent_compiles_from_slow_ones():
    # Shape 8 compiles alone (10 s) and on two engines at once; shape 9 on three at once
    # and alone later. Under kappa = 0.5, m at once take 1 + 0.5 (m - 1) times as long.
    windows = [
        (8, 0.0, 10.0),
        (8, 20.0, 35.0),
        (8, 20.0, 35.0),
        (9, 50.0, 62.0),
        (9, 50.0, 62.0),
        (9, 50.0, 62.0),
        (9, 70.0, 76.0),
    ]
    kappa, alone = calibrate._fit_contention(windows)
    assert kappa == pytest.approx(0.5)
    np.testing.assert_allclose(alone[8], [10.0] * 3)
    np.testing.assert_allclose(alone[9], [6.0] * 4)


def test_compiles_land_on_the_executions_that_reach_a_bucket():
    # Every execution's prompt grows 50 tokens a call from 70: bucket 1 (> 128 tokens)
    # at its call 2, bucket 2 (> 256) at its call 4. Only executions with that many
    # calls compile it, on their engines; the old model compiles turn k on every engine.
    truth = CONTEXT_TRUTH.replace(context_sigma=0.0)
    simulator = Simulator(truth, make_policy("elastic"))
    compiled = []  # (execution, its call index, cell, bucket)
    maybe_compile = simulator._maybe_compile

    def spy(e):
        before = simulator.compile_left.copy()
        maybe_compile(e)
        cell = int(simulator.engine[e])
        if cell >= 0 and simulator.compile_left[cell] > before[cell]:
            compiled.append((e, int(simulator.phase[e] // 2), cell, int(simulator.bucket[e])))

    simulator._maybe_compile = spy
    simulator.run()
    calls = simulator.trace.calls.reshape(-1)
    assert {b for *_, b in compiled} == {0, 1, 2}
    for e, call, _, bucket in compiled:
        assert call == {0: 0, 1: 2, 2: 4}[bucket] or (bucket == 0 and call < 2)
        assert calls[e] > call
    # Most executions are too short to reach bucket 2, and never compile it.
    assert np.mean(calls >= 5) < 0.5
    assert len({cell for *_, cell, b in compiled if b == 2}) <= truth.cells


def test_context_fields_change_nothing_without_the_load_model():
    plain = simulate(TRUTH.replace(steps=8), "elastic")
    fields = {
        "context_tokens": 70.0,
        "context_per_call": 50.0,
        "context_sigma": 0.3,
        "call_work_s": 0.7,
        "bucket_compile_s": (6.0, 4.0),
        "compile_contention": 0.5,
    }
    other = simulate(TRUTH.replace(steps=8, **fields), "elastic")
    assert other.makespan_s == plain.makespan_s
    assert other.step_end_s == plain.step_end_s
