"""Fault injection: SIGKILL the main job at chosen moments, restart it, check what it kept.

  python benchmarks/chaos.py [--quick] [--json PATH] [--kills N] [--seed S] [--workdir DIR]
                             [--moments warm_start,rollout,step,checkpoint,publish,transition]
                             [--per_run K] [--adversarial after|only|skip]

The main job is the tiny CPU run, started as a user starts it:

  python -m gyrejax.launch --config configs/tiny_cpu.py:smoke --workdir RUN <overrides>

(--quick: that command, 2 RL steps on two cells, 3 kills). The full run adds a warm start
(`warmup.*` overrides), 6 RL steps and an external gyrejax engine server that stays up
across kills: a config written next to RUN (`chaos_config.py`: tiny_cpu.py:smoke plus
`rollout.engine_servers`, which has no command-line override while empty), so each
weight publication writes an HF export (`RUN/published/version_<v>`) for it to reload.

Each kill is aimed at one moment, cycling through them in a random order: a warm start,
rollout, a training step, a checkpoint write, a weight publication, a cell transition.
The job notes when each moment begins and ends in the file $GYREJAX_MARKERS names
(`gyrejax.logs.mark`, a no-op otherwise); rollout is aimed at from the execution store
and dispatch log. The kill lands a random short delay after the moment begins; whether
it landed inside (before the moment's end marker) is reported. After each kill the same
command starts again; the kill counts as survived when the checks below hold and the
restart goes on (to the next kill, or to the end of the run). When a run completes
before its next moment comes, the remaining kills go to a fresh run.

Checked after every kill: no process of the job outlives it; every stored execution
(RL store and demonstrations) reads, none seen before is lost; every checkpoint on disk
restores and none was moved aside as corrupt; every HF export with a config.json loads;
the metrics rows up to the newest checkpoint train no group twice and only groups that
checkpoint records as trained. After the run: it exits 0, metrics.jsonl holds each step
once, every log line reads, and no export is left half-written.

Also: an engine server (a JAX engine; scripted with --quick) and, if vllm is installed
(not with --quick), a vLLM server are killed mid-request behind the proxy, beside a
local engine; the request must complete there, equal to that engine's own answer.

Then the adversarial round (benchmarks/adversarial.py; `--adversarial only|skip`): a
real run whose agent command makes each attack of the audit (issue 40) from inside its
sandbox, each judged from outside; it reports attacks tried and contained.

Reports kills survived / tried, per moment, the server kills and the adversarial round;
--json writes it all.
On 2 shared CPU cores the full run (20 kills, about 4 runs) takes 40 minutes, --quick
4 minutes (10 when the cores are busy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO_ROOT = Path(__file__).resolve().parent.parent
MOMENTS = ("warm_start", "rollout", "step", "checkpoint", "publish", "transition")
# After a moment begins, the kill waits a random delay up to this many seconds (below
# the moment's length on 2 loaded cores, so most kills land inside it: measured from the
# markers, a warm start takes 30-70 s, a step 0.2-80 s (the first one compiles), a
# checkpoint 0.2-0.9 s, a publication with its HF export 0.04-0.2 s).
MAX_DELAY_S = {"warm_start": 30.0, "rollout": 4.0, "step": 0.15, "checkpoint": 0.2,
               "publish": 0.04, "transition": 2.0}  # fmt: skip
MOMENT_TIMEOUT_S = 900.0  # a moment that never comes: the run is stuck
MARKERS = "chaos_markers.log"
# The shared token of the engine servers this benchmark starts, in the environment of
# every process it starts (a server and its clients read GYREJAX_ENGINE_TOKEN where
# engine servers require one); never set in this process's own environment.
ENGINE_TOKEN_ENV = "GYREJAX_ENGINE_TOKEN"
ENGINE_TOKEN = secrets.token_hex(16)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process this benchmark starts."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", ENGINE_TOKEN_ENV: ENGINE_TOKEN, **extra}


@contextlib.contextmanager
def engine_token_here():
    """GYREJAX_ENGINE_TOKEN set in this process while its own clients reach a server."""
    old = os.environ.get(ENGINE_TOKEN_ENV)
    os.environ[ENGINE_TOKEN_ENV] = ENGINE_TOKEN
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENGINE_TOKEN_ENV]
        else:
            os.environ[ENGINE_TOKEN_ENV] = old


@dataclasses.dataclass
class Scenario:
    """One main-job setup: the command's config and overrides, and what a run does."""

    config: str  # --config value
    overrides: tuple[str, ...]
    steps: int  # train.steps
    group_size: int
    warm_start: bool
    engine_server: bool  # an external engine server beside the cells


