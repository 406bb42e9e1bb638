"""PNG plots of a run: the cell-role timeline, reward and step time per step, and the
held-out evaluations (eval.png, from eval.jsonl records)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

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


def per_step(path: Path, records: list[dict]):
    """Reward and step time per training step."""
    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r.get("reward") for r in records], marker="o")
    top.set_ylabel("mean reward")
    bottom.plot(steps, [r.get("step_s") for r in records], marker="o", color="tab:orange")
    bottom.set_ylabel("step time (s)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
