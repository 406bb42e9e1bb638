"""What the RL loop writes: a metrics row per step, a line per transition, where every
cell-second went, and the run's summary.

  * `metrics.jsonl`: per step reward, loss, tokens, staleness, step time, roles,
    utilisation, joins and leaves, cell-seconds by state since the last row, groups
    trained beyond the gate (`over_stale`), bad records left out, and the figures of
    a held-out evaluation finished since the last row (`eval`; else None);
  * `transitions.jsonl`: every role switch, phase by phase, with the device memory in
    use on the cell's devices around it (`device_memory`), and every publication;
  * cell time: a 0.25 s sampler attributes every cell-second to "busy" or one idle cause
    (`policies.IDLE_CAUSES`, as the simulator does exactly), and prints progress;
  * `run_summary.json` (`calibrate.py` fits its `schedule`; `eval`: the last held-out
    evaluation's figures, from `eval.jsonl`) and the PNG plots.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import json
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import Config
from gyrejax.harness.agent_sandbox import agent_sandbox_summary
from gyrejax.harness.sandbox import sandbox_summary
from gyrejax.harness.workspace_quota import quota_summary
from gyrejax.logs import mark, read_jsonl
from gyrejax.loop.context import RunContext
from gyrejax.loop.evaluation import EVAL_LOG, record_figures
from gyrejax.progress import Progress
from gyrejax.scheduler import plots
from gyrejax.scheduler.driver import logged_trainer_time
from gyrejax.scheduler.policies import IDLE_CAUSES, Role
from gyrejax.train.trainer import StepReport
from gyrejax.trajectory import PackedBatch

SAMPLE_S = 0.25  # the cell-time sampler's period


def device_memory(devices: Sequence[jax.Device]) -> tuple[str, list[int | None]]:
    """Bytes in use on each of `devices`, and where the figure comes from:
    "memory_stats" (the allocator's `bytes_in_use`, where the backend reports it: GPU,
    TPU), else "live_arrays" (the buffers of this process's live JAX arrays on each
    device, each counted once: a shard's own array shares its parent's buffer; CPU
    reports no memory stats), or "other_process" (Nones: devices another process of a
    multi-process run holds). None sees another program's memory (vLLM's)."""
    if any(d.process_index != jax.process_index() for d in devices):
        return "other_process", [None] * len(devices)
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_in_use" in s for s in stats):
        return "memory_stats", [int(s["bytes_in_use"]) for s in stats]
    # Arrays only uncollected garbage holds (reference cycles) hold nothing a switch can
    # use: collected first, so the figure does not depend on when Python's collector ran.
    gc.collect()
    live, views, shards = jax.live_arrays(), set(), []
    for array in live:
        try:  # a running step may donate (delete) an array meanwhile: it holds nothing
            if array.is_deleted():
                continue
            held = [(s.device, s.data) for s in array.addressable_shards]
        except (RuntimeError, TypeError):  # deleted between the check and the read: jax
            continue  # raises RuntimeError, or TypeError once its buffer list is gone
        views.update(id(data) for _, data in held if data is not array)
        shards.append((array, held))
    used = dict.fromkeys(devices, 0)
    for array, held in shards:
        if id(array) in views:  # a shard's own array (cached on its parent): counted there
            continue
        for device, data in held:
            if device in used:
                used[device] += data.nbytes
    return "live_arrays", [used[d] for d in devices]


def log_transition(
    ctx: RunContext, index: int | None, kind: str, phases: dict, burst: int | None = None
) -> None:
    """Appends a transition (or a publication: `index` None) to `transitions.jsonl`."""
    burst = ctx.driver.burst if burst is None else burst
    record = {"time_s": ctx.now(), "cell": index, "kind": kind, "burst": burst, **phases}
    ctx.transitions_logged += 1
    ctx.log("transitions", record, step=ctx.transitions_logged)
    mark("publish done" if kind == "publish" else "transition done")
    logging.info("transition %s cell %s: %s", kind, index, phases)


class CellTime:
    """Cell-seconds by state ("busy" and `IDLE_CAUSES`), for the run and since the last
    step, sampled every `SAMPLE_S` seconds; their idle share is 1 - utilisation."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.cell_s = dict.fromkeys(("busy", *IDLE_CAUSES), 0.0)
        self._at_step = dict(self.cell_s)
        self.busy_samples: list[float] = []  # busy fraction of the cells, per sample

    def since_step(self) -> dict[str, float]:
        """Cell-seconds by state since the last call (a metrics row's `cell_s`)."""
        since = {k: v - self._at_step[k] for k, v in self.cell_s.items()}
        self._at_step = dict(self.cell_s)
        return since

    def recent_utilisation(self) -> float | None:
        recent = self.busy_samples[-40:]
        return float(np.mean(recent)) if recent else None

    async def monitor(self, proxy, groups) -> None:
        """Samples what every cell does and prints a progress line now and then."""
        ctx = self.ctx
        last_print = 0.0
        # Rate and ETA of the RL steps (logged in the progress line below; a bar on a
        # terminal); measured from the first step done, so its compile counts once.
        steps = Progress("RL steps", ctx.config.train.steps, "steps", every_s=float("inf"))
        last_step = ctx.trainer.step
        steps.update(last_step)
        while True:
            await asyncio.sleep(SAMPLE_S)
            in_flight = proxy.counters().in_flight
            tail = groups.next_seq >= ctx.driver.schedule.groups_total
            states = [self.state(c, in_flight, tail) for c in ctx.cells]
            for state in states:
                self.cell_s[state] += SAMPLE_S
            self.busy_samples.append(states.count("busy") / len(states))
            if ctx.trainer.step != last_step:
                last_step = ctx.trainer.step
                steps.update(last_step)
            if ctx.now() - last_print >= ctx.config.scheduler.progress_every_s:
                last_print = ctx.now()
                logging.info(
                    "progress: %s; burst %d, roles %s, %d groups ready, %d executions running",
                    steps.line(ctx.trainer.step),
                    ctx.driver.burst,
                    ctx.driver.roles_text(),
                    len(groups.ready),
                    sum(in_flight.values()),
                )

    def state(self, cell: Cell, in_flight: dict[str, int], tail: bool) -> str:
        """ "busy" or the idle cause (the simulator's IDLE_CAUSES) of one cell right now.

        A rollout cell is busy while its engine holds a request; a training cell while a
        step runs with it in the trainer (a cell released for rollout trains on until the
        step's end). Idle time after the run's last dispatch (`tail`) is the straggler
        tail.
        """
        ctx, index = self.ctx, cell.index
        roles = ctx.driver.roles
        step_running = ctx.step_task is not None
        in_step = step_running and any(c.index == index for c in ctx.trainer.training)
        phase = ctx.phase.get(index)
        if phase == "switch":
            return "switching"
        if phase in ("queued", "wait_boundary") and roles[index] is Role.ROLLOUT:
            # Leaving training: busy while in the running step, else waiting for the switch.
            return "busy" if in_step else "boundary_wait"
        serving = roles[index] is Role.ROLLOUT or phase == "queued"
        if serving:
            if in_flight.get(f"cell{index}", 0) > 0:
                return "busy"
        elif in_step:
            return "busy"
        if tail:
            return "tail"
        if not serving:
            return "train_wait"
        return "gate" if ctx.driver.gate_closed else "other"