QUICK = Scenario(
    config="configs/tiny_cpu.py:smoke",
    overrides=("--config.cells.size=4", "--config.cells.fsdp=4"),  # two cells
    steps=2, group_size=2, warm_start=False, engine_server=False,
)  # fmt: skip
FULL = Scenario(
    config="configs/tiny_cpu.py:smoke",
    overrides=(
        "--config.train.steps=6", "--config.warmup.steps=3",
        "--config.warmup.demonstrations=24", "--config.warmup.groups_per_step=8",
    ),
    steps=6, group_size=2, warm_start=True, engine_server=True,
)  # fmt: skip


@dataclasses.dataclass
class Kill:
    """One SIGKILL of the main job and what was found after it."""

    run: int
    moment: str
    after_s: float  # since this start of the job
    landed_inside: bool  # the moment had begun and not ended when the signal went
    problems: list[str]
    survived: bool | None = None  # the checks held and the restart went on


# --- the main job ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """The main job in a subprocess (its own session, so its children can be found),
    output to a log file (a pipe could fill and stall it)."""

    def __init__(self, command: list[str], log: Path, markers: Path):
        self.command = command
        self.log_path = log
        self.markers = markers
        self.started = time.monotonic()
        self._log = open(log, "a")
        self._log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(command)}\n")
        self._log.flush()
        env = child_env(GYREJAX_MARKERS=str(markers))
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def poll(self) -> int | None:
        return self.process.poll()

    def kill(self) -> int:
        """SIGKILLs the main process, as a crash would; returns how many of its
        processes were still alive a second later (then kills them too)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        time.sleep(1.0)
        survivors = _session_members(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()
        return len(survivors)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9
        self._log.close()
        return code

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def _session_members(sid: int) -> list[int]:
    """Processes of session `sid` still alive (children a killed job left behind)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # session id; not a zombie
                    members.append(int(entry.name))
    return members


def read_markers(path: Path) -> list[tuple[float, str]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        stamp, _, event = line.partition(" ")
        with contextlib.suppress(ValueError):
            out.append((float(stamp), event))
    return out


def moment_open(markers: list[tuple[float, str]], moment: str) -> bool:
    """Whether `moment` has begun and not ended, by the last of its markers."""
    for _, event in reversed(markers):
        if event == moment:
            return True
        if event == f"{moment} done":
            return False
    return False


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _records(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {p.name for p in directory.iterdir() if p.name.endswith(".gxr")}


def rollout_under_way(run: Path, group_size: int) -> bool:
    """Some dispatched group still lacks stored executions."""
    from gyrejax.logs import read_jsonl

    stored = _records(run / "executions")
    for entry in read_jsonl(run / "dispatch.jsonl"):
        group = str(entry.get("group"))
        if sum(name.startswith(f"{group}%2F") for name in stored) < group_size:
            return True
    return False


def aim_and_kill(job: Job, run: Path, moment: str, scenario: Scenario, rng: random.Random):
    """Waits for `moment` to begin, then a random delay, then kills the job. Returns
    (after_s, landed_inside, orphans), or None if the job ended first."""
    markers_path = job.markers
    seen = len(read_markers(markers_path))
    executions0 = len(_records(run / "executions"))
    dispatched0 = _count_lines(run / "dispatch.jsonl")
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while True:
        if job.poll() is not None:
            return None
        if time.monotonic() > deadline:
            raise RuntimeError(f"{moment}: did not come within {MOMENT_TIMEOUT_S} s")
        markers = read_markers(markers_path)
        if moment == "rollout":
            begun = (
                len(_records(run / "executions")) > executions0
                or _count_lines(run / "dispatch.jsonl") > dispatched0
            )
        else:
            begun = any(event == moment for _, event in markers[seen:])
        if begun:
            break
        time.sleep(0.01)
    delay = rng.uniform(0.0, MAX_DELAY_S[moment])
    end = time.monotonic() + delay
    while time.monotonic() < end and job.poll() is None:
        time.sleep(min(0.01, max(0.0, end - time.monotonic())))
    if job.poll() is not None:
        return None
    if moment == "rollout":
        inside = rollout_under_way(run, scenario.group_size)
    else:
        inside = moment_open(read_markers(markers_path), moment)
    after_s = job.elapsed()
    orphans = job.kill()
    return after_s, inside, orphans


# --- checks ---------------------------------------------------------------------------


@dataclasses.dataclass
class Seen:
    """What earlier checks found, so a later one can tell whether something was lost."""

    executions: dict[str, set[str]] = dataclasses.field(default_factory=dict)


def check_stores(run: Path, seen: Seen, problems: list[str]) -> None:
    from gyrejax.trajectory import ExecutionStore

    for name in ("executions", "demonstrations"):
        directory = run / name
        if not directory.is_dir():
            continue
        store = ExecutionStore(directory)
        ids = {e.execution_id for e in store}
        if store.bad_records:
            problems.append(f"{name}: unreadable records {sorted(store.bad_records)}")
        lost = seen.executions.get(name, set()) - ids
        if lost:
            problems.append(f"{name}: lost {sorted(lost)}")
        seen.executions[name] = seen.executions.get(name, set()) | ids


def restore_checkpoints(directory: Path, problems: list[str]) -> dict[int, dict]:
    """Restores every checkpoint under `directory` (no targets: saved shapes and
    layout); returns step -> metadata of those that restore."""
    import orbax.checkpoint as ocp
    from absl import logging as absl_logging

    metas: dict[int, dict] = {}
    if not directory.is_dir():
        return metas
    aside = [p.name for p in directory.iterdir() if ".corrupt-" in p.name]
    if aside:
        problems.append(f"{directory}: checkpoints moved aside as unreadable: {aside}")
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax warns that it is read-only
    with contextlib.ExitStack() as stack:
        stack.callback(absl_logging.set_verbosity, verbosity)
        options = ocp.CheckpointManagerOptions(read_only=True)
        manager = stack.enter_context(ocp.CheckpointManager(directory, options=options))
        for step in manager.all_steps():
            try:
                restored = manager.restore(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(),
                        opt_state=ocp.args.StandardRestore(),
                        metadata=ocp.args.JsonRestore(),
                    ),
                )
                metas[step] = dict(restored.metadata)
            except Exception as e:  # Orbax raises plain Exceptions
                problems.append(f"{directory / str(step)}: does not restore: {e!s:.200}")
    return metas


def check_exports(run: Path, problems: list[str], final: bool) -> int:
    """Every export with a config.json loads; at the end, none lacks it. Returns how
    many were checked."""
    from gyrejax.model.hf_io import load_hf

    checked = 0
    for export in sorted([*run.glob("published/version_*"), *run.glob("hf/step_*")]):
        if (export / "config.json").exists():
            try:
                load_hf(export)
                checked += 1
            except Exception as e:
                problems.append(f"{export}: complete-looking export does not load: {e!s:.200}")
        elif final:
            problems.append(f"{export}: half-written export left at the end of the run")
    return checked


def check_history(run: Path, metas: dict[int, dict], problems: list[str], final: bool) -> None:
    """No group is trained twice in the checkpointed history."""
    from gyrejax.logs import read_jsonl

    rows = read_jsonl(run / "metrics.jsonl")
    newest = max(metas, default=0)
    trained = list(metas[newest].get("trained_groups", [])) if newest else []
    if len(trained) != len(set(trained)):
        problems.append(f"checkpoint {newest}: a group is trained twice in {trained}")
    history = [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= newest]
    steps = [r["step"] for r in history]
    if len(steps) != len(set(steps)):
        problems.append(f"metrics.jsonl: a step appears twice up to checkpoint {newest}: {steps}")
    groups = [g for r in history for g in r.get("groups", [])]
    if len(groups) != len(set(groups)):
        problems.append(f"metrics.jsonl: a group is trained twice: {groups}")
    if not set(groups) <= set(trained):
        problems.append(
            f"metrics.jsonl: groups {sorted(set(groups) - set(trained))} trained up to "
            f"checkpoint {newest} are not in its trained_groups"
        )
    if final:
        all_steps = [r.get("step") for r in rows]
        if all_steps != list(range(1, len(rows) + 1)):
            problems.append(f"metrics.jsonl: steps {all_steps}, expected each once")


def check_logs_read(run: Path, problems: list[str]) -> None:
    for name in ("metrics.jsonl", "dispatch.jsonl", "transitions.jsonl"):
        path = run / name
        if path.exists():
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                try:
                    json.loads(line)
                except ValueError:
                    problems.append(f"{name} line {number} does not read: {line[:80]!r}")


def check_run(run: Path, seen: Seen, *, final: bool) -> tuple[list[str], dict]:
    """Every check of the module docstring; returns (problems, counts)."""
    problems: list[str] = []
    check_stores(run, seen, problems)
    metas = restore_checkpoints(run / "checkpoints", problems)
    warm = restore_checkpoints(run / "warmup" / "checkpoints", problems)
    exports = check_exports(run, problems, final)
    check_history(run, metas, problems, final)
    if final:
        check_logs_read(run, problems)
    counts = {
        "executions": len(seen.executions.get("executions", ())),
        "demonstrations": len(seen.executions.get("demonstrations", ())),
        "checkpoints": len(metas) + len(warm),
        "exports": exports,
    }
    return problems, counts


# --- runs -----------------------------------------------------------------------------


def start_engine_server(root: Path, scenario: Scenario):
    """An external engine server for the full scenario, up across the job's kills:
    (process, url). It starts from an HF export of the config's initial model."""
    from gyrejax.config import from_dict
    from gyrejax.model.hf_io import export_hf
    from gyrejax.model.transformer import init_model
    from gyrejax.serve.vllm_server_engine import start_server_process, wait_until_healthy

    c = _load_config(scenario)
    config = from_dict(c)
    start = export_hf(init_model(config.model), root / "engine_server_start")
    port = free_port()
    command = [
        sys.executable, "-m", "gyrejax.serve.engine_server", f"--port={port}", "--name=ext",
        "--engine=jax", f"--hf_dir={start}", f"--max_seq_len={config.rollout.max_seq_len}",
        f"--max_slots={config.rollout.max_slots}",
        f"--weights_dir={root}",  # every run's published/ lies under it
    ]  # fmt: skip
    log = open(root / "engine_server.log", "w")
    process = start_server_process(command, child_env(), log)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, process)
    return process, url


