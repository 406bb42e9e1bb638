"""Dispatch: groups of executions, from the policy's decision to a ready group.

Each new group g<seq> takes a task from the environment (`harness.tasks.draw_tasks`,
seeded by seq; or from `rl.tasks_path`, seeded by seq, or under `scheduler.dispatch_order
= "longest_first"` by the draw `_task_index` puts at seq's place) and runs `rl.group_size`
executions through the harness (or the external agents), with the rollout weights of the
moment (`dispatch.jsonl`). Every execution is stored as soon as it ends (`workdir/executions`;
`executions.jsonl` logs when, for calibration); a group whose executions all ended is
ready for training. A store write that fails (a full disk) is retried until it succeeds,
the record kept in memory meanwhile: the group waits, nothing is lost. After a restart,
groups dispatched before it are ready again (unless trained before the checkpoint) and
only their missing executions run again.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from absl import logging

from gyrejax.config import ConfigError
from gyrejax.harness.agent import Harness
from gyrejax.harness.tasks import FileTask, draw_file_task, draw_tasks
from gyrejax.logs import append_jsonl, prepare_for_append
from gyrejax.loop.context import RunContext
from gyrejax.scheduler.driver import GenerationShare, dispatch_block, dispatch_permutation
from gyrejax.trajectory import Execution, ExecutionStore

STORE_RETRY_MAX_S = 30.0  # the longest wait between two tries of a failed store write


async def store_until_stored(
    store: ExecutionStore, execution: Execution, first_wait_s: float = 0.5
) -> None:
    """Stores `execution` (off the event loop), retrying an OSError (ENOSPC, EIO, ...)
    with a growing wait until it succeeds; each failure is a warning naming it."""
    wait, attempt = first_wait_s, 1
    while True:
        try:
            await asyncio.to_thread(store.put, execution, overwrite=True)
            if attempt > 1:
                logging.warning("execution %s stored at try %d", execution.execution_id, attempt)
            return
        except OSError as e:
            logging.warning(
                "execution %s: store write failed (%s); kept in memory, trying again in %.1f s",
                execution.execution_id,
                e,
                wait,
            )
        await asyncio.sleep(wait)
        wait, attempt = min(2 * wait, STORE_RETRY_MAX_S), attempt + 1


@dataclasses.dataclass
class Group:
    """One dispatched group and what became of it."""

    group_id: str
    seq: int
    task: object
    version: int  # rollout weights when dispatched
    burst: int
    executions: dict[str, Execution] = dataclasses.field(default_factory=dict)
    done: bool = False


class Groups:
    """The run's groups: dispatched, running, ready (in finish order).

    Args:
      ctx: the run.
      env: the environment its tasks come from.
      store: where every execution is stored as it ends.
      tasks: a task file's tasks (`rl.tasks_path`); None: the environment's.
    """

    def __init__(
        self, ctx: RunContext, env, store: ExecutionStore, tasks: list[FileTask] | None = None
    ):
        self.ctx = ctx
        self.env = env
        self.store = store
        self.tasks = tasks
        # Runs executions: the built-in Harness or CommandAgents (the same
        # `run_execution`); set once the engines are up (`attach`).
        self.harness: Harness | None = None
        self.groups: dict[str, Group] = {}
        self.ready: collections.deque[str] = collections.deque()
        self.next_seq = 0
        self.bad_records = 0  # stored records skipped since the last metrics row
        # The last finished executions' share of wall time in model calls.
        self.generation = GenerationShare()

    def attach(self, harness) -> None:
        self.harness = harness

    def in_flight(self) -> list[Group]:
        """Dispatched groups with unfinished executions."""
        return [g for g in self.groups.values() if not g.done]

    def dispatch(self) -> None:
        """Dispatches the next group with the current rollout version."""
        seq = self.next_seq
        self.next_seq += 1
        draw = self._task_index(seq)
        group = self._make(seq, self.ctx.driver.rollout_version, draw)
        entry = {"group": group.group_id, "seq": seq, "task": group.task.task_id, "draw": draw}
        entry.update(version=group.version, time=self.ctx.now())
        append_jsonl(self.ctx.workdir / "dispatch.jsonl", entry)
        self.ctx.spawn(self._run(group, range(self.ctx.config.rl.group_size)))

    def take(self, group_ids: list[str]) -> list[Execution]:
        """Takes ready groups for a step; returns their executions."""
        for g in group_ids:
            self.ready.remove(g)
        return [e for g in group_ids for e in self.groups[g].executions.values()]

    def rewards(self, group_ids: list[str]) -> list[float]:
        return [
            e.reward
            for g in group_ids
            for e in self.groups[g].executions.values()
            if e.reward is not None
        ]

    def _task_index(self, seq: int) -> int:
        """The draw (data index) group `seq` takes: seq itself, or under "longest_first"
        the one `dispatch_permutation` puts at seq's place in its block, the run's last
        block cut at its last group as the simulator's trace is (so the run's last
        groups are the short ones of what is left). `dispatch.jsonl` records it: a
        resume gives each group dispatched before its own draw, whatever train.steps."""
        config = self.ctx.config
        total = self.ctx.driver.schedule.groups_total
        if config.scheduler.dispatch_order == "fifo" or seq >= total:
            return seq
        block = dispatch_block(config.rl.groups_per_step, config.scheduler.max_staleness)
        start = seq - seq % block
        end = min(start + block, total)
        # (A resume with more steps lengthens a cut block: its seqs not yet dispatched
        # may then repeat a draw, as draws with replacement from the file do anyway.)
        draws = [
            draw_file_task(self.tasks, seed=i, run_seed=config.seed) for i in range(start, end)
        ]
        return start + dispatch_permutation([t.expected_s for t in draws], block)[seq - start]

    def _make(self, seq: int, version: int, draw: int | None = None) -> Group:
        """Group `seq` with the task of `draw` (file tasks; None: `_task_index(seq)`)."""
        config = self.ctx.config
        if self.tasks is not None:
            index = self._task_index(seq) if draw is None else draw
            task = draw_file_task(self.tasks, seed=index, run_seed=config.seed)
        else:
            (task,) = draw_tasks(self.env, config.harness, 1, seed=seq, run_seed=config.seed)
        group = Group(f"g{seq}", seq, task, version, self.ctx.driver.burst)
        self.groups[group.group_id] = group
        return group

    async def _run(self, group: Group, members) -> None:
        async def one(i: int) -> None:
            execution_id = f"{group.group_id}/{i}"
            seed = group.seq * 1000 + i
            started = self.ctx.now()
            execution = await self.harness.run_execution(
                group.task, execution_id, group.group_id, seed
            )
            await store_until_stored(self.store, execution)  # persisted as soon as it ends
            group.executions[execution_id] = execution
            record = {"execution": execution_id, "group": group.group_id, "started_s": started}
            record.update(finished_s=self.ctx.now(), status=execution.status)
            append_jsonl(self.ctx.workdir / "executions.jsonl", record)  # for calibration
            calls_s = sum(c.finished_at - c.started_at for c in execution.calls)
            self.generation.add(calls_s, record["finished_s"] - started)
            self.ctx.notify()

        await asyncio.gather(*(one(i) for i in members))
        group.done = True
        self.ready.append(group.group_id)
        self.ctx.notify()

    def resume(self, trained: set[str]) -> None:
        """Groups dispatched before a restart: finished ones are ready again (unless in
        `trained`, trained before the checkpoint), missing executions run again."""

        def valid(entry: dict) -> bool:
            fields = (("group", str), ("seq", int), ("version", int))
            return all(isinstance(entry.get(k), t) for k, t in fields)

        # A torn last entry is cut away: its group had not started (the entry is
        # written before the group runs), so its seq is simply dispatched again.
        entries = [e for e in prepare_for_append(self.ctx.workdir / "dispatch.jsonl") if valid(e)]
        if not entries:
            return
        self.next_seq = max(e["seq"] for e in entries) + 1
        skipped: list[str] = []  # bad stored records: skipped (named), counted, re-run
        size = self.ctx.config.rl.group_size
        for entry in entries:
            if entry["group"] in trained:
                continue
            draw = entry.get("draw")  # absent in older runs: recomputed
            group = self._make(
                entry["seq"], entry["version"], draw if isinstance(draw, int) else None
            )
            if entry.get("task", group.task.task_id) != group.task.task_id:
                raise ConfigError(
                    f"resume: dispatch.jsonl says group {entry['group']} ran task "
                    f"{entry['task']!r}, the config now gives it {group.task.task_id!r}; "
                    "resume with the settings that chose it (seed, rl.tasks_path, the "
                    "environment's harness settings)"
                )
            for execution in self.store.groups([group.group_id], skipped=skipped)[group.group_id]:
                group.executions[execution.execution_id] = execution
            missing = [i for i in range(size) if f"{group.group_id}/{i}" not in group.executions]
            if missing:
                self.ctx.spawn(self._run(group, missing))
            else:
                group.done = True
                self.ready.append(group.group_id)
        self.bad_records += len(skipped)
        running = len(self.in_flight())
        logging.info(
            "resume: %d groups ready, %d re-running, %d bad records skipped",
            len(self.ready),
            running,
            len(skipped),
        )

    def cancel_unfinished(self, proxy) -> None:
        """Cancels the model calls of every unfinished group (request ids "<group>/...")."""
        for group in self.in_flight():
            proxy.cancel_execution(group.group_id)
