"""Held-out evaluation in the RL loop: on the rollout engines, at burst boundaries, while
training goes on, and never trained.

When a publication ends a burst (`Rollout.publish`, from steps.py) and the trainer has
passed a multiple of `eval.every_steps` since the last evaluation, `start` runs every
held-out task (gyrejax/harness/held_out.py) once greedily (temperature 0) and
`eval.samples_per_task` times at the rollout's sampling (temperature, top_p, top_k),
through the run's proxy, with harnesses of their own. The weights are those just
published (`version`) only while no newer ones reach the engine serving it: the next
publication, or a cell that returns to rollout with the trainer's newest weights (e.g.
elastic, all of whose cells may be training when the evaluation starts), swaps them
mid-execution. So the record also gives the versions its tokens were sampled with
(`versions`, [min, max]); only colocate, which trains no step while one runs, always
evaluates exactly `version`.

Capacity. The proxy counts these executions like any (d(t), f(t)), so elastic's
waterlevel keeps the rollout capacity they need and brings a cell back if none is left;
async always keeps its rollout cells. A policy with no rollout cell while it trains
(colocate) evaluates in its rollout phase: its cells return for the next burst, and
while an evaluation runs `allowed` holds back moves to training that would leave no
engine serving it (colocate then trains once the evaluation ends).

Never trained: an evaluation's executions ("eval/step<s>/t<i>/greedy", ".../s<j>", group
"eval/step<s>") are run here, not by `Groups`: they are never a group, never stored in
the execution store (workdir/executions), dispatch.jsonl or executions.jsonl, never
ready, so no step's `Groups.take` can reach them. Their workspaces are
workdir/eval_workspaces.

Outputs: `eval.jsonl`, a record per evaluation (step, version, wall time, the figures of
gyrejax.evaluation.report overall and per family, each task's rewards); the newest
finished evaluation's figures in the next metrics row ("eval"); run_summary.json and
eval.png (outputs.py). The run waits for its evaluations before it ends; if its last
steps ended no burst, they are published then and evaluated (runtime.py). A resume drops
records past its checkpoint's step (their steps are trained and evaluated again); an
evaluation cut short by a kill is lost with its weights.
"""

from __future__ import annotations

import asyncio
import time

from absl import logging

from gyrejax.evaluation import TaskResult, report
from gyrejax.harness.agent import Harness
from gyrejax.harness.held_out import EvalTask
from gyrejax.logs import prepare_for_append, up_to_step
from gyrejax.loop.context import RunContext
from gyrejax.scheduler.policies import Role

EVAL_LOG = "eval.jsonl"
PREFIX = "eval"  # execution ids "eval/step<s>/...": the proxy cancels them by it
# An evaluation's overall figures, as a metrics row and run_summary.json carry them.
FIGURES = (
    "greedy_reward",
    "greedy_pass@1",
    "sampled_reward",
    "sampled_pass@1",
    "sampled_pass@k",
    "sampled_empty_rate",
    "sampled_reward_produced",
    "k",
)


def record_figures(record: dict) -> dict:
    """An `eval.jsonl` record's step, version and overall figures."""
    return {key: record[key] for key in ("step", "version", *FIGURES)}