def _load_config(scenario: Scenario):
    import importlib.util

    name, _, variant = scenario.config.partition(":")
    spec = importlib.util.spec_from_file_location("chaos_tiny_cpu", REPO_ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant or None)


def write_config(root: Path, scenario: Scenario, url: str) -> str:
    """The config with the external engine server (see the module docstring)."""
    name, _, variant = scenario.config.partition(":")
    path = root / "chaos_config.py"
    path.write_text(
        f'"""{scenario.config} with the engine server {url}: written by benchmarks/chaos.py."""\n'
        "import importlib.util\n\n"
        f"_spec = importlib.util.spec_from_file_location('tiny_cpu', {str(REPO_ROOT / name)!r})\n"
        "_tiny = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_tiny)\n\n\n"
        "def get_config():\n"
        f"    c = _tiny.get_config({variant or None!r})\n"
        f"    c.rollout.engine_servers = ({url!r},)\n"
        "    return c\n"
    )
    return str(path)


def command_for(config: str, run: Path, scenario: Scenario) -> list[str]:
    return [sys.executable, "-m", "gyrejax.launch", "--config", config, "--workdir", str(run),
            *scenario.overrides]  # fmt: skip


def chaos(
    root: Path,
    scenario: Scenario,
    kills: int,
    seed: int,
    log=print,
    only=MOMENTS,
    per_run: int | None = None,
) -> dict:
    """Runs the main job again and again, killing it `kills` times (module docstring),
    at the moments of `only` the scenario has (each once per run, or `per_run` kills a
    run)."""
    rng = random.Random(seed)
    moments = [m for m in only if scenario.warm_start or m != "warm_start"]
    if not scenario.engine_server:  # no export to publish: a publication is instant
        moments = [m for m in moments if m != "publish"]
    if not moments:
        raise ValueError(f"none of the moments {only} happens in this scenario")
    results: list[Kill] = []
    runs: list[dict] = []
    server = None
    config = scenario.config
    try:
        if scenario.engine_server:
            server, url = start_engine_server(root, scenario)
            config = write_config(root, scenario, url)
        run_index = 0
        while len(results) < kills:
            run = root / f"run{run_index}"
            plan = _plan(moments, rng, per_run)
            seen = Seen()
            outcome = _one_run(run, run_index, config, scenario, plan, kills - len(results),
                               rng, seen, results, log)  # fmt: skip
            runs.append(outcome)
            run_index += 1
            if not outcome["completed"]:
                break  # a run that cannot complete: the next would not either
    finally:
        if server is not None:
            from gyrejax.serve.vllm_server_engine import kill_server_process

            kill_server_process(server)
    return {"kills": [dataclasses.asdict(k) for k in results], "runs": runs}


