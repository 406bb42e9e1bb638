"""Scheduling benchmark: colocate vs async vs elastic, side by side, fairly tuned.

Usage:
  python benchmarks/schedule_bench.py [--quick] [--json PATH] [--config PATH[:variant]]
                                      [--plot PATH] [--sensitivity] [--hindsight]
                                      [--cell_size [FACTORS]]
                                      [--workers N]
                                      [--real] [--real_steps N] [--real_warm DIR]
                                      [--real_workdir DIR] [--real_regimes compute,latency]
                                      [--real_processes P] [--real_lookaheads]
                                      [--real_cell_capacities N,...]
                                      [--real_occupancies X,...] [--real_overcommits X,...]
                                      [--real_only REGEX]
                                      [--real_flags=FLAGS] [--real_passes N]
                                      [--calibrate DIR|elastic] [--load_model]
                                      [--cores_by DIR|NAME]
                                      [--reward_plot PATH]

In the discrete-event simulator (gyrejax/scheduler/simulator.py; the model and its
assumptions are in `configs/sim_paper.py`'s docstring), over the same traces for every
policy:
  (a) published: the paper's asymmetric setting (async one step off-policy, elastic with
      no gate). NOT like for like; kept only to compare with the paper's figures;
  (b) fair: for every workload, cluster shape and gate S of the config's `fair` section,
      each policy at its own best publication cadence mu, dispatch depth phi (with
      lookahead "phi"; or "gate": dispatch as deep as S allows) and, for async, split
      (whole, or halfway between two: their cells alternating per step; then beside
      async's best three, splits moved by 1/6, 1/4 and 1/3 of a cell; elastic's each
      also with `overcommit` 0.25, 0.5, 0.75 and 1; where tasks carry a duration hint,
      the mixed workload, every setting also with `dispatch_order` "longest_first"):
      all swept on the first seed, the best three settings of each policy re-run on every
      seed, the best mean kept. Columns: the setting, makespan (mean over seeds), the
      bound valid for any cadence and dispatch order (`makespan_bound_s`, the least over
      the orders swept), makespan / bound, measured staleness (max, mean; a group's
      staleness is the trainer's version when it is trained minus the version it was
      dispatched with, i.e. its oldest tokens'), idle cell-hours by cause, and each
      policy over elastic; then the term of the bound that set it on each seed
      (`makespan_bound_terms_s`: work, gate_chain, pipeline_fill, deadline_chain,
      gate_windows), the gate's limit (an ESTIMATE, not a bound: the same gate with
      unlimited cells and free training), the train-all limit (an ESTIMATE: every cell
      of the cluster training, at the real cost, beside unlimited rollout cells: what
      moving cells could at most reach) and the issue-14 goals: met, not met, not met
      and unreachable (the bound rules the goal out for every policy), or not met and
      out of reach by the train-all estimate;
  a Pareto plot (`--plot`, default schedule_pareto.png): makespan against mean staleness,
  per policy the front of every setting swept at every S, and its best setting per S;
  `--sensitivity`: drift and mixed at S = 8 with token_exponent 0, 0.5 and 1 (whether the
  rollout/training ratio drifts at all);
  `--hindsight` (at S = 4 and 8): a baseline stronger than any fixed split, async (at its
  best setting, or any cadence) with a split that changes per quarter of the run, searched
  on the very traces it is scored on (`hindsight_split`: it shows whether the best split
  moves over the run, and whether alternating two splits beats both; not a policy anyone
  could run, since it knows the run in advance). Adds about 15 minutes on 2 cores;
  `--cell_size [2,4]` (at S = 4 and 8): every workload and shape again with cells 2 (and
  4) times smaller, as many slots and the same training compute (`smaller_cells`), each
  policy re-tuned: a waterlevel moves whole cells, so up to a cell's slots stay free in
  rollout; this shows what that costs each policy (works with --no-sim: then every
  shape is tuned here). Halves add about 8 minutes on 2 cores, quarters more.

`--real` runs the three policies (async over every split) as real tiny CPU runs of equal
work, in two regimes (compute-bound: today's tiny_cpu; latency-bound: tool calls that
wait), each from the same warm start if `--real_warm DIR` is given, and plots each
policy's step reward against wall clock (`--reward_plot`). `--calibrate DIR` fits the
simulator's model to a real run's logs (gyrejax.scheduler.calibrate) and predicts the
real runs of all three policies (with --real: the ones just run); `--calibrate elastic`
fits each regime's elastic run and predicts the others of that regime out of sample;
`--load_model` fits the simulator's load-dependent model (shared cores) instead (from
records with prompt lengths, as the real runs': calls by work, context growth per call,
compiles per context bucket; `benchmarks/calibration_bench.py` tabulates the errors);
`--cores_by` lets another run's wall choose that model's cores and training demand (a
workdir, or with --real the name of a real run in each regime, e.g. "async(3) mu=1": one
rollout engine).
Every real run's log is its workdir's launch.log; runs already finished in
`--real_workdir` are read back, so an interrupted benchmark goes on where it stopped.
`--real_processes 2` runs each real run as 2 processes of 4 devices, each pinned to a core
of its own (launch/local.sh --pin): a cell freed from rollout then adds compute.
`--real_lookaheads` adds async and elastic at their non-default dispatch depth
(`scheduler.lookahead`: async "gate", elastic "phi"). `--real_cell_capacities 32,64`
adds elastic counting each rollout cell as serving that many executions
(`scheduler.cell_capacity`; the engines keep their slots): an agent waiting on a tool
holds no slot, so elastic's waterlevel may free more cells (async's split does not use it).
`--real_occupancies 0.5,1` adds elastic whose capacity follows the measured share of time
its agents spend in model calls (`scheduler.slot_occupancy`); `--real_overcommits 0.5,1`
elastic with that `scheduler.elastic_overcommit` (it acts only while two steps of data
wait and groups remain to dispatch, which the default tiny run seldom has).
`--real_only REGEX` runs only the variants whose name matches (each policy's best,
re-measured); `--real_flags` adds flags to every real run, given with "=" (a value
starting with "--"), e.g. a looser gate:
`--real_flags=--config.scheduler.max_staleness=11`. `--real_passes N` runs every
variant N times, pass after pass (DIR/<regime>/pass<i>/), and prints each variant's
walls and median, and elastic's best against the better baseline's as the ratio of
medians and pass by pass (the machines are noisy: one run is one draw); each variant's
median run is then the one calibration and the reward plot use.

--quick uses configs/sim_paper.py:quick (12 steps, one seed, one small shape).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from gyrejax.config import DISPATCH_ORDERS
from gyrejax.scheduler.driver import TRAINER_TIME
from gyrejax.scheduler.policies import IDLE_CAUSES, Async, View, cells_at_step
from gyrejax.scheduler.simulator import (
    HINTED_WORKLOADS,
    HOUR,
    SimConfig,
    Simulator,
    make_trace,
    makespan_bound_s,
    makespan_bound_terms_s,
    simulate,
)

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("colocate", "async", "elastic")
TOP = 3  # settings of each policy re-run on every seed


def load_config(spec: str):
    """`configs/x.py[:variant]` -> its get_config(variant) (a ConfigDict)."""
    path, _, variant = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("sim_config", REPO / path)
    if module_spec is None:
        raise SystemExit(f"--config {spec}: no such config file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)


# --- one simulated run (in a worker process) -------------------------------------------

_TRACES: dict = {}


def _trace(sim: SimConfig):
    """The trace of a config (every field but the schedule's decides it), cached so that
    a sweep builds it and its bound once per worker."""
    # The gate sets the blocks "longest_first" reorders, so it is part of that trace.
    gate = None if sim.dispatch_order == "fifo" else sim.max_staleness
    key = sim.replace(cells=2, capacity=1, mu=1, phi=0, max_staleness=gate)
    if key not in _TRACES:
        _TRACES[key] = make_trace(sim)
    return _TRACES[key]


# The fields of a setting that are SimConfig's (the rest are the policy's options).
SETTING_SIM_FIELDS = ("mu", "phi", "dispatch_order")


def with_schedule(sim: SimConfig, setting: dict) -> SimConfig:
    """`sim` with a setting's `SETTING_SIM_FIELDS`."""
    return sim.replace(**{k: setting[k] for k in SETTING_SIM_FIELDS if k in setting})


def dispatch_orders(sim: SimConfig) -> tuple[str, ...]:
    """The dispatch orders swept under `sim`: both where its tasks carry a duration hint
    (`HINTED_WORKLOADS`), else "fifo" alone."""
    return DISPATCH_ORDERS if sim.workload in HINTED_WORKLOADS else ("fifo",)


def loosest_order(sim: SimConfig) -> SimConfig:
    """`sim` in the one of `dispatch_orders` whose trace has the least `makespan_bound_s`
    (each order is a different trace): that bound holds whichever order a policy takes."""
    ordered = [sim.replace(dispatch_order=o) for o in dispatch_orders(sim)]
    return min(ordered, key=lambda s: makespan_bound_s(s, _trace(s)))


def any_order_bound_s(sim: SimConfig) -> float:
    """`makespan_bound_s` valid whichever of `dispatch_orders` a policy takes."""
    loosest = loosest_order(sim)
    return makespan_bound_s(loosest, _trace(loosest))


def run_one(job: tuple[dict, str, dict]) -> dict:
    """(SimConfig fields, policy, setting) -> the run's summary. The setting holds
    `SETTING_SIM_FIELDS` and the policy's options."""
    fields, policy, setting = job
    options = {k: v for k, v in setting.items() if k not in SETTING_SIM_FIELDS}
    sim = with_schedule(SimConfig(**fields), setting)
    result = simulate(sim, policy, _trace(sim), **options)
    return {**result.summary(), "setting": setting}


def _async_limit_h(sim: SimConfig, relaxed: SimConfig, split: int, cadences) -> float:
    """Async on `relaxed` (more resources than `sim`, on `sim`'s trace) with `split` cells
    training, dispatching as deep as the gate allows, at its best cadence among the
    cadences (those <= S + 1; at mu = 1 alone the gate's limit was beaten, since the mixed
    workload at S = 2 and 4 runs best at mu = 2 for every policy) and dispatch order: an
    estimate, not a bound."""
    gate = sim.max_staleness
    return min(
        simulate(
            relaxed.replace(mu=mu, dispatch_order=order),
            "async",
            _trace(sim.replace(dispatch_order=order)),
            training_cells=split,
            lookahead="gate",
        ).makespan_s
        / HOUR
        for mu in cadences
        if gate is None or mu - 1 <= gate
        for order in dispatch_orders(sim)
    )


def gate_limit_h(job: tuple[dict, tuple[int, ...]]) -> float:
    """(SimConfig fields, cadences) -> the gate's limit (a job of the worker pool):
    `_async_limit_h` with unlimited slots and cells, free training and switches."""
    fields, cadences = job
    sim = SimConfig(**fields)
    free = sim.replace(
        cells=sim.cells * 64,
        capacity=sim.capacity * 64,
        train_s_per_token=1e-12,
        to_training_s=0.0,
        to_rollout_s=0.0,
    )
    return _async_limit_h(sim, free, 1, cadences)


def train_all_limit_h(job: tuple[dict, tuple[int, ...]]) -> float:
    """(SimConfig fields, cadences) -> the train-all limit (a job of the worker pool), what
    moving cells could at most reach: `_async_limit_h` with the cluster's cells all
    training at the real cost beside rollout cells that hold every execution at once."""
    fields, cadences = job
    sim = SimConfig(**fields)
    executions = sim.steps * sim.groups_per_step * sim.group_size
    rollout_cells = -(-executions // sim.capacity)
    return _async_limit_h(sim, sim.replace(cells=sim.cells + rollout_cells), sim.cells, cadences)


class PhasedSplit(Async):
    """A hindsight comparator, not a policy to run: async whose split changes with the
    run's phase: `splits[i]` cells train during the i-th of len(splits) equal spans of
    the run's steps (a fraction as async's, alternating whole splits step by step;
    dispatch as async's `lookahead`). Searched on the very traces it is scored on
    (`hindsight_split`), it is the best a split chosen in advance could do if it knew how
    the run would go, e.g. whether the rollout/training ratio drifts."""

    def __init__(self, splits: tuple[float, ...], steps: int, lookahead: str = "phi"):
        super().__init__(max(splits), lookahead)
        self.splits, self.steps = tuple(splits), steps
        self.label = "phased async"

    def split(self, view: View) -> int:
        phase = view.steps_done * len(self.splits) // self.steps
        return cells_at_step(self.splits[min(phase, len(self.splits) - 1)], view.steps_done)


def run_phased(job: tuple[dict, dict, tuple[float, ...]]) -> float:
    """(SimConfig fields, async setting, splits per phase) -> makespan h (a pool job)."""
    fields, setting, splits = job
    sim = with_schedule(SimConfig(**fields), setting)
    policy = PhasedSplit(splits, sim.steps, setting.get("lookahead", "phi"))
    return Simulator(sim, policy, _trace(sim), name=policy.label).run().makespan_s / HOUR


HINDSIGHT_GATES = (4, 8)  # the gates with goals (issue 14)
HINDSIGHT_GRID = 3  # the two halves: each split up to 3 cells from the best async's
HINDSIGHT_MOVES = tuple(Fraction(1, d) for d in (6, 3, 2, 1))  # then each quarter's, +-


def hindsight_split(pool, sim: SimConfig, fair, setting: dict) -> dict:
    """The best `PhasedSplit` by its mean makespan over the seeds of `fair`, at the best
    async's setting and at every cadence of `fair` dispatching to the gate, starting from
    the best async's split x: at each, every pair of splits x + j (j whole, |j| <= 3) over
    the run's two halves, then from the best pair four quarters by coordinate descent
    (each split moved by a sixth, a third, a half or a whole cell). The grid holds x over
    the whole run, async itself, so the result is never worse than the best async. A
    search, not an optimum; a hindsight baseline, stronger than any split chosen in
    advance."""
    x = Fraction(setting["training_cells"]).limit_denominator(12)  # 3.667 -> 11/3
    gate = sim.max_staleness
    fixed = {k: setting[k] for k in ("training_cells", "dispatch_order") if k in setting}
    settings = [setting] + [
        {"mu": mu, "phi": 0, "lookahead": "gate", **fixed}
        for mu in fair.cadences
        if gate is None or mu - 1 <= gate
    ]
    settings = [s for i, s in enumerate(settings) if s not in settings[:i]]

    def mean_h(at: dict, patterns: list[tuple[Fraction, ...]]) -> list[float]:
        jobs = [
            (dict(vars(sim), seed=s), at, tuple(map(float, p)))
            for p in patterns
            for s in fair.seeds
        ]
        out = pool.map(run_phased, jobs)
        n = len(fair.seeds)
        return [float(np.mean(out[i : i + n])) for i in range(0, len(out), n)]

    def search(at: dict) -> tuple[float, tuple[Fraction, ...]]:
        grid = sorted([x, *moved_splits(x, range(1, HINDSIGHT_GRID + 1), sim.cells)])
        halves = [(a, b) for a in grid for b in grid]
        scores = mean_h(at, halves)
        a, b = halves[scores.index(min(scores))]
        best = (a, a, b, b)  # the same halves (quarters of steps not divisible by 4 differ)
        best_h = mean_h(at, [best])[0]
        for _ in range(3):
            trials = [
                (*best[:i], k, *best[i + 1 :])
                for i in range(4)
                for k in moved_splits(best[i], HINDSIGHT_MOVES, sim.cells)
            ]
            scores = mean_h(at, trials)
            if min(scores) >= best_h - 1e-9:
                break
            best_h = min(scores)
            best = trials[scores.index(best_h)]
        return best_h, best

    found = [(*search(at), i) for i, at in enumerate(settings)]
    best_h, best, i = min(found)
    return {"makespan_h": best_h, "splits": [float(k) for k in best], "setting": settings[i]}


# --- the sweep ----------------------------------------------------------------------------


def half_splits(cells: int) -> list[float]:
    """Async's splits on `cells` cells: every whole number of training cells that leaves
    one rolling out, and every half between two (alternating them per step)."""
    return [j / 2 if j % 2 else j // 2 for j in range(2, 2 * cells - 1)]


# Elastic's overcommit values swept (a share of a cell's slots; policies.Elastic).
OVERCOMMITS = (0.25, 0.5, 0.75, 1.0)


def settings(policy: str, sim: SimConfig, fair) -> list[dict]:
    """Every setting swept for a policy under the gate of `sim` (elastic's each also with
    every `OVERCOMMITS`)."""
    cadences = [
        mu for mu in fair.cadences if sim.max_staleness is None or mu - 1 <= sim.max_staleness
    ]
    out = []
    for mu in cadences:
        if policy == "colocate":
            out.append({"mu": mu, "phi": 0})
            continue
        splits = half_splits(sim.cells) if policy == "async" else [None]
        for k in splits:
            split = {} if k is None else {"training_cells": k}
            out.append({"mu": mu, "phi": 0, "lookahead": "gate", **split})
            out += [{"mu": mu, "phi": phi, "lookahead": "phi", **split} for phi in fair.depths]
    if policy == "elastic":
        out += [dict(s, overcommit=share) for share in OVERCOMMITS for s in out]
    orders = dispatch_orders(sim)
    if len(orders) > 1:  # each setting in each order, named (whatever `sim`'s own)
        out = [dict(s, dispatch_order=o) for o in orders for s in out]
    return out


def moved_splits(split: Fraction, moves, cells: int) -> list[Fraction]:
    """`split` moved down and up by each of `moves` (in that order), keeping those that
    train at least one cell and leave one rolling out on `cells` cells."""
    moved = [split + sign * move for move in moves for sign in (-1, 1)]
    return [k for k in moved if k >= 1 and math.ceil(k) < cells]


def finer_splits(top: list[dict], sim: SimConfig) -> list[dict]:
    """Async settings beside the sweep's best: each split moved by 1/6, 1/4 and 1/3 of a
    cell (the sweep has wholes and halves only; on 8 cells 3.67 beat 3.5 by 2%),
    at the same cadence and dispatch rule; those swept already or leaving no rollout cell
    are left out."""
    swept = {tuple(sorted(s.items())) for s in top}
    out = []
    for setting in top:
        x = Fraction(setting["training_cells"])  # halves: exact
        for split in moved_splits(x, (Fraction(1, 6), Fraction(1, 4), Fraction(1, 3)), sim.cells):
            finer = dict(setting, training_cells=float(split))
            if (key := tuple(sorted(finer.items()))) not in swept:
                swept.add(key)
                out.append(finer)
    return out


def tune(pool, sim: SimConfig, fair) -> dict:
    """Each policy's best setting under `sim`'s gate: all settings on the first seed (for
    async also `finer_splits` beside its best `TOP`), the best `TOP` on every seed; the
    best mean makespan wins. Returns per policy the setting, its runs (one per seed) and
    the mean of their summaries; its bound is `any_order_bound_s`, so the same for every
    policy whichever dispatch order it took."""
    seeds = list(fair.seeds)
    base = dict(vars(sim), seed=seeds[0])
    jobs = [(base, p, s) for p in POLICIES for s in settings(p, sim, fair)]
    first = pool.map(run_one, jobs)
    out = {}
    for policy in POLICIES:
        runs = [r for (_, p, _), r in zip(jobs, first, strict=True) if p == policy]
        runs.sort(key=lambda r: r["makespan_h"])
        if policy == "async":  # and beside its best, finer splits
            finer = finer_splits([r["setting"] for r in runs[:TOP]], sim)
            runs += pool.map(run_one, [(base, policy, s) for s in finer])
            runs.sort(key=lambda r: r["makespan_h"])
        candidates = runs[:TOP]
        more = [
            (dict(vars(sim), seed=seed), policy, r["setting"])
            for r in candidates
            for seed in seeds[1:]
        ]
        rest = pool.map(run_one, more)
        best = None
        for i, r in enumerate(candidates):
            per_seed = [r, *rest[i * (len(seeds) - 1) : (i + 1) * (len(seeds) - 1)]]
            mean = float(np.mean([x["makespan_h"] for x in per_seed]))
            if best is None or mean < best["makespan_h"]:
                best = _mean_summary(per_seed)
        # Every setting's first-seed (mean staleness, makespan), for the Pareto plot.
        best["sweep"] = [(r["staleness_mean"], r["makespan_h"]) for r in runs]
        out[policy] = best
    if len(dispatch_orders(sim)) > 1:
        bounds_h = [any_order_bound_s(sim.replace(seed=seed)) / HOUR for seed in seeds]
        for best in out.values():
            best["bound_h"] = float(np.mean(bounds_h))
            best["over_bound"] = float(np.mean(np.divide(best["per_seed_h"], bounds_h)))
    return out


def _mean_summary(runs: list[dict]) -> dict:
    return {
        "setting": runs[0]["setting"],
        "makespan_h": float(np.mean([r["makespan_h"] for r in runs])),
        "per_seed_h": [r["makespan_h"] for r in runs],
        "bound_h": float(np.mean([r["bound_h"] for r in runs])),
        "over_bound": float(np.mean([r["makespan_over_bound"] for r in runs])),
        "staleness_max": max(r["staleness_max"] for r in runs),
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in runs])),
        "over_stale": sum(r["over_stale"] for r in runs),
        "utilisation": float(np.mean([r["utilisation"] for r in runs])),
        "idle_cell_h": {
            k: float(np.mean([r["idle_cell_h"][k] for r in runs])) for k in IDLE_CAUSES
        },
        "trainer_h": {k: float(np.mean([r["trainer_h"][k] for r in runs])) for k in TRAINER_TIME},
        "transitions": float(np.mean([sum(r["transitions"].values()) for r in runs])),
    }


