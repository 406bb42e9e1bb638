"""The RL runtime: harness, proxy, engines, trajectory processor and trainer, with cells
moved between rollout and training by a policy (gyrejax.scheduler.policies).

One asyncio loop drives everything. After every event (an execution or group finished, a
step finished, a transition finished) the policy sees a `View` and returns a `Decision`;
the runtime carries it out and applies the driver rules of policies.py:

  * dispatch: each new group g<seq> takes a task from the environment and runs
    `rl.group_size` executions through the harness; each execution is stored as soon as
    it ends (`workdir/executions`); a group whose executions all ended is ready;
  * a training step starts when the core cell is TRAINING, no step runs and
    `rl.groups_per_step` groups are ready; with `scheduler.max_staleness` S it takes the
    oldest rollout versions first and waits for a running older group rather than train
    anything more than S versions stale (`policies.step_groups`); it runs in a worker
    thread;
  * transitions run one at a time. rollout -> training: the proxy drains the cell's
    engine (in-flight requests migrate with their KV cache), its memory is freed, and the
    cell joins the trainer (mid-step if one runs). training -> rollout: at the step
    boundary the cell leaves the trainer; once the step (and its update, which donates
    the weights) has ended, its engine gets its memory back, pulls the newest weights
    (no step starts during the copy) and accepts requests again. Every phase is timed and logged
    (`workdir/transitions.jsonl`);
  * after every `scheduler.mu` steps the weights are published to the rollout engines
    and a new burst begins.

Outputs: `metrics.jsonl` (per step: reward, loss, tokens, staleness, step time, roles,
utilisation), `transitions.jsonl`, checkpoints, the execution store, `dispatch.jsonl`, and
PNG plots (cell-role timeline, reward and step time per step). Killing the process and
starting the same command again continues from the last checkpoint with every stored
execution: groups trained after that checkpoint are trained again (their updates were
lost with the process), finished executions are never re-run, unfinished ones are.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import Config, ConfigError
from gyrejax.harness.agent import Harness
from gyrejax.harness.chat import load_chat
from gyrejax.harness.envs import get_environment
from gyrejax.harness.sandbox import sandbox_summary
from gyrejax.harness.tasks import draw_tasks
from gyrejax.logs import append_jsonl, mark, prepare_for_append, read_jsonl, up_to_step
from gyrejax.model.hf_io import export_hf
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.engine import Engine
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.types import EngineError
from gyrejax.scheduler import plots
from gyrejax.scheduler.policies import (
    IDLE_CAUSES,
    CellView,
    Role,
    View,
    gate_allowance,
    make_policy,
    step_groups,
)
from gyrejax.serve.http_engine import HttpEngine
from gyrejax.serve.vllm_server_engine import VllmServerEngine
from gyrejax.train.checkpoint import TrainCheckpointer
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.trajectory import Execution, ExecutionStore, process


@dataclasses.dataclass
class _Group:
    """One dispatched group and what became of it."""

    group_id: str
    seq: int
    task: object
    version: int  # rollout weights when dispatched
    burst: int
    executions: dict[str, Execution] = dataclasses.field(default_factory=dict)
    done: bool = False


class PublishedWeights:
    """HF exports of the policy for engines reached by URL, `directory/version_<v>`: read
    by the engines' hosts (shared storage), written once per version by this run.

    An export an earlier run of the same workdir left is never reused: a run resumed
    from an older checkpoint trains the later versions again, so their old exports hold
    other weights.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self._written: set[int] = set()
        self._lock = asyncio.Lock()

    async def path(self, version: int, model: Callable[[], Transformer]) -> Path:
        """The export of `version` (`model()` builds it; called only when not written)."""
        path = self.directory / f"version_{version}"
        async with self._lock:
            if version not in self._written:
                shutil.rmtree(path, ignore_errors=True)  # an earlier run's, or a partial one
                await asyncio.get_running_loop().run_in_executor(None, export_hf, model(), path)
                self._written.add(version)
                # Keep this version and the one before (an engine may still be loading it).
                for old in self.directory.glob("version_*"):
                    if old.name not in (path.name, f"version_{version - 1}"):
                        shutil.rmtree(old, ignore_errors=True)
        return path


