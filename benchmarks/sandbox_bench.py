"""Sandbox benchmark: what bubblewrap adds to one run of agent code, and to one
execution of an external agent.

  python benchmarks/sandbox_bench.py [--quick] [--json PATH]

1. Agent-written code: a trivial script (`print(1)`) through `run_python` under the
   Python guard alone and under bubblewrap (with the guard inside).
2. An external agent (`rl.agent = command`): one execution of a small Python agent that
   makes `--calls` completions calls through the door (a scripted engine answers at
   once, so what is timed is the process, the sandbox and the door path), under
   `harness.agent_sandbox = "none"` and `"bwrap"` (bubblewrap, a forwarder inside to
   the execution's own door socket).

Each pair runs interleaved (one, the other, one, ...) so that load on a shared machine
hits both alike, after one warm-up run of each. Reports the median and 90th-percentile
wall time per run and the bwrap - baseline difference and ratio. 20 runs each
(`--quick`: 5). Without a working bubblewrap it reports the baselines only and says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.harness.external import CommandAgents
from gyrejax.harness.sandbox import Limits, choose_sandbox, run_python
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.serve.openai_server import OpenAIServer

SCRIPT = "print(1)\n"
# An external agent: `calls` completions through the door, then its own reward.
AGENT = """
import json, os, sys, urllib.request
for _ in range(int(sys.argv[1])):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/completions", method="POST",
        data=json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).read()
open("reward.json", "w").write('{"reward": 1}')
"""


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


def time_agents(modes: list[str], workdir: Path, runs: int, calls: int) -> dict[str, list]:
    """Wall seconds per external-agent execution for each agent_sandbox mode, interleaved."""
    script = workdir / "agent.py"
    script.write_text(AGENT)
    task = MiniRepoEnv().sample_tasks(1, seed=0)[0]
    engine = ScriptedEngine("scripted", lambda prompt, request: [0])

    async def body() -> dict[str, list[float]]:
        door = OpenAIServer(Proxy([engine]), api_key=secrets.token_urlsafe(32))
        url = await door.start("127.0.0.1", 0)
        agents = {
            mode: CommandAgents(
                door,
                url,
                [sys.executable, str(script), str(calls)],
                workdir / mode,
                environment=MiniRepoEnv(),
                reward="agent",
                agent_sandbox=mode,
            )
            for mode in modes
        }
        times = {mode: [] for mode in modes}
        try:
            for i in range(runs + 1):  # the first of each is the warm-up
                for mode, runner in agents.items():
                    start = time.perf_counter()
                    execution = await runner.run_execution(task, f"{mode}/{i}", f"{mode}/{i}", 0)
                    elapsed = time.perf_counter() - start
                    assert execution.status == "finished", (mode, execution.error)
                    assert len(execution.calls) == calls, (mode, len(execution.calls))
                    if i:
                        times[mode].append(elapsed)
        finally:
            await door.stop()
        return times

    return asyncio.run(body())


def report(times: dict[str, list[float]], base: str, figures: dict, key: str = "") -> None:
    """Prints (and adds to `figures`) each mode's median and p90, and bwrap over `base`."""
    print(f"{'sandbox':<14}{'median ms':>12}{'p90 ms':>10}")
    for name, samples in times.items():
        ordered = sorted(samples)
        median = statistics.median(ordered)
        p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
        figures[key + name] = {"median_s": median, "p90_s": p90}
        print(f"{name:<14}{median * 1e3:>12.1f}{p90 * 1e3:>10.1f}")
    if "bwrap" in times:
        low, high = figures[key + base]["median_s"], figures[key + "bwrap"]["median_s"]
        figures[f"{key}bwrap_minus_{base}_s"] = high - low
        figures[f"{key}bwrap_over_{base}"] = high / low
        print(f"bwrap adds {(high - low) * 1e3:.1f} ms per run ({high / low:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 runs each instead of 20")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--calls", type=int, default=8, help="an agent's calls (default 8)")
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
    figures = {"runs": runs, "agent_calls": args.calls}
    print("agent-written code (run_python, print(1)):")
    report(times, "python_guard", figures)
    modes = ["none", *(["bwrap"] if bwrap.security_boundary else [])]
    with tempfile.TemporaryDirectory() as workdir:
        agents = time_agents(modes, Path(workdir), runs, args.calls)
    print(f"\nan external agent's execution ({args.calls} calls through the door):")
    report(agents, "none", figures, key="agent_")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