def step_record(
    ctx: RunContext,
    report: StepReport,
    batch: PackedBatch,
    group_ids: list[str],
    rewards: list[float],
    cell_time: CellTime,
    *,
    over_stale: int,
    bad_records: int,
    longest_call: int,
    evaluation: dict | None = None,
    compiled: int = 0,
) -> dict:
    """Appends the metrics row of a step to `metrics.jsonl` and logs it; returns it.
    `longest_call`: the longest context (prompt + output) of a call the step trained;
    `evaluation`: a held-out evaluation's figures that finished since the last row."""
    record = {
        "step": report.step,
        "version": report.version,
        "time_s": ctx.now(),
        "policy": ctx.config.scheduler.policy,
        "reward": float(np.mean(rewards)) if rewards else None,
        "groups": group_ids,
        **report.metrics,
        "skipped": report.skipped,
        "cells": list(report.cells),
        "step_s": report.step_s,
        "rows": int(batch.tokens.shape[0]),
        # (rows, row length) of each distinct micro-step shape, longest rows first: which
        # row buckets the step used.
        "shapes": [[int(r), int(length)] for r, length in batch.shapes],
        "longest_call": longest_call,
        "greedy_tokens": batch.stats.greedy_tokens,  # greedy calls' outputs: never trained
        "roles": "".join(r.value[0].upper() for r in ctx.driver.roles),
        # Executions a rollout cell counts as serving (moves with scheduler.slot_occupancy).
        "capacity": ctx.driver.schedule.capacity,
        "utilisation": cell_time.recent_utilisation(),
        "joins": [dataclasses.asdict(j) for j in report.joins],
        "leaves": [dataclasses.asdict(r) for r in report.released],
        "cell_s": cell_time.since_step(),
        "over_stale": over_stale,
        "bad_records": bad_records,
        # Functions the step compiled (its step_s includes them; steps.png marks it).
        "compiled": compiled,
        "eval": evaluation,
    }
    ctx.log("metrics", record, step=record["step"])
    mark("step done")
    metrics = report.metrics
    logging.info(
        "step %d: reward %.3f loss %.4f tokens %d staleness %.1f cells %s roles %s (%.1f s)",
        report.step,
        record["reward"] or 0.0,
        metrics.get("loss", float("nan")),
        int(metrics.get("tokens", 0)),
        metrics.get("staleness_mean", 0.0),
        list(report.cells),
        record["roles"],
        report.step_s,
    )
    return record


