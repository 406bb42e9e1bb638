"""Cell-role policies: pure logic over counters and capacities, registered by name.

A policy never touches devices. After every event (an execution or group finished, a
training step finished, a transition finished, a burst began) the driver (the real
runtime, or the discrete-event simulator) hands it a `View` and carries out the
`Decision` it returns: role transitions, and how many new groups to dispatch. The same
policy object therefore drives wall-clock runs and simulations.

Shared rules every driver applies (they are not choices of a policy):
  * a training step starts whenever the core cell is TRAINING, no step runs, and at least
    B finished groups are waiting; it uses every TRAINING cell, and cells that reach
    TRAINING while it runs join it;
  * a cell leaving TRAINING waits for the step boundary; it leaves the trainer when its
    switch is requested, so it never starts a new step while queued behind other switches;
  * after every `mu` training steps the new weights are published to the rollout cells
    (a burst ends), and the burst counters d(t), p(t), f(t) restart;
  * groups are trained in the order they finish.

Role switches are serial (DESIGN.md): the training cells are always a prefix of the cell
order (core first), and rollout work prefers the cells that stay in rollout longest
(a standalone rollout pool, then the latest cells in the order).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from collections.abc import Callable, Sequence


class Role(enum.Enum):
    ROLLOUT = "rollout"
    TRAINING = "training"


@dataclasses.dataclass(frozen=True)
class CellView:
    """One cell as a policy sees it.

    Attributes:
      index: position in the fixed order; 0 is the core cell.
      role: its role, or the role it is switching to when `switching`.
      switching: a transition is under way; no decision may target this cell.
      capacity: executions it serves concurrently in rollout.
      standalone: a rollout-only pool cell (never trains).
    """

    index: int
    role: Role
    switching: bool
    capacity: int
    standalone: bool = False


@dataclasses.dataclass(frozen=True)
class View:
    """Everything a policy may look at.

    Attributes:
      now: seconds since the run started.
      cells: every cell in the fixed order (standalone pool cells last).
      group_size: N, executions per group.
      groups_per_step: B.
      steps_per_burst: mu, training steps per weight publication.
      lookahead_bursts: phi, extra bursts of dispatch depth (the staleness bound).
      burst: index of the current burst.
      dispatched, started, finished: executions of the current burst (d, p, f).
      executions_in_flight: dispatched executions not finished yet, of any burst (a
        lookahead burst may still run when the next one starts).
      groups_in_flight: dispatched groups with unfinished executions (all bursts).
      groups_ready: finished groups waiting to be trained.
      steps_in_burst: training steps completed in the current burst.
      step_running: a training step is running.
      groups_remaining: groups the run may still dispatch (None: unlimited).
      max_staleness: S, the driver's staleness gate (`step_groups`); None: no gate.
    """

    now: float
    cells: tuple[CellView, ...]
    group_size: int
    groups_per_step: int
    steps_per_burst: int
    lookahead_bursts: int
    burst: int
    dispatched: int
    started: int
    finished: int
    executions_in_flight: int
    groups_in_flight: int
    groups_ready: int
    steps_in_burst: int
    step_running: bool
    groups_remaining: int | None = None
    max_staleness: int | None = None

    @property
    def outstanding(self) -> int:
        """w(t): executions dispatched and not finished (d(t) - f(t), summed over the
        bursts still running)."""
        return self.executions_in_flight

    @property
    def steps_done(self) -> int:
        """Training steps completed in the run (every burst before this one has mu)."""
        return self.burst * self.steps_per_burst + self.steps_in_burst

    @property
    def rollout_capacity(self) -> int:
        """C_R(t): capacity of the cells in (or switching to) rollout."""
        return sum(c.capacity for c in self.cells if c.role is Role.ROLLOUT)

    @property
    def depth_groups(self) -> int:
        """(phi + mu) * B: the most groups dispatched and not yet trained."""
        return (self.lookahead_bursts + self.steps_per_burst) * self.groups_per_step

    def cell(self, index: int) -> CellView:
        return self.cells[index]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the driver does next: role transitions (carried out in the given order),
    then `dispatch` new groups onto the rollout cells."""

    transitions: tuple[tuple[int, Role], ...] = ()
    dispatch: int = 0


