"""A discrete-event simulator of the cell-role policies (pure Python/NumPy; no JAX).

It runs the very policy objects the runtime runs (`policies.make_policy`) over modelled
executions, so cluster-scale claims (hours of rollout, dozens of cells) can be checked on
one machine in a second. The driver rules are the runtime's (gyrejax/scheduler/runtime.py
and the policies.py docstring):

  * after every event the policy sees a `View` and its `Decision` is carried out: first
    `dispatch` new groups (in sequence order, so every policy runs the same executions of
    a `Trace`), then the transitions, then a training step starts if it can. The policy is
    asked again until it asks for nothing new (the runtime re-asks after every event and
    at least once a second);
  * a training step starts when the core cell is TRAINING (not switching), no step runs
    and >= B groups are ready, oldest-finished first; it uses every cell in the trainer;
    a cell whose rollout -> training switch completes mid-step joins it;
  * transitions are serial (one at a time, in request order). rollout -> training: the
    cell stops serving when its switch begins (its executions migrate to the other
    rollout cells), takes `to_training_s`, then joins the trainer. training -> rollout:
    the cell first waits for the step boundary (still training; the queue of switches
    waits with it, as in the runtime), then takes `to_rollout_s`, then serves;
  * after every mu steps the weights are published (instantly) and a burst begins: the
    burst counters d, p, f restart and new groups carry the new rollout version;
  * the run ends when `steps` steps are done (unfinished executions are dropped; with
    `groups_remaining` the policies dispatch exactly steps * B groups).

One optional rule is not in the runtime: `max_staleness` S (None: off, the runtime's
behaviour). With S set, a step at trainer version k must include every untrained group
dispatched at rollout version <= k - S (it waits until they have finished) and takes
those first, then fills up to B in finish order; so no group is ever trained more than S
versions after the weights it was sampled with (`step_groups` in policies.py holds the
rule so that the runtime can adopt it).

The model (assumptions, stated so that nobody reads more into the figures):
  * an execution needs one rollout slot for `duration` seconds of progress; it progresses
    only while it holds a slot, at the same speed whatever the load of its cell (no
    batching speed-up or slow-down); durations are lognormal, capped at `timeout_s`
    (a timed-out execution is still scored and trained, DESIGN.md "Partial credit");
  * the rollout cells form one pool of slots (`capacity` per serving cell). When a cell
    stops serving, executions that no longer fit are paused, the most recently started
    first, and resume first (migration itself costs nothing: KV copies take seconds,
    executions take hours); waiting executions start in dispatch order;
  * a training step costs `train_s_per_token` cell-seconds per token of its groups'
    executions and progresses at a rate proportional to the number of cells in the
    trainer (greedy micro-step claiming: perfect data-parallel scaling); the cross-cell
    reduction, optimizer update and weight publication are free;
  * a cell is busy in proportion to its occupied slots (k of c slots busy: k/c busy) or
    while it computes a step; switching and waiting cells are idle. Hence utilisation =
    work / (cells * makespan) = lower bound / makespan, where the lower bound is the total
    work (rollout slot-seconds / capacity + train cell-seconds) over the cells. With a gate
    S the critical path can be longer than that: `staleness_bound_s` is a lower bound on
    the makespan of any policy that respects the gate. The result also splits the idle
    time (free slots on serving cells, trainer cells with no step running) so that the
    benchmark can show where a policy loses time.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Mapping

import numpy as np

from gyrejax.scheduler.policies import CellView, Policy, Role, View, make_policy, step_groups

HOUR = 3600.0


class SimulationError(RuntimeError):
    """The simulated run cannot make progress (a policy or configuration deadlock)."""


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """A simulated cluster, workload and RL schedule.

    Attributes:
      cells: K homogeneous cells; cell 0 is the core.
      capacity: executions one cell serves concurrently in rollout.
      group_size: N executions per group.
      groups_per_step: B groups per training step.
      steps: training steps of the run.
      mu: steps per weight publication (a burst).
      phi: extra bursts of dispatch depth.
      max_staleness: S, the staleness gate (see the module docstring); None: off.
      duration_median_s, duration_sigma: lognormal execution durations (seconds of
        progress while holding a slot) ...
      timeout_s: ... capped here.
      tokens_mean: mean tokens of an execution; tokens are proportional to its duration
        times a lognormal factor (sigma `tokens_sigma`), scaled to this mean.
      train_s_per_token: cell-seconds of training per token.
      to_training_s, to_rollout_s: switch costs (published: 8.52 s and 3.46 s).
      seed: seed of the trace (durations and tokens).
    """

    cells: int = 8
    capacity: int = 8
    group_size: int = 8
    groups_per_step: int = 4
    steps: int = 12
    mu: int = 1
    phi: int = 1
    max_staleness: int | None = None
    duration_median_s: float = 4.6 * HOUR
    duration_sigma: float = 0.5
    timeout_s: float = 10 * HOUR
    tokens_mean: float = 700_000.0
    tokens_sigma: float = 0.3
    train_s_per_token: float = 1e-3
    to_training_s: float = 8.5
    to_rollout_s: float = 3.5
    seed: int = 0

    def __post_init__(self):
        for name in ("cells", "capacity", "group_size", "groups_per_step", "steps", "mu"):
            if getattr(self, name) < 1:
                raise ValueError(f"sim.{name}={getattr(self, name)}, expected >= 1")
        if self.cells < 2:
            raise ValueError(f"sim.cells={self.cells}, expected >= 2")
        if self.phi < 0:
            raise ValueError(f"sim.phi={self.phi}, expected >= 0")
        if self.max_staleness is not None and self.max_staleness < self.mu - 1:
            raise ValueError(
                f"sim.max_staleness={self.max_staleness}, expected >= mu - 1 = {self.mu - 1} "
                "(a burst's last step trains groups mu - 1 versions old)"
            )
        for name in ("duration_median_s", "timeout_s", "tokens_mean"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sim.{name}={getattr(self, name)}, expected > 0")
        for name in ("duration_sigma", "tokens_sigma", "train_s_per_token", "to_training_s",
                     "to_rollout_s"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"sim.{name}={getattr(self, name)}, expected >= 0")

    @classmethod
    def from_dict(cls, values: Mapping) -> SimConfig:
        """From any mapping (e.g. `ConfigDict.to_dict()`); unknown keys are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"sim config: unknown fields {unknown}; known: {sorted(names)}")
        return cls(**dict(values))

    def replace(self, **changes) -> SimConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Trace:
    """The executions of a run, indexed [group seq, member]; the same for every policy.

    Attributes:
      duration_s: float64[groups, group_size], capped at the timeout.
      tokens: float64[groups, group_size].
      timed_out: bool[groups, group_size].
    """

    duration_s: np.ndarray
    tokens: np.ndarray
    timed_out: np.ndarray

    @property
    def groups(self) -> int:
        return self.duration_s.shape[0]


