"""The RL loop: harness, proxy, engines, trajectory processor and trainer, with cells
moved between rollout and training by a policy (gyrejax.scheduler.policies).

One asyncio loop drives everything (`Runtime._run`, read it top to bottom). After every
event (an execution or group finished, a step finished, a transition finished) the
policy sees a `View` and returns a `Decision`; the runtime carries it out under the
driver rules both drivers share (gyrejax.scheduler.driver):

  * dispatch (groups.py): each new group takes a task and runs `rl.group_size`
    executions through the harness (or, with `rl.agent = command`, as processes of the
    user's agent through an OpenAI door served here: harness/external.py); each
    execution is stored as it ends;
  * steps (steps.py): a training step starts when the rules and the staleness gate
    allow, trains on every TRAINING cell in an executor thread, and after every
    `scheduler.mu` steps the weights are published to the rollout engines
    (engines.py) and a new burst begins;
  * transitions (transitions.py): role switches, one at a time, every phase timed;
  * evaluation (evaluation.py, `eval.every_steps` > 0): held-out tasks at burst
    boundaries, on the rollout engines while training goes on, never trained
    (`eval.jsonl`); the run waits for them before it ends;
  * outputs (outputs.py): `metrics.jsonl`, `transitions.jsonl`, idle time by cause,
    `run_summary.json` and the plots; also the execution store, `dispatch.jsonl`,
    `executions.jsonl` and checkpoints.

Killing the process and starting the same command again continues from the last
checkpoint with every stored execution: groups trained after that checkpoint are
trained again (their updates were lost with the process), finished executions are never
re-run, unfinished ones are.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gyrejax.cells import Cell
from gyrejax.config import Config
from gyrejax.harness.agent import Harness
from gyrejax.harness.chat import load_chat
from gyrejax.harness.envs import get_environment
from gyrejax.harness.external import start_command_agents
from gyrejax.harness.held_out import held_out_tasks
from gyrejax.harness.tasks import load_task_file
from gyrejax.loop.context import RunContext, schedule_of
from gyrejax.loop.engines import CellEngines, Rollout
from gyrejax.loop.evaluation import Evaluation
from gyrejax.loop.groups import Groups
from gyrejax.loop.outputs import CellTime, write_summary
from gyrejax.loop.steps import Steps
from gyrejax.loop.transitions import Transitions
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.engine import Engine
from gyrejax.scheduler.driver import Driver, capacity_from_share
from gyrejax.scheduler.policies import Role, policy_from_config
from gyrejax.serve.openai_server import OpenAIServer
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.trajectory import ExecutionStore
from gyrejax.writers import Writers


class Runtime:
    """Runs `config.train.steps` RL steps with the configured scheduling policy.

    Args:
      config: the whole run configuration.
      cells: every cell, in order (cell 0 is the core).
      model: the starting policy (e.g. after the warm start).
      workdir: where everything is written (see the module docstring).
      trainer: the trainer to train, at the start of its RL phase (e.g. the warm
        start's, after `begin_phase`; across processes, one with their transport);
        default: a new one on cell 0 built from `model`.
      cell_engines: builds each cell's engine (default: a precompiled `make_engine` in
        this process; across processes, another process's cells are reached by URL).
    """

    def __init__(
        self,
        config: Config,
        cells: list[Cell],
        model: Transformer,
        workdir: Path,
        *,
        trainer: ElasticTrainer | None = None,
        cell_engines: CellEngines | None = None,
    ):
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        if trainer is None:
            trainer = ElasticTrainer(model, cells[0], rl=config.rl, train=config.train)
        self.config = config
        self.trainer = trainer
        driver = Driver(schedule_of(config, len(cells)))
        self.ctx = RunContext(config, cells, workdir, trainer, driver)
        env = get_environment(config.harness.environment, sandbox=config.harness.sandbox)
        tasks = None
        if config.rl.tasks_path:  # read (and resolved) now: a bad file is one error line
            scorer = env if config.rl.reward == "environment" else None
            by_expected = config.scheduler.dispatch_order == "longest_first"
            tasks = load_task_file(
                config.rl.tasks_path,
                scorer,
                need_expected=by_expected,
                private_fields=getattr(env, "private_task_fields", ()),
            )
        self.groups = Groups(self.ctx, env, ExecutionStore(workdir / "executions"), tasks)
        held_out = held_out_tasks(config, env) if config.eval.every_steps else None
        self.evaluation = Evaluation(self.ctx, held_out)  # (a bad eval.* is one error line)
        self.door: OpenAIServer | None = None  # rl.agent = command: the agents' door
        self.rollout = Rollout(self.ctx, cell_engines)
        self.cell_time = CellTime(self.ctx)
        self.steps = Steps(
            self.ctx, self.groups, self.cell_time, self._publish, self.evaluation.figures
        )
        self.transitions = Transitions(self.ctx, self.rollout)
        self.policy = policy_from_config(config.scheduler)

    @property
    def engines(self) -> dict[int, Engine]:
        """The cells' engines, by cell index."""
        return self.rollout.engines

    def run(self) -> dict:
        """Runs the loop to its last step; returns the run's summary."""
        return asyncio.run(self._run())

    async def _run(self) -> dict:
        ctx, config = self.ctx, self.config
        ctx.start()
        self.steps.restore()
        self.evaluation.restore(self.trainer.step)
        # After the logs were trimmed: the trackers rewrite the steps the run redoes.
        ctx.writers = Writers(config, ctx.workdir, resumed_at=self.trainer.step)
        try:  # engines started so far are shut down even if a later one fails to start
            proxy = await self.rollout.start()
            harness = await self._agents(proxy)
            self.groups.attach(harness)
            self.evaluation.attach(proxy, harness)
            ctx.timeline += [(0.0, cell.index, Role.ROLLOUT.value) for cell in ctx.cells]
            ctx.spawn(self.transitions.worker())
            ctx.spawn(self.cell_time.monitor(proxy, self.groups))
            self.groups.resume(set(self.steps.trained_groups))
            while self.trainer.step < config.train.steps:
                await self._decide(proxy)
            if ctx.step_task is not None:
                await ctx.step_task
            if self.evaluation.due():  # the last steps ended no burst: publish them
                await self._publish()
            while self.evaluation.busy:  # the policy still decides (a cell may return)
                await self._decide(proxy, train=False)
        finally:
            await self._shutdown()
        return write_summary(
            ctx,
            self.cell_time,
            self.steps.over_stale,
            self.steps.resumed_at,
            overcommitted=getattr(self.policy, "overcommitted", None),  # elastic's only
        )

    async def _decide(self, proxy, train: bool = True) -> None:
        """One round: the policy sees the View; its dispatch and transitions are carried
        out, a step starts if it may (`train`); then waits for the next event."""
        ctx, config = self.ctx, self.config
        occupancy, slots = config.scheduler.slot_occupancy, config.rollout.max_slots
        ctx.check()
        share = self.groups.generation.share() if occupancy > 0 else None
        if share is not None:
            ctx.driver.set_capacity(capacity_from_share(slots, occupancy, share))
        c = proxy.counters()
        view = ctx.driver.view(
            ctx.now(),
            (c.dispatched, c.started, c.finished),
            groups_in_flight=len(self.groups.in_flight()),
            groups_ready=len(self.groups.ready),
            groups_dispatched=self.groups.next_seq,
            step_running=ctx.step_task is not None,
        )
        decision = self.policy(view)
        ctx.driver.note_gate(view, decision.dispatch)
        for _ in range(decision.dispatch):
            self.groups.dispatch()
        external = bool(self.rollout.external)
        for index, role in self.evaluation.allowed(
            decision.transitions, ctx.driver.roles, external
        ):
            self.transitions.request(index, role)
        if train:
            self.steps.maybe_start()
        await ctx.changed(timeout_s=1.0)

    async def _publish(self) -> None:
        """Ends a burst: the rollout engines get the newest weights, then an evaluation
        of them if one is due (evaluation.py)."""
        await self.rollout.publish()
        self.evaluation.start()

    async def _agents(self, proxy):
        """What runs executions: the built-in harness, or the user's agent command
        through an OpenAI door this runtime serves on loopback (harness/external.py)."""
        config, workdir = self.config, self.ctx.workdir / "workspaces"
        chat = load_chat(config.model.tokenizer)
        if config.rl.agent == "builtin":
            return Harness(
                proxy,
                config.harness,
                workdir,
                temperature=config.rollout.temperature,
                top_p=config.rollout.top_p,
                top_k=config.rollout.top_k,
                environment=self.groups.env,
                chat=chat,
            )
        agents = await start_command_agents(
            config, proxy, chat, workdir, self.groups.env, run_dirs=(self.ctx.workdir,)
        )
        self.door = agents.door
        return agents

    async def _shutdown(self) -> None:
        ctx = self.ctx
        if self.rollout.proxy is not None:
            self.groups.cancel_unfinished(self.rollout.proxy)
            self.evaluation.cancel(self.rollout.proxy)
        for task in ctx.tasks():
            if task is not ctx.step_task:
                task.cancel()
        await asyncio.gather(*ctx.tasks(), return_exceptions=True)
        if self.door is not None:
            await self.door.stop()
        await self.rollout.shutdown()
        ctx.writers.close()
        self.steps.close()