# Where idle cell-time goes: both drivers attribute every idle cell-second to one cause
# (the simulator's SimResult.idle_s, the runtime's run_summary.json `cell_s`).
IDLE_CAUSES = (
    "gate",  # free rollout slots while groups remain but the staleness gate holds dispatch
    "train_wait",  # trainer cells with no step running (too little data, or an older
    # group under the gate)
    "switching",  # cells in a role switch
    "boundary_wait",  # trainer cells queued to return to rollout, left out of the running
    # step, waiting for its end (a leaving cell inside the step computes until it ends)
    "tail",  # any idle after the run's last group was dispatched (the straggler tail)
    "other",  # free slots while the gate would allow dispatch but the policy holds it
)


Policy = Callable[[View], Decision]
_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str):
    def register(factory):
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return register


def make_policy(name: str, **kwargs) -> Policy:
    """A new policy object (policies may keep state across decisions)."""
    return _factory(name)(**kwargs)


def policy_from_config(scheduler) -> Policy:
    """The policy a `SchedulerConfig` names, with the options it sets that the policy
    takes."""
    options = options_from_fields(vars(scheduler))
    return make_policy(scheduler.policy, **policy_options(scheduler.policy, **options))


# The SchedulerConfig fields that are policy options: option -> (field, its default). A
# run's recorded schedule names them as the config does (gyrejax.scheduler.calibrate).
OPTION_FIELDS = {
    "training_cells": ("async_training_cells", 1.0),
    "overcommit": ("elastic_overcommit", 0.0),
}


def options_from_fields(fields) -> dict:
    """The policy options scheduler fields set (a SchedulerConfig's, or a run's recorded
    schedule): a field absent (a run logged before it was recorded) takes its default;
    `lookahead` "default" (or absent) is left out: the policy's own."""
    options = {name: fields.get(field, default) for name, (field, default) in OPTION_FIELDS.items()}
    if fields.get("lookahead", "default") != "default":
        options["lookahead"] = fields["lookahead"]
    return options


def policy_options(name: str, **options) -> dict:
    """The `options` that policy `name` takes (the others are left out), so one set of
    options serves every policy: e.g. `training_cells` only matters to "async"."""
    accepted = inspect.signature(_factory(name)).parameters
    return {k: v for k, v in options.items() if k in accepted}


def _factory(name: str) -> Callable[..., Policy]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def known_policies() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def step_groups(
    ready_versions: Sequence[int],
    in_flight_versions: Sequence[int],
    version: int,
    groups_per_step: int,
    max_staleness: int | None,
) -> list[int] | None:
    """Which ready groups the next training step takes (a driver rule).

    Without a staleness gate: the B oldest-finished. With `max_staleness` S, a group
    sampled with rollout version v must be trained by the step at trainer version v + S
    (its deadline): the step takes the ready groups with the oldest versions (finish order
    among equals), and waits (returns None) while that would leave some deadline unmet
    that waiting for an older in-flight group could still meet: after this step at
    version k, at most j * B of the other untrained groups may have deadlines <= k + j.

    Args:
      ready_versions: rollout version of each ready group, in finish order.
      in_flight_versions: rollout version of each dispatched group not finished yet.
      version: k, the trainer version the step starts from.
      groups_per_step: B.
      max_staleness: S, or None for no gate.

    Returns:
      Indices into `ready_versions` (B of them), or None when the step must wait.
    """
    b = groups_per_step
    if len(ready_versions) < b:
        return None
    if max_staleness is None:
        return list(range(b))
    order = sorted(range(len(ready_versions)), key=lambda i: (ready_versions[i], i))
    chosen = order[:b]
    left = sorted([ready_versions[i] for i in order[b:]] + list(in_flight_versions))
    feasible = all(
        count <= (v + max_staleness - version) * b for count, v in enumerate(left, start=1)
    )
    newest_chosen = max(ready_versions[i] for i in chosen)
    if not feasible and any(v < newest_chosen for v in in_flight_versions):
        return None  # an older group is still running: wait for it rather than break S
    return chosen


