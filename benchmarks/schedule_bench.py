"""Scheduling benchmark: colocate vs async vs elastic, side by side, in the simulator.

Usage:
  python benchmarks/schedule_bench.py [--quick] [--json PATH] [--config PATH[:variant]]
                                      [--seed N] [--robust] [--real] [--real_steps N]
                                      [--real_warm DIR]

On the paper-scale setting of `configs/sim_paper.py` (see its docstring for the model and
its assumptions) it runs the three policies of gyrejax/scheduler/policies.py in the
discrete-event simulator (gyrejax/scheduler/simulator.py) over one trace (the same
executions for every policy) and prints markdown tables:
  (a) published: colocate bursts, one-step-off-policy async (gate S = 1), elastic with no
      gate (stragglers carried; its measured staleness shown). The staleness differs
      between the rows, so this is not a like-for-like comparison; a context row gives
      async without its gate too;
  (b) equal staleness: the same gate S for all three, for each (S, phi) of the config,
      followed by the elastic ablation: the plain waterlevel rule, then each refinement
      of the elastic policy added in turn (the fourth row is `make_policy("elastic")`),
      and one alternative option value.
Async is run with every possible number of training cells (1 .. K-1) and, in (b), both
dispatch rules (`lookahead` "phi": the (phi + mu) B depth; "gate": only S limits), and
the best is reported (`async(k, rule)`). Columns: makespan, utilisation, makespan / lower
bound (total work / cells), makespan / S-bound (`staleness_bound_s`: no policy under the
gate can beat it), staleness (max, mean), switches, idle cell-hours (trainer cells with no
step running; free slots on serving cells, and the part of it with dispatch held back by
the depth or gate), and each makespan over elastic's. --quick uses the config's `quick`
variant (12 steps). --robust repeats (b) for the config's `robust.seeds` and
`robust.shapes` (cells x slots) and prints one summary row per run (minutes).

`--real` additionally runs the policies as real tiny CPU runs of equal work through
`gyrejax.launch` (`real_runs`; about 3 minutes per policy; `--real_warm DIR` starts them
from a finished tiny_cpu warm start).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gyrejax.scheduler.simulator import (
    HOUR,
    SimConfig,
    SimResult,
    make_trace,
    simulate,
    staleness_bound_s,
)

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("colocate", "async", "elastic")
ASYNC_LOOKAHEADS = ("phi", "gate")
# The elastic ablation: each row adds one refinement to the one above; the fourth row is
# the default policy (`make_policy("elastic")`); the last one swaps one of its options.
PLAIN = {"lookahead": "phi", "core_stays": "ready", "keep_cell": "always"}
ELASTIC_ABLATION = (
    ("waterlevel (DESIGN.md rule)", PLAIN),
    ("+ core returns unless backlog", {**PLAIN, "core_stays": "backlog"}),
    ("+ no idle lookahead cell", {**PLAIN, "core_stays": "backlog", "keep_cell": "dispatchable"}),
    ("+ dispatch to the gate (default)", {}),
    ("default, core_stays=spare", {"core_stays": "spare"}),
)


def load_config(spec: str):
    """`configs/x.py[:variant]` -> its get_config(variant) (a ConfigDict)."""
    path, _, variant = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("sim_config", REPO / path)
    if module_spec is None:
        raise SystemExit(f"--config {spec}: no such config file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)


def best_async(
    config: SimConfig, trace, lookaheads=("phi",)
) -> tuple[SimResult, dict[str, list[tuple[int, float]]]]:
    """Async with every split and dispatch rule; returns the fastest and, per rule,
    (training cells, makespan h)."""
    best, sweep = None, {}
    for lookahead in lookaheads:
        sweep[lookahead] = []
        for k in range(1, config.cells):
            result = simulate(config, "async", trace, training_cells=k, lookahead=lookahead)
            if len(lookaheads) > 1:
                result = dataclasses.replace(result, policy=f"async({k}, {lookahead})")
            sweep[lookahead].append((k, result.makespan_s / HOUR))
            if best is None or result.makespan_s < best.makespan_s:
                best = result
    return best, sweep


def row(config: SimConfig, result: SimResult, trace, start: float, **extra) -> dict:
    return {
        "label": result.policy,
        "mu": config.mu,
        "phi": config.phi,
        "max_staleness": config.max_staleness,
        **result.summary(),
        "staleness_bound_h": staleness_bound_s(config, trace) / HOUR,
        "sim_s": time.perf_counter() - start,
        **extra,
    }


def run_setting(configs: dict[str, SimConfig], trace, lookaheads=("phi",), extra=()) -> dict:
    """One row per policy (async tuned over its split and `lookaheads`), then `extra`
    rows: (key, policy, config, options)."""
    rows = {}
    for policy in POLICIES:
        config = configs[policy]
        start = time.perf_counter()
        if policy == "async":
            result, sweep = best_async(config, trace, lookaheads)
        else:
            result, sweep = simulate(config, policy, trace), None
        rows[policy] = row(config, result, trace, start, async_sweep_h=sweep)
    for key, policy, config, options in extra:
        start = time.perf_counter()
        if policy == "async" and "training_cells" not in options:
            result, _ = best_async(config, trace, lookaheads)
        else:
            result = simulate(config, policy, trace, **options)
        rows[key] = row(config, result, trace, start, label=key)
    elastic = rows["elastic"]["makespan_h"]
    best = rows["async"]["makespan_h"]
    for r in rows.values():
        r["over_elastic"] = r["makespan_h"] / elastic
        r["async_over"] = best / r["makespan_h"]
    return rows


def print_table(title: str, rows: dict, ablation: bool = False) -> None:
    print(f"\n### {title}\n")
    last = "best async / this" if ablation else "/ elastic"
    print("| policy | mu | phi | S | makespan h | util | / bound | / S-bound | stale max "
          "| stale mean | switches | train idle cell-h | rollout idle (throttled) cell-h "
          f"| {last} |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        switches = sum(r["transitions"].values())
        gate = "-" if r["max_staleness"] is None else r["max_staleness"]
        ratio = r["async_over"] if ablation else r["over_elastic"]
        print(
            f"| {r['label']} | {r['mu']} | {r['phi']} | {gate} | {r['makespan_h']:.1f} "
            f"| {r['utilisation']:.3f} | {r['makespan_over_bound']:.3f} "
            f"| {r['makespan_h'] / r['staleness_bound_h']:.3f} "
            f"| {r['staleness_max']} | {r['staleness_mean']:.2f} | {switches} "
            f"| {r['train_idle_cell_h']:.0f} "
            f"| {r['rollout_idle_cell_h']:.0f} ({r['throttled_cell_h']:.0f}) | {ratio:.2f}x |"
        )
    ref = rows.get("elastic", list(rows.values())[-1])
    gate = "-" if ref["max_staleness"] is None else ref["max_staleness"]
    print(f"\nlower bound {ref['lower_bound_h']:.1f} h; S-bound of {ref['label']} "
          f"{ref['staleness_bound_h']:.1f} h (S = {gate})")  # fmt: skip
    if ablation:
        return
    for lookahead, sweep in rows["async"]["async_sweep_h"].items():
        print(f"async ({lookahead}) makespan (h) by training cells: "
              + ", ".join(f"{k}: {h:.1f}" for k, h in sweep))  # fmt: skip


def equal_settings(sim: SimConfig, pairs) -> dict[str, dict[str, SimConfig]]:
    return {
        f"(b) equal staleness S={s}, phi={phi}": {
            p: sim.replace(max_staleness=s, phi=0 if p == "colocate" else phi) for p in POLICIES
        }
        for s, phi in pairs
    }


def ablation_rows(configs: dict[str, SimConfig]) -> list[tuple]:
    """The `extra` rows of `run_setting` for the elastic ablation of one setting."""
    return [(name, "elastic", configs["elastic"], options) for name, options in ELASTIC_ABLATION]


def robust(sim: SimConfig, cfg) -> list[dict]:
    """(b) over several seeds and cluster shapes: one summary row per run."""
    out = []
    print("\n### robustness: equal staleness over seeds and cluster shapes\n")
    print("| cells x slots | S | phi | seed | bound h | S-bound h | colocate h | best async h "
          "| elastic waterlevel h | elastic h | best async / elastic | elastic / bound "
          "| goal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cells, slots in cfg.robust.shapes:
        for s, phi in cfg.equal.settings:
            for seed in cfg.robust.seeds:
                base = sim.replace(cells=cells, capacity=slots, seed=seed)
                configs = next(iter(equal_settings(base, [(s, phi)]).values()))
                trace = make_trace(base)
                rows = run_setting(configs, trace, ASYNC_LOOKAHEADS,
                                   [("plain", "elastic", configs["elastic"], PLAIN)])  # fmt: skip
                e, a = rows["elastic"], rows["async"]
                vs_async = a["makespan_h"] / e["makespan_h"]
                goal = vs_async >= 1.10 and e["makespan_over_bound"] <= 1.10
                print(
                    f"| {cells} x {slots} | {s} | {phi} | {seed} | {e['lower_bound_h']:.1f} "
                    f"| {e['staleness_bound_h']:.1f} | {rows['colocate']['makespan_h']:.1f} "
                    f"| {a['makespan_h']:.1f} ({a['label']}) | {rows['plain']['makespan_h']:.1f} "
                    f"| {e['makespan_h']:.1f} | {vs_async:.2f}x | {e['makespan_over_bound']:.3f} "
                    f"| {'met' if goal else 'not met'} |",
                    flush=True,
                )
                out.append({"cells": cells, "capacity": slots, "max_staleness": s, "phi": phi,
                            "seed": seed, "rows": rows, "goal": goal})  # fmt: skip
    return out


REAL_VARIANTS = (
    ("colocate", []),
    *((f"async({k})", ["--config.scheduler.policy=async",
                       f"--config.scheduler.async_training_cells={k}"]) for k in (1, 2, 3)),
    ("elastic", []),
)  # fmt: skip


def _phase_means(path: Path) -> dict[str, dict[str, float]]:
    """Mean seconds of every timed phase, per transition kind, from transitions.jsonl."""
    phases: dict[str, dict[str, list[float]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        kind = phases.setdefault(record["kind"], {})
        for key, value in record.items():
            if key.endswith("_s") and key != "time_s" and isinstance(value, int | float):
                kind.setdefault(key, []).append(float(value))
    return {kind: {k: float(np.mean(v)) for k, v in keys.items()} for kind, keys in phases.items()}


def real_runs(args) -> dict:
    """Part (b): the same policies as real tiny CPU runs of equal work (configs/tiny_cpu.py:
    4 cells, `--real_steps` RL steps of the same groups per step), one after another.

    With `--real_warm DIR` (a tiny_cpu workdir whose `demonstrations/` and `warmup/` are
    done) every run starts from that warm start, so the executions are realistic; without
    it, from random weights. The async split is swept over 1..3 training cells. Wall time
    is the RL part only (`run_summary.json`: from the runtime's start, so engine and step
    compiles count, the warm start does not).
    """
    results = {}
    root = Path(args.real_workdir or tempfile.mkdtemp(prefix="schedule_bench_"))
    for name, flags in REAL_VARIANTS:
        workdir = root / name.replace("(", "_").replace(")", "")
        if args.real_warm and not workdir.exists():
            for part in ("demonstrations", "warmup"):
                shutil.copytree(Path(args.real_warm) / part, workdir / part)
        policy = [] if flags else [f"--config.scheduler.policy={name}"]
        command = [
            sys.executable, "-m", "gyrejax.launch", "--config", "configs/tiny_cpu.py",
            f"--workdir={workdir}", *policy, *flags, f"--config.train.steps={args.real_steps}",
            *([] if args.real_warm else ["--config.warmup.steps=0"]),
        ]  # fmt: skip
        print(f"[real] {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)  # fmt: skip
        summary = json.loads((workdir / "run_summary.json").read_text())
        results[name] = {"summary": summary, "phases": _phase_means(workdir / "transitions.jsonl")}
    elastic = results["elastic"]["summary"]["wall_s"]
    print("\n### (b) real tiny CPU runs (4 cells, equal work)\n")
    print("| policy | steps | RL wall s | / elastic | utilisation | reward first -> last "
          "| to_training | to_rollout |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["summary"]
        counts = s.get("transitions", {})
        first, last = s.get("reward_first") or 0.0, s.get("reward_last") or 0.0
        print(f"| {name} | {s['steps']} | {s['wall_s']:.0f} | {s['wall_s'] / elastic:.2f}x "
              f"| {s.get('utilisation') or 0.0:.3f} | {first:.3f} -> {last:.3f} "
              f"| {counts.get('to_training', 0)} | {counts.get('to_rollout', 0)} |")  # fmt: skip
    print("\n| policy | transition | mean phase seconds |")
    print("|---|---|---|")
    for name, r in results.items():
        for kind, means in r["phases"].items():
            times = ", ".join(f"{k} {v:.3f}" for k, v in means.items())
            print(f"| {name} | {kind} | {times} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--config", default=None, help="default: configs/sim_paper.py")
    parser.add_argument("--seed", type=int, default=None, help="trace seed (default: config)")
    parser.add_argument("--robust", action="store_true", help="(b) over seeds and shapes")
    parser.add_argument("--real", action="store_true", help="also run real tiny CPU runs")
    parser.add_argument("--real_steps", type=int, default=12)
    parser.add_argument("--real_workdir", default=None)
    parser.add_argument("--real_warm", default=None, help="a tiny_cpu workdir to start from")
    args = parser.parse_args()
    spec = args.config or ("configs/sim_paper.py:quick" if args.quick else "configs/sim_paper.py")
    cfg = load_config(spec)
    sim = SimConfig.from_dict(cfg.sim.to_dict())
    if args.seed is not None:
        sim = sim.replace(seed=args.seed)
    trace = make_trace(sim)
    long_share = float((trace.duration_s >= 4 * HOUR).mean())
    print(
        f"{spec}: {sim.cells} cells x {sim.capacity} slots, {sim.steps} steps of "
        f"{sim.groups_per_step} x {sim.group_size} executions; {long_share:.0%} run >= 4 h, "
        f"{trace.timed_out.mean():.1%} time out at {sim.timeout_s / HOUR:.1f} h; "
        f"switches {sim.to_training_s} s / {sim.to_rollout_s} s; seed {sim.seed}"
    )
    published = cfg.published.to_dict()
    overrides = {"colocate": published["colocate"], "async": published["async_"],
                 "elastic": published["elastic"]}  # fmt: skip
    report = {"config": spec, "sim": vars(sim) | {}, "settings": {}, "quick": args.quick}
    title = "(a) published settings"
    configs = {p: sim.replace(**overrides[p]) for p in POLICIES}
    ungated = configs["async"].replace(max_staleness=None)
    rows = run_setting(configs, trace, extra=[("async, no gate", "async", ungated, {})])
    print_table(title, rows)
    report["settings"][title] = rows
    for title, configs in equal_settings(sim, cfg.equal.settings).items():
        rows = run_setting(configs, trace, ASYNC_LOOKAHEADS, ablation_rows(configs))
        print_table(title, {p: rows[p] for p in POLICIES})
        names = [name for name, _ in ELASTIC_ABLATION]
        print_table(f"elastic ablation, {title[4:]}", {k: rows[k] for k in ["async", *names]},
                    ablation=True)  # fmt: skip
        report["settings"][title] = rows
    print("\npublished: 75.4 h elastic vs 134.6 h async (1.78x) vs 91.5 h colocate (1.21x)")
    if args.robust:
        report["robust"] = robust(sim, cfg)
    if args.real:
        report["real"] = real_runs(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