class Runtime:
    """Runs `config.train.steps` RL steps with the configured scheduling policy.

    Args:
      config: the whole run configuration.
      cells: every cell, in order (cell 0 is the core).
      model: the starting policy (e.g. after the warm start).
      workdir: where everything is written (see the module docstring).
    """

    def __init__(self, config: Config, cells: list[Cell], model: Transformer, workdir: Path):
        self.config = config
        self.cells = cells
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = get_environment(config.harness.environment, sandbox=config.harness.sandbox)
        self.trainer = self._make_trainer(model)
        self.checkpointer = TrainCheckpointer(self.workdir / "checkpoints", config.checkpoint)
        self.store = ExecutionStore(self.workdir / "executions")
        policy_kwargs = {}
        if config.scheduler.policy == "async":
            policy_kwargs["training_cells"] = config.scheduler.async_training_cells
        self.policy = make_policy(config.scheduler.policy, **policy_kwargs)
        self.roles = [Role.ROLLOUT] * len(cells)
        self.switching = [False] * len(cells)
        self.engines: dict[int, Engine] = {}  # one per cell
        self.external: list[Engine] = []  # config.rollout.vllm_servers, engine_servers
        self.proxy: Proxy | None = None
        self.published = PublishedWeights(self.workdir / "published")
        self.groups: dict[str, _Group] = {}
        self.ready: collections.deque[str] = collections.deque()
        self.trained_groups: list[str] = []
        self.bad_records = 0  # stored records skipped since the last metrics row
        self.next_seq = 0
        self.burst = 0
        self.steps_in_burst = 0
        self.burst_base = (0, 0, 0)  # proxy counters (d, p, f) when the burst began
        self.rollout_version = 0
        self.step_task: asyncio.Future | None = None
        self._weight_pulls = 0  # engines copying the trainer's weights right now
        self.timeline: list[tuple[float, int, str]] = []
        self.busy_samples: list[float] = []
        # Cell-seconds by state ("busy" and the simulator's IDLE_CAUSES), sampled by
        # `_monitor`, for the run and since the last step.
        self.cell_time = dict.fromkeys(("busy", *IDLE_CAUSES), 0.0)
        self._cell_time_at_step = dict(self.cell_time)
        self._phase: dict[int, str] = {}  # cell -> "queued" | "wait_boundary" | "switch"
        self._gate_closed = False  # the gate allowed no more dispatch at the last decision
        self.over_stale = 0  # groups trained more than max_staleness versions late
        self._transitions: asyncio.Queue = asyncio.Queue()
        self._changed: asyncio.Event | None = None
        self._start = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None

    # --- the run ------------------------------------------------------------------------

    def run(self) -> dict:
        return asyncio.run(self._run())

    async def _run(self) -> dict:
        self._changed = asyncio.Event()
        self._start = time.monotonic()
        self._restore()
        try:  # engines started so far are shut down even if a later one fails to start
            await self._start_engines()
            await self._connect_external_engines()
            self.proxy = Proxy([*self.engines.values(), *self.external])
            self.harness = Harness(
                self.proxy,
                self.config.harness,
                self.workdir / "workspaces",
                temperature=self.config.rollout.temperature,
                environment=self.env,
                chat=load_chat(self.config.model.tokenizer),
            )
            for cell in self.cells:
                self.timeline.append((0.0, cell.index, Role.ROLLOUT.value))
            self._spawn(self._transition_worker())
            self._spawn(self._monitor())
            self._resume_unfinished_groups()
            while self.trainer.step < self.config.train.steps:
                view = self._view()
                decision = self.policy(view)
                gate = gate_allowance(view)
                self._gate_closed = gate is not None and gate <= decision.dispatch
                for _ in range(decision.dispatch):
                    self._dispatch_group()
                for index, role in decision.transitions:
                    self._request_transition(index, role)
                self._maybe_start_step()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                self._changed.clear()
            if self.step_task is not None:
                await self.step_task
        finally:
            await self._shutdown()
        return self._finish()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._surface_errors)
        return task

    def _surface_errors(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logging.error("runtime task failed: %r", task.exception())
            self._failure = task.exception()
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _now(self) -> float:
        return time.monotonic() - self._start

    # --- view -----------------------------------------------------------------------------

    def _view(self) -> View:
        if self._failure is not None:
            raise RuntimeError("a runtime task failed") from self._failure
        counters = self.proxy.counters()
        d0, p0, f0 = self.burst_base
        in_flight_groups = sum(1 for g in self.groups.values() if not g.done)
        executions_in_flight = counters.dispatched - counters.finished
        capacity = self.config.rollout.max_slots
        total = self.config.train.steps * self.config.rl.groups_per_step
        dispatched_groups = self.next_seq
        return View(
            now=self._now(),
            cells=tuple(
                CellView(c.index, self.roles[c.index], self.switching[c.index], capacity)
                for c in self.cells
            ),
            group_size=self.config.rl.group_size,
            groups_per_step=self.config.rl.groups_per_step,
            steps_per_burst=self.config.scheduler.mu,
            lookahead_bursts=self.config.scheduler.phi,
            burst=self.burst,
            dispatched=counters.dispatched - d0,
            started=counters.started - p0,
            finished=counters.finished - f0,
            executions_in_flight=executions_in_flight,
            groups_in_flight=in_flight_groups,
            groups_ready=len(self.ready),
            steps_in_burst=self.steps_in_burst,
            step_running=self.step_task is not None,
            groups_remaining=max(0, total - dispatched_groups),
            max_staleness=self.config.scheduler.max_staleness,
        )

    # --- hooks (gyrejax.distributed.rl overrides them for a multi-process run) ---------------

    def _make_trainer(self, model: Transformer) -> ElasticTrainer:
        return ElasticTrainer(model, self.cells[0], rl=self.config.rl, train=self.config.train)

    async def _start_engines(self) -> None:
        for cell in self.cells:
            self.engines[cell.index] = self._new_engine(cell)
        self._spawn(self._precompile_training())

    async def _precompile_training(self) -> None:
        """Compiles every cell's micro-step once the engines compiled what they first
        needed (not to slow the first rollouts), so that a cell's first join does not
        compile inside a step."""
        await asyncio.gather(*(e.precompiled() for e in self.engines.values()))
        for cell in self.cells:
            await asyncio.to_thread(self.trainer.precompile, cell)

    async def _weights_for(self, engine: Engine):
        """What `engine.update_weights` gets for the trainer's current weights (called
        only while no step runs: a step's update donates the weights' buffers): the
        arrays for an engine in this process, the path of an HF export of them for an
        engine reached by URL (`workdir/published`)."""
        if not isinstance(engine, HttpEngine):
            return self.trainer.params
        return str(await self.published.path(self.trainer.version, self.trainer.model))

    async def _connect_external_engines(self) -> None:
        """Engines outside the cells (always rolling out); each gets the current
        weights first, whatever the server started with."""
        r = self.config.rollout
        servers = [("vllm_servers", i, url) for i, url in enumerate(r.vllm_servers)]
        servers += [("engine_servers", i, url) for i, url in enumerate(r.engine_servers)]
        for field, i, url in servers:
            try:
                if field == "vllm_servers":
                    engine = await VllmServerEngine.connect(url, name=f"vllm{i}")
                else:
                    engine = await HttpEngine.connect(url)
                self.external.append(engine)  # shut down with the others from here on
                names = [e.name for e in [*self.engines.values(), *self.external]]
                if names.count(engine.name) > 1:  # records and routing go by name
                    raise ValueError(
                        f"its engine is named {engine.name!r} like another engine of this "
                        "run; give each server its own name (engine_server --name)"
                    )
                await engine.update_weights(await self._weights_for(engine), self.trainer.version)
            except (EngineError, ValueError) as e:  # unreachable, or not usable as set up
                raise ConfigError(f"config.rollout.{field}[{i}]={url!r}: {e}") from e
            logging.info("external engine %s at %s", engine.name, url)

    # --- rollout ---------------------------------------------------------------------------

    def _new_engine(self, cell: Cell) -> JaxEngine:
        r = self.config.rollout
        return JaxEngine(
            f"cell{cell.index}",
            self.trainer.model(),
            cell,
            max_slots=r.max_slots,
            max_seq_len=r.max_seq_len,
            rules=r.sharding_rules,
            version=self.trainer.version,
            precompile=True,  # no role switch waits for a compile
        )

    def _dispatch_group(self) -> None:
        seq = self.next_seq
        self.next_seq += 1
        group = self._make_group(seq, self.rollout_version)
        append_jsonl(self.workdir / "dispatch.jsonl", {
            "group": group.group_id, "seq": seq, "task": group.task.task_id,
            "version": group.version, "time": self._now()})  # fmt: skip
        self._spawn(self._run_group(group, range(self.config.rl.group_size)))

    def _make_group(self, seq: int, version: int) -> _Group:
        (task,) = draw_tasks(self.env, self.config.harness, 1, seed=seq, run_seed=self.config.seed)
        group = _Group(f"g{seq}", seq, task, version, self.burst)
        self.groups[group.group_id] = group
        return group

    async def _run_group(self, group: _Group, members) -> None:
        async def one(i: int) -> None:
            execution_id = f"{group.group_id}/{i}"
            seed = group.seq * 1000 + i
            started = self._now()
            execution = await self.harness.run_execution(
                group.task, execution_id, group.group_id, seed
            )
            self.store.put(execution, overwrite=True)  # persisted as soon as it ends
            group.executions[execution_id] = execution
            record = {"execution": execution_id, "group": group.group_id, "started_s": started}
            record.update(finished_s=self._now(), status=execution.status)
            append_jsonl(self.workdir / "executions.jsonl", record)  # for calibration
            self._notify()

        await asyncio.gather(*(one(i) for i in members))
        group.done = True
        self.ready.append(group.group_id)
        self._notify()

    # --- training ---------------------------------------------------------------------------

    def _maybe_start_step(self) -> None:
        core = self.cells[0].index
        if (
            self.step_task is not None
            or self._weight_pulls  # an engine is copying the weights a step would donate
            or self.roles[core] is not Role.TRAINING
            or self.switching[core]
        ):
            return
        ready = list(self.ready)
        chosen = step_groups(
            [self.groups[g].version for g in ready],
            [g.version for g in self.groups.values() if not g.done],
            self.trainer.version,
            self.config.rl.groups_per_step,
            self.config.scheduler.max_staleness,
        )
        if chosen is None:  # too few groups, or waiting for an older one (staleness)
            return
        group_ids = [ready[i] for i in chosen]
        for g in group_ids:
            self.ready.remove(g)
        gate = self.config.scheduler.max_staleness
        stale = {g: self.trainer.version - self.groups[g].version for g in group_ids}
        late = [g for g, s in stale.items() if gate is not None and s > gate]
        if late:  # never silent: step_groups only does this when nothing better exists
            self.over_stale += len(late)
            logging.warning("groups %s are trained more than %d versions late", late, gate)
        self.step_task = self._spawn(self._train_step(group_ids))

    async def _train_step(self, group_ids: list[str]) -> None:
        config = self.config
        executions = [e for g in group_ids for e in self.groups[g].executions.values()]
        batch = process(
            executions,
            row_length=config.train.row_length,
            j_max=config.rl.j_max,
            seed=config.seed + self.trainer.step,
            advantage=config.rl.advantage,
            rows_per_micro_step=config.train.rows_per_micro_step,
            vocab_size=config.model.vocab_size,
        )
        loop = asyncio.get_running_loop()
        try:
            if batch.num_micro_steps == 0:
                logging.warning("groups %s have nothing to train; skipped", group_ids)
                self.trained_groups += group_ids
                return
            mark("step")  # for benchmarks/chaos.py; "step done" comes with its metrics row
            report = await loop.run_in_executor(None, self.trainer.train_step, batch)
            self.trained_groups += group_ids
            self.steps_in_burst += 1
            self._record_step(report, batch, group_ids)
            if self.trainer.step % config.checkpoint.every_steps == 0:
                await loop.run_in_executor(None, self._save)
            if self.steps_in_burst >= config.scheduler.mu:
                await self._publish()
        finally:
            self.step_task = None
            self._notify()

    async def _publish(self) -> None:
        """Ends a burst: the rollout engines get the newest weights. An external engine
        that fails its update is dropped like one that crashed; the run goes on."""
        mark("publish")  # for benchmarks/chaos.py, like "transition" below
        start = time.perf_counter()
        version = self.trainer.version
        live = [
            e for i, e in self.engines.items()
            if self.roles[i] is Role.ROLLOUT and not self.switching[i]
        ] + [e for e in self.external if not self.proxy.failed(e.name)]  # fmt: skip
        weights = [await self._weights_for(e) for e in live]
        updates = [e.update_weights(w, version) for e, w in zip(live, weights, strict=True)]
        results = await asyncio.gather(*updates, return_exceptions=True)
        failed = []
        for engine, result in zip(live, results, strict=True):
            if not isinstance(result, BaseException):
                continue
            if engine in self.external and isinstance(result, EngineError):
                self.proxy.mark_failed(engine.name, f"weight update failed: {result}")
                failed.append(engine.name)
            else:  # a cell's engine: the run cannot go on without it
                raise result
        self.rollout_version = version
        self.burst += 1
        self.steps_in_burst = 0
        c = self.proxy.counters()
        self.burst_base = (c.dispatched, c.started, c.finished)
        phases = {"publish_s": time.perf_counter() - start, "version": version}
        phases.update(engines=len(live) - len(failed), failed=failed)
        self._log_transition(None, "publish", phases)

    def _record_step(self, report, batch, group_ids: list[str]) -> None:
        rewards = [
            e.reward
            for g in group_ids
            for e in self.groups[g].executions.values()
            if e.reward is not None
        ]
        recent = self.busy_samples[-40:]
        record = {
            "step": report.step,
            "version": report.version,
            "time_s": self._now(),
            "policy": self.config.scheduler.policy,
            "reward": float(np.mean(rewards)) if rewards else None,
            "groups": group_ids,
            **report.metrics,
            "skipped": report.skipped,
            "cells": list(report.cells),
            "step_s": report.step_s,
            "rows": int(batch.tokens.shape[0]),
            "roles": "".join(r.value[0].upper() for r in self.roles),
            "utilisation": float(np.mean(recent)) if recent else None,
            "joins": [dataclasses.asdict(j) for j in report.joins],
            "leaves": [dataclasses.asdict(r) for r in report.released],
            "cell_s": {k: v - self._cell_time_at_step[k] for k, v in self.cell_time.items()},
            "over_stale": self.over_stale,
            "bad_records": self.bad_records,
        }
        self._cell_time_at_step = dict(self.cell_time)
        self.bad_records = 0
        append_jsonl(self.workdir / "metrics.jsonl", record)
        mark("step done")
        logging.info(
            "step %d: reward %.3f loss %.4f tokens %d staleness %.1f cells %s roles %s (%.1f s)",
            report.step, record["reward"] or 0.0, report.metrics.get("loss", float("nan")),
            int(report.metrics.get("tokens", 0)), report.metrics.get("staleness_mean", 0.0),
            list(report.cells), record["roles"], report.step_s,
        )  # fmt: skip

    # --- transitions ------------------------------------------------------------------------

    def _request_transition(self, index: int, role: Role) -> None:
        if self.switching[index] or self.roles[index] is role:
            return
        self.switching[index] = True
        self.roles[index] = role  # the View shows the target role while switching
        self._phase[index] = "queued"
        cell = self.cells[index]
        if role is Role.ROLLOUT and not cell.is_core:
            # Released now, not when the (serial) worker reaches it: a cell queued to return
            # must not start a new step and hold its switch for a whole step.
            self.trainer.release(cell)
        self._transitions.put_nowait((index, role, self.burst))  # the burst that decided it

    async def _transition_worker(self) -> None:
        while True:
            index, role, burst = await self._transitions.get()
            mark("transition")  # for benchmarks/chaos.py; "... done" with its log record
            start = time.perf_counter()
            cell = self.cells[index]
            self.timeline.append((self._now(), index, "switching"))
            self._phase[index] = "switch" if role is Role.TRAINING else "wait_boundary"
            if role is Role.TRAINING:
                phases = await self._to_training(cell)
            else:
                phases = await self._to_rollout(cell)
            self.switching[index] = False
            self._phase.pop(index, None)
            self.timeline.append((self._now(), index, role.value))
            phases["total_s"] = time.perf_counter() - start
            self._log_transition(index, f"to_{role.value}", phases, burst)
            self._notify()

    async def _to_training(self, cell: Cell) -> dict:
        engine = self.engines[cell.index]
        t0 = time.perf_counter()
        report = await self.proxy.drain(engine.name)
        t1 = time.perf_counter()
        await engine.release_memory()
        t2 = time.perf_counter()
        if not cell.is_core:  # off the loop: a join may write a weights snapshot
            await asyncio.get_running_loop().run_in_executor(None, self.trainer.join, cell)
        return {"drain_s": t1 - t0, "migrated": report.migrated, "kv_copies": report.kv_copies,
                "resubmits": report.resubmits, "free_s": t2 - t1}  # fmt: skip

    async def _to_rollout(self, cell: Cell) -> dict:
        # Released when requested (`_request_transition`); it leaves at the step boundary.
        t0 = time.perf_counter()
        # Wait for the step to end, update included: the update donates the weights'
        # buffers, so they are copied only while no step runs (and none may start).
        while self.step_task is not None:
            await asyncio.sleep(0.01)
        self._phase[cell.index] = "switch"
        t1 = time.perf_counter()
        engine = self.engines[cell.index]
        self._weight_pulls += 1
        try:
            await engine.resume()
            await engine.update_weights(await self._weights_for(engine), self.trainer.version)
        finally:
            self._weight_pulls -= 1
            self._notify()
        t2 = time.perf_counter()
        self.proxy.set_accepting(engine.name, True)
        return {"wait_boundary_s": t1 - t0, "weight_pull_s": t2 - t1}

    def _log_transition(
        self, index: int | None, kind: str, phases: dict, burst: int | None = None
    ) -> None:
        burst = self.burst if burst is None else burst
        record = {"time_s": self._now(), "cell": index, "kind": kind, "burst": burst, **phases}
        append_jsonl(self.workdir / "transitions.jsonl", record)
        mark("publish done" if kind == "publish" else "transition done")
        logging.info("transition %s cell %s: %s", kind, index, phases)

    # --- monitoring, checkpoints, resume -----------------------------------------------------

    async def _monitor(self) -> None:
        """Samples what every cell does (busy, or idle by cause) and prints a progress line
        now and then."""
        last_print = 0.0
        interval = 0.25
        while True:
            await asyncio.sleep(interval)
            in_flight = self.proxy.counters().in_flight
            states = [self._cell_state(c, in_flight) for c in self.cells]
            for state in states:
                self.cell_time[state] += interval
            self.busy_samples.append(states.count("busy") / len(states))
            if self._now() - last_print >= self.config.scheduler.progress_every_s:
                last_print = self._now()
                roles = "".join(
                    "s" if self.switching[i] else self.roles[i].value[0].upper()
                    for i in range(len(self.cells))
                )
                logging.info(
                    "progress: step %d/%d, burst %d, roles %s, %d groups ready, %d executions "
                    "running", self.trainer.step, self.config.train.steps, self.burst, roles,
                    len(self.ready), sum(in_flight.values()),
                )  # fmt: skip

    def _cell_state(self, cell: Cell, in_flight: dict[str, int]) -> str:
        """ "busy" or the idle cause (the simulator's IDLE_CAUSES) of one cell right now.

        A rollout cell is busy while its engine holds a request; a training cell while a
        step runs with it in the trainer (a cell released for rollout trains on until the
        step's end). Idle time after the run's last dispatch is the straggler tail.
        """
        index = cell.index
        step_running = self.step_task is not None
        in_step = step_running and any(c.index == index for c in self.trainer.training)
        phase = self._phase.get(index)
        if phase == "switch":
            return "switching"
        if phase in ("queued", "wait_boundary") and self.roles[index] is Role.ROLLOUT:
            # Leaving training: busy while in the running step, else waiting for the switch.
            return "busy" if in_step else "boundary_wait"
        serving = self.roles[index] is Role.ROLLOUT or phase == "queued"
        if serving:
            if in_flight.get(f"cell{index}", 0) > 0:
                return "busy"
        elif in_step:
            return "busy"
        total = self.config.train.steps * self.config.rl.groups_per_step
        if self.next_seq >= total:
            return "tail"
        if not serving:
            return "train_wait"
        return "gate" if self._gate_closed else "other"

    def _save(self) -> None:
        self.trainer.save(
            self.checkpointer,
            {"trained_groups": self.trained_groups, "next_seq": self.next_seq,
             "burst": self.burst, "seed": self.config.seed},
        )  # fmt: skip

    def _restore(self) -> None:
        """Resumes from the newest readable checkpoint, if any, and readies the logs for
        appending: a torn last line (a kill mid-write) is cut away, and metric rows of
        steps past the checkpoint are dropped, since those steps are trained again."""
        if self.checkpointer.latest_step() is not None:
            meta = self.trainer.restore(self.checkpointer)
            self.trained_groups = list(meta["trained_groups"])
            self.burst = int(meta["burst"])
            self.rollout_version = self.trainer.version
            logging.info("resumed from step %d (%d groups trained)", self.trainer.step,
                         len(self.trained_groups))  # fmt: skip
        prepare_for_append(self.workdir / "metrics.jsonl", keep=up_to_step(self.trainer.step))
        prepare_for_append(self.workdir / "transitions.jsonl")
        prepare_for_append(self.workdir / "executions.jsonl")

    def _resume_unfinished_groups(self) -> None:
        """Groups dispatched before a restart: finished ones are ready again (unless
        trained before the checkpoint), missing executions run again."""
        trained = set(self.trained_groups)
        # A torn last entry is cut away: its group had not started (the entry is
        # written before the group runs), so its seq is simply dispatched again.
        entries = [
            e for e in prepare_for_append(self.workdir / "dispatch.jsonl")
            if isinstance(e.get("group"), str) and isinstance(e.get("seq"), int)
            and isinstance(e.get("version"), int)
        ]  # fmt: skip
        if not entries:
            return
        self.next_seq = max(e["seq"] for e in entries) + 1
        skipped: list[str] = []  # bad stored records: skipped (named), counted, re-run
        for entry in entries:
            if entry["group"] in trained:
                continue
            group = self._make_group(entry["seq"], entry["version"])
            for execution in self.store.groups([group.group_id], skipped=skipped)[group.group_id]:
                group.executions[execution.execution_id] = execution
            missing = [i for i in range(self.config.rl.group_size)
                       if f"{group.group_id}/{i}" not in group.executions]  # fmt: skip
            if missing:
                self._spawn(self._run_group(group, missing))
            else:
                group.done = True
                self.ready.append(group.group_id)
        self.bad_records += len(skipped)
        logging.info("resume: %d groups ready, %d re-running, %d bad records skipped",
                     len(self.ready), sum(not g.done for g in self.groups.values()),
                     len(skipped))  # fmt: skip

    async def _shutdown(self) -> None:
        for group in self.groups.values():
            if not group.done and self.proxy is not None:  # request ids: "<group id>/..."
                self.proxy.cancel_execution(group.group_id)
        for task in list(self._tasks):
            if task is not self.step_task:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in [*self.engines.values(), *self.external]:
            await engine.shutdown()
        if self.trainer.step and self.checkpointer.latest_step() != self.trainer.step:
            self._save()
        self.checkpointer.close()

    def _finish(self) -> dict:
        records = read_jsonl(self.workdir / "metrics.jsonl")
        transitions = read_jsonl(self.workdir / "transitions.jsonl")
        plots.write_all(self.workdir, records, self.timeline, len(self.cells), self._now())
        rewards = [r["reward"] for r in records if r.get("reward") is not None]
        k = max(1, len(rewards) // 4)
        summary = {
            "policy": self.config.scheduler.policy,
            "steps": self.trainer.step,
            "wall_s": self._now(),
            "reward_first": float(np.mean(rewards[:k])) if rewards else None,
            "reward_last": float(np.mean(rewards[-k:])) if rewards else None,
            # Step rewards are noisy (a few groups each): means over tenths of the run.
            "reward_by_tenth": [
                float(np.mean(part)) for part in np.array_split(rewards, 10) if len(part)
            ],
            "utilisation": float(np.mean(self.busy_samples)) if self.busy_samples else None,
            "transitions": collections.Counter(t["kind"] for t in transitions),
            # Cell-seconds busy and idle by cause (sampled every 0.25 s): they sum to
            # cells x the sampled time, and their idle share is 1 - utilisation.
            "cell_s": dict(self.cell_time),
            "over_stale": self.over_stale,
            "schedule": _schedule_fields(self.config, len(self.cells)),
            # Which sandbox ran agent code; without bubblewrap it says it is no boundary.
            "sandbox": sandbox_summary(self.config.harness.sandbox),
        }
        (self.workdir / "run_summary.json").write_text(json.dumps(summary, indent=2))
        logging.info("run finished: %s", summary)
        return summary


def _schedule_fields(config: Config, cells: int) -> dict:
    """The run's schedule as the simulator names it (gyrejax.scheduler.calibrate)."""
    sched = config.scheduler
    return {
        "policy": sched.policy,
        "cells": cells,
        "capacity": config.rollout.max_slots,
        "group_size": config.rl.group_size,
        "groups_per_step": config.rl.groups_per_step,
        "steps": config.train.steps,
        "mu": sched.mu,
        "phi": sched.phi,
        "max_staleness": sched.max_staleness,
        "async_training_cells": sched.async_training_cells,
        "timeout_s": config.harness.timeout_s,
    }
