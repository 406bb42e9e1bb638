"""Learning benchmark: does RL beat doing nothing on held-out tasks?

  python benchmarks/learning_bench.py --out DIR [--warm WARM] [--seeds 3] [--steps N]
      [--eval_every N] [--num_tasks N] [--samples N] [--config.x=y ...]

The main job's config in its `learning` variant (configs/tiny_cpu.py:learning: a warm
start on fresh tasks, not the main job's memorised 16-task pool; 80 RL steps; held-out
evaluation of 64 tasks at steps 40 and 80), two arms from one warm start, `--seeds`
seeds each (`config.seed`: the RL tasks drawn, the sampling, the admission):
  * rl: the main job's RL, `train.steps` steps (`--steps`, `--eval_every`,
    `--num_tasks` and `--samples` override train.steps and the eval.* fields);
  * control: the same run at `train.learning_rate = 0`: the same tasks, rollouts,
    scheduling and evaluations, weights never moving (the warm start's all along).
Both evaluate the held-out split (gyrejax/harness/held_out.py: tasks no training draw
of the run can give, the same for both arms of a seed) every `--eval_every` steps: each
task once greedily and `--samples` times at the rollout temperature. The control's
evaluations are of the warm start's weights, the RL run's start; so "start" below is
the control, and the RL run's evaluations are its middle and end.

Reported per arm and evaluation step, mean +- the 95% confidence half-width over seeds
(Student t, n - 1 degrees of freedom): sampled and greedy pass@1 (a pass: reward 1,
every hidden check), sampled reward, the share of sampled executions that left an empty
workspace, and the mean reward of those that produced something. The goal (issue 39):
RL's held-out sampled pass@1 above the control's with non-overlapping intervals.

Every --config.x=y argument goes to every run and to the warm start, e.g.
--config.train.learning_rate=... (the RL arm's rate) or --config.rl.reward_shaping=pass.
The warm start (`--warm`, else made in OUT/warm: `launch ... --config.train.steps=0`,
about 18 minutes of SFT on 2 cores) is copied into every run (its demonstrations/ and
warmup/), so every run starts from the same weights. A run whose run_summary.json
exists is not run again: the benchmark resumes. Each run takes about 6 minutes on 2
cores (80 steps and two evaluations of 320 executions). Writes OUT/learning.json and
OUT/learning.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CONFIG = "configs/tiny_cpu.py:learning"
FIGURES = (
    "sampled_pass@1",
    "greedy_pass@1",
    "sampled_reward",
    "sampled_empty_rate",
    "sampled_reward_produced",
)
# Two-sided 95% Student t quantiles by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def launch(workdir: Path, flags: list[str], log: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "gyrejax.launch",
        "--config",
        CONFIG,
        "--workdir",
        str(workdir),
    ]
    with open(log, "w") as out:
        subprocess.run(command + flags, stdout=out, stderr=subprocess.STDOUT, check=True)


def warm_start(out: Path, given: str | None, flags: list[str]) -> Path:
    """The warm start every run copies: `given`, else made in OUT/warm under the same
    --config.x=y flags as the runs (so a changed warm start is the one they resume)."""
    if given:
        return Path(given)
    warm = out / "warm"
    if not (warm / "rollout_summary.json").exists():  # what a train.steps=0 run ends with
        print("warm start ->", warm, flush=True)
        launch(warm, [*flags, "--config.train.steps=0"], out / "warm.log")
    return warm


def run_arm(out: Path, warm: Path, arm: str, seed: int, args) -> Path:
    workdir = out / f"{arm}_seed{seed}"
    if (workdir / "run_summary.json").exists():
        return workdir
    if workdir.exists():
        shutil.rmtree(workdir)  # an unfinished run: start it again from the warm start
    workdir.mkdir(parents=True)
    for part in ("demonstrations", "warmup"):
        shutil.copytree(warm / part, workdir / part)
    given = {
        "train.steps": args.steps,
        "eval.every_steps": args.eval_every,
        "eval.num_tasks": args.num_tasks,
        "eval.samples_per_task": args.samples,
    }
    flags = [f"--config.seed={seed}"]
    flags += [f"--config.{name}={value}" for name, value in given.items() if value is not None]
    flags += args.flags
    if arm == "control":
        flags.append("--config.train.learning_rate=0.0")
    start = time.perf_counter()
    launch(workdir, flags, out / f"{arm}_seed{seed}.log")
    print(f"{arm} seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)
    return workdir


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the 95% confidence half-width over seeds (0 with one seed)."""
    x = np.asarray(values, np.float64)
    if len(x) < 2:
        return float(x.mean()), 0.0
    return float(x.mean()), T95[len(x) - 1] * float(x.std(ddof=1)) / math.sqrt(len(x))


