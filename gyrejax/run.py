"""`run(config, workdir)`: the main job, called by `gyrejax.launch` and by tests.

Stages, in order; each exists only once its module does:
  1. layout: split the devices into cells, build or load the model on the core cell;
  2. smoke generations: greedy decoding of `config.generate.prompts` with the KV cache;
  3. with `config.train.executions_dir`: SFT or RL steps on that execution store on all
     cells, checkpointing into `workdir/checkpoints` and resuming from it
     (`gyrejax.train.loop`); nothing else runs;
  otherwise:
  4. warm start when `warmup.steps > 0` (`gyrejax.stages`): demonstrations recorded
     through the harness, then SFT on them;
  5. RL for `train.steps` steps (`gyrejax.loop`): the harness runs groups of executions
     through the cells' engines while the policy (`scheduler.policy`) moves cells
     between rollout and training; with `train.steps = 0`, one rollout batch instead
     (executions stored, mean reward reported).
The job has one trainer (built once stages 3-5 need one): the warm start trains it, and
RL goes on with its layout and whatever it compiled that still fits.

Several processes (`launch/local.sh`, a cluster; `_run_processes`): every process splits
all devices into the same cells and holds those of its local devices; process 0 writes
`layout.json` (which process holds which cell) and drives, the others follow (gyrejax/
distributed). Stage 3 is the same store-training loop on process 0 with a trainer whose
transport reaches the others' cells; for RL the warm start runs on process 0's cells,
the others start from its result (`workdir/snapshots/start`), serve their cells' engines
over HTTP and train them when told to. No smoke generations.

Outputs in `workdir`: `layout.json`, `generations.jsonl`; stage 3 `metrics.jsonl`,
`checkpoints/`, `hf/step_<n>/`; stage 4 `demonstrations/`, `warmup/`; stage 5
`executions/`, `metrics.jsonl`, `transitions.jsonl`, `dispatch.jsonl`, `checkpoints/`,
`cell_roles.png`, `steps.png`, `run_summary.json` (or `rollout_summary.json`); launch's
`jax_cache/` (compilation_cache_dir="auto"; run() itself sets no cache: the process's
entry point does, before its first compile).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

from gyrejax import preflight
from gyrejax.cells import Cell, split_into_cells
from gyrejax.config import Config, ConfigError
from gyrejax.distributed import rl as processes
from gyrejax.distributed.runtime import Decisions, local_cells, owner
from gyrejax.distributed.transport import MultiProcessTransport
from gyrejax.harness.sandbox import SandboxUnavailable, choose_sandbox
from gyrejax.loop import Runtime
from gyrejax.model import sharding
from gyrejax.model.build import build_model
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import Transformer, count_params
from gyrejax.stages import rollout_batch, warm_start
from gyrejax.train.loop import train_on_store
from gyrejax.train.trainer import ElasticTrainer


def run(config: Config, workdir: str) -> dict:
    """Runs every stage that exists; returns a summary (also written to `workdir`).

    Raises:
      ConfigError: the config does not fit the run's inputs or devices (checked before
        anything is built or written).
    """
    preflight.check(config, len(jax.devices()), jax.devices()[0].platform)
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    agents = not config.train.executions_dir and jax.process_index() == 0
    if agents:  # agent code will run here: harness.sandbox="bwrap" refuses to start
        try:  # without bubblewrap, before anything is built
            choose_sandbox(config.harness.sandbox)
        except SandboxUnavailable as e:  # "sandbox='bwrap': ..."
            raise ConfigError(f"config.harness.{e}") from e
    if agents and config.rl.agent == "command" and config.harness.agent_sandbox == "bwrap":
        try:
            choose_sandbox("bwrap")
        except SandboxUnavailable as e:
            raise ConfigError(
                f"config.harness.agent_{e}; or harness.agent_sandbox='none' to run the "
                "agent command unsandboxed (trusted agents only)"
            ) from e
    cells = split_into_cells(config.cells)
    logging.info("devices: %d %s", len(jax.devices()), jax.devices()[0].platform)
    for cell in cells:
        logging.info("%s", cell.describe())
    if jax.process_count() > 1:
        return _run_processes(config, out, cells)

    core = cells[0]
    start = time.perf_counter()
    model = build_model(config.model, core.mesh, config.rollout.sharding_rules)
    params = count_params(model)
    logging.info(
        "model: %d layers, hidden %d, %d params (%s), built in %.1f s",
        model.config.num_layers,
        model.config.hidden_size,
        params,
        model.config.dtype,
        time.perf_counter() - start,
    )
    layout = {
        "platform": jax.devices()[0].platform,
        "num_devices": len(jax.devices()),
        "cells": [
            {"index": c.index, "devices": [d.id for d in c.devices], "mesh": dict(c.mesh.shape)}
            for c in cells
        ],
        "model": {"num_params": params, "num_layers": model.config.num_layers},
    }
    (out / "layout.json").write_text(json.dumps(layout, indent=2))
    summary = {"layout": layout, "generations": _smoke_generations(config, core, model, out)}

    if config.train.executions_dir:  # offline: train on a stored set, nothing else
        summary["train"] = train_on_store(config, cells, model, out).summary()
        return summary
    trainer = None  # the job's one trainer, once a stage trains
    if config.warmup.steps:
        trainer = ElasticTrainer(model, core, rl=config.rl, train=config.train)
        model = warm_start(config, cells, model, out, trainer=trainer)
    if config.train.steps:  # RL with the configured scheduling policy
        if trainer is not None:
            trainer.begin_phase(rl=config.rl, train=config.train)
        summary["rl"] = Runtime(config, cells, model, out, trainer=trainer).run()
    else:  # evaluation only: one batch of executions
        summary["rollout"] = rollout_batch(config, cells, model, out)
    return summary


def _smoke_generations(config: Config, core: Cell, model: Transformer, out: Path) -> list:
    """Greedy decoding of `config.generate.prompts` -> `generations.jsonl`."""
    start = time.perf_counter()
    with jax.set_mesh(core.mesh), sharding.axis_rules(config.rollout.sharding_rules):
        results = generate(
            model,
            [list(p) for p in config.generate.prompts],
            max_new_tokens=config.generate.max_new_tokens,
            temperature=0.0,
        )
    elapsed = time.perf_counter() - start
    with open(out / "generations.jsonl", "w") as f:
        for prompt, result in zip(config.generate.prompts, results, strict=True):
            record = {
                "prompt_ids": list(prompt),
                "token_ids": result.token_ids,
                "logprobs": result.logprobs,
                "finish_reason": result.finish_reason,
            }
            f.write(json.dumps(record) + "\n")
            logging.info(
                "greedy %s -> %s (mean logprob %.3f)",
                list(prompt),
                result.token_ids,
                float(np.mean(result.logprobs)),
            )
    logging.info("generated %d sequences in %.1f s", len(results), elapsed)
    return [r.token_ids for r in results]


def _run_processes(config: Config, out: Path, cells: list[Cell]) -> dict:
    """This process's part of a multi-process job; returns a summary (process 0's has
    the run's summary, the others what they did)."""
    if not config.train.executions_dir and not config.train.steps:
        raise ConfigError(
            "config.train.steps=0: a multi-process job trains (RL with train.steps > 0, or "
            "a stored set with train.executions_dir); run a single rollout batch in one process"
        )
    process, leader = jax.process_index(), jax.process_index() == 0
    for cell in cells:
        owner(cell)  # raises if a cell spans processes
    mine = local_cells(cells)
    if not mine:
        raise ConfigError(f"process {process} holds no cell: check config.cells.size")
    logging.info(
        "process %d of %d: cells %s of %d",
        *(process, jax.process_count(), [c.index for c in mine], len(cells)),
    )
    if leader:
        layout = {
            "num_processes": jax.process_count(),
            "cells": [
                {"index": c.index, "process": owner(c), "devices": [d.id for d in c.devices]}
                for c in cells
            ],
        }
        (out / "layout.json").write_text(json.dumps(layout, indent=2))
    # Built on a cell of this process; identical in every process (same seed or checkpoint).
    model = build_model(config.model, mine[0].mesh, config.rollout.sharding_rules)

    if config.train.executions_dir:  # the store-training loop on process 0; the rest follow
        transport = MultiProcessTransport(cells, Decisions(), snapshot_dir=out / "snapshots")
        trainer = ElasticTrainer(
            model, cells[0], rl=config.rl, train=config.train, transport=transport
        )
        if not leader:
            for cell in mine:
                trainer.precompile(cell)
            return {"process": process, "steps_followed": processes.follow_until_stopped(trainer)}
        try:
            result = train_on_store(config, cells, model, out, trainer=trainer)
        finally:  # followers return from `follow` even if this process fails
            trainer.stop()
        return {"process": 0, "step": trainer.step, "last": result.last_metrics}

    start = Decisions("gyrejax/start", timeout_s=processes.FOLLOWER_TIMEOUT_S)
    # One engine token per run, drawn by process 0 before anything else is handed over;
    # the followers get its digest only.
    if leader:
        token = processes.share_engine_token(start)
    else:
        token_sha256 = processes.receive_engine_token_digest(start)
    trainer = None
    if leader and config.warmup.steps:  # on process 0's cells, then handed over
        trainer = ElasticTrainer(model, cells[0], rl=config.rl, train=config.train)
        model = warm_start(config, mine, model, out, trainer=trainer)
        processes.share_start_weights(model, out, start)
    elif leader:
        processes.announce_no_start_weights(start)
    else:
        model = processes.receive_start_weights(model, start)
    decisions = Decisions(timeout_s=processes.FOLLOWER_TIMEOUT_S)
    transport = MultiProcessTransport(cells, decisions, snapshot_dir=out / "snapshots")
    if trainer is None:
        trainer = ElasticTrainer(
            model, cells[0], rl=config.rl, train=config.train, transport=transport
        )
    else:
        trainer.begin_phase(rl=config.rl, train=config.train, transport=transport)
    if not leader:
        for cell in mine:  # idle until process 0 needs the engines anyway
            trainer.precompile(cell)
        weights_dir = processes.published_dir(out)
        return processes.serve_and_follow(
            config, cells, model, trainer, token_sha256=token_sha256, weights_dir=weights_dir
        )
    engines = processes.RemoteCellEngines(config.rollout, decisions, token)
    try:
        return Runtime(config, cells, model, out, trainer=trainer, cell_engines=engines).run()
    finally:  # followers stop serving and return even if this process fails
        trainer.stop()
