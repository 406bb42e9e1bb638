"""Training steps of the RL loop, their checkpoints, and resuming from one.

A step starts when the driver's rules allow it (the core TRAINING and not switching, no
step running, no engine copying the weights its update would donate) and the staleness
gate lets `rl.groups_per_step` ready groups go (`Driver.choose_groups`: the oldest
rollout versions first, waiting for a running older group rather than train anything
more than S versions stale; a group trained beyond the gate is counted, never silent).
It runs in an executor thread: its groups' executions become a packed batch
(`train.loop.process_options`, the one place those arguments come from the config),
the trainer trains on every TRAINING cell, a metrics row is written, a checkpoint every
`checkpoint.every_steps` steps, and after every `scheduler.mu` steps the weights are
published (a burst ends).

Checkpoint metadata records the trained groups, the next group seq and the burst, so a
restart re-readies stored groups, re-runs only missing executions and trains nothing
twice; metric rows of steps past the checkpoint are dropped (they are trained again).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from absl import logging

from gyrejax.logs import mark, prepare_for_append, up_to_step
from gyrejax.loop.context import RunContext
from gyrejax.loop.groups import Groups
from gyrejax.loop.outputs import CellTime, step_record
from gyrejax.model.hf_io import tokenizer_fingerprint
from gyrejax.train.checkpoint import TOKENIZER_KEY, TrainCheckpointer, check_tokenizer
from gyrejax.train.loop import process_options
from gyrejax.trajectory import process

# Steps' worth of groups in a row with nothing to train before the run gives up.
NOTHING_TO_TRAIN_STEPS = 4


class NothingToTrain(RuntimeError):
    """Group after group had nothing to train: the run cannot make progress (the message
    says why, with the last execution's error)."""


class Steps:
    """Starts, runs and records the run's training steps; checkpoints and resumes.

    Args:
      ctx: the run.
      groups: where ready groups come from.
      cell_time: the idle accounting each metrics row reports.
      publish: ends a burst (the rollout engines get the newest weights).
      eval_figures: the newest held-out evaluation finished since it was last asked, or
        None (a metrics row's "eval"; loop/evaluation.py).
    """

    def __init__(
        self,
        ctx: RunContext,
        groups: Groups,
        cell_time: CellTime,
        publish: Callable[[], Awaitable[None]],
        eval_figures: Callable[[], dict | None] = lambda: None,
    ):
        self.ctx = ctx
        self.groups = groups
        self.cell_time = cell_time
        self.publish = publish
        self.eval_figures = eval_figures
        self.checkpointer = TrainCheckpointer(ctx.workdir / "checkpoints", ctx.config.checkpoint)
        self.tokenizer = tokenizer_fingerprint(ctx.config.model.tokenizer)  # (read once)
        self.trained_groups: list[str] = []
        self.skipped_groups: list[str] = []  # with nothing to train: replaced (see below)
        self.skipped_in_a_row = 0
        self.over_stale = 0  # groups trained more than max_staleness versions late
        self.resumed_at = 0  # the step this process started from (its rows come after)

    def maybe_start(self) -> None:
        """Starts a step if the driver's rules and the staleness gate allow one."""
        ctx, driver, trainer = self.ctx, self.ctx.driver, self.ctx.trainer
        # No step while an engine copies the weights a step's update would donate, nor
        # while a cell waits for this boundary to leave training: steps started back to
        # back would hold it (out of the trainer, not yet serving) for good.
        leaving = "wait_boundary" in ctx.phase.values()
        if ctx.weight_pulls or leaving or not driver.step_may_start(ctx.step_task is not None):
            return
        ready = list(self.groups.ready)
        groups = self.groups.groups
        chosen = driver.choose_groups(
            [groups[g].version for g in ready],
            [g.version for g in self.groups.in_flight()],
            trainer.version,
        )
        if chosen is None:  # too few groups, or waiting for an older one (staleness)
            return
        group_ids = [ready[i] for i in chosen]
        late = [g for g in group_ids if driver.over_stale(trainer.version - groups[g].version)]
        if late:  # never silent: step_groups only does this when nothing better exists
            self.over_stale += len(late)
            gate = ctx.config.scheduler.max_staleness
            logging.warning("groups %s are trained more than %d versions late", late, gate)
        executions = self.groups.take(group_ids)
        ctx.step_task = ctx.spawn(self._train(group_ids, executions))

    async def _train(self, group_ids: list[str], executions: list) -> None:
        ctx, config, trainer = self.ctx, self.ctx.config, self.ctx.trainer
        batch = process(executions, **process_options(config, trainer.step))
        loop = asyncio.get_running_loop()
        try:
            if batch.num_micro_steps == 0:
                self._nothing_to_train(group_ids, executions)
                return
            self.skipped_in_a_row = 0
            mark("step")  # for benchmarks/chaos.py; "step done" comes with its metrics row
            compiled = trainer.compile_count
            report = await loop.run_in_executor(None, trainer.train_step, batch)
            compiled = trainer.compile_count - compiled  # functions this step compiled
            self.trained_groups += group_ids
            end_of_burst = ctx.driver.step_done()
            step_record(
                ctx,
                report,
                batch,
                group_ids,
                self.groups.rewards(group_ids),
                self.cell_time,
                over_stale=self.over_stale,
                bad_records=self.groups.bad_records,
                longest_call=longest_call(executions, batch.execution_ids),
                evaluation=self.eval_figures(),
                compiled=compiled,
            )
            self.groups.bad_records = 0
            if trainer.step % config.checkpoint.every_steps == 0:
                await loop.run_in_executor(None, self.save)
            if end_of_burst:
                await self.publish()
        finally:
            ctx.step_task = None
            ctx.notify()

    def _nothing_to_train(self, group_ids: list[str], executions: list) -> None:
        """Groups whose executions all failed (or hold nothing trainable) count as
        trained, never retried, and as many new groups take their place: the schedule
        dispatches only steps x groups_per_step, and would otherwise wait for groups it
        never dispatches. Past NOTHING_TO_TRAIN_STEPS steps' worth in a row the run ends
        with why (an agent command that cannot run fails every execution)."""
        ctx = self.ctx
        self.trained_groups += group_ids
        self.skipped_groups += group_ids
        self.skipped_in_a_row += len(group_ids)
        limit = NOTHING_TO_TRAIN_STEPS * ctx.config.rl.groups_per_step
        if self.skipped_in_a_row >= limit:
            failed = [e for e in executions if e.error]
            why = f"; the last error ({failed[-1].execution_id}): {failed[-1].error[-400:]}"
            raise NothingToTrain(
                f"{self.skipped_in_a_row} groups in a row had nothing to train (every "
                f"execution failed or trained nothing){why if failed else ''}"
            )
        logging.warning("groups %s have nothing to train; new groups replace them", group_ids)
        self._replace_groups(len(group_ids))

    def _replace_groups(self, count: int) -> None:
        schedule = self.ctx.driver.schedule
        total = schedule.groups_total + count
        self.ctx.driver.schedule = dataclasses.replace(schedule, groups_total=total)

    def save(self) -> None:
        """Checkpoints the trainer with what a restart needs to go on."""
        meta = {"trained_groups": self.trained_groups, "next_seq": self.groups.next_seq}
        meta["skipped_groups"] = self.skipped_groups
        meta.update(burst=self.ctx.driver.burst, seed=self.ctx.config.seed)
        meta[TOKENIZER_KEY] = self.tokenizer
        self.ctx.trainer.save(self.checkpointer, meta)

    def restore(self) -> None:
        """Resumes from the newest readable checkpoint, if any, and readies the logs for
        appending: a torn last line (a kill mid-write) is cut away, and metric rows of
        steps past the checkpoint are dropped, since those steps are trained again.

        Raises:
          ConfigError: the checkpoint was trained with another `model.tokenizer`.
        """
        ctx, trainer = self.ctx, self.ctx.trainer
        if self.checkpointer.latest_step() is not None:
            meta = trainer.restore(self.checkpointer)
            where = self.checkpointer.step_path(trainer.step)
            check_tokenizer(meta, ctx.config.model.tokenizer, self.tokenizer, where)
            self.trained_groups = list(meta["trained_groups"])
            self.skipped_groups = list(meta.get("skipped_groups", []))
            self._replace_groups(len(self.skipped_groups))
            ctx.driver.burst = int(meta["burst"])
            ctx.driver.rollout_version = trainer.version
            self.resumed_at = trainer.step
            logging.info(
                "resumed from step %d (%d groups trained)", trainer.step, len(self.trained_groups)
            )
        prepare_for_append(ctx.workdir / "metrics.jsonl", keep=up_to_step(trainer.step))
        # Every role switch stays (none is redone): the trackers count on from the last.
        ctx.transitions_logged = len(prepare_for_append(ctx.workdir / "transitions.jsonl"))
        prepare_for_append(ctx.workdir / "executions.jsonl")

    def close(self) -> None:
        """At the run's end: keeps every completed step, then closes the checkpointer."""
        step = self.ctx.trainer.step
        if step and self.checkpointer.latest_step() != step:
            self.save()
        self.checkpointer.close()


def longest_call(executions: list, trained_ids: tuple[str, ...]) -> int:
    """The longest context (prompt + output) of a call of the trained executions; 0 if
    none. Above train.row_length, it was trained in a longer row bucket."""
    trained = set(trained_ids)
    lengths = [c.length for ex in executions if ex.execution_id in trained for c in ex.calls]
    return max(lengths, default=0)
