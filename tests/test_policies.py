"""Policy decisions on hand-built counter sequences (gyrejax/scheduler/policies.py)."""

from __future__ import annotations

import dataclasses

import pytest

from gyrejax.scheduler.policies import (
    CellView,
    Decision,
    Role,
    View,
    known_policies,
    make_policy,
    step_groups,
)

R, T = Role.ROLLOUT, Role.TRAINING


def view(roles="RRRR", switching="", capacity=8, **counters) -> View:
    """4 cells (roles as letters; `switching` lists the switching cells' indices)."""
    cells = tuple(
        CellView(i, R if r == "R" else T, str(i) in switching, capacity)
        for i, r in enumerate(roles)
    )
    values = dict(
        now=0.0, group_size=4, groups_per_step=2, steps_per_burst=1, lookahead_bursts=0,
        burst=0, dispatched=0, started=0, finished=0, executions_in_flight=0,
        groups_in_flight=0, groups_ready=0, steps_in_burst=0, step_running=False,
        groups_remaining=0,
    )  # fmt: skip
    values.update(counters)
    return View(cells=cells, **values)


def elastic_after_boundary(**kwargs):
    """An elastic policy that has already seen burst 0's boundary."""
    policy = make_policy("elastic", **kwargs)
    policy(view())
    return policy


def test_known_policies_and_unknown_name():
    assert set(known_policies()) >= {"colocate", "async", "elastic"}
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_waterlevel_boundary():
    # C_R = 32, C_e = 8: the core may leave iff w <= 24.
    policy = elastic_after_boundary()
    assert policy(view(executions_in_flight=24)).transitions == ((0, T),)
    assert policy.overcommitted == 0  # every execution keeps a slot
    policy = elastic_after_boundary()
    assert policy(view(executions_in_flight=25)).transitions == ()


def test_overcommit_leaves_a_share_of_a_cell_unserved_while_training_is_behind():
    # C_R = 32, C_e = 8; overcommit 0.5: up to 4 executions without a slot, but only with
    # backlog_steps (2) steps of data waiting (4 groups, B = 2) and groups left to dispatch.
    behind = dict(groups_ready=4, groups_remaining=6)
    policy = elastic_after_boundary(overcommit=0.5)
    assert policy(view(executions_in_flight=28, **behind)).transitions == ((0, T),)
    assert policy.overcommitted == 1  # counted for run_summary.json
    for counters in (
        dict(executions_in_flight=29, **behind),
        dict(executions_in_flight=28, groups_ready=3, groups_remaining=6),
        dict(executions_in_flight=28, groups_ready=4, groups_remaining=0),  # all dispatched
    ):
        assert elastic_after_boundary(overcommit=0.5)(view(**counters)).transitions == ()
    assert elastic_after_boundary()(view(executions_in_flight=25, **behind)).transitions == ()
    # Never the last rollout cell while work is outstanding; with none, as the plain rule.
    last = view("TTTR", executions_in_flight=1, **behind)
    assert elastic_after_boundary(overcommit=1)(last).transitions == ()
    idle = dataclasses.replace(last, executions_in_flight=0)
    assert elastic_after_boundary(overcommit=1)(idle).transitions == ((3, T),)
    with pytest.raises(ValueError, match=r"overcommit=1\.5"):
        make_policy("elastic", overcommit=1.5)


def test_overcommit_stops_with_the_last_dispatch():
    # Gate S = 2 with 4 groups ready (B = 2) allows 2 more groups: 20 + 8 = 28 executions
    # outstanding, 4 of them without a slot. Allowed while groups remain after this
    # dispatch (or the run is unlimited), not when it sends the run's last groups.
    counters = dict(executions_in_flight=20, groups_ready=4, max_staleness=2)
    for remaining, leaves in ((3, True), (None, True), (2, False)):
        decision = elastic_after_boundary(overcommit=0.5)(
            view(groups_remaining=remaining, **counters)
        )
        assert decision.dispatch == 2
        assert decision.transitions == (((0, T),) if leaves else ())


def test_waterlevel_counts_work_about_to_be_dispatched():
    # 2 groups of 4 still to dispatch: w = 20 + 8 > 24.
    policy = elastic_after_boundary()
    decision = policy(view(executions_in_flight=20, groups_remaining=10, groups_in_flight=0))
    assert decision.dispatch == 2
    assert decision.transitions == ()


def test_serial_order_core_first_then_satellites():
    policy = elastic_after_boundary()
    assert policy(view("RRRR", executions_in_flight=0)).transitions == ((0, T),)
    assert policy(view("TRRR", executions_in_flight=0)).transitions == ((1, T),)
    assert policy(view("TTRR", executions_in_flight=0)).transitions == ((2, T),)
    # Nothing while a cell is switching.
    assert policy(view("TTRR", switching="1", executions_in_flight=0)).transitions == ()