def setting_label(policy: str, setting: dict) -> str:
    parts = [f"mu={setting['mu']}"]
    if policy != "colocate":
        if setting.get("lookahead") == "gate":
            parts.append("dispatch to S")
        else:
            parts.append(f"phi={setting['phi']}")
    if "training_cells" in setting:
        parts.insert(0, f"{setting['training_cells']:.4g} train")
    if setting.get("overcommit"):
        parts.append(f"overcommit {setting['overcommit']:g}")
    if setting.get("dispatch_order", "fifo") != "fifo":
        parts.append(setting["dispatch_order"].replace("_", " "))
    return ", ".join(parts)


# --- (b) fair tables and goals ----------------------------------------------------------------


def binding_terms(sim: SimConfig, seeds) -> dict[str, int]:
    """How many seeds' bounds each term of `makespan_bound_s` sets (the largest term:
    what limits every policy there)."""
    counts: dict[str, int] = {}
    for seed in seeds:
        seeded = loosest_order(sim.replace(seed=seed))
        terms = makespan_bound_terms_s(seeded, _trace(seeded))
        name = max(terms, key=terms.get)
        counts[name] = counts.get(name, 0) + 1
    return counts


# Issue 14's goals: elastic's lead over the best async (static; drift and mixed at S = 4
# and 8, where also over colocate and within a factor of the bound).
GOAL_STATIC_VS_ASYNC, GOAL_VS_ASYNC, GOAL_VS_COLOCATE, GOAL_OVER_BOUND = 1.05, 1.10, 1.20, 1.10


