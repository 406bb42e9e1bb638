"""A discrete-event simulator of the cell-role policies (pure Python/NumPy; no JAX).

It runs the very policy objects the runtime runs (`policies.make_policy`) over modelled
executions, so cluster-scale claims (hours of rollout, dozens of cells) can be checked on
one machine in a second. The driver rules are the runtime's (`driver.Driver`, which both
keep, and the policies.py docstring):

  * after every event the policy sees a `View` and its `Decision` is carried out: first
    `dispatch` new groups (in sequence order, so every policy runs the same executions of
    a `Trace`), then the transitions, then a training step starts if it can. The policy is
    asked again until it asks for nothing new, and once more after that (the runtime
    re-asks at least once a second, so a policy whose answer changed by being asked,
    e.g. at a burst boundary, is heard);
  * a training step starts when the core cell is TRAINING (not switching), no step runs
    and `step_groups` picks B ready groups (the staleness gate S: oldest versions first,
    waiting for an older group still running rather than breaking S); it uses every cell
    in the trainer; a cell whose rollout -> training switch completes mid-step joins it;
  * transitions are serial (one at a time, in request order). rollout -> training: the
    cell stops serving when its switch begins (its executions migrate to the other
    rollout cells), takes `to_training_s`, then joins the trainer. training -> rollout:
    the cell first waits for the step boundary (still training; the queue of switches
    waits with it, as in the runtime), then takes `to_rollout_s`, then serves;
  * after every mu steps the weights are published (instantly) and a burst begins: the
    burst counters d, p, f restart and new groups carry the new rollout version;
  * the run ends when `steps` steps are done (unfinished executions are dropped; with
    `groups_remaining` the policies dispatch exactly steps * B groups).

The gate is never broken silently: a step that trains a group more than S versions after
its rollout version (possible only when a policy dispatches more than the gate allows)
is counted in `SimResult.over_stale` and shows in its staleness.

The model (assumptions, stated so that nobody reads more into the figures):
  * an execution needs one rollout slot for `duration` seconds of progress; it progresses
    only while it holds a slot, at the same speed whatever the load of its cell (no
    batching speed-up or slow-down: the latency-bound regime of agents waiting on tools);
    durations are lognormal, capped at `timeout_s` (a timed-out execution is still scored
    and trained, DESIGN.md "Partial credit");
  * workloads (`SimConfig.workload`): "static", one distribution for the whole run;
    "drift", the median duration grows `drift_factor`-fold linearly over the groups (as a
    policy learns to use more turns); "mixed", each group's task comes from one of two
    families whose median durations differ `mixed_factor`-fold. A group's factor f scales
    its durations and timeout; its tokens scale as f ** `token_exponent` (1: tokens follow
    wall time and the rollout/training ratio never changes; below 1: longer executions
    spend more of their time waiting on tools, so the ratio drifts). Factors are
    normalised to mean 1. With `dispatch_order` "longest_first", mixed tasks are
    dispatched long family first within each block of S steps' groups;
  * the rollout cells form one pool of slots (`capacity` per serving cell). When a cell
    stops serving, executions that no longer fit are paused, the most recently started
    first, and resume first (migration itself costs nothing: KV copies take seconds,
    executions take hours); waiting executions start in dispatch order;
  * a training step costs `train_s_per_token` cell-seconds per token of its groups'
    executions and progresses at a rate proportional to the number of cells in the
    trainer (greedy micro-step claiming: perfect data-parallel scaling); the cross-cell
    reduction, optimizer update and weight publication are free;
  * a cell is busy in proportion to its occupied slots (k of c slots busy: k/c busy) or
    while it computes a step. Hence utilisation = work / (cells * makespan) =
    `lower_bound_s` / makespan. Every idle cell-second is attributed to one cause
    (`IDLE_CAUSES`), so busy + idle = cells * makespan exactly.

The load-dependent model (`SimConfig.decode_cores` > 0; off by default, and then
everything above holds unchanged) is for runs whose cells share one host's compute, as
CPU-emulated devices do: an execution is `turns` decode phases of equal work (its drawn
duration is then its decode work, compute-seconds at full speed) separated by tool calls
(wall time, lognormal `tool_median_s`/`tool_sigma`, unaffected by load). Decode phases
and a running training step share `decode_cores` cores (processor sharing): with n
executions decoding and a step running (a demand of `train_cores` cores), every one of
them progresses at min(1, decode_cores / (n + train_cores)) of its full speed, recomputed
whenever the active set changes. Hence one execution at a time, no tool calls and no
step gives the old durations exactly. `first_step_s` (both models) is extra work of the
first step (compilation). Also in the load model, the runtime's other costs:
  * `per_engine`: executions run on a serving cell's engine (the least loaded when they
    start; a draining cell's move to the others); demand counts engines, not
    executions (an engine's decode step is one batched computation), and an execution
    on an engine serving n progresses at share / ((1 - batch_cost) + batch_cost * n):
    a step costs a + b * n, so how executions spread over rollout cells matters;
  * compilation: an engine's first decode of turn k waits `engine_compile_s[k]` wall
    seconds (XLA compiles on about one thread; the engine still counts as one demand);
    the trainer's first step adds `first_step_s` of work, a step at a trainer width not
    seen before `train_compile_s`, a cell joining training for the first time
    `join_compile_s` (work, so it competes for the cores);
  * calls by work (`call_work_s` > 0; replaces `turns`): an execution of decode work w
    makes max(1, round((w / call_work_s) ** call_work_exponent)) calls (decode phases
    of equal work, tool calls between), so long executions make more calls and short
    ones finish in one or two, as the real agents do (their calls and output tokens
    correlate at 0.86); an exponent below 1 gives the longest executions fewer, longer
    calls (the real agents' turn limits);
  * context growth (`context_tokens` > 0; replaces compiling per turn): an execution's
    prompt is `context_tokens` at its first call and grows by `context_per_call` tokens
    a call (its output and the tool result it brings) times its own lognormal factor
    (median 1, sigma `context_sigma`): context_tokens + context_per_call * factor * k at
    its call k (no compaction: prompts only grow). An engine compiles when a decode
    phase it serves begins in a context bucket (prompts up to 128, 256, 512, ...
    tokens: the real engines' shapes) it has not compiled: `bucket_compile_s[i]` wall
    seconds for bucket 128 * 2 ** i (past the tuple's end: nothing, as for a bucket the
    calibration run never reached). So compiles land on the executions that reach a
    bucket, those with many calls, and on their engines only. As the real engines
    (`precompile`: a background compiler), only the engine's calls in a bucket being
    compiled wait; its other calls go on. Compiles queued on one engine end together;
  * compile contention (`compile_contention` = kappa): with m engines compiling at
    once, each compilation progresses at 1 / (1 + kappa * (m - 1)) of its speed alone
    (its cost is wall seconds alone); kappa = 0: compilations never slow each other.

Bounds: `lower_bound_s` is the work over the cells; `makespan_bound_s` also accounts for
the staleness gate's critical path and the pipeline fill, and holds for any publication
cadence, dispatch depth and policy (`staleness_bound_s` is the same chain for one
cadence only).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Mapping

import numpy as np

from gyrejax.config import DISPATCH_ORDERS
from gyrejax.scheduler.driver import (
    Driver,
    GenerationShare,
    Schedule,
    capacity_from_share,
    dispatch_block,
    dispatch_permutation,
    trainer_time,
)
from gyrejax.scheduler.policies import (
    IDLE_CAUSES,
    Policy,
    Role,
    View,
    make_policy,
    policy_options,
)

HOUR = 3600.0
BUCKETS = 32  # context buckets 128 * 2 ** i, i < 32
SMALLEST_BUCKET_LOG2 = 7  # the engines' smallest context bucket, 128 tokens
WORKLOADS = ("static", "drift", "mixed")
# Workloads whose tasks carry a duration hint (a mixed task's family, known before it
# runs); "longest_first" reorders only these.
HINTED_WORKLOADS = ("mixed",)


def context_bucket(prompt_tokens: int) -> int:
    """The context bucket i of a prompt: prompts up to 128 * 2 ** i tokens (the real
    engines' power-of-two shapes, which each compile once per engine)."""
    log2 = int(np.ceil(np.log2(max(prompt_tokens, 1))))
    return min(BUCKETS - 1, max(0, log2 - SMALLEST_BUCKET_LOG2))


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
      executions_hold_slots: an execution holds its slot for its whole duration (agents
        whose KV stays resident through tool calls); False: slots bound nothing (engines
        that hold a request only while it generates: `capacity` is then only what the
        policies see, as in the runtime's View).
      train_parallel: a step's time is its work over the cells in the trainer (perfect
        data parallelism); False: the cells share one host (CPU-emulated devices), so a
        step takes its work whatever the number of cells.
      step_overhead_s: seconds every step adds (packing, reduction, update).
      workload: "static", "drift" or "mixed" (module docstring).
      drift_factor: "drift": the last group's median duration over the first's.
      mixed_factor: "mixed": the long family's median duration over the short one's.
      token_exponent: a group's tokens scale as (its workload factor) ** this.
      dispatch_order: "fifo" (the trace's order) or "longest_first": within each block of
        S steps' groups, the long family's tasks first (`driver.dispatch_permutation`,
        each group's hint its family's median: "mixed" only; static and drift tasks carry
        no hint, so their order stays). Part of the trace (`make_trace`), so the bounds
        see it too.
      decode_cores: > 0: the load-dependent model (module docstring), with this many
        cores shared by decoding executions and training; 0: the old model.
      train_cores: load model: the cores a running training step asks for.
      turns: load model: decode phases per execution (turns - 1 tool calls between;
        with `call_work_s`, by work instead).
      tool_median_s, tool_sigma: load model: lognormal wall time of one tool call
        (median 0: none).
      first_step_s: extra seconds of work of the first step (compilation).
      per_engine: load model: one demand per engine with executions decoding (an
        engine's batched decode step), not one per decoding execution; its executions
        then progress at share / ((1 - batch_cost) + batch_cost * n) for n on it.
      batch_cost: load model with per_engine: a decode step of an engine serving n
        executions costs (1 - batch_cost) + batch_cost * n of a one-execution step
        (b / (a + b) of the runtime's a + b * n).
      engine_compile_s: load model: per turn k, the wall seconds an engine compiles
        before its first decode of turn k (contexts grow turn by turn and cross the
        engine's length buckets, new shapes, at some turns; turns past the end: none);
        the engine's decoding waits for it. Wall time, not shared work: XLA compiles on
        about one thread (the real runs: one engine alone ~11 s, four at once 14-18 s);
        a compiling engine still counts as one demand (per_engine).
      context_tokens: load model: > 0: the prompt tokens of an execution's first call,
        and engines compile per context bucket (`bucket_compile_s`, module docstring)
        instead of per turn (`engine_compile_s` unused); 0: per turn.
      context_per_call: load model: prompt tokens an execution adds per call ...
      context_sigma: ... times a lognormal factor per execution (median 1, this sigma).
      call_work_s: load model: > 0: an execution makes
        max(1, round((work / this) ** call_work_exponent)) decode phases (calls) of
        equal work instead of `turns` (long executions make more calls, as the real
        agents do); 0: `turns`.
      call_work_exponent: see `call_work_s` (1: calls in proportion to work).
      bucket_compile_s: load model with context_tokens: per context bucket i (prompts
        up to 128 * 2 ** i tokens), the wall seconds an engine alone compiles before
        its first decode in that bucket (its calls in that bucket wait); past the end:
        none.
      compile_contention: load model: kappa; m engines compiling at once each compile
        at 1 / (1 + kappa * (m - 1)) of their speed alone.
      slot_occupancy: load model with executions_hold_slots False: > 0: the capacity the
        policies see per rollout cell follows the agents, as the runtime's
        `scheduler.slot_occupancy`: `driver.capacity_from_share(capacity, this, g)`, g the
        share of the last finished executions' wall time in decode phases.
      train_compile_s: load model: seconds of work added to the first step at each new
        trainer width after the first step (a new sharding compiles).
      join_compile_s: load model: seconds of work added to a running step when a cell
        joins training for the first time (its compilation).
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
    executions_hold_slots: bool = True
    train_parallel: bool = True
    step_overhead_s: float = 0.0
    workload: str = "static"
    drift_factor: float = 3.0
    mixed_factor: float = 4.0
    token_exponent: float = 1.0
    dispatch_order: str = "fifo"
    decode_cores: float = 0.0
    train_cores: float = 1.0
    turns: int = 1
    tool_median_s: float = 0.0
    tool_sigma: float = 0.0
    first_step_s: float = 0.0
    per_engine: bool = False
    batch_cost: float = 0.0
    engine_compile_s: tuple[float, ...] = ()
    train_compile_s: float = 0.0
    join_compile_s: float = 0.0
    context_tokens: float = 0.0
    context_per_call: float = 0.0
    context_sigma: float = 0.0
    call_work_s: float = 0.0
    call_work_exponent: float = 1.0
    bucket_compile_s: tuple[float, ...] = ()
    compile_contention: float = 0.0
    slot_occupancy: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("cells", "capacity", "group_size", "groups_per_step", "steps", "mu", "turns"):
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
        positive = ("duration_median_s", "timeout_s", "tokens_mean", "drift_factor", "mixed_factor")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"sim.{name}={getattr(self, name)}, expected > 0")
        costs = (
            "duration_sigma",
            "tokens_sigma",
            "train_s_per_token",
            "to_training_s",
            "to_rollout_s",
            "token_exponent",
            "step_overhead_s",
            "decode_cores",
            "train_cores",
            "tool_median_s",
            "tool_sigma",
            "first_step_s",
            "train_compile_s",
            "join_compile_s",
            "context_tokens",
            "context_per_call",
            "context_sigma",
            "call_work_s",
            "call_work_exponent",
            "compile_contention",
            "slot_occupancy",
        )
        for name in costs:
            if getattr(self, name) < 0:
                raise ValueError(f"sim.{name}={getattr(self, name)}, expected >= 0")
        for name in ("engine_compile_s", "bucket_compile_s"):
            if any(not t >= 0 for t in getattr(self, name)):
                raise ValueError(f"sim.{name}={getattr(self, name)}, expected >= 0")
        if not 0 <= self.batch_cost <= 1:
            raise ValueError(f"sim.batch_cost={self.batch_cost}, expected in [0, 1]")
        if self.slot_occupancy > 0 and (self.executions_hold_slots or not self.load_model):
            raise ValueError(
                f"sim.slot_occupancy={self.slot_occupancy} needs the load model (decode_cores "
                "> 0: decode phases to measure) and executions_hold_slots=False"
            )
        if self.workload not in WORKLOADS:
            raise ValueError(f"sim.workload={self.workload!r}, expected one of {WORKLOADS}")
        if self.dispatch_order not in DISPATCH_ORDERS:
            raise ValueError(
                f"sim.dispatch_order={self.dispatch_order!r}, expected one of {DISPATCH_ORDERS}"
            )

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

    @property
    def groups(self) -> int:
        return self.steps * self.groups_per_step

    @property
    def load_model(self) -> bool:
        """Whether durations depend on load (module docstring)."""
        return self.decode_cores > 0


@dataclasses.dataclass(frozen=True)
class Trace:
    """The executions of a run, indexed [group seq, member]; the same for every policy.

    Attributes:
      duration_s: float64[groups, group_size], capped at the timeout.
      tokens: float64[groups, group_size].
      timed_out: bool[groups, group_size].
      factor: float64[groups], the workload factor of each group (1 when static).
      tool_s: load model only: float64[groups, group_size, turns - 1], the wall time of
        each tool call (None: none).
      context_factor: load model with context growth only: float64[groups, group_size],
        each execution's context growth factor (None: 1 for all).
      calls: load model with `call_work_s` only: int64[groups, group_size], each
        execution's decode phases (None: `turns` for all).
    """

    duration_s: np.ndarray
    tokens: np.ndarray
    timed_out: np.ndarray
    factor: np.ndarray | None = None
    tool_s: np.ndarray | None = None
    context_factor: np.ndarray | None = None
    calls: np.ndarray | None = None
    # makespan_bound_terms_s per schedule, so that a sweep over policies computes them once.
    bounds: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def groups(self) -> int:
        return self.duration_s.shape[0]


def workload_factors(config: SimConfig, rng: np.random.Generator) -> np.ndarray:
    """float64[groups]: each group's duration scale (mean 1), by `config.workload`."""
    groups = config.groups
    if config.workload == "drift":
        factor = 1 + (config.drift_factor - 1) * np.linspace(0.0, 1.0, groups)
    elif config.workload == "mixed":
        long = rng.random(groups) < 0.5
        factor = np.where(long, config.mixed_factor, 1.0)
    else:
        factor = np.ones(groups)
    return factor / factor.mean()


def make_trace(config: SimConfig, seed: int | None = None) -> Trace:
    """Samples steps * B groups of executions (deterministic for a seed; a static trace is
    the same as before workloads existed), in `config.dispatch_order`."""
    rng = np.random.default_rng(config.seed if seed is None else seed)
    shape = (config.groups, config.group_size)
    base = config.duration_median_s * np.exp(config.duration_sigma * rng.standard_normal(shape))
    noise = np.exp(config.tokens_sigma * rng.standard_normal(shape))
    factor = workload_factors(config, rng)[:, None]
    raw = base * factor
    timeout = config.timeout_s * factor
    duration = np.minimum(raw, timeout)
    # Tokens follow the time an execution would take without the workload factor, and the
    # factor only as factor ** token_exponent.
    weight = duration / factor * factor**config.token_exponent * noise
    tokens = config.tokens_mean * weight / weight.mean()
    calls = None
    if config.load_model and config.call_work_s > 0:
        per_work = (duration / config.call_work_s) ** config.call_work_exponent
        calls = np.maximum(1, np.round(per_work)).astype(np.int64)
    most = config.turns if calls is None else int(calls.max())
    tool = None
    if config.load_model and most > 1 and config.tool_median_s > 0:
        # Its own stream, so that the durations and tokens are those of the old model.
        tool_rng = np.random.default_rng([config.seed if seed is None else seed, 1])
        normal = tool_rng.standard_normal((*shape, most - 1))
        tool = config.tool_median_s * np.exp(config.tool_sigma * normal)
    context = None
    if config.load_model and config.context_tokens > 0 and config.context_sigma > 0:
        context_rng = np.random.default_rng([config.seed if seed is None else seed, 2])
        context = np.exp(config.context_sigma * context_rng.standard_normal(shape))
    trace = Trace(duration, tokens, raw >= timeout, factor[:, 0], tool, context, calls)
    return in_dispatch_order(config, trace)


def in_dispatch_order(config: SimConfig, trace: Trace) -> Trace:
    """`trace` with its groups in the order `config.dispatch_order` dispatches them. Only
    "mixed" tasks carry a hint (their family's median duration); others keep their order."""
    if config.dispatch_order == "fifo" or config.workload not in HINTED_WORKLOADS:
        return trace
    block = dispatch_block(config.groups_per_step, config.max_staleness)
    order = np.asarray(dispatch_permutation(list(trace.factor), block))
    # Every array field is per group along its first axis; `bounds` is a cache.
    arrays = [f.name for f in dataclasses.fields(trace) if f.name != "bounds"]
    moved = {k: None if getattr(trace, k) is None else getattr(trace, k)[order] for k in arrays}
    return dataclasses.replace(trace, **moved, bounds={})


def lower_bound_s(config: SimConfig, trace: Trace) -> float:
    """Total work over the cells: rollout slot-seconds / capacity + train cell-seconds."""
    work = trace.duration_s.sum() / config.capacity
    work += trace.tokens.sum() * config.train_s_per_token
    return float(work / config.cells)


def _cheapest_step_s(config: SimConfig, trace: Trace) -> float:
    """The shortest a step can be: the B groups with the fewest tokens, trained on all
    cells (every bound below uses it)."""
    tokens = np.sort(trace.tokens.sum(axis=1))[: config.groups_per_step]
    return float(tokens.sum()) * config.train_s_per_token / config.cells


def _chain(config: SimConfig, trace: Trace, mu: int) -> list[float]:
    """Lower bounds on when each step can start under the gate, at publication cadence mu.

    Rollout version v = mu b is published when step mu b - 1 ends (P_b), so step k may
    train groups of bursts b with mu b <= k and k - mu b <= S only. Hence the steps
    k' <= k whose every admissible burst is >= b need n = B * (their number) groups that
    were all dispatched at or after P_b, and step k cannot start before P_b + (the n-th
    shortest group duration, a group lasting as long as its longest execution, among the
    groups those can be). Those groups are consecutive in dispatch order (`Trace` order)
    within a window: at P_b exactly mu b steps are done, so at least B mu b groups were
    dispatched before, and at most (S - mu + 1) B more (untrained groups of burst b - 1
    must be trained by step mu (b - 1) + S); a burst's groups are trained within S + 1
    steps, so the window spans at most (S + 1) B groups per burst it covers. Every group
    must be trained, so the last step also waits for the groups past the last possible
    window start. Steps run one at a time and take at least the training of the B
    groups with the fewest tokens on all cells.

    Returns:
      The start bound of every step, then the end bound of the last one (steps + 1).
    """
    s_max, b_groups = config.max_staleness, config.groups_per_step
    longest = trace.duration_s.max(axis=1)
    groups = len(longest)
    step_min = _cheapest_step_s(config, trace)
    if s_max is None:  # any B groups can be the first trained
        first = float(np.sort(longest)[b_groups - 1])
        return [first + k * step_min for k in range(config.steps + 1)]
    per_version = (s_max + 1) * b_groups
    slack = (s_max - mu + 1) * b_groups

    def first_burst(k: int) -> int:  # the oldest burst step k may train
        return max(0, -(-(k - s_max) // mu))

    cache: dict[tuple[int, int, int], float] = {}

    def shortest(n: int, burst: int, bursts: int) -> float:
        """The n-th shortest group among the windows that burst's groups can occupy."""
        key = (n, burst, bursts)
        if key not in cache:
            low = b_groups * mu * burst
            best = np.inf
            for start in range(low, min(low + (slack if burst else 0), groups) + 1):
                window = longest[start : start + bursts * per_version]
                if len(window) >= n:
                    best = min(best, float(np.partition(window, n - 1)[n - 1]))
            cache[key] = 0.0 if best == np.inf else best
        return cache[key]

    published = [0.0]
    starts, end = [], 0.0
    for k in range(config.steps):
        start = end
        for burst in range(k // mu + 1):
            n = b_groups * sum(1 for j in range(k + 1) if first_burst(j) >= burst)
            if n:
                start = max(start, published[burst] + shortest(n, burst, k // mu - burst + 1))
        if k == config.steps - 1:
            rest = longest[b_groups * mu * (k // mu) + slack :]
            if len(rest):
                start = max(start, published[k // mu] + float(rest.max()))
        starts.append(start)
        end = start + step_min
        if (k + 1) % mu == 0:
            published.append(end)
    return [*starts, end]


def staleness_bound_s(config: SimConfig, trace: Trace) -> float:
    """A lower bound on the makespan of any policy under the gate S at `config.mu` (the
    critical path of `_chain`, or the work when longer). Valid for that cadence only: a
    policy publishing more often can beat it; `makespan_bound_s` holds for any cadence.
    """
    return max(lower_bound_s(config, trace), _chain(config, trace, config.mu)[-1])


def makespan_bound_s(config: SimConfig, trace: Trace) -> float:
    """A lower bound on the makespan of any policy, at any publication cadence, dispatch
    depth and split, that respects the gate S and dispatches groups in order.

    Publishing every step (mu = 1) gives every group the newest version it can have, so
    every deadline is as late as possible: mu = 1 bounds every cadence. The bound is the
    largest of:
      * the work over the cells (`lower_bound_s`);
      * the gate's critical path (`_chain` at mu = 1);
      * the pipeline fill: no step runs before the first one can start (t1), and before
        t1 only groups of version 0, at most (S + 1) B of them (all of them without a
        gate), can roll out, each for at most t1 seconds; every other cell-second of work
        comes after t1;
      * the deadline chain (`_deadline_chain`): a group is dispatched no sooner than the
        gate lets its place in the order go out, each block of B groups is trained within
        S steps of the block's index, and steps 0..k need (k + 1) B finished groups;
      * the gate's windows (`gate_windows_bound_s`): a group trained by step k ran between the
        end of step k - S - 1 and the start of step k, for any cadence and order.
    """
    return max(makespan_bound_terms_s(config, trace).values())


def makespan_bound_terms_s(config: SimConfig, trace: Trace) -> dict[str, float]:
    """Each term of `makespan_bound_s` by name (`BOUND_TERMS`; the bound is the largest):
    the one that binds names what limits every policy on this trace."""
    c = config
    if not c.executions_hold_slots:  # slots bind nothing: rollout costs no cell-time
        c = c.replace(capacity=FREE_SLOTS)
    key = (c.cells, c.capacity, c.groups_per_step, c.steps, c.max_staleness, c.train_s_per_token)
    if key not in trace.bounds:
        trace.bounds[key] = _makespan_bound_terms(c, trace)
    return dict(trace.bounds[key])


# A capacity no rollout fills: a cell-second of rollout then costs ~nothing.
FREE_SLOTS = 2**62


# The terms of `makespan_bound_s`, in its docstring's order.
BOUND_TERMS = ("work", "gate_chain", "pipeline_fill", "deadline_chain", "gate_windows")


def _makespan_bound_terms(config: SimConfig, trace: Trace) -> dict[str, float]:
    c = config
    chain = _chain(c, trace, 1)
    t1 = chain[0]
    version0 = (
        trace.duration_s
        if c.max_staleness is None
        else (trace.duration_s[: (c.max_staleness + 1) * c.groups_per_step])
    )
    rollout_before = min(c.cells * t1, float(np.minimum(version0, t1).sum()) / c.capacity)
    work = lower_bound_s(c, trace) * c.cells
    fill = t1 + (work - rollout_before) / c.cells
    idle_fill = c.cells * t1 - rollout_before
    terms = (
        work / c.cells,
        chain[-1],
        fill,
        _deadline_chain(c, trace, idle_fill),
        gate_windows_bound_s(c, trace),
    )
    return dict(zip(BOUND_TERMS, terms, strict=True))


def gate_windows_bound_s(config: SimConfig, trace: Trace) -> float:
    """The gate's windows: a lower bound on the makespan of any policy, cadence, depth
    and dispatch order that keeps the gate S (0 without a gate).

    A group g trained by step k (0-indexed; the trainer is then at version k) carries a
    rollout version v >= k - S, and versions are published only when steps end, so g
    was dispatched no sooner than E_{k-S-1}, the end of step k - S - 1 (time 0 when that
    is < 0), and finished no later than step k starts. So with D_k the longest duration
    among step k's groups and tau_k its training time,
        E_k >= E_{k-S-1} + D_k + tau_k,
    a chain through the steps of each residue modulo S + 1, and E_{K-1} >= E_{K-1-j} +
    j tau_min. Averaging the n = min(S + 1, K) chains, which end at steps K-1-j
    (j < n) and hold every step between them:
        E_{K-1} >= (sum_k D_k + sum_k tau_k) / n + (n - 1) tau_min / 2.
    Every group is trained once, so sum_k tau_k is the whole training work over the cells
    (at most all cells train); and sum_k D_k is smallest when the steps take the groups in
    order of duration: the i-th largest D_k of any split into steps of B is at least the
    (i - 1) B + 1-th longest group, since the (i - 1) B + 1 longest lie in at least i
    steps. Unlimited slots and free switches are assumed, so it holds for every shape.
    """
    c = config
    if c.max_staleness is None:
        return 0.0
    b_groups, chains = c.groups_per_step, min(c.max_staleness + 1, c.steps)
    longest = np.sort(trace.duration_s.max(axis=1))[::-1]
    train = float(trace.tokens.sum()) * c.train_s_per_token / c.cells
    total = float(longest[::b_groups].sum()) + train
    return total / chains + (chains - 1) * _cheapest_step_s(c, trace) / 2


def _deadline_chain(config: SimConfig, trace: Trace, idle_fill: float) -> float:
    """The deadline chain (a lower bound on the makespan at any cadence; 0 without a gate).

    Before P_b (the end of step b - 1) at most b - 1 steps are done, so at most
    (b - 1) B groups are trained and the untrained ones carry versions <= b - 1 (no
    newer one exists), to be trained by step b - 1 + S: at most (S + 1) B of them. So
    group g, in block j = g // B, is dispatched no sooner than P_{j - S}, and finishes no
    sooner than f_g = P_{j - S} + its longest execution. Two things then hold for each
    step k:
      * steps 0..j train (j + 1) B groups, each dispatched before step j starts, in
        order: block j was dispatched before step j started, so it carries a version
        <= j and must be trained by step j + S: step k >= j + S starts no sooner than
        the block's latest f_g, and the last step waits for every block;
      * steps 0..k train (k + 1) B groups, each finished no later than its step starts:
        step k starts no sooner than the (k + 1) B-th smallest f_g (among the groups
        that can be dispatched before it starts, g < (k + S + 1) B).
    Steps follow each other and take at least the training of the B groups with the
    fewest tokens on all cells; P_b is also no sooner than (the idle forced before the
    first step + the rollout and training of the b B cheapest groups among the first
    (b + S) B) / cells.
    """
    c = config
    s_max, b_groups, steps = c.max_staleness, c.groups_per_step, c.steps
    if s_max is None:
        return 0.0
    longest = trace.duration_s.max(axis=1)
    block_longest = longest.reshape(steps, b_groups).max(axis=1)
    rollout = trace.duration_s.sum(axis=1) / c.capacity  # cell-seconds per group
    train = trace.tokens.sum(axis=1) * c.train_s_per_token
    step_min = _cheapest_step_s(c, trace)
    ends = [0.0]  # P_b for b = 0, 1, ... as the steps' starts become known

    def published(b: int) -> float:  # P_b
        return ends[max(b, 0)]

    finish: list[float] = []  # f_g, for the groups that can be dispatched so far
    start = -step_min  # (the step before the first)
    for k in range(steps):
        start += step_min
        for g in range(len(finish), min(len(longest), (k + s_max + 1) * b_groups)):
            finish.append(published(g // b_groups - s_max) + float(longest[g]))
        trained = (k + 1) * b_groups  # by steps 0..k
        start = max(start, float(np.partition(finish, trained - 1)[trained - 1]))
        due = range(k - s_max, k - s_max + 1) if k < steps - 1 else range(k - s_max, steps)
        for j in due:
            if j >= 0:
                start = max(start, published(j - s_max) + float(block_longest[j]))
        # P_{k+1}: this step's end, and no sooner than the forced idle and the work of the
        # (k + 1) B cheapest groups among the first (k + 1 + S) B, over the cells.
        done, known = (k + 1) * b_groups, min(len(train), (k + 1 + s_max) * b_groups)
        cheapest = np.partition(rollout[:known], done - 1)[:done].sum()
        cheapest += np.partition(train[:known], done - 1)[:done].sum()
        ends.append(max(start + step_min, (idle_fill + cheapest) / c.cells))
    return start + step_min


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What one simulated run did.

    Attributes:
      makespan_s: time when the last step finished.
      utilisation: busy cell-seconds / (cells * makespan).
      lower_bound_s: total work / cells (`lower_bound_s`).
      bound_s: `makespan_bound_s` (any cadence, this gate).
      rollout_busy_s, train_busy_s: busy cell-seconds of each kind.
      idle_s: idle cell-seconds by cause (`IDLE_CAUSES`); busy + idle = cells * makespan.
      trained: group seqs in the order they were trained.
      staleness: per trained group (same order), trainer version when trained minus the
        rollout version it was dispatched with.
      over_stale: groups trained more than S versions after their rollout version.
      step_end_s: when each step finished.
      transitions: number of switches by kind ("to_training", "to_rollout").
      timeline: (time, cell, "rollout" | "training" | "switching") role changes.
      log: what the runtime logs, for `calibrate.write_run_logs`: per group "dispatched"
        (seconds); per execution "finished" (seconds; NaN if not finished); "steps"
        (start, end, tokens, cells at the end, cells at the start) and "switches" (cell,
        kind, start, end, wait_s).
    """

    policy: str
    makespan_s: float
    utilisation: float
    lower_bound_s: float
    bound_s: float
    rollout_busy_s: float
    train_busy_s: float
    idle_s: dict[str, float]
    trained: tuple[int, ...]
    staleness: tuple[int, ...]
    over_stale: int
    step_end_s: tuple[float, ...]
    transitions: dict[str, int]
    timeline: tuple[tuple[float, int, str], ...]
    log: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "makespan_h": self.makespan_s / HOUR,
            "utilisation": self.utilisation,
            "lower_bound_h": self.lower_bound_s / HOUR,
            "bound_h": self.bound_s / HOUR,
            "makespan_over_bound": self.makespan_s / self.bound_s,
            "staleness_max": self.max_staleness,
            "staleness_mean": float(np.mean(self.staleness)) if self.staleness else 0.0,
            "over_stale": self.over_stale,
            "transitions": dict(self.transitions),
            "idle_cell_h": {k: v / HOUR for k, v in self.idle_s.items()},
            "trainer_h": {k: v / HOUR for k, v in self.trainer_time_s().items()},
        }

    def trainer_time_s(self) -> dict[str, float]:
        """The makespan from the trainer's side (`driver.trainer_time`)."""
        spans = [(start, end) for start, end, *_ in self.log.get("steps", ())]
        return trainer_time(spans, self.makespan_s)


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

    def __init__(
        self, config: SimConfig, policy: Policy, trace: Trace | None = None, name: str = "policy"
    ):
        self.config = config
        self.policy = policy
        self.trace = trace if trace is not None else make_trace(config)
        self.name = name
        expected = (config.groups, config.group_size)
        if self.trace.duration_s.shape != expected:
            raise ValueError(f"trace shape {self.trace.duration_s.shape}, expected {expected}")
        k, n = config.cells, config.group_size
        self.now = 0.0
        # Cells: roles, switches and bursts as the runtime keeps them.
        self.driver = Driver(
            Schedule(
                cells=k,
                capacity=config.capacity,
                group_size=n,
                groups_per_step=config.groups_per_step,
                mu=config.mu,
                phi=config.phi,
                max_staleness=config.max_staleness,
                groups_total=self.trace.groups,
            )
        )
        self.serving = [True] * k  # its slots count in the rollout pool
        self.in_trainer = [False] * k
        self.leaving = [False] * k
        self.current: list | None = None  # [cell, role, phase ("wait"/"switch"), end]
        # Executions: id = seq * N + member.
        total = self.trace.groups * n
        self.state = np.zeros(total, dtype=np.int8)
        self.remaining = self.trace.duration_s.reshape(-1).copy()
        self.run_since = np.zeros(total)
        self.generation = np.zeros(total, dtype=np.int64)  # invalidates heap entries
        self.heap: list[tuple[float, int, int]] = []
        # Load model: each execution's phase (even: decoding, odd: a tool call), what is
        # left of it (work or wall seconds), when it began, and the decode phases logged.
        self.phase = np.zeros(total, dtype=np.int64)
        calls = self.trace.calls
        self.turns = np.full(total, config.turns) if calls is None else calls.reshape(-1)
        self.left = self.remaining / self.turns
        self.phase_since = np.zeros(total)
        self.in_calls = np.zeros(total)  # seconds in decode phases (load model)
        self.generation_share = GenerationShare()
        # (execution, start, end, work, (engine cell at its start, at its end), prompt
        # tokens with context growth, else None)
        self.calls: list[tuple[int, float, float, float, tuple[int, int], int | None]] = []
        # Load model, per engine: executions migrate between engines, each engine compiles
        # before its first decode of each turn, the trainer per new width and first join.
        self.engine = np.full(total, -1, dtype=np.int64)
        self.call_engine = np.full(total, -1, dtype=np.int64)  # where its phase began
        self.compile_left = np.zeros(k)
        # With context growth: the buckets each engine is compiling, each execution's.
        self.pending = np.zeros((k, BUCKETS), dtype=bool)
        self.bucket = np.zeros(total, dtype=np.int64)
        self.engine_compiled: set[tuple[int, int]] = set()  # (cell, turn or bucket)
        self.widths_seen: set[int] = set()
        self.joined_once = [False] * k
        self.join_log: list[tuple[int, int, float]] = []  # (step, cell, compile wall s)
        self._due: int | None = None
        self.waiting: collections.deque[int] = collections.deque()
        self.running: list[int] = []  # in start order (pause the latest first)
        self.started_once = np.zeros(total, dtype=bool)
        self.totals = [0, 0, 0]  # executions dispatched, started, finished
        # Groups.
        self.next_seq = 0
        self.group_version: list[int] = []
        self.group_left: list[int] = []
        self.in_flight_versions: collections.Counter[int] = collections.Counter()
        self.ready: list[int] = []  # finish order
        self.trained: list[int] = []
        self.staleness: list[int] = []
        self.over_stale = 0
        # Training.
        self.version = 0
        self.step_work = 0.0  # cell-seconds left in the running step
        self.step_cells: set[int] = set()
        self.step_running = False
        self.step_end: list[float] = []
        # Accounting.
        self.rollout_busy = 0.0
        self.train_busy = 0.0
        self.idle = dict.fromkeys(IDLE_CAUSES, 0.0)
        self.transition_counts = collections.Counter()
        self.dispatched_at: list[float] = []
        self.finished_at = np.full(total, np.nan)
        self.step_log: list[tuple[float, float, float, int, int]] = []
        self.switch_log: list[tuple[int, str, float, float, float]] = []
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
            when, kind, speeds = self._next_event()
            if kind is None:
                raise SimulationError(self._stuck_message())
            self._advance(when, speeds)
            if kind == "execution":
                self._finish_execution()
            elif kind == "phase":
                self._finish_phase()
            elif kind == "compile":
                self._finish_compile()
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
            bound_s=makespan_bound_s(c, self.trace),
            rollout_busy_s=self.rollout_busy,
            train_busy_s=self.train_busy,
            idle_s=dict(self.idle),
            trained=tuple(self.trained),
            staleness=tuple(self.staleness),
            over_stale=self.over_stale,
            step_end_s=tuple(self.step_end),
            transitions=dict(self.transition_counts),
            timeline=tuple(self.timeline),
            log={
                "dispatched": self.dispatched_at,
                "finished": self.finished_at,
                "steps": self.step_log,
                "switches": self.switch_log,
                "calls": self.calls,
                "join_compiles": self.join_log,
            },
        )

    def _decide(self) -> None:
        """Asks the policy and carries out its decision until nothing new happens, asking
        once more after the first empty answer (the runtime's periodic re-ask)."""
        quiet = 0
        for _ in range(200):
            view = self._view()
            decision = self.policy(view)
            acted = False
            for _ in range(decision.dispatch):
                acted |= self._dispatch_group()
            for index, role in decision.transitions:
                acted |= self.driver.request_transition(index, role)
            self._start_transition()
            acted |= self._maybe_start_step()
            quiet = 0 if acted else quiet + 1
            if quiet == 2:
                self.driver.note_gate(self._view())
                return
        raise SimulationError(f"policy keeps acting at t={self.now:.1f}: {decision}")

    def _view(self) -> View:
        return self.driver.view(
            self.now,
            self.totals,
            groups_in_flight=sum(self.in_flight_versions.values()),
            groups_ready=len(self.ready),
            groups_dispatched=self.next_seq,
            step_running=self.step_running,
        )

    # --- time ---------------------------------------------------------------------------------

    def _next_event(self) -> tuple[float, str | None, tuple]:
        """(when, what, speeds): the next event and the speeds until then, (the shared
        cores' share, the running executions, their rates), which `_advance` reuses:
        nothing changes in between, and they are most of a simulation's time."""
        best, kind = np.inf, None
        share = self._share()
        running, rates = None, None
        if self.step_running and self.step_cells:
            when = self.now + self.step_work / (self._train_rate() * share)
            best, kind = when, "step"
        if self.current is not None and self.current[2] == "switch" and self.current[3] < best:
            best, kind = self.current[3], "transition"
        if self.config.load_model:
            if self.running:
                running = np.array(self.running)
                rates = self._rates(running, share)
                with np.errstate(divide="ignore"):
                    times = np.where(
                        rates > 0, self.left[running] / np.maximum(rates, 1e-300), np.inf
                    )
                i = int(np.argmin(times))
                if self.now + times[i] < best:
                    best, kind = self.now + float(times[i]), "phase"
                    self._due = int(running[i])
            compiling = np.flatnonzero(self.compile_left > 0)
            if len(compiling):
                rate = self._compile_rate()
                when = self.now + float(self.compile_left[compiling].min()) / rate
                if when < best:
                    best, kind = when, "compile"
            return best, kind, (share, running, rates)
        while self.heap and self.heap[0][2] != self.generation[self.heap[0][1]]:
            heapq.heappop(self.heap)  # a paused execution's stale entry
        if self.heap and self.heap[0][0] < best:
            best, kind = self.heap[0][0], "execution"
        return best, kind, (share, running, rates)

    def _advance(self, when: float, speeds: tuple) -> None:
        """Moves the clock at `speeds` (from `_next_event`), attributing every cell-second
        to work or to an idle cause."""
        dt = when - self.now
        if dt < 0:
            raise SimulationError(f"time runs backwards: {self.now} -> {when}")
        c = self.config
        busy_slots = len(self.running) / c.capacity
        free_slots = sum(self.serving) - busy_slots  # in cells
        training = len(self.step_cells) if self.step_running else 0
        trainer_idle = sum(self.in_trainer) - training
        # Trainer cells left out of the running step wait for its end to switch.
        held = trainer_idle if self.step_running else 0
        trainer_idle -= held
        switching = int(self.current is not None and self.current[2] == "switch")
        self.rollout_busy += dt * busy_slots
        self.train_busy += dt * training
        self.idle["switching"] += dt * switching
        self.idle["boundary_wait"] += dt * held
        if self.next_seq >= self.trace.groups:
            self.idle["tail"] += dt * (free_slots + trainer_idle)
        else:
            cause = "gate" if self.driver.gate_closed else "other"
            self.idle[cause] += dt * free_slots
            self.idle["train_wait"] += dt * trainer_idle
        share, running, rates = speeds
        if self.step_running:
            self.step_work = max(0.0, self.step_work - dt * self._train_rate() * share)
        if c.load_model and self.running:
            self.left[running] = np.maximum(0.0, self.left[running] - dt * rates)
        if c.load_model:
            self.compile_left = np.maximum(0.0, self.compile_left - dt * self._compile_rate())
        self.now = when

    def _compile_rate(self) -> float:
        """Load model: the speed of each compilation with m engines compiling at once,
        1 / (1 + compile_contention * (m - 1)) (module docstring)."""
        compiling = int(np.count_nonzero(self.compile_left > 0))
        return 1.0 / (1.0 + self.config.compile_contention * max(compiling - 1, 0))

    def _prompt(self, e: int) -> int:
        """Load model with context growth: the prompt tokens of `e`'s current decode
        phase (module docstring)."""
        c = self.config
        factor = 1.0 if self.trace.context_factor is None else self.trace.context_factor.flat[e]
        return round(c.context_tokens + c.context_per_call * factor * (self.phase[e] // 2))

    def _share(self) -> float:
        """Load model: the speed (0, 1] of everything on the shared cores (module
        docstring); 1 in the old model."""
        c = self.config
        if not c.load_model:
            return 1.0
        running = np.array(self.running, dtype=np.int64)
        decoding = running[self.phase[running] % 2 == 0]
        # A compiling engine holds a core (XLA compiles on about one thread) and its
        # executions, waiting, still count: what the fit sees in the logs.
        if c.per_engine:  # one demand per engine decoding or compiling
            engines = set(self.engine[decoding].tolist()) | set(
                np.flatnonzero(self.compile_left > 0).tolist()
            )
            demand = float(len(engines - {-1}))
        else:
            demand = float(len(decoding))
        if self.step_running and self.step_cells:
            demand += c.train_cores
        return min(1.0, c.decode_cores / demand) if demand > 0 else 1.0

    def _rates(self, running: np.ndarray, share: float) -> np.ndarray:
        """Load model: the progress rate of each running execution (decode work seconds
        or tool wall seconds per second)."""
        c = self.config
        engine = self.engine[running]
        decoding = self.phase[running] % 2 == 0
        rates = np.where(decoding, share, 1.0)
        if c.per_engine:
            batch = np.bincount(engine[decoding & (engine >= 0)], minlength=c.cells)
            cost = (1 - c.batch_cost) + c.batch_cost * np.maximum(batch[np.maximum(engine, 0)], 1)
            rates = np.where(decoding, share / cost, 1.0)
        cell = np.maximum(engine, 0)
        if c.context_tokens > 0:  # only the calls whose bucket is compiling wait
            stalled = decoding & (engine >= 0) & self.pending[cell, self.bucket[running]]
        else:  # the whole engine waits
            stalled = decoding & (engine >= 0) & (self.compile_left[cell] > 0)
        return np.where(stalled, 0.0, rates)

    def _assign_engine(self, e: int) -> None:
        """Load model: `e` runs on the serving cell with the fewest executions; a cell's
        first execution starts its engine's compilation."""
        serving = [i for i in range(self.config.cells) if self.serving[i]]
        if not serving:
            self.engine[e] = -1
            return
        running = np.array(self.running, dtype=np.int64)
        counts = np.bincount(
            self.engine[running][self.engine[running] >= 0], minlength=self.config.cells
        )
        cell = min(serving, key=lambda i: (counts[i], i))
        self.engine[e] = cell

    def _maybe_compile(self, e: int) -> None:
        """Load model: an engine's first decode of a turn (with context growth: of a
        context bucket) compiles, a new shape; the engine's decoding waits for it (with
        context growth: only its calls in that bucket). Asked
        when a decode phase begins (an execution migrating mid-phase compiles nothing, so
        that each compilation begins at a logged call's start, as the fit assumes)."""
        c = self.config
        cell, shape = int(self.engine[e]), int(self.phase[e] // 2)
        costs = c.engine_compile_s
        if c.context_tokens > 0:  # bucket i holds prompts up to 128 * 2 ** i tokens
            shape = context_bucket(self._prompt(e))
            costs = c.bucket_compile_s
            self.bucket[e] = shape
        if cell >= 0 and self.phase[e] % 2 == 0 and (cell, shape) not in self.engine_compiled:
            self.engine_compiled.add((cell, shape))
            cost = costs[shape] if shape < len(costs) else 0.0
            self.compile_left[cell] += cost
            self.pending[cell, shape] = c.context_tokens > 0 and cost > 0

    def _finish_compile(self) -> None:
        """Load model: the engine whose compilation is due is ready."""
        # (_advance already brought it to about 0; others compiling go on)
        self.compile_left[self.compile_left < 1e-9] = 0.0
        self.pending[self.compile_left == 0] = False  # (its buckets finish together)

    def _finish_phase(self) -> None:
        """Load model: the due execution ends a decode phase or a tool call."""
        c, e = self.config, self._due
        self._due = None
        if self.phase[e] % 2 == 0:
            work = self.trace.duration_s.reshape(-1)[e] / self.turns[e]
            engines = (int(self.call_engine[e]), int(self.engine[e]))
            prompt = self._prompt(e) if c.context_tokens > 0 else None
            self.calls.append((e, self.phase_since[e], self.now, work, engines, prompt))
            self.in_calls[e] += self.now - self.phase_since[e]
        self.phase[e] += 1
        self.phase_since[e] = self.now
        if self.phase[e] >= 2 * self.turns[e] - 1:
            self._finish_execution(e)
        elif self.phase[e] % 2 == 1:
            tool = self.trace.tool_s
            self.left[e] = (
                0.0 if tool is None else tool.reshape(-1, tool.shape[-1])[e, self.phase[e] // 2]
            )
        else:
            self.left[e] = self.trace.duration_s.reshape(-1)[e] / self.turns[e]
            self.call_engine[e] = self.engine[e]
            self._maybe_compile(e)

    # --- rollout ------------------------------------------------------------------------------

    def _capacity(self) -> int:
        if not self.config.executions_hold_slots and any(self.serving):
            return len(self.remaining)  # every execution runs while a cell serves
        return self.config.capacity * sum(self.serving)

    def _dispatch_group(self) -> bool:
        if self.next_seq >= self.trace.groups:
            return False
        seq = self.next_seq
        self.next_seq += 1
        n = self.config.group_size
        self.group_version.append(self.driver.rollout_version)
        self.dispatched_at.append(self.now)
        self.group_left.append(n)
        self.in_flight_versions[self.driver.rollout_version] += 1
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
            if not self.config.load_model:
                heapq.heappush(self.heap, (self.now + self.remaining[e], e, self.generation[e]))
            self.running.append(e)
            if self.config.load_model:
                self._assign_engine(e)
            if not self.started_once[e]:
                self.call_engine[e] = self.engine[e]
                if self.config.load_model:
                    self._maybe_compile(e)
                self.phase_since[e] = self.now
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

    def _finish_execution(self, e: int | None = None) -> None:
        if e is None:
            _, e, _ = heapq.heappop(self.heap)
        self.state[e] = _DONE
        self.remaining[e] = 0.0
        self.finished_at[e] = self.now
        self.running.remove(e)
        self.totals[2] += 1
        seq = e // self.config.group_size
        if self.config.slot_occupancy > 0:  # the capacity follows the agents
            self.generation_share.add(self.in_calls[e], self.now - self.dispatched_at[seq])
            share = self.generation_share.share()
            if share is not None:
                occupancy = self.config.slot_occupancy
                self.driver.set_capacity(
                    capacity_from_share(self.config.capacity, occupancy, share)
                )
        self.group_left[seq] -= 1
        if self.group_left[seq] == 0:
            self.in_flight_versions[self.group_version[seq]] -= 1
            if not self.in_flight_versions[self.group_version[seq]]:
                del self.in_flight_versions[self.group_version[seq]]
            self.ready.append(seq)
        self._fill_slots()

    # --- transitions --------------------------------------------------------------------------

    def _start_transition(self) -> None:
        if self.current is not None or not self.driver.pending:
            return
        cell, role, _ = self.driver.next_transition()
        self.timeline.append((self.now, cell, "switching"))
        self._switch_start = self.now
        if role is Role.TRAINING:
            self.serving[cell] = False  # drain: its executions move to the other cells
            self._shrink_slots()
            if self.config.load_model:
                for e in self.running:
                    if self.engine[e] == cell:
                        self._assign_engine(e)
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
        cell, role, _, end = self.current
        wait = (
            end
            - self._switch_start
            - (self.config.to_training_s if role is Role.TRAINING else self.config.to_rollout_s)
        )
        self.switch_log.append((cell, f"to_{role.value}", self._switch_start, self.now, wait))
        self.current = None
        self.driver.finish_transition(cell)
        self.timeline.append((self.now, cell, role.value))
        self.transition_counts[f"to_{role.value}"] += 1
        if role is Role.TRAINING:
            self.in_trainer[cell] = True
            if self.step_running:
                self.step_cells.add(cell)  # joins the running step
                if self.config.load_model and not self.joined_once[cell]:
                    self.step_work += self.config.join_compile_s * self._train_rate()
                    # What the runtime logs: the compile's wall time at today's share.
                    wall = self.config.join_compile_s / self._share()
                    self.join_log.append((self.version + 1, cell, wall))
            if self.config.load_model:
                self.joined_once[cell] = True
        else:
            self.serving[cell] = True
            self._fill_slots()
        self._start_transition()

    # --- training -----------------------------------------------------------------------------

    def _maybe_start_step(self) -> bool:
        c = self.config
        if not self.driver.step_may_start(self.step_running):
            return False
        chosen = self.driver.choose_groups(
            [self.group_version[s] for s in self.ready],
            list(self.in_flight_versions.elements()),
            self.version,
        )
        if chosen is None:
            return False
        groups = [self.ready[i] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self.ready[i]
        for seq in groups:
            staleness = self.version - self.group_version[seq]
            self.trained.append(seq)
            self.staleness.append(staleness)
            self.over_stale += self.driver.over_stale(staleness)
        # A cell already queued to return to rollout does not start a new step: it leaves
        # at this boundary instead of holding its switch (and the queue) for a whole step.
        returning = self.driver.returning()
        self.step_cells = {i for i in range(c.cells) if self.in_trainer[i] and i not in returning}
        self.step_running = True
        self._step_start = (self.now, float(self.trace.tokens[groups].sum()), len(self.step_cells))
        # Work in cell-seconds; the overhead is seconds at the step's starting rate.
        self.step_work = float(self.trace.tokens[groups].sum()) * c.train_s_per_token
        self.step_work += c.step_overhead_s * self._train_rate()
        if self.version == 0:
            self.step_work += c.first_step_s * self._train_rate()
        elif c.load_model and len(self.step_cells) not in self.widths_seen:
            self.step_work += c.train_compile_s * self._train_rate()
        if c.load_model:
            self.widths_seen.add(len(self.step_cells))
            for cell in self.step_cells:
                self.joined_once[cell] = True
        return True

    def _train_rate(self) -> float:
        """Cell-seconds of step work done per second (module docstring)."""
        if not self.step_cells:
            return 1.0
        return float(len(self.step_cells)) if self.config.train_parallel else 1.0

    def _finish_step(self) -> None:
        c = self.config
        self.step_running = False
        self.step_work = 0.0
        self.version += 1
        self.step_end.append(self.now)
        start, tokens, cells = self._step_start
        self.step_log.append((start, self.now, tokens, len(self.step_cells), cells))
        for cell in list(self.step_cells):
            if self.leaving[cell]:
                self._leave_trainer(cell)
        self.step_cells = set()
        if self.current is not None and self.current[2] == "wait":
            self.current[2:] = ["switch", self.now + c.to_rollout_s]
        if self.driver.step_done():  # publish; a new burst begins
            self.driver.begin_burst(self.totals, self.version)

    def _stuck_message(self) -> str:
        roles = self.driver.roles_text()
        return (
            f"t={self.now:.1f}s step {self.version}/{self.config.steps} burst {self.driver.burst} "
            f"roles {roles} ready {len(self.ready)} running {len(self.running)} "
            f"waiting {len(self.waiting)} dispatched groups {self.next_seq} "
            f"capacity {self._capacity()} step_running {self.step_running}"
        )


def simulate(config: SimConfig, policy: str, trace: Trace | None = None, **options) -> SimResult:
    """Runs one policy by name (`options`: those it does not take are left out, as in
    `policies.policy_options`) and returns its result, labelled by the policy."""
    instance = make_policy(policy, **policy_options(policy, **options))
    return Simulator(config, instance, trace, name=getattr(instance, "label", policy)).run()