def test_return_at_burst_end_reverse_order_until_capacity_covers():
    policy = elastic_after_boundary()
    # Burst 1 begins; 3 groups (12 executions) to dispatch; only cell 3 (8) serves.
    decision = policy(view("TTTR", burst=1, groups_remaining=3, groups_ready=2,
                           steps_per_burst=3))  # fmt: skip
    assert decision.dispatch == 3  # depth (phi + mu) * B - ready = 4, 3 remain
    assert decision.transitions == ((2, R),)
    # More work: cells return in reverse order; with the plain rule the core stays when
    # data is ready.
    policy = elastic_after_boundary(core_stays="ready")
    decision = policy(view("TTTR", burst=1, groups_remaining=9, executions_in_flight=40,
                           groups_ready=2, groups_in_flight=0))  # fmt: skip
    assert decision.transitions == ((2, R), (1, R))
    # Without ready data the core returns too.
    policy = elastic_after_boundary()
    decision = policy(view("TTTR", burst=1, executions_in_flight=40, groups_ready=0))
    assert decision.transitions == ((2, R), (1, R), (0, R))


def test_colocate_alternates():
    policy = make_policy("colocate")
    first = policy(view(groups_remaining=10, steps_per_burst=2))
    assert first == Decision(dispatch=4)  # mu * B groups
    assert policy(view(groups_in_flight=4, executions_in_flight=16)) == Decision()
    to_train = policy(view(groups_ready=4))
    assert to_train.transitions == tuple((i, T) for i in range(4))
    assert policy(view("TTTT", switching="2", groups_ready=4)) == Decision()
    assert policy(view("TTTT", groups_ready=2, step_running=True)) == Decision()
    back = policy(view("TTTT", groups_ready=0))
    assert back.transitions == tuple((i, R) for i in (3, 2, 1, 0))


def test_async_fixed_split_and_dispatch_depth():
    policy = make_policy("async", training_cells=2)
    decision = policy(view(groups_remaining=100, lookahead_bursts=1, steps_per_burst=2))
    assert decision.transitions == ((0, T), (1, T))
    assert decision.dispatch == 6  # (phi + mu) * B
    decision = policy(view("TTRR", groups_remaining=100, lookahead_bursts=1,
                           steps_per_burst=2, groups_in_flight=3, groups_ready=1))  # fmt: skip
    assert decision == Decision(dispatch=2)
    assert policy(view("TTRR", groups_remaining=1, lookahead_bursts=1)).dispatch == 1
    with pytest.raises(ValueError, match="training_cells=4 leaves no rollout cell"):
        make_policy("async", training_cells=4)(view())
    with pytest.raises(ValueError, match="training_cells=0"):
        make_policy("async", training_cells=0)


def test_dispatch_respects_the_staleness_gate():
    # S = 1, one step done since the publication, a step running: no step left for the
    # current version, so nothing may be dispatched; at a fresh burst 2 steps' worth.
    policy = make_policy("async", training_cells=1)
    busy = view("TRRR", groups_remaining=100, lookahead_bursts=3, max_staleness=1,
                steps_in_burst=1, step_running=True, steps_per_burst=2)  # fmt: skip
    assert policy(busy).dispatch == 0
    fresh = view("TRRR", groups_remaining=100, lookahead_bursts=3, max_staleness=1,
                 groups_in_flight=1)  # fmt: skip
    assert policy(fresh).dispatch == 3


def test_step_groups_finish_order_without_gate():
    assert step_groups([3, 1, 2], [0], version=5, groups_per_step=2, max_staleness=None) == [
        0,
        1,
    ]
    assert step_groups([3], [], version=5, groups_per_step=2, max_staleness=None) is None


def test_step_groups_gate_takes_oldest_and_waits_for_stragglers():
    # Version 4, S = 2: a group of version 2 is due now. Oldest versions first.
    assert step_groups([4, 3, 2], [], version=4, groups_per_step=2, max_staleness=2) == [2, 1]
    # A version-2 group still running: the step waits for it.
    assert step_groups([4, 4, 3], [2], version=4, groups_per_step=2, max_staleness=2) is None
    # A version-3 group running is due next step, with room for it: no wait.
    assert step_groups([4, 4], [3], version=4, groups_per_step=2, max_staleness=2) == [0, 1]