def gate_allowance(view: View) -> int | None:
    """Groups the staleness gate still lets be untrained (None: no gate).

    Every untrained group carries a rollout version <= the current one, v; with the gate it
    must be trained at trainer version <= v + S. The steps left for that are S + 1 - (steps
    since v was published) - (the running step, whose groups are taken), so only that many
    steps' worth of groups may be untrained at once.
    """
    if view.max_staleness is None:
        return None
    steps_left = view.max_staleness + 1 - view.steps_in_burst - int(view.step_running)
    return steps_left * view.groups_per_step - (view.groups_in_flight + view.groups_ready)


def _undispatched_depth(view: View, lookahead: str = "phi") -> int:
    """Groups that may be dispatched now.

    lookahead "phi": the dispatch depth (phi + mu) B - (in flight + ready), and no more
    than the staleness gate allows. "gate": with a staleness gate, only the gate limits
    (phi is not used; without a gate it falls back to "phi").
    """
    untrained = view.groups_in_flight + view.groups_ready
    gate = gate_allowance(view)
    if lookahead == "gate" and gate is not None:
        allowed = gate
    else:
        allowed = view.depth_groups - untrained
        if gate is not None:
            allowed = min(allowed, gate)
    if view.groups_remaining is not None:
        allowed = min(allowed, view.groups_remaining)
    return max(0, allowed)


_LOOKAHEADS = ("phi", "gate")


def _check_option(policy: str, name: str, value, known: tuple) -> None:
    if value not in known:
        raise ValueError(f"{policy} policy: {name}={value!r}, expected one of {known}")


def _trainable(cells: tuple[CellView, ...]) -> list[CellView]:
    return [c for c in cells if not c.standalone]


@register_policy("colocate")
class Colocate:
    """Every cell rolls out a burst, then every cell trains it, alternating.

    A burst dispatches mu * B groups; once all of them have finished, every cell trains
    (mu steps); when no full step of data is left, every cell returns to rollout and the
    next burst is dispatched.
    """

    label = "colocate"

    def __call__(self, view: View) -> Decision:
        if any(c.switching for c in view.cells):
            return Decision()
        trainable = _trainable(view.cells)
        training = [c for c in trainable if c.role is Role.TRAINING]
        if training:
            if view.groups_ready < view.groups_per_step and not view.step_running:
                return Decision(tuple((c.index, Role.ROLLOUT) for c in reversed(training)))
            return Decision()
        if view.groups_in_flight == 0 and view.groups_ready == 0:
            want = view.steps_per_burst * view.groups_per_step
            if view.groups_remaining is not None:
                want = min(want, view.groups_remaining)
            return Decision(dispatch=want)
        if view.groups_in_flight == 0 and view.groups_ready >= view.groups_per_step:
            return Decision(tuple((c.index, Role.TRAINING) for c in trainable))
        return Decision()


def cells_at_step(training_cells: float, step: int) -> int:
    """The whole cells that train step `step` under a split of `training_cells` (a
    fraction alternates the whole splits around it, `Async`)."""
    x = training_cells
    return math.floor(x * (step + 1) + 1e-9) - math.floor(x * step + 1e-9)


@register_policy("async")
class Async:
    """A fixed split: the first `training_cells` cells train, the rest roll out.

    Rollout keeps (phi + mu) * B groups dispatched-or-waiting (bounded staleness);
    training consumes groups as they become ready.

    Args:
      training_cells: the size of the training prefix. A fraction x is a split between
        two whole numbers of cells: step t trains on floor(x (t + 1)) - floor(x t) cells
        (x = 3.5: 3, 4, 3, 4, ...; x = 11/3: 3, 4, 4, ...; a cell moves at most once per
        step boundary), so x cells train on average. A whole number never moves a cell.
      lookahead: "phi" (default) keeps the (phi + mu) * B dispatch depth; "gate" lets only
        the staleness gate limit dispatch (as elastic's option of the same name), so that a
        benchmark can tune async over it too.
    """

    def __init__(self, training_cells: float = 1, lookahead: str = "phi"):
        if training_cells < 1:
            raise ValueError(f"async policy: training_cells={training_cells}, expected >= 1")
        _check_option("async", "lookahead", lookahead, _LOOKAHEADS)
        self.training_cells = training_cells
        self.lookahead = lookahead
        self.label = f"async({training_cells:.4g})"  # the split names an async run

    def split(self, view: View) -> int:
        """Cells in training for the next step (exactly `training_cells` when whole)."""
        return cells_at_step(self.training_cells, view.steps_done)

    def __call__(self, view: View) -> Decision:
        trainable = _trainable(view.cells)
        if math.ceil(self.training_cells) >= len(view.cells):
            raise ValueError(
                f"async policy: training_cells={self.training_cells} leaves no rollout cell "
                f"among {len(view.cells)}"
            )
        k = self.split(view)
        transitions = [
            (c.index, Role.TRAINING)
            for c in trainable[:k]
            if c.role is not Role.TRAINING and not c.switching
        ]
        transitions += [  # a fractional split's extra cell, back to rollout
            (c.index, Role.ROLLOUT)
            for c in reversed(trainable[k:])
            if c.role is Role.TRAINING and not c.switching
        ]
        return Decision(tuple(transitions), dispatch=_undispatched_depth(view, self.lookahead))


