"""Calibrate the simulator on a real run's logs, and predict real runs with it.

`fit_run(workdir)` reads what the runtime writes (`run_summary.json` with the run's
schedule, `executions.jsonl`, `metrics.jsonl`, `transitions.jsonl`, `dispatch.jsonl`) and
fits the simulator's model (gyrejax/scheduler/simulator.py):
  * execution durations: a lognormal, median and sigma from the quartiles of the log
    durations (robust to the timeout cutting the upper tail), capped at the run's timeout;
  * training: tokens per execution from the steps' trained tokens, and a step's time as a
    fixed overhead plus seconds per token, either over the cells in the step (data
    parallel) or not (cells sharing one host, as CPU-emulated devices do): the better
    least-squares fit of the two decides `train_parallel`;
  * switch costs: mean seconds of rollout -> training and of training -> rollout (without
    the wait for the step boundary, which the simulator plays out itself);
  * the time before the first dispatch (engines starting) and after the last step
    (checkpoint, plots), added to a predicted makespan.
With `load=True` (`fit_run(workdir, load=True)`) it fits the simulator's load-dependent
model instead (`SimConfig.decode_cores`, gyrejax/scheduler/simulator.py), from the model
calls in the execution records (`executions/*.gxr` headers: each call's start, end,
tokens, prompt length and engines) and the steps' times:
  * every instant has n calls decoding and maybe a step running; for candidate cores C and
    step demand T every call's decode work is the integral of min(1, C / (n + T)) over
    it, and every step's work likewise. (C, T) is the grid point whose works are best
    explained by their tokens (a call: a + b * output tokens; a step: overhead + b *
    tokens, steps with compiles left out): least squares on the log of the works.
    With `per_engine` the demand counts engines with a call decoding, and a call's work
    alone on its engine is the integral of share / ((1 - beta) + beta * n), n the calls
    on its engine; (C, T, per_engine, beta = `batch_cost`) is the grid point whose
    works are best explained by their tokens (a call: prefill + per-token cost). Calls
    that waited for a compilation or moved between engines, and (when there are 50)
    calls before the first step ended (engines still compiling new shapes), are left
    out of that fit;
  * compilation: an engine compiles at its first call of each context bucket (128,
    256, ... prompt tokens; a simulated log without prompt lengths: each turn). A
    compile's window runs from the bucket's first call start on that engine to its
    first call end there, less that call's modelled decode (with prompt lengths: its
    decode work done at the engine's rate just before its end, since only the calls in
    the bucket wait and the engine's rate meanwhile is not the decode's; without: at the
    call's mean rate); windows in which the engine's cell began to switch to training
    are left out (the compile's end is unseen). With prompt lengths (the real runs' records; the
    simulator's context growth): with m windows open at once each progresses at
    1 / (1 + kappa * (m - 1)), kappa (`compile_contention`) the grid point under which
    each bucket's costs alone agree best across engines (identified only where a bucket
    compiles at different concurrency in the run; else 0), and `bucket_compile_s` the
    median cost alone per bucket over the engines whose compile took time (under
    `COMPILE_MIN_S`: the shape was cached). Without prompt lengths: the median wall
    time per turn (`engine_compile_s`), mapped onto the turn whose median call first
    reaches the bucket. A cell's first join: its logged joins[].compile_s at the step's
    mean share (`join_compile_s`); a step at a new trainer width, its work beyond the
    step fit less its joins' (`train_compile_s`); the first step's work beyond the fit
    less its joins' (`first_step_s`);
  * an execution's decode work (the sum over its calls, those starting after the
    first step when there are 20) is the lognormal of durations, `turns` its mean
    number of calls, the gaps between its calls the tool calls' lognormal (an
    execution's mean gap, spread over `turns` - 1 tool calls);
  * with prompt lengths, the calls and context model: `call_work_s` and
    `call_work_exponent` are the work per call and exponent under which
    max(1, round((work / call_work_s) ** exponent)) best gives each execution's number of
    calls; `context_tokens` the median first prompt; `context_per_call` and
    `context_sigma` the lognormal of each execution's prompt growth per call (least
    squares on its call index, up to its first compaction). The tool calls: sigma from
    the executions' mean gaps, the median such that the mean gap is the run's (the
    gaps one by one are bimodal: many calls follow one another with no tool call).
`fit_run(workdir, load=True, cores_by=[other, ...])` lets other runs' walls choose the
host's cores and the training's demand on them, which one run may not show (`fit_run`).
The costs (a call's prefill and per token, a step's overhead and per token) are
least-squares fits with coefficients >= 0 (`_nonnegative_lstsq`).
`predict(fit, run)` simulates another run's policy and schedule under the fitted model, on
several seeds, and returns the median wall time; `predicted_band` the 10th-90th
percentile range over the seeds (how much one run may differ from the next);
`predicted_trainer_time` the median of each part of the wall from the trainer's side.
`write_run_logs` writes a simulated run's logs in the runtime's format, so a test can
check that fitting recovers known parameters.

Pure Python/NumPy, like the simulator.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gyrejax.logs import read_jsonl
from gyrejax.scheduler.driver import logged_trainer_time
from gyrejax.scheduler.policies import OPTION_FIELDS, options_from_fields
from gyrejax.scheduler.simulator import (
    SMALLEST_BUCKET_LOG2,
    SimConfig,
    SimResult,
    Trace,
    context_bucket,
    makespan_bound_s,
    simulate,
)
from gyrejax.trajectory.store import MAGIC, escape_id, read_header

IQR_PER_SIGMA = 1.3489795  # the interquartile range of a standard normal
TOKENS_PER_WORK_S = 100.0  # simulated logs: output tokens per second of decode work


@dataclasses.dataclass(frozen=True)
class Fit:
    """The simulator's model fitted to a run.

    Attributes:
      sim: a SimConfig with the fitted durations, tokens, training and switch costs (its
        schedule fields are the calibration run's; `predict` replaces them).
      startup_s: seconds from the runtime's start to the first dispatch.
      shutdown_s: seconds from the last step's end to the end of the run.
      train_residual_s: RMS error of the step-time fit.
      train_parallel_identified: False when every step ran on as many cells, so the run
        cannot tell data-parallel from shared-host training (shared host assumed).
      cores_by: the runs whose walls chose the decode cores and the training's demand
        (`fit_run`), if any.
    """

    sim: SimConfig
    startup_s: float
    shutdown_s: float
    train_residual_s: float
    train_parallel_identified: bool = True
    cores_by: tuple[str, ...] = ()

    def summary(self) -> dict:
        s = self.sim
        return {
            "duration_median_s": s.duration_median_s,
            "duration_sigma": s.duration_sigma,
            "timeout_s": s.timeout_s,
            "tokens_mean": s.tokens_mean,
            "train_s_per_token": s.train_s_per_token,
            "step_overhead_s": s.step_overhead_s,
            "train_parallel": s.train_parallel,
            "train_residual_s": self.train_residual_s,
            "train_parallel_identified": self.train_parallel_identified,
            "decode_cores": s.decode_cores,
            "train_cores": s.train_cores,
            "turns": s.turns,
            "tool_median_s": s.tool_median_s,
            "tool_sigma": s.tool_sigma,
            "first_step_s": s.first_step_s,
            "per_engine": s.per_engine,
            "batch_cost": s.batch_cost,
            "engine_compile_s": s.engine_compile_s,
            "train_compile_s": s.train_compile_s,
            "join_compile_s": s.join_compile_s,
            "context_tokens": s.context_tokens,
            "context_per_call": s.context_per_call,
            "context_sigma": s.context_sigma,
            "call_work_s": s.call_work_s,
            "call_work_exponent": s.call_work_exponent,
            "bucket_compile_s": s.bucket_compile_s,
            "compile_contention": s.compile_contention,
            "to_training_s": s.to_training_s,
            "to_rollout_s": s.to_rollout_s,
            "startup_s": self.startup_s,
            "shutdown_s": self.shutdown_s,
            "cores_by": list(self.cores_by),
        }


def read_run(workdir: Path) -> dict:
    """What a finished run did (from `run_summary.json` and its logs): wall time, steps,
    utilisation, idle shares by cause, the wall time from the trainer's side, rewards,
    switches, staleness and its schedule."""
    workdir = Path(workdir)
    summary = json.loads((workdir / "run_summary.json").read_text())
    cell_s = summary.get("cell_s") or {}
    total = sum(cell_s.values()) or 1.0
    rows = read_jsonl(workdir / "metrics.jsonl")
    steps = [s for s in rows if not s.get("skipped")]
    # Runs from before the summary had it (not resumed: every row timed by one clock).
    trainer_s = summary.get("trainer_s") or logged_trainer_time(rows, summary["wall_s"])
    return {
        "workdir": str(workdir),
        "wall_s": summary["wall_s"],
        "steps": summary["steps"],
        "utilisation": summary.get("utilisation") or 0.0,
        "idle_share": {k: v / total for k, v in cell_s.items() if k != "busy"},
        "trainer_s": trainer_s,
        "reward_first": summary.get("reward_first") or 0.0,
        "reward_last": summary.get("reward_last") or 0.0,
        "reward_by_tenth": summary.get("reward_by_tenth") or [],
        "switches": sum(
            (summary.get("transitions") or {}).get(k, 0) for k in ("to_training", "to_rollout")
        ),
        "schedule": summary["schedule"],
        "over_stale": summary.get("over_stale", 0),
        # (simulated logs, write_run_logs, carry no staleness: 0)
        "staleness_max": max((s.get("staleness_max", 0.0) for s in steps), default=0.0),
        "staleness_mean": float(np.mean([s.get("staleness_mean", 0.0) for s in steps] or [0.0])),
    }


def outside_calls_bound_s(workdir: Path) -> float | None:
    """A lower bound on a finished run's wall time, from its own executions: each lasts
    at least its time outside model calls (tool calls, the harness), every step at least
    the fastest step of the run, and the gate S orders them as
    `simulator.makespan_bound_s` has it (groups in the run's dispatch order, any
    cadence, rollout slots unlimited), after the run's first dispatch. It bounds this
    run only (another run's executions differ); wall / bound is what model calls, slots
    and scheduling added. None without model calls, or where the bound's premises fail:
    the gate was broken (`over_stale`), an update was skipped (the versions then lag the
    steps), or a dispatched group was trained in no logged step."""
    workdir = Path(workdir)
    try:
        calls = read_calls(workdir)
    except ValueError:
        return None
    summary = json.loads((workdir / "run_summary.json").read_text())
    rows = read_jsonl(workdir / "metrics.jsonl")
    dispatched = sorted(read_jsonl(workdir / "dispatch.jsonl"), key=lambda d: d["seq"])
    if summary.get("over_stale") or any(r.get("skipped") for r in rows):
        return None  # the gate broken, or versions lagging the steps: its premises fail
    if {g for r in rows for g in r.get("groups", ())} != {d["group"] for d in dispatched}:
        return None  # groups dispatched but trained in no logged step (nothing to train)
    in_calls: dict[str, float] = {}
    for c in calls:
        in_calls[c["execution"]] = in_calls.get(c["execution"], 0.0) + c["end"] - c["start"]
    members: dict[str, list[float]] = {}
    for e in read_jsonl(workdir / "executions.jsonl"):
        outside = e["finished_s"] - e["started_s"] - in_calls.get(e["execution"], 0.0)
        members.setdefault(e["group"], []).append(max(0.0, outside))
    steps, schedule = rows, summary["schedule"]
    n, b = schedule["group_size"], schedule["groups_per_step"]
    groups = [members.get(d["group"], []) for d in dispatched]
    if not steps or len(groups) != len(steps) * b:
        return None
    durations = np.array([(g + [0.0] * n)[:n] for g in groups])
    # Two cells sharing a step's work: `step_s` of each group's tokens makes the B
    # cheapest groups' training take exactly the fastest step.
    fastest = min(s["step_s"] for s in steps)
    sim = SimConfig(
        cells=2,
        capacity=n,
        executions_hold_slots=False,  # agents waiting on tools hold nothing: rollout is free
        group_size=n,
        groups_per_step=b,
        steps=len(steps),
        mu=1,
        max_staleness=schedule["max_staleness"],
        train_s_per_token=1.0,
    )
    tokens = np.full(durations.shape, 2 * fastest / (b * n))
    trace = Trace(durations, tokens, np.zeros(durations.shape, bool))
    return dispatched[0]["time"] + makespan_bound_s(sim, trace)


def _lognormal(values: np.ndarray) -> tuple[float, float]:
    """(median, sigma) of a lognormal from its quartiles."""
    q25, q50, q75 = np.quantile(np.log(np.maximum(values, 1e-9)), [0.25, 0.5, 0.75])
    return float(np.exp(q50)), float((q75 - q25) / IQR_PER_SIGMA)


def _nonnegative_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The coefficients >= 0 of the least squares `design @ coef ~ target` (exact, over
    every subset of the design's few columns). Clipping a free fit's negative
    coefficient to zero is not that: the others must be fitted again without it (a
    negative slope clipped leaves the intercept where the slope had lifted it)."""
    free, *_ = np.linalg.lstsq(design, target, rcond=None)
    if np.all(free >= 0):  # the unconstrained optimum is feasible (the usual case)
        return free
    best, best_sse = np.zeros(design.shape[1]), float(np.sum(target**2))
    for k in range(1, design.shape[1]):
        for kept in itertools.combinations(range(design.shape[1]), k):
            sub, *_ = np.linalg.lstsq(design[:, kept], target, rcond=None)
            if np.any(sub < 0):
                continue
            coef = np.zeros(design.shape[1])
            coef[list(kept)] = sub
            sse = float(np.sum((design @ coef - target) ** 2))
            if sse < best_sse - 1e-12 * max(best_sse, 1.0):
                best, best_sse = coef, sse
    return best


def _fit_steps(steps: list[dict]) -> tuple[float, float, bool | None, float]:
    """(seconds per token, overhead s, parallel, RMS residual s) of step_s = overhead +
    tokens * s_per_token (/ cells when parallel), the better of the two fits.

    Steps that cells joined midway run at more than one width, so they are left out when
    enough others remain. `parallel` is None when every step ran on the same number of
    cells: the data cannot tell the two apart (the fit is then the shared-host one).
    """
    steady = [s for s in steps if not s.get("joins")]
    if len(steady) >= max(3, len(steps) // 4):
        steps = steady
    tokens = np.array([s["tokens"] for s in steps], dtype=float)
    cells = np.array([len(s["cells"]) for s in steps], dtype=float)
    seconds = np.array([s["step_s"] for s in steps], dtype=float)
    best = None
    for parallel in (False, True):  # on a tie (one width), the shared host
        x = tokens / cells if parallel else tokens
        design = np.stack([x, np.ones_like(x)], axis=1)
        per_token, overhead = (float(v) for v in _nonnegative_lstsq(design, seconds))
        residual = float(np.sqrt(np.mean((overhead + per_token * x - seconds) ** 2)))
        if best is None or residual < best[3] - 1e-12:
            best = (per_token, overhead, parallel, residual)
    if len(set(cells)) == 1:
        return (*best[:2], None, best[3])
    return best


CORES_GRID = tuple(float(c) for c in np.round(np.geomspace(0.25, 64.0, 49), 4))
TRAIN_CORES_GRID = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


def read_calls(workdir: Path) -> list[dict]:
    """The model calls of a run's execution records, on the run's clock: dicts with
    execution, start, end, tokens (output). The records' wall-clock times are shifted by
    the median gap between an execution's first call and its start in executions.jsonl."""
    workdir = Path(workdir)
    started = {e["execution"]: e["started_s"] for e in read_jsonl(workdir / "executions.jsonl")}
    headers = [read_header(p) for p in sorted((workdir / "executions").glob("*.gxr"))]
    offsets = [
        h["calls"][0]["started_at"] - started[h["execution_id"]]
        for h in headers
        if h.get("calls") and h["execution_id"] in started
    ]
    if not offsets:
        raise ValueError(f"{workdir}: no model calls in executions/*.gxr to fit the load model")
    offset = float(np.median(offsets))
    return [
        {
            "execution": h["execution_id"],
            "turn": turn,
            "shape": _shape(turn, c.get("prompt_len")),
            "prompt": c.get("prompt_len"),
            "start": c["started_at"] - offset,
            "end": c["finished_at"] - offset,
            "tokens": c["output_len"],
            "engine": (c.get("engines") or ["engine"])[0],
            "moved": len(c.get("engines") or []) > 1,  # migrated to another engine
        }
        for h in headers
        for turn, c in enumerate(sorted(h.get("calls", []), key=lambda c: c["started_at"]))
    ]


BATCH_COST_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 3))


def _shared_work(
    calls: list[dict],
    steps: list[dict],
    cores: float,
    train_cores: float,
    per_engine: bool,
    batch_costs: tuple[float, ...] = (0.0,),
    with_integral: bool = False,
) -> tuple:
    """(work of each call: float[batch costs, calls], work of each step: float[steps]);
    `with_integral`: also (times: float[t], each engine's work integral at those times:
    float[batch costs, engines, t], each call's engine: int[calls]).

    A step's work is the integral of share = min(1, cores / demand) over it, demand =
    (engines with a call decoding when `per_engine`, else calls decoding) + train_cores
    while a step runs; a call's work, its work alone on its engine, the integral of
    share / ((1 - batch_cost) + batch_cost * n) with n the calls on its engine (per
    engine; else of share)."""
    c_start = np.array([c["start"] for c in calls])
    c_end = np.array([c["end"] for c in calls])
    engines = sorted({c["engine"] for c in calls})
    engine = np.array([engines.index(c["engine"]) for c in calls])
    s_end = np.array([s["time_s"] for s in steps], dtype=float)
    s_start = s_end - np.array([s["step_s"] for s in steps], dtype=float)
    edges = np.unique(np.concatenate([c_start, c_end, s_start, s_end]))
    mid = (edges[:-1] + edges[1:]) / 2

    def active(start, end):
        return np.searchsorted(np.sort(start), mid) - np.searchsorted(np.sort(end), mid)

    batch = np.stack(
        [active(c_start[engine == i], c_end[engine == i]) for i in range(len(engines))]
    )
    decoding = (batch > 0).sum(axis=0) if per_engine else batch.sum(axis=0)
    demand = decoding + train_cores * (active(s_start, s_end) > 0)
    share = np.where(demand > 0, np.minimum(1.0, cores / np.maximum(demand, 1e-12)), 1.0)
    dt = np.diff(edges)
    step_integral = np.concatenate([[0.0], np.cumsum(share * dt)])
    step_at = np.searchsorted(edges, s_end), np.searchsorted(edges, s_start)
    step_work = step_integral[step_at[0]] - step_integral[step_at[1]]
    cost = np.array(batch_costs)[:, None, None]
    if per_engine:
        rate = share / ((1 - cost) + cost * np.maximum(batch, 1)[None])  # [costs, engines, t]
    else:
        rate = np.broadcast_to(share, (len(batch_costs), len(engines), len(share)))
    integral = np.concatenate(
        [np.zeros((*rate.shape[:2], 1)), np.cumsum(rate * dt, axis=2)], axis=2
    )
    start_at, end_at = np.searchsorted(edges, c_start), np.searchsorted(edges, c_end)
    call_work = integral[:, engine, end_at] - integral[:, engine, start_at]
    if with_integral:
        return call_work, step_work, (edges, integral, engine)
    return call_work, step_work


def _log_lstsq(design: np.ndarray, work: np.ndarray) -> tuple[np.ndarray, float]:
    """(coefficients >= 0, mean squared log error) of work ~ design @ coefficients."""
    coef = _nonnegative_lstsq(design, work)
    predicted = np.maximum(design @ coef, 1e-9)
    return coef, float(np.mean(np.log(np.maximum(work, 1e-9) / predicted) ** 2))


def _shape(turn: int, prompt_len: int | None) -> int:
    """The shape an engine compiles a call for: its context's power-of-two bucket (the
    real runs' engines compile when a prompt first crosses 128, 256, ... tokens); a log
    without prompt lengths (simulated): its turn."""
    if prompt_len is None:
        return turn
    return SMALLEST_BUCKET_LOG2 + context_bucket(prompt_len)


def _compile_calls(calls: list[dict]) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """(bool per call: it waited for a compilation on its engine; (the call whose end
    marks each compilation, the compilation's start)).

    An engine compiles at its first call of each shape (`_shape`), so its first call of
    that shape to finish there (not migrated) ends the compilation, and every call on
    that engine running since that shape's first start waited for it."""
    first_start: dict[tuple[str, int], float] = {}
    first_end: dict[tuple[str, int], int] = {}
    for i, c in enumerate(calls):
        key = (c["engine"], c["shape"])
        first_start[key] = min(first_start.get(key, np.inf), c["start"])
        j = first_end.get(key)
        if not c.get("moved") and (j is None or c["end"] < calls[j]["end"]):
            first_end[key] = i
    windows: dict[str, list[tuple[float, float]]] = {}
    for key, j in first_end.items():
        windows.setdefault(key[0], []).append((first_start[key], calls[j]["end"]))
    waited = np.array(
        [
            any(
                c["start"] < end and c["end"] > start for start, end in windows.get(c["engine"], [])
            )
            for c in calls
        ]
    )
    return waited, [(j, first_start[key]) for key, j in first_end.items()]


def _classify_steps(steps: list[dict]) -> tuple[list[int], list[int]]:
    """(steady steps, steps at a new trainer width) among steps[1:] (index into steps);
    a step where a cell compiled to join is not steady."""
    seen = {len(steps[0]["cells"])}
    steady, new_width = [], []
    for k in range(1, len(steps)):
        width = len(steps[k]["cells"])
        if width not in seen:
            new_width.append(k)
        elif not any((j.get("compile_s") or 0) > 0 for j in steps[k].get("joins", [])):
            steady.append(k)
        seen.add(width)
    return steady, new_width


def _compile_by_turn(
    calls: list[dict], by_shape: dict[int, list[float]], turns: int
) -> tuple[float, ...]:
    """The simulator's compile seconds per turn: turn k reaches the median shape of the
    calls at turn k, and compiles (the median over engines of) every shape past the
    previous turn's. Shapes past the last modelled turn's (reached by the few executions
    with more calls than `turns`) are left out: the simulator's executions never get
    there."""
    compile_s = {shape: float(np.median(v)) for shape, v in by_shape.items()}
    reached, out = None, []  # the largest shape reached so far
    for k in range(turns):
        shapes = [c["shape"] for c in calls if c["turn"] == k]
        top = int(np.median(shapes)) if shapes else reached
        out.append(
            float(
                sum(
                    v
                    for shape, v in compile_s.items()
                    if (reached is None or shape > reached) and shape <= top
                )
            )
        )
        reached = top if reached is None else max(reached, top)
    return tuple(out)


CONTENTION_GRID = tuple(np.round(np.linspace(0.0, 2.0, 81), 3))
COMPILE_MIN_S = 0.5  # a shorter compile window is the decode estimate's noise


def _fit_contention(
    windows: list[tuple[int, float, float]], grid: tuple[float, ...] = CONTENTION_GRID
) -> tuple[float, dict[int, list[float]]]:
    """(kappa, each shape's compile seconds alone on each engine that compiled it).

    `windows`: (shape, start, end) of every compilation. With m compiling at once each
    progresses at 1 / (1 + kappa * (m - 1)) (simulator.py), so a compilation's cost
    alone is that rate's integral over its window, m counted from the windows; kappa is
    the grid point under which the costs of each shape agree best across engines (least
    squares on their logs about each shape's mean)."""
    starts = np.array([w[1] for w in windows], dtype=float)
    ends = np.array([w[2] for w in windows], dtype=float)
    shapes = np.array([w[0] for w in windows])
    edges = np.unique(np.concatenate([starts, ends]))
    mid = (edges[:-1] + edges[1:]) / 2
    compiling = np.searchsorted(np.sort(starts), mid) - np.searchsorted(np.sort(ends), mid)
    at_start, at_end = np.searchsorted(edges, starts), np.searchsorted(edges, ends)
    timed = ends - starts >= COMPILE_MIN_S  # (no compile, or too short to tell)
    best = None
    for kappa in grid:
        rate = 1.0 / (1.0 + kappa * np.maximum(compiling - 1, 0))
        integral = np.concatenate([[0.0], np.cumsum(rate * np.diff(edges))])
        alone = integral[at_end] - integral[at_start]
        misfit = 0.0
        for shape in set(shapes.tolist()):
            logs = np.log(alone[(shapes == shape) & timed])
            misfit += float(np.sum((logs - logs.mean()) ** 2)) if len(logs) else 0.0
        if best is None or misfit < best[0] - 1e-12:
            best = (misfit, float(kappa), alone)
    by_shape: dict[int, list[float]] = {}
    for shape, cost in zip(shapes.tolist(), best[2], strict=True):
        by_shape.setdefault(shape, []).append(float(cost))
    return best[1], by_shape


def _timed_median(costs: list[float]) -> float:
    """The median compile cost among those that took time (a shorter one: the shape was
    in a compilation cache); 0 when none did."""
    timed = [c for c in costs if c >= COMPILE_MIN_S]
    return float(np.median(timed)) if timed else 0.0


def _fit_context(calls: list[dict]) -> tuple[float, float, float]:
    """(context_tokens, context_per_call, context_sigma): the median first prompt, and
    the lognormal of each execution's prompt growth per call (least squares through
    the origin of its prompt growth on its call index, up to its first compaction: a
    prompt shorter than the one before; executions with two calls or more)."""
    by_execution: dict[str, list[tuple[float, int]]] = {}
    for c in calls:
        by_execution.setdefault(c["execution"], []).append((c["start"], c["prompt"]))
    first, rates = [], []
    for parts in by_execution.values():
        prompts = np.array([p for _, p in sorted(parts)], dtype=float)
        first.append(prompts[0])
        grown = prompts - prompts[0]
        kept = np.concatenate([[True], np.cumprod(np.diff(grown) >= 0) > 0])
        index = np.arange(len(grown))[kept]
        if len(index) > 1:
            rates.append(float(index @ grown[kept] / (index @ index)))
    if not rates:
        return float(np.median(first)), 0.0, 0.0
    median, sigma = _lognormal(np.maximum(np.array(rates), 1e-3))
    return float(np.median(first)), median, sigma


CALL_EXPONENT_GRID = tuple(np.round(np.arange(1.0, 0.39, -0.05), 2))


def _fit_call_work(work: np.ndarray, calls: np.ndarray) -> tuple[float, float]:
    """(call_work_s, call_work_exponent): the work per call and exponent under which
    max(1, round((work / call_work_s) ** exponent)) best gives each execution's number
    of calls (least absolute error over a grid around the median work per call, for
    each exponent from 1 down; a smaller exponent only when it fits strictly better)."""
    best = None
    for exponent in CALL_EXPONENT_GRID:
        guess = float(np.median(work / calls ** (1.0 / exponent)))
        for scale in guess * np.geomspace(0.5, 2.0, 401):
            misfit = np.abs(np.maximum(1, np.round((work / scale) ** exponent)) - calls).sum()
            if best is None or misfit < best[0]:
                best = (misfit, float(scale), float(exponent))
    return best[1], best[2]


def fit_load(
    workdir: Path,
    calls: list[dict],
    steps: list[dict],
    cores_grid: tuple[float, ...] = CORES_GRID,
    train_cores_grid: tuple[float, ...] = TRAIN_CORES_GRID,
) -> dict:
    """The load model's parameters from a run's calls and steps (module docstring), the
    decode cores searched over `cores_grid` (and a finer grid around the best), the
    training's demand over `train_cores_grid`."""
    tokens = np.array([c["tokens"] for c in calls], dtype=float)
    waited, first = _compile_calls(calls)
    # Calls that waited for a compilation or moved between engines (their batch is two
    # engines') are left out of the fit of a call's cost.
    clean = ~waited & ~np.array([bool(c.get("moved")) for c in calls])
    # Engines warm up over the first minute (shapes compile at more than the turns
    # modelled): the calls that start after the first step are the steady state.
    warm = np.array([c["start"] >= float(steps[0]["time_s"]) for c in calls])
    if np.count_nonzero(clean & warm) >= 50:
        clean &= warm
    steady_steps, new_width = _classify_steps(steps)
    step_tokens = np.array([steps[k]["tokens"] for k in steady_steps], dtype=float)

    design = np.stack([np.ones_like(tokens), tokens], axis=1)  # prefill + per token
    step_design = np.stack([np.ones_like(step_tokens), step_tokens], axis=1)

    def evaluate(cores, train_cores, per_engine, batch_costs):
        """The best batch cost's (misfit, cores, train_cores, per_engine, batch_cost,
        coef, call work, step work)."""
        call_work, step_work = _shared_work(
            calls, steps, cores, train_cores, per_engine, batch_costs
        )
        step_misfit = 0.0
        if len(step_tokens) >= 3:
            step_misfit = _log_lstsq(step_design, step_work[steady_steps])[1]
        best = None
        for i, batch_cost in enumerate(batch_costs if per_engine else (0.0,)):
            coef, misfit = _log_lstsq(design[clean], call_work[i][clean])
            got = (misfit + step_misfit, cores, train_cores, per_engine, batch_cost, coef)
            if best is None or got[0] < best[0] - 1e-12:
                best = (*got, call_work[i], step_work)
        return best

    best = None
    for per_engine in (False, True):
        for cores in cores_grid:
            for train_cores in train_cores_grid:
                got = evaluate(cores, train_cores, per_engine, BATCH_COST_GRID)
                if best is None or got[0] < best[0] - 1e-12:
                    best = got
    # Between grid points: finer grids of cores and of the batch cost around the best.
    fine_costs = tuple(np.clip(best[4] + np.linspace(-0.05, 0.05, 21), 0.0, 1.0))
    for cores in np.geomspace(best[1] / 1.13, best[1] * 1.13, 25):
        got = evaluate(float(cores), best[2], best[3], fine_costs)
        if got[0] < best[0] - 1e-12:
            best = got
    misfit, cores, train_cores, per_engine, batch_cost, coef, call_work, step_work = best
    predicted = design @ coef  # a call's work alone on its engine
    # Each call's work alone on its engine: measured; a call that waited for its
    # engine's compilation gets its modelled work instead.
    normal = np.where(waited, predicted, call_work)
    # A compilation is wall time: from its shape's first call start to the end of the
    # first call to finish, less that call's decode at the call's share; alone, once
    # the contention of the compilations running at the same time is taken out.
    # A window in which its engine's cell began to switch to training is left out: the
    # compile's end is unseen (its calls moved; the cell's next call, back in rollout,
    # ends it).
    drains: dict[str, list[float]] = {}
    for t in read_jsonl(Path(workdir) / "transitions.jsonl"):
        if t.get("kind") == "to_training":
            drains.setdefault(f"cell{t['cell']}", []).append(t["time_s"] - t["total_s"])
    with_context = all(c["prompt"] is not None for c in calls)
    if with_context:  # the decode ends the call: at the rate of its last moments
        *_, (edges, integral, engine) = _shared_work(
            calls, steps, cores, train_cores, per_engine, (batch_cost,), with_integral=True
        )
    windows = []
    for i, start in first:
        end = calls[i]["end"]
        if any(start < t < end for t in drains.get(calls[i]["engine"], [])):
            continue
        if with_context:
            done = integral[0, engine[i]]
            end = float(np.interp(np.interp(end, edges, done) - predicted[i], done, edges))
        else:  # the decode at the call's mean rate
            wall = calls[i]["end"] - calls[i]["start"]
            end -= predicted[i] * wall / max(call_work[i], 1e-12)
        windows.append((calls[i]["shape"], start, max(start, end)))
    # Prompt lengths in the records: engines compile per context bucket (the median over
    # the engines that compiled it; buckets never reached cost nothing), with contention;
    # else per turn, in wall time.
    contention, by_shape = _fit_contention(windows, CONTENTION_GRID if with_context else (0.0,))
    by_execution: dict[str, list[tuple[float, float, float]]] = {}
    for c, w in zip(calls, normal, strict=True):
        by_execution.setdefault(c["execution"], []).append((c["start"], c["end"], w))
    turns = max(1, round(len(calls) / len(by_execution)))
    work, gaps = [], []
    for parts in by_execution.values():
        parts.sort()
        work.append(sum(w for *_, w in parts))
        # The time between its calls, spread over the model's turns - 1 tool calls.
        gaps.append(sum(b[0] - a[1] for a, b in itertools.pairwise(parts)) / max(turns - 1, 1))
    # The executions that start after the first step: the steady state (as `clean`).
    first_end = float(steps[0]["time_s"])
    steady = [w for w, p in zip(work, by_execution.values(), strict=True) if p[0][0] >= first_end]
    median, sigma = _lognormal(np.array(steady if len(steady) >= 20 else work))
    tool_median, tool_sigma = _lognormal(np.array(gaps)) if turns > 1 else (0.0, 0.0)
    context = {}
    if with_context:
        # Calls by work: every gap between two calls is a tool call. The gaps one by one
        # are bimodal (many calls follow one another with no tool call), so the sigma is
        # that of an execution's mean gap, and the median keeps the mean gap the run's.
        pairs = [[b[0] - a[1] for a, b in itertools.pairwise(p)] for p in by_execution.values()]
        pairs = [g for g in pairs if g]
        tool_median, tool_sigma = 0.0, 0.0
        if pairs:
            tool_sigma = _lognormal(np.array([np.mean(g) for g in pairs]))[1]
            mean_gap = float(np.mean(np.concatenate(pairs)))
            tool_median = mean_gap * float(np.exp(-(tool_sigma**2) / 2))
        tokens0, per_call, context_sigma = _fit_context(calls)
        counts = np.array([len(p) for p in by_execution.values()])
        buckets = range(SMALLEST_BUCKET_LOG2, max(by_shape) + 1)
        call_work, call_exponent = _fit_call_work(np.array(work), counts)
        context = {
            "context_tokens": tokens0,
            "context_per_call": per_call,
            "call_work_s": call_work,
            "call_work_exponent": call_exponent,
            "context_sigma": context_sigma,
            "bucket_compile_s": tuple(_timed_median(by_shape.get(b, [])) for b in buckets),
            "engine_compile_s": (),
        }
    deloaded = [dict(s, step_s=float(w)) for s, w in zip(steps, step_work, strict=True)]
    fitted_steps = [deloaded[k] for k in steady_steps] or deloaded[1:] or deloaded
    per_token_s, overhead, parallel, residual = _fit_steps(fitted_steps)

    def extra(k: int) -> float:  # step k's work beyond the steady fit
        s = deloaded[k]
        width = len(s["cells"]) if parallel else 1
        return s["step_s"] - overhead - per_token_s * s["tokens"] / width

    # A join's compile, logged in wall seconds, is work at the step's mean share.
    join_compile, join_work = [], np.zeros(len(steps))
    for k, s in enumerate(steps):
        mean_share = step_work[k] / max(s["step_s"], 1e-12)
        for j in s.get("joins", []):
            if (j.get("compile_s") or 0) > 0:
                join_compile.append(j["compile_s"] * mean_share)
                join_work[k] += j["compile_s"] * mean_share
    train_compile = [max(0.0, extra(k) - join_work[k]) for k in new_width]
    return {
        "decode_cores": cores,
        "train_cores": train_cores,
        "per_engine": bool(per_engine),
        "batch_cost": float(batch_cost),
        "engine_compile_s": _compile_by_turn(calls, by_shape, turns),
        "train_compile_s": float(np.mean(train_compile)) if train_compile else 0.0,
        "join_compile_s": float(np.mean(join_compile)) if join_compile else 0.0,
        "duration_median_s": median,
        "duration_sigma": sigma,
        "turns": turns,
        "tool_median_s": tool_median if turns > 1 or with_context else 0.0,
        "tool_sigma": tool_sigma if turns > 1 or with_context else 0.0,
        "train_s_per_token": per_token_s,
        "step_overhead_s": overhead,
        "train_parallel": bool(parallel),
        "first_step_s": max(0.0, float(extra(0) - join_work[0])),
        "compile_contention": contention,
        **context,
        "residual": residual,
        "identified": parallel is not None,
        "misfit": misfit,
    }


# The decode cores and training demands tried when other runs' walls choose them: the
# cores a factor 2 apart (every sixth point of CORES_GRID, each refined by fit_load's
# finer grid), the demands likewise: 63 fits, the plausible ones (below) each predicting
# the runs given.
CORES_BY_WALL_GRID = CORES_GRID[::6]
TRAIN_CORES_BY_WALL_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
# Only fits that explain the calls' and steps' costs nearly as well as the best compete
# (misfit within 20% of it): a wall alone, one draw with tool calls in it, would
# otherwise push the cores to wherever they absorb the model's other errors.
CORES_BY_WALL_TOLERANCE = 0.2


def fit_run(workdir: Path, load: bool = False, cores_by: Sequence[Path] = ()) -> Fit:
    """Fits the simulator's model to the run in `workdir` (module docstring); `load`:
    its load-dependent model.

    `cores_by` (load model only): other finished runs on the same host (another policy
    or split), whose walls choose what one run may not tell: how many computations the
    host runs at full speed (`decode_cores`) and how much a training step demands of
    them (`train_cores`). A run where about as many engines decode at every moment
    explains its calls about as well with one core as with four, yet a run with a single
    engine would have the whole host under the first and a quarter of it under the
    second; under colocate no call decodes beside a step, so nothing shows how much a
    step slows the engines. So the load model is fitted at each pair of
    `CORES_BY_WALL_GRID` and `TRAIN_CORES_BY_WALL_GRID` (everything else fitted anew
    there); among the fits whose misfit of the calls' and steps' costs is within
    `CORES_BY_WALL_TOLERANCE` of the least, the one whose predicted walls (`predict`) of
    the runs in `cores_by` are closest to theirs (the least sum of squared log ratios)
    is kept, of equals the first (the fewest cores). Those runs are then in sample.
    """
    workdir = Path(workdir)
    run = read_run(workdir)
    schedule = run["schedule"]
    executions = read_jsonl(workdir / "executions.jsonl")
    steps = [s for s in read_jsonl(workdir / "metrics.jsonl") if not s.get("skipped")]
    if not executions or not steps:
        raise ValueError(f"{workdir}: no executions.jsonl or metrics.jsonl to fit")
    durations = np.array([e["finished_s"] - e["started_s"] for e in executions])
    median, sigma = _lognormal(durations)
    per_token, overhead, parallel, residual = _fit_steps(steps)
    per_execution = schedule["group_size"] * schedule["groups_per_step"]
    tokens_mean = float(np.mean([s["tokens"] for s in steps])) / per_execution
    switches = read_jsonl(workdir / "transitions.jsonl")
    to_training = [t["total_s"] for t in switches if t["kind"] == "to_training"]
    to_rollout = [
        t["total_s"] - t.get("wait_boundary_s", 0.0) for t in switches if t["kind"] == "to_rollout"
    ]
    dispatched = read_jsonl(workdir / "dispatch.jsonl")
    startup = min((d["time"] for d in dispatched), default=0.0)
    shutdown = max(0.0, run["wall_s"] - max(s["time_s"] for s in steps))
    sim = _schedule_config(schedule).replace(
        duration_median_s=median,
        duration_sigma=sigma,
        timeout_s=float(schedule["timeout_s"]),
        tokens_mean=max(tokens_mean, 1e-9),
        tokens_sigma=0.0,
        train_s_per_token=per_token,
        step_overhead_s=overhead,
        train_parallel=bool(parallel),
        to_training_s=float(np.mean(to_training)) if to_training else 0.0,
        to_rollout_s=float(np.mean(to_rollout)) if to_rollout else 0.0,
        executions_hold_slots=False,
    )
    if not load:
        if cores_by:
            raise ValueError("cores_by chooses the load model's cores and demand: pass load=True")
        return Fit(sim, startup, shutdown, residual, parallel is not None)
    calls = read_calls(workdir)

    def load_fit(
        cores_grid: tuple[float, ...], train_cores_grid: tuple[float, ...] = TRAIN_CORES_GRID
    ) -> tuple[Fit, float]:
        """(the fit, its misfit of the calls' and steps' costs)."""
        fitted = fit_load(workdir, calls, steps, cores_grid, train_cores_grid)
        residual, identified = fitted.pop("residual"), fitted.pop("identified")
        misfit = fitted.pop("misfit")
        return Fit(sim.replace(**fitted), startup, shutdown, residual, identified), misfit

    if not cores_by:
        return load_fit(CORES_GRID)[0]
    checks = [read_run(d) for d in cores_by]

    def wall_error(fit: Fit) -> float:
        return sum(float(np.log(predict(fit, r) / r["wall_s"])) ** 2 for r in checks)

    fits = [load_fit((c,), (t,)) for c in CORES_BY_WALL_GRID for t in TRAIN_CORES_BY_WALL_GRID]
    # (+ 1e-12: a simulated log's exact fits have misfits of 0 give or take rounding)
    most = (1 + CORES_BY_WALL_TOLERANCE) * min(misfit for _, misfit in fits) + 1e-12
    plausible = [fit for fit, misfit in fits if misfit <= most]
    best = min(plausible, key=wall_error)  # the first of equals: the fewest cores
    return dataclasses.replace(best, cores_by=tuple(str(d) for d in cores_by))


SCHEDULE_FIELDS = (
    "cells",
    "capacity",
    "group_size",
    "groups_per_step",
    "steps",
    "mu",
    "phi",
    "max_staleness",
)


def _schedule_config(schedule: dict) -> SimConfig:
    """A SimConfig with a run's schedule (the model fields at their defaults)."""
    return SimConfig(**{k: schedule[k] for k in SCHEDULE_FIELDS})


PREDICT_SEEDS = tuple(range(9))
Results = list[SimResult] | None  # simulations `predicted_runs` already made, or None


def schedule_options(schedule: dict) -> dict:
    """The policy options a run's schedule sets (`simulate` keeps those its policy
    takes): the async split, elastic's overcommit and the dispatch depth, read as the
    runtime reads its config (`policies.options_from_fields`)."""
    return options_from_fields(schedule)


def predicted_runs(fit: Fit, run: dict, seeds: tuple[int, ...] = PREDICT_SEEDS) -> list[SimResult]:
    """`run` (a `read_run` result: its policy and schedule) simulated under the fitted
    model, one result per seed. Its split, dispatch depth and (load model only: the
    plain one has no calls to measure it) `slot_occupancy` are simulated as the run set
    them."""
    schedule = run["schedule"]
    sim = fit.sim.replace(**{k: schedule[k] for k in SCHEDULE_FIELDS})
    if sim.load_model:  # only its decode phases give a share of time in model calls
        sim = sim.replace(slot_occupancy=schedule.get("slot_occupancy", 0.0))
    options = schedule_options(schedule)
    return [simulate(sim.replace(seed=s), schedule["policy"], **options) for s in seeds]


def predicted_walls(
    fit: Fit, run: dict, seeds: tuple[int, ...] = PREDICT_SEEDS, results: Results = None
) -> np.ndarray:
    """`run`'s wall time (s) under the fitted model, one per seed: startup + the
    simulated makespan + shutdown. `results`: `predicted_runs`' simulations when the
    caller has them (else they are run here)."""
    results = results if results is not None else predicted_runs(fit, run, seeds)
    return fit.startup_s + np.array([r.makespan_s for r in results]) + fit.shutdown_s


def predicted_trainer_time(
    fit: Fit, run: dict, seeds: tuple[int, ...] = PREDICT_SEEDS, results: Results = None
) -> dict[str, float]:
    """`run`'s wall from the trainer's side under the fitted model (`driver.trainer_time`,
    startup counted before the first step and shutdown after the last, as a real run's
    `trainer_s`): each part's median over the seeds. Set beside the run's own, it says
    whether the model misses its training or the time the trainer waits for data.
    `results`: as `predicted_walls`."""
    results = results if results is not None else predicted_runs(fit, run, seeds)
    parts = [r.trainer_time_s() for r in results]
    for part in parts:
        part["before_first_step"] += fit.startup_s
        part["after_last_step"] += fit.shutdown_s
    return {k: float(np.median([p[k] for p in parts])) for k in parts[0]}


def predict(fit: Fit, run: dict, seeds: tuple[int, ...] = PREDICT_SEEDS) -> float:
    """Predicted wall time (s) of one run like `run`: the median of `predicted_walls`.
    The median, not the mean: with tool calls a makespan is set by the slowest
    executions, so its distribution over seeds has a long right tail, and one run lands
    near its median far more often than near its mean."""
    return float(np.median(predicted_walls(fit, run, seeds)))


def predicted_band(
    fit: Fit, run: dict, seeds: tuple[int, ...] = PREDICT_SEEDS, results: Results = None
) -> tuple[float, float, float]:
    """(10th percentile, median, 90th percentile) of `predicted_walls`: the spread one
    run of `run`'s configuration has under the model (seed to seed). `results`: as
    `predicted_walls`."""
    walls = predicted_walls(fit, run, seeds, results)
    low, median, high = np.percentile(walls, [10, 50, 90])
    return float(low), float(median), float(high)


def write_run_logs(
    sim: SimConfig,
    result: SimResult,
    policy: str,
    workdir: Path,
    startup_s: float = 0.0,
    options: dict | None = None,
) -> None:
    """Writes a simulated run's logs in the runtime's format (`fit_run` reads them).

    Times are shifted by `startup_s` (the simulated engines start that late); `options`:
    the policy options the run was simulated with (its schedule records the async split
    and the dispatch depth, as the runtime's does). A run of
    the load model also gets its decode phases as model calls in `executions/*.gxr`:
    headers only (what `read_calls` reads), `TOKENS_PER_WORK_S` output tokens per
    second of decode work."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = result.log
    n = sim.group_size
    with open(workdir / "dispatch.jsonl", "w") as f:
        for seq, when in enumerate(log["dispatched"]):
            f.write(json.dumps({"group": f"g{seq}", "seq": seq, "time": startup_s + when}) + "\n")
    with open(workdir / "executions.jsonl", "w") as f:
        for e, finished in enumerate(log["finished"]):
            if np.isnan(finished):
                continue
            started = log["dispatched"][e // n]
            f.write(
                json.dumps(
                    {
                        "execution": f"g{e // n}/{e % n}",
                        "group": f"g{e // n}",
                        "started_s": startup_s + started,
                        "finished_s": startup_s + float(finished),
                    }
                )
                + "\n"
            )
    with open(workdir / "metrics.jsonl", "w") as f:
        compiles: dict[int, list] = {}
        for step, cell, wall in log.get("join_compiles", []):
            compiles.setdefault(step, []).append({"cell": cell, "compile_s": wall})
        b = sim.groups_per_step
        for step, (start, end, tokens, cells, at_start) in enumerate(log["steps"], start=1):
            joins = compiles.get(step, [])
            joins += [{"cell": -1, "compile_s": 0.0}] * (cells - at_start - len(joins))
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "time_s": startup_s + end,
                        "step_s": end - start,
                        "tokens": tokens,
                        "cells": list(range(at_start)),  # as the runtime: at the start
                        "joins": joins,
                        "groups": [f"g{g}" for g in result.trained[(step - 1) * b : step * b]],
                    }
                )
                + "\n"
            )
    with open(workdir / "transitions.jsonl", "w") as f:
        for cell, kind, start, end, wait in log["switches"]:
            record = {"time_s": startup_s + end, "cell": cell, "kind": kind, "total_s": end - start}
            if kind == "to_rollout":
                record["wait_boundary_s"] = wait
            f.write(json.dumps(record) + "\n")
    options = options or {}
    schedule = {
        "policy": policy,
        "cells": sim.cells,
        "capacity": sim.capacity,
        "group_size": sim.group_size,
        "groups_per_step": sim.groups_per_step,
        "steps": sim.steps,
        "mu": sim.mu,
        "phi": sim.phi,
        "max_staleness": sim.max_staleness,
        **{field: options.get(name, default) for name, (field, default) in OPTION_FIELDS.items()},
        "lookahead": options.get("lookahead", "default"),
        "slot_occupancy": sim.slot_occupancy,
        "timeout_s": sim.timeout_s,
    }
    summary = {
        "wall_s": startup_s + result.makespan_s,
        "steps": sim.steps,
        "utilisation": result.utilisation,
        "transitions": result.transitions,
        "schedule": schedule,
    }
    (workdir / "run_summary.json").write_text(json.dumps(summary, indent=2))
    if log.get("calls"):
        by_execution: dict[int, list] = {}
        for e, start, end, work, engine, prompt in log["calls"]:
            by_execution.setdefault(e, []).append((start, end, work, engine, prompt))
        (workdir / "executions").mkdir(exist_ok=True)
        for e, parts in by_execution.items():
            execution_id = f"g{e // n}/{e % n}"
            calls = [
                {
                    "call_id": i,
                    "started_at": startup_s + start,
                    "finished_at": startup_s + end,
                    "output_len": max(1, round(work * TOKENS_PER_WORK_S)),
                    "engines": [f"cell{i}" for i in dict.fromkeys(engine)],
                    **({} if prompt is None else {"prompt_len": prompt}),
                }
                for i, (start, end, work, engine, prompt) in enumerate(parts)
            ]
            header = json.dumps({"execution_id": execution_id, "calls": calls}).encode()
            path = workdir / "executions" / f"{escape_id(execution_id)}.gxr"
            path.write_bytes(MAGIC + len(header).to_bytes(8, "little") + header)
