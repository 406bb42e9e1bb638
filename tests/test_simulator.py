"""The discrete-event simulator (gyrejax/scheduler/simulator.py) on small clusters."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gyrejax.scheduler.policies import make_policy
from gyrejax.scheduler.simulator import (
    HOUR,
    SimConfig,
    SimulationError,
    Simulator,
    lower_bound_s,
    make_trace,
    simulate,
    staleness_bound_s,
)

SMALL = SimConfig(
    cells=4, capacity=4, group_size=2, groups_per_step=2, steps=8, mu=2, phi=1,
    duration_median_s=1 * HOUR, duration_sigma=0.6, timeout_s=3 * HOUR,
    tokens_mean=10_000.0, train_s_per_token=0.05,
)  # fmt: skip
RUNS = [("colocate", {}), ("async", {"training_cells": 1}), ("async", {"training_cells": 3}),
        ("elastic", {})]  # fmt: skip


def test_deterministic_for_a_seed():
    a = simulate(SMALL, "elastic")
    b = simulate(SMALL, "elastic")
    assert a.makespan_s == b.makespan_s and a.trained == b.trained
    assert a.timeline == b.timeline
    c = simulate(SMALL.replace(seed=1), "elastic")
    assert c.makespan_s != a.makespan_s
    assert not np.array_equal(make_trace(SMALL).duration_s, make_trace(SMALL, seed=1).duration_s)


@pytest.mark.parametrize("gate", [None, 2])
@pytest.mark.parametrize(("policy", "options"), RUNS)
def test_one_trace_all_policies_finish_every_group_once(policy, options, gate):
    config = SMALL.replace(max_staleness=gate)
    trace = make_trace(config)
    result = simulate(config, policy, trace, **options)
    total = config.steps * config.groups_per_step
    assert len(result.step_end_s) == config.steps
    assert sorted(result.trained) == list(range(total))  # each group exactly once
    assert result.utilisation <= 1.0 + 1e-9
    assert result.makespan_s >= result.lower_bound_s * (1 - 1e-9)
    # Utilisation is work over cell-time, so it equals lower bound / makespan.
    assert result.utilisation == pytest.approx(result.lower_bound_s / result.makespan_s)
    if gate is not None:
        assert result.max_staleness <= gate


@pytest.mark.parametrize("gate", [1, 3, 5])
@pytest.mark.parametrize("policy", ["async", "elastic", "colocate"])
def test_staleness_never_exceeds_its_bound(policy, gate):
    config = SimConfig(
        cells=6, capacity=4, group_size=2, groups_per_step=2, steps=12, mu=1 if gate < 2 else 2,
        phi=2, max_staleness=gate, duration_median_s=HOUR, duration_sigma=1.0,
        timeout_s=6 * HOUR, tokens_mean=1e4, train_s_per_token=0.02, seed=3,
    )  # fmt: skip
    options = {"training_cells": 2} if policy == "async" else {}
    result = simulate(config, policy, **options)
    assert len(result.staleness) == config.steps * config.groups_per_step
    assert result.max_staleness <= gate


def test_transitions_are_serial_and_cost_time():
    result = simulate(SMALL, "elastic")
    switching = {}
    for t, cell, state in result.timeline:
        if state == "switching":
            assert not any(switching.values()), "two cells switching at once"
            switching[cell] = t
        elif switching.get(cell) is not None:
            assert t - switching[cell] >= min(SMALL.to_training_s, SMALL.to_rollout_s) - 1e-9
            switching[cell] = None
    assert result.transitions.get("to_training", 0) >= 1


def test_more_cells_are_not_slower_for_elastic():
    trace = make_trace(SMALL)
    few = simulate(SMALL, "elastic", trace)
    many = simulate(SMALL.replace(cells=8), "elastic", trace)
    assert many.makespan_s < few.makespan_s


def test_config_validation_and_trace_shape():
    with pytest.raises(ValueError, match=r"sim\.cells=1"):
        SimConfig(cells=1)
    with pytest.raises(ValueError, match="max_staleness=0, expected >= mu - 1 = 1"):
        SimConfig(mu=2, max_staleness=0)
    with pytest.raises(ValueError, match="unknown fields"):
        SimConfig.from_dict({"cels": 3})
    with pytest.raises(ValueError, match="trace shape"):
        Simulator(SMALL, make_policy("elastic"), make_trace(SMALL.replace(steps=2)))


def test_a_stuck_policy_is_reported():
    def never(view):  # dispatches, never trains
        from gyrejax.scheduler.policies import Decision

        return Decision(dispatch=view.groups_remaining or 0)

    with pytest.raises(SimulationError, match="step 0/8"):
        Simulator(SMALL, never).run()


def test_simulator_imports_no_jax():
    code = (
        "import sys; import gyrejax.scheduler.simulator; "
        "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("gate", [1, 2, 4])
def test_staleness_bound_holds_for_every_policy(gate):
    config = SMALL.replace(max_staleness=gate, mu=1 if gate < 2 else 2, duration_sigma=1.0)
    trace = make_trace(config)
    bound = staleness_bound_s(config, trace)
    assert bound >= lower_bound_s(config, trace)
    plain = {"lookahead": "phi", "core_stays": "ready", "keep_cell": "always"}
    for policy, options in [*RUNS, ("elastic", plain)]:
        result = simulate(config, policy, trace, **options)
        assert result.makespan_s >= bound * (1 - 1e-9), (policy, options)
    # Without a gate it is the work bound.
    assert staleness_bound_s(SMALL, trace) == lower_bound_s(SMALL, trace)


def test_a_tight_gate_makes_the_staleness_bound_exceed_the_work_bound():
    # Executions that all time out at 10 h, mu = 1, S = 1: step k may only train versions
    # k - 1 and k, so steps 0, 2, 4, 6 each wait 10 h for groups dispatched after the step
    # two before ended: at least 40 h, about twice the work bound (21.1 h).
    config = SMALL.replace(mu=1, max_staleness=1, duration_median_s=20 * HOUR,
                           duration_sigma=0.0, timeout_s=10 * HOUR)  # fmt: skip
    trace = make_trace(config)
    assert staleness_bound_s(config, trace) >= 40 * HOUR > 1.8 * lower_bound_s(config, trace)
    assert simulate(config, "elastic", trace).makespan_s >= staleness_bound_s(config, trace)


def test_idle_accounting():
    result = simulate(SMALL, "elastic")
    c = SMALL
    assert result.rollout_idle_s >= result.throttled_s >= 0
    assert result.train_idle_s >= 0
    # Busy and idle cell-time never exceed the cluster's cell-time.
    total = result.rollout_busy_s + result.train_busy_s + result.rollout_idle_s
    assert total + result.train_idle_s <= c.cells * result.makespan_s * (1 + 1e-9)
    summary = result.summary()
    assert summary["train_idle_cell_h"] == pytest.approx(result.train_idle_s / HOUR)


def test_elastic_options_reach_the_simulator():
    config = SMALL.replace(max_staleness=3, phi=0)
    trace = make_trace(config)
    plain = simulate(config, "elastic", trace, lookahead="phi", core_stays="ready",
                     keep_cell="always")  # fmt: skip
    tuned = simulate(config, "elastic", trace)
    assert plain.makespan_s != tuned.makespan_s  # the options change what happens
    assert max(plain.max_staleness, tuned.max_staleness) <= 3


def test_benchmark_rows_on_a_small_cluster(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "schedule_bench.py"
    spec = importlib.util.spec_from_file_location("schedule_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    configs = next(iter(bench.equal_settings(SMALL, [(3, 1)]).values()))
    trace = make_trace(SMALL)
    rows = bench.run_setting(configs, trace, bench.ASYNC_LOOKAHEADS, bench.ablation_rows(configs))
    names = [name for name, _ in bench.ELASTIC_ABLATION]
    assert set(rows) == {*bench.POLICIES, *names}
    # The ablation's default row is the default policy; async is the best of its sweep.
    assert rows["+ dispatch to the gate (default)"]["makespan_h"] == rows["elastic"]["makespan_h"]
    sweep = [h for hs in rows["async"]["async_sweep_h"].values() for _, h in hs]
    assert rows["async"]["makespan_h"] == min(sweep)
    assert len(sweep) == 2 * (SMALL.cells - 1)
    bench.print_table("t", {p: rows[p] for p in bench.POLICIES})
    bench.print_table("a", {k: rows[k] for k in ["async", *names]}, ablation=True)
    out = capsys.readouterr().out
    assert "/ S-bound" in out and "best async / this" in out
