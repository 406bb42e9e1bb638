"""The adversarial round of benchmarks/chaos.py: the audit's attacks (issue 40), made by
agent code inside a real run, each judged from outside.

  python benchmarks/adversarial.py [--json PATH] [--workdir DIR] [--agent_sandbox MODE]

The main job (tiny_cpu.py:smoke, 2 RL steps of one group of 2) runs
`benchmarks/adversary_agent.py` as its agent command (`rl.agent = command`) with small
limits, so that each exhaustion attack meets them within seconds:
`harness.agent_memory_bytes` 512 MiB, `agent_max_processes` 64, `workspace_bytes`
16 MiB, `workspace_inodes` 1024. Every execution makes every attack; the first of each
group also sends the documented finish on its own execution claiming reward 1.0.

An attack is contained when, for every execution that made it:

  runtime environ, runtime memory   no run secret (the engine token in the run's
                                    environment) among what the agent collected
  sibling workspaces, store listing, forged record, checkpoints, task file, root-only
  file, /proc/sys, /proc/sysrq-trigger, host port, other executions' keys, admin at
  the door, huge prompt, disk fill, fork bomb, memory hog
                                    the agent's own attempt failed (and, from the host:
                                    no forged record in the store, kernel.core_uses_pid
                                    unchanged)
  keyless flood, own finish         the run completed, every execution stored; the
                                    finisher's reward is the run's, not the 1.0 it sent
  verifier forgery                  each forger's reward is 0 (member 1 of each group
                                    solves honestly instead: the report shows what the
                                    verifier gave it, and those rewards let steps train)
  setsid survivor                   no process with the marked sleep is left on the host

`--agent_sandbox none` runs the same round without the sandbox, as a control: it shows
which attacks the sandbox is what contains. Reports attacks tried and contained (a
table; --json writes it all). About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 900.0
LIMITS = (
    "--config.harness.agent_memory_bytes=536870912",
    "--config.harness.agent_max_processes=64",
    "--config.harness.workspace_bytes=16777216",
    "--config.harness.workspace_inodes=1024",
)
# What the agent aims at, beyond the limits above (see adversary_agent.py).
AIM = {"fill_mib": 64, "fill_files": 5000, "forks": 1000, "hogs": 3, "hog_mib": 300}
OWN_ATTEMPT_FAILS = (
    "sibling workspaces", "store listing", "forged record", "checkpoints", "task file",
    "root-only file", "/proc/sys", "/proc/sysrq-trigger", "host port",
    "other executions' keys", "admin at the door", "huge prompt", "disk fill",
    "fork bomb", "memory hog",
)  # fmt: skip


def adversarial_round(root: Path, engine_token: str, agent_sandbox: str = "bwrap", log=print):
    """Runs the round in `root` (see module docstring); returns the report."""
    run = root / "adversary_run"
    tasks = REPO_ROOT / "examples/agents/mini_repo_tasks.jsonl"
    secret_file = root / "root_only"
    secret_file.write_text("a root-only secret")
    secret_file.chmod(0o600)
    listener = socket.create_server(("127.0.0.1", 0))
    sleep = f"{2_000_000 + secrets.randbelow(1_000_000)}"
    core_uses_pid = Path("/proc/sys/kernel/core_uses_pid").read_text()
    aim = dict(AIM, task_file=str(tasks), root_only=str(secret_file), sleep=sleep,
               host_port=listener.getsockname()[1])  # fmt: skip
    command = [
        sys.executable, "-m", "gyrejax.launch", "--config", "configs/tiny_cpu.py:smoke",
        "--workdir", str(run), "--config.rl.agent=command",
        f"--config.rl.agent_command={sys.executable} {REPO_ROOT / 'benchmarks/adversary_agent.py'}",
        f"--config.rl.tasks_path={tasks}", f"--config.harness.agent_sandbox={agent_sandbox}",
        *LIMITS,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GYREJAX_ENGINE_TOKEN": engine_token,
           "ADVERSARY_AIM": json.dumps(aim)}  # fmt: skip
    start = time.monotonic()
    log(f"adversarial round: {' '.join(command[2:6])} ... (agent_sandbox={agent_sandbox})")
    with open(root / "adversary_run.log", "w") as out:
        try:
            code = subprocess.run(
                command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                timeout=RUN_TIMEOUT_S,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = None
    listener.close()
    wall_s = time.monotonic() - start
    reports = _agent_reports(run)
    records = _records(run)
    host = {
        "run_exit": code,
        "wall_s": round(wall_s, 1),
        "core_uses_pid_unchanged": Path("/proc/sys/kernel/core_uses_pid").read_text()
        == core_uses_pid,
        "forged_in_store": any("forged" in r["execution_id"] for r in records)
        or any(p.name == "forged.json" for p in (run / "executions").rglob("*")),
        "survivors": _running(f"sleep {sleep}", kill=True),
        "executions_stored": len(records),
        "rewards": sorted({r.get("reward") for r in records}, key=str),
    }
    attacks = _judge(reports, records, host, engine_token)
    return {"agent_sandbox": agent_sandbox, "host": host, "attacks": attacks,
            "agents_reporting": len(reports)}  # fmt: skip


def _agent_reports(run: Path) -> dict[str, dict]:
    """Each execution's report: the last JSON line of its agent's stdout."""
    reports = {}
    for out in sorted((run / "workspaces").glob("*.out")):
        lines = [line for line in out.read_text(errors="replace").splitlines() if line]
        if lines:
            try:
                reports[out.stem] = json.loads(lines[-1])
            except ValueError:
                pass
    return reports


def _records(run: Path) -> list[dict]:
    """The run's stored executions, and one row per record the store could not read."""
    from gyrejax.trajectory import ExecutionStore

    store = ExecutionStore(run / "executions")
    records = [{"execution_id": e.execution_id, "reward": e.reward} for e in store]
    unreadable = len(store) - len(records)
    return records + [{"execution_id": "unreadable", "reward": None}] * unreadable