# The order a run meets the moments in: the warm start once, at the start; rollout and
# transitions from the first seconds of RL (and again after each restart); steps,
# checkpoints and publications only once groups are ready, fewer as the run nears its end.
_PHASE = {"warm_start": 0, "rollout": 1, "transition": 1, "step": 2, "checkpoint": 2,
          "publish": 2}  # fmt: skip


def _plan(moments: list[str], rng: random.Random, per_run: int | None) -> list[str]:
    """The moments of one run: each once (or `per_run` kills, cycling through them),
    shuffled, then ordered by phase (a kill aimed at a moment a run has passed would
    wait for nothing)."""
    order = list(moments)
    if per_run is not None:
        order = [order[i % len(order)] for i in range(per_run)]
    rng.shuffle(order)
    return sorted(order, key=_PHASE.__getitem__)


def _one_run(run, run_index, config, scenario, plan, budget, rng, seen, results, log) -> dict:
    """One run (a fresh workdir): a kill per planned moment, each followed by a restart
    of the same command, then a last start left to complete."""
    command = command_for(config, run, scenario)
    run.mkdir(parents=True, exist_ok=True)
    markers = run / MARKERS
    starts = 0
    pending: Kill | None = None  # the last kill, judged once its restart goes on
    for moment in plan[:budget]:
        job = Job(command, run / "job.log", markers)
        starts += 1
        aimed = aim_and_kill(job, run, moment, scenario, rng)
        if aimed is None:  # the job ended (done, or failed) before the moment came
            return _finish(run, run_index, seen, job.wait(60.0), starts, log, job, pending)
        if pending is not None:  # the restart after it reached the next moment
            pending.survived = not pending.problems
        after_s, inside, orphans = aimed
        problems, counts = check_run(run, seen, final=False)
        if orphans:
            problems.append(f"{orphans} process(es) of the killed job outlived it")
        pending = Kill(run_index, moment, round(after_s, 1), inside, problems)
        results.append(pending)
        log(f"run {run_index} kill {len(results)}: {moment} at {after_s:.1f} s "
            f"({'inside' if inside else 'outside'} it) {counts} "
            f"{'OK' if not problems else problems}")  # fmt: skip
    job = Job(command, run / "job.log", markers)
    starts += 1
    return _finish(run, run_index, seen, job.wait(3600.0), starts, log, job, pending)