def summarise(runs: dict[tuple[str, int], Path]) -> dict:
    """Per arm, per evaluation step: each figure's values over seeds, mean and CI."""
    table: dict[str, dict[int, dict]] = {}
    for (arm, seed), workdir in runs.items():
        for line in (workdir / "eval.jsonl").read_text().splitlines():
            record = json.loads(line)
            row = table.setdefault(arm, {}).setdefault(record["step"], {"seeds": []})
            row["seeds"].append(seed)
            for name in FIGURES:
                if record.get(name) is not None:
                    row.setdefault(name, []).append(record[name])
    for rows in table.values():
        for row in rows.values():
            for name in FIGURES:
                if name in row:
                    mean, half = interval(row[name])
                    row[name] = {"values": row[name], "mean": mean, "ci95": half}
    return table


def verdict(table: dict) -> str:
    """RL's last evaluation against the control's (its mean over evaluations: the same
    weights), on held-out sampled pass@1."""
    rl_rows, control_rows = table.get("rl", {}), table.get("control", {})
    if not rl_rows or not control_rows:
        return "incomplete"
    last = rl_rows[max(rl_rows)]["sampled_pass@1"]
    control = [v for row in control_rows.values() for v in row["sampled_pass@1"]["values"]]
    c_mean, c_half = interval(control)
    gap = (last["mean"] - last["ci95"]) - (c_mean + c_half)
    word = "RL above control, intervals apart" if gap > 0 else "not shown: intervals overlap"
    return (
        f"{word}: RL {last['mean']:.3f} +- {last['ci95']:.3f} at step {max(rl_rows)}, "
        f"control {c_mean:.3f} +- {c_half:.3f} (all its evaluations)"
    )


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, rows in sorted(table.items()):
        steps = sorted(rows)
        mean = [rows[s]["sampled_pass@1"]["mean"] for s in steps]
        half = [rows[s]["sampled_pass@1"]["ci95"] for s in steps]
        ax.errorbar(steps, mean, yerr=half, marker="o", capsize=4, label=arm)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out sampled pass@1")
    ax.set_title("mean and 95% CI over seeds; the control's weights are the start's")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the runs, learning.json, learning.png")
    parser.add_argument("--warm", help="a finished tiny_cpu warm start (else made in OUT)")
    parser.add_argument("--seeds", type=int, default=3)
    # Unset: the config's (train.steps, eval.every_steps, eval.num_tasks, samples_per_task).
    parser.add_argument("--steps", type=int)
    parser.add_argument("--eval_every", type=int)
    parser.add_argument("--num_tasks", type=int)
    parser.add_argument("--samples", type=int)
    args, flags = parser.parse_known_args()  # the rest: --config.x=y, to every run
    unknown = [f for f in flags if not f.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (only --config.x=y pass on)")
    args.flags = flags
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_start(out, args.warm, args.flags)
    runs = {
        (arm, seed): run_arm(out, warm, arm, seed, args)
        for seed in range(args.seeds)
        for arm in ("rl", "control")
    }
    table = summarise(runs)
    result = {"args": vars(args), "table": table, "verdict": verdict(table)}
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    plot(table, out / "learning.png")
    for arm, rows in sorted(table.items()):
        for step, row in sorted(rows.items()):
            cells = [
                f"{name} {row[name]['mean']:.3f} +- {row[name]['ci95']:.3f}"
                for name in FIGURES
                if name in row
            ]
            print(f"{arm:8s} step {step:3d}: " + ", ".join(cells))
    print(result["verdict"])


if __name__ == "__main__":
    main()