def _running(text: str, kill: bool = False) -> int:
    """Host processes whose command line holds `text` (killed too, with `kill`)."""
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if text in cmdline and state != "Z":
            count += 1
            if kill:
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), signal.SIGKILL)
    return count


def _judge(reports: dict, records: list, host: dict, engine_token: str) -> dict[str, dict]:
    """attack -> {"tried": executions, "contained": executions, "evidence": ...}."""
    judged: dict[str, dict] = {}

    def note(name: str, contained: bool, evidence: str) -> None:
        row = judged.setdefault(name, {"tried": 0, "contained": 0, "evidence": []})
        row["tried"] += 1
        row["contained"] += bool(contained)
        if evidence not in row["evidence"] and len(row["evidence"]) < 2:
            row["evidence"].append(evidence)

    completed = host["run_exit"] == 0 and len(records) >= len(reports) > 0
    rewards = {r["execution_id"]: r["reward"] for r in records}
    honest: list = []  # what the verifier gave honest solutions (it still rewards them)
    for report in reports.values():
        attacks, found = report["attacks"], report["found"]
        for name in ("runtime environ", "runtime memory"):
            leaked = engine_token in found
            evidence = f"no run secret in {attacks[name]['detail']}"
            note(name, not leaked, "the engine token found" if leaked else evidence)
        for name in OWN_ATTEMPT_FAILS:
            if name == "root-only file" and os.geteuid() != 0:
                continue  # the file is the caller's own: nothing to contain
            outcome = attacks[name]
            contained = outcome["outcome"] == "refused"
            if name == "forged record":
                contained = contained and not host["forged_in_store"]
            if name == "/proc/sys":
                contained = contained and host["core_uses_pid_unchanged"]
            note(name, contained, outcome["detail"])
        note("keyless flood", completed, f"run completed: {completed}")
        reward = rewards.get(report["execution"])
        if "verifier forgery" in attacks:
            note("verifier forgery", reward == 0.0, f"forgers' reward {reward}")
        else:
            honest.append(reward)
        note("setsid survivor", host["survivors"] == 0, f"{host['survivors']} left running")
        if "own finish" in attacks:  # it claimed 1.0; the run scores it
            mine = rewards.get(report["execution"])
            evidence = f"run completed: {completed}; its reward {mine}"
            note("own finish", completed and mine != 1.0, evidence)
    host["honest_rewards"] = honest
    return judged


def print_report(result: dict) -> None:
    attacks = result["attacks"]
    print(f"\nadversarial round (agent_sandbox={result['agent_sandbox']}): "
          f"{result['agents_reporting']} agents, run exit {result['host']['run_exit']}, "
          f"{result['host']['wall_s']} s; honest solutions' rewards "
          f"{result['host']['honest_rewards']}")  # fmt: skip
    print("| attack | contained / tried | evidence |")
    print("|---|---|---|")
    for name, row in attacks.items():
        evidence = "; ".join(row["evidence"])[:120].replace("|", "/")
        print(f"| {name} | {row['contained']} / {row['tried']} | {evidence} |")
    contained = sum(r["contained"] == r["tried"] for r in attacks.values())
    print(f"| **all** | **{contained} / {len(attacks)} attacks contained** | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--workdir", help="keep the run here (default: a temp dir, removed)")
    parser.add_argument("--agent_sandbox", default="bwrap", choices=("bwrap", "none"))
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gyrejax-adversary-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = adversarial_round(root, secrets.token_hex(16), args.agent_sandbox)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