def _finish(run, run_index, seen, code, starts, log, job, pending) -> dict:
    """The checks at the end of a run; the last kill survived if the run completed."""
    problems, counts = check_run(run, seen, final=True)
    summary_path = run / "run_summary.json"
    steps = json.loads(summary_path.read_text())["steps"] if summary_path.exists() else None
    completed = code == 0 and not problems
    if code != 0:
        problems.append(f"exit {code}: {job.tail(1500)}")
    if pending is not None:
        pending.survived = completed and not pending.problems
        pending.problems += problems
    log(f"run {run_index}: exit {code} after {starts} start(s), steps {steps}, {counts} "
        f"{'OK' if not problems else problems}")  # fmt: skip
    return {"run": run_index, "exit": code, "starts": starts, "steps": steps,
            "completed": completed, "problems": problems, **counts}  # fmt: skip


# --- servers killed mid-request -------------------------------------------------------


async def _kill_mid_request(far, kill, near, prompt, sampling, mid_request) -> dict:
    """A proxy over [far, near]; a request goes to far and far is killed once
    `mid_request()` says it is under way there; the request must complete on near
    exactly as near alone answers it."""
    from gyrejax.rollout.proxy import Proxy

    reference = await near.submit(_request("reference", prompt, sampling))
    proxy = Proxy([far, near], hang_timeout_s=2.0)
    proxy.dispatch("x")
    proxy.set_accepting(near.name, False)  # the request goes to far
    call = asyncio.create_task(proxy.generate("x", "main", "main", prompt, sampling))
    deadline = time.monotonic() + 300
    while not proxy.counters().in_flight.get(far.name) or not await mid_request():
        if call.done() or time.monotonic() > deadline:
            raise RuntimeError(f"the request never got under way on {far.name}: {call}")
        await asyncio.sleep(0.01)
    proxy.set_accepting(near.name, True)
    kill()
    completion = await asyncio.wait_for(call, timeout=300)
    (record,) = proxy.finish("x")
    ok = (
        completion.engines == (near.name,)
        and completion.output_ids.tolist() == reference.output_ids.tolist()
        and record.output_ids.tolist() == reference.output_ids.tolist()
        and proxy.counters().retries == 1
    )
    return {"completed_on": list(completion.engines), "tokens": len(completion.output_ids),
            "equals_reference": ok}  # fmt: skip