def goals(workload: str, gate: int, rows: dict, train_all_h: float | None = None) -> dict:
    """Issue 14's goals for one (workload, S): None where none is set.

    `lead_ceiling`: the best async over the bound, the most any policy could lead it
    (per seed; mean). `reachable`: False where no policy that keeps the gate could meet
    the goal: every makespan is at least the bound, so elastic's lead over a baseline is
    at most the baseline's mean makespan over the mean bound (the ratios here are of
    means). `within_estimate`: the same test against the train-all limit `train_all_h`
    (an estimate, `train_all_limit_h`: no policy that only moves the cluster's cells should
    beat it); None without a goal or a limit."""
    e, a, c = (rows[p]["makespan_h"] for p in ("elastic", "async", "colocate"))
    bound = rows["elastic"]["bound_h"]  # the same for every policy (trace and gate)
    out = {"vs_async": a / e, "vs_colocate": c / e, "vs_bound": rows["elastic"]["over_bound"]}
    out["lead_ceiling"] = rows["async"]["over_bound"]

    def could(best: float, over_bound: float) -> bool:
        """Whether a policy taking `best` hours (`over_bound` the bound) meets the goal."""
        if workload == "static":
            return a / best >= GOAL_STATIC_VS_ASYNC
        return (
            a / best >= GOAL_VS_ASYNC
            and c / best >= GOAL_VS_COLOCATE
            and over_bound <= GOAL_OVER_BOUND
        )

    if workload == "static" or gate in (4, 8):
        out["met"] = could(e, out["vs_bound"])
        out["reachable"] = could(bound, 1.0)
        out["within_estimate"] = (
            None if train_all_h is None else could(train_all_h, train_all_h / bound)
        )
    else:
        out["met"] = out["reachable"] = out["within_estimate"] = None
    return out


