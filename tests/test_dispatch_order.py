"""Dispatch order "longest_first": the same permutation in the simulator and the RL loop.

Within each block of S steps' groups the task with the longest expected duration is
dispatched first (`scheduler/driver.py`, `dispatch_permutation`). References: orders
written by hand and a naive selection loop.
"""

import asyncio
import dataclasses
import json

import numpy as np
import pytest
from conftest import load_config_file
from test_simulator import SMALL

from gyrejax.config import ConfigError, from_dict
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.harness.tasks import draw_file_task, load_task_file
from gyrejax.loop.context import RunContext, schedule_of
from gyrejax.loop.groups import Groups
from gyrejax.scheduler.driver import Driver, dispatch_block, dispatch_permutation
from gyrejax.scheduler.simulator import SimConfig, make_trace, makespan_bound_s
from gyrejax.trajectory import ExecutionStore


def naive_order(hints, block):
    """Block by block, repeatedly the first remaining task of the largest hint."""
    order = []
    for start in range(0, len(hints), block):
        left = list(range(start, min(len(hints), start + block)))
        while left:
            pick = max(left, key=lambda i: (hints[i], -i))
            order.append(pick)
            left.remove(pick)
    return order


def test_permutation_by_hand_and_against_a_naive_loop():
    assert dispatch_permutation([1, 3, 2, 3, 5, 1], 4) == [1, 3, 2, 0, 4, 5]
    assert dispatch_permutation([2, 2, 2], 2) == [0, 1, 2]  # ties keep the data order
    assert dispatch_block(4, 3) == 12
    assert dispatch_block(4, None) == dispatch_block(4, 0) == 4  # one step's groups
    rng = np.random.default_rng(0)
    for _ in range(50):
        hints = list(rng.integers(1, 4, rng.integers(1, 20)).astype(float))
        block = int(rng.integers(1, 8))
        assert dispatch_permutation(hints, block) == naive_order(hints, block)


def test_the_simulator_reorders_mixed_groups_within_blocks_and_nothing_else():
    config = SMALL.replace(workload="mixed", steps=12, max_staleness=2)
    fifo, ordered = make_trace(config), make_trace(config.replace(dispatch_order="longest_first"))
    block = dispatch_block(config.groups_per_step, 2)
    order = naive_order(list(fifo.factor), block)
    assert order != list(range(config.groups))  # the draw has work to do
    # Every group keeps its own executions (durations, tokens, timeouts), moved whole.
    for name in ("duration_s", "tokens", "timed_out", "factor"):
        np.testing.assert_array_equal(getattr(ordered, name), getattr(fifo, name)[order])
    # Static and drift tasks carry no hint: their order stays.
    for workload in ("static", "drift"):
        plain = config.replace(workload=workload)
        a, b = make_trace(plain), make_trace(plain.replace(dispatch_order="longest_first"))
        np.testing.assert_array_equal(a.duration_s, b.duration_s)
    with pytest.raises(ValueError, match=r"sim\.dispatch_order='lpt'"):
        SimConfig(dispatch_order="lpt")


def test_the_benchmark_sweeps_both_orders_where_tasks_carry_a_hint():
    from test_simulator import _schedule_bench

    bench = _schedule_bench()
    cfg = bench.load_config("configs/sim_paper.py:quick")
    mixed = bench.fair_case(cfg, "mixed", 4, 4, 2).replace(steps=6)
    static = mixed.replace(workload="static")
    plain = bench.settings("elastic", static, cfg.fair)  # static: no hint, no order swept
    assert all("dispatch_order" not in s for s in plain)
    assert bench.settings("elastic", mixed, cfg.fair) == [
        dict(s, dispatch_order=order) for order in ("fifo", "longest_first") for s in plain
    ]
    # The bound that holds for either order is the lesser of the two traces' bounds (on
    # 16 x 32 at S = 8 longest first lowers it: the deadline chain binds).
    wide = bench.fair_case(bench.load_config("configs/sim_paper.py"), "mixed", 16, 32, 8)
    bounds = []
    for order in ("fifo", "longest_first"):
        sim = wide.replace(dispatch_order=order)
        bounds.append(makespan_bound_s(sim, make_trace(sim)))
    assert bounds[1] < bounds[0]
    assert bench.any_order_bound_s(wide) == min(bounds)


