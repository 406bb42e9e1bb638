"""Sandbox benchmark: what bubblewrap adds to one run of agent code.

  python benchmarks/sandbox_bench.py [--quick] [--json PATH]

Runs a trivial script (`print(1)`) through `run_python` under the Python guard alone and
under bubblewrap (with the guard inside), interleaved (guard, bwrap, guard, ...) so that
load on a shared machine hits both alike, after one warm-up run of each. Reports the
median and 90th-percentile wall time per run and the bwrap - guard difference and
ratio. 20 runs each (`--quick`: 5). Without a working bubblewrap it reports the guard
only and says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from gyrejax.harness.sandbox import Limits, choose_sandbox, run_python

SCRIPT = "print(1)\n"


def time_runs(sandboxes: dict, workspace: str, runs: int) -> dict[str, list[float]]:
    """Wall seconds per run of SCRIPT for each sandbox, interleaved."""
    limits = Limits(wall_s=30.0)
    times = {name: [] for name in sandboxes}
    for choice in sandboxes.values():  # warm-up: page cache, imports
        run_python(SCRIPT, workspace, limits, sandbox=choice)
    for _ in range(runs):
        for name, choice in sandboxes.items():
            start = time.perf_counter()
            result = run_python(SCRIPT, workspace, limits, sandbox=choice)
            times[name].append(time.perf_counter() - start)
            assert result.stdout == "1\n", (name, result)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 runs each instead of 20")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    runs = 5 if args.quick else 20

    sandboxes = {"python_guard": choose_sandbox("python_guard")}
    bwrap = choose_sandbox("auto")
    if bwrap.security_boundary:
        sandboxes["bwrap"] = bwrap
    else:
        print(f"bubblewrap not measured: {bwrap.reason}")
    with tempfile.TemporaryDirectory() as workspace:
        times = time_runs(sandboxes, workspace, runs)

    figures = {"runs": runs}
    print(f"{'sandbox':<14}{'median ms':>12}{'p90 ms':>10}")
    for name, samples in times.items():
        ordered = sorted(samples)
        median = statistics.median(ordered)
        p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
        figures[name] = {"median_s": median, "p90_s": p90}
        print(f"{name:<14}{median * 1e3:>12.1f}{p90 * 1e3:>10.1f}")
    if "bwrap" in figures:
        guard, bubble = figures["python_guard"]["median_s"], figures["bwrap"]["median_s"]
        figures["bwrap_minus_guard_s"] = bubble - guard
        figures["bwrap_over_guard"] = bubble / guard
        print(f"bwrap adds {(bubble - guard) * 1e3:.1f} ms per run ({bubble / guard:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