@register_policy("elastic")
class Elastic:
    """The waterlevel trigger (DESIGN.md, Cells and roles), with three refinements.

    During a burst the outstanding work w(t) = d(t) - f(t) only falls. The next cell e in
    the order may leave rollout when w(t) <= C_R(t) - C_e: the rollout capacity left
    without it still covers every outstanding execution. At a burst boundary the next
    burst is dispatched and cells return to rollout in reverse order until the rollout
    capacity covers the work.

    Options (defaults: the best measured in benchmarks/schedule_bench.py; the other values
    give the plain waterlevel rule of DESIGN.md, for ablation):
      min_rollout_cells: cells that never leave rollout (besides a standalone pool).
      lookahead: "gate" (default): with a staleness gate S, dispatch as far ahead as the
        gate allows, so stragglers are carried over for as many steps as S permits and the
        rollout cells never wait for the dispatch depth; "phi": keep the (phi + mu) B
        depth as well. Without a gate both are "phi".
      core_stays: whether the core cell stays in training at a burst boundary (where it
        may stay only if the next step's data is ready). A step started at the boundary
        holds every satellite queued to return until it ends (switches are serial and a
        cell leaves training at a step boundary), so the new burst's executions wait.
        "backlog" (default): the core stays if the satellites that return without it
        cover the new burst's work, or if at least `backlog_steps` steps of data are
        waiting (training is behind, and a trainer without the core would idle until
        the waterlevel sends it back); "spare": only in the first case; "ready" (the
        plain rule): whenever the next step's data is ready.
      backlog_steps: see core_stays.
      keep_cell: one cell stays in rollout without a standalone pool when phi > 0.
        "dispatchable" (default): only while the run and the staleness gate still allow
        dispatch before the next publication (when nothing more can be dispatched, the
        cell only idles, and the last steps of a burst run on one cell fewer); "always":
        whenever phi > 0.
      overcommit: while training is behind (at least `backlog_steps` steps of data
        waiting), the next cell may leave rollout when the rest cover all but this share
        of a cell's capacity of the outstanding executions (0, the plain rule: all of
        them). The executions left without a slot wait for the next to finish, minutes
        when hundreds run for hours, while the cell trains at once; a waterlevel of
        whole cells otherwise leaves up to a cell's slots idle under the gate. Never the
        last rollout cell while work is outstanding, and not once the run has dispatched
        every group (the executions still out are its last: they finish ever further
        apart, and one left waiting delays the end). 0 by default: it pays where the
        cells' work binds (8 x 32 at S = 8 in the benchmark: 0.75-1) and only delays
        executions where the gate does.
    """

    def __init__(
        self,
        min_rollout_cells: int = 0,
        lookahead: str = "gate",
        core_stays: str = "backlog",
        keep_cell: str = "dispatchable",
        backlog_steps: int = 2,
        overcommit: float = 0.0,
    ):
        _check_option("elastic", "lookahead", lookahead, _LOOKAHEADS)
        _check_option("elastic", "core_stays", core_stays, ("backlog", "spare", "ready"))
        if backlog_steps < 1:
            raise ValueError(f"elastic policy: backlog_steps={backlog_steps}, expected >= 1")
        _check_option("elastic", "keep_cell", keep_cell, ("dispatchable", "always"))
        if not 0 <= overcommit <= 1:
            raise ValueError(f"elastic policy: overcommit={overcommit}, expected in [0, 1]")
        self.min_rollout_cells = min_rollout_cells
        self.lookahead = lookahead
        self.core_stays = core_stays
        self.keep_cell = keep_cell
        self.backlog_steps = backlog_steps
        self.overcommit = overcommit
        self.overcommitted = 0  # leaves with executions left waiting (run_summary.json)
        self._burst_seen = -1

    label = "elastic"

    def __call__(self, view: View) -> Decision:
        trainable = _trainable(view.cells)
        dispatch = _undispatched_depth(view, self.lookahead)
        if any(c.switching for c in view.cells):  # serial switches: one at a time
            return Decision(dispatch=dispatch)
        if view.burst != self._burst_seen:  # a burst boundary: make room for its dispatch
            self._burst_seen = view.burst
            returns = self._return_for_burst(view, trainable, dispatch)
            if returns.transitions:
                return returns
            # Nothing needs to return: the waterlevel rule applies at once (answering
            # nothing here would leave a driver that asks only after events stuck).
        # Waterlevel: the next cell in order leaves rollout while the rest still covers w.
        rollout = [c for c in trainable if c.role is Role.ROLLOUT]
        keep = self.min_rollout_cells + int(self._keeps_a_cell(view))
        capacity = view.rollout_capacity
        outstanding = view.outstanding + dispatch * view.group_size
        if capacity == 0 and outstanding > 0:  # work but nobody to serve it: bring one back
            last = [c for c in trainable if c.role is Role.TRAINING][-1]
            return Decision(((last.index, Role.ROLLOUT),), dispatch=dispatch)
        if (
            rollout
            and len(rollout) > keep
            and self._may_leave(view, rollout[0], outstanding, dispatch)
        ):
            if outstanding > capacity - rollout[0].capacity:
                self.overcommitted += 1
            return Decision(((rollout[0].index, Role.TRAINING),), dispatch=dispatch)
        return Decision(dispatch=dispatch)

    def _may_leave(self, view: View, cell: CellView, outstanding: int, dispatch: int) -> bool:
        """Whether `cell` may leave rollout with `outstanding` executions to serve, of
        which `dispatch` groups' are dispatched now."""
        left = view.rollout_capacity - cell.capacity
        if outstanding <= left:
            return True
        behind = view.groups_ready >= self.backlog_steps * view.groups_per_step
        # An execution left waiting gets the next free slot, which comes soon only while
        # the run keeps dispatching: once every group is out, those still running are the
        # run's last, they finish ever further apart, and a wait delays the end itself.
        dispatching = view.groups_remaining is None or view.groups_remaining > dispatch
        unserved = outstanding - left
        return left > 0 and behind and dispatching and unserved <= self.overcommit * cell.capacity

    def _keeps_a_cell(self, view: View) -> bool:
        """Without a standalone pool, one cell keeps serving the lookahead (phi > 0)."""
        if not view.lookahead_bursts or any(c.standalone for c in view.cells):
            return False
        if self.keep_cell == "always":
            return True
        if view.groups_remaining is not None and view.groups_remaining <= 0:
            return False  # nothing left to dispatch in this run
        gate = gate_allowance(view)
        if gate is None:
            return True
        # A finished step frees B groups of room but also one step of the gate: the room
        # only grows at the next publication.
        return gate > 0

    def _return_for_burst(self, view: View, trainable, dispatch: int) -> Decision:
        """Cells return in reverse order until rollout covers the new burst's work."""
        needed = view.outstanding + dispatch * view.group_size
        capacity = view.rollout_capacity
        core = trainable[0]
        core_stays = view.groups_ready >= view.groups_per_step
        if core_stays and self.core_stays != "ready":
            others = sum(c.capacity for c in trainable[1:] if c.role is Role.TRAINING)
            backlog = view.groups_ready >= self.backlog_steps * view.groups_per_step
            core_stays = capacity + others >= needed or (self.core_stays == "backlog" and backlog)
        transitions = []
        for cell in reversed(trainable):
            if capacity >= needed:
                break
            if cell.role is not Role.TRAINING:
                continue
            if cell.index == core.index and core_stays:
                break
            transitions.append((cell.index, Role.ROLLOUT))
            capacity += cell.capacity
        return Decision(tuple(transitions), dispatch=dispatch)
