"""Stages of the main job that `run.py` composes: the warm start and a rollout batch.

warm_start: demonstrations of the environment's tasks are recorded through the harness
  (`workdir/demonstrations`, an execution store), then the model is trained on them
  with SFT on every cell (`workdir/warmup`: checkpoints, metrics; resumable). Given the
  job's trainer, it trains that one (its SFT phase), so RL goes on from its layout and
  compiled functions.
rollout_batch: JAX engines on every cell behind one proxy; the harness runs
  `rl.groups_per_step` groups of `rl.group_size` executions; every execution is stored
  in `workdir/executions` as soon as it ends, and the mean reward is reported.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import Config
from gyrejax.harness.agent import Harness
from gyrejax.harness.chat import load_chat
from gyrejax.harness.demonstrations import command_demonstrations, demonstration_executions
from gyrejax.harness.envs import get_environment
from gyrejax.harness.sandbox import sandbox_summary
from gyrejax.harness.tasks import draw_tasks
from gyrejax.logs import mark
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.factory import make_engine
from gyrejax.rollout.proxy import Proxy
from gyrejax.train.loop import train_on_store
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.trajectory import Execution, ExecutionStore


def warm_start(
    config: Config,
    cells: list[Cell],
    model: Transformer,
    workdir: Path,
    *,
    trainer: ElasticTrainer | None = None,
) -> Transformer:
    """SFT on demonstrations; returns the model with the trained weights.

    Args:
      config, cells, model, workdir: the run (`warmup` holds the SFT settings).
      trainer: the job's trainer; its SFT phase begins here (default: a new trainer
        built from `model`).
    """
    mark("warm_start")  # for benchmarks/chaos.py
    env = get_environment(config.harness.environment, sandbox=config.harness.sandbox)
    store = ExecutionStore(workdir / "demonstrations")
    if len(store) < config.warmup.demonstrations:
        tasks = draw_tasks(
            env, config.harness, config.warmup.demonstrations, seed=1, run_seed=config.seed
        )
        start = time.perf_counter()
        chat, workspaces = load_chat(config.model.tokenizer), workdir / "demonstration_workspaces"
        if config.rl.agent == "command":  # in the user's agent's own format
            recorded = command_demonstrations(
                config,
                env,
                tasks,
                workspaces,
                seed=config.seed,
                quality=config.warmup.quality,
                chat=chat,
                run_dirs=(workdir,),
            )
        else:
            recorded = demonstration_executions(
                env,
                tasks,
                config.harness,
                workspaces,
                seed=config.seed,
                quality=config.warmup.quality,
                delegation_prob=config.warmup.delegation_prob,
                chat=chat,
            )
        executions = asyncio.run(recorded)
        for execution in executions:
            if execution.execution_id not in store:
                store.put(execution)
        seconds = time.perf_counter() - start
        reward = float(np.mean([e.reward for e in executions if e.reward is not None]))
        logging.info(
            "recorded %d demonstrations in %.1f s (mean reward %.3f)",
            len(executions),
            seconds,
            reward,
        )
    sft = dataclasses.replace(
        config,
        train=dataclasses.replace(
            config.train,
            executions_dir=str(store.root),
            steps=config.warmup.steps,
            learning_rate=config.warmup.learning_rate,
        ),
        rl=dataclasses.replace(
            config.rl, loss="sft", groups_per_step=config.warmup.groups_per_step, j_max=100
        ),
        checkpoint=dataclasses.replace(config.checkpoint, export_hf=False),
        # SFT on a stored set rolls nothing out: the RL loop's external engines are not
        # its (and a stored-set config refuses them).
        rollout=dataclasses.replace(config.rollout, vllm_servers=(), engine_servers=()),
    )
    if trainer is None:
        trainer = ElasticTrainer(model, cells[0], rl=sft.rl, train=sft.train)
    else:
        trainer.begin_phase(rl=sft.rl, train=sft.train)
    result = train_on_store(sft, cells, model, workdir / "warmup", trainer=trainer)
    logging.info("warm start: %d SFT steps (%s)", trainer.step, result.summary()["last"])
    mark("warm_start done")
    return trainer.model()


async def _rollout(
    config: Config, cells: list[Cell], model: Transformer, workdir: Path, version: int
) -> list[Execution]:
    env = get_environment(config.harness.environment, sandbox=config.harness.sandbox)
    engines = [make_engine(cell, model, config.rollout, version=version) for cell in cells]
    proxy = Proxy(engines)
    harness = Harness(
        proxy,
        config.harness,
        workdir / "workspaces",
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
        top_k=config.rollout.top_k,
        environment=env,
        chat=load_chat(config.model.tokenizer),
    )
    store = ExecutionStore(workdir / "executions")
    tasks = draw_tasks(env, config.harness, config.rl.groups_per_step, seed=2, run_seed=config.seed)

    async def group(i: int, task) -> list[Execution]:
        executions = await harness.run_group(task, f"batch0-g{i}", config.rl.group_size, seed=i)
        for execution in executions:  # persisted as soon as its group ends
            store.put(execution, overwrite=True)
        return executions

    try:
        groups = await asyncio.gather(*(group(i, t) for i, t in enumerate(tasks)))
    finally:
        for engine in engines:
            await engine.shutdown()
    return [e for g in groups for e in g]


def rollout_batch(
    config: Config, cells: list[Cell], model: Transformer, workdir: Path, version: int = 0
) -> dict:
    """Runs one batch of executions through JAX engines on every cell; returns a summary."""
    start = time.perf_counter()
    executions = asyncio.run(_rollout(config, cells, model, workdir, version))
    rewards = [e.reward for e in executions if e.reward is not None]
    statuses: dict[str, int] = {}
    for e in executions:
        statuses[e.status] = statuses.get(e.status, 0) + 1
    summary = {
        "executions": len(executions),
        "mean_reward": float(np.mean(rewards)) if rewards else None,
        "statuses": statuses,
        "calls": sum(len(e.calls) for e in executions),
        "generated_tokens": sum(len(c.output_ids) for e in executions for c in e.calls),
        "seconds": time.perf_counter() - start,
        "sandbox": sandbox_summary(config.harness.sandbox),  # no boundary without bwrap
    }
    (workdir / "rollout_summary.json").write_text(json.dumps(summary, indent=2))
    logging.info(
        "rollout batch: %d executions, mean reward %.3f, statuses %s, %d calls, %.1f s",
        *(len(executions), summary["mean_reward"] or 0.0, statuses, summary["calls"]),
        summary["seconds"],
    )
    return summary