def _request(request_id, prompt, sampling):
    from gyrejax.rollout.types import Request

    return Request(request_id, list(prompt), sampling)


def engine_server_kill(root: Path, quick: bool) -> dict:
    """An engine server (a JAX engine; scripted with --quick) killed mid-request."""
    from gyrejax.rollout.types import SamplingParams
    from gyrejax.serve.http_engine import HttpEngine
    from gyrejax.serve.vllm_server_engine import (
        kill_server_process,
        start_server_process,
        wait_until_healthy,
    )

    port = free_port()
    prompt = [5, 6, 7, 8, 9, 10]
    command = [sys.executable, "-m", "gyrejax.serve.engine_server", f"--port={port}",
               "--name=far"]  # fmt: skip
    if quick:
        from gyrejax.rollout.scripted import ScriptedEngine
        from gyrejax.serve.engine_server import scripted_answer

        command += ["--engine=scripted", "--scripted_delay_s=60"]
        near = ScriptedEngine("near", scripted_answer)
        sampling = SamplingParams(max_new_tokens=8)
    else:
        from gyrejax.config import from_dict
        from gyrejax.model.hf_io import export_hf, load_hf
        from gyrejax.rollout.jax_engine import JaxEngine

        model_config = from_dict(_load_config(QUICK)).model
        from gyrejax.model.transformer import init_model

        checkpoint = export_hf(init_model(model_config), root / "engine_kill_model")
        command += ["--engine=jax", f"--hf_dir={checkpoint}", "--max_seq_len=256"]
        near = JaxEngine("near", load_hf(checkpoint), max_slots=4, max_seq_len=256)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=200)
    log = open(root / "engine_kill_server.log", "w")
    process = start_server_process(command, child_env(), log)
    url = f"http://127.0.0.1:{port}"

    async def body():
        far = await HttpEngine.connect(url, poll_interval_s=0.1, status_timeout_s=1.0)

        async def mid_request() -> bool:  # held by the server (compiling or decoding)
            return "x/0" in (await far.status())["request_ids"]

        try:
            return await _kill_mid_request(
                far, lambda: kill_server_process(process), near, prompt, sampling, mid_request
            )
        finally:
            await far.shutdown()
            await near.shutdown()

    try:
        wait_until_healthy(url, process)
        with engine_token_here():
            return asyncio.run(body())
    finally:
        kill_server_process(process)