class Evaluation:
    """The run's held-out evaluations (module docstring).

    Args:
      ctx: the run.
      tasks: the held-out tasks; None: `eval.every_steps` is 0 (no evaluation).
    """

    def __init__(self, ctx: RunContext, tasks: list[EvalTask] | None):
        self.ctx = ctx
        self.tasks = tasks or []
        self.every = ctx.config.eval.every_steps if tasks else 0
        self.evaluated_step = 0  # the step of the last evaluation (or of the checkpoint)
        self.running = 0  # evaluations under way
        self.greedy: Harness | None = None
        self.sampled: Harness | None = None
        self._newest: dict | None = None  # finished, not yet in a metrics row

    def attach(self, proxy, harness: Harness) -> None:
        """Builds the evaluation's harnesses beside the run's `harness` (its environment
        and chat format, its proxy): greedy, and at the rollout's sampling."""
        if not self.every:
            return
        config, root = self.ctx.config, self.ctx.workdir / "eval_workspaces"
        shared = dict(environment=harness.env, chat=harness.chat)
        self.greedy = Harness(proxy, config.harness, root, temperature=0.0, **shared)
        r = config.rollout
        self.sampled = Harness(
            proxy, config.harness, root, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            **shared,
        )  # fmt: skip

    def restore(self, step: int) -> None:
        """After a resume from `step`: records of later steps are dropped (redone)."""
        self.evaluated_step = step
        prepare_for_append(self.ctx.workdir / EVAL_LOG, keep=up_to_step(step))

    @property
    def busy(self) -> bool:
        return self.running > 0

    def due(self) -> bool:
        """The trainer passed a multiple of `eval.every_steps` since the last evaluation."""
        step = self.ctx.trainer.step
        return bool(self.every) and step // self.every > self.evaluated_step // self.every

    def start(self) -> None:
        """At a burst boundary (the weights just published): an evaluation if `due`."""
        if not self.due():
            return
        step, version = self.ctx.trainer.step, self.ctx.driver.rollout_version
        self.evaluated_step = step
        self.running += 1
        self.ctx.spawn(self._evaluate(step, version))

    def allowed(self, transitions, roles: list[Role], external: bool) -> tuple:
        """A decision's `transitions`, less its moves to training while an evaluation
        runs if they would leave no engine serving it (`external`: engines outside the
        cells, which always serve)."""
        if not self.busy or external:
            return tuple(transitions)
        after = list(roles)
        for index, role in transitions:
            after[index] = role
        if Role.ROLLOUT in after:
            return tuple(transitions)
        return tuple((i, role) for i, role in transitions if role is not Role.TRAINING)

    def figures(self) -> dict | None:
        """The newest evaluation finished since the last call (a metrics row's "eval")."""
        record, self._newest = self._newest, None
        return None if record is None else record_figures(record)

    def cancel(self, proxy) -> None:
        """Cancels the model calls of every unfinished evaluation."""
        proxy.cancel_execution(PREFIX)

    async def _evaluate(self, step: int, version: int) -> None:
        ctx, k = self.ctx, self.ctx.config.eval.samples_per_task
        start_s, start = ctx.now(), time.perf_counter()
        group = f"{PREFIX}/step{step}"
        try:
            runs = []
            # The run's seed varies the samples, so runs of several seeds are independent
            # evaluations, even of the same weights.
            base = ctx.config.seed * 1_000_003
            for i, held in enumerate(self.tasks):
                name = f"{group}/t{i}"
                runs.append(self.greedy.run_execution(held.task, f"{name}/greedy", group, base + i))
                runs += [
                    self.sampled.run_execution(
                        held.task, f"{name}/s{j}", group, base + i * 1000 + j
                    )
                    for j in range(k)
                ]
            executions = await asyncio.gather(*runs)
            results = []
            for i, held in enumerate(self.tasks):
                greedy, *sampled = executions[i * (k + 1) : (i + 1) * (k + 1)]
                rewards = tuple(e.reward for e in sampled)
                empty = tuple(e.status == "no_artifact" for e in sampled)
                results.append(
                    TaskResult(held.task.task_id, held.family, greedy.reward, rewards, empty)
                )
            versions = [int(v) for e in executions for c in e.calls for v in c.versions]
            record = {"step": step, "version": version, "start_s": start_s, "time_s": ctx.now()}
            record["wall_s"] = time.perf_counter() - start
            record["versions"] = [min(versions), max(versions)] if versions else None
            record["temperature"] = ctx.config.rollout.temperature
            record.update(report(results, k))
            record["per_task"] = [
                {"id": r.task_id, "family": r.family, "greedy": r.greedy, "sampled": r.sampled}
                for r in results
            ]
            ctx.log(EVAL_LOG.removesuffix(".jsonl"), record, step=step)
            self._newest = record
            logging.info(
                "eval at step %d (version %d, sampled with %s): greedy pass@1 %.3f, sampled "
                "pass@1 %.3f pass@%d %.3f, reward %.3f (%d executions, %.1f s)",
                *(step, version, record["versions"], record["greedy_pass@1"]),
                *(record["sampled_pass@1"], k),
                *(record["sampled_pass@k"], record["sampled_reward"], record["executions"]),
                record["wall_s"],
            )
        finally:
            self.running -= 1
            ctx.notify()
