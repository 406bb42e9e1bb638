"""PNG plots of a run: the cell-role timeline, reward and step time per step, and the
held-out evaluations (eval.png, from eval.jsonl records)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

COLOURS = {"rollout": "tab:blue", "training": "tab:orange", "switching": "tab:gray"}


def role_timeline(path: Path, timeline: list[tuple[float, int, str]], cells: int, end: float):
    """Cells on the y axis, time on x; rollout / training / switching spans."""
    fig, ax = plt.subplots(figsize=(10, 0.6 * cells + 1.5))
    for cell in range(cells):
        events = sorted((t, state) for t, c, state in timeline if c == cell)
        for (start, state), (stop, _) in zip(events, [*events[1:], (end, None)], strict=True):
            if stop > start:
                ax.broken_barh([(start, stop - start)], (cell - 0.4, 0.8), color=COLOURS[state])
        for t, state in events[1:]:
            if state != "switching":
                ax.plot([t, t], [cell - 0.45, cell + 0.45], color="black", linewidth=0.8)
    ax.set_yticks(range(cells), [f"cell {c}" + (" (core)" if c == 0 else "") for c in range(cells)])
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, max(end, 1e-3))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="upper right", ncols=3)
    ax.set_title("cell roles (black ticks: transitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def moving_average(values: list[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """The trailing mean and standard deviation over up to `window` values at each point."""
    x = np.asarray(values, float)
    means, stds = np.empty_like(x), np.empty_like(x)
    for i in range(len(x)):
        part = x[max(0, i + 1 - window) : i + 1]
        means[i], stds[i] = part.mean(), part.std()
    return means, stds


def per_step(path: Path, records: list[dict]) -> dict:
    """Reward per step (points, a moving average and its band of one standard deviation)
    and step time, whose axis the steady steps set: a step that compiled (`compiled` > 0
    in its record) is marked, and one that would stretch the axis is drawn at its top
    with its time written beside it. Returns what was drawn: {"window", "step_time_top",
    "compile_steps"}."""
    steps = [r["step"] for r in records]
    rewarded = [(r["step"], r["reward"]) for r in records if r.get("reward") is not None]
    window = max(1, min(20, len(rewarded) // 5))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if rewarded:
        x, y = zip(*rewarded, strict=True)
        mean, std = moving_average(list(y), window)
        top.plot(x, y, "o", color="tab:blue", alpha=0.35, markersize=3, label="per step")
        top.plot(x, mean, color="tab:blue", label=f"moving average ({window} steps)")
        top.fill_between(x, mean - std, mean + std, color="tab:blue", alpha=0.15, label="± 1 sd")
        top.legend(loc="best", fontsize="small")
    top.set_ylabel("mean reward")
    times = [r.get("step_s") or 0.0 for r in records]
    compiles = [r["step"] for r in records if r.get("compiled")]
    steady = [t for r, t in zip(records, times, strict=True) if not r.get("compiled")] or times
    limit = 1.3 * max(steady) if max(steady) > 0 else 1.0
    bottom.plot(steps, [min(t, limit) for t in times], marker="o", color="tab:orange")
    for step, t in zip(steps, times, strict=True):
        if step in compiles:
            bottom.plot([step], [min(t, limit)], "s", color="tab:red", markersize=8)
            if t > limit:
                bottom.annotate(f"{t:.1f} s (compiling)", (step, limit), fontsize="small",
                                xytext=(4, -12), textcoords="offset points")  # fmt: skip
    bottom.set_ylim(0, limit * 1.05)
    bottom.set_ylabel("step time (s); red: compiled")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"window": window, "step_time_top": limit, "compile_steps": compiles}


# eval.jsonl figure -> its label in eval.png.
EVAL_CURVES = {
    "greedy_pass@1": "greedy pass@1",
    "sampled_pass@1": "sampled pass@1",
    "sampled_pass@k": "sampled pass@k",
    "greedy_reward": "greedy mean reward",
    "sampled_reward": "sampled mean reward",
}


def evaluations(path: Path, records: list[dict]):
    """Held-out pass@1 (greedy, sampled), pass@k and mean rewards per evaluated step."""
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in EVAL_CURVES.items():
        style = "--" if key.endswith("reward") else "-"
        ax.plot(steps, [r.get(key) for r in records], style, marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    k = records[-1].get("k")
    ax.set_title(f"held-out evaluation ({records[-1].get('tasks')} tasks, k = {k})")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(
    workdir: Path, records: list[dict], timeline, cells: int, end: float, evals: list[dict] = ()
) -> None:
    role_timeline(workdir / "cell_roles.png", timeline, cells, end)
    if records:
        per_step(workdir / "steps.png", records)
    if evals:
        evaluations(workdir / "eval.png", evals)
