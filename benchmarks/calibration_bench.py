"""Calibration benchmark: the simulator's load model fitted to one real run, predicting the
others (issue 14, goal 5: predicted vs measured makespan within 10%).

Usage:
  python benchmarks/calibration_bench.py --real_workdir DIR [--regimes compute,latency]
                                         [--sources elastic_mu_1,colocate_mu_1]
                                         [--exclude latency/async_1_mu_2,...] [--json PATH]
                                         [--cores_by async_3_mu_1]

Reads the real tiny CPU runs that `benchmarks/schedule_bench.py --real` left in
`--real_workdir` (DIR/<regime>/<run>; it runs nothing), fits the load model
(`calibrate.fit_run(..., load=True)`) to each source run of each regime, predicts every
run of that regime (`calibrate.predict`) and prints predicted / measured wall time per
run (the ten standard variants and any other run there, e.g. those of
`--real_lookaheads`), with the largest and mean |ratio - 1| over the runs out of sample
(the source and the `--exclude`d runs left out; by default the latency regime's mu = 2
async and elastic runs, which ran under heavy external load). The prediction is the
median over seeds; each run is also checked against the 10-90% band of its predicted wall
times (`calibrate.predicted_band`): one run is one draw, and where tool calls make the
tail set the makespan, that band is wider than +-10%. Then, per fit, each run's wall from
the trainer's side predicted beside measured (`calibrate.predicted_trainer_time`, the
runs' `trainer_s`): whether a miss is in the training or in the waiting for data. About
25 s per fit on one core. `--cores_by RUN` lets that run of each regime (e.g. async(3): one
rollout engine) choose each fit's cores and training demand by its wall
(`calibrate.fit_run`'s `cores_by`; about a minute per fit); it is then in sample too,
left out of the errors like the source.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gyrejax.scheduler import calibrate

RUNS = (
    "colocate_mu_1",
    "async_1_mu_1",
    "async_2_mu_1",
    "async_3_mu_1",
    "elastic_mu_1",
    "colocate_mu_2",
    "async_1_mu_2",
    "async_2_mu_2",
    "async_3_mu_2",
    "elastic_mu_2",
)
LOADED = "latency/async_1_mu_2,latency/async_2_mu_2,latency/async_3_mu_2,latency/elastic_mu_2"


def run_names(regime_dir: Path) -> list[str]:
    """The finished runs of a regime: the standard ten first (each must be there), then
    any other variant schedule_bench left (e.g. --real_lookaheads' "_gate" runs)."""
    finished = {p.parent.name for p in regime_dir.glob("*/run_summary.json")}
    missing = [name for name in RUNS if name not in finished]
    if missing:
        raise SystemExit(f"{regime_dir}: no finished run {', '.join(missing)}")
    return [*RUNS, *sorted(finished - set(RUNS))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real_workdir", required=True, help="schedule_bench --real's")
    parser.add_argument("--regimes", default="compute,latency")
    parser.add_argument("--sources", default="elastic_mu_1,colocate_mu_1")
    parser.add_argument("--exclude", default=LOADED, help="regime/run, comma-separated")
    parser.add_argument("--cores_by", help="a run of each regime whose wall picks the cores")
    parser.add_argument("--json")
    args = parser.parse_args()
    root, excluded = Path(args.real_workdir), set(args.exclude.split(","))
    report = {}
    for regime in args.regimes.split(","):
        names = run_names(root / regime)
        runs = {name: calibrate.read_run(root / regime / name) for name in names}
        cores_by = [root / regime / args.cores_by] if args.cores_by else []
        for source in args.sources.split(","):
            fit = calibrate.fit_run(root / regime / source, load=True, cores_by=cores_by)
            # Each run simulated once (on every seed): its band and its trainer's side.
            sims = {name: calibrate.predicted_runs(fit, run) for name, run in runs.items()}
            bands = {
                name: calibrate.predicted_band(fit, run, results=sims[name])
                for name, run in runs.items()
            }
            ratios = {name: bands[name][1] / run["wall_s"] for name, run in runs.items()}
            inside = {
                name: bands[name][0] <= run["wall_s"] <= bands[name][2]
                for name, run in runs.items()
            }
            in_sample = {source, args.cores_by}
            scored = [n for n in names if n not in in_sample and f"{regime}/{n}" not in excluded]
            errors = [abs(ratios[n] - 1) for n in scored]
            # Where a miss comes from: the training, or the waiting for data around it.
            trainer = {
                name: {
                    "predicted_s": calibrate.predicted_trainer_time(fit, run, results=sims[name]),
                    "measured_s": run["trainer_s"],
                }
                for name, run in runs.items()
            }
            report[f"{regime}/{source}"] = {
                "ratios": ratios,
                "trainer": trainer,
                "bands_s": bands,
                "measured_in_band": inside,
                "max_error": max(errors),
                "mean_error": float(np.mean(errors)),
                "in_band": f"{sum(inside[n] for n in scored)}/{len(scored)}",
                "within_10": f"{sum(e <= 0.10 for e in errors)}/{len(errors)}",  # the goal
                "fit": fit.summary(),
            }
    print("| run | " + " | ".join(f"{k} fit" for k in report) + " |")
    print("|---|" + "---|" * len(report))
    for name in dict.fromkeys(n for r in report.values() for n in r["ratios"]):
        cells = []
        for key, r in report.items():
            if name not in r["ratios"]:
                cells.append("-")
                continue
            regime, source = key.split("/")
            mark = ""
            if name == source:
                mark = " (fitted)"
            elif name == args.cores_by:
                mark = " (cores)"
            elif f"{regime}/{name}" in excluded:
                mark = " (excl.)"
            band = "" if r["measured_in_band"][name] else " *"
            cells.append(f"{r['ratios'][name]:.2f}{band}{mark}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(
        "| max / mean error | "
        + " | ".join(f"{r['max_error']:.2f} / {r['mean_error']:.2f}" for r in report.values())
        + " |"
    )
    print("| within 10% | " + " | ".join(r["within_10"] for r in report.values()) + " |")
    print(
        "| measured in the 10-90% band | "
        + " | ".join(r["in_band"] for r in report.values())
        + " |"
    )
    print("\n(median predicted / measured; * = measured outside the 10-90% band over seeds)")
    parts = ("before_first_step", "training", "between_steps")
    for key, r in report.items():
        print(f"\n{key} fit: the wall from the trainer's side, predicted / measured s")
        print("| run | " + " | ".join(parts) + " |")
        print("|---|" + "---|" * len(parts))
        for name, t in r["trainer"].items():
            got, want = t["predicted_s"], t["measured_s"]
            cells = " | ".join(f"{got[k]:.1f} / {want[k]:.1f}" for k in parts)
            print(f"| {name} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
