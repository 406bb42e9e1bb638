"""The driver rules both drivers of a policy apply, written once: what the policy sees
and how its decisions about roles are carried out.

The RL loop (`gyrejax.loop`, wall clock) and the simulator (`simulator.py`, modelled
time) each keep one `Driver`. It holds the cells' roles and switches, the burst
counters and the queue of requested transitions, and builds the `View` a policy sees.
The rules (also in the policies.py docstring):

  * a requested transition is queued and carried out serially, in request order; the
    View shows the target role while the cell switches, and no decision may target a
    switching cell (`request_transition`);
  * a cell queued to return to rollout leaves the trainer when its switch is requested,
    so it never starts a new step while it waits behind other switches (`returning`);
  * a training step starts when the core is TRAINING and not switching and no step
    runs (`step_may_start`), and takes the groups `policies.step_groups` picks
    (`choose_groups`);
  * after every `mu` steps the weights are published and a burst begins: the burst
    counters d, p, f restart and new groups carry the new rollout version
    (`step_done`, `begin_burst`).

Pure Python, like the policies: no JAX, no devices.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence

from gyrejax.scheduler.policies import CellView, Role, View, gate_allowance, step_groups


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a driver needs of the run's configuration.

    Attributes:
      cells: K, the cells in the policy's order (cell 0 is the core).
      capacity: executions one cell serves concurrently in rollout.
      group_size: N.
      groups_per_step: B.
      mu: steps per publication (a burst).
      phi: extra bursts of dispatch depth.
      max_staleness: S, the staleness gate; None: no gate.
      groups_total: groups the run dispatches in all (steps * B).
    """

    cells: int
    capacity: int
    group_size: int
    groups_per_step: int
    mu: int
    phi: int
    max_staleness: int | None
    groups_total: int


def capacity_from_share(max_slots: int, occupancy: float, share: float) -> int:
    """Executions a rollout cell counts as serving when they spend `share` of their wall
    time in model calls: enough to keep its `max_slots` slots `occupancy` busy on
    average (an agent waiting on a tool holds no slot), and never fewer than the slots.
    Calls queue when slots are short, which raises the measured share: the capacity
    then falls back, a feedback that settles."""
    if share <= 0:
        return max_slots
    return max(max_slots, round(max_slots * occupancy / share))


def dispatch_block(groups_per_step: int, max_staleness: int | None) -> int:
    """Tasks that "longest_first" reorders among themselves: S steps' groups (one step's
    without a gate or at S = 0). The gate already lets a group train S steps after its
    dispatch, so a task still trains within about S steps of its turn in the data."""
    return groups_per_step * max(1, max_staleness or 0)


def dispatch_permutation(hints: Sequence[float], block: int) -> list[int]:
    """The data index of the task each dispatch takes ("longest_first"): within each
    block of `block` consecutive tasks, the longest expected (`hints`: each task's
    expected duration, e.g. its family's median) first; ties keep the data order.

    Why: the run's makespan is at least its last dispatch plus the longest execution
    dispatched then. Starting a block's long tasks first leaves the short ones for the
    end, so the tail after the last dispatch shortens, for every policy."""
    order: list[int] = []
    for start in range(0, len(hints), block):
        chunk = range(start, min(len(hints), start + block))
        order += sorted(chunk, key=lambda i: -hints[i])  # sorted is stable
    return order


# Where a run's wall time goes on the trainer's side (`trainer_time`).
TRAINER_TIME = ("before_first_step", "training", "between_steps", "after_last_step")


def trainer_time(steps: Sequence[tuple[float, float]], end: float) -> dict[str, float]:
    """A run's wall time from the trainer's side (`TRAINER_TIME`): before its first step,
    in steps, between steps, after the last one. Steps run one at a time, so the four
    sum to `end`. More training cells shorten "training" alone; the time the trainer
    waits for data (rollout, the gate) shows before and between its steps.

    Args:
      steps: (start, end) of each step, in order, in seconds (or any one unit).
      end: the run's end, in the same unit.
    """
    if not steps:
        return dict(zip(TRAINER_TIME, (float(end), 0.0, 0.0, 0.0), strict=True))
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(steps)]
    return {
        "before_first_step": float(steps[0][0]),
        "training": float(sum(e - s for s, e in steps)),
        "between_steps": float(sum(gaps)),
        "after_last_step": float(end - steps[-1][1]),
    }


def logged_trainer_time(rows: Sequence[dict], end: float, after_step: int = 0) -> dict:
    """`trainer_time` of the steps a run logged (`metrics.jsonl` rows: each step ends at
    `time_s`, `step_s` after it began), those after step `after_step` only (a resumed
    process's own: earlier rows were timed by an earlier process's clock)."""
    spans = [(r["time_s"] - r["step_s"], r["time_s"]) for r in rows if r["step"] > after_step]
    return trainer_time(spans, end)


class GenerationShare:
    """The share of the last `window` finished executions' wall time spent in model calls
    (what `capacity_from_share` sizes a rollout cell from; the runtime and the simulator
    both keep one)."""

    def __init__(self, window: int = 64):
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)

    def add(self, calls_s: float, wall_s: float) -> None:
        """An execution finished: `calls_s` of its `wall_s` were in model calls."""
        self._recent.append((calls_s, wall_s))

    def share(self) -> float | None:
        """None until an execution finished."""
        wall = sum(w for _, w in self._recent)
        return sum(c for c, _ in self._recent) / wall if wall > 0 else None


