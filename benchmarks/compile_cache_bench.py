"""Compilation cache benchmark: a tiny run with a cold vs a warm persistent cache.

  python benchmarks/compile_cache_bench.py [--quick] [--runs N] [--min_compile_time_s 0,1]
      [--json PATH]

Runs the real launch path (`python -m gyrejax.launch`, configs/tiny_cpu.py:smoke: 4
cells, no warm start, 2 RL steps) in a fresh workdir each time, so nothing resumes;
only the compilation cache differs. Cold: an empty cache directory. Warm: the directory
the first cold run filled (`config.compilation_cache_dir`; $JAX_COMPILATION_CACHE_DIR
removed from the runs' environment). Runs interleave (cold, warm, cold, warm, ...) so
load on a shared machine hits both alike. Reports medians of: the whole run's wall time,
the time to the first RL step (from process start, by the step's line in metrics.jsonl
and the run's own clock), programs loaded / compiled through the cache, and warm/cold
ratios. With several `--min_compile_time_s` values (JAX's default is 1 s, ours 0),
each gets its own cold and warm runs. `--quick`: one cold and one warm run of a rollout
batch only (`train.steps=0`) on one cell of 2 devices.

Measured (2 shared cores, load average 2.3 before, 6.9 after: others' jobs and tests
ran alongside; medians of 3):

  min compile s  cache    run s  1st step s      loaded
            0.0   cold    105.3       103.3       0/108
            0.0   warm     20.1        17.6     109/109
            0.0    w/c     0.19        0.17   cache 1.9 MB
            1.0   cold    103.1        99.9       0/108
            1.0   warm     21.4        19.1      38/107
            1.0    w/c     0.21        0.19   cache 1.6 MB

`--quick` (load 2.7): cold 20.5 s, warm 5.1 s (0.25), 33/33 programs loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
FULL = ["--config", "configs/tiny_cpu.py:smoke"]
QUICK = [
    *FULL,
    "--config.train.steps=0",
    "--config.cells.num_cpu_devices=2",
    "--config.harness.max_turns=1",
]
LOADED = re.compile(r"compilation cache: (\d+) of (\d+) programs loaded")


def one_run(args: list[str], cache_dir: pathlib.Path, min_compile_time_s: float) -> dict:
    """One launch in a fresh workdir; its wall seconds, seconds to the first RL step (None
    without RL) and programs loaded / requested through the cache."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(min_compile_time_s)
    with tempfile.TemporaryDirectory(prefix="gyrejax-cc-bench-") as workdir:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gyrejax.launch", *args, "--workdir", workdir,
             f"--config.compilation_cache_dir={cache_dir}"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        first_step_s = None
        metrics = pathlib.Path(workdir) / "metrics.jsonl"
        while proc.poll() is None:  # the first step's line, seen as it is written
            if first_step_s is None and metrics.exists() and metrics.read_text().strip():
                first_step_s = time.perf_counter() - start
            time.sleep(0.05)
        wall_s = time.perf_counter() - start
        stderr = proc.stderr.read()
        if proc.returncode:
            raise SystemExit(f"launch failed ({proc.returncode}):\n{stderr[-3000:]}")
    loaded, requested = map(int, LOADED.findall(stderr)[-1])
    return dict(wall_s=wall_s, first_step_s=first_step_s, loaded=loaded, requested=requested)


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a rollout batch, 1 run each")
    parser.add_argument("--runs", type=int, default=3, help="cold and warm runs each")
    parser.add_argument("--min_compile_time_s", default="0", help="comma-separated")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    launch_args, runs = (QUICK, 1) if args.quick else (FULL, args.runs)
    thresholds = [float(x) for x in args.min_compile_time_s.split(",")]

    figures = {"load_before": os.getloadavg(), "args": launch_args, "runs": runs, "by_min": {}}
    root = pathlib.Path(tempfile.mkdtemp(prefix="gyrejax-cc-bench-caches-"))
    try:
        for threshold in thresholds:
            warm_dir = root / f"warm-{threshold}"
            results = {"cold": [], "warm": []}
            for i in range(runs):  # the first cold run fills the warm runs' cache
                cold_dir = warm_dir if i == 0 else root / f"cold-{threshold}-{i}"
                results["cold"].append(one_run(launch_args, cold_dir, threshold))
                results["warm"].append(one_run(launch_args, warm_dir, threshold))
                print(f"min {threshold:g} s, run {i + 1}/{runs}: cold {results['cold'][-1]}, "
                      f"warm {results['warm'][-1]}", flush=True)  # fmt: skip
            figures["by_min"][str(threshold)] = results
            figures["by_min"][str(threshold)]["cache_bytes"] = sum(
                f.stat().st_size for f in warm_dir.iterdir()
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures["load_after"] = os.getloadavg()

    print(f"\nload average before {figures['load_before'][0]:.2f}, after "
          f"{figures['load_after'][0]:.2f}; medians of {runs} run(s)")  # fmt: skip
    header = f"{'min compile s':>14}{'cache':>7}{'run s':>9}{'1st step s':>12}{'loaded':>12}"
    print(header)
    for threshold, results in figures["by_min"].items():
        for kind in ("cold", "warm"):
            r = results[kind]
            step = median(r, "first_step_s")
            loaded = f"{median(r, 'loaded'):.0f}/{median(r, 'requested'):.0f}"
            step_text = "-" if step is None else f"{step:.1f}"
            print(f"{threshold:>14}{kind:>7}{median(r, 'wall_s'):>9.1f}{step_text:>12}{loaded:>12}")
        ratio = median(results["warm"], "wall_s") / median(results["cold"], "wall_s")
        line = f"{threshold:>14}{'w/c':>7}{ratio:>9.2f}"
        if median(results["cold"], "first_step_s"):
            step_ratio = median(results["warm"], "first_step_s") / median(
                results["cold"], "first_step_s"
            )
            line += f"{step_ratio:>12.2f}"
        print(line + f"   cache {results['cache_bytes'] / 1e6:.1f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