def test_elastic_defaults_and_plain_options():
    policy = make_policy("elastic")
    assert (policy.lookahead, policy.core_stays, policy.keep_cell) == (
        "gate", "backlog", "dispatchable")  # fmt: skip
    with pytest.raises(ValueError, match="core_stays='nope'"):
        make_policy("elastic", core_stays="nope")
    with pytest.raises(ValueError, match="lookahead='x'"):
        make_policy("elastic", lookahead="x")
    with pytest.raises(ValueError, match="keep_cell"):
        make_policy("elastic", keep_cell="never")
    with pytest.raises(ValueError, match="backlog_steps=0"):
        make_policy("elastic", backlog_steps=0)
    with pytest.raises(ValueError, match="lookahead='x'"):
        make_policy("async", training_cells=1, lookahead="x")


# A burst boundary where the new burst needs more than the satellites can give back:
# w = 40 executions, capacity 8 per cell, cell 3 serves, cells 0-2 train; 2 groups ready.
BOUNDARY = dict(burst=1, groups_remaining=9, executions_in_flight=40, groups_in_flight=0)


def test_core_returns_at_the_boundary_when_its_capacity_is_needed():
    # Satellites 2 and 1 give 24 slots: short of 40, so the core returns too ("spare",
    # and "backlog" with only one step of data waiting).
    for option in ("spare", "backlog"):
        policy = elastic_after_boundary(core_stays=option)
        decision = policy(view("TTTR", groups_ready=2, **BOUNDARY))
        assert decision.transitions == ((2, R), (1, R), (0, R))


def test_core_stays_at_the_boundary_when_the_satellites_suffice():
    # w = 20 <= 8 + 16: the satellites cover the work, the core keeps training.
    policy = elastic_after_boundary()
    decision = policy(view("TTTR", groups_ready=2, **{**BOUNDARY, "executions_in_flight": 20}))
    assert decision.transitions == ((2, R), (1, R))


def test_core_stays_at_the_boundary_with_a_training_backlog():
    # Two steps of data waiting (4 groups, B = 2): training is behind, the core stays
    # ("backlog"), but not with "spare" nor with a higher backlog_steps.
    policy = elastic_after_boundary()
    decision = policy(view("TTTR", groups_ready=4, **BOUNDARY))
    assert decision.transitions == ((2, R), (1, R))
    policy = elastic_after_boundary(core_stays="spare")
    assert policy(view("TTTR", groups_ready=4, **BOUNDARY)).transitions[-1] == (0, R)
    policy = elastic_after_boundary(backlog_steps=3)
    assert policy(view("TTTR", groups_ready=4, **BOUNDARY)).transitions[-1] == (0, R)


def gated(**counters):
    """A gated (S = 2) burst, mu = 2, phi = 1, B = 2, N = 4, in its second step."""
    values = dict(max_staleness=2, steps_per_burst=2, lookahead_bursts=1, groups_remaining=50,
                  steps_in_burst=1)  # fmt: skip
    values.update(counters)
    return view(**values)


def test_lookahead_gate_dispatches_as_far_as_the_staleness_gate_allows():
    # Gate: (S + 1 - 1 step done) * B = 4 groups may be untrained; 1 is: 3 more.
    # Depth: (phi + mu) * B = 6 minus 1 untrained = 5; "phi" takes the smaller, 3.
    assert make_policy("elastic", lookahead="phi")(gated(groups_in_flight=1)).dispatch == 3
    # With a bigger phi the depth no longer binds; "gate" ignores phi altogether.
    shallow = gated(groups_in_flight=1, lookahead_bursts=0, steps_in_burst=0)
    assert make_policy("elastic", lookahead="phi")(shallow).dispatch == 3  # depth 4 - 1
    assert make_policy("elastic")(shallow).dispatch == 5  # gate 3 * 2 - 1
    assert make_policy("async", training_cells=1, lookahead="gate")(shallow).dispatch == 5
    # Without a gate "gate" falls back to the depth.
    free = view(lookahead_bursts=1, steps_per_burst=2, groups_remaining=50, groups_in_flight=1)
    assert make_policy("elastic")(free).dispatch == 5


def test_no_idle_lookahead_cell_once_the_gate_is_full():
    # One cell left in rollout, nothing outstanding, the gate full (4 untrained groups):
    # nothing can be dispatched before the next publication, so the last cell may train.
    full = gated(roles="TTTR", groups_ready=4)
    assert elastic_after_boundary()(full).transitions == ((3, T),)
    assert elastic_after_boundary(keep_cell="always")(full).transitions == ()
    # Room under the gate (S = 5: 10 - 6 = 4) but the depth full ((phi + mu) B = 6): the
    # next step frees depth, so the cell stays to serve the lookahead.
    room = gated(roles="TTTR", groups_ready=6, max_staleness=5)
    policy = elastic_after_boundary(lookahead="phi")
    decision = policy(room)
    assert decision.dispatch == 0 and decision.transitions == ()
    # At the end of the run (nothing left to dispatch) it may train.
    done = gated(roles="TTTR", groups_ready=6, max_staleness=5, groups_remaining=0)
    assert elastic_after_boundary(lookahead="phi")(done).transitions == ((3, T),)