def goal_verdict(g: dict) -> str:
    """'met', 'NOT met', 'NOT met (unreachable ...)', 'NOT met (out of reach by the
    train-all estimate)' or 'no goal' for `goals`' output."""
    if g["met"] is None:
        return "no goal"
    if g["met"]:
        return "met"
    if not g["reachable"]:
        return "NOT met (unreachable: no policy keeping S could)"
    if g["within_estimate"] is False:
        return "NOT met (out of reach by the train-all estimate)"
    return "NOT met"


def fair_case(cfg, workload: str, cells: int, slots: int, gate: int, **overrides) -> SimConfig:
    """One case of the fair comparison: the config's sim with a workload (and
    `overrides` of it), a shape and a gate S; mu = 1, which every gate allows (the sweep
    sets each policy's cadence)."""
    fields = dict(cfg.workloads[workload].to_dict(), **overrides)
    base = SimConfig.from_dict(cfg.sim.to_dict())
    return base.replace(cells=cells, capacity=slots, max_staleness=gate, mu=1, **fields)


def fair(pool, cfg, report: dict, hindsight: bool = False) -> None:
    """The fair tables and goals (module docstring); `hindsight`: also the hindsight split
    (`hindsight_split`) at the gates with goals (`HINDSIGHT_GATES`)."""
    for workload in cfg.fair.workloads:
        for cells, slots in cfg.fair.shapes:
            key = f"{workload} {cells}x{slots}"
            print(
                f"\n### (b) fair: {key} (each policy at its best mu, phi and split under the "
                f"same S; mean of seeds {list(cfg.fair.seeds)})\n",
                flush=True,
            )
            print(
                "| S | policy | best setting | makespan h | bound h | / bound | stale max "
                "| stale mean | idle cell-h: "
                + ", ".join(IDLE_CAUSES)
                + " | trainer h: "
                + ", ".join(TRAINER_TIME[:3])
                + " | / elastic |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            report[key] = {}
            for gate in cfg.fair.gates:
                sim = fair_case(cfg, workload, cells, slots, gate)
                start = time.perf_counter()
                rows = tune(pool, sim, cfg.fair)
                jobs = [(dict(vars(sim), seed=s), cfg.fair.cadences) for s in cfg.fair.seeds]
                train_all = float(np.mean(pool.map(train_all_limit_h, jobs)))
                entry = {
                    "policies": rows,
                    "gate_limit_estimate_h": float(np.mean(pool.map(gate_limit_h, jobs))),
                    "train_all_limit_estimate_h": train_all,
                    "bound_set_by": binding_terms(sim, cfg.fair.seeds),
                    "goals": goals(workload, gate, rows, train_all),
                    "sim_s": time.perf_counter() - start,
                }
                if hindsight and gate in HINDSIGHT_GATES:
                    best = hindsight_split(pool, sim, cfg.fair, rows["async"]["setting"])
                    entry["hindsight_split"] = best
                    entry["goals"]["vs_hindsight_split"] = (
                        best["makespan_h"] / rows["elastic"]["makespan_h"]
                    )
                    entry["sim_s"] = time.perf_counter() - start
                report[key][gate] = entry
                elastic = rows["elastic"]["makespan_h"]
                for policy in POLICIES:
                    r = rows[policy]
                    idle = ", ".join(f"{r['idle_cell_h'][k]:.0f}" for k in IDLE_CAUSES)
                    # The makespan is the trainer's: after its last step the run ends.
                    trainer = ", ".join(f"{r['trainer_h'][k]:.1f}" for k in TRAINER_TIME[:3])
                    print(
                        f"| {gate} | {policy} | {setting_label(policy, r['setting'])} "
                        f"| {r['makespan_h']:.1f} | {r['bound_h']:.1f} | {r['over_bound']:.3f} "
                        f"| {r['staleness_max']} | {r['staleness_mean']:.2f} | {idle} "
                        f"| {trainer} | {r['makespan_h'] / elastic:.3f}x |",
                        flush=True,
                    )
            print(
                f"\ngoals ({key}): elastic vs best async, vs colocate, / bound; gate limit "
                "(estimate: unlimited cells, free training); train-all limit (estimate: every "
                "cell training, unlimited rollout cells beside them: what moving cells could "
                "at most reach)"
            )
            for gate, entry in report[key].items():
                g, limit = entry["goals"], entry["gate_limit_estimate_h"]
                met = goal_verdict(g)
                elastic = entry["policies"]["elastic"]["makespan_h"]
                best_async = entry["policies"]["async"]["makespan_h"]
                train_all = entry["train_all_limit_estimate_h"]
                seeds = len(cfg.fair.seeds)
                set_by = ", ".join(f"{k} {n}/{seeds}" for k, n in entry["bound_set_by"].items())
                phased, phased_text = entry.get("hindsight_split"), ""
                if phased:
                    schedule = dict(phased["setting"])
                    schedule.pop("training_cells")  # the splits per quarter replace it
                    splits = "[" + ", ".join(f"{k:.4g}" for k in phased["splits"]) + "]"
                    phased_text = (
                        f"; the hindsight split {phased['makespan_h']:.1f} h (cells training "
                        f"per quarter {splits}, {setting_label('async', schedule)}): "
                        f"elastic {g['vs_hindsight_split']:.3f}x it"
                    )
                print(
                    f"  S={gate}: {g['vs_async']:.3f}x async, {g['vs_colocate']:.2f}x colocate, "
                    f"{g['vs_bound']:.3f} of bound (async {g['lead_ceiling']:.3f} of it: the "
                    f"most any policy could lead async; set by {set_by}); gate limit "
                    f"{limit:.1f} h (elastic {elastic / limit:.2f}x it); train-all limit "
                    f"{train_all:.1f} h (elastic {elastic / train_all:.3f}x it, async "
                    f"{best_async / train_all:.3f}x){phased_text}: {met}"
                )


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (staleness, makespan) points no other point beats on both, by staleness."""
    front, best = [], np.inf
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def pareto_plot(report: dict, path: Path) -> None:
    """Makespan against mean staleness, one panel per workload and shape: per policy the
    Pareto front of every setting swept at every S (first seed; line), and its best
    setting at each S (mean of the seeds; markers, labelled by S)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(report)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for policy, marker in zip(POLICIES, "s^o", strict=True):
            rows = {s: e["policies"][policy] for s, e in report[key].items()}
            swept = [p for r in rows.values() for p in r.get("sweep", [])]
            line = ax.plot(*zip(*pareto_front(swept), strict=True), label=policy)[0]
            for s, r in rows.items():
                x, y = r["staleness_mean"], r["makespan_h"]
                ax.plot(x, y, marker=marker, color=line.get_color(), linestyle="")
                ax.annotate(f"S={s}", (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        ax.set_title(key)
        ax.set_xlabel("mean staleness of trained groups (versions)")
        ax.set_ylabel("makespan (h)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- (a) published and sensitivity ----------------------------------------------------------


def published(pool, cfg, report: dict) -> None:
    sim = SimConfig.from_dict(cfg.sim.to_dict())
    overrides = {
        "colocate": cfg.published.colocate.to_dict(),
        "async": cfg.published.async_.to_dict(),
        "elastic": cfg.published.elastic.to_dict(),
    }
    jobs = []
    for policy in POLICIES:
        fields = dict(vars(sim), **overrides[policy])
        for setting in (
            [{}] if policy != "async" else [{"training_cells": k} for k in range(1, sim.cells)]
        ):
            jobs.append((fields, policy, setting))
    runs = pool.map(run_one, jobs)
    print(
        "\n### (a) published settings: NOT like for like (async one step off-policy, "
        "elastic without a gate)\n"
    )
    print("| policy | setting | makespan h | / bound | stale max | stale mean |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for policy in POLICIES:
        best = min(
            (r for (_, p, _), r in zip(jobs, runs, strict=True) if p == policy),
            key=lambda r: r["makespan_h"],
        )
        rows[policy] = best
        print(
            f"| {policy} | {overrides[policy] | best['setting']} | {best['makespan_h']:.1f} "
            f"| {best['makespan_over_bound']:.3f} | {best['staleness_max']} "
            f"| {best['staleness_mean']:.2f} |"
        )
    e = rows["elastic"]["makespan_h"]
    print(
        f"\nasync / elastic {rows['async']['makespan_h'] / e:.2f}x, colocate / elastic "
        f"{rows['colocate']['makespan_h'] / e:.2f}x (published: 1.78x and 1.21x)"
    )
    report["published"] = rows


def sensitivity(pool, cfg, report: dict) -> None:
    """Does the rollout/training ratio drift at all? drift and mixed at S = 8 on the first
    shape, with token_exponent 0, 0.5 and 1 (1: tokens follow wall time, no drift)."""
    cells, slots = cfg.fair.shapes[0]
    print(f"\n### sensitivity: token_exponent, S=8, {cells}x{slots}\n")
    print(
        "| workload | token_exponent | elastic h | best async h (setting) | colocate h "
        "| elastic vs async | vs colocate | / bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    report["sensitivity"] = {}
    for workload in ("drift", "mixed"):
        for exponent in (0.0, 0.5, 1.0):
            sim = fair_case(cfg, workload, cells, slots, 8, token_exponent=exponent)
            rows = tune(pool, sim, cfg.fair)
            g = goals(workload, 8, rows)
            report["sensitivity"][f"{workload} e={exponent}"] = {"policies": rows, "goals": g}
            a = rows["async"]
            print(
                f"| {workload} | {exponent} | {rows['elastic']['makespan_h']:.1f} "
                f"| {a['makespan_h']:.1f} ({setting_label('async', a['setting'])}) "
                f"| {rows['colocate']['makespan_h']:.1f} | {g['vs_async']:.3f}x "
                f"| {g['vs_colocate']:.2f}x | {g['vs_bound']:.3f} |",
                flush=True,
            )


def smaller_cells(sim: SimConfig, factor: int = 2) -> SimConfig:
    """The same cluster in cells `factor` times smaller: `factor` times as many cells, each
    with 1/factor of the slots and of the training compute (so a token costs `factor`
    times the cell-seconds); the same switch costs, trace and bound."""
    if sim.capacity % factor:
        raise ValueError(
            f"sim.capacity={sim.capacity}: smaller cells by {factor} need a multiple of it"
        )
    if sim.load_model or not sim.train_parallel:
        raise ValueError(
            f"smaller cells: sim.decode_cores={sim.decode_cores}, sim.train_parallel="
            f"{sim.train_parallel}; only the plain model (decode_cores 0, train_parallel) "
            "scales with the cell"
        )
    return sim.replace(
        cells=sim.cells * factor,
        capacity=sim.capacity // factor,
        train_s_per_token=sim.train_s_per_token * factor,
    )


def cell_size(pool, cfg, report: dict, factors: tuple[int, ...] = (2,)) -> None:
    """Does the cell's size hold elastic back? At the gates with goals, every workload and
    shape again in cells `factors` times smaller (`smaller_cells`: the same slots and
    compute), each policy re-tuned, beside the fair tables' rows (tuned here when
    `report` has none). A waterlevel moves whole cells, so up to a cell's slots stay free
    in rollout (the gate column of the idle). On every shape elastic is held against each
    baseline at its best shape: the baselines may choose their cell size too."""
    gates = [g for g in cfg.fair.gates if g in HINDSIGHT_GATES]
    smaller = ", ".join(f"{f}x" for f in factors)
    print(f"\n### cell size: the same cluster in cells {smaller} smaller (same slots, compute)\n")
    print(
        "| workload | cells | S | elastic h | best async h (setting, cells) | colocate h "
        "| elastic vs async | vs colocate | elastic / bound | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    report["cell_size"] = {}
    for workload in cfg.fair.workloads:
        for cells, slots in cfg.fair.shapes:
            key = f"{workload} {cells}x{slots}"
            for gate in gates:
                sim = fair_case(cfg, workload, cells, slots, gate)
                fair_rows = report.get("fair", {}).get(key, {}).get(gate, {}).get("policies")
                by_shape = {f"{cells}x{slots}": fair_rows or tune(pool, sim, cfg.fair)}
                for factor in factors:
                    small = smaller_cells(sim, factor)
                    by_shape[f"{small.cells}x{small.capacity}"] = tune(pool, small, cfg.fair)
                entry = {"policies": by_shape, "goals": {}, "baselines_from": {}}
                for shape, rows in by_shape.items():
                    # Each baseline at its best shape; elastic at this one.
                    held = {"elastic": rows["elastic"]}
                    for policy in ("async", "colocate"):
                        best = min(by_shape, key=lambda k: by_shape[k][policy]["makespan_h"])
                        held[policy] = by_shape[best][policy]
                        entry["baselines_from"].setdefault(shape, {})[policy] = best
                    g = goals(workload, gate, held)
                    entry["goals"][shape] = g
                    a, from_shape = held["async"], entry["baselines_from"][shape]["async"]
                    print(
                        f"| {workload} | {shape} | {gate} | {rows['elastic']['makespan_h']:.1f} "
                        f"| {a['makespan_h']:.1f} ({setting_label('async', a['setting'])}, "
                        f"{from_shape}) | {held['colocate']['makespan_h']:.1f} "
                        f"| {g['vs_async']:.3f}x | {g['vs_colocate']:.2f}x | {g['vs_bound']:.3f} "
                        f"| {goal_verdict(g)} |",
                        flush=True,
                    )
                report["cell_size"][f"{key} S={gate}"] = entry


# --- real runs and calibration ------------------------------------------------------------


REGIMES = {
    # Today's tiny_cpu: rollout is decode on the same 2 cores (compute-bound).
    "compute": [],
    # Every tool call waits (lognormal, median 2 s), as builds and test suites do: rollout
    # holds few CPU-seconds and much wall time.
    "latency": [
        "--config.harness.tool_latency_median_s=2.0",
        "--config.harness.tool_latency_sigma=0.5",
    ],
}


def real_variants(
    cells: int = 4,
    mus: tuple[int, ...] = (1, 2),
    lookaheads: bool = False,
    cell_capacities: tuple[int, ...] = (),
    occupancies: tuple[float, ...] = (),
    overcommits: tuple[float, ...] = (),
) -> list[tuple[str, list[str]]]:
    """Every policy at every publication cadence mu (and async at every `half_splits`),
    all under tiny_cpu's gate S = 3: each policy's best is the fairly tuned one.
    `lookaheads`: also async and elastic at the dispatch depth that is not their default
    (async "gate", elastic "phi"), as the simulator's sweep has them. `cell_capacities`:
    also elastic with each of these `scheduler.cell_capacity` values; `occupancies`: with
    each of these `scheduler.slot_occupancy` values (the capacity measured as it runs);
    `overcommits`: with each of these `scheduler.elastic_overcommit` values."""
    variants = []
    for mu in mus:
        cadence = [f"--config.scheduler.mu={mu}"]
        variants.append((f"colocate mu={mu}", ["--config.scheduler.policy=colocate", *cadence]))
        for k in half_splits(cells):
            split = f"--config.scheduler.async_training_cells={k}"
            flags = ["--config.scheduler.policy=async", split]
            variants.append((f"async({k}) mu={mu}", [*flags, *cadence]))
            if lookaheads:
                depth = ["--config.scheduler.lookahead=gate"]
                variants.append((f"async({k}) mu={mu} gate", [*flags, *cadence, *depth]))
        variants.append((f"elastic mu={mu}", ["--config.scheduler.policy=elastic", *cadence]))
        if lookaheads:
            flags = ["--config.scheduler.policy=elastic", "--config.scheduler.lookahead=phi"]
            variants.append((f"elastic mu={mu} phi", [*flags, *cadence]))
        for label, field, values in (
            ("cap", "cell_capacity", cell_capacities),
            ("occupancy", "slot_occupancy", occupancies),
            ("overcommit", "elastic_overcommit", overcommits),
        ):
            for x in values:
                flags = ["--config.scheduler.policy=elastic", f"--config.scheduler.{field}={x}"]
                variants.append((f"elastic mu={mu} {label}={x}", [*flags, *cadence]))
    return variants


def best_of(runs: dict, policy: str) -> tuple[str, dict] | None:
    """The fastest run (name, run) of `policy` among the variants (None: none ran, e.g.
    under --real_only)."""
    named = [(n, r) for n, r in runs.items() if n.startswith(policy)]
    return min(named, key=lambda x: x[1]["wall_s"]) if named else None


def real_runs(args) -> dict:
    """The policies as real tiny CPU runs of equal work (configs/tiny_cpu.py: 4 cells,
    `--real_steps` RL steps), one after another, in each regime; with `--real_warm DIR`
    every run starts from that warm start. Wall time is the RL part (`run_summary.json`)."""
    from gyrejax.scheduler import calibrate

    root = Path(args.real_workdir or tempfile.mkdtemp(prefix="schedule_bench_"))
    regimes = args.real_regimes.split(",") if args.real_regimes else list(REGIMES)
    processes = args.real_processes
    if processes < 1 or 8 % processes:
        raise SystemExit(f"--real_processes={processes}: must divide tiny_cpu's 8 devices")
    # One process: 8 emulated devices on every core. Several: launch/local.sh --pin, each
    # process (its share of the devices) on a core of its own, like a host.
    prefix = ["bash", "launch/local.sh", str(processes), "--pin", "--"] if processes > 1 else []
    layout = [f"--config.cells.num_cpu_devices={8 // processes}"] if processes > 1 else []
    capacities = tuple(int(n) for n in args.real_cell_capacities.split(",") if n)
    occupancies = tuple(float(x) for x in args.real_occupancies.split(",") if x)
    overcommits = tuple(float(x) for x in args.real_overcommits.split(",") if x)
    variants = real_variants(
        lookaheads=args.real_lookaheads,
        cell_capacities=capacities,
        occupancies=occupancies,
        overcommits=overcommits,
    )
    if args.real_only:  # a subset, e.g. to re-measure the best of each policy
        variants = [(name, flags) for name, flags in variants if re.search(args.real_only, name)]
        if not variants:
            raise SystemExit(f"--real_only={args.real_only!r}: matches no variant")

    def slug(text: str) -> str:
        return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")

    if args.real_passes < 1:
        raise SystemExit(f"--real_passes={args.real_passes}: expected >= 1")
    results, medians = {}, {}
    for regime in regimes:
        key = regime if processes == 1 else f"{regime}, {processes} pinned processes"
        key += f", {args.real_flags}" if args.real_flags else ""
        folder = regime if processes == 1 else f"{regime}_p{processes}"
        if args.real_flags:  # runs under other flags are other runs
            folder += "_" + slug(args.real_flags)
        by_pass = []
        # Pass after pass, every variant in each: slow drifts of the machine's load then
        # fall on every variant alike.
        for p in range(args.real_passes):
            where = root / folder if args.real_passes == 1 else root / folder / f"pass{p + 1}"
            runs = {}
            for name, flags in variants:
                command = [*prefix, sys.executable, "-m", "gyrejax.launch"]
                command += ["--config", "configs/tiny_cpu.py", *layout, *flags, *REGIMES[regime]]
                command += [*args.real_flags.split(), f"--config.train.steps={args.real_steps}"]
                command += [] if args.real_warm else ["--config.warmup.steps=0"]
                label = f"{name} ({key}, pass {p + 1})"
                runs[name] = _real_run(where / slug(name), command, args.real_warm, label)
            for run in runs.values():
                run["outside_calls_bound_s"] = calibrate.outside_calls_bound_s(run["workdir"])
            _print_real(key if args.real_passes == 1 else f"{key}, pass {p + 1}", runs)
            by_pass.append(runs)
        # Each variant's median run (the lower one of an even count) stands for it below.
        results[key] = {
            name: sorted((runs[name] for runs in by_pass), key=lambda r: r["wall_s"])[
                (len(by_pass) - 1) // 2
            ]
            for name in by_pass[0]
        }
        if args.real_passes > 1:
            medians[key] = pass_medians(by_pass)
            _print_medians(key, medians[key])
    return {"root": str(root), "runs": results, "passes": medians}


def _real_run(workdir: Path, command: list[str], warm: str | None, label: str) -> dict:
    """One real run of `command` in `workdir` (read back if an earlier invocation
    finished it), from the warm start `warm` if given."""
    from gyrejax.scheduler import calibrate

    if (workdir / "run_summary.json").exists():
        print(f"[real] {workdir}: done before, read back", flush=True)
        return calibrate.read_run(workdir)
    # A run cut short would resume from its checkpoint and time only its rest: every
    # measured run starts afresh.
    shutil.rmtree(workdir, ignore_errors=True)
    if warm:
        for part in ("demonstrations", "warmup"):
            shutil.copytree(Path(warm) / part, workdir / part)
    command = [*command, f"--workdir={workdir}"]
    print(f"[real] {' '.join(command)}", flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LOG_DIR=str(workdir / "process_logs"))
    with open(workdir / "launch.log", "w") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (workdir / "launch.log").read_text().splitlines()[-20:]
        raise SystemExit(f"{label} failed:\n" + "\n".join(tail))
    return calibrate.read_run(workdir)


def pass_medians(by_pass: list[dict]) -> dict:
    """Several passes of the same variants: each variant's walls and median; each
    policy's best variant by median; elastic's best against the better baseline's, as
    the ratio of medians and pass by pass (the two variants' walls in the same pass)."""
    names = list(by_pass[0])
    walls = {name: [runs[name]["wall_s"] for runs in by_pass] for name in names}
    median = {name: float(np.median(w)) for name, w in walls.items()}
    by_median = {name: {"wall_s": m} for name, m in median.items()}
    best = {p: best_of(by_median, p) for p in ("colocate", "async", "elastic")}
    best = {p: b[0] for p, b in best.items() if b is not None}
    out = {"walls_s": walls, "median_s": median, "best": best}
    baselines = [best[p] for p in ("colocate", "async") if p in best]
    if "elastic" in best and baselines:
        baseline = min(baselines, key=median.get)
        elastic = best["elastic"]
        out["vs_better_baseline"] = {
            "baseline": baseline,
            "elastic": elastic,
            "of_medians": median[baseline] / median[elastic],
            "pass_by_pass": [b / e for b, e in zip(walls[baseline], walls[elastic], strict=True)],
        }
    return out


def _print_medians(regime: str, summary: dict) -> None:
    walls, median = summary["walls_s"], summary["median_s"]
    passes = len(next(iter(walls.values())))
    print(f"\n### real tiny CPU runs, regime: {regime}: medians of {passes} passes\n")
    print("| variant | " + " | ".join(f"pass {p + 1} s" for p in range(passes)) + " | median s |")
    print("|---|" + "---|" * (passes + 1))
    for name, w in walls.items():
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in w) + f" | {median[name]:.1f} |")
    print("\nbest of each policy by median: " + ", ".join(summary["best"].values()))
    vs = summary.get("vs_better_baseline")
    if vs:
        each = ", ".join(f"{r:.2f}" for r in vs["pass_by_pass"])
        print(
            f"elastic ({vs['elastic']}) vs the better baseline ({vs['baseline']}): "
            f"{vs['of_medians']:.2f}x of medians; pass by pass {each} "
            f"(median {np.median(vs['pass_by_pass']):.2f}x)"
        )


def _print_real(regime: str, runs: dict) -> None:
    best = {p: best_of(runs, p) for p in ("colocate", "async", "elastic")}
    best = {p: b for p, b in best.items() if b is not None}
    _, reference = best.get("elastic") or min(best.values(), key=lambda b: b[1]["wall_s"])
    print(
        f"\n### real tiny CPU runs, regime: {regime} (4 cells, equal work; S = 3 unless the "
        "regime's flags set another)\n"
    )
    print(
        "| variant | steps | RL wall s | / best elastic | / own bound | utilisation | idle "
        "share: "
        + ", ".join(IDLE_CAUSES)
        + " | trainer s: "
        + ", ".join(TRAINER_TIME)
        + " | reward first -> last | switches | max staleness |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        idle = ", ".join(f"{r['idle_share'].get(k, 0):.2f}" for k in IDLE_CAUSES)
        trainer = ", ".join(f"{r['trainer_s'][k]:.1f}" for k in TRAINER_TIME)
        bound = r.get("outside_calls_bound_s")
        over = f"{r['wall_s'] / bound:.2f}" if bound else "-"
        ratio = r["wall_s"] / reference["wall_s"]
        print(
            f"| {name} | {r['steps']} | {r['wall_s']:.0f} | {ratio:.2f}x "
            f"| {over} | {r['utilisation']:.3f} | {idle} | {trainer} "
            f"| {r['reward_first']:.3f} -> {r['reward_last']:.3f} | {r['switches']} "
            f"| {r['staleness_max']:.0f} |"
        )
    listed = ", ".join(f"{n} {r['wall_s']:.0f} s" for n, r in best.values())
    print(f"\nbest of each policy: {listed}")
    baselines = [best[p][1]["wall_s"] for p in ("colocate", "async") if p in best]
    if "elastic" in best and baselines:
        print(f"elastic vs the better baseline: {min(baselines) / reference['wall_s']:.2f}x")
    print(
        "/ own bound: the wall over a lower bound from the run's own executions (their time "
        "outside model calls, the fastest step, the gate: calibrate.outside_calls_bound_s)"
    )


def calibrate_and_predict(args, real: dict | None) -> dict:
    """Fits the simulator to a real run and predicts the real runs.

    `--calibrate DIR` fits the run in DIR and predicts every real run; `--calibrate
    elastic` (with --real) fits each regime's elastic run and predicts that regime's
    runs, so the other policies are out-of-sample predictions."""
    from gyrejax.scheduler import calibrate

    runs = (real or {}).get("runs", {})
    out = {"fits": {}, "predictions": {}}
    for regime, by_policy in runs.items() or [("", {})]:
        if args.calibrate == "elastic":
            elastic = best_of(by_policy, "elastic")
            if elastic is None:
                raise SystemExit("--calibrate elastic: no elastic run among the real runs")
            source = elastic[1]["workdir"]
        else:
            source = args.calibrate
        cores_by = []
        if args.cores_by:  # a real run of this regime by name, else a workdir
            named = by_policy.get(args.cores_by)
            cores_by = [Path(named["workdir"] if named else args.cores_by)]
        fit = calibrate.fit_run(Path(source), load=args.load_model, cores_by=cores_by)
        out["fits"][regime or "all"] = {"source": source, **fit.summary()}
        print(f"\n### calibration from {source}\n")
        for k, v in fit.summary().items():
            print(f"  {k}: {v}")
        if not by_policy:
            continue
        print(
            f"\n| {regime} regime | measured s | predicted s (median) | 10-90% band s "
            "| predicted / measured |"
        )
        print("|---|---|---|---|---|")
        for name, run in by_policy.items():
            low, predicted, high = calibrate.predicted_band(fit, run)
            in_sample = Path(run["workdir"]) in (Path(source), *cores_by)
            out["predictions"][f"{regime}/{name}"] = {
                "measured_s": run["wall_s"],
                "predicted_s": predicted,
                "band_s": [low, high],
                "in_sample": in_sample,
            }
            label = name
            if Path(run["workdir"]) == Path(source):
                label += " (fitted)"
            elif in_sample:
                label += " (its wall picked the cores)"
            ratio = predicted / run["wall_s"]
            print(
                f"| {label} | {run['wall_s']:.0f} | {predicted:.0f} | {low:.0f}-{high:.0f} "
                f"| {ratio:.3f} |"
            )
    return out


def reward_plot(real: dict, path: Path) -> None:
    """Reward of each trained step against the wall-clock time it finished, per policy,
    one panel per regime: staleness costs learning as well as time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gyrejax.logs import read_jsonl

    regimes = real["runs"]
    fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4), squeeze=False)
    for ax, (regime, by_policy) in zip(axes[0], regimes.items(), strict=True):
        for name, run in by_policy.items():
            steps = read_jsonl(Path(run["workdir"]) / "metrics.jsonl")
            ax.plot([s["time_s"] for s in steps], [s["reward"] for s in steps], ".-", label=name)
        ax.set(title=regime, xlabel="wall clock s", ylabel="step reward")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--config", default=None, help="default: configs/sim_paper.py")
    parser.add_argument("--plot", default="schedule_pareto.png")
    parser.add_argument("--sensitivity", action="store_true")
    parser.add_argument(
        "--cell_size",
        nargs="?",
        const="2",
        default=None,
        help="also every goal's case in cells this many times smaller (the same slots and "
        "compute): 2 (alone: --cell_size), or several, e.g. 2,4",
    )
    parser.add_argument(
        "--hindsight",
        action="store_true",
        help="also the best split that changes per quarter of the run, chosen in hindsight",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--sim",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the simulator tables (--no-sim: real runs / calibration only)",
    )
    parser.add_argument("--real", action="store_true", help="also run real tiny CPU runs")
    parser.add_argument("--real_steps", type=int, default=12)
    parser.add_argument(
        "--real_workdir", default=None, help="runs finished there before are read back, not rerun"
    )
    parser.add_argument("--real_regimes", default=None, help="e.g. latency (default: both)")
    parser.add_argument("--real_warm", default=None, help="a tiny_cpu workdir to start from")
    parser.add_argument(
        "--real_lookaheads",
        action="store_true",
        help="also async and elastic at their non-default dispatch depth (lookahead)",
    )
    parser.add_argument(
        "--real_cell_capacities",
        default="",
        help="also elastic with each scheduler.cell_capacity, e.g. 32,64",
    )
    parser.add_argument(
        "--real_occupancies",
        default="",
        help="also elastic with each scheduler.slot_occupancy, e.g. 0.5,1",
    )
    parser.add_argument(
        "--real_overcommits",
        default="",
        help="also elastic with each scheduler.elastic_overcommit, e.g. 0.5,1",
    )
    parser.add_argument(
        "--real_only",
        default="",
        help="only the real variants whose name matches this regex, e.g. 'mu=1 (gate|cap)'",
    )
    parser.add_argument(
        "--real_flags",
        default="",
        help="more flags for every real run, e.g. --real_flags=--config.scheduler.max_staleness=11",
    )
    parser.add_argument(
        "--real_passes",
        type=int,
        default=1,
        help="> 1: every real variant that many times, pass after pass; medians reported",
    )
    parser.add_argument(
        "--real_processes",
        type=int,
        default=1,
        help="> 1: each real run as this many processes, each pinned to a core of its own",
    )
    parser.add_argument(
        "--calibrate",
        default=None,
        help="a real run's workdir to fit, or 'elastic': each regime's elastic run (--real)",
    )
    parser.add_argument(
        "--load_model",
        action="store_true",
        help="--calibrate fits the simulator's load-dependent model (SimConfig.decode_cores)",
    )
    parser.add_argument(
        "--cores_by",
        default=None,
        help="with --load_model: a run (workdir, or a real run's name) whose wall picks the cores",
    )
    parser.add_argument("--reward_plot", default="schedule_real_reward.png")
    args = parser.parse_args()
    if args.cores_by and not (args.calibrate and args.load_model):
        parser.error(
            f"--cores_by {args.cores_by}: it picks the load model's cores, so it needs "
            "--calibrate and --load_model"
        )
    spec = args.config or ("configs/sim_paper.py:quick" if args.quick else "configs/sim_paper.py")
    cfg = load_config(spec)
    factors = ()
    if args.cell_size:  # checked before the fair tables' half hour, not after it
        try:
            factors = tuple(int(f) for f in args.cell_size.split(","))
        except ValueError:
            factors = ()
        slots = [n for _, n in cfg.fair.shapes]
        if not factors or min(factors) < 2 or any(n % f for n in slots for f in factors):
            parser.error(
                f"--cell_size {args.cell_size}: expected factors >= 2 that divide every "
                f"shape's slots {slots}, e.g. 2,4"
            )
    report = {"config": spec, "quick": args.quick}
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        if args.sim:
            published(pool, cfg, report)
            report["fair"] = {}
            fair(pool, cfg, report["fair"], hindsight=args.hindsight)
            pareto_plot(report["fair"], Path(args.plot))
            print(f"\nPareto plot: {args.plot}")
            if args.sensitivity:
                sensitivity(pool, cfg, report)
        if factors:
            cell_size(pool, cfg, report, factors)
    if args.real:
        report["real"] = real_runs(args)
        reward_plot(report["real"], Path(args.reward_plot))
        print(f"\nreward against wall clock: {args.reward_plot}")
    if args.calibrate:
        report["calibration"] = calibrate_and_predict(args, report.get("real"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