def make_trace(config: SimConfig, seed: int | None = None) -> Trace:
    """Samples steps * B groups of executions (deterministic for a seed)."""
    rng = np.random.default_rng(config.seed if seed is None else seed)
    shape = (config.steps * config.groups_per_step, config.group_size)
    raw = config.duration_median_s * np.exp(config.duration_sigma * rng.standard_normal(shape))
    duration = np.minimum(raw, config.timeout_s)
    weight = duration * np.exp(config.tokens_sigma * rng.standard_normal(shape))
    tokens = config.tokens_mean * weight / weight.mean()
    return Trace(duration, tokens, raw >= config.timeout_s)


def lower_bound_s(config: SimConfig, trace: Trace) -> float:
    """Total work over the cells: rollout slot-seconds / capacity + train cell-seconds."""
    work = trace.duration_s.sum() / config.capacity
    work += trace.tokens.sum() * config.train_s_per_token
    return float(work / config.cells)


def staleness_bound_s(config: SimConfig, trace: Trace) -> float:
    """A lower bound on the makespan of any policy under the staleness gate S.

    `lower_bound_s` ignores time: with a gate, the critical path can be longer than the
    work. Rollout version v = mu b is published when step mu b - 1 ends (P_b), so step k
    may train groups of bursts b with mu b <= k and k - mu b <= S only. Hence the steps
    k' <= k whose every admissible burst is >= b need n = B * (their number) groups that
    were all dispatched at or after P_b, and step k cannot start before P_b + (the n-th
    shortest group duration, a group lasting as long as its longest execution, among the
    groups those can be). Those groups are consecutive in dispatch order (`Trace` order)
    within a window: at P_b at least B mu b groups were trained (so dispatched before),
    at most (S + 1) B untrained groups of a version can exist (each must be trained in
    one of S + 1 steps), so the window starts in [B mu b, B mu b + (S + 1) B] and spans at
    most (S + 1) B groups per burst it covers. Every group must be trained, so the last
    step also waits for the groups past the last possible window start. Steps run one at
    a time and take at least the training of the B groups with the fewest tokens on all
    cells. The bound is the larger of that chain and `lower_bound_s`; it holds for any
    policy that respects the gate and dispatches in order (it assumes dispatch at P_b and
    instant switches, so it is loose).
    """
    work = lower_bound_s(config, trace)
    s_max, mu, b_groups = config.max_staleness, config.mu, config.groups_per_step
    if s_max is None:
        return work
    longest = trace.duration_s.max(axis=1)
    groups = len(longest)
    tokens = np.sort(trace.tokens.sum(axis=1))
    step_min = float(tokens[:b_groups].sum()) * config.train_s_per_token / config.cells
    per_version = (s_max + 1) * b_groups

    def first_burst(k: int) -> int:  # the oldest burst step k may train
        return max(0, -(-(k - s_max) // mu))

    cache: dict[tuple[int, int, int], float] = {}

    def shortest(n: int, burst: int, bursts: int) -> float:
        """The n-th shortest group among the windows that burst's groups can occupy."""
        key = (n, burst, bursts)
        if key not in cache:
            low = b_groups * mu * burst
            best = np.inf
            for start in range(low, min(low + per_version, groups) + 1):
                window = np.sort(longest[start : start + bursts * per_version])
                if len(window) >= n:
                    best = min(best, float(window[n - 1]))
            cache[key] = 0.0 if best == np.inf else best
        return cache[key]

    published = [0.0]
    end = 0.0
    for k in range(config.steps):
        start = end
        for burst in range(k // mu + 1):
            n = b_groups * sum(1 for j in range(k + 1) if first_burst(j) >= burst)
            if n:
                start = max(start, published[burst] + shortest(n, burst, k // mu - burst + 1))
        if k == config.steps - 1:
            rest = longest[b_groups * mu * (k // mu) + per_version :]
            if len(rest):
                start = max(start, published[k // mu] + float(rest.max()))
        end = start + step_min
        if (k + 1) % mu == 0:
            published.append(end)
    return max(work, end)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What one simulated run did.

    Attributes:
      makespan_s: time when the last step finished.
      utilisation: busy cell-seconds / (cells * makespan).
      lower_bound_s: total work / cells (`lower_bound_s`).
      rollout_busy_s, train_busy_s, switching_s: cell-seconds spent on each.
      rollout_idle_s: cell-seconds of free slots on serving cells (slots / capacity) ...
      throttled_s: ... the part of it while groups were left to dispatch but none waited
        (dispatch held back by the depth or the staleness gate).
      train_idle_s: cell-seconds of cells in the trainer while no step ran (waiting for
        data, or for an older group under the gate).
      trained: group seqs in the order they were trained.
      staleness: per trained group (same order), trainer version when trained minus the
        rollout version it was dispatched with.
      step_end_s: when each step finished.
      transitions: number of switches by kind ("to_training", "to_rollout").
      timeline: (time, cell, "rollout" | "training" | "switching") role changes.
    """

    policy: str
    makespan_s: float
    utilisation: float
    lower_bound_s: float
    rollout_busy_s: float
    train_busy_s: float
    switching_s: float
    rollout_idle_s: float
    throttled_s: float
    train_idle_s: float
    trained: tuple[int, ...]
    staleness: tuple[int, ...]
    step_end_s: tuple[float, ...]
    transitions: dict[str, int]
    timeline: tuple[tuple[float, int, str], ...]

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "makespan_h": self.makespan_s / HOUR,
            "utilisation": self.utilisation,
            "lower_bound_h": self.lower_bound_s / HOUR,
            "makespan_over_bound": self.makespan_s / self.lower_bound_s,
            "staleness_max": self.max_staleness,
            "staleness_mean": float(np.mean(self.staleness)) if self.staleness else 0.0,
            "transitions": dict(self.transitions),
            "rollout_idle_cell_h": self.rollout_idle_s / HOUR,
            "throttled_cell_h": self.throttled_s / HOUR,
            "train_idle_cell_h": self.train_idle_s / HOUR,
            "switching_h": self.switching_s / HOUR,
        }


# Execution states.
_WAITING, _RUNNING, _DONE = 1, 2, 3


class Simulator:
    """One simulated run of `policy` over `trace` (see the module docstring).

    Args:
      config: the cluster, workload and schedule.
      policy: a policy object (`make_policy(...)`); it keeps state, so use a new one.
      trace: the executions (default: `make_trace(config)`).
      name: label of the result.
    """

    def __init__(self, config: SimConfig, policy: Policy, trace: Trace | None = None,
                 name: str = "policy"):  # fmt: skip
        self.config = config
        self.policy = policy
        self.trace = trace if trace is not None else make_trace(config)
        self.name = name
        if self.trace.duration_s.shape != (config.steps * config.groups_per_step,
                                           config.group_size):  # fmt: skip
            raise ValueError(
                f"trace shape {self.trace.duration_s.shape}, expected "
                f"({config.steps * config.groups_per_step}, {config.group_size})"
            )
        k, n = config.cells, config.group_size
        self.now = 0.0
        # Cells.
        self.roles = [Role.ROLLOUT] * k
        self.switching = [False] * k
        self.serving = [True] * k  # its slots count in the rollout pool
        self.in_trainer = [False] * k
        self.leaving = [False] * k
        self.pending: collections.deque[tuple[int, Role]] = collections.deque()
        self.current: list | None = None  # [cell, role, phase ("wait"/"switch"), end]
        # Executions: id = seq * N + member.
        total = self.trace.groups * n
        self.state = np.zeros(total, dtype=np.int8)
        self.remaining = self.trace.duration_s.reshape(-1).copy()
        self.run_since = np.zeros(total)
        self.generation = np.zeros(total, dtype=np.int64)  # invalidates heap entries
        self.heap: list[tuple[float, int, int]] = []
        self.waiting: collections.deque[int] = collections.deque()
        self.running: list[int] = []  # in start order (pause the latest first)
        self.started_once = np.zeros(total, dtype=bool)
        self.totals = [0, 0, 0]  # executions dispatched, started, finished
        # Groups.
        self.next_seq = 0
        self.group_version: list[int] = []
        self.group_left: list[int] = []
        self.ready: list[int] = []  # finish order
        self.trained: list[int] = []
        self.staleness: list[int] = []
        # Training.
        self.version = 0
        self.rollout_version = 0
        self.burst = 0
        self.steps_in_burst = 0
        self.burst_base = (0, 0, 0)
        self.step_work = 0.0  # cell-seconds left in the running step
        self.step_cells: set[int] = set()
        self.step_running = False
        self.step_end: list[float] = []
        # Accounting.
        self.rollout_busy = 0.0
        self.train_busy = 0.0
        self.switching_time = 0.0
        self.rollout_idle = 0.0
        self.throttled = 0.0
        self.train_idle = 0.0
        self.transition_counts = collections.Counter()
        self.timeline = [(0.0, c, Role.ROLLOUT.value) for c in range(k)]

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> SimResult:
        c = self.config
        events = 0
        limit = 50 * self.trace.groups * c.group_size + 10_000
        while self.version < c.steps:
            self._decide()
            if self.version >= c.steps:
                break
            when, kind = self._next_event()
            if kind is None:
                raise SimulationError(self._stuck_message())
            self._advance(when)
            if kind == "execution":
                self._finish_execution()
            elif kind == "transition":
                self._finish_transition()
            else:
                self._finish_step()
            events += 1
            if events > limit:
                raise SimulationError(f"no end after {events} events: {self._stuck_message()}")
        makespan = self.now
        work = self.rollout_busy + self.train_busy
        return SimResult(
            policy=self.name,
            makespan_s=makespan,
            utilisation=work / (c.cells * makespan) if makespan > 0 else 0.0,
            lower_bound_s=lower_bound_s(c, self.trace),
            rollout_busy_s=self.rollout_busy,
            train_busy_s=self.train_busy,
            switching_s=self.switching_time,
            rollout_idle_s=self.rollout_idle,
            throttled_s=self.throttled,
            train_idle_s=self.train_idle,
            trained=tuple(self.trained),
            staleness=tuple(self.staleness),
            step_end_s=tuple(self.step_end),
            transitions=dict(self.transition_counts),
            timeline=tuple(self.timeline),
        )

    def _decide(self) -> None:
        """Asks the policy and carries out its decision until nothing new happens."""
        for _ in range(100):
            decision = self.policy(self._view())
            acted = False
            for _ in range(decision.dispatch):
                acted |= self._dispatch_group()
            for index, role in decision.transitions:
                acted |= self._request_transition(index, role)
            self._start_transition()
            acted |= self._maybe_start_step()
            if not acted:
                return
        raise SimulationError(f"policy keeps acting at t={self.now:.1f}: {decision}")

    def _view(self) -> View:
        c = self.config
        d0, p0, f0 = self.burst_base
        d, p, f = self.totals
        return View(
            now=self.now,
            cells=tuple(
                CellView(i, self.roles[i], self.switching[i], c.capacity) for i in range(c.cells)
            ),
            group_size=c.group_size,
            groups_per_step=c.groups_per_step,
            steps_per_burst=c.mu,
            lookahead_bursts=c.phi,
            burst=self.burst,
            dispatched=d - d0,
            started=p - p0,
            finished=f - f0,
            executions_in_flight=d - f,
            groups_in_flight=sum(1 for left in self.group_left if left > 0),
            groups_ready=len(self.ready),
            steps_in_burst=self.steps_in_burst,
            step_running=self.step_running,
            groups_remaining=self.trace.groups - self.next_seq,
            max_staleness=c.max_staleness,
        )

    # --- time ---------------------------------------------------------------------------------

    def _next_event(self) -> tuple[float, str | None]:
        best, kind = np.inf, None
        if self.step_running and self.step_cells:
            when = self.now + self.step_work / len(self.step_cells)
            best, kind = when, "step"
        if self.current is not None and self.current[2] == "switch" and self.current[3] < best:
            best, kind = self.current[3], "transition"
        while self.heap and self.heap[0][2] != self.generation[self.heap[0][1]]:
            heapq.heappop(self.heap)  # a paused execution's stale entry
        if self.heap and self.heap[0][0] < best:
            best, kind = self.heap[0][0], "execution"
        return best, kind

    def _advance(self, when: float) -> None:
        dt = when - self.now
        if dt < 0:
            raise SimulationError(f"time runs backwards: {self.now} -> {when}")
        self.rollout_busy += dt * len(self.running) / self.config.capacity
        free = (self._capacity() - len(self.running)) / self.config.capacity
        self.rollout_idle += dt * free
        if not self.waiting and self.next_seq < self.trace.groups:
            self.throttled += dt * free
        if not self.step_running:
            self.train_idle += dt * sum(self.in_trainer)
        if self.step_running:
            self.train_busy += dt * len(self.step_cells)
            self.step_work = max(0.0, self.step_work - dt * len(self.step_cells))
        if self.current is not None and self.current[2] == "switch":
            self.switching_time += dt
        self.now = when

    # --- rollout ------------------------------------------------------------------------------

    def _capacity(self) -> int:
        return self.config.capacity * sum(self.serving)

    def _dispatch_group(self) -> bool:
        if self.next_seq >= self.trace.groups:
            return False
        seq = self.next_seq
        self.next_seq += 1
        n = self.config.group_size
        self.group_version.append(self.rollout_version)
        self.group_left.append(n)
        for member in range(n):
            e = seq * n + member
            self.state[e] = _WAITING
            self.waiting.append(e)
        self.totals[0] += n
        self._fill_slots()
        return True

    def _fill_slots(self) -> None:
        capacity = self._capacity()
        while self.waiting and len(self.running) < capacity:
            e = self.waiting.popleft()
            self.state[e] = _RUNNING
            self.run_since[e] = self.now
            self.generation[e] += 1
            heapq.heappush(self.heap, (self.now + self.remaining[e], e, self.generation[e]))
            self.running.append(e)
            if not self.started_once[e]:
                self.started_once[e] = True
                self.totals[1] += 1

    def _shrink_slots(self) -> None:
        """Pauses the most recently started executions that no longer fit."""
        capacity = self._capacity()
        while len(self.running) > capacity:
            e = self.running.pop()
            self.remaining[e] -= self.now - self.run_since[e]
            self.state[e] = _WAITING
            self.generation[e] += 1
            self.waiting.appendleft(e)

    def _finish_execution(self) -> None:
        _, e, _ = heapq.heappop(self.heap)
        self.state[e] = _DONE
        self.remaining[e] = 0.0
        self.running.remove(e)
        self.totals[2] += 1
        seq = e // self.config.group_size
        self.group_left[seq] -= 1
        if self.group_left[seq] == 0:
            self.ready.append(seq)
        self._fill_slots()

    # --- transitions --------------------------------------------------------------------------

    def _request_transition(self, index: int, role: Role) -> bool:
        if self.switching[index] or self.roles[index] is role:
            return False
        self.switching[index] = True
        self.roles[index] = role  # the View shows the target role while switching
        self.pending.append((index, role))
        return True

    def _start_transition(self) -> None:
        if self.current is not None or not self.pending:
            return
        cell, role = self.pending.popleft()
        self.timeline.append((self.now, cell, "switching"))
        if role is Role.TRAINING:
            self.serving[cell] = False  # drain: its executions move to the other cells
            self._shrink_slots()
            self.current = [cell, role, "switch", self.now + self.config.to_training_s]
            return
        self.leaving[cell] = True
        if self.step_running and cell in self.step_cells:
            self.current = [cell, role, "wait", None]  # leaves at the step boundary
            return
        self._leave_trainer(cell)
        self.current = [cell, role, "switch", self.now + self.config.to_rollout_s]

    def _leave_trainer(self, cell: int) -> None:
        self.in_trainer[cell] = False
        self.leaving[cell] = False
        self.step_cells.discard(cell)

    def _finish_transition(self) -> None:
        cell, role, _, _ = self.current
        self.current = None
        self.switching[cell] = False
        self.timeline.append((self.now, cell, role.value))
        self.transition_counts[f"to_{role.value}"] += 1
        if role is Role.TRAINING:
            self.in_trainer[cell] = True
            if self.step_running:
                self.step_cells.add(cell)  # joins the running step
        else:
            self.serving[cell] = True
            self._fill_slots()
        self._start_transition()

    # --- training -----------------------------------------------------------------------------

    def _maybe_start_step(self) -> bool:
        c = self.config
        if self.step_running or self.roles[0] is not Role.TRAINING or self.switching[0]:
            return False
        if len(self.ready) < c.groups_per_step:
            return False
        untrained = [s for s in range(self.next_seq) if self.group_left[s] > 0]
        chosen = step_groups(
            [self.group_version[s] for s in self.ready],
            [self.group_version[s] for s in untrained],
            self.version,
            c.groups_per_step,
            c.max_staleness,
        )
        if chosen is None:
            return False
        groups = [self.ready[i] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self.ready[i]
        for seq in groups:
            self.trained.append(seq)
            self.staleness.append(self.version - self.group_version[seq])
        self.step_work = float(self.trace.tokens[groups].sum()) * c.train_s_per_token
        self.step_cells = {i for i in range(c.cells) if self.in_trainer[i]}
        self.step_running = True
        return True

    def _finish_step(self) -> None:
        c = self.config
        self.step_running = False
        self.step_work = 0.0
        self.version += 1
        self.steps_in_burst += 1
        self.step_end.append(self.now)
        for cell in list(self.step_cells):
            if self.leaving[cell]:
                self._leave_trainer(cell)
        self.step_cells = set()
        if self.current is not None and self.current[2] == "wait":
            self.current[2:] = ["switch", self.now + c.to_rollout_s]
        if self.steps_in_burst >= c.mu:  # publish; a new burst begins
            self.rollout_version = self.version
            self.burst += 1
            self.steps_in_burst = 0
            self.burst_base = tuple(self.totals)

    def _stuck_message(self) -> str:
        roles = "".join(
            "s" if self.switching[i] else self.roles[i].value[0].upper()
            for i in range(self.config.cells)
        )
        return (
            f"t={self.now:.1f}s step {self.version}/{self.config.steps} burst {self.burst} "
            f"roles {roles} ready {len(self.ready)} running {len(self.running)} "
            f"waiting {len(self.waiting)} dispatched groups {self.next_seq} "
            f"capacity {self._capacity()} step_running {self.step_running}"
        )


def policy_kwargs(name: str, **options) -> dict:
    """Keyword arguments of `make_policy` for a policy name (options of other policies
    are dropped, so one options dict can serve every policy)."""
    accepted = {
        "colocate": (),
        "async": ("training_cells", "lookahead"),
        "elastic": ELASTIC_OPTIONS,
    }.get(name, tuple(options))
    return {k: v for k, v in options.items() if k in accepted}


ELASTIC_OPTIONS = ("min_rollout_cells", "lookahead", "core_stays", "keep_cell", "backlog_steps")


def simulate(config: SimConfig, policy: str, trace: Trace | None = None, **options) -> SimResult:
    """Runs one policy by name (`options` as in `policy_kwargs`) and returns its result."""
    instance = make_policy(policy, **policy_kwargs(policy, **options))
    label = policy
    if policy == "async" and "training_cells" in options:
        label = f"async({options['training_cells']})"
    return Simulator(config, instance, trace, name=label).run()