def _tasks_config(tmp_path, hints, order="longest_first", steps=3):
    lines = MiniRepoEnv().sample_tasks(len(hints), seed=0)
    path = tmp_path / "tasks.jsonl"
    rows = [
        {"id": t.task_id, "prompt": t.spec, **({} if h is None else {"expected_s": h})}
        for t, h in zip(lines, hints, strict=True)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = load_config_file("tiny_cpu", "smoke")
    c.rl.agent, c.rl.agent_command, c.rl.reward = "command", "true", "agent"
    c.rl.tasks_path, c.scheduler.dispatch_order = str(path), order
    c.rl.groups_per_step, c.train.steps, c.scheduler.max_staleness = 2, steps, 2
    return from_dict(c)


def test_the_rl_loop_orders_as_the_simulator_and_a_resume_keeps_each_groups_task(tmp_path):
    def make_groups(config) -> tuple[RunContext, Groups]:
        tasks = load_task_file(config.rl.tasks_path, need_expected=True)
        ctx = RunContext(config, [], tmp_path, None, Driver(schedule_of(config, 4)))
        return ctx, Groups(ctx, MiniRepoEnv(), ExecutionStore(tmp_path / "executions"), tasks)

    hints = [10.0 * (i + 1) for i in range(8)]
    config = _tasks_config(tmp_path, hints)  # 3 steps of 2 groups, S = 2: 6 groups
    tasks = load_task_file(config.rl.tasks_path, need_expected=True)
    draws = [draw_file_task(tasks, seed=i, run_seed=config.seed) for i in range(6)]
    # Blocks of 4 groups, the last cut at the run's end, as the simulator's trace is.
    order = naive_order([d.expected_s for d in draws], dispatch_block(2, 2))
    assert order != list(range(6))  # the order differs from the data's
    _, groups = make_groups(config)
    assert [groups._task_index(seq) for seq in range(6)] == order
    assert [groups._make(seq, 0).task.task_id for seq in range(6)] == [
        draws[i].task_id for i in order
    ]
    # A resume with more steps lengthens the last block, which would give seqs 4 and 5
    # other draws; each group dispatched before keeps the draw dispatch.jsonl recorded.
    longer = _tasks_config(tmp_path, hints, steps=4)
    _, moved = make_groups(longer)
    changed = [seq for seq in (4, 5) if moved._task_index(seq) != order[seq]]
    assert changed
    entries = [
        {"group": f"g{seq}", "seq": seq, "task": draws[order[seq]].task_id, "draw": order[seq],
         "version": 0}
        for seq in range(6)
    ]  # fmt: skip
    (tmp_path / "dispatch.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))

    async def resume(config) -> Groups:
        ctx, groups = make_groups(config)
        groups.resume(set())
        for task in ctx.tasks():  # the re-runs of missing executions: not started here
            task.cancel()
        return groups

    resumed = asyncio.run(resume(longer))
    assert [resumed.groups[f"g{seq}"].task.task_id for seq in range(6)] == [
        e["task"] for e in entries
    ]
    assert resumed.next_seq == 6
    # Where the settings now give a group another task (here: another seed), the resume
    # stops with one line naming both, instead of training it on the wrong task.
    reseeded = dataclasses.replace(longer, seed=7)
    with pytest.raises(ConfigError, match=r"group g0 ran task '.*', the config now gives it"):
        asyncio.run(resume(reseeded))


def test_longest_first_needs_a_hint_on_every_line(tmp_path):
    with pytest.raises(ConfigError, match=r"line 2: \"expected_s\"=None, expected a number"):
        load_task_file(str(_tasks_config(tmp_path, [5.0, None]).rl.tasks_path), need_expected=True)
    bad_values = (
        ("-1", r"line 1: \"expected_s\"=-1, expected a finite number > 0"),
        ('"9"', r"line 1: \"expected_s\"='9', expected a number"),
        ("1" + "0" * 400, r"line 1: \"expected_s\"=10+, expected a finite"),  # overflows
    )
    for bad, message in bad_values:
        path = tmp_path / "bad.jsonl"
        path.write_text('{"id": "a", "prompt": "p", "expected_s": ' + bad + "}\n")
        with pytest.raises(ConfigError, match=message):
            load_task_file(str(path))
    c = load_config_file("tiny_cpu", "smoke")
    c.scheduler.dispatch_order = "longest_first"
    with pytest.raises(ConfigError, match=r"scheduler\.dispatch_order.*needs tasks"):
        from_dict(c)
    c.scheduler.dispatch_order = "shortest"
    with pytest.raises(ConfigError, match=r"scheduler\.dispatch_order='shortest'"):
        from_dict(c)