def vllm_server_kill(root: Path) -> dict:
    """A vLLM server killed mid-request; a JAX engine on the same weights finishes it."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not installed"}
    from gyrejax.config import from_dict
    from gyrejax.model.hf_io import export_hf, load_hf
    from gyrejax.model.transformer import init_model
    from gyrejax.rollout.jax_engine import JaxEngine
    from gyrejax.rollout.types import SamplingParams
    from gyrejax.serve.vllm_server_engine import (
        VllmServerEngine,
        kill_server_process,
        server_command,
        start_server_process,
        wait_until_healthy,
    )

    model_config = from_dict(_load_config(QUICK)).model  # head_dim 64: vLLM's CPU attention
    checkpoint = export_hf(init_model(model_config), root / "vllm_kill_model")
    port = free_port()
    command, env = server_command(checkpoint, port, max_model_len=256, max_num_seqs=4)
    log = open(root / "vllm_kill_server.log", "w")
    process = start_server_process(command, env, log)
    url = f"http://127.0.0.1:{port}"
    near = JaxEngine("near", load_hf(checkpoint), max_slots=4, max_seq_len=256)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=200)

    async def body():
        far = await VllmServerEngine.connect(url, name="vllm0")

        async def mid_request() -> bool:  # some tokens streamed back, not all
            stream = far._streams.get("x/0")  # the proxy's first request id of "x"
            return stream is not None and len(stream.output) >= 5

        try:
            return await _kill_mid_request(
                far, lambda: kill_server_process(process), near, [5, 6, 7, 8, 9, 10],
                sampling, mid_request,
            )  # fmt: skip
        finally:
            await far.shutdown()
            await near.shutdown()

    try:
        wait_until_healthy(url, process)
        return asyncio.run(body())
    finally:
        kill_server_process(process)


# --- report ---------------------------------------------------------------------------


def summarize(result: dict) -> dict:
    kills = result["kills"]
    by_moment = {}
    for moment in MOMENTS:
        mine = [k for k in kills if k["moment"] == moment]
        if mine:
            by_moment[moment] = {
                "tried": len(mine),
                "survived": sum(bool(k["survived"]) for k in mine),
                "landed_inside": sum(k["landed_inside"] for k in mine),
            }
    return {
        "kills_tried": len(kills),
        "kills_survived": sum(bool(k["survived"]) for k in kills),
        "by_moment": by_moment,
        "runs_completed": sum(r["completed"] for r in result["runs"]),
        "runs": len(result["runs"]),
    }


def print_report(summary: dict, servers: dict) -> None:
    print("\n| moment | kills survived / tried | landed inside the moment |")
    print("|---|---|---|")
    for moment, row in summary["by_moment"].items():
        print(f"| {moment} | {row['survived']} / {row['tried']} | {row['landed_inside']} |")
    print(f"| **all** | **{summary['kills_survived']} / {summary['kills_tried']}** | |")
    print(f"\nruns completed: {summary['runs_completed']} / {summary['runs']}")
    for name, outcome in servers.items():
        print(f"{name} killed mid-request: {outcome}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 kills of the smoke run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--kills", type=int, default=None, help="default 20 (3 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moments", default=",".join(MOMENTS), help=f"a subset of {','.join(MOMENTS)}"
    )
    parser.add_argument(
        "--per_run", type=int, default=None, help="kills per run (default: each moment once)"
    )
    parser.add_argument("--workdir", help="keep the runs here (default: a temp dir, removed)")
    parser.add_argument(
        "--adversarial", choices=("after", "only", "skip"), default="after",
        help="the adversarial round (benchmarks/adversarial.py): after the kills, alone, or not",
    )  # fmt: skip
    args = parser.parse_args()
    import jax
    from adversarial import adversarial_round  # benchmarks/, beside this script
    from adversarial import print_report as print_adversarial

    jax.config.update("jax_num_cpu_devices", 8)  # checkpoints are restored as saved
    scenario = QUICK if args.quick else FULL
    kills = args.kills if args.kills is not None else (3 if args.quick else 20)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gyrejax-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        only = tuple(m for m in args.moments.split(",") if m)
        if set(only) - set(MOMENTS):
            parser.error(f"--moments: unknown {sorted(set(only) - set(MOMENTS))}")
        result, servers, adversarial = {"kills": [], "runs": []}, {}, None
        if args.adversarial != "only":
            result = chaos(
                root, scenario, kills, args.seed, log=lambda m: print(m, flush=True),
                only=only, per_run=args.per_run,
            )  # fmt: skip
            servers = {"engine server": engine_server_kill(root, args.quick)}
            if not args.quick:
                servers["vLLM server"] = vllm_server_kill(root)
        if args.adversarial != "skip":
            adversarial = adversarial_round(root, ENGINE_TOKEN, log=lambda m: print(m, flush=True))
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(result)
    if args.adversarial != "only":
        print_report(summary, servers)
    if adversarial is not None:
        print_adversarial(adversarial)
    print(f"\n{time.monotonic() - start:.0f} s in all")
    if args.json:
        everything = {"summary": summary, "servers": servers, "adversarial": adversarial}
        Path(args.json).write_text(json.dumps(everything | result, indent=2))


if __name__ == "__main__":
    main()