def write_summary(
    ctx: RunContext,
    cell_time: CellTime,
    over_stale: int,
    resumed_at: int = 0,
    overcommitted: int | None = None,
) -> dict:
    """Writes `run_summary.json` and the plots; returns the summary. `resumed_at`: the
    step this process resumed from (earlier rows were timed by an earlier process);
    `overcommitted`: the cells elastic sent to training with executions left waiting for
    a slot (`scheduler.elastic_overcommit`) in this process; None for other policies."""
    config, workdir = ctx.config, ctx.workdir
    records = read_jsonl(workdir / "metrics.jsonl")
    transitions = read_jsonl(workdir / "transitions.jsonl")
    evaluations = read_jsonl(workdir / EVAL_LOG)
    plots.write_all(workdir, records, ctx.timeline, len(ctx.cells), ctx.now(), evaluations)
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    k = max(1, len(rewards) // 4)
    busy = cell_time.busy_samples
    wall_s = ctx.now()
    summary = {
        "policy": config.scheduler.policy,
        "steps": ctx.trainer.step,
        "wall_s": wall_s,
        "reward_first": float(np.mean(rewards[:k])) if rewards else None,
        "reward_last": float(np.mean(rewards[-k:])) if rewards else None,
        # Step rewards are noisy (a few groups each): means over tenths of the run.
        "reward_by_tenth": [
            float(np.mean(part)) for part in np.array_split(rewards, 10) if len(part)
        ],
        "utilisation": float(np.mean(busy)) if busy else None,
        "transitions": collections.Counter(t["kind"] for t in transitions),
        # Cell-seconds busy and idle by cause (sampled every 0.25 s): they sum to
        # cells x the sampled time, and their idle share is 1 - utilisation.
        "cell_s": dict(cell_time.cell_s),
        # The wall time from the trainer's side: before its first step, in steps (the
        # trainer's step_s), between steps (packing, checkpoints, publication and waiting
        # for data), after the last; they sum to wall_s.
        "trainer_s": logged_trainer_time(records, wall_s, after_step=resumed_at),
        "over_stale": over_stale,
        "overcommitted_leaves": overcommitted,
        "schedule": schedule_fields(config, len(ctx.cells)),
        # Which sandbox ran agent code; without bubblewrap it says it is no boundary.
        "sandbox": sandbox_summary(config.harness.sandbox),
        # Each workspace's bytes and inodes, and whether they are enforced (root: tmpfs).
        "workspace_quota": quota_summary(
            config.harness.workspace_bytes, config.harness.workspace_inodes
        ),
        # How the agent command was confined (rl.agent=command only).
        "agent_sandbox": (
            agent_sandbox_summary(config.harness) if config.rl.agent == "command" else None
        ),
        # The last held-out evaluation (eval.jsonl has each): step, version, figures.
        "eval": record_figures(evaluations[-1]) if evaluations else None,
        "evaluations": len(evaluations),
    }
    (workdir / "run_summary.json").write_text(json.dumps(summary, indent=2))
    logging.info("run finished: %s", summary)
    return summary


def schedule_fields(config: Config, cells: int) -> dict:
    """The run's schedule as the simulator names it (gyrejax.scheduler.calibrate)."""
    sched = config.scheduler
    return {
        "policy": sched.policy,
        "cells": cells,
        "capacity": config.cell_capacity,
        "group_size": config.rl.group_size,
        "groups_per_step": config.rl.groups_per_step,
        "steps": config.train.steps,
        "mu": sched.mu,
        "phi": sched.phi,
        "max_staleness": sched.max_staleness,
        "async_training_cells": sched.async_training_cells,
        "lookahead": sched.lookahead,
        "elastic_overcommit": sched.elastic_overcommit,
        "slot_occupancy": sched.slot_occupancy,
        "dispatch_order": sched.dispatch_order,
        "timeout_s": config.harness.timeout_s,
    }