def test_the_scheduler_config_sets_each_policys_dispatch_depth():
    """`scheduler.lookahead` reaches async and elastic ("default": each one's own), so
    the real-run benchmark can sweep it for both as the simulator's does; and
    `scheduler.elastic_overcommit` reaches elastic."""
    from gyrejax.config import ConfigError, SchedulerConfig
    from gyrejax.scheduler.policies import policy_from_config

    def built(policy, lookahead):
        config = SchedulerConfig(policy=policy, lookahead=lookahead, async_training_cells=2)
        return policy_from_config(config)

    assert built("elastic", "default").lookahead == "gate"
    assert built("elastic", "phi").lookahead == "phi"
    assert built("async", "default").lookahead == "phi"
    assert built("async", "gate").lookahead == "gate"
    assert built("async", "gate").training_cells == 2
    assert built("colocate", "gate").label == "colocate"
    assert policy_from_config(SchedulerConfig(elastic_overcommit=0.5)).overcommit == 0.5
    with pytest.raises(ConfigError, match=r"scheduler\.elastic_overcommit=2"):
        SchedulerConfig(elastic_overcommit=2)
    with pytest.raises(ConfigError, match=r"scheduler\.lookahead='deep'"):
        SchedulerConfig(lookahead="deep")


def test_the_cell_capacity_the_policies_see():
    """`scheduler.cell_capacity` (0: the engine's slots) is what a rollout cell serves in
    the policies' view: elastic's waterlevel then frees the cells whose engines would
    only idle while agents wait on tools."""
    from gyrejax.config import Config, ConfigError, RolloutConfig, SchedulerConfig
    from gyrejax.loop.context import schedule_of

    slots = Config(rollout=RolloutConfig(max_slots=16))
    assert slots.cell_capacity == 16 and schedule_of(slots, 4).capacity == 16
    tools = dataclasses.replace(slots, scheduler=SchedulerConfig(cell_capacity=40))
    assert tools.cell_capacity == 40 and schedule_of(tools, 4).capacity == 40
    with pytest.raises(ConfigError, match=r"scheduler\.cell_capacity=-1"):
        SchedulerConfig(cell_capacity=-1)
    # 50 executions in flight, 4 cells serving: at 16 each the other three (48) cannot
    # hold them, so the core stays; at 40 each it leaves (and the next ones after it).
    for capacity, frees in ((16, False), (40, True)):
        policy = elastic_after_boundary()
        decision = policy(view(capacity=capacity, executions_in_flight=50))
        assert decision.transitions == (((0, T),) if frees else ()), capacity


def test_the_capacity_follows_the_time_agents_generate():
    """`scheduler.slot_occupancy`: a rollout cell counts as serving enough executions to
    keep its slots that busy, from the measured share of time in model calls; never
    fewer than its slots. The driver's view carries the new capacity."""
    from gyrejax.config import ConfigError, SchedulerConfig
    from gyrejax.scheduler.driver import Driver, Schedule, capacity_from_share

    assert capacity_from_share(16, 1.0, 0.2) == 80  # agents generate a fifth of the time
    assert capacity_from_share(16, 0.5, 0.2) == 40
    assert capacity_from_share(16, 1.0, 0.9) == 18  # generating most of the time: ~slots
    assert capacity_from_share(16, 0.5, 0.9) == 16  # never fewer than the slots
    assert capacity_from_share(16, 1.0, 1.5) == 16  # parallel sub-agents: still the slots
    assert capacity_from_share(16, 1.0, 0.0) == 16
    driver = Driver(Schedule(4, 16, 4, 4, 1, 1, 3, 48))
    args = dict(groups_in_flight=0, groups_ready=0, groups_dispatched=0, step_running=False)
    assert driver.view(0.0, (0, 0, 0), **args).rollout_capacity == 64
    driver.set_capacity(40)
    assert driver.view(0.0, (0, 0, 0), **args).rollout_capacity == 160
    with pytest.raises(ConfigError, match=r"scheduler\.slot_occupancy=0\.5: set with"):
        SchedulerConfig(slot_occupancy=0.5, cell_capacity=32)
    with pytest.raises(ConfigError, match=r"scheduler\.slot_occupancy=-1"):
        SchedulerConfig(slot_occupancy=-1.0)