class Driver:
    """Roles, switches, bursts and the transition queue of one run (module docstring)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        k = schedule.cells
        self.roles = [Role.ROLLOUT] * k  # or the role a switching cell switches to
        self.switching = [False] * k
        # Requested transitions not begun yet, in order: (cell, role, burst that asked).
        self.pending: collections.deque[tuple[int, Role, int]] = collections.deque()
        self.burst = 0
        self.steps_in_burst = 0
        self.burst_base = (0, 0, 0)  # executions (dispatched, started, finished) then
        self.rollout_version = 0  # the weights the rollout engines sample with
        self.gate_closed = False  # the gate allowed no more dispatch at the last decision
        self._cell_views: tuple[CellView, ...] | None = None  # rebuilt when a role changes

    # --- what the policy sees -----------------------------------------------------------

    def view(
        self,
        now: float,
        totals: Sequence[int],
        *,
        groups_in_flight: int,
        groups_ready: int,
        groups_dispatched: int,
        step_running: bool,
    ) -> View:
        """The policy's `View`.

        Args:
          now: seconds since the run started.
          totals: executions (dispatched, started, finished) since the run started.
          groups_in_flight: dispatched groups with unfinished executions.
          groups_ready: finished groups not trained yet.
          groups_dispatched: groups dispatched since the run started.
          step_running: a training step runs.
        """
        s = self.schedule
        if self._cell_views is None:
            self._cell_views = tuple(
                CellView(i, self.roles[i], self.switching[i], s.capacity) for i in range(s.cells)
            )
        d, p, f = totals
        d0, p0, f0 = self.burst_base
        return View(
            now=now,
            cells=self._cell_views,
            group_size=s.group_size,
            groups_per_step=s.groups_per_step,
            steps_per_burst=s.mu,
            lookahead_bursts=s.phi,
            burst=self.burst,
            dispatched=d - d0,
            started=p - p0,
            finished=f - f0,
            executions_in_flight=d - f,
            groups_in_flight=groups_in_flight,
            groups_ready=groups_ready,
            steps_in_burst=self.steps_in_burst,
            step_running=step_running,
            groups_remaining=max(0, s.groups_total - groups_dispatched),
            max_staleness=s.max_staleness,
        )

    def note_gate(self, view: View, dispatch: int = 0) -> None:
        """Records whether the staleness gate holds dispatch once `dispatch` more groups
        of `view` went out (idle slots are then the gate's, not the policy's)."""
        gate = gate_allowance(view)
        self.gate_closed = gate is not None and gate <= dispatch

    def set_capacity(self, capacity: int) -> None:
        """Each rollout cell now counts as serving `capacity` executions (the runtime's
        `scheduler.slot_occupancy`, from the measured share of time in model calls)."""
        if capacity != self.schedule.capacity:
            self.schedule = dataclasses.replace(self.schedule, capacity=capacity)
            self._cell_views = None

    # --- transitions --------------------------------------------------------------------

    def request_transition(self, index: int, role: Role) -> bool:
        """Queues a policy's transition of cell `index` to `role`; False (nothing to do)
        if the cell switches already or has that role. The caller takes a cell returning
        to rollout out of the trainer now (see `returning`)."""
        if self.switching[index] or self.roles[index] is role:
            return False
        self.switching[index] = True
        self.roles[index] = role  # the View shows the target role while switching
        self._cell_views = None
        self.pending.append((index, role, self.burst))
        return True

    def next_transition(self) -> tuple[int, Role, int] | None:
        """The oldest queued transition, taken off the queue (None: none is queued)."""
        return self.pending.popleft() if self.pending else None

    def finish_transition(self, index: int) -> None:
        """Cell `index` has its new role."""
        self.switching[index] = False
        self._cell_views = None

    def returning(self) -> set[int]:
        """Cells queued to return to rollout: no new step may include them."""
        return {index for index, role, _ in self.pending if role is Role.ROLLOUT}

    # --- steps and bursts ---------------------------------------------------------------

    def step_may_start(self, step_running: bool) -> bool:
        """No step runs and the core is TRAINING, not switching."""
        return not step_running and self.roles[0] is Role.TRAINING and not self.switching[0]

    def choose_groups(
        self, ready_versions: Sequence[int], in_flight_versions: Sequence[int], version: int
    ) -> list[int] | None:
        """Indices into `ready_versions` that the next step trains (`step_groups` under
        this run's B and S), or None: it must wait."""
        s = self.schedule
        if len(ready_versions) < s.groups_per_step:
            return None
        return step_groups(
            ready_versions, in_flight_versions, version, s.groups_per_step, s.max_staleness
        )

    def over_stale(self, staleness: int) -> bool:
        """A group trained this many versions after its rollout version breaks the gate."""
        return self.schedule.max_staleness is not None and staleness > self.schedule.max_staleness

    def step_done(self) -> bool:
        """Counts a finished step; True when it ends the burst (publish, then
        `begin_burst`)."""
        self.steps_in_burst += 1
        return self.steps_in_burst >= self.schedule.mu

    def begin_burst(self, totals: Sequence[int], version: int) -> None:
        """The weights of `version` are published: a new burst begins at `totals`."""
        self.rollout_version = version
        self.burst += 1
        self.steps_in_burst = 0
        self.burst_base = tuple(totals)

    def roles_text(self) -> str:
        """One letter per cell: R(ollout), T(raining), s(witching)."""
        return "".join(
            "s" if self.switching[i] else self.roles[i].value[0].upper()
            for i in range(self.schedule.cells)
        )
